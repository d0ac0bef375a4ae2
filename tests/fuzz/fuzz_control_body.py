"""Fuzz target for the egress control API's request parser (forwarder/egress/router/control_body.py).

The first byte of ``data`` says what the rest is: ``A`` an arm body (``pull_arm``, claim id ``c1``), ``E``
an exit body (``pull_exit``), ``I`` an import body (``pull_import``), ``C`` a claim id from a URL
(``check_claim_id``, the rest as Latin-1 text); any other first byte, or none, an arm body of all of
``data``. ``classify(data)`` is the outcome: "ok" or the ``ControlError`` reason (seed names are
``<expected>-<what>``).

Invariant: each parser returns a value or raises ``ControlError`` with a reason from its docstring's list,
nothing else. A value re-encodes to a body that parses back to an equal value, and it means what the JSON
said: every field the body gave has the same value in the re-encoded form (addresses compared as
addresses, a number never a bool), and the fields it left out have their defaults.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from forwarder.egress.router.claims import ClaimState, LimitsSpec, PolicySpec
from forwarder.egress.router.control_body import (
    ControlError,
    check_claim_id,
    pull_arm,
    pull_exit,
    pull_import,
    push_state,
)

REASONS = {"too_long", "not_utf8", "not_json", "not_object", "unknown_field", "missing_field", "bad_field",
           "bad_claim_id"}
DEFAULTS: dict[str, Any] = {"policy": PolicySpec().model_dump(mode="json"),
                            "limits": LimitsSpec().model_dump(mode="json"), "enabled": True, "quota_used": 0,
                            "address": None}


def _same(sent: Any, canon: Any, where: str) -> None:
    if isinstance(sent, dict) and isinstance(canon, dict):
        for key in sent.keys() | canon.keys():
            if key in sent:
                _same(sent[key], canon.get(key, ...), f"{where}.{key}")
        return
    if where.endswith(".address") and sent is not None:
        sent, canon = ipaddress.IPv4Address(sent), ipaddress.IPv4Address(canon)
    if sent != canon or type(sent) is bool or type(canon) is bool:
        if type(sent) is bool and type(canon) is bool and sent == canon:
            return
        raise AssertionError(f"{where}: the body said {sent!r}, the value says {canon!r}")


def _defaults(sent: dict[str, Any], canon: dict[str, Any]) -> None:
    for key, value in DEFAULTS.items():
        if key in canon and key not in sent and canon[key] != value:
            raise AssertionError(f"{key} was not in the body and is not its default: {canon[key]!r}")


def _parse(kind: bytes, body: bytes) -> object:
    if kind == b"E":
        label = pull_exit(body)
        if pull_exit(json.dumps({"exit": label}).encode()) != label:
            raise AssertionError(f"exit {label!r} does not round-trip")
        if json.loads(body)["exit"] != label:
            raise AssertionError("the label is not the body's")
        return label
    if kind == b"C":
        text = body.decode("latin-1")
        return check_claim_id(text)
    if kind == b"I":
        st = pull_import(body)
        again = push_state(st)
        if pull_import(again) != st or push_state(pull_import(again)) != again:
            raise AssertionError(f"{st!r} does not round-trip")
        sent, canon = json.loads(body), json.loads(again)
        _same(sent, canon, "(body)")
        _defaults(sent, canon)
        return st
    req = pull_arm("c1", body)
    canon = req.model_dump(mode="json")
    sent = json.loads(body)
    _same(sent, canon, "(body)")
    _defaults(sent, canon)
    again = json.dumps({k: v for k, v in canon.items() if k not in ("id", "address")}).encode()
    if pull_arm("c1", again) != req:
        raise AssertionError(f"{req!r} does not round-trip")
    if not isinstance(ClaimState(**req.model_dump(exclude={"address"}), address="100.64.0.2"), ClaimState):
        raise AssertionError("an armed request is not a claim state")
    return req


def _split(data: bytes) -> tuple[bytes, bytes]:
    if data[:1] in (b"A", b"E", b"I", b"C"):
        return data[:1], data[1:]
    return b"A", data


def classify(data: bytes) -> str:
    kind, body = _split(data)
    try:
        _parse(kind, body)
    except ControlError as e:
        return e.reason
    return "ok"


def one_input(data: bytes) -> None:
    kind, body = _split(data)
    try:
        _parse(kind, body)
    except ControlError as e:
        if e.reason not in REASONS or not e.detail or "\n" in e.detail or e.status != 400:
            raise AssertionError(f"bad refusal {e.reason!r} {e.detail!r}") from None


if __name__ == "__main__":
    import sys

    for path in sys.argv[1:]:
        with open(path, "rb") as f:
            one_input(f.read())
