"""The client side of ``sbxnet scheduler status``: one ``GET /v1/sandboxes`` per refresh, over TLS with
the admin token, printed with ``status_table.render``."""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
import urllib.error
import urllib.request

from scheduler.status_table import render


def fetch(url: str, token: str, ctx: ssl.SSLContext, timeout: float = 5.0) -> list[dict[str, object]]:
    req = urllib.request.Request(url.rstrip("/") + "/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
        doc = json.loads(resp.read())
    rows = doc.get("sandboxes") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError("the answer has no sandboxes list")
    return rows


def status(args: argparse.Namespace) -> int:
    if args.token_file is None:
        print("scheduler status: --token-file (or SBXNET_SCHEDULER_TOKEN_FILE) is required", file=sys.stderr)
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
