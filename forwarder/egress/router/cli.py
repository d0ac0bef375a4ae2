"""``sbxnet egress``: load settings and claims, then run the router daemon."""

from __future__ import annotations

import argparse
from pathlib import Path


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


def run(args: argparse.Namespace) -> int:
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
