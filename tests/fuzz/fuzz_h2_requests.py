"""Fuzz target: what of a client's HTTP/2 requests may reach a sandbox (issue 22 points 8 and 9).

``data`` is what a client sends after the connection preface (this target puts the preface first). It is
fed to an h2 server connection configured as the gateway's (``gateway/http2.py``: no header decoding,
inbound headers validated) one frame at a time, the worst case for a proxy that streams: a head is taken
(and would go upstream) before the frames after it are read. Each request is decided in the gateway's
order: CONNECT or no ``:path`` (501), ``request_rules.check_h2_head``, ``request_rules.upstream_target``
(``admit``'s first step), then the name (``names.Names.request_name``); a refused one goes nowhere (its DATA
is dropped), an accepted one is "sent upstream": its head, its DATA, its end. A connection error h2 raises
aborts every upstream request not complete (the gateway aborts their links: the app sees a reset, never
an end).

Invariant (``one_input``): nothing of a refused request reaches the sandbox, and what does is well formed:
a token method; an origin-form target (``*`` only for OPTIONS), printable, no fragment; lower-case header
names, none connection-specific, ``te`` only ``trailers`` (h2's checks, which the gateway relies on, held
here so a change in h2 shows); at most one ``content-length``, digits; a request that ends upstream carried
exactly its ``content-length`` of DATA; nothing arrives after its end. ``classify(data)``: the first
request's outcome: ``ok`` (forwarded, not cut), its refusal reason, ``protocol_error`` (the connection
failed before its head was taken), ``none`` (no request and no error) or ``cut`` (forwarded, then
aborted by a connection error).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from gateway.names import NameRefused, Names
from gateway.request_rules import RequestRefused, check_h2_head, upstream_target

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
    body: int = 0
    ended: bool = False
    aborted: bool = False


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
    pseudo = {n: v for n, v in headers if n.startswith(b":")}
    method, path = pseudo.get(b":method", b""), pseudo.get(b":path")
    if method == b"CONNECT" or path is None:
        return "connect_unsupported"
    try:
        check_h2_head(headers, ended=ev.stream_ended is not None)
        target = upstream_target(method, path, scheme=NAMES.scheme, http2=True)
        NAMES.request_name(path, [v for n, v in headers if n == b"host"], authority=pseudo.get(b":authority"),
                           http2=True)
    except (RequestRefused, NameRefused) as e:
        return e.reason
    lengths = [v for n, v in headers if n == b"content-length"]
    return Upstream(method, target, [(n, v) for n, v in headers if not n.startswith(b":")],
                    int(lengths[0]) if lengths else None)


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
    config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=True)
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    outcomes: dict[int, Upstream | str] = {}
    failed = False
    for piece in [PREFACE, *frames(data)]:
        try:
            events = conn.receive_data(piece)
        except h2.exceptions.ProtocolError:
            failed = True
            for cut in outcomes.values():
                if isinstance(cut, Upstream) and not cut.ended:
                    cut.aborted = True
            break
        for ev in events:
            sid = getattr(ev, "stream_id", 0)
            up = outcomes.get(sid)
            if isinstance(ev, h2.events.RequestReceived):
                decided = _decide(ev)
                if isinstance(decided, Upstream):
                    _check(decided)
                outcomes[sid] = decided
            elif isinstance(up, Upstream):
                if up.ended and isinstance(ev, h2.events.DataReceived | h2.events.TrailersReceived):
                    raise AssertionError(f"stream {sid}: bytes after its end went upstream")
                if isinstance(ev, h2.events.DataReceived):
                    up.body += len(ev.data)
                elif isinstance(ev, h2.events.StreamEnded):
                    up.ended = True
                elif isinstance(ev, h2.events.StreamReset):
                    up.aborted = True
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
    return "cut" if first.aborted else "ok"


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
