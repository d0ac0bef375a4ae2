"""Regenerates the HTTP/1.1 codec seed corpus under tests/seeds/h1_codec/ (run by hand; the files are committed).

Each seed is what ``fuzz_h1_codec.one_input`` takes: one byte choosing the side (``S`` the client
connection's, ``G``/``H``/``U`` a link's after a GET, a HEAD, an upgrade request), then the peer's bytes;
each is named ``<expected>-<what>`` (``ok`` or the refusal's reason), which the replay checks with
``classify``. The well-formed messages are written by h11 (an encoder that is not the codec's); the
smuggling corpus and the broken ones by hand. Usage: .venv/bin/python tests/fuzz/make_h1_codec_seeds.py
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import h11
from seed_dir import write_seeds

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "seeds" / "h1_codec"
HOST = b"Host: a.test\r\n"


def h11_request(method: str, target: str, headers: list[tuple[str, str]], body: Sequence[bytes] = (),
                trailers: Sequence[tuple[str, str]] = ()) -> bytes:
    c = h11.Connection(h11.CLIENT)
    out = c.send(h11.Request(method=method, target=target, headers=[("host", "a.test"), *headers])) or b""
    for b in body:
        out += c.send(h11.Data(data=b)) or b""
    return out + (c.send(h11.EndOfMessage(headers=list(trailers))) or b"")


def h11_response(status: int, headers: list[tuple[str, str]], body: Sequence[bytes] = (),
                 trailers: Sequence[tuple[str, str]] = (), method: str = "GET") -> bytes:
    s = h11.Connection(h11.SERVER)
    s.receive_data(h11_request(method, "/", []))
    while s.next_event() is not h11.NEED_DATA:
        pass
    out = s.send(h11.Response(status_code=status, headers=headers)) or b""
    for b in body:
        out += s.send(h11.Data(data=b)) or b""
    return out + (s.send(h11.EndOfMessage(headers=list(trailers))) or b"")


def seeds() -> dict[str, bytes]:
    s: dict[str, bytes] = {}
    # Requests that pass.
    s["ok-get"] = b"S" + h11_request("GET", "/x?y=1", [("accept", "*/*")])
    s["ok-post-length"] = b"S" + h11_request("POST", "/p", [("content-length", "5")], [b"hello"])
    s["ok-post-chunked-with-trailers"] = b"S" + h11_request(
        "POST", "/p", [("transfer-encoding", "chunked")], [b"abc", b"defgh"], [("x-checksum", "1")])
    s["ok-pipelined-three"] = b"S" + h11_request("GET", "/1", []) + h11_request(
        "POST", "/2", [("content-length", "2")], [b"ab"]) + h11_request("GET", "/3", [("connection", "close")])
    s["ok-http10"] = b"S" + b"GET / HTTP/1.0\r\n\r\n"
    s["ok-absolute-form"] = b"S" + b"GET http://a.test/x HTTP/1.1\r\n" + HOST + b"\r\n"
    s["ok-expect-100-continue"] = b"S" + h11_request("PUT", "/u", [("expect", "100-continue"),
                                                                    ("content-length", "3")], [b"abc"])
    s["ok-websocket-upgrade-then-bytes"] = (b"S" + b"GET /ws HTTP/1.1\r\n" + HOST +
                                            b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x05hello")
    s["ok-chunk-extension"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Transfer-Encoding: chunked\r\n\r\n3;name=v\r\nabc\r\n0\r\n\r\n")
    s["ok-empty"] = b"S"
    # The smuggling corpus (tests/gateway/test_gateway_http.py) and what h11 refused.
    s["content_length_with_transfer_encoding-cl-te"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    s["content_length_with_transfer_encoding-te-cl"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n")
    s["duplicate_content_length-cl-cl"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Content-Length: 4\r\nContent-Length: 4\r\n\r\nabcd")
    s["bad_request-cl-list"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 4, 5\r\n\r\nabcd"
    s["bad_request-cl-negative"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: -1\r\n\r\n"
    s["bad_request-te-obfuscated"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n")
    s["bad_request-te-gzip-chunked"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n")
    s["bad_request-te-space-before-colon"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n")
    s["obs_fold-folded-line"] = b"S" + b"GET / HTTP/1.1\r\n" + HOST + b"X-A: 1\r\n  folded\r\n\r\n"
    s["bad_request-nul-in-value"] = b"S" + b"GET / HTTP/1.1\r\n" + HOST + b"X-A: a\x00b\r\n\r\n"
    s["bad_request-control-in-name"] = b"S" + b"GET / HTTP/1.1\r\n" + HOST + b"X\x01A: b\r\n\r\n"
    s["bad_request-bare-lf"] = b"S" + b"GET / HTTP/1.1\nHost: a.test\n\n"
    s["bad_request-no-host"] = b"S" + b"GET / HTTP/1.1\r\n\r\n"
    s["bad_request-two-hosts"] = b"S" + b"GET / HTTP/1.1\r\n" + HOST + HOST + b"\r\n"
    s["bad_request-http2-version"] = b"S" + b"GET / HTTP/2.0\r\n" + HOST + b"\r\n"
    s["bad_request-bad-chunk-size"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
    s["bad_request-chunk-without-crlf"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + (
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcd\r\n0\r\n\r\n")
    s["upgrade_with_body-websocket-post"] = b"S" + b"POST /ws HTTP/1.1\r\n" + HOST + (
        b"Connection: upgrade\r\nUpgrade: websocket\r\nContent-Length: 2\r\n\r\nab")
    s["header_too_large-one-long-header"] = b"S" + b"GET / HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 5000 + b"\r\n\r\n"
    s["header_too_large-endless-head"] = b"S" + b"GET / HTTP/1.1\r\n" + HOST + b"X-Drip: 1\r\n" * 500
    s["truncated-body-cut"] = b"S" + b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 10\r\n\r\nabc"
    s["bad_request-second-pipelined-broken"] = (b"S" + h11_request("GET", "/1", [])
                                                + b"GET / HTTP/1.1\r\nX\x00: 1\r\n\r\n")
    s["bad_request-garbage"] = b"S" + b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"
    # Issue 22 point 4: malformed chunked bodies after a valid head. The replay holds each to "nothing after
    # the refusal reaches the sandbox" (fuzz_h1_codec.py's proxy): whole, the refusal is ahead of the head
    # (400, nothing sent); byte by byte the head and the body before the bad byte went, then nothing.
    chunked = b"POST /u HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n"
    after = h11_request("GET", "/after", [])  # a pipelined request behind it: never read, never sent
    for name, body in {
        "chunk-size-leading-space": b" 5\r\nhello\r\n0\r\n\r\n",
        "chunk-size-trailing-space": b"5 \r\nhello\r\n0\r\n\r\n",
        "chunk-size-leading-tab": b"\t5\r\nhello\r\n0\r\n\r\n",
        "chunk-size-plus-sign": b"+5\r\nhello\r\n0\r\n\r\n",
        "chunk-size-0x-prefix": b"0x5\r\nhello\r\n0\r\n\r\n",
        "chunk-size-not-hex": b"5g\r\nhello\r\n0\r\n\r\n",
        "chunk-size-overlong-hex": b"1" + b"0" * 16 + b"\r\nhello\r\n0\r\n\r\n",
        "last-chunk-size-leading-space": b"5\r\nhello\r\n 0\r\n\r\n",
        "last-chunk-size-trailing-space": b"5\r\nhello\r\n0 \r\n\r\n",
        "second-chunk-size-space-after-data": b"5\r\nhello\r\n 3\r\nabc\r\n0\r\n\r\n",
        "chunk-size-bare-lf": b"5\nhello\r\n0\r\n\r\n",
        "chunk-data-without-crlf": b"5\r\nhelloXX0\r\n\r\n",
        "chunk-data-bare-lf": b"5\r\nhello\n0\r\n\r\n",
        "chunk-empty-size-line": b"5\r\nhello\r\n\r\n0\r\n\r\n",
        "chunk-extension-space": b"5; a=b\r\nhello\r\n0\r\n\r\n",
        "chunk-extension-unterminated-quote": b"5;a=\"b\r\nhello\r\n0\r\n\r\n",
        "chunk-extension-nul": b"5;a\x00\r\nhello\r\n0\r\n\r\n",
        "chunk-extension-bare-cr": b"5;a\rb\r\nhello\r\n0\r\n\r\n",
        "trailer-transfer-encoding": b"5\r\nhello\r\n0\r\nTransfer-Encoding: chunked\r\n\r\n",
        "trailer-space-before-colon": b"5\r\nhello\r\n0\r\nX-A : 1\r\n\r\n",
        "trailer-obs-fold-start": b"5\r\nhello\r\n0\r\n X-A: 1\r\n\r\n",
    }.items():
        s[f"bad_request-{name}"] = b"S" + chunked + body + after
    s["content_length_with_transfer_encoding-trailer-content-length"] = (
        b"S" + chunked + b"5\r\nhello\r\n0\r\nContent-Length: 5\r\n\r\n" + after)
    for field in (b"Host: b.test", b"Connection: close", b"TE: trailers", b"Trailer: x-a", b"Upgrade: websocket",
                  b"Keep-Alive: 5", b"Proxy-Authorization: x"):
        what = field.split(b":")[0].lower().decode()
        s[f"bad_trailer-trailer-{what}"] = b"S" + chunked + b"5\r\nhello\r\n0\r\n" + field + b"\r\n\r\n" + after
    # A chunk extension that never ends: judged per read, so 431 when it trickles in, cut at the end of stream
    # when it all came in one read (classify's whole feed).
    s["truncated-chunk-extension-endless-in-one-read"] = b"S" + chunked + b"5;x=" + b"a" * 5000
    # A refused trailer field, then a malformed line: the malformed line is refused, however the bytes are cut
    # (trailers are judged once whole, as a head is).
    s["bad_request-trailer-connection-then-malformed-line"] = (b"S" + chunked + b"5\r\nhello\r\n0\r\n"
                                                               b"Connection: close\r\n0\r\n" + after)
    s["truncated-chunked-body-cut-in-data"] = b"S" + chunked + b"5\r\nhel"
    s["truncated-chunked-body-cut-before-last-chunk"] = b"S" + chunked + b"5\r\nhello\r\n"
    s["truncated-length-body-cut"] = b"S" + b"PUT /u HTTP/1.1\r\n" + HOST + b"Content-Length: 100\r\n\r\nhello"
    s["bad_request-pipelined-good-then-bad-chunk"] = (b"S" + h11_request("POST", "/1", [("content-length", "2")],
                                                                        [b"ab"]) + chunked + b" 5\r\nhello\r\n")
    s["ok-chunk-size-leading-zeros"] = b"S" + chunked + b"0" * 20 + b"5\r\nhello\r\n0\r\n\r\n"
    s["ok-chunk-size-upper-hex"] = b"S" + chunked + b"A\r\n0123456789\r\n0\r\n\r\n"
    # Issue 22 point 10: a Connection option naming a framing header is refused at its head (nothing sent);
    # one naming the gateway's own headers passes, and the replay checks X-Forwarded-For still reaches the app.
    for name, head in {
        "content-length": b"Connection: Content-Length\r\nContent-Length: 5\r\n\r\nhello",
        "transfer-encoding": b"Connection: transfer-encoding\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "host": b"Connection: Host\r\n\r\n",
        "in-a-list": b"Connection: close, content-length\r\nContent-Length: 1\r\n\r\nx",
        "two-connection-headers": b"Connection: keep-alive\r\nConnection: Transfer-Encoding\r\n\r\n",
    }.items():
        s[f"connection_names_framing-{name}"] = b"S" + b"POST /p HTTP/1.1\r\n" + HOST + head + after
    s["ok-connection-names-x-forwarded"] = b"S" + h11_request(
        "GET", "/", [("connection", "close, X-Forwarded-For, X-Forwarded-Proto, X-Forwarded-Host"),
                     ("x-forwarded-for", "6.6.6.6")])
    s["ok-connection-names-hop-by-hop-custom"] = b"S" + h11_request(
        "GET", "/", [("connection", "keep-alive, x-private"), ("x-private", "1"), ("keep-alive", "5"),
                     ("te", "trailers"), ("x-public", "2")]) + h11_request("GET", "/2", [])
    # Responses that pass.
    s["ok-response-length"] = b"G" + h11_response(200, [("content-length", "5")], [b"hello"])
    s["ok-response-chunked-trailers"] = b"G" + h11_response(200, [("transfer-encoding", "chunked")], [b"ab", b"cd"],
                                                            [("grpc-status", "0")])
    s["ok-response-ends-by-close"] = b"G" + b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"
    s["ok-response-http10"] = b"G" + b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"
    s["ok-response-100-then-200"] = b"G" + b"HTTP/1.1 100 Continue\r\n\r\n" + h11_response(
        200, [("content-length", "2")], [b"ok"])
    s["ok-response-204-with-length"] = b"G" + b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"
    s["ok-response-304"] = b"G" + b"HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\n\r\n"
    s["ok-response-empty-reason"] = b"G" + b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\nok"
    s["ok-response-keep-alive-two"] = b"G" + h11_response(200, [("content-length", "1")], [b"a"]) + h11_response(
        404, [("content-length", "1")], [b"b"])
    s["ok-head-response-with-length"] = b"H" + b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
    s["ok-head-response-chunked"] = b"H" + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    s["ok-head-response-after-100"] = (b"H" + b"HTTP/1.1 100 Continue\r\n\r\n"
                                       b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n")
    s["ok-switch-101-then-bytes"] = (b"U" + b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                                     b"Upgrade: websocket\r\n\r\n\x81\x02hi")
    s["ok-upgrade-refused-200"] = b"U" + h11_response(200, [("content-length", "2")], [b"no"])
    s["bad_response-101-unasked"] = (b"G" + b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                                     b"Upgrade: x\r\n\r\n")
    s["bad_response-garbage"] = b"G" + b"SSH-2.0-OpenSSH_9.2\r\n"
    s["bad_response-te-gzip"] = b"G" + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc"
    s["bad_response-cl-te"] = (b"G" + b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"0\r\n\r\n")
    s["bad_response-head-too-large"] = b"G" + b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
    s["bad_response-head-too-large-for-head"] = b"H" + b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
    s["bad_response-connection-names-content-length"] = (b"G" + b"HTTP/1.1 200 OK\r\nConnection: content-length\r\n"
                                                          b"Content-Length: 2\r\n\r\nok")
    s["bad_response-trailer-host"] = (b"G" + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                      b"2\r\nok\r\n0\r\nHost: x\r\n\r\n")
    s["truncated-response-cut"] = b"G" + b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    s["truncated-response-head-cut"] = b"G" + b"HTTP/1.1 200 OK\r\nContent-Le"
    s["truncated-head-response-head-cut"] = b"H" + b"HTTP/1.1 200 OK\r\nContent-Le"
    return s


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
