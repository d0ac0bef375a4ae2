"""``sbxnet bench``: the staged throughput benchmark (issue 13). Import-light: the work is in ``run``."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", dest="mode", action="store_const", const="quick", default="full",
                   help="every arm once on small transfers (under 2 minutes on 2 cores): proves the tool works, "
                        "its figures mean nothing")
    p.add_argument("--full", dest="mode", action="store_const", const="full", help="the figures (the default)")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="directory for bench.json, bench.md and bench.png (default ./bench-out)")
    p.add_argument("--arms", help="comma-separated arm keys, in this order (default: all; see --list)")
    p.add_argument("--workloads", help="comma-separated workload keys (default: all; see --list)")
    p.add_argument("--repeats", type=int, help="repetitions (default: the mode's)")
    p.add_argument("--mib", type=int, help="MiB per bulk trial, split over the connections (default: the mode's)")
    p.add_argument("--budget", type=float, help="seconds: start no trial after this long (those left are listed "
                   "as not run); the results so far are written")
    p.add_argument("--keep", action="store_true", help="keep the working directory (configs, logs)")
    p.add_argument("--list", action="store_true", help="list the arms and workloads and exit")


def run(args: argparse.Namespace) -> int:
    from sbxnet.app.bench.run import main

    return main(args)
