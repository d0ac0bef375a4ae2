"""Fuzz target for the gateway's HTTP/1.1 reading (gateway/h1_codec.py ``H1Server`` and ``H1Client``).

The first byte of ``data`` says which side reads the rest: ``S`` the client connection's (requests in),
``H`` a link's awaiting the answer to a HEAD, ``U`` a link's awaiting the answer to an upgrade request,
any other byte a link's awaiting the answer to a GET. The rest is the byte stream that peer sends, then
its end of stream. ``classify(data)`` is "ok" when every event comes out without a refusal, else the
refusal's reason token (seed names are ``<expected>-<what>``).

Invariant (``one_input``): whatever the bytes, reading gives events of the codec's types, ``NEED_DATA``
or an ``H1Error`` (with a reason token and a 4xx/5xx status), never any other exception; a refusal stays
(asked again, the same error); and the events are the same however the stream is cut: whole, one byte
at a time, and at positions derived from the data. The server side answers each request (with a
response the codec writes) and takes the next, so pipelined requests are read in turn; a link's side
reads one exchange (the gateway sends one request at a time), and anything after its response makes the
link unfit, however it came.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

from gateway import h1_codec as h1

MAX_HEAD = 4096
BYTEWISE = 1024  # bytes fed one at a time before the rest goes in whole
MAX_EXCHANGES = 16


def _side(data: bytes) -> tuple[str, bytes]:
    first = data[:1]
    kind = {b"S": "server", b"H": "head", b"U": "upgrade"}.get(first, "get")
    return kind, data[1:]


def _pieces(stream: bytes, points: set[int]) -> list[bytes]:
    cuts = sorted({p for p in points if 0 < p < len(stream)} | {0, len(stream)})
    return [stream[a:b] for a, b in itertools.pairwise(cuts)]


def chunkings(stream: bytes) -> Iterator[list[bytes]]:
    yield [stream]
    n = len(stream)
    yield [*(stream[i : i + 1] for i in range(min(n, BYTEWISE))), stream[BYTEWISE:]]
    digest = hashlib.sha256(stream).digest()
    yield _pieces(stream, {int.from_bytes(digest[i : i + 2], "big") % (n + 1) for i in range(0, 32, 2)})


def _describe(ev: Any) -> tuple[Any, ...]:
    if isinstance(ev, h1.Request):
        return ("request", ev.method, ev.target, tuple(ev.headers), ev.http_version, ev.keep_alive, ev.upgrade)
    if isinstance(ev, h1.Response):  # InformationalResponse included
        return (type(ev).__name__, ev.status_code, tuple(ev.headers), ev.reason, ev.http_version)
    if isinstance(ev, h1.Data):
        return ("data", ev.data)
    if isinstance(ev, h1.EndOfMessage):
        return ("end", tuple(ev.headers))
    if isinstance(ev, h1.ConnectionClosed):
        return ("closed",)
    raise AssertionError(f"not an event: {ev!r}")


def _new(kind: str) -> h1.H1Server | h1.H1Client:
    if kind == "server":
        return h1.H1Server(MAX_HEAD)
    c = h1.H1Client(MAX_HEAD)
    method = b"HEAD" if kind == "head" else b"GET"
    headers = [(b"host", b"a.test")]
    if kind == "upgrade":
        headers += [(b"connection", b"upgrade"), (b"upgrade", b"websocket")]
    c.send_request(method, b"/", headers)
    return c


def _take(side: h1.H1Server | h1.H1Client, kind: str, out: list[Any]) -> bool:
    """Events until NEED_DATA, the next cycle begun after each whole exchange. False once it ends."""
    while True:
        try:
            ev = side.next_event()
        except h1.H1Error as e:
            if not e.reason or not (400 <= e.http_status <= 599):
                raise AssertionError(f"a refusal without a reason or an error status: {e!r}") from e
            try:
                side.next_event()
            except h1.H1Error as again:
                if again.reason != e.reason:
                    raise AssertionError("a refusal changed when asked again") from e
            else:
                raise AssertionError("a refusal did not stay") from e
            out.append(("error", e.reason, e.http_status))
            return False
        if ev is h1.NEED_DATA:
            if isinstance(side, h1.H1Server) and side.request is not None and side.request.upgrade:
                if not side.response_started:  # the app takes the upgrade: what follows is the new protocol's
                    side.send_informational(101, [(b"connection", b"upgrade"), (b"upgrade", b"websocket")])
                    side.switched()
                return False
            if isinstance(side, h1.H1Server) and side.request_done and _cycles(out) < MAX_EXCHANGES:
                if not side.response_started:
                    side.send_response(200, [(b"content-length", b"0")])
                    side.send_eom()
                if side.must_close:
                    return False
                side.start_next_cycle()
                continue
            return True
        out.append(_describe(ev))
        if isinstance(ev, h1.ConnectionClosed):
            return False


def _cycles(out: list[Any]) -> int:
    return sum(1 for ev in out if ev[0] == "end")


def run(kind: str, pieces: list[bytes]) -> list[Any]:
    side = _new(kind)
    out: list[Any] = []
    taking = True
    for piece in [*pieces, b""]:
        side.receive_data(piece)  # after a switch, the bytes are kept for the new protocol
        if taking and not _take(side, kind, out):
            taking = False
    if isinstance(side, h1.H1Client) and side.switched:
        out.append(("switched", side.trailing_data))
    elif isinstance(side, h1.H1Client) and side.response_done:
        out.append(("unfit", side.unfit))
    if isinstance(side, h1.H1Server) and side.request is not None and side.request.upgrade:
        out.append(("upgraded", side.trailing_data))
    return out


def one_input(data: bytes) -> None:
    kind, stream = _side(data)
    results = [_merge(run(kind, pieces)) for pieces in chunkings(stream)]
    for r in results[1:]:
        if not _same(r, results[0]):
            raise AssertionError(f"the events depend on how the bytes were cut:\n{results[0]}\n{r}")


def _same(a: list[Any], b: list[Any]) -> bool:
    """The same events. One exception: a head over the limit is judged once per read, so whether that or a
    parse refusal further in it comes first depends on the reads (both are refusals, at the same event)."""
    if a == b:
        return True
    if not (a and b and a[-1][0] == "error" and b[-1][0] == "error" and a[:-1] == b[:-1]):
        return False
    return "header_too_large" in (a[-1][1], b[-1][1])


def _merge(events: list[Any]) -> list[Any]:
    """Data events joined (how a body is split follows the reads, not the message)."""
    out: list[Any] = []
    for ev in events:
        if ev[0] == "data" and out and out[-1][0] == "data":
            out[-1] = ("data", out[-1][1] + ev[1])
        elif ev[0] == "data" and not ev[1]:
            continue
        else:
            out.append(ev)
    return out


def classify(data: bytes) -> str:
    kind, stream = _side(data)
    for ev in run(kind, [stream]):
        if ev[0] == "error":
            return str(ev[1])
    return "ok"
