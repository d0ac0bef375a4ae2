"""Replays the egress fuzz seed corpora on every run and checks each seed's named outcome.

Seeds live in tests/seeds/{egress_frames,vxlan,arp}/ (regenerate with tests/fuzz/make_proto_seeds.py);
a seed named ``<expected>-<what>`` must make the target's ``classify`` return ``expected`` ("ok" or a
refusal reason). A short random smoke run of each target follows; the long run is bench/fuzz_egress.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parent.parent
TARGETS = {"egress_frames": "fuzz_egress_frames", "vxlan": "fuzz_vxlan", "arp": "fuzz_arp"}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_egress_{name}", TESTS / "fuzz" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODULES = {corpus: _load(mod) for corpus, mod in TARGETS.items()}
SEEDS = [(corpus, p) for corpus in TARGETS for p in sorted((TESTS / "seeds" / corpus).glob("*"))]


@pytest.mark.parametrize("corpus", list(TARGETS))
def test_corpus_is_there(corpus: str) -> None:
    assert len(list((TESTS / "seeds" / corpus).glob("*"))) >= 10, f"seed corpus tests/seeds/{corpus}"


@pytest.mark.parametrize(("corpus", "path"), SEEDS, ids=[f"{c}/{p.name}" for c, p in SEEDS])
def test_seed(corpus: str, path: Path) -> None:
    mod = MODULES[corpus]
    data = path.read_bytes()
    mod.one_input(data)
    assert mod.classify(data) == path.name.split("-")[0]


def test_required_seeds_present() -> None:
    names = {p.name for c, p in SEEDS if c == "egress_frames"}
    assert any(n.startswith("bad_csum_start-aimed-at-ip") for n in names)
    assert "gso_proto_mismatch-tcpv4-on-udp" in names


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(TARGETS)), st.binary(max_size=120))
def test_targets_on_random_bytes(corpus: str, data: bytes) -> None:
    MODULES[corpus].one_input(data)
