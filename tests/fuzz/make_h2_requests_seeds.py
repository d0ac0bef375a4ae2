"""Regenerates the HTTP/2 request seed corpus under tests/seeds/h2_requests/ (run by hand; the files are
committed).

Each seed is what ``fuzz_h2_requests.one_input`` takes: a client's frames after the connection preface
(its SETTINGS, then requests), written by h2's own client with its header checks off, so malformed heads
can be written; each is named ``<expected>-<what>``, the first request's outcome, which the replay checks
with ``classify``: ``ok``, a refusal reason (``bad_target``, ``bad_method``, ``content_length_mismatch``, a
name's), ``protocol_error`` (h2's connection error before the head was taken) or ``cut`` (the head went
upstream, then a connection error aborted it). The malformed requests of issue 22 points 8 and 9.
Usage: .venv/bin/python tests/fuzz/make_h2_requests_seeds.py
"""

from __future__ import annotations

from pathlib import Path

import h2.config
import h2.connection
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
    # Point 9: what h2 refuses itself, as a connection error, before the head is taken.
    bad_heads: dict[str, Headers] = {
        "upper-case-name": [*head(), (b"X-Up", b"1")],
        "connection": [*head(), (b"connection", b"close")],
        "keep-alive": [*head(), (b"keep-alive", b"5")],
        "proxy-connection": [*head(), (b"proxy-connection", b"x")],
        "transfer-encoding": [*head(), (b"transfer-encoding", b"chunked")],
        "upgrade": [*head(), (b"upgrade", b"websocket")],
        "te-gzip": [*head(), (b"te", b"gzip")],
        "pseudo-header-after-regular": [(b"x", b"1"), *head()],
        "unknown-pseudo-header": [*head(), (b":foo", b"1")],
        "status-in-request": [*head(), (b":status", b"200")],
        "duplicate-path": [*head(), (b":path", b"/y")],
        "empty-path": head(b""),
        "no-path": head()[:3],
        "no-method": head()[1:],
        "no-scheme": [head()[0], *head()[2:]],
        "host-against-authority": [*head(), (b"host", b"b.sandbox.example.com")],
        "content-length-not-digits": [*head(), (b"content-length", b"3x")],
        "content-length-conflicting": [*head(), (b"content-length", b"3"), (b"content-length", b"4")],
        "nul-in-value": [*head(), (b"x", b"a\x00b")],
        "crlf-in-value": [*head(), (b"x", b"a\r\nX-Injected: 1")],
        "space-in-name": [*head(), (b"x y", b"1")],
    }
    for what, headers in bad_heads.items():
        out[f"protocol_error-{what}"] = get(headers)
    out["cut-content-length-below-data-in-one-data-frame"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"3")], True, [b"abcdef"]))
    # The head was taken (it went upstream), then the DATA broke its content-length: the link is aborted.
    out["cut-content-length-below-data"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"3")], True, [b"ab", b"cdef"]))
    out["cut-content-length-above-data"] = client(
        ([*head(b"/p", b"POST"), (b"content-length", b"10")], True, [b"abc"]))
    return out


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
