"""``sbxnet forwarder``: placeholder, replaced as the forwarder lands."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with a [forwarder] table")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("forwarder: not built yet")
