"""Regenerates the HTTP/2 request seed corpus under tests/seeds/h2_requests/ (run by hand; the files are
committed).

Each seed is what ``fuzz_h2_requests.one_input`` takes: a client's frames after the connection preface
(its SETTINGS, then requests), written by h2's own client with its header checks off, so malformed heads
can be written; each is named ``<expected>-<what>``, the first request's outcome, which the replay checks
with ``classify``: ``ok``, a refusal reason of its head (``bad_target``, ``bad_method``, ``bad_header``,
``bad_pseudo_header``, ``content_length_mismatch``, a name's, ...), ``reset_<reason>`` (the head went
upstream, then its DATA or trailers made it malformed: that stream reset), ``protocol_error`` (h2's
connection error before the head was taken: frames, not fields) or ``cut`` (the head went upstream, then a
connection error aborted it). The malformed requests of issue 22 points 8 and 9: RFC 9113 8.1.1 makes each
a stream error, so none of them is a connection error any more.
Usage: .venv/bin/python tests/fuzz/make_h2_requests_seeds.py
"""

from __future__ import annotations

from pathlib import Path

import h2.config
import h2.connection
import hpack
import hyperframe.frame
from seed_dir import write_seeds

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "seeds" / "h2_requests"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
AUTHORITY = b"a.sandbox.example.com"  # fuzz_h2_requests.NAMES's domain

Headers = list[tuple[bytes, bytes]]


def head(path: bytes = b"/", method: bytes = b"GET", authority: bytes = AUTHORITY) -> Headers:
    return [(b":method", method), (b":scheme", b"https"), (b":authority", authority), (b":path", path)]


def client(*requests: tuple[Headers, bool, list[bytes]]) -> bytes:
    """The client's frames after the preface: SETTINGS, then each request (stream 1, 3, ...): its HEADERS
    (END_STREAM when ``end`` and no DATA), then each DATA, the last ending the stream."""
    config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                       normalize_outbound_headers=False)
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    for i, (headers, end, data) in enumerate(requests):
        sid = 1 + 2 * i
        conn.send_headers(sid, headers, end_stream=end and not data)
        for j, piece in enumerate(data):
            conn.send_data(sid, piece, end_stream=end and j == len(data) - 1)
    out = conn.data_to_send()
    assert out.startswith(PREFACE)
    return out[len(PREFACE) :]


def get(headers: Headers) -> bytes:
    return client((headers, True, []))


def with_trailers(headers: Headers, data: list[bytes], trailers: Headers) -> bytes:
    """One request (stream 1): HEADERS, its DATA, then trailers ending the stream."""
    config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                       normalize_outbound_headers=False)
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    conn.send_headers(1, headers)
    for piece in data:
        conn.send_data(1, piece)
    conn.send_headers(1, trailers, end_stream=True)
    return conn.data_to_send()[len(PREFACE) :]


def raw_frames(*blocks: tuple[int, Headers, bool]) -> bytes:
    """HEADERS frames (END_HEADERS; END_STREAM when asked), one HPACK context, which h2's client would not
    write: on any stream id, a 1xx :status in a request, trailers without END_STREAM."""
    encoder = hpack.Encoder()
    out = b""
    for stream_id, headers, end in blocks:
        f = hyperframe.frame.HeadersFrame(stream_id)
        f.data = encoder.encode(headers)
        f.flags.add("END_HEADERS")
        if end:
            f.flags.add("END_STREAM")
        out += bytes(f.serialize())
    return out


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    out["none-settings-only"] = client()
    # What passes.
    out["ok-get"] = get(head(b"/x?y=1"))
    out["ok-options-asterisk"] = get(head(b"*", b"OPTIONS"))
    out["ok-post-content-length-and-data"] = client(([*head(b"/p", b"POST"), (b"content-length", b"6")], True,
                                                     [b"abc", b"def"]))
    out["ok-post-no-content-length"] = client((head(b"/p", b"POST"), True, [b"abc"]))
    out["ok-content-length-zero-on-end-stream"] = get([*head(), (b"content-length", b"0")])
    out["ok-te-trailers"] = get([*head(), (b"te", b"trailers")])
    out["ok-lower-case-method-is-a-token"] = get(head(method=b"get"))
    out["ok-then-a-refused-one"] = client((head(b"/ok"), True, []), (head(b"x"), True, []))
    # Point 8: targets that are not origin-form.
    out["bad_target-path-without-slash"] = get(head(b"x"))
    out["bad_target-absolute-form-another-sandbox"] = get(head(b"https://b.sandbox.example.com/x"))
    out["bad_target-absolute-form-its-own-sandbox"] = get(head(b"https://a.sandbox.example.com/x"))
    out["bad_target-asterisk-on-get"] = get(head(b"*"))
    out["bad_target-fragment"] = get(head(b"/x#frag"))
    out["bad_target-space"] = get(head(b"/a b"))
    out["bad_target-non-ascii"] = get(head("/é".encode()))
    out["bad_target-then-ok"] = client((head(b"*", b"POST"), True, []), (head(b"/ok"), True, []))
    # Point 9: what h2 lets through and the gateway refuses.
    out["content_length_mismatch-30-on-end-stream"] = get([*head(b"/p", b"POST"), (b"content-length", b"30")])
    out["bad_method-space"] = get(head(method=b"G T"))
    out["bad_method-del"] = get(head(method=b"GET\x7f"))
    out["bad_method-paren"] = get(head(method=b"(GET)"))
    out["bad_method-empty"] = get(head(method=b""))
    out["connect_unsupported-connect"] = get([(b":method", b"CONNECT"), (b":authority", AUTHORITY)])
    # Names (400 at the gateway).
    out["wrong_port-authority-other-port"] = get(head(authority=AUTHORITY + b":9"))
    out["outside_domain-authority-elsewhere"] = get(head(authority=b"evil.example.org"))
    # Point 9: what h2 4.4 refused itself as a connection error (GOAWAY, every stream lost), now refused on its
    # stream by request_rules under its reason (its table).
    bad_heads: dict[str, Headers] = {
        "bad_header-upper-case-name": [*head(), (b"X-Up", b"1")],
        "bad_header-connection": [*head(), (b"connection", b"close")],
        "bad_header-keep-alive": [*head(), (b"keep-alive", b"5")],
        "bad_header-proxy-connection": [*head(), (b"proxy-connection", b"x")],
        "bad_header-transfer-encoding": [*head(), (b"transfer-encoding", b"chunked")],
        "bad_header-upgrade": [*head(), (b"upgrade", b"websocket")],
        "bad_header-te-gzip": [*head(), (b"te", b"gzip")],
        "bad_header-nul-in-value": [*head(), (b"x", b"a\x00b")],
        "bad_header-crlf-in-value": [*head(), (b"x", b"a\r\nX-Injected: 1")],
        "bad_header-space-in-name": [*head(), (b"x y", b"1")],
        "bad_header-empty-name": [*head(), (b"", b"1")],
        "bad_header-value-with-leading-space": [*head(), (b"x", b" 1")],
        "bad_pseudo_header-after-regular": [(b"x", b"1"), *head()],
        "bad_pseudo_header-after-a-cookie": [(b"cookie", b"a=1"), *head()],
        "bad_pseudo_header-unknown": [*head(), (b":foo", b"1")],
        "bad_pseudo_header-status-in-request": [*head(), (b":status", b"200")],
        "bad_pseudo_header-duplicate-path": [*head(), (b":path", b"/y")],
        "bad_pseudo_header-no-path": head()[:3],
        "bad_pseudo_header-no-method": head()[1:],
        "bad_pseudo_header-no-scheme": [head()[0], *head()[2:]],
        "bad_pseudo_header-protocol-on-get": [*head(), (b":protocol", b"websocket")],
        "bad_target-empty-path": head(b""),
        "host_mismatch-host-against-authority": [*head(), (b"host", b"b.sandbox.example.com")],
        "duplicate_host-two-hosts": [*head()[:2], head()[3], (b"host", AUTHORITY), (b"host", AUTHORITY)],
        "missing_host-neither-authority-nor-host": [*head()[:2], head()[3]],
        "bad_content_length-not-digits": [*head(), (b"content-length", b"3x")],
        "bad_content_length-conflicting": [*head(), (b"content-length", b"3"), (b"content-length", b"4")],
    }
    for what, headers in bad_heads.items():
        out[what] = get(headers)
    # A malformed request does not end the connection: the next stream is served.
    out["bad_header-then-ok"] = client(([*head(), (b"X-Up", b"1")], True, []), (head(b"/ok"), True, []))
    # The head was taken (it went upstream), then its DATA broke its content-length: that stream is reset.
    out["reset_content_length_mismatch-below-data-in-one-data-frame"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"3")], True, [b"abcdef"]))
    out["reset_content_length_mismatch-below-data"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"3")], True, [b"ab", b"cdef"]))
    out["reset_content_length_mismatch-whole-then-one-more"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"3")], True, [b"abc", b"d"]))
    out["reset_content_length_mismatch-above-data"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"10")], True, [b"abc"]))
    out["reset_content_length_mismatch-then-ok"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"1")], True, [b"ab"]), (head(b"/ok"), True, []))
    out["reset_content_length_mismatch-zero-then-data"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"0")], True, [b"x"]))
    out["ok-content-length-zero-then-an-empty-end"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"0")], True, [b""]))
    out["ok-content-length-whole-then-an-empty-end"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"3")], True, [b"abc", b""]))
    # Trailers: held to the field rules, no pseudo-header; a content-length the DATA fell short of.
    out["ok-post-with-trailers"] = with_trailers(head(b"/p", b"POST"), [b"abc"], [(b"x-sum", b"1")])
    out["ok-post-content-length-with-trailers"] = with_trailers(
        [*head(b"/p", b"POST"), (b"content-length", b"3")], [b"abc"], [(b"x-sum", b"1")])
    out["reset_bad_pseudo_header-trailers-with-path"] = with_trailers(head(b"/p", b"POST"), [b"abc"],
                                                                      [(b":path", b"/x")])
    out["reset_bad_header-trailers-upper-case"] = with_trailers(head(b"/p", b"POST"), [b"abc"], [(b"X-Sum", b"1")])
    out["reset_bad_header-trailers-connection"] = with_trailers(head(b"/p", b"POST"), [b"abc"],
                                                                [(b"connection", b"close")])
    out["reset_content_length_mismatch-trailers-short-of-content-length"] = with_trailers(
        [*head(b"/p", b"POST"), (b"content-length", b"5")], [b"abc"], [(b"x-sum", b"1")])
    out["reset_bad_trailers-without-end-stream"] = client() + raw_frames(
        (1, [(b":method", b"POST"), *head()[1:]], False), (1, [(b"x-sum", b"1")], False))
    # h2 takes a :status starting with 1 for an informational response; as a request it is malformed.
    out["bad_pseudo_header-informational-status"] = client() + raw_frames((1, [(b":status", b"100"), *head()], True))
    # What is still a connection error: frames, not fields (a client may not open an even stream).
    out["protocol_error-headers-on-an-even-stream"] = client() + raw_frames((2, head(), True))
    return out


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
