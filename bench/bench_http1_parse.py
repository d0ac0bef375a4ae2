"""What the gateway's HTTP/1.1 machinery costs per keep-alive request, outside the gateway: the work of
one proxied exchange (the client's request parsed, the upstream request serialised, the sandbox's response
parsed, the client's response serialised) three ways: h11's four state machines (as ``gateway/http1.py``
ran it before), ``gateway/h1_codec`` (what it runs now: httptools underneath, ``H1Server`` and
``H1Client`` with their checks and framing), and httptools alone with the two heads serialised by a join.
The last arm is not a gateway: it is the floor of what a parser swap could save (no validation, no state
machine).

Run: .venv/bin/pytest bench/bench_http1_parse.py -p no:cacheprovider --benchmark-columns=min,median,max
The machine is shared: compare the arms of one run, not numbers across runs.
"""

from __future__ import annotations

from typing import Any

import h11
import httptools

from gateway import h1_codec as h1

REQUEST = (b"GET /small HTTP/1.1\r\nhost: alpha.example.test\r\nuser-agent: h2load nghttp2/1.52.0\r\n"
           b"accept: */*\r\n\r\n")
BODY = b"x" * 100
RESPONSE = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 19:00:00 GMT\r\n"
            b"Content-Type: text/plain\r\nContent-Length: 100\r\nLast-Modified: Tue, 01 Dec 2026 18:00:00 GMT\r\n"
            b"Connection: keep-alive\r\nETag: \"abc\"\r\nAccept-Ranges: bytes\r\n\r\n" + BODY)
ROUNDS = 200  # exchanges per timed call


def h11_exchanges(n: int) -> int:
    srv, cli = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    out = 0
    for _ in range(n):
        srv.receive_data(REQUEST)
        req = srv.next_event()
        assert isinstance(req, h11.Request)
        assert isinstance(srv.next_event(), h11.EndOfMessage)
        out += len(cli.send(h11.Request(method=req.method, target=req.target,
                                        headers=[*req.headers, (b"x-forwarded-for", b"192.0.2.1")])) or b"")
        cli.send(h11.EndOfMessage())
        cli.receive_data(RESPONSE)
        resp, data, end = cli.next_event(), cli.next_event(), cli.next_event()
        assert isinstance(resp, h11.Response) and isinstance(data, h11.Data) and isinstance(end, h11.EndOfMessage)
        out += len(srv.send(h11.Response(status_code=resp.status_code, headers=resp.headers, reason=resp.reason))
                   or b"")
        out += len(srv.send(h11.Data(data=data.data)) or b"")
        srv.send(h11.EndOfMessage())
        srv.start_next_cycle()
        cli.start_next_cycle()
    return out


def codec_exchanges(n: int) -> int:
    srv, cli = h1.H1Server(16384), h1.H1Client()
    out = 0
    for _ in range(n):
        srv.receive_data(REQUEST)
        req = srv.next_event()
        assert isinstance(req, h1.Request)
        assert isinstance(srv.next_event(), h1.EndOfMessage)
        out += len(cli.send_request(req.method, req.target, [*req.headers, (b"x-forwarded-for", b"192.0.2.1")]))
        cli.receive_data(RESPONSE)
        resp, data, end = cli.next_event(), cli.next_event(), cli.next_event()
        assert isinstance(resp, h1.Response) and isinstance(data, h1.Data) and isinstance(end, h1.EndOfMessage)
        out += len(srv.send_response(resp.status_code, resp.headers, resp.reason))
        out += len(srv.send_data(data.data))
        srv.send_eom()
        srv.start_next_cycle()
        cli.start_next_cycle()
    return out


class _Msg:
    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.body = b""
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


def httptools_exchanges(n: int) -> int:
    out = 0
    for _ in range(n):
        req = _Msg()
        httptools.HttpRequestParser(req).feed_data(REQUEST)
        assert req.done
        head = [b"GET " + req.url + b" HTTP/1.1\r\n"]
        head += [k + b": " + v + b"\r\n" for k, v in req.headers]
        head.append(b"x-forwarded-for: 192.0.2.1\r\n\r\n")
        out += len(b"".join(head))
        resp = _Msg()
        p = httptools.HttpResponseParser(resp)
        p.feed_data(RESPONSE)
        assert resp.done and p.get_status_code() == 200
        back = [b"HTTP/1.1 200 OK\r\n", *(k + b": " + v + b"\r\n" for k, v in resp.headers), b"\r\n"]
        out += len(b"".join(back)) + len(resp.body)
    return out


def test_h11_exchange(benchmark: Any) -> None:
    n = benchmark(h11_exchanges, ROUNDS)
    assert n > 0
    benchmark.extra_info["exchanges_per_call"] = ROUNDS


def test_codec_exchange(benchmark: Any) -> None:
    n = benchmark(codec_exchanges, ROUNDS)
    assert n > 0
    benchmark.extra_info["exchanges_per_call"] = ROUNDS


def test_httptools_exchange(benchmark: Any) -> None:
    n = benchmark(httptools_exchanges, ROUNDS)
    assert n > 0
    benchmark.extra_info["exchanges_per_call"] = ROUNDS
