"""A small synchronous client of the control API (``sbxnet egress claims ...`` and the tests): one HTTP
request per call over the Unix socket, the answer as (status, JSON value)."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("egress", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except BaseException:
            s.close()
            raise
        self.sock = s


def call(path: Path, method: str, url: str, body: object = None, timeout: float = 10.0) -> tuple[int, Any]:
    """``method url`` with ``body`` as JSON (none if None); raises OSError if the socket cannot be reached."""
    conn = _UnixConnection(path, timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, url, body=data, headers=headers)
        r = conn.getresponse()
        text = r.read().decode()
        return r.status, json.loads(text) if text.strip() else None
    finally:
        conn.close()
