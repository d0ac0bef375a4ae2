"""``sbxnet egress``: load settings and claims, then run the router daemon; ``sbxnet egress claims ...``
speaks to a running one's control API."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file with an [egress] table")
    p.add_argument("--claims-file", help="overrides claims_file (JSON claims armed at start)")
    p.add_argument("--port", type=int, help="overrides port (VXLAN UDP port)")
    p.add_argument("--log-level", help="overrides log_level")
    p.add_argument("--check", action="store_true", help="validate the settings and claims, then exit")
    p.epilog = (
        "Settings come from (highest first) these flags, SBXNET_EGRESS_* environment variables "
        "(lists comma-separated), the [egress] table of --config, and defaults. See docs/egress.md."
    )
    sub = p.add_subparsers(dest="egress_command", metavar="claims")
    c = sub.add_parser("claims", help="the running daemon's claims, through its control API (root only)")
    c.add_argument("--socket", type=Path, help="the control socket (default: the control_socket setting)")
    verbs = c.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser("list", help="every armed claim")
    for verb, what in (("show", "one claim"), ("disarm", "disarm, releasing its address"),
                       ("disable", "revoke its packet path at once"), ("enable", "reopen it"),
                       ("export", "print its state for an import elsewhere and disarm it here")):
        verbs.add_parser(verb, help=what).add_argument("id")
    arm = verbs.add_parser("arm", help="arm a claim; the allocator gives its address")
    arm.add_argument("id")
    arm.add_argument("--uds", required=True, help="the VMM's vsock socket path (the stream is <uds>_2051)")
    arm.add_argument("--exit", required=True, help="the exit label")
    arm.add_argument("--policy", help='JSON, e.g. {"rules": ["deny tcp any 25"], "default_allow": true}')
    arm.add_argument("--limits", help='JSON, e.g. {"byte_rate": 12500000, "quota_bytes": 10000000000}')
    ex = verbs.add_parser("exit", help="send the claim through another exit")
    ex.add_argument("id")
    ex.add_argument("label")
    imp = verbs.add_parser("import", help="arm an exported claim (a file, or - for stdin)")
    imp.add_argument("file")
    ann = verbs.add_parser("announce", help="a gratuitous ARP for every claim now (run after an exit reloads)")
    ann.add_argument("--exit", dest="label", help="only the claims sent through this exit")


def _request(args: argparse.Namespace) -> tuple[str, str, Any]:
    v = args.verb
    if v == "list":
        return "GET", "/v1/claims", None
    if v == "announce":
        return "POST", "/v1/announce" if args.label is None else f"/v1/exits/{args.label}/announce", None
    url = f"/v1/claims/{getattr(args, 'id', '')}"
    if v == "show":
        return "GET", url, None
    if v == "disarm":
        return "DELETE", url, None
    if v in ("disable", "enable", "export"):
        return "POST", f"{url}/{v}", None
    if v == "exit":
        return "PUT", f"{url}/exit", {"exit": args.label}
    if v == "arm":
        body: dict[str, Any] = {"uds": args.uds, "exit": args.exit}
        for name in ("policy", "limits"):
            text = getattr(args, name)
            if text is not None:
                body[name] = json.loads(text)
        return "PUT", url, body
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    return "POST", "/v1/import", json.loads(text)


def _claims(args: argparse.Namespace) -> int:
    from forwarder.egress.router.control_client import call

    path = args.socket
    if path is None:
        from forwarder.egress.router.settings import EgressSettings
        from sbxnet.config import load_settings

        path = load_settings(EgressSettings, section="egress", config_file=args.config).control_socket
        if path is None:
            print("egress claims: no --socket and no control_socket setting", file=sys.stderr)
            return 2
    try:
        method, url, body = _request(args)
    except (OSError, ValueError) as e:
        print(f"egress claims: {e}", file=sys.stderr)
        return 2
    try:
        status, answer = call(path, method, url, body)
    except OSError as e:
        print(f"egress claims: cannot reach {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    if 200 <= status < 300:
        print(json.dumps(answer, indent=1))
        return 0
    err = answer if isinstance(answer, dict) else {}
    print(f"egress claims: {status} {err.get('error', '?')}: {err.get('detail', '')}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    if getattr(args, "egress_command", None) == "claims":
        return _claims(args)
    from forwarder.egress.router.claims import Known, load_claims
    from forwarder.egress.router.settings import EgressSettings
    from sbxnet.config import load_settings

    settings = load_settings(
        EgressSettings,
        section="egress",
        config_file=args.config,
        overrides={"claims_file": args.claims_file, "port": args.port, "log_level": args.log_level},
    )
    claims = []
    if settings.claims_file is not None:
        claims = load_claims(settings.claims_file, Known(settings.overlay, frozenset(settings.exit_specs())))
    from forwarder.egress.router.daemon import serve

    return serve(settings, claims, check_only=args.check)
