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

Invariant (``one_input``, the client's side): nothing of a refused request reaches the sandbox. ``proxy``
drives the codec as the gateway's HTTP/1.1 front does (gateway/http1.py): a request's head goes upstream
(its end-to-end headers, ``h1_codec.end_to_end``, then the gateway's own X-Forwarded-For) only if no
refusal is ahead of it in what was parsed already (``H1Server.refusal_ahead``: the gateway answers 400),
then its body as it comes, its end; at a refusal nothing more goes (the gateway aborts the link). What went
upstream is read by the sandbox's side (another ``H1Server``, the app's view): it is never refused, the app
reads whole exactly the requests the proxy read whole, each with the gateway's X-Forwarded-For once and no
hop-by-hop header; a refused request never reaches it whole (no end of message); and what it reads is, for
every way the bytes are cut, a prefix of what it reads when they come one byte at a time, where the proxy
stops at the very byte the refusal is found at: so no byte after the refusal point goes upstream.
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
    cuts = list(chunkings(stream))
    results = [_merge(run(kind, pieces)) for pieces in cuts]
    for r in results[1:]:
        if not _same(r, results[0]):
            raise AssertionError(f"the events depend on how the bytes were cut:\n{results[0]}\n{r}")
    if kind == "server":
        _nothing_refused_goes_upstream(cuts)


FORWARDED_FOR = (b"x-forwarded-for", b"192.0.2.1")


def proxy(pieces: list[bytes]) -> tuple[bytes, int, str | None]:
    """What the gateway's HTTP/1.1 front sends upstream for these client bytes (each request on a link of
    its own, joined: each is framed on its own), how many requests it sent whole, and the reason it refused
    one for (before or after its head went), or None."""
    side = h1.H1Server(MAX_HEAD)
    up: list[bytes] = []
    link: h1.H1Client | None = None
    whole = 0
    for piece in [*pieces, b""]:
        side.receive_data(piece)
        while True:
            try:
                ev = side.next_event()
            except h1.H1Error as e:
                return b"".join(up), whole, e.reason  # the link aborted: nothing more goes
            if ev is h1.NEED_DATA:
                if not side.request_done or whole >= MAX_EXCHANGES:
                    break
                side.send_response(200, [(b"content-length", b"0")])
                side.send_eom()
                if side.must_close:
                    return b"".join(up), whole, None
                side.start_next_cycle()
                continue
            if isinstance(ev, h1.Request):
                ahead = side.refusal_ahead()
                if ahead is not None:
                    return b"".join(up), whole, ahead.reason  # answered 400: nothing of it goes upstream
                headers = [(b"host", b"a.test"),
                           *((n, v) for n, v in h1.end_to_end(ev.headers, keep_upgrade=ev.upgrade)
                             if n not in (b"host", FORWARDED_FOR[0])),
                           FORWARDED_FOR]
                if ev.upgrade:
                    headers.append((b"connection", b"upgrade"))
                link = h1.H1Client(MAX_HEAD)
                up.append(link.send_request(ev.method, ev.target, headers))
                if ev.method == b"CONNECT":
                    return b"".join(up), whole + 1, None  # what follows is the tunnel's, not HTTP
                if ev.upgrade:
                    return b"".join(up), whole, None
            elif isinstance(ev, h1.Data):
                assert link is not None
                up.append(link.send_data(ev.data))
            elif isinstance(ev, h1.EndOfMessage):
                assert link is not None
                up.append(link.send_eom(ev.headers))
                whole += 1
            elif isinstance(ev, h1.ConnectionClosed):
                return b"".join(up), whole, None
    return b"".join(up), whole, None


def app_view(up: bytes) -> list[Any]:
    """The sandbox's reading of what went upstream (no end of stream: an aborted link is a reset)."""
    app = h1.H1Server(1 << 20)
    if up:
        app.receive_data(up)  # (b"" would be the end of the stream)
    out: list[Any] = []
    while True:
        ev = app.next_event()  # an H1Error here breaks the invariant: the gateway sent something malformed
        if ev is h1.NEED_DATA:
            if not app.request_done:
                return _merge(out)
            app.send_response(200, [(b"content-length", b"0")])
            app.send_eom()
            if app.must_close:
                return _merge(out)
            app.start_next_cycle()
            continue
        if isinstance(ev, h1.Request):
            names = [n for n, _ in ev.headers]
            if [v for n, v in ev.headers if n == FORWARDED_FOR[0]] != [FORWARDED_FOR[1]]:
                raise AssertionError(f"the gateway's X-Forwarded-For did not reach the app once: {ev.headers}")
            if any(n in h1.HOP_BY_HOP and not (n in (b"connection", b"upgrade") and ev.upgrade) for n in names):
                raise AssertionError(f"a hop-by-hop header reached the app: {ev.headers}")
        out.append(_describe(ev))
        if isinstance(ev, h1.Request) and ev.upgrade:
            return _merge(out)
        if isinstance(ev, h1.EndOfMessage) and app.request is not None and app.request.method == b"CONNECT":
            return _merge(out)


def _is_prefix(a: list[Any], b: list[Any]) -> bool:
    """``a`` is ``b`` cut short: its events the same, its last body possibly shorter."""
    if not a:
        return True
    if len(a) > len(b) or a[:-1] != b[: len(a) - 1]:
        return False
    last, other = a[-1], b[len(a) - 1]
    return last == other or (last[0] == other[0] == "data" and other[1].startswith(last[1]))


def _nothing_refused_goes_upstream(cuts: list[list[bytes]]) -> None:
    runs = [proxy(pieces) for pieces in cuts]
    views = [app_view(up) for up, _, _ in runs]
    bytewise = views[1]  # chunkings' second: one byte at a time (the proxy stops at the refusal's own byte)
    _, _, refused = runs[0]
    whole_view = views[0]  # chunkings' first: all the bytes in one read
    if refused not in (None, "truncated") and whole_view and whole_view[-1][0] != "end":
        # Everything came in one read, so the refusal was known when the request's head was taken: nothing
        # of the refused request may have gone (only a body cut by the end of the stream is found later).
        raise AssertionError(f"a request refused in what came with its head went upstream: {whole_view}")
    for (_, whole, _), view in zip(runs, views, strict=True):
        ends = sum(1 for ev in view if ev[0] == "end")
        if ends != whole:
            raise AssertionError(f"the app read {ends} requests whole, the gateway {whole}: {view}")
        if not _is_prefix(view, bytewise):
            raise AssertionError(f"bytes after the refusal point went upstream:\n{view}\n{bytewise}")
    wholes = {whole for _, whole, _ in runs}
    if len(wholes) != 1:
        raise AssertionError(f"how many requests went whole depends on how the bytes were cut: {wholes}")


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
