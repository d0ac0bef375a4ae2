"""``/metrics``, ``/healthz`` and ``/readyz`` over a deliberately tiny HTTP/1.0 responder."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("sbxnet.ops")


def _response(status: str, body: bytes, ctype: str = "text/plain; charset=utf-8") -> bytes:
    head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


class OpsServer:
    def __init__(self, metrics_text: Callable[[], bytes], ready: Callable[[], bool]) -> None:
        self._metrics_text = metrics_text
        self._ready = ready
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                out = _response("405 Method Not Allowed", b"GET only\n")
            elif path == "/metrics":
                out = _response("200 OK", self._metrics_text(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                out = _response("200 OK", b"ok\n")
            elif path == "/readyz":
                out = (
                    _response("200 OK", b"ready\n")
                    if self._ready()
                    else _response("503 Service Unavailable", b"not ready\n")
                )
            else:
                out = _response("404 Not Found", b"not found\n")
            writer.write(out)
            await writer.drain()
        except (TimeoutError, OSError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
