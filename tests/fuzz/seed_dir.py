"""Writes a seed corpus directory for the make_*_seeds.py scripts: the directory emptied, one file per
seed, and a line saying how many went where."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def write_seeds(out: Path, seeds: Mapping[str, bytes]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    for name, data in seeds.items():
        (out / name).write_bytes(data)
    print(f"{len(seeds)} seeds in {out}")
