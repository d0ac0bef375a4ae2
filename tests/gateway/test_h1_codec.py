"""gateway/h1_codec.py: the HTTP/1.1 codec of both sides, without sockets.

The strongest check is differential: valid messages written by h11 (an encoder that is not ours) are read by
the codec and by h11, and must give the same events, fed whole, one byte at a time and cut at random
places, pipelined too; and what the codec writes h11 must read back as what was written. Then the cases
the gateway relies on one by one: every refusal with its status and reason token, the framing a response
gets for each kind of request (HTTP/1.0, HEAD, Connection: close), 1xx and 101, a body ended by close, a
HEAD response that names a length, unasked bytes after a response. The fuzz target (tests/fuzz/
fuzz_h1_codec.py, seeds replayed by tests/fuzz/test_seed_replay.py) holds "events or H1Error, nothing
else, however the bytes are cut".
"""

from __future__ import annotations

import itertools
from typing import Any

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import h1_codec as h1
from sbxnet.errors import LocalProtocolError

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-!#$%&'*+.^_`|~", min_size=1, max_size=12)
VCHAR = "".join(chr(c) for c in range(0x21, 0x7F))
VALUE = st.builds(lambda a, b: (a + " " + b).strip() if b else a, st.text(alphabet=VCHAR, min_size=1, max_size=10),
                  st.text(alphabet=VCHAR + " \t", max_size=10).map(str.strip))
RESERVED = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "expect", "te", "trailer"}
HEADERS = st.lists(st.tuples(TOKEN.filter(lambda n: n.lower() not in RESERVED), VALUE), max_size=6)
BODY = st.lists(st.binary(min_size=1, max_size=40), max_size=4)
PATH = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~/%?=&", max_size=20).map(lambda p: "/" + p)
SLOW = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    ps = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(ps)]


def chunkings(data: bytes, points: list[int]) -> list[list[bytes]]:
    return [[data], [data[i : i + 1] for i in range(len(data))], cuts(data, points)]


def norm(events: list[Any]) -> list[tuple[Any, ...]]:
    """Either library's events as plain tuples, bodies joined."""
    out: list[tuple[Any, ...]] = []
    for ev in events:
        if isinstance(ev, (h11.Request, h1.Request)):
            out.append(("request", bytes(ev.method), bytes(ev.target), [(bytes(n), bytes(v)) for n, v in ev.headers],
                        bytes(ev.http_version)))
        elif isinstance(ev, (h11.InformationalResponse, h1.InformationalResponse)):
            out.append(("info", ev.status_code, [(bytes(n), bytes(v)) for n, v in ev.headers], bytes(ev.reason)))
        elif isinstance(ev, (h11.Response, h1.Response)):
            out.append(("response", ev.status_code, [(bytes(n), bytes(v)) for n, v in ev.headers], bytes(ev.reason),
                        bytes(ev.http_version)))
        elif isinstance(ev, (h11.Data, h1.Data)):
            if out and out[-1][0] == "data":
                out[-1] = ("data", out[-1][1] + bytes(ev.data))
            elif ev.data:
                out.append(("data", bytes(ev.data)))
        elif isinstance(ev, (h11.EndOfMessage, h1.EndOfMessage)):
            out.append(("end", [(bytes(n), bytes(v)) for n, v in ev.headers]))
        elif isinstance(ev, (h11.ConnectionClosed, h1.ConnectionClosed)):
            out.append(("closed",))
    return out


def h11_request(method: str, target: str, headers: list[tuple[str, str]], body: list[bytes], framing: str,
                trailers: list[tuple[str, str]]) -> bytes:
    c = h11.Connection(h11.CLIENT)
    hdrs = [("host", "a.test"), *headers]
    if framing == "length":
        hdrs.append(("content-length", str(sum(map(len, body)))))
    elif framing == "chunked":
        hdrs.append(("transfer-encoding", "chunked"))
    else:
        body = []
    out = c.send(h11.Request(method=method, target=target, headers=hdrs)) or b""
    for b in body:
        out += c.send(h11.Data(data=b)) or b""
    return out + (c.send(h11.EndOfMessage(headers=trailers if framing == "chunked" else [])) or b"")


REQUEST = st.builds(h11_request, st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "HEAD"]), PATH,
                    HEADERS, BODY, st.sampled_from(["none", "length", "chunked"]),
                    st.lists(st.tuples(TOKEN.filter(lambda n: n.lower() not in RESERVED), VALUE), max_size=2))


def server_events(pieces: list[bytes]) -> list[Any]:
    """The codec's server side on ``pieces`` then the end of stream, each request answered 200."""
    s = h1.H1Server(1 << 16)
    out: list[Any] = []
    for piece in [*pieces, b""]:
        s.receive_data(piece)
        while True:
            ev = s.next_event()
            if ev is h1.NEED_DATA:
                if s.request_done:
                    s.send_response(200, [(b"content-length", b"0")])
                    s.send_eom()
                    s.start_next_cycle()
                    continue
                break
            out.append(ev)
    return out


def h11_server_events(data: bytes) -> list[Any]:
    s = h11.Connection(h11.SERVER)
    s.receive_data(data)
    s.receive_data(b"")
    out: list[Any] = []
    while True:
        ev = s.next_event()
        if ev is h11.NEED_DATA or ev is h11.PAUSED:
            if s.their_state is h11.DONE:
                s.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                s.send(h11.EndOfMessage())
                s.start_next_cycle()
                continue
            break
        out.append(ev)
        if isinstance(ev, h11.ConnectionClosed):
            break
    return out


@SLOW
@given(st.lists(REQUEST, min_size=1, max_size=3), st.lists(st.integers(0, 10_000), max_size=6))
def test_requests_read_as_h11_reads_them_however_cut(requests: list[bytes], points: list[int]) -> None:
    data = b"".join(requests)
    expected = norm(h11_server_events(data))
    assert [e[0] for e in expected].count("request") == len(requests)
    for pieces in chunkings(data, points):
        assert norm(server_events(pieces)) == expected


def h11_response(status: int, reason: str, headers: list[tuple[str, str]], body: list[bytes], framing: str,
                 method: str, trailers: list[tuple[str, str]]) -> bytes:
    s = h11.Connection(h11.SERVER)
    s.receive_data(h11_request(method, "/", [], [], "none", []))
    while s.next_event() is not h11.NEED_DATA:
        pass
    hdrs = list(headers)
    if framing == "length":
        hdrs.append(("content-length", str(sum(map(len, body)))))
    elif framing == "chunked":
        hdrs.append(("transfer-encoding", "chunked"))
    if method == "HEAD" or status in (204, 304):
        body = []
    out = s.send(h11.Response(status_code=status, reason=reason, headers=hdrs)) or b""
    for b in body:
        out += s.send(h11.Data(data=b)) or b""
    return out + (s.send(h11.EndOfMessage(headers=trailers if framing == "chunked" and method != "HEAD" and
                                          status not in (204, 304) else [])) or b"")


RESPONSE_ARGS = st.tuples(st.sampled_from([200, 201, 204, 206, 301, 304, 400, 404, 500, 503]),
                          st.sampled_from(["", "OK", "Not Found", "Some Reason"]), HEADERS, BODY,
                          st.sampled_from(["length", "chunked"]), st.sampled_from(["GET", "HEAD", "POST"]),
                          st.lists(st.tuples(TOKEN.filter(lambda n: n.lower() not in RESERVED), VALUE), max_size=2))


def client_events(method: str, pieces: list[bytes]) -> tuple[list[Any], h1.H1Client]:
    c = h1.H1Client()
    c.send_request(method.encode(), b"/", [(b"host", b"a.test")])
    out: list[Any] = []
    for piece in pieces:
        c.receive_data(piece)
        while (ev := c.next_event()) is not h1.NEED_DATA:
            out.append(ev)
    if not c.response_done:  # the app's end of stream, when the response needs it to end
        c.receive_data(b"")
        while (ev := c.next_event()) is not h1.NEED_DATA:
            out.append(ev)
    return out, c


def h11_client_events(method: str, data: bytes) -> list[Any]:
    c = h11.Connection(h11.CLIENT)
    c.send(h11.Request(method=method, target="/", headers=[("host", "a.test")]))
    c.send(h11.EndOfMessage())
    c.receive_data(data)
    out: list[Any] = []
    while (ev := c.next_event()) is not h11.NEED_DATA:
        out.append(ev)
        if isinstance(ev, h11.EndOfMessage):
            break
    return out


@SLOW
@given(RESPONSE_ARGS, st.booleans(), st.lists(st.integers(0, 10_000), max_size=6))
def test_responses_read_as_h11_reads_them_however_cut(args: tuple[Any, ...], continue_first: bool,
                                                      points: list[int]) -> None:
    status, reason, headers, body, framing, method, trailers = args
    data = h11_response(status, reason, headers, body, framing, method, trailers)
    if continue_first:
        data = b"HTTP/1.1 100 Continue\r\n\r\n" + data
    expected = norm(h11_client_events(method, data))
    for pieces in chunkings(data, points):
        events, c = client_events(method, pieces)
        assert norm(events) == expected
        assert c.request_done and c.response_done and not c.must_close


@SLOW
@given(REQUEST, st.sampled_from(["1.1", "1.0"]), RESPONSE_ARGS)
def test_what_the_codec_writes_h11_reads_back(request: bytes, version: str, rargs: tuple[Any, ...]) -> None:
    """A request taken by the server side and written again by the client side (as the gateway passes it
    on), and a response written by the server side: h11 reads both as what they were."""
    (req,) = [e for e in server_events([request]) if isinstance(e, h1.Request)]
    c = h1.H1Client()
    body = [e for e in server_events([request]) if isinstance(e, (h1.Data, h1.EndOfMessage))]
    out = c.send_request(req.method, req.target, req.headers)
    for ev in body:
        out += c.send_data(ev.data) if isinstance(ev, h1.Data) else c.send_eom(ev.headers)
    assert c.request_done
    assert norm(h11_server_events(out))[: len(norm(server_events([request])))] == norm(server_events([request]))

    status, reason, headers, chunks, framing, _, trailers = rargs
    s = h1.H1Server(1 << 16)
    s.receive_data(f"GET / HTTP/{version}\r\nhost: a.test\r\n\r\n".encode())
    assert isinstance(s.next_event(), h1.Request)
    hdrs = [(n.encode(), v.encode()) for n, v in headers]
    if status in (204, 304):
        chunks = []
    length = sum(map(len, chunks))
    hdrs.append((b"content-length", str(length).encode()) if framing == "length"
                else (b"transfer-encoding", b"chunked"))
    wire = s.send_response(status, hdrs, reason.encode())
    for chunk in chunks:
        wire += s.send_data(chunk)
    tr = [(n.encode(), v.encode()) for n, v in trailers]
    wire += s.send_eom(tr)
    h11c = h11.Connection(h11.CLIENT)
    h11c.send(h11.Request(method="GET", target="/", headers=[("host", "a.test")], http_version="1.1"))
    h11c.send(h11.EndOfMessage())
    h11c.receive_data(wire)
    if s.must_close:
        h11c.receive_data(b"")
    got: list[Any] = []
    while (back := h11c.next_event()) is not h11.NEED_DATA:
        got.append(back)
        if isinstance(back, h11.EndOfMessage):
            break
    events = norm(got)
    assert events[0][1] == status and events[0][3] == reason.encode()
    assert [e for e in events if e[0] == "data"] == ([("data", b"".join(chunks))] if length else [])
    sent_trailers = tr if framing == "chunked" and version == "1.1" and status not in (204, 304) else []
    assert events[-1] == ("end", sent_trailers)
    assert s.must_close == (version == "1.0")


# -- refusals ------------------------------------------------------------------------------------------

HOST = b"Host: a.test\r\n"
REFUSED_REQUESTS = {
    # the gateway's smuggling corpus and what h11 refused: (status, reason)
    b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n":
        (400, "content_length_with_transfer_encoding"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n":
        (400, "content_length_with_transfer_encoding"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 4\r\nContent-Length: 4\r\n\r\nabcd":
        (400, "duplicate_content_length"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 4, 5\r\n\r\nabcd": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: +4\r\n\r\nabcd": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n": (400, "bad_request"),
    b"GET / HTTP/1.1\r\n" + HOST + b"X-A: 1\r\n  folded\r\n\r\n": (400, "obs_fold"),
    b"GET / HTTP/1.1\r\n" + HOST + b"X-A: 1\r\n\tfolded\r\n\r\n": (400, "obs_fold"),
    b"GET / HTTP/1.1\r\n folded\r\n" + HOST + b"\r\n": (400, "obs_fold"),
    b"GET / HTTP/1.1\r\n" + HOST + b"X-A: a\x00b\r\n\r\n": (400, "bad_request"),
    b"GET / HTTP/1.1\r\n" + HOST + b"X\x01A: b\r\n\r\n": (400, "bad_request"),
    b"GET / HTTP/1.1\r\n" + HOST + b"X-A: a\rb\r\n\r\n": (400, "bad_request"),
    b"GET / HTTP/1.1\nHost: a.test\n\n": (400, "bad_request"),
    b"GET / HTTP/1.1\r\n\r\n": (400, "bad_request"),
    b"GET / HTTP/1.1\r\n" + HOST + HOST + b"\r\n": (400, "bad_request"),
    b"GET / HTTP/2.0\r\n" + HOST + b"\r\n": (400, "bad_request"),
    b"GET / HTTP/0.9\r\n" + HOST + b"\r\n": (400, "bad_request"),
    b"GET /a b HTTP/1.1\r\n" + HOST + b"\r\n": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcd\r\n": (400, "bad_request"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n3\nabc\n0\n\n": (400, "bad_request"),
    b"POST /ws HTTP/1.1\r\n" + HOST + b"Connection: upgrade\r\nUpgrade: websocket\r\nContent-Length: 2\r\n\r\nab":
        (400, "upgrade_with_body"),
    b"GET / HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 2000 + b"\r\n\r\n": (431, "header_too_large"),
    b"GET / HTTP/1.1\r\n" + HOST + b"X-Drip: 1\r\n" * 200: (431, "header_too_large"),
    # a chunked body's lines are bounded as a head is: trailers, and a chunk line that never ends
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n0\r\n" + b"X-T: 1234567890\r\n" * 100:
        (431, "header_too_large"),
    b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n3;ext=" + b"a" * 2000:
        (431, "header_too_large"),
}


@pytest.mark.parametrize("raw", sorted(REFUSED_REQUESTS), ids=range(len(REFUSED_REQUESTS)))
def test_each_refused_request_is_refused_with_its_status_and_reason_however_cut(raw: bytes) -> None:
    status, reason = REFUSED_REQUESTS[raw]
    for pieces in chunkings(raw, [7, 30, 61]):
        s = h1.H1Server(1024)
        refused = None
        # The bounds are judged once per read, on what it brought: a trickle is refused by the read after the
        # one that crossed a callback (here, more of the same bytes).
        for piece in [*pieces, raw[-1:] * 2000]:
            s.receive_data(piece)
            try:
                while s.next_event() is not h1.NEED_DATA:
                    pass
            except h1.H1Error as e:
                refused = e
                break
        assert refused is not None, raw
        assert (refused.http_status, refused.reason) == (status, reason)
        with pytest.raises(h1.H1Error):
            s.next_event()  # it stays refused: nothing after it is parsed


def test_a_refused_request_names_its_method_once_its_request_line_parsed() -> None:
    s = h1.H1Server(1024)
    s.receive_data(b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(h1.H1Error) as e:
        s.next_event()
    assert e.value.method == b"POST"
    s = h1.H1Server(1024)
    s.receive_data(b"\x16\x03\x01\x00")
    with pytest.raises(h1.H1Error) as e:
        s.next_event()
    assert e.value.method == b""


def test_a_pipelined_request_after_a_broken_one_is_never_read_and_one_before_it_is_served() -> None:
    s = h1.H1Server(1024)
    s.receive_data(b"GET /1 HTTP/1.1\r\n" + HOST + b"\r\nGET /2 HTTP/1.1\r\nX\x00: y\r\n\r\nGET /3 HTTP/1.1\r\n" + HOST
                   + b"\r\n")
    assert isinstance(req := s.next_event(), h1.Request) and req.target == b"/1"
    assert isinstance(s.next_event(), h1.EndOfMessage)
    assert s.next_event() is h1.NEED_DATA  # the next waits for this exchange's end
    s.send_response(200, [(b"content-length", b"0")])
    s.send_eom()
    s.start_next_cycle()
    with pytest.raises(h1.H1Error):
        s.next_event()


BAD_RESPONSES = {
    b"SSH-2.0-OpenSSH_9.2\r\n": "bad_response",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc": "bad_response",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n": "bad_response",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc": "bad_response",
    b"HTTP/1.1 200 OK\r\nX: a\x00\r\n\r\n": "bad_response",
    b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n": "bad_response",
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n": "bad_response",  # not asked for
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n": "bad_response",
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc": "truncated",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab": "truncated",
    b"HTTP/1.1 200 OK\r\nContent-": "truncated",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nabHTTP/1.1 200 OK\r\n\r\n": None,  # unasked: see below
}


@pytest.mark.parametrize("raw", sorted(BAD_RESPONSES), ids=range(len(BAD_RESPONSES)))
def test_a_sandbox_that_sends_garbage_gets_a_refusal_the_gateway_answers_502(raw: bytes) -> None:
    reason = BAD_RESPONSES[raw]
    for method in ("GET", "HEAD"):
        if method == "HEAD" and reason == "truncated" and b"\r\n\r\n" in raw:
            continue  # a HEAD response's head is whole: nothing of it was cut
        try:
            events, c = client_events(method, [raw])
        except h1.H1Error as e:
            assert e.http_status == 502
            if method == "HEAD" and b"\r\n\r\n" not in raw:
                reason = "truncated"  # a HEAD's answer is parsed a whole head at a time: this one never ended
            assert e.reason == reason, (method, raw)
        else:
            assert reason is None, (method, raw, events)
            assert c.response_done and c.unfit and c.must_close  # bytes nobody asked for: not reused
            with pytest.raises(LocalProtocolError):
                c.start_next_cycle()


# -- what each side writes -----------------------------------------------------------------------------

def answer(request: bytes, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"",
           ends_by_close: bool = False) -> tuple[bytes, h1.H1Server]:
    s = h1.H1Server(4096)
    s.receive_data(request)
    while s.next_event() is not h1.NEED_DATA:
        pass
    return s.send_response(status, headers, body_ends_by_close=ends_by_close) + s.send_data(body) + s.send_eom(), s


def test_a_response_of_unknown_length_is_chunked_to_http11_and_sent_bare_then_closed_to_http10() -> None:
    wire, s = answer(b"GET / HTTP/1.1\r\n" + HOST + b"\r\n", 200, [(b"x", b"1")], b"hello", ends_by_close=True)
    assert wire == b"HTTP/1.1 200 \r\nx: 1\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    assert not s.must_close
    wire, s = answer(b"GET / HTTP/1.0\r\n\r\n", 200, [(b"transfer-encoding", b"chunked")], b"hello")
    assert wire == b"HTTP/1.1 200 \r\nconnection: close\r\n\r\nhello"
    assert s.must_close


def test_connection_close_asked_or_said_is_written_and_ends_the_connection() -> None:
    for request, headers in ((b"GET / HTTP/1.1\r\n" + HOST + b"Connection: close\r\n\r\n", []),
                             (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", []),  # h11 kept no 1.0 alive
                             (b"GET / HTTP/1.1\r\n" + HOST + b"\r\n", [(b"connection", b"close")])):
        wire, s = answer(request, 200, [(b"content-length", b"2"), *headers], b"ok")
        assert wire.count(b"connection: close\r\n") == 1 and wire.endswith(b"\r\n\r\nok")
        assert s.must_close
        with pytest.raises(LocalProtocolError):
            s.start_next_cycle()


def test_head_1xx_204_304_answers_have_no_body_whatever_their_headers_say() -> None:
    wire, s = answer(b"HEAD / HTTP/1.1\r\n" + HOST + b"\r\n", 200, [(b"content-length", b"1000")])
    assert wire == b"HTTP/1.1 200 \r\ncontent-length: 1000\r\n\r\n"
    s.start_next_cycle()
    wire, _ = answer(b"GET / HTTP/1.1\r\n" + HOST + b"\r\n", 304, [(b"etag", b'"x"')])
    assert wire == b'HTTP/1.1 304 \r\netag: "x"\r\n\r\n'
    events, c = client_events("HEAD", [b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"])
    assert norm(events) == [("response", 200, [(b"content-length", b"1000")], b"OK", b"1.1"), ("end", [])]
    assert not c.must_close
    c.start_next_cycle()  # the link is fit for the next request
    c.send_request(b"GET", b"/", [(b"host", b"a.test")])
    c.receive_data(b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n")
    assert norm([c.next_event(), c.next_event()]) == [("response", 204, [(b"content-length", b"7")], b"No Content",
                                                       b"1.1"), ("end", [])]


def test_keep_alive_link_reads_one_response_per_request() -> None:
    c = h1.H1Client()
    for i in range(3):
        c.send_request(b"GET", f"/{i}".encode(), [(b"host", b"a.test")])
        c.receive_data(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n" + str(i).encode())
        evs = [c.next_event() for _ in range(3)]
        assert isinstance(evs[1], h1.Data) and evs[1].data == str(i).encode()
        assert not c.must_close
        c.start_next_cycle()


def test_a_response_that_ends_by_close_ends_at_the_end_of_stream_and_ends_the_link() -> None:
    events, c = client_events("GET", [b"HTTP/1.1 200 OK\r\n\r\nall", b" of it"])
    assert norm(events) == [("response", 200, [], b"OK", b"1.1"), ("data", b"all of it"), ("end", [])]
    assert c.body_ends_by_close and c.must_close
    events, c = client_events("GET", [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"])
    assert c.response_done and c.must_close  # HTTP/1.0: not kept


def test_an_upgrade_the_app_takes_leaves_the_bytes_after_it_for_the_tunnel_both_ways() -> None:
    s = h1.H1Server(4096)
    s.receive_data(b"GET /ws HTTP/1.1\r\n" + HOST + b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x02hi")
    req = s.next_event()
    assert isinstance(req, h1.Request) and req.upgrade
    assert isinstance(s.next_event(), h1.EndOfMessage)
    s.receive_data(b"more")
    assert s.trailing_data == b"\x81\x02himore"
    c = h1.H1Client()
    c.send_request(b"GET", b"/ws", [(b"host", b"a.test"), (b"connection", b"upgrade"), (b"upgrade", b"websocket")])
    c.receive_data(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x01x")
    ev = c.next_event()
    assert isinstance(ev, h1.InformationalResponse) and ev.status_code == 101
    assert c.switched and c.must_close and c.trailing_data == b"\x81\x01x"
    assert c.next_event() is h1.NEED_DATA


def test_an_upgrade_the_app_refuses_goes_on_as_http() -> None:
    s = h1.H1Server(4096)
    s.receive_data(b"GET /ws HTTP/1.1\r\n" + HOST + b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
                   b"GET /next HTTP/1.1\r\n" + HOST + b"\r\n")
    assert isinstance(s.next_event(), h1.Request)
    assert isinstance(s.next_event(), h1.EndOfMessage)
    s.send_response(426, [(b"content-length", b"0")])
    s.send_eom()
    s.start_next_cycle()
    req = s.next_event()
    assert isinstance(req, h1.Request) and req.target == b"/next"


def test_informational_heads_come_before_the_response_and_expect_100_is_passed_through() -> None:
    events, _ = client_events("POST", [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                                       b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"])
    assert [e[0] for e in norm(events)] == ["info", "info", "response", "data", "end"]
    s = h1.H1Server(4096)
    s.receive_data(b"PUT / HTTP/1.1\r\n" + HOST + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    req = s.next_event()
    assert (b"expect", b"100-continue") in req.headers
    assert s.send_informational(100, [], b"Continue") == b"HTTP/1.1 100 Continue\r\n\r\n"


def test_the_writers_refuse_what_would_break_the_framing() -> None:
    c = h1.H1Client()
    c.send_request(b"POST", b"/", [(b"host", b"a"), (b"content-length", b"2")])
    with pytest.raises(LocalProtocolError):
        c.send_data(b"abc")
    with pytest.raises(LocalProtocolError):
        c.send_eom()  # two bytes promised, none sent
    with pytest.raises(LocalProtocolError):
        h1.serialise_request_head(b"GET", b"/", [(b"x", b"a\r\nInjected: 1")])
    with pytest.raises(LocalProtocolError):
        h1.serialise_response_head(200, b"OK\r\n", [])


def test_request_heads_put_host_first_and_chunked_trailers_go_out() -> None:
    c = h1.H1Client()
    head = c.send_request(b"POST", b"/u", [(b"x-a", b"1"), (b"host", b"a.test"), (b"transfer-encoding", b"chunked")])
    assert head == b"POST /u HTTP/1.1\r\nhost: a.test\r\nx-a: 1\r\ntransfer-encoding: chunked\r\n\r\n"
    assert c.send_data(b"abc") == b"3\r\nabc\r\n"
    assert c.send_eom([(b"x-sum", b"9")]) == b"0\r\nx-sum: 9\r\n\r\n"


def test_ready_body_takes_only_a_body_already_parsed_and_leaves_the_rest_for_next_event() -> None:
    s = h1.H1Server(1024)
    s.receive_data(b"POST /u HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
    assert isinstance(s.next_event(), h1.Request)
    assert isinstance(d := s.ready_body(), h1.Data) and d.data == b"abc"
    assert s.ready_body() is None and s.next_event() is h1.NEED_DATA  # nothing more came
    s.receive_data(b"0\r\nT: 1\r\n\r\nGET /next HTTP/1.1\r\n" + HOST + b"\r\n\r\n")
    assert isinstance(end := s.ready_body(), h1.EndOfMessage) and end.headers == [(b"t", b"1")]
    assert s.request_done and s.ready_body() is None  # the pipelined request waits for the next cycle
    # A refusal is left in place: next_event raises it, as it would have without ready_body.
    bad = h1.H1Server(1024)
    bad.receive_data(b"POST /u HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
    assert isinstance(bad.next_event(), h1.Request)
    assert bad.ready_body() is None
    with pytest.raises(h1.H1Error):
        bad.next_event()
    # So is the end of the stream in the middle of a body.
    cut = h1.H1Server(1024)
    cut.receive_data(b"POST /u HTTP/1.1\r\n" + HOST + b"Content-Length: 5\r\n\r\nab")
    assert isinstance(cut.next_event(), h1.Request)
    assert isinstance(cut.ready_body(), h1.Data)
    cut.receive_data(b"")
    assert cut.ready_body() is None
    with pytest.raises(h1.H1Error):
        cut.next_event()


# -- issue 22 points 4 and 10: framing errors after the head, and hop-by-hop headers ------------------------

CHUNKED_HEAD = b"POST /u HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n"
# Malformed chunked bodies (after a valid head), each with the reason it is refused for.
BAD_CHUNKED = {
    b" 5\r\nhello\r\n0\r\n\r\n": "bad_request",  # a space before the size (issue 22's case)
    b"5 \r\nhello\r\n0\r\n\r\n": "bad_request",  # and after it
    b"\t5\r\nhello\r\n0\r\n\r\n": "bad_request",
    b"+5\r\nhello\r\n0\r\n\r\n": "bad_request",
    b"0x5\r\nhello\r\n0\r\n\r\n": "bad_request",
    b"5\r\nhello\r\n 0\r\n\r\n": "bad_request",  # the last chunk's size with a space
    b"5\r\nhello\r\n0 \r\n\r\n": "bad_request",
    b"fffffffffffffffff\r\nhello\r\n0\r\n\r\n": "bad_request",  # overlong hex: overflow
    b"5\nhello\r\n0\r\n\r\n": "bad_request",  # no CR after the size
    b"5\r\nhelloXX0\r\n\r\n": "bad_request",  # no CRLF after the data
    b"5\r\nhello\r\n\r\n": "bad_request",  # an empty size line
    b"5; a=b\r\nhello\r\n0\r\n\r\n": "bad_request",  # a space in an extension
    b"5;a=\"b\r\nhello\r\n0\r\n\r\n": "bad_request",  # an unterminated quoted extension
    b"5;\x00\r\nhello\r\n0\r\n\r\n": "bad_request",
    b"5\r\nhello\r\n0\r\nTransfer-Encoding: chunked\r\n\r\n": "bad_request",  # trailers that frame
    b"5\r\nhello\r\n0\r\nContent-Length: 5\r\n\r\n": "content_length_with_transfer_encoding",
    b"5\r\nhello\r\n0\r\nHost: b.test\r\n\r\n": "bad_trailer",  # or route
    b"5\r\nhello\r\n0\r\nConnection: close\r\n\r\n": "bad_trailer",  # or are hop-by-hop
    b"5\r\nhello\r\n0\r\nTrailer: x\r\n\r\n": "bad_trailer",
    b"5\r\nhello\r\n0\r\nTE: trailers\r\n\r\n": "bad_trailer",
    b"5\r\nhello\r\n0\r\nX-A : 1\r\n\r\n": "bad_request",
}


def _events_until_refusal(s: h1.H1Server, pieces: list[bytes]) -> tuple[list[Any], h1.H1Error | None]:
    events: list[Any] = []
    for piece in pieces:
        s.receive_data(piece)
        try:
            while (ev := s.next_event()) is not h1.NEED_DATA:
                events.append(ev)
        except h1.H1Error as e:
            return events, e
    return events, None


@pytest.mark.parametrize("body", sorted(BAD_CHUNKED), ids=range(len(BAD_CHUNKED)))
def test_a_malformed_chunked_body_is_refused_and_known_before_anything_goes_up_when_it_came_with_the_head(
        body: bytes) -> None:
    """Whole, byte by byte and cut elsewhere: the refusal comes with its reason, no end of the request ever
    comes before it, and a pipelined request after it is never read. When the bad bytes came with the head
    (one read), ``refusal_ahead`` says so as the head is taken: the gateway answers 400, sending nothing."""
    reason = BAD_CHUNKED[body]
    raw = CHUNKED_HEAD + body + b"GET /next HTTP/1.1\r\n" + HOST + b"\r\n"
    for pieces in chunkings(raw, [len(CHUNKED_HEAD) + 1, len(CHUNKED_HEAD) + 7, len(raw) - 3]):
        events, refused = _events_until_refusal(h1.H1Server(1024), [*pieces, b""])
        assert refused is not None and (refused.reason, refused.http_status) == (reason, 400), (pieces, events)
        assert isinstance(events[0], h1.Request) and events[0].target == b"/u"
        assert not any(isinstance(ev, (h1.EndOfMessage, h1.Request)) for ev in events[1:]), events
    s = h1.H1Server(1024)
    s.receive_data(raw)
    assert isinstance(s.next_event(), h1.Request)
    ahead = s.refusal_ahead()
    assert ahead is not None and ahead.reason == reason
    with pytest.raises(h1.H1Error):
        while s.next_event() is not h1.NEED_DATA:
            pass


def test_refusal_ahead_is_none_for_a_good_body_a_body_not_here_yet_and_after_the_end() -> None:
    s = h1.H1Server(1024)
    s.receive_data(CHUNKED_HEAD + b"5\r\nhello\r\n")
    assert isinstance(s.next_event(), h1.Request)
    assert s.refusal_ahead() is None  # nothing wrong so far
    assert isinstance(s.next_event(), h1.Data)
    s.receive_data(b" 3\r\nabc\r\n0\r\n\r\n")  # the bad size comes after the head and some body went
    assert s.refusal_ahead() is not None
    with pytest.raises(h1.H1Error):
        s.next_event()
    good = h1.H1Server(1024)
    good.receive_data(CHUNKED_HEAD + b"5\r\nhello\r\n0\r\n\r\nGET / HTTP/1.1\r\nX\x00: 1\r\n\r\n")
    assert isinstance(good.next_event(), h1.Request)
    assert good.refusal_ahead() is None  # the broken request after this one's end is not this one's
    assert isinstance(good.next_event(), h1.Data) and isinstance(good.next_event(), h1.EndOfMessage)
    assert good.refusal_ahead() is None


@pytest.mark.parametrize("option", [b"Content-Length", b"transfer-encoding", b"HOST", b"close, Content-Length",
                                    b"keep-alive,transfer-encoding"])
def test_a_connection_option_naming_a_framing_header_is_400_however_cut(option: bytes) -> None:
    framing = b"Content-Length: 5\r\n\r\nhello" if b"ength" in option or b"HOST" in option else \
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    raw = (b"POST /u HTTP/1.1\r\n" + HOST + b"Connection: " + option + b"\r\n" + framing
           + b"GET /next HTTP/1.1\r\n" + HOST)
    for pieces in chunkings(raw, [20, 40, 60]):
        events, refused = _events_until_refusal(h1.H1Server(1024), [*pieces, b""])
        assert events == [] and refused is not None, (pieces, events)  # refused at its head: no Request event
        assert (refused.reason, refused.http_status, refused.method) == ("connection_names_framing", 400, b"POST")


def test_a_response_that_names_its_framing_in_connection_or_frames_in_trailers_is_refused() -> None:
    for raw in (b"HTTP/1.1 200 OK\r\nConnection: content-length\r\nContent-Length: 2\r\n\r\nok",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nHost: x\r\n\r\n"):
        with pytest.raises(h1.H1Error) as e:
            client_events("GET", [raw])
        assert (e.value.reason, e.value.http_status) == ("bad_response", 502)


def test_end_to_end_drops_hop_by_hop_headers_and_what_connection_names_and_nothing_else() -> None:
    headers = [(b"host", b"a.test"), (b"connection", b"close, X-Forwarded-For, x-custom"), (b"x-custom", b"1"),
               (b"X-Forwarded-For", b"6.6.6.6"), (b"keep-alive", b"5"), (b"te", b"trailers"), (b"accept", b"*/*"),
               (b"upgrade", b"websocket"), (b"proxy-authorization", b"x")]
    assert h1.end_to_end(headers) == [(b"host", b"a.test"), (b"accept", b"*/*")]
    assert h1.end_to_end(headers, keep_upgrade=True) == [(b"host", b"a.test"), (b"accept", b"*/*"),
                                                        (b"upgrade", b"websocket")]
