"""Regenerates the route-codec seed corpus under tests/seeds/routes/ (run by hand; the files are committed).

Each seed is what ``fuzz_routes.one_input`` takes: ``P`` and a registration body (``PUT /v1/sandboxes/{id}``)
or ``R`` and a route answer (``GET /v1/routes/{id}``); each is named ``<expected>-<what>``: ``ok`` or the
reason ``RouteError`` gives (the replay checks the name with ``fuzz_routes.classify``). The golden bodies
are docs/scheduler-api.md's example. ``REGRESSIONS`` holds bodies that routes.py once did not answer with a
``RouteError`` or a value that round-trips, named for the answer it gives now.
Usage: .venv/bin/python tests/fuzz/make_routes_seeds.py
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from seed_dir import write_seeds

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "seeds" / "routes"

REGISTRATION, ROUTE = b"P", b"R"
MAX_BODY = 64 * 1024  # routes.MAX_BODY, written out: the seeds are to test it
PIN = base64.b64encode(hashlib.sha256(b"spki").digest()).decode()
PIN_NEXT = base64.b64encode(hashlib.sha256(b"next spki").digest()).decode()
PIN_THIRD = base64.b64encode(hashlib.sha256(b"third spki").digest()).decode()
TOKEN = hashlib.sha256(b"secret").hexdigest()
DROP = object()  # a field to leave out

GOLDEN: dict[str, Any] = {
    "incarnation": "2f9c1e6a",
    "forwarder": {"address": "10.0.3.7:8443", "spki_pins": [PIN]},
    "target_ip": "10.200.1.5",
    "default_port": 8080,
    "ports": {"8080": {"protocol": "http", "auth": "token"}, "22": {"protocol": "tcp", "auth": "public"}},
    "token_sha256": TOKEN,
    "idle_period_s": 300,
    "activity": "bytes",
    "connect_deadline_s": 10,
}
# The route is the registration minus the idle timer's fields, plus the sandbox and its state.
GOLDEN_ROUTE: dict[str, Any] = {"sandbox": "sbx-1", "state": "active",
                                **{k: v for k, v in GOLDEN.items() if k not in ("idle_period_s", "activity")}}
PUBLIC_PORTS = {"8080": {"protocol": "http", "auth": "public"}}


def _with(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = {**base, **over}
    return {k: v for k, v in out.items() if v is not DROP}


def reg(**over: Any) -> bytes:
    return REGISTRATION + json.dumps(_with(GOLDEN, over)).encode()


def route(**over: Any) -> bytes:
    return ROUTE + json.dumps(_with(GOLDEN_ROUTE, over)).encode()


def fwd(address: object = "10.0.3.7:8443", pin: object = PIN) -> dict[str, Any]:
    return {"address": address, "spki_pin": pin}


def pins(*values: object) -> dict[str, Any]:
    """A forwarder pinned by a set (``spki_pins``), as the platform registers one during a key rotation."""
    return {"address": "10.0.3.7:8443", "spki_pins": list(values)}


def port(protocol: object = "http", auth: object = "public", number: str = "8080", **extra: Any) -> dict[str, Any]:
    """``ports`` with one port; a token port keeps the golden token."""
    return {"ports": {number: {"protocol": protocol, "auth": auth, **extra}}}


def padded(body: bytes, size: int) -> bytes:
    """``body`` (with its first byte) grown with trailing JSON whitespace to ``size`` bytes after that byte."""
    return body + b" " * (size - len(body) + 1)


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    # -- accepted -----------------------------------------------------------------------------------
    out["ok-registration-golden-as-documented"] = REGISTRATION + json.dumps(GOLDEN, indent=2).encode()
    out["ok-registration-golden-compact"] = REGISTRATION + json.dumps(GOLDEN, separators=(",", ":")).encode()
    out["ok-route-golden"] = ROUTE + json.dumps(GOLDEN_ROUTE, sort_keys=True, separators=(",", ":")).encode()
    out["ok-registration-required-fields-only"] = reg(token_sha256=DROP, activity=DROP, connect_deadline_s=DROP,
                                                      **port())
    out["ok-route-required-fields-only"] = route(token_sha256=DROP, connect_deadline_s=DROP, **port())
    out["ok-registration-ipv6-forwarder-and-target"] = reg(forwarder=fwd("[fd00::7]:8443"), target_ip="fd00:200::5")
    out["ok-route-ipv6-spelled-long"] = route(forwarder=fwd("[FD00:0000::0007]:8443"),
                                              target_ip="fd00:200:0:0:0:0:0:5")
    out["ok-registration-ipv4-mapped-target"] = reg(target_ip="::ffff:10.200.1.5")
    out["ok-registration-activity-connections"] = reg(activity="connections")
    out["ok-registration-every-protocol-and-auth"] = reg(ports={
        "80": {"protocol": "http", "auth": "public"}, "8080": {"protocol": "http", "auth": "token"},
        "50051": {"protocol": "h2c", "auth": "token"}, "50052": {"protocol": "h2c", "auth": "public"},
        "22": {"protocol": "tcp", "auth": "public"}, "5432": {"protocol": "tcp", "auth": "client_cert"}})
    out["ok-registration-64-ports"] = reg(default_port=1, token_sha256=DROP, ports={
        str(p): {"protocol": "tcp", "auth": "public"} for p in range(1, 65)})
    out["ok-registration-port-65535"] = reg(default_port=65535, **port(number="65535"))
    out["ok-registration-token-null-with-public-ports"] = reg(token_sha256=None, **port())
    out["ok-registration-numbers-at-their-caps"] = reg(connect_deadline_s=300, idle_period_s=86400 * 365)
    out["ok-registration-smallest-positive-numbers"] = reg(connect_deadline_s=5e-324, idle_period_s=5e-324)
    out["ok-registration-float-numbers"] = reg(connect_deadline_s=2.5, idle_period_s=0.1)
    out["ok-registration-incarnation-64-chars"] = reg(incarnation="A-z0._" * 10 + "9._-")
    out["ok-registration-escaped-keys-and-values"] = reg().replace(b'"incarnation": "2f9c1e6a"',
                                                                   b'"\\u0069ncarnation": "\\u0032f9c1e6a"')
    out["ok-registration-trailing-json-whitespace"] = reg() + b" \t\r\n"
    out["ok-registration-exactly-64-kib"] = padded(reg(), MAX_BODY)
    out["ok-route-exactly-64-kib"] = padded(route(), MAX_BODY)
    for name in ("active", "idle", "stopping", "stopped", "waking"):
        out[f"ok-route-state-{name}"] = route(state=name)
    out["ok-route-sandbox-57-chars"] = route(sandbox="s" * 57)
    out["ok-route-sandbox-all-digits"] = route(sandbox="12345")
    out["ok-route-sandbox-underscore-first"] = route(sandbox="_x-1")
    out["ok-route-sandbox-digits-then-letters"] = route(sandbox="80web")
    # JSON keeps the last of two equal keys, and so do the codecs: the first value is never judged.
    out["ok-registration-duplicate-key-last-wins"] = reg().replace(
        b'"incarnation": "2f9c1e6a"', b'"incarnation": "no spaces", "incarnation": "2f9c1e6a"')
    out["bad_port-registration-duplicate-key-last-wins"] = reg().replace(b'"default_port": 8080',
                                                                         b'"default_port": 8080, "default_port": 0')
    # -- the body as a whole ------------------------------------------------------------------------
    out["too_long-registration-64-kib-plus-one"] = padded(reg(), MAX_BODY + 1)
    out["too_long-route-64-kib-plus-one"] = padded(route(), MAX_BODY + 1)
    out["too_long-registration-128-kib-not-even-json"] = REGISTRATION + b"\xff" * (2 * MAX_BODY)
    out["too_long-registration-65-ports"] = reg(default_port=1, token_sha256=DROP, ports={
        str(p): {"protocol": "tcp", "auth": "public"} for p in range(1, 66)})
    out["not_json-empty-input"] = b""
    out["not_json-registration-empty"] = REGISTRATION
    out["not_json-route-empty"] = ROUTE
    out["not_json-registration-only-whitespace"] = REGISTRATION + b" \r\n\t"
    out["not_json-registration-truncated"] = reg()[:-20]
    out["not_json-registration-nan-idle"] = reg().replace(b'"idle_period_s": 300', b'"idle_period_s": NaN')
    out["not_json-registration-infinity-deadline"] = reg().replace(b'"connect_deadline_s": 10',
                                                                   b'"connect_deadline_s": Infinity')
    out["not_json-registration-minus-infinity-idle"] = reg().replace(b'"idle_period_s": 300',
                                                                     b'"idle_period_s": -Infinity')
    out["not_json-route-nan-in-an-unknown-field"] = route()[:-1] + b', "x": NaN}'
    out["not_json-registration-non-utf8-byte"] = reg().replace(b"2f9c1e6a", b"2f9c\xff1e6a")
    out["not_json-registration-overlong-utf8-slash"] = reg().replace(b"2f9c1e6a", b"2f9c\xc0\xaf1e6a")
    out["not_json-registration-utf8-encoded-surrogate"] = reg().replace(b"2f9c1e6a", b"2f9c\xed\xa0\x801e6a")
    out["not_json-registration-latin1-body"] = reg(incarnation="caf\u00e9").replace(b"\\u00e9", b"\xe9")
    out["not_json-registration-utf8-bom"] = REGISTRATION + b"\xef\xbb\xbf" + reg()[1:]
    out["not_json-registration-utf16"] = REGISTRATION + json.dumps(GOLDEN).encode("utf-16")
    out["not_json-registration-single-quotes"] = REGISTRATION + json.dumps(GOLDEN).replace('"', "'").encode()
    out["not_json-registration-trailing-comma"] = reg()[:-1] + b",}"
    out["not_json-registration-control-char-in-string"] = reg().replace(b"2f9c1e6a", b"2f9c\n1e6a")
    out["not_json-registration-two-objects"] = reg() + reg()[1:]
    out["not_json-registration-no-break-space-after-body"] = reg() + "\u00a0".encode()
    out["not_json-registration-hex-number"] = reg().replace(b'"default_port": 8080', b'"default_port": 0x1f90')
    out["not_json-registration-leading-zero-number"] = reg().replace(b'"default_port": 8080', b'"default_port": 08080')
    out["not_json-registration-deep-array-nesting"] = REGISTRATION + b"[" * 30000 + b"]" * 30000
    out["not_json-registration-deep-nesting-in-the-forwarder"] = reg().replace(
        b'"forwarder": ', b'"forwarder": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b", \"x\": ")
    out["not_object-registration-array-of-the-golden"] = REGISTRATION + b"[" + reg()[1:] + b"]"
    out["not_object-registration-string"] = REGISTRATION + b'"2f9c1e6a"'
    out["not_object-registration-number"] = REGISTRATION + b"8080"
    out["not_object-registration-null"] = REGISTRATION + b"null"
    out["not_object-route-true"] = ROUTE + b"true"
    out["not_object-route-empty-array"] = ROUTE + b"[]"
    # -- fields -------------------------------------------------------------------------------------
    out["unknown_field-registration-typo-idle-period"] = reg(idle_period_s=DROP, idle_period=300)
    out["unknown_field-registration-with-a-route-state"] = reg(state="active")
    out["unknown_field-registration-with-a-sandbox"] = reg(sandbox="sbx-1")
    out["unknown_field-registration-key-in-other-case"] = reg(incarnation=DROP, Incarnation="2f9c1e6a")
    out["unknown_field-registration-empty-key"] = reg(**{"": 1})
    out["unknown_field-registration-in-the-forwarder"] = reg(forwarder={**fwd(), "port": 8443})
    out["unknown_field-registration-in-a-port"] = reg(**port(tls=True))
    nested = b"[" * 200 + b"]" * 200
    out["unknown_field-registration-holding-200-deep-nesting"] = reg()[:-1] + b', "x": ' + nested + b"}"
    out["unknown_field-route-with-idle-period"] = route(idle_period_s=300)
    out["unknown_field-route-with-activity"] = route(activity="bytes")
    out["missing_field-registration-empty-object"] = REGISTRATION + b"{}"
    out["missing_field-registration-no-incarnation"] = reg(incarnation=DROP)
    out["missing_field-registration-no-idle-period"] = reg(idle_period_s=DROP)
    out["missing_field-registration-no-ports"] = reg(ports=DROP)
    out["missing_field-registration-forwarder-without-pin"] = reg(forwarder={"address": "10.0.3.7:8443"})
    out["missing_field-registration-port-without-auth"] = reg(ports={"8080": {"protocol": "http"}})
    out["missing_field-route-no-state"] = route(state=DROP)
    out["missing_field-route-no-sandbox"] = route(sandbox=DROP)
    out["bad_type-registration-forwarder-string"] = reg(forwarder="10.0.3.7:8443")
    out["bad_type-registration-address-number"] = reg(forwarder=fwd(address=8443))
    out["bad_type-registration-pin-number"] = reg(forwarder=fwd(pin=12345))
    out["bad_type-registration-target-ip-number"] = reg(target_ip=180879621)
    out["bad_type-registration-ports-empty"] = reg(ports={})
    out["bad_type-registration-ports-array"] = reg(ports=[{"protocol": "http", "auth": "token"}])
    out["bad_type-registration-port-spec-string"] = reg(ports={"8080": "http"})
    out["bad_type-route-ports-null"] = route(ports=None)
    # -- the sandbox and its state (a route's) ------------------------------------------------------
    for what, sandbox in [("upper-case", "Sbx-1"), ("port-form", "80-web"), ("58-chars", "s" * 58), ("empty", ""),
                          ("dash-first", "-sbx"), ("dot", "sbx.1"), ("trailing-newline", "sbx-1\n"),
                          ("non-ascii", "sbx-\u00e9"), ("number", 1), ("null", None), ("slash", "sbx/1")]:
        out[f"bad_sandbox-route-{what}"] = route(sandbox=sandbox)
    for what, state in [("running", "running"), ("capitalised", "Active"), ("null", None), ("number", 1),
                        ("list", ["active"])]:
        out[f"bad_state-route-{what}"] = route(state=state)
    # -- the registration's own fields, and those a route shares ----------------------------------------
    for what, incarnation in [("empty", ""), ("65-chars", "a" * 65), ("space", "2f9c 1e6a"), ("slash", "2f9c/1e6a"),
                              ("number", 12345), ("null", None), ("non-ascii", "caf\u00e9"),
                              ("lone-surrogate", "\ud800")]:
        out[f"bad_incarnation-registration-{what}"] = reg(incarnation=incarnation)
    out["bad_incarnation-route-trailing-newline"] = route(incarnation="2f9c1e6a\n")
    for what, address in [("no-port", "10.0.3.7"), ("host-name", "fwd.example.com:8443"),
                          ("ipv6-unbracketed", "fd00::7:8443"), ("no-host", ":8443"), ("cidr", "10.0.3.7/32:8443"),
                          ("ipv4-leading-zeros", "010.0.3.7:8443"), ("empty", ""),
                          ("bracket-inside", "[fd00::7:8443]")]:
        out[f"bad_address-registration-{what}"] = reg(forwarder=fwd(address))
    out["bad_address-route-ipv6-zone-only"] = route(forwarder=fwd("[fe80::1%]:8443"))
    for what, address in [("empty-port", "10.0.3.7:"), ("port-99999", "10.0.3.7:99999"),
                          ("port-leading-zero", "10.0.3.7:08443"), ("port-negative", "10.0.3.7:-1"),
                          ("port-zero", "10.0.3.7:0"), ("port-plus", "[fd00::7]:+8443")]:
        out[f"bad_port-registration-forwarder-{what}"] = reg(forwarder=fwd(address))
    digest = hashlib.sha256(b"spki").digest()
    for what, pin in [("not-base64", "!" * 44), ("31-byte-digest", base64.b64encode(digest[:31]).decode()),
                      ("33-bytes", base64.b64encode(digest + b"\x00").decode()), ("no-padding", PIN.rstrip("=")),
                      ("trailing-newline", PIN + "\n"), ("hex", digest.hex()),
                      ("url-safe-alphabet", base64.urlsafe_b64encode(digest).decode()),
                      ("non-ascii", PIN[:-2] + "\u00e9="), ("empty", "")]:
        out[f"bad_pin-registration-{what}"] = reg(forwarder=fwd(pin=pin))
    for what, ip in [("three-octets", "10.200.1"), ("host-name", "sandbox.internal"), ("cidr", "10.200.1.5/32"),
                     ("empty", ""), ("leading-zeros", "010.200.1.5"), ("with-port", "10.200.1.5:8080"),
                     ("bracketed-ipv6", "[fd00::5]")]:
        out[f"bad_ip-registration-{what}"] = reg(target_ip=ip)
    out["bad_ip-route-octet-256"] = route(target_ip="10.200.1.256")
    for what, default in [("zero", 0), ("65536", 65536), ("string", "8080"), ("true", True), ("float", 8080.0),
                          ("negative", -8080), ("null", None)]:
        out[f"bad_port-registration-default-{what}"] = reg(default_port=default)
    for what, key in [("leading-zero", "08080"), ("zero", "0"), ("65536", "65536"), ("arabic-digits", "\u0668\u0660"),
                      ("negative", "-1"), ("space-before", " 8080"), ("plus", "+8080"), ("empty", ""),
                      ("superscript", "\u00b2")]:
        out[f"bad_port-registration-key-{what}"] = reg(**port(number=key))
    out["bad_port-route-default-zero"] = route(default_port=0)
    out["default_port_not_exposed-registration-9090"] = reg(default_port=9090)
    out["default_port_not_exposed-route-22-of-8080-only"] = route(default_port=22, **port())
    for what, protocol in [("https", "https"), ("upper-case", "HTTP"), ("null", None), ("list", ["http"]),
                           ("grpc", "grpc")]:
        out[f"bad_protocol-registration-{what}"] = reg(**port(protocol=protocol))
    for what, protocol, auth in [("none", "http", "none"), ("http-client-cert", "http", "client_cert"),
                                 ("h2c-client-cert", "h2c", "client_cert"), ("tcp-token", "tcp", "token"),
                                 ("null", "http", None), ("upper-case", "http", "PUBLIC")]:
        out[f"bad_auth-registration-{what}"] = reg(**port(protocol, auth))
    for what, token in [("upper-case-hex", TOKEN.upper()), ("63-digits", TOKEN[:63]), ("65-digits", TOKEN + "0"),
                        ("number", 12345), ("not-hex", "g" * 64), ("base64", PIN)]:
        out[f"bad_token_hash-registration-{what}"] = reg(token_sha256=token)
    out["no_token-registration-token-port-without-token"] = reg(token_sha256=DROP)
    out["no_token-registration-token-port-with-null-token"] = reg(token_sha256=None)
    out["no_token-route-h2c-token-port-without-token"] = route(token_sha256=DROP, **port("h2c", "token"))
    for what, value in [("zero", 0), ("negative", -1), ("minus-zero", -0.0), ("over-a-year", 86400 * 365 + 1),
                        ("string", "300"), ("true", True), ("null", None), ("subnormal-negative", -5e-324)]:
        out[f"bad_number-registration-idle-{what}"] = reg(idle_period_s=value)
    out["bad_number-registration-idle-1e400-overflows-to-inf"] = reg().replace(b'"idle_period_s": 300',
                                                                              b'"idle_period_s": 1e400')
    out["bad_number-registration-deadline-zero"] = reg(connect_deadline_s=0)
    out["bad_number-registration-deadline-over-300"] = reg(connect_deadline_s=300.00000000001)
    out["bad_number-route-deadline-false"] = route(connect_deadline_s=False)
    for what, activity in [("packets", "packets"), ("capitalised", "Bytes"), ("null", None), ("number", 1)]:
        out[f"bad_activity-registration-{what}"] = reg(activity=activity)
    # -- a set of pins (spki_pins: the current key and the next during a rotation) ----------------------
    out["ok-registration-single-pin-field"] = reg(forwarder=fwd())  # the field before the set: still taken
    out["ok-route-single-pin-field"] = route(forwarder=fwd())
    out["ok-registration-pins-current-and-next"] = reg(forwarder=pins(PIN, PIN_NEXT))
    out["ok-route-pins-current-and-next"] = route(forwarder=pins(PIN, PIN_NEXT))
    out["ok-registration-pins-one"] = reg(forwarder=pins(PIN))
    out["ok-registration-pins-unsorted-and-repeated"] = reg(forwarder=pins(PIN_NEXT, PIN, PIN_NEXT))
    out["ok-route-pins-four"] = route(forwarder=pins(PIN, PIN_NEXT, PIN_THIRD, PIN))
    out["bad_pin-registration-pin-and-pins"] = reg(forwarder={**pins(PIN), "spki_pin": PIN})
    out["bad_pin-registration-pins-empty"] = reg(forwarder=pins())
    out["bad_pin-route-pins-one-not-base64"] = route(forwarder=pins(PIN, "!" * 44))
    out["bad_pin-registration-pins-one-not-canonical"] = reg(
        forwarder=pins(PIN, PIN_NEXT[:-2] + chr(ord(PIN_NEXT[-2]) + 1) + "="))
    out["bad_pin-registration-pins-one-empty"] = reg(forwarder=pins(PIN, ""))
    out["too_long-registration-pins-five"] = reg(forwarder=pins(PIN, PIN_NEXT, PIN_THIRD, PIN, PIN_NEXT))
    out["too_long-route-pins-5000"] = route(forwarder=pins(*[PIN] * 5000))
    out["bad_type-registration-pins-a-string"] = reg(forwarder={"address": "10.0.3.7:8443", "spki_pins": PIN})
    out["bad_type-registration-pins-null"] = reg(forwarder={"address": "10.0.3.7:8443", "spki_pins": None})
    out["bad_type-registration-pins-an-object"] = reg(forwarder={"address": "10.0.3.7:8443", "spki_pins": {PIN: 1}})
    out["bad_type-registration-pins-one-a-number"] = reg(forwarder=pins(PIN, 12345))
    out["bad_type-registration-pins-one-a-list"] = reg(forwarder=pins(PIN, [PIN_NEXT]))
    out["bad_type-registration-pin-a-list"] = reg(forwarder={"address": "10.0.3.7:8443", "spki_pin": [PIN]})
    out["unknown_field-registration-pins-typo"] = reg(forwarder={"address": "10.0.3.7:8443", "spki_pinz": [PIN]})
    return out


# Bodies this corpus found routes.py answering against its contract (now fixed; kept as regressions).
REGRESSIONS: dict[str, bytes] = {
    # An integer literal of more than 4,300 digits: json.loads raised ValueError (CPython's limit on int
    # conversion), which _load did not catch.
    "bad_number-registration-5000-digit-integer": reg().replace(b'"idle_period_s": 300',
                                                             b'"idle_period_s": 1' + b"0" * 5000),
    # A port key or forwarder port of more than 4,300 digits: int() raises ValueError in _port_key.
    "bad_port-registration-key-5000-digits": reg(**port(number="1" * 5000)),
    "bad_port-registration-forwarder-port-5000-digits": reg(forwarder=fwd("10.0.3.7:" + "1" * 5000)),
    # An integer too large for a float: math.isfinite raises OverflowError in _positive.
    "bad_number-registration-deadline-401-digit-integer": reg(connect_deadline_s=10**400),
    "bad_number-registration-idle-401-digit-integer": reg(idle_period_s=10**400),
    # IPv6 zone IDs are accepted with any text (ipaddress allows them); one of non-ASCII characters makes
    # a body of under 64 KiB re-encode (\\u escapes) to over 64 KiB, so push_registration refuses its own value.
    "bad_ip-registration-zone-id-re-encodes-over-64-kib": REGISTRATION + json.dumps(
        _with(GOLDEN, {"target_ip": "fe80::1%" + "\U0001f600" * 15000}), ensure_ascii=False).encode(),
    "bad_ip-registration-zone-id-with-a-newline": reg(target_ip="fe80::1%eth0\nx"),
    "bad_address-registration-zone-id-in-the-forwarder": reg(forwarder=fwd("[fe80::1%eth0]:8443")),
    # Base64 with stray bits in its last character decodes to the same 32 bytes, so it is accepted, but
    # the gateway compares pins as strings (certs/loader.py check_pin): that forwarder can never match.
    "bad_pin-registration-non-canonical-base64": reg(forwarder=fwd(pin=PIN[:-2] + chr(ord(PIN[-2]) + 1) + "=")),
}


def main() -> None:
    write_seeds(OUT, seeds() | REGRESSIONS)


if __name__ == "__main__":
    main()
