"""The client side of ``sbxnet scheduler status``: one ``GET /v1/sandboxes`` per refresh, over TLS with
the admin token, printed with ``status_table.render``. Where to: the flags, else (``--config``) the
scheduler's own settings, else the environment (``resolve``)."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from scheduler.status_table import render


def fetch(url: str, token: str, ctx: ssl.SSLContext, timeout: float = 5.0) -> list[dict[str, object]]:
    req = urllib.request.Request(url.rstrip("/") + "/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
        doc = json.loads(resp.read())
    rows = doc.get("sandboxes") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError("the answer has no sandboxes list")
    return rows


DEFAULT_URL = "https://127.0.0.1:8700"


def api_url(host: str, port: int) -> str:
    """The URL to reach a scheduler listening on ``host``: a wildcard address is reached on loopback."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """Fill ``args.url``, ``args.ca_file`` and ``args.token_file``: a flag given wins; then, with
    ``--config``, the scheduler's own settings (its file and SBXNET_SCHEDULER_* environment, loaded as the
    daemon loads them); then SBXNET_SCHEDULER_URL, _CA_FILE and _TOKEN_FILE; then the default URL. Returns
    an error to print when the settings cannot be loaded."""
    config = getattr(args, "config", None)
    if config is not None:
        from sbxnet.config import load_settings
        from sbxnet.errors import SbxnetError
        from scheduler.settings import SchedulerSettings

        try:
            settings = load_settings(SchedulerSettings, section="scheduler", config_file=config)
        except (SbxnetError, OSError) as e:
            return f"cannot read the scheduler's settings from {config}: {getattr(e, 'detail', None) or e}"
        if args.url is None:
            args.url = api_url(str(settings.listen_host), settings.listen_port)
        if args.ca_file is None:
            args.ca_file = settings.ca_file
        if args.token_file is None:
            args.token_file = settings.admin_token_file
    if args.url is None:
        args.url = env.get("SBXNET_SCHEDULER_URL") or DEFAULT_URL
    if args.ca_file is None and env.get("SBXNET_SCHEDULER_CA_FILE"):
        args.ca_file = Path(env["SBXNET_SCHEDULER_CA_FILE"])
    if args.token_file is None and env.get("SBXNET_SCHEDULER_TOKEN_FILE"):
        args.token_file = Path(env["SBXNET_SCHEDULER_TOKEN_FILE"])
    return None


def status(args: argparse.Namespace) -> int:
    problem = resolve(args, os.environ)
    if problem is not None:
        print(f"scheduler status: {problem}", file=sys.stderr)
        return 2
    if args.token_file is None:
        print("scheduler status: --token-file (or admin_token_file in --config, or SBXNET_SCHEDULER_TOKEN_FILE) "
              "is required", file=sys.stderr)
        return 2
    try:
        token = args.token_file.read_text().strip()
    except OSError as e:
        print(f"scheduler status: cannot read {args.token_file}: {e.strerror}", file=sys.stderr)
        return 2
    if not token or any(not (0x21 <= ord(ch) <= 0x7E) for ch in token):
        # Never echo it: the file may hold something else secret.
        print(f"scheduler status: {args.token_file} must hold the token alone, on one line", file=sys.stderr)
        return 2
    ctx = ssl.create_default_context(cafile=str(args.ca_file) if args.ca_file else None)
    while True:
        try:
            rows = fetch(args.url, token, ctx)
        except urllib.error.HTTPError as e:
            print(f"scheduler status: {args.url} answered {e.code}: {e.read().decode(errors='replace').strip()}",
                  file=sys.stderr)
            return 1
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            print(f"scheduler status: cannot reach {args.url}: {reason}", file=sys.stderr)
            if not args.watch:
                return 1
            rows = None
        if rows is not None:
            text = json.dumps(rows, indent=2) + "\n" if args.json else render(rows, time.time())
            if args.watch:
                sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + args.url + "\n\n")
            sys.stdout.write(text)
            sys.stdout.flush()
        if not args.watch:
            return 0
        try:
            time.sleep(max(0.1, args.interval))
        except KeyboardInterrupt:
            return 0
