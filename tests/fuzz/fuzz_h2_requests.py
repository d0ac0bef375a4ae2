"""Fuzz target: what of a client's HTTP/2 requests may reach a sandbox (issue 22 points 8 and 9).

``data`` is what a client sends after the connection preface (this target puts the preface first). It is
fed to an h2 server connection exactly as the gateway's (``gateway.http2.server_connection``: no header
decoding, h2's inbound checks off, ``request_rules`` doing them per stream) one frame at a time, the worst
case for a proxy that streams: a head is taken (and would go upstream) before the frames after it are read.
Each request is decided in the gateway's order (``H2Session._event`` and ``_stream``):
``request_rules.check_h2_head`` and ``h2_content_length`` (a malformed head: refused on its stream), CONNECT
(501), ``request_rules.upstream_target`` (``admit``'s first step), then the name
(``names.Names.request_name``); a refused one goes nowhere (its DATA is dropped), an accepted one is "sent
upstream": its head (one with ``content-length: 0`` and no END_STREAM only once its stream ended:
``H2Session._await_end``), then its DATA as ``request_rules.h2_data`` lets it through (the DATA that
completes its content-length waits for the end), its end. DATA against content-length or malformed trailers
(``check_h2_trailers``; trailers without END_STREAM, ``http2._RequestStream``) reset that stream only (its
link aborted: the app sees a reset, never an end); a connection error h2 raises (frames, HPACK, stream
states) aborts every upstream request not complete.

Invariant (``one_input``): nothing of a refused request reaches the sandbox, and what does is well formed:
a token method; an origin-form target (``*`` only for OPTIONS), printable, no fragment; lower-case header
names, none connection-specific, ``te`` only ``trailers``; at most one ``content-length``, digits; the app
holds a request's whole content-length of DATA (its head, for 0) only once its stream ended well formed, so
an aborted one never got it whole; a request that ends upstream carried exactly its content-length; nothing
arrives after its end. ``classify(data)``: the first request's outcome: ``ok`` (forwarded, not cut), its
refusal reason, ``reset_<reason>`` (forwarded, then its stream reset for
that reason), ``protocol_error`` (the connection failed before its head was taken), ``none`` (no request
and no error) or ``cut`` (forwarded, then aborted by a connection error).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import h2.events
import h2.exceptions

from gateway.http2 import _TrailersWithoutEnd, server_connection
from gateway.names import NameRefused, Names
from gateway.request_rules import (
    RequestRefused,
    check_h2_head,
    check_h2_trailers,
    h2_content_length,
    h2_data,
    upstream_target,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
NAMES = Names("sandbox.example.com", listen_port=8443)
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CONNECTION_SPECIFIC = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}


@dataclass
class Upstream:
    """One request as the sandbox would see it."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    length: int | None  # its content-length
    received: int = 0  # DATA bytes the client sent on the stream
    held: int = 0  # DATA bytes the gateway holds back (they complete the content-length before the end)
    body: int = 0  # DATA bytes that went upstream
    head_sent: bool = True  # its head went upstream (one with content-length 0 waits for the stream's end)
    ended: bool = False
    aborted: str = ""  # why it was cut: a stream error's reason, "connection_error", "client_reset"


def frames(stream: bytes) -> list[bytes]:
    """``stream`` cut at its frame boundaries (RFC 9113 4.1); a tail that is no whole frame is the last piece."""
    out = []
    pos = 0
    while pos + 9 <= len(stream):
        end = pos + 9 + int.from_bytes(stream[pos : pos + 3], "big")
        out.append(stream[pos:end])
        pos = end
    if pos < len(stream):
        out.append(stream[pos:])
    return out


def _decide(ev: h2.events.RequestReceived) -> Upstream | str:
    headers = list(ev.headers or [])
    try:
        check_h2_head(headers, ended=ev.stream_ended is not None)
        length = h2_content_length(headers)
    except RequestRefused as e:
        return e.reason
    pseudo = {n: v for n, v in headers if n.startswith(b":")}
    method, path = pseudo[b":method"], pseudo.get(b":path")
    if method == b"CONNECT" or path is None:
        return "connect_unsupported"
    try:
        target = upstream_target(method, path, scheme=NAMES.scheme, http2=True)
        NAMES.request_name(path, [v for n, v in headers if n == b"host"], authority=pseudo.get(b":authority"),
                           http2=True)
    except (RequestRefused, NameRefused) as e:
        return e.reason
    return Upstream(method, target, [(n, v) for n, v in headers if not n.startswith(b":")], length,
                    head_sent=not (length == 0 and ev.stream_ended is None))


def _abort(up: Upstream, why: str) -> None:
    up.aborted = why  # after its end (a client's reset of the response): the request itself was whole
    if not up.ended and up.head_sent and up.length is not None and up.body >= up.length:
        raise AssertionError(f"a request cut ({why}) had its whole content-length upstream")


def _data(up: Upstream, size: int, end: bool) -> None:
    """DATA on a forwarded stream, as ``H2Session._data`` takes it."""
    up.received += size
    try:
        hold = h2_data(up.length, up.received, size, end=end)
    except RequestRefused as e:
        _abort(up, e.reason)
        return
    if hold:
        up.held += size
        return
    if end:
        up.body += up.held
        up.held = 0
    up.body += size
    if up.head_sent and up.length is not None and up.body >= up.length and not end:
        raise AssertionError(f"the whole content-length ({up.length}) went upstream before the stream ended")


def _check(up: Upstream) -> None:
    if not _TOKEN.fullmatch(up.method):
        raise AssertionError(f"method {up.method!r} went upstream")
    if up.target == b"*":
        if up.method != b"OPTIONS":
            raise AssertionError(f"* went upstream with {up.method!r}")
    elif not re.fullmatch(rb"/[\x21-\x7e]*", up.target) or b"#" in up.target:
        raise AssertionError(f"target {up.target!r} went upstream")
    lengths = [v for n, v in up.headers if n == b"content-length"]
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
        raise AssertionError(f"content-length {lengths!r} went upstream")
    for n, v in up.headers:
        if n != n.lower() or n in _CONNECTION_SPECIFIC or (n == b"te" and v != b"trailers"):
            raise AssertionError(f"header {n!r}: {v!r} went upstream")


def run(data: bytes) -> tuple[dict[int, Upstream | str], bool]:
    """Every request's outcome by stream id (what went upstream, or the refusal reason), and whether the
    connection ended in a connection error."""
    conn = server_connection()
    conn.initiate_connection()
    outcomes: dict[int, Upstream | str] = {}
    failed = False
    for piece in [PREFACE, *frames(data)]:
        try:
            events = conn.receive_data(piece)
        except h2.exceptions.ProtocolError:
            failed = True
            for cut in outcomes.values():
                if isinstance(cut, Upstream) and not cut.ended and not cut.aborted:
                    _abort(cut, "connection_error")
            break
        for ev in events:
            sid = getattr(ev, "stream_id", 0)
            up = outcomes.get(sid)
            if isinstance(ev, h2.events.RequestReceived):
                decided = _decide(ev)
                if isinstance(decided, Upstream):
                    _check(decided)
                outcomes[sid] = decided
            elif isinstance(up, Upstream) and not up.aborted:
                if up.ended and isinstance(ev, h2.events.DataReceived | h2.events.TrailersReceived):
                    raise AssertionError(f"stream {sid}: bytes after its end went upstream")
                if isinstance(ev, h2.events.DataReceived):
                    _data(up, len(ev.data), ev.stream_ended is not None)
                elif isinstance(ev, h2.events.TrailersReceived):
                    try:
                        check_h2_trailers(list(ev.headers or []))
                        h2_data(up.length, up.received, 0, end=True)
                    except RequestRefused as e:
                        _abort(up, e.reason)
                    else:
                        up.body, up.held = up.body + up.held, 0
                elif isinstance(ev, h2.events.StreamEnded):
                    up.ended = up.head_sent = True
                elif isinstance(ev, h2.events.StreamReset):
                    _abort(up, "client_reset")
                elif isinstance(ev, _TrailersWithoutEnd):  # the gateway's connection reset the stream
                    _abort(up, "bad_trailers")
        conn.data_to_send()
    for sid, up in outcomes.items():
        if isinstance(up, Upstream) and up.ended and up.length is not None and up.body != up.length:
            raise AssertionError(f"stream {sid}: {up.body} bytes ended upstream under content-length {up.length}")
    return outcomes, failed


def one_input(data: bytes) -> None:
    for outcome in run(data)[0].values():
        if isinstance(outcome, str) and not outcome.isidentifier():
            raise AssertionError(f"reason {outcome!r} is not a token")


def classify(data: bytes) -> str:
    outcomes, failed = run(data)
    if not outcomes:
        return "protocol_error" if failed else "none"
    first = outcomes[min(outcomes)]
    if isinstance(first, str):
        return first
    if first.aborted == "connection_error":
        return "cut"
    return f"reset_{first.aborted}" if first.aborted else "ok"


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
