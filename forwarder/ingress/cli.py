"""``sbxnet forwarder``: load settings, then serve (one process, or a supervisor and workers)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ALLOCATOR = "malloc"  # PYTHONMALLOC for the forwarder unless its environment names one (docs/forwarder.md, Memory)


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


def _started_as_command() -> bool:
    """Whether this process is ``sbxnet ...`` or ``python -m sbxnet.app.cli ...`` (not a caller's own process
    that called ``run``: that one is never replaced)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (spec is not None and spec.name == "sbxnet.app.cli") or Path(sys.argv[0]).name == "sbxnet"


def use_malloc() -> None:
    """Start again, the same command and the same PID, under glibc's malloc (``PYTHONMALLOC=malloc``) unless
    the environment names an allocator already. With Python's own allocator a few objects that outlive a
    wave of tunnels each keep a whole 1 MiB arena, and the memory is not given back after the tunnels close;
    under malloc, ``malloc_trim`` returns it. Done first, before any socket or thread exists; workers inherit
    the environment."""
    if "PYTHONMALLOC" in os.environ or not _started_as_command():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "PYTHONMALLOC": ALLOCATOR})


def run(args: argparse.Namespace) -> int:
    use_malloc()
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
