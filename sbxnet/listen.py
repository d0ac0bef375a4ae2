"""A listening TCP socket, or an error an operator can act on (port taken, permission, no such address)."""

from __future__ import annotations

import errno
import socket

from sbxnet.errors import EnvironmentFault


class ListenError(EnvironmentFault):
    """The listening socket cannot be had (port taken, permission, no such address)."""


def bind_listener(
    host: str, port: int, *, reuse_port: bool, backlog: int = 1024, setting: str = "the listen port setting"
) -> socket.socket:
    """A listening socket, or ListenError with a message an operator can act on (``setting`` names where
    the port is set)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ListenError(
                "listen",
                f"cannot listen on {host}:{port}: the address is already in use by another process "
                f"(stop it, or choose another port with {setting})",
            ) from None
        if e.errno == errno.EACCES:
            raise ListenError("listen", f"cannot listen on {host}:{port}: permission denied") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ListenError("listen", f"cannot listen on {host}:{port}: no such local address") from None
        raise ListenError("listen", f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    return sock
