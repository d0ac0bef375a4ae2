"""``sbxnet forwarder``: load settings, then serve (one process, or a supervisor and workers)."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file with a [forwarder] table")
    p.add_argument("--listen-port", type=int, help="overrides listen_port")
    p.add_argument("--metrics-port", type=int, help="overrides metrics_port (0 disables)")
    p.add_argument("--workers", type=int, help="overrides workers (0 = one per core)")
    p.add_argument("--data-plane", help="overrides data_plane")
    p.add_argument("--log-level", help="overrides log_level")
    p.add_argument("--check", action="store_true", help="validate the settings and certificates, then exit")
    p.add_argument(
        "--takeover", type=Path, metavar="SOCKET",
        help="take the listening socket over from the forwarder serving the control socket SOCKET (its "
             "takeover_socket), then serve that control socket for the next upgrade",
    )
    p.epilog = (
        "Settings come from (highest first) these flags, SBXNET_FORWARDER_* environment variables "
        "(lists comma-separated), the [forwarder] table of --config, and defaults. See docs/forwarder.md."
    )


def run(args: argparse.Namespace) -> int:
    from forwarder.ingress.settings import ForwarderSettings
    from sbxnet.config import load_settings

    settings = load_settings(
        ForwarderSettings,
        section="forwarder",
        config_file=args.config,
        overrides={
            "listen_port": args.listen_port,
            "metrics_port": args.metrics_port,
            "workers": args.workers,
            "data_plane": args.data_plane,
            "log_level": args.log_level,
            "takeover_socket": args.takeover,
        },
    )
    from forwarder.ingress.run import serve

    return serve(settings, check_only=args.check, takeover=args.takeover is not None)
