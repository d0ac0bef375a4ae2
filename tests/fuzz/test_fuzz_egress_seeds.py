"""Replays the stored seeds of the egress packet-core fuzz targets (rewrite, segment) on every run."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_rewrite import one_input as rewrite_input
from fuzz_segment import one_input as segment_input

SEEDS = Path(__file__).resolve().parent.parent / "seeds"
TARGETS = {"rewrite": rewrite_input, "segment": segment_input}
CASES = [(t, p) for t in TARGETS for p in sorted((SEEDS / t).iterdir())] if SEEDS.is_dir() else []


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_corpus_is_there_with_the_named_cases(target: str) -> None:
    names = {p.name for p in (SEEDS / target).iterdir()}
    assert len(names) >= 30
    assert any(n.startswith("csum-offset-into-ip-dst") for n in names)
    assert any(n.startswith("tcp-gso-on-udp") for n in names)


@pytest.mark.parametrize(("target", "path"), CASES, ids=[f"{t}/{p.name}" for t, p in CASES])
def test_seed(target: str, path: Path) -> None:
    TARGETS[target](path.read_bytes())
