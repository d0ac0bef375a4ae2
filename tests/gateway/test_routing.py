"""gateway/routing.py: each request held to its connection's name and certificate (421), then to its route (404)."""

from __future__ import annotations

import base64
import hashlib
import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st
from names_cases import names

from gateway.cert_select import covers
from gateway.names import Name, Names
from gateway.routing import (
    SERVE_HTTP,
    Answer,
    Close,
    Forward,
    RawForward,
    decide_connection,
    decide_http,
    request_target,
    requested_port,
)
from sbxnet.protocol.routes import Forwarder, PortSpec, Route, push_route

N = names()
PIN = base64.b64encode(hashlib.sha256(b"spki").digest()).decode()
TOKEN = hashlib.sha256(b"secret").hexdigest()


def route(sandbox: str = "a", **over: object) -> Route:
    fields: dict[str, object] = {
        "sandbox": sandbox,
        "incarnation": "i1",
        "state": "active",
        "forwarder": Forwarder("10.0.3.7", 8443, (PIN,)),
        "target_ip": ipaddress.ip_address("10.200.1.5"),
        "default_port": 8080,
        "ports": {
            8080: PortSpec("http", "token"),
            9000: PortSpec("h2c", "public"),
            22: PortSpec("tcp", "public"),
            2222: PortSpec("tcp", "client_cert"),
        },
        "token_sha256": TOKEN,
    }
    fields.update(over)
    r = Route(**fields)  # type: ignore[arg-type]
    push_route(r)  # the routes are ones the scheduler could send
    return r


A, B = Name("a", None), Name("b", None)


def target(conn: Name | None, host: str | None, **kw: object) -> Name | Answer:
    hosts = [] if host is None else [host.encode()]
    return request_target(N, conn, target=b"/", hosts=hosts, **kw)  # type: ignore[arg-type]


# -- step 1: coalescing (RFC 9113 9.1.1) ------------------------------------------------------------

# (connection's server name, the request's Host, the outcome: a Name to look up, or a status)
COALESCING: list[tuple[str | None, str | None, Name | int]] = [
    ("a.sandbox.example.com", "a.sandbox.example.com", A),
    ("a.sandbox.example.com", "A.Sandbox.Example.Com.:443", A),
    ("a.sandbox.example.com.", "a.sandbox.example.com:8443", A),
    ("A.SANDBOX.EXAMPLE.COM", "a.sandbox.example.com", A),
    ("8080-a.sandbox.example.com", "8080-a.sandbox.example.com", Name("a", 8080)),
    ("a.sandbox.example.com", "b.sandbox.example.com", 421),
    ("a.sandbox.example.com", "8080-a.sandbox.example.com", 421),  # same sandbox, another (spelled) port
    ("8080-a.sandbox.example.com", "9000-a.sandbox.example.com", 421),
    ("8080-a.sandbox.example.com", "a.sandbox.example.com", 421),
    ("8080-a.sandbox.example.com", "8080-b.sandbox.example.com", 421),
    ("a.sandbox.example.com", "a.b.sandbox.example.com", 400),
    ("a.sandbox.example.com", "a.sandbox.example.com:9999", 400),
    ("a.sandbox.example.com", "evil.example.org", 400),
    ("a.sandbox.example.com", "[::1]:443", 400),
    ("a.sandbox.example.com", "", 400),
    ("a.sandbox.example.com", None, 400),  # HTTP/1.1 without Host
    (None, "b.sandbox.example.com", B),  # no server name: each request by its own authority
    (None, "8080-b.sandbox.example.com", Name("b", 8080)),
    (None, None, 400),
    (None, "10.0.0.1", 400),
]


@pytest.mark.parametrize(("sni", "host", "want"), COALESCING, ids=[f"{s}->{h}" for s, h, _ in COALESCING])
def test_a_request_is_held_to_its_connections_name(sni: str | None, host: str | None, want: Name | int) -> None:
    conn = N.parse_sni(sni)
    got = target(conn, host)
    if isinstance(want, Name):
        assert got == want
    else:
        assert isinstance(got, Answer) and got.status == want
        if want == 421:
            assert got.reason == "misdirected"


WILD = ("*.sandbox.example.com",)


def test_http2_coalescing_uses_authority() -> None:
    conn = N.parse_sni("a.sandbox.example.com")
    got = target(conn, None, authority=b"b.sandbox.example.com", http2=True)  # no certificate names given
    assert isinstance(got, Answer) and (got.status, got.reason) == (421, "misdirected")
    got = target(conn, None, authority=b"a.sandbox.example.com:443", http2=True)
    assert got == A
    got = target(conn, "b.sandbox.example.com", authority=b"a.sandbox.example.com", http2=True, cert_names=WILD)
    assert isinstance(got, Answer) and (got.status, got.reason) == (400, "host_mismatch")


# (the connection's server name, the SANs of the certificate it presented, the stream's :authority, the outcome)
HTTP2_COALESCING: list[tuple[str, tuple[str, ...], str, Name | int]] = [
    ("a.sandbox.example.com", WILD, "b.sandbox.example.com", B),
    ("a.sandbox.example.com", WILD, "B.Sandbox.Example.Com.:443", B),
    ("a.sandbox.example.com", WILD, "8080-a.sandbox.example.com", Name("a", 8080)),  # another port of a
    ("8080-a.sandbox.example.com", WILD, "9000-b.sandbox.example.com", Name("b", 9000)),
    ("a.sandbox.example.com", ("*.SANDBOX.example.com.",), "b.sandbox.example.com", B),
    ("a.sandbox.example.com", ("a.sandbox.example.com",), "b.sandbox.example.com", 421),  # exact: a only
    ("a.sandbox.example.com", ("a.sandbox.example.com", "b.sandbox.example.com"), "b.sandbox.example.com", B),
    ("a.sandbox.example.com", ("*.example.com",), "b.sandbox.example.com", 421),  # one label, not two
    ("a.sandbox.example.com", ("*.other.example",), "b.sandbox.example.com", 421),
    ("a.sandbox.example.com", ("b*.sandbox.example.com",), "b.sandbox.example.com", 421),  # partial: no
    ("a.sandbox.example.com", ("*.a.sandbox.example.com",), "b.sandbox.example.com", 421),
    ("a.sandbox.example.com", (), "b.sandbox.example.com", 421),
    ("a.sandbox.example.com", WILD, "a.b.sandbox.example.com", 400),  # never a name: refused before
    ("a.sandbox.example.com", WILD, "b.sandbox.example.com:9999", 400),
    ("a.sandbox.example.com", WILD, "evil.example.org", 400),
]


@pytest.mark.parametrize(("sni", "sans", "authority", "want"), HTTP2_COALESCING,
                         ids=[f"{s}[{','.join(c)}]->{a}" for s, c, a, _ in HTTP2_COALESCING])
def test_an_http2_stream_for_a_name_the_certificate_covers_is_routed_by_its_own_name(
    sni: str, sans: tuple[str, ...], authority: str, want: Name | int
) -> None:
    got = target(N.parse_sni(sni), None, authority=authority.encode(), http2=True, cert_names=sans)
    if isinstance(want, Name):
        assert got == want
    else:
        assert isinstance(got, Answer) and got.status == want
        if want == 421:
            assert got.reason == "misdirected"


def test_http11_is_held_to_the_server_name_whatever_the_certificate_covers() -> None:
    conn = N.parse_sni("a.sandbox.example.com")
    got = target(conn, "b.sandbox.example.com", cert_names=WILD)
    assert isinstance(got, Answer) and (got.status, got.reason) == (421, "misdirected")
    got = request_target(N, conn, target=b"https://b.sandbox.example.com/", hosts=[], cert_names=WILD)
    assert isinstance(got, Answer) and got.status == 421


def test_an_absolute_form_target_for_another_sandbox_is_misdirected() -> None:
    conn = N.parse_sni("a.sandbox.example.com")
    got = request_target(N, conn, target=b"https://b.sandbox.example.com/x", hosts=[b"a.sandbox.example.com"])
    assert isinstance(got, Answer) and got.status == 421


def test_http10_without_host_routes_by_the_server_name() -> None:
    conn = N.parse_sni("8080-a.sandbox.example.com")
    assert target(conn, None, http10=True) == Name("a", 8080)
    got = target(None, None, http10=True)
    assert isinstance(got, Answer) and (got.status, got.reason) == (400, "missing_host")


def test_a_bad_authority_answer_names_the_reason_and_not_the_peers_text() -> None:
    got = target(None, "evil<script>.sandbox.example.com")
    assert isinstance(got, Answer) and (got.status, got.reason) == (400, "bad_char")
    assert "evil" not in got.message and "\n" not in got.message


# -- the port the client named (a redirect keeps it) ---------------------------------------------------

N8443 = Names("sandbox.example.com", listen_port=8443)

# (Host, :authority, absolute-form target, HTTP/2, the port)
REQUESTED_PORT: list[tuple[str | None, str | None, str, bool, int | None]] = [
    ("a.sandbox.example.com:8443", None, "/", False, 8443),
    ("a.sandbox.example.com", None, "/", False, None),
    ("a.sandbox.example.com:443", None, "/", False, None),  # the scheme's default: no port in a URL
    ("a.sandbox.example.com:9999", None, "/", False, None),  # not accepted (request_target's 400)
    ("a.sandbox.example.com:", None, "/", False, None),
    (None, None, "/", False, None),  # HTTP/1.0 without Host
    ("a.sandbox.example.com", None, "https://a.sandbox.example.com:8443/x", False, 8443),  # the target wins
    ("a.sandbox.example.com:8443", None, "https://a.sandbox.example.com/x", False, None),
    (None, "a.sandbox.example.com:8443", "/", True, 8443),
    ("a.sandbox.example.com:8443", None, "/", True, 8443),  # HTTP/2 without :authority: Host
    ("a.sandbox.example.com:8443", "a.sandbox.example.com", "/", True, None),  # :authority first
    (None, "[::1]:8443", "/", True, None),
]


@pytest.mark.parametrize(("host", "authority", "tgt", "http2", "want"), REQUESTED_PORT)
def test_the_port_the_request_named(host: str | None, authority: str | None, tgt: str, http2: bool,
                                    want: int | None) -> None:
    hosts = [] if host is None else [host.encode()]
    auth = None if authority is None else authority.encode()
    assert requested_port(N8443, target=tgt.encode(), hosts=hosts, authority=auth, http2=http2) == want


def test_the_port_is_dropped_when_the_listener_is_on_the_schemes_default() -> None:
    n443 = Names("sandbox.example.com", listen_port=443)
    assert requested_port(n443, target=b"/", hosts=[b"a.sandbox.example.com:443"]) is None


@given(st.sampled_from(["a", "8080-b"]), st.sampled_from(["", ":443", ":8443", ":8444", ":0", ":08443"]),
       st.booleans())
def test_a_named_port_is_one_request_target_accepts(label: str, suffix: str, http2: bool) -> None:
    text = f"{label}.sandbox.example.com{suffix}".encode()
    kw: dict[str, object] = {"authority": text, "http2": True} if http2 else {}
    hosts = [] if http2 else [text]
    port = requested_port(N8443, target=b"/", hosts=hosts, **kw)  # type: ignore[arg-type]
    accepted = request_target(N8443, None, target=b"/", hosts=hosts, **kw)  # type: ignore[arg-type]
    assert port == (8443 if suffix == ":8443" else None)
    if port is not None:
        assert isinstance(accepted, Name)


# -- step 2: the route --------------------------------------------------------------------------------


def test_forward_to_the_default_port() -> None:
    r = route()
    assert decide_http(A, r) == Forward(r, "a", 8080, "http", "token")


def test_forward_to_a_named_port() -> None:
    r = route()
    assert decide_http(Name("a", 9000), r) == Forward(r, "a", 9000, "h2c", "public")
    assert decide_http(Name("a", 8080), r) == Forward(r, "a", 8080, "http", "token")


@pytest.mark.parametrize(
    ("name", "lookup", "status", "reason"),
    [
        (A, None, 404, "unknown_sandbox"),
        (Name("a", 8081), route(), 404, "port_not_exposed"),
        (Name("a", 22), route(), 404, "not_http"),
        (Name("a", 2222), route(), 404, "not_http"),
        (B, route("a"), 502, "route_mismatch"),
    ],
)
def test_refusals(name: Name, lookup: Route | None, status: int, reason: str) -> None:
    got = decide_http(name, lookup)
    assert isinstance(got, Answer) and (got.status, got.reason) == (status, reason)
    assert "\n" not in got.message


def test_a_default_port_that_is_raw_tcp_is_not_http() -> None:
    r = route(default_port=22)
    got = decide_http(A, r)
    assert isinstance(got, Answer) and got.reason == "not_http"


def test_the_connections_first_route_never_serves_another_sandboxs_request() -> None:
    # A connection made for a.<domain> whose route is cached; a coalesced request for b.<domain>: 421 before any
    # lookup, and even a caller that handed decide_http the connection's route gets no Forward to a.
    conn = N.parse_sni("a.sandbox.example.com")
    first = route("a")
    assert isinstance(decide_http(A, first), Forward)
    got = target(conn, "b.sandbox.example.com")
    assert isinstance(got, Answer) and got.status == 421
    assert isinstance(decide_http(B, first), Answer)
    # without a server name, b is routed to b's own route
    b = target(None, "b.sandbox.example.com")
    assert isinstance(b, Name)
    fwd = decide_http(b, route("b"))
    assert isinstance(fwd, Forward) and fwd.sandbox == "b" and fwd.route.sandbox == "b"


@given(st.sampled_from(["a", "b", "c"]), st.sampled_from([None, 8080, 9000]),
       st.sampled_from(["a", "b", "c"]), st.sampled_from([None, 8080, 9000]))
def test_a_forward_always_goes_where_the_connection_and_the_request_both_say(
    cs: str, cp: int | None, rs: str, rp: int | None
) -> None:
    conn, req = Name(cs, cp), Name(rs, rp)
    host = N.host_of(req).encode()
    got = request_target(N, conn, target=b"/", hosts=[host], cert_names=WILD)  # HTTP/1.1
    if conn != req:
        assert isinstance(got, Answer) and got.status == 421
        return
    assert got == req
    for lookup in (route("a"), route("b"), route("c")):
        d = decide_http(got, lookup)
        if isinstance(d, Forward):
            assert d.sandbox == conn.sandbox == lookup.sandbox
            assert d.port == (lookup.default_port if conn.port is None else conn.port)


@given(st.sampled_from(["a", "b", "c"]), st.sampled_from([None, 8080, 9000]),
       st.sampled_from(["a", "b", "c"]), st.sampled_from([None, 8080, 9000]),
       st.sampled_from([WILD, ("a.sandbox.example.com", "8080-b.sandbox.example.com"), ()]))
def test_a_coalesced_http2_stream_goes_where_it_says_or_nowhere(
    cs: str, cp: int | None, rs: str, rp: int | None, sans: tuple[str, ...]
) -> None:
    conn, req = Name(cs, cp), Name(rs, rp)
    host = N.host_of(req)
    got = request_target(N, conn, target=b"/", hosts=[], authority=host.encode(), http2=True, cert_names=sans)
    if conn != req and not any(covers(s, host) for s in sans):
        assert isinstance(got, Answer) and got.status == 421
        return
    assert got == req  # its own name, never the connection's
    for lookup in (route("a"), route("b"), route("c")):
        d = decide_http(got, lookup)
        if isinstance(d, Forward):
            assert d.sandbox == req.sandbox == lookup.sandbox
            assert d.port == (lookup.default_port if req.port is None else req.port)


# -- the raw TCP rule: by server name alone, tcp ports only --------------------------------------------


def test_raw_tcp_routes_by_server_name_to_tcp_ports() -> None:
    r = route()
    assert decide_connection(Name("a", 22), r) == RawForward(r, "a", 22, require_client_cert=False)
    assert decide_connection(Name("a", 2222), r) == RawForward(r, "a", 2222, require_client_cert=True)
    raw_default = route(default_port=22)
    assert decide_connection(A, raw_default) == RawForward(raw_default, "a", 22, require_client_cert=False)


@pytest.mark.parametrize(
    ("conn", "lookup"),
    [
        (None, None),  # no server name: raw needs one
        (None, route()),
        (A, None),  # unknown: HTTP, where the request is answered 404
        (A, route()),  # default port is http
        (Name("a", 9000), route()),  # h2c
        (Name("a", 8081), route()),  # not exposed: 404 over HTTP
        (B, route("a")),  # a route for another sandbox is never used
    ],
)
def test_everything_else_is_served_as_http(conn: Name | None, lookup: Route | None) -> None:
    assert decide_connection(conn, lookup) is SERVE_HTTP


def test_a_tcp_port_with_token_auth_is_closed() -> None:
    # routes.py refuses such a route; if one arrived anyway it is not forwarded unauthenticated.
    r = route()
    object.__setattr__(r, "ports", {**r.ports, 23: PortSpec("tcp", "token")})
    assert decide_connection(Name("a", 23), r) == Close("bad_tcp_auth")


# -- no SNI: the default certificate's names ---------------------------------------------------------------

NO_SNI: list[tuple[tuple[str, ...], str, bool, Name | int]] = [
    # the default certificate's SANs, the request's authority, HTTP/2, the outcome
    (WILD, "b.sandbox.example.com", False, B),
    (WILD, "b.sandbox.example.com", True, B),
    (WILD, "8080-b.sandbox.example.com", True, Name("b", 8080)),
    (("b.sandbox.example.com",), "b.sandbox.example.com", False, B),
    (("b.sandbox.example.com",), "a.sandbox.example.com", False, 421),
    (("b.sandbox.example.com",), "a.sandbox.example.com", True, 421),
    (("b.sandbox.example.com",), "8080-b.sandbox.example.com", True, 421),  # another name of b's: not covered
    (("*.other.example.com",), "b.sandbox.example.com", False, 421),
    ((), "b.sandbox.example.com", False, B),  # no certificate known (not a front connection): by its authority
    (("b.sandbox.example.com",), "a.b.sandbox.example.com", False, 400),  # malformed first
]


@pytest.mark.parametrize(("sans", "authority", "http2", "want"), NO_SNI,
                         ids=[f"[{','.join(c)}]->{a}{'-h2' if h else ''}" for c, a, h, _ in NO_SNI])
def test_without_sni_a_request_is_routed_by_its_own_name_when_the_certificate_covers_it(
    sans: tuple[str, ...], authority: str, http2: bool, want: Name | int
) -> None:
    """No server name: the connection was shown the default certificate, and each request is routed by its
    own authority, on both fronts, if that certificate covers it; 421 otherwise."""
    if http2:
        got = target(None, None, authority=authority.encode(), http2=True, cert_names=sans)
    else:
        got = target(None, authority, cert_names=sans)
    if isinstance(want, Name):
        assert got == want
    else:
        assert isinstance(got, Answer) and got.status == want
        if want == 421:
            assert got.reason == "misdirected"
