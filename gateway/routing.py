"""Routing: where one request (or one raw TCP connection) goes, decided from names and a route.

Pure: names and a looked-up ``Route`` in, a decision out. No sockets, no clocks, no lookups; the caller
looks the route up (``route_cache.py``, then the scheduler) between the two steps of a request.

An HTTP request is routed in two steps:

1. ``request_target`` (before any lookup): which name the request asks for. Its authority (Host,
   ``:authority`` or an absolute-form target, ``names.Names.request_name``) is parsed; a malformed one is
   answered 400. Then it is held to the connection's TLS server name: browsers reuse one HTTP/2 connection
   for every name the certificate it was shown covers at the same address (RFC 9113 section 9.1.1), so a
   request on a connection made for ``a.<domain>`` may ask for ``b.<domain>``, or for another port of
   ``a``. Over HTTP/2 such a request is routed by its own name when that name is covered by the
   certificate the connection presented (``cert_names``, by ``cert_select.covers``: a wildcard covers one
   left-most label), and answered 421 otherwise (Misdirected Request: the client retries it on a connection
   of its own). Over HTTP/1.1 no client reuses a connection across names, so a Host other than the server
   name is always 421. Either way the request is decided by its own name, never by the connection's first
   sandbox: the front keys its upstream links by the decision's sandbox and port, never by the client
   connection. Names are compared as parsed, so ``a.<domain>`` and ``<default port>-a.<domain>`` are
   different names here. A connection without a server name routes each request by its own authority,
   on either front, when the certificate it was shown (the default one) covers that name, and answers
   421 when it does not: the client could not have checked that name on this connection.
   ``requested_port`` says which port that authority named (what a redirect back to the client keeps).
2. ``decide_http`` (after looking up the name's sandbox): 404 for an unknown sandbox or a port the route
   does not expose, 404 for a raw TCP port asked for over HTTP, otherwise ``Forward``.

A raw TCP connection is routed by its server name alone, at the handshake (``decide_connection``): only a
port whose protocol is ``tcp`` is forwarded raw; everything else is served as HTTP, where each request is
routed (and refused) as above.

Answer reason tokens (``Answer.reason``; stable, counted by metrics): a ``names`` reason for a 400;
``misdirected`` (421); ``unknown_sandbox``, ``port_not_exposed``, ``not_http`` (404); ``route_mismatch``
(502: the route given is not the named sandbox's, a bug upstream of this module); for a raw connection
``Close.reason`` ``bad_tcp_auth``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.cert_select import covered
from gateway.names import Name, NameRefused, Names
from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.routes import Auth, Protocol, Route


@dataclass(frozen=True)
class Answer:
    """An HTTP answer the gateway gives itself: nothing goes upstream."""

    status: int
    reason: str  # a stable token for metrics
    message: str  # one line for the body; never the peer's text


@dataclass(frozen=True)
class Forward:
    """Forward the request to ``port`` of ``sandbox``; authenticate it first as ``auth`` says."""

    route: Route
    sandbox: str
    port: int
    protocol: Protocol  # "http" or "h2c": how to speak to the sandbox's app
    auth: Auth  # "public" or "token"


@dataclass(frozen=True)
class RawForward:
    """Forward the connection's bytes to ``port`` of ``sandbox``: no ALPN, no HTTP."""

    route: Route
    sandbox: str
    port: int
    require_client_cert: bool  # the port's auth is "client_cert"


@dataclass(frozen=True)
class ServeHttp:
    """Serve the connection as HTTP (ALPN h2 / http/1.1); each request is routed on its own."""


@dataclass(frozen=True)
class Close:
    """Close the raw connection without forwarding anything."""

    reason: str


SERVE_HTTP = ServeHttp()


def bad_authority(err: NameRefused) -> Answer:
    """The 400 for a request whose authority ``names`` refused."""
    return Answer(400, err.reason, f"bad request authority ({err.reason})")


def request_target(
    names: Names,
    conn: Name | None,
    *,
    target: str | bytes,
    hosts: Sequence[str | bytes],
    authority: str | bytes | None = None,
    http2: bool = False,
    http10: bool = False,
    cert_names: Sequence[str] = (),
) -> Name | Answer:
    """Step 1: the name this request asks for, or the answer that refuses it (400, 421).

    ``conn`` is the connection's parsed server name (None: the client sent none). An HTTP/1.0 request
    without Host is routed by ``conn``; without either it is refused (``missing_host``). ``cert_names``:
    the DNS SANs of the certificate the connection presented; an HTTP/2 request for another name than
    ``conn`` is routed by its own name if they cover it, 421 if not; without ``conn``, any request (either
    front) likewise. Empty ``cert_names`` (no certificate known): nothing is held to them."""
    try:
        name = names.request_name(target, hosts, authority=authority, http2=http2, http10=http10)
    except NameRefused as e:
        return bad_authority(e)
    if name is None:
        if conn is None:
            return Answer(400, "missing_host", "bad request authority (missing_host)")
        return conn
    if conn is None:
        # No SNI: the connection was shown the default certificate; a name it does not cover is not one
        # this connection can carry (the client could not have checked it), on either front.
        if cert_names and not _presented_for(names, name, cert_names):
            return Answer(421, "misdirected", "this connection's certificate does not cover this name")
        return name
    if name != conn and not (http2 and _presented_for(names, name, cert_names)):
        return Answer(421, "misdirected", "this connection serves another name: open a new connection")
    return name


_SCHEME_DEFAULT_PORT = {"https": 443, "http": 80}


def requested_port(
    names: Names,
    *,
    target: str | bytes,
    hosts: Sequence[str | bytes],
    authority: str | bytes | None = None,
    http2: bool = False,
) -> int | None:
    """The port the authority ``request_target`` routed by names (``:authority`` or else Host over HTTP/2;
    an absolute-form target or else Host over HTTP/1.x), for a request it accepted: the listener's port,
    as validated there. None when the authority names no port, names the scheme's default (``host:443``
    is ``host``), or is not one ``request_target`` would accept."""
    text: str | bytes | None
    if http2:
        text = authority if authority is not None else (hosts[0] if hosts else None)
    else:
        try:
            text = names.authority_of_target(target)
        except NameRefused:
            return None
        if text is None:
            text = hosts[0] if hosts else None
    if text is None:
        return None
    try:
        names.parse_authority(text)  # the same checks: a port other than the accepted ones is refused
    except NameRefused:
        return None
    if isinstance(text, bytes):
        text = text.decode("ascii")
    _, sep, digits = text.rpartition(":")
    if not sep:
        return None
    port = int(digits)
    return None if port == _SCHEME_DEFAULT_PORT.get(names.scheme) else port


def _presented_for(names: Names, name: Name, cert_names: Sequence[str]) -> bool:
    """Whether the certificate whose DNS SANs are ``cert_names`` covers ``name``'s host name."""
    try:
        host = names.host_of(name)
    except LocalProtocolError:
        return False  # not a name any client could have asked for: no certificate covers it
    return covered(cert_names, host)


def decide_http(name: Name, route: Route | None) -> Forward | Answer:
    """Step 2: ``route`` is the lookup of ``name.sandbox`` (None: the scheduler does not know it)."""
    if route is None:
        return Answer(404, "unknown_sandbox", "unknown sandbox")
    if route.sandbox != name.sandbox:
        return Answer(502, "route_mismatch", "the route found is for another sandbox")
    spec = route.port_spec(name.port)
    port = route.default_port if name.port is None else name.port
    if spec is None:
        return Answer(404, "port_not_exposed", f"port {port} is not exposed")
    if spec.protocol == "tcp":
        return Answer(404, "not_http", f"port {port} is raw TCP over TLS, not HTTP")
    return Forward(route, name.sandbox, port, spec.protocol, spec.auth)


def decide_connection(conn: Name | None, route: Route | None) -> RawForward | ServeHttp | Close:
    """At the handshake: raw TCP for a server name whose port is ``tcp``, otherwise HTTP.

    ``route`` is the lookup of ``conn.sandbox`` (None when unknown, or when there is no server name).
    An unknown sandbox or an unexposed port is served as HTTP, so a browser reads the 404."""
    if conn is None or route is None or route.sandbox != conn.sandbox:
        return SERVE_HTTP
    spec = route.port_spec(conn.port)
    if spec is None or spec.protocol != "tcp":
        return SERVE_HTTP
    if spec.auth not in ("public", "client_cert"):
        return Close("bad_tcp_auth")
    port = route.default_port if conn.port is None else conn.port
    return RawForward(route, conn.sandbox, port, require_client_cert=spec.auth == "client_cert")
