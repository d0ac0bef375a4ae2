"""The sandbox app of the staged benchmark: HTTP/1.1 on loopback, plaintext (what the hops reach) and TLS
1.3 (the direct arm).

    python -m sbxnet.app.bench.http_app --dir WORK --port P --tls-port T

``GET /<name>`` answers the file ``WORK/www/<name>`` (``sendfile(2)`` on the plaintext port);
``PUT`` or ``POST /upload`` reads the body and discards it, answering its length in bytes. Keep-alive
unless the client asks to close. One thread per connection; requests are parsed by httptools (the
same parser as the L7 hop), bodies read into one buffer per connection.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import sys
import threading
from pathlib import Path

import httptools

from sbxnet.app.bench.http_peer import head

BUF = 1 << 20


class _Request:
    """httptools' callbacks for one connection: the request in progress and what is to be answered."""

    def __init__(self) -> None:
        self.url = b""
        self.body = 0
        self.done: list[tuple[bytes, bytes, int, bool]] = []  # method, url, body bytes, keep-alive
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += len(body)

    def on_message_complete(self) -> None:
        p = self.parser
        self.done.append((p.get_method(), self.url, self.body, p.should_keep_alive()))


def serve(conn: socket.socket, www: Path) -> None:
    req = _Request()
    buf = bytearray(BUF)
    view = memoryview(buf)
    plain = not isinstance(conn, ssl.SSLSocket)
    try:
        while True:
            n = conn.recv_into(buf)
            if not n:
                return
            req.parser.feed_data(view[:n])
            while req.done:
                method, url, body, keep = req.done.pop(0)
                if not answer(conn, www, method, url.split(b"?", 1)[0], body, keep, plain) or not keep:
                    return
    except (OSError, httptools.HttpParserError):
        return
    finally:
        conn.close()


def answer(conn: socket.socket, www: Path, method: bytes, path: bytes, body: int, keep: bool, plain: bool) -> bool:
    if method in (b"PUT", b"POST") and path == b"/upload":
        text = str(body).encode()
        conn.sendall(head(200, len(text), keep) + text)
        return True
    name = path.lstrip(b"/").decode("ascii", "replace")
    file = www / name
    if method != b"GET" or "/" in name or not name or not file.is_file():
        conn.sendall(head(404, 0, keep))
        return True
    size = file.stat().st_size
    conn.sendall(head(200, size, keep))
    with file.open("rb") as f:
        if plain:
            conn.sendfile(f)
        else:  # sendfile cannot encrypt: TLS goes through our buffer
            while chunk := f.read(BUF):
                conn.sendall(chunk)
    return True


def accept_loop(listener: socket.socket, www: Path, tls: ssl.SSLContext | None) -> None:
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                conn.settimeout(10)
                conn = tls.wrap_socket(conn, server_side=True)
                conn.settimeout(None)
            except (OSError, ssl.SSLError):
                conn.close()
                continue
        threading.Thread(target=serve, args=(conn, www), daemon=True).start()


def listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(4096)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="holds www/ and the front certificate")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tls-port", type=int, default=0, help="also serve TLS 1.3 here (0: not)")
    args = ap.parse_args(argv)
    www = args.dir / "www"
    if args.tls_port:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(str(args.dir / "front.crt"), str(args.dir / "front.key"))
        threading.Thread(target=accept_loop, args=(listen(args.tls_port), www, ctx), daemon=True).start()
    print(f"app pid {os.getpid()}", flush=True)
    accept_loop(listen(args.port), www, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
