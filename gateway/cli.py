"""``sbxnet gateway``: load settings, then serve (one process, or a supervisor and workers)."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file with a [gateway] table")
    p.add_argument("--listen-port", type=int, help="overrides listen_port")
    p.add_argument("--metrics-port", type=int, help="overrides metrics_port (0 disables)")
    p.add_argument("--workers", type=int, help="overrides workers (0 = one per core)")
    p.add_argument("--log-level", help="overrides log_level")
    p.add_argument("--check", action="store_true", help="validate the settings, certificates and routes, then exit")
    p.epilog = (
        "Settings come from (highest first) these flags, SBXNET_GATEWAY_* environment variables "
        "(lists comma-separated), the [gateway] table of --config, and defaults. See docs/gateway.md."
    )


def run(args: argparse.Namespace) -> int:
    from gateway.settings import GatewaySettings
    from sbxnet.config import load_settings

    settings = load_settings(
        GatewaySettings,
        section="gateway",
        config_file=args.config,
        overrides={"listen_port": args.listen_port, "metrics_port": args.metrics_port, "workers": args.workers,
                   "log_level": args.log_level},
    )
    from gateway.run import serve

    return serve(settings, check_only=args.check)
