"""The control API's body parser (control_body.py), untrusted input: hypothesis properties over valid
bodies (always accepted, meaning kept), bodies mutated field by field (accepted or refused with a listed
reason, never anything else), and arbitrary bytes; the invariants are the fuzz target's
(tests/fuzz/fuzz_control_body.py), whose seeds tests/fuzz/test_seed_replay.py replays."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))
import fuzz_control_body

from forwarder.egress.router.control_body import ControlError, pull_arm, pull_import

rules = st.lists(st.sampled_from(["deny tcp any 25", "allow udp 8.8.8.8/32 53", "deny any", "allow icmp any"]),
                 max_size=4)
positive = st.one_of(st.integers(1, 10**12), st.floats(1e-3, 1e12, allow_nan=False))
limits = st.fixed_dictionaries({}, optional={"byte_rate": positive, "packet_rate": positive, "byte_burst": positive,
                                            "packet_burst": positive, "quota_bytes": st.integers(0, 2**63 - 1)})
policy = st.fixed_dictionaries({}, optional={"rules": rules, "default_allow": st.booleans()})
uds = st.from_regex(r"/[a-z0-9_][a-z0-9_.]{0,39}(/[a-z0-9_][a-z0-9_.]{0,19}){0,2}", fullmatch=True)
arm = st.fixed_dictionaries({"uds": uds, "exit": st.text(min_size=1, max_size=64)},
                            optional={"policy": policy, "limits": limits})
state = st.builds(
    lambda a, cid, addr, en, used: {**a, "id": cid, "address": addr, "enabled": en, "quota_used": used},
    arm, st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True),
    st.integers(0, 2**32 - 1).map(lambda n: f"{n >> 24}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"),
    st.booleans(), st.integers(0, 2**63 - 1))
junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                 st.text(max_size=20), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5),
                                                                                          st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(arm)
def test_every_valid_arm_body_is_accepted_and_means_what_it_said(body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    assert fuzz_control_body.classify(b"A" + data) == "ok"
    fuzz_control_body.one_input(b"A" + data)
    req = pull_arm("c1", data)
    assert (str(req.uds), req.exit) == (body["uds"], body["exit"]) and req.address is None


@settings(max_examples=300, deadline=None)
@given(state)
def test_every_valid_import_body_is_accepted_and_round_trips(body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    assert fuzz_control_body.classify(b"I" + data) == "ok"
    fuzz_control_body.one_input(b"I" + data)
    assert str(pull_import(data).address) == body["address"]


def _mutate(body: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node.get(key, {}), dict) else node
    node[path[-1]] = value
    return out


FIELDS = [["uds"], ["exit"], ["policy"], ["limits"], ["policy", "rules"], ["policy", "default_allow"],
          ["limits", "byte_rate"], ["limits", "quota_bytes"], ["address"], ["enabled"], ["quota_used"], ["id"],
          ["colour"], ["limits", "colour"]]


@settings(max_examples=600, deadline=None)
@given(st.sampled_from([b"A", b"I"]), state, st.sampled_from(FIELDS), junk, st.booleans())
def test_a_body_with_one_field_changed_is_accepted_or_refused_with_its_reason(
        kind: bytes, body: dict[str, Any], field: list[str], value: Any, drop: bool) -> None:
    if kind == b"A":
        body = {k: v for k, v in body.items() if k not in ("id", "address", "enabled", "quota_used")}
    changed = _mutate(body, field, value)
    if drop:
        changed.pop(field[0], None)
    data = kind + json.dumps(changed).encode()
    fuzz_control_body.one_input(data)  # raises on anything but a value or a listed refusal
    outcome = fuzz_control_body.classify(data)
    assert outcome == "ok" or outcome in fuzz_control_body.REASONS
    if kind == b"A" and field[0] in ("address", "id", "colour", "enabled", "quota_used") and not drop:
        assert outcome == "unknown_field"


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([b"A", b"E", b"I", b"C", b""]), st.binary(max_size=200))
def test_arbitrary_bytes_never_break_the_parser(kind: bytes, data: bytes) -> None:
    fuzz_control_body.one_input(kind + data)


def test_refusals_name_the_field() -> None:
    with pytest.raises(ControlError) as e:
        pull_arm("c1", json.dumps({"uds": "/x", "exit": "a", "limits": {"byte_rate": "9"}}).encode())
    assert (e.value.reason, e.value.detail.split(":")[0]) == ("bad_field", "limits.byte_rate")
