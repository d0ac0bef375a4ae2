"""``sbxnet demo``: placeholder until the forwarder lands (see docs/architecture.md)."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=16, help="MiB to move each way")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("demo: not built yet")
