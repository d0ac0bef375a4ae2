"""HTTP/1.1 framing shared by the benchmark's app and its L7 hop: message heads written, hop-by-hop headers
dropped, bodies re-framed (no I/O here)."""

from __future__ import annotations

REASONS = {100: b"Continue", 200: b"OK", 204: b"No Content", 400: b"Bad Request", 404: b"Not Found",
           502: b"Bad Gateway"}

# RFC 9110 7.6.1: a proxy does not forward these (it frames the message itself).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                        b"upgrade", b"proxy-authenticate", b"proxy-authorization"})


def head(status: int, length: int, keep: bool) -> bytes:
    """An app's response head with a Content-Length."""
    conn = b"keep-alive" if keep else b"close"
    return (b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\nContent-Type: application/octet-stream\r\nConnection: %s\r\n\r\n"
            % (status, REASONS.get(status, b"Status"), length, conn))


def reframe(start: bytes, headers: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """A message head as a proxy sends it on: ``start`` (request or status line, no CRLF), the end-to-end
    ``headers`` kept in order, ``extra`` appended. Returns the head and whether the body goes on chunked
    (it came chunked: its length is known only at its end; the parser has taken the chunks apart)."""
    out = [start]
    chunked = False
    for name, value in headers:
        low = name.lower()
        if low in HOP_BY_HOP:
            chunked = chunked or low == b"transfer-encoding"
            continue
        out.append(name + b": " + value)
    out.extend(name + b": " + value for name, value in extra)
    if chunked:
        out.append(b"Transfer-Encoding: chunked")
    return b"\r\n".join(out) + b"\r\n\r\n", chunked


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never the empty last one: see LAST_CHUNK)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
