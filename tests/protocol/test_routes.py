"""sbxnet/protocol/routes.py: the registration and route codecs both the scheduler and the gateway use."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.routes import (
    Forwarder,
    PortSpec,
    Route,
    RouteError,
    check_sandbox_id,
    pull_registration,
    pull_route,
    push_registration,
    push_route,
)

PIN = base64.b64encode(hashlib.sha256(b"spki").digest()).decode()
TOKEN = hashlib.sha256(b"secret").hexdigest()


def registration(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "incarnation": "2f9c1e6a",
        "forwarder": {"address": "10.0.3.7:8443", "spki_pin": PIN},
        "target_ip": "10.200.1.5",
        "default_port": 8080,
        "ports": {"8080": {"protocol": "http", "auth": "token"}, "22": {"protocol": "tcp", "auth": "public"}},
        "token_sha256": TOKEN,
        "idle_period_s": 300,
    }
    body.update(over)
    return {k: v for k, v in body.items() if v is not ...}


def enc(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_the_documented_registration_decodes() -> None:
    r = pull_registration(enc(registration()))
    assert r.forwarder == Forwarder("10.0.3.7", 8443, (PIN,))
    assert r.target_ip == ipaddress.ip_address("10.200.1.5")
    assert r.ports == {8080: PortSpec("http", "token"), 22: PortSpec("tcp", "public")}
    assert (r.default_port, r.token_sha256, r.idle_period_s, r.activity, r.connect_deadline_s) == (
        8080, TOKEN, 300.0, "bytes", 10.0
    )


def test_registration_round_trips_and_becomes_the_route_the_gateway_reads() -> None:
    r = pull_registration(enc(registration(activity="connections", connect_deadline_s=2.5)))
    assert pull_registration(push_registration(r)) == r
    route = r.route("sbx-1", "idle")
    back = pull_route(push_route(route))
    assert back == route
    assert back.port_spec(None) == PortSpec("http", "token")
    assert back.port_spec(22) == PortSpec("tcp", "public")
    assert back.port_spec(9999) is None
    assert "idle_period_s" not in json.loads(push_route(route))


def test_an_ipv6_forwarder_is_bracketed() -> None:
    r = pull_registration(enc(registration(forwarder={"address": "[fd00::7]:8443", "spki_pin": PIN})))
    assert r.forwarder.host == "fd00::7" and r.forwarder.address == "[fd00::7]:8443"
    assert pull_registration(push_registration(r)) == r


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"extra": 1}, "unknown_field"),
        ({"incarnation": ...}, "missing_field"),
        ({"incarnation": "a/b"}, "bad_incarnation"),
        ({"incarnation": ""}, "bad_incarnation"),
        ({"forwarder": {"address": "10.0.3.7", "spki_pin": PIN}}, "bad_address"),
        ({"forwarder": {"address": "fwd.example:8443", "spki_pin": PIN}}, "bad_address"),
        ({"forwarder": {"address": "fd00::7:8443", "spki_pin": PIN}}, "bad_address"),
        ({"forwarder": {"address": "10.0.3.7:0", "spki_pin": PIN}}, "bad_port"),
        ({"forwarder": {"address": "10.0.3.7:08443", "spki_pin": PIN}}, "bad_port"),
        ({"forwarder": {"address": "10.0.3.7:8443", "spki_pin": "short"}}, "bad_pin"),
        ({"forwarder": {"address": "10.0.3.7:8443", "spki_pin": PIN, "x": 1}}, "unknown_field"),
        ({"forwarder": "10.0.3.7:8443"}, "bad_type"),
        ({"target_ip": "sandbox.internal"}, "bad_ip"),
        ({"target_ip": 5}, "bad_type"),
        ({"default_port": 9090}, "default_port_not_exposed"),
        ({"default_port": True}, "bad_port"),
        ({"default_port": 70000}, "bad_port"),
        ({"ports": {}}, "bad_type"),
        ({"ports": {"+80": {"protocol": "http", "auth": "public"}}}, "bad_port"),
        ({"ports": {"8080": {"protocol": "ftp", "auth": "public"}}}, "bad_protocol"),
        ({"ports": {"8080": {"protocol": "http", "auth": "root"}}}, "bad_auth"),
        ({"ports": {"8080": {"protocol": "http", "auth": "client_cert"}}}, "bad_auth"),
        ({"ports": {"8080": {"protocol": "tcp", "auth": "token"}}}, "bad_auth"),
        ({"token_sha256": ...}, "no_token"),
        ({"token_sha256": TOKEN.upper()}, "bad_token_hash"),
        ({"idle_period_s": 0}, "bad_number"),
        ({"idle_period_s": "300"}, "bad_number"),
        ({"connect_deadline_s": 301}, "bad_number"),
        ({"activity": "pings"}, "bad_activity"),
    ],
)
def test_each_refusal_has_its_reason(over: dict[str, Any], reason: str) -> None:
    with pytest.raises(RouteError) as e:
        pull_registration(enc(registration(**over)))
    assert e.value.reason == reason


@pytest.mark.parametrize(
    ("data", "reason"),
    [(b"\xff", "not_json"), (b"[1]", "not_object"), (b'{"idle_period_s": NaN}', "not_json"), (b"{" * 5000, "not_json"),
     (b" " * 70000, "too_long")],
)
def test_bytes_that_are_not_a_json_object(data: bytes, reason: str) -> None:
    with pytest.raises(RouteError) as e:
        pull_registration(data)
    assert e.value.reason == reason


def test_route_answer_checks_its_own_fields() -> None:
    good = json.loads(push_route(pull_registration(enc(registration())).route("sbx-1", "active")))
    for key, value, reason in [("state", "asleep", "bad_state"), ("sandbox", "a.b", "bad_sandbox"),
                               ("idle_period_s", 3, "unknown_field")]:
        with pytest.raises(RouteError) as e:
            pull_route(enc({**good, key: value}))
        assert e.value.reason == reason


def test_sandbox_ids_are_reachable_host_name_labels() -> None:
    assert check_sandbox_id("sbx_1-a") == "sbx_1-a"
    assert check_sandbox_id("8080") == "8080" and check_sandbox_id("a" * 57)
    # Upper case (host names are case-insensitive), the port form, and labels over DNS's 63 with a port.
    for bad in ("", "a.b", "a" * 58, "é", None, "Sbx", "8080-web", "-x"):
        with pytest.raises(RouteError):
            check_sandbox_id(bad)


def test_push_refuses_a_route_it_could_not_read_back() -> None:
    r = pull_registration(enc(registration())).route("sbx-1", "active")
    bad = Route(**{**r.__dict__, "sandbox": "has.dot"})
    with pytest.raises(LocalProtocolError):
        push_route(bad)


@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_route_error(data: bytes) -> None:
    for pull in (pull_registration, pull_route):
        try:
            pull(data)
        except RouteError:
            pass


@given(st.dictionaries(st.sampled_from(sorted(registration())), st.none() | st.integers() | st.text(max_size=8),
                       max_size=4))
def test_mutated_fields_only_ever_raise_route_error(changes: dict[str, Any]) -> None:
    try:
        pull_registration(enc(registration(**changes)))
    except RouteError:
        pass


# -- a set of pins (issue 22 point 17: a forwarder's key rotated without cutting its host off) -------------

PIN_B = base64.b64encode(hashlib.sha256(b"next spki").digest()).decode()
PIN_C = base64.b64encode(hashlib.sha256(b"third spki").digest()).decode()


def pinned(**fwd: object) -> dict[str, Any]:
    return registration(forwarder={"address": "10.0.3.7:8443", **fwd})


def test_a_forwarder_is_pinned_by_a_set_written_sorted_once_each() -> None:
    r = pull_registration(enc(pinned(spki_pins=[PIN_B, PIN, PIN_B])))
    assert set(r.forwarder.spki_pins) == {PIN, PIN_B} and len(r.forwarder.spki_pins) == 2
    for body in (push_registration(r), push_route(r.route("sbx-1", "active"))):
        assert json.loads(body)["forwarder"] == {"address": "10.0.3.7:8443", "spki_pins": sorted([PIN, PIN_B])}
    # The order the platform gave does not matter: the same set is the same forwarder.
    assert pull_registration(enc(pinned(spki_pins=[PIN, PIN_B]))) == r


def test_the_single_pin_field_is_still_taken_and_comes_back_as_a_set_of_one() -> None:
    r = pull_registration(enc(pinned(spki_pin=PIN)))
    assert r.forwarder.spki_pins == (PIN,)
    assert r == pull_registration(enc(pinned(spki_pins=[PIN])))
    assert json.loads(push_registration(r))["forwarder"] == {"address": "10.0.3.7:8443", "spki_pins": [PIN]}
    route = json.loads(push_route(r.route("sbx-1", "active")))
    assert route["forwarder"]["spki_pins"] == [PIN] and "spki_pin" not in route["forwarder"]


@pytest.mark.parametrize(
    ("fwd", "reason"),
    [
        ({"spki_pins": [PIN], "spki_pin": PIN}, "bad_pin"),  # both: which one is meant?
        ({}, "missing_field"),
        ({"spki_pins": []}, "bad_pin"),
        ({"spki_pins": [PIN, PIN_B, PIN_C, PIN, PIN_B]}, "too_long"),  # five entries, even if three differ
        ({"spki_pins": PIN}, "bad_type"),
        ({"spki_pins": {"a": PIN}}, "bad_type"),
        ({"spki_pins": None}, "bad_type"),
        ({"spki_pins": [PIN, 7]}, "bad_type"),
        ({"spki_pins": [PIN, [PIN_B]]}, "bad_type"),
        ({"spki_pins": [PIN, "short"]}, "bad_pin"),
        ({"spki_pins": [PIN, PIN_B.rstrip("=")]}, "bad_pin"),
        ({"spki_pins": [PIN, PIN_B[:-2] + chr(ord(PIN_B[-2]) + 1) + "="]}, "bad_pin"),  # not canonical
        ({"spki_pins": [PIN, ""]}, "bad_pin"),
        ({"spki_pin": [PIN]}, "bad_type"),  # the single field takes one string
    ],
)
def test_each_refusal_of_the_pins_has_its_reason(fwd: dict[str, Any], reason: str) -> None:
    for pull, body in ((pull_registration, pinned(**fwd)),
                       (pull_route, {**json.loads(push_route(pull_registration(enc(registration())).route(
                           "sbx-1", "active"))), "forwarder": {"address": "10.0.3.7:8443", **fwd}})):
        with pytest.raises(RouteError) as e:
            pull(enc(body))
        assert e.value.reason == reason, (pull.__name__, fwd)


_SOME_PINS = [base64.b64encode(hashlib.sha256(bytes([i])).digest()).decode() for i in range(6)]


@given(st.lists(st.sampled_from(_SOME_PINS), min_size=1, max_size=4))
def test_any_one_to_four_pins_decode_to_their_set_and_round_trip(pins: list[str]) -> None:
    r = pull_registration(enc(pinned(spki_pins=pins)))
    assert r.forwarder.spki_pins == tuple(sorted(set(pins)))
    assert pull_registration(push_registration(r)) == r
    route = r.route("sbx-1", "active")
    assert pull_route(push_route(route)) == route
