"""``sbxnet scheduler``: run the reference scheduler; ``sbxnet scheduler status``: print its sandboxes."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file with a [scheduler] table")
    p.add_argument("--listen-port", type=int, help="overrides listen_port")
    p.add_argument("--metrics-port", type=int, help="overrides metrics_port (0 disables)")
    p.add_argument("--database", help="overrides database (sqlite:///path or postgresql://...)")
    p.add_argument("--log-level", help="overrides log_level")
    p.add_argument("--check", action="store_true", help="validate the settings, certificates and store, then exit")
    p.epilog = (
        "Settings come from (highest first) these flags, SBXNET_SCHEDULER_* environment variables "
        "(lists comma-separated), the [scheduler] table of --config, and defaults. See docs/scheduler.md."
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    st = sub.add_parser("status", help="print each sandbox's state, activity, bytes and time to idle",
                        description="print each sandbox's state, activity, bytes and time to idle")
    st.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                    help="the scheduler's own TOML file (with its SBXNET_SCHEDULER_* environment, as the daemon "
                         "reads them): the API address from listen_host and listen_port, the CA from ca_file, "
                         "the token from admin_token_file; the flags below override each")
    st.add_argument("--url", help="the scheduler (default: from --config, else $SBXNET_SCHEDULER_URL, else "
                                  "https://127.0.0.1:8700)")
    st.add_argument("--ca-file", type=Path,
                    help="CA the scheduler's certificate chains to (default: ca_file of --config, else "
                         "$SBXNET_SCHEDULER_CA_FILE)")
    st.add_argument("--token-file", type=Path,
                    help="file holding the admin token (default: admin_token_file of --config, else "
                         "$SBXNET_SCHEDULER_TOKEN_FILE)")
    st.add_argument("--watch", action="store_true", help="refresh until interrupted")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    st.add_argument("--json", action="store_true", help="print the rows as JSON instead")


def run(args: argparse.Namespace) -> int:
    if args.action == "status":
        from scheduler.status_cli import status

        return status(args)
    from sbxnet.config import load_settings
    from scheduler.settings import SchedulerSettings

    settings = load_settings(
        SchedulerSettings,
        section="scheduler",
        config_file=args.config,
        overrides={"listen_port": args.listen_port, "metrics_port": args.metrics_port,
                   "database": args.database, "log_level": args.log_level},
    )
    from scheduler.run import serve

    return serve(settings, check_only=args.check)
