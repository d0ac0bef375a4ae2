"""Replays every stored preamble fuzz seed through the fuzz target on every test run."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_preamble import one_input

SEEDS = Path(__file__).resolve().parent.parent / "seeds" / "preamble"
FILES = sorted(SEEDS.iterdir()) if SEEDS.is_dir() else []


def test_seed_corpus_is_there() -> None:
    assert len(FILES) >= 30, f"expected the preamble seed corpus under {SEEDS}"


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_seed(path: Path) -> None:
    one_input(path.read_bytes())
