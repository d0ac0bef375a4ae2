"""Fuzz target for the route codecs (sbxnet/protocol/routes.py): ``one_input(data)``.

The first byte of ``data`` says what the rest is: ``R`` (0x52) the scheduler's answer to a route lookup
(``pull_route``), any other byte the platform's registration body (``pull_registration``; the seeds use
``P``). No first byte at all is an empty registration body. ``classify(data)`` is that parser's outcome:
"ok" or the ``RouteError`` reason (seed names are ``<expected>-<what>``).

Invariant: both parsers, on the rest and on the whole of ``data``, return a value or raise ``RouteError``,
nothing else. A returned ``Registration`` re-encodes (``push_registration``) to bytes that parse back to an
equal value and re-encode to the same bytes; a ``Route`` likewise through ``push_route``. And the value
means what the JSON said: every field the body gave (but a null ``token_sha256``, which is no token) has
the same value in the re-encoded JSON, IP addresses compared as addresses, since only their spelling may
change; fields it left out take their documented defaults. The forwarder's pins (``spki_pin``, one, or
``spki_pins``, a list) re-encode as ``spki_pins``: the same set, sorted, each once.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from typing import Any

from sbxnet.protocol.routes import (
    DEFAULT_CONNECT_DEADLINE_S,
    Registration,
    Route,
    RouteError,
    pull_registration,
    pull_route,
    push_registration,
    push_route,
)

ROUTE = b"R"
DEFAULTS: dict[str, Any] = {"connect_deadline_s": DEFAULT_CONNECT_DEADLINE_S, "activity": "bytes"}


def _address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, _, port = text.rpartition(":")
    return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")), int(port)


def _pins_sent(forwarder: dict[str, Any]) -> set[str]:
    return {forwarder["spki_pin"]} if "spki_pin" in forwarder else set(forwarder["spki_pins"])


def _same_meaning(sent: dict[str, Any], canonical: dict[str, Any]) -> None:
    for key in sent.keys() | canonical.keys():
        if key == "token_sha256" and sent.get(key) is None:
            if key in canonical:
                raise AssertionError("a body without a token re-encodes with one")
            continue
        if key not in sent:
            if canonical[key] != DEFAULTS.get(key, ...):
                raise AssertionError(f"{key} was not in the body and is not its default: {canonical[key]!r}")
            continue
        a, b = sent[key], canonical.get(key, ...)
        if key == "target_ip":
            a, b = ipaddress.ip_address(a), ipaddress.ip_address(b)
        elif key == "forwarder":
            a = {"address": _address(a["address"]), "pins": _pins_sent(a)}
            pins = b["spki_pins"]
            if pins != sorted(set(pins)) or set(b) != {"address", "spki_pins"}:
                raise AssertionError(f"the pins re-encode unsorted, repeated or under another field: {b!r}")
            b = {"address": _address(b["address"]), "pins": set(pins)}
        if a != b or type(a) is bool or type(b) is bool:  # True == 1: a bool must never pass for a number
            raise AssertionError(f"{key}: the body said {a!r}, the re-encoded value says {b!r}")


def _round_trip(value: Registration | Route, body: bytes) -> None:
    # push_* raise LocalProtocolError (not caught: a failure) if the value cannot be sent on.
    if isinstance(value, Route):
        again = push_route(value)
        same = pull_route(again) == value and push_route(pull_route(again)) == again
    else:
        again = push_registration(value)
        same = pull_registration(again) == value and push_registration(pull_registration(again)) == again
    if not same:
        raise AssertionError(f"{value!r} does not round-trip")
    _same_meaning(json.loads(body.decode("utf-8")), json.loads(again))


def parse(body: bytes, pull: Callable[[bytes], Registration | Route]) -> str:
    try:
        value = pull(body)
    except RouteError as e:
        if not isinstance(e.reason, str) or not e.reason:
            raise AssertionError(f"a RouteError without a reason: {e!r}") from None
        return e.reason
    if not isinstance(value, Route | Registration):
        raise AssertionError(f"not a Route or Registration: {value!r}")
    _round_trip(value, body)
    return "ok"


def classify(data: bytes) -> str:
    return parse(data[1:], pull_route if data[:1] == ROUTE else pull_registration)


def one_input(data: bytes) -> None:
    for body in (data[1:], data):
        parse(body, pull_registration)
        parse(body, pull_route)


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
