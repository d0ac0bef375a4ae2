"""What every data plane receives and returns.

After the handshake, the preamble and the status record, the server hands a connection to a data plane
(``userspace``: TLS in user space, bytes copied; ``ktls``: keys in the kernel, splice). Both planes
follow the same rules: each direction ends independently (half-close is forwarded as half-close),
the remaining direction gets ``close_timeout``, a reset at either end becomes a reset at the other, and
the meter counts exactly the bytes delivered.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass
from typing import Protocol

from forwarder.ingress.metering import ConnMeter
from forwarder.ingress.tls_link import TlsLink


class Outcome(enum.StrEnum):
    """How a connection ended: the steps before the data plane (``sequence.py``) end it with one of the
    first five, a data plane with one of the rest. Values are the ``outcome`` label and log field."""

    HANDSHAKE_REFUSED = "handshake_refused"  # TLS failed, or the peer's SAN is not on the allowlist
    # The link ended before the preamble's first byte: the gateway closed or reset it (a pooled link
    # retired, a gateway that refused our key's pin), or sent nothing within preamble_idle_timeout.
    NO_PREAMBLE = "no_preamble"
    BAD_PREAMBLE = "bad_preamble"  # malformed, too long, too slow, or the link broke part-way through it
    FORBIDDEN = "forbidden"  # the target guard refused the preamble's destination
    NOT_LISTENING = "not_listening"  # nothing answered at the target before connect_deadline
    CLOSED = "closed"  # both directions ended with an orderly end of stream
    RESET_GATEWAY = "reset_gateway"  # the gateway side reset, or ended without close_notify; the sandbox side reset too
    RESET_SANDBOX = "reset_sandbox"  # the sandbox reset; the gateway side was reset too
    CLOSE_TIMEOUT = "close_timeout"  # one side ended, the other did not within close_timeout
    TLS_ERROR = "tls_error"  # a record failed to decrypt, or a TLS message we refuse (KeyUpdate)
    DRAINED = "drained"  # still open when the drain deadline passed
    MOVED = "moved"  # a kTLS tunnel handed to the process that took over (takeover.py): it ends there
    INTERNAL = "internal"


@dataclass
class Handoff:
    link: TlsLink  # handshake done, preamble consumed, status sent; nothing buffered in OpenSSL
    upstream: socket.socket  # connected to the sandbox, non-blocking
    leftover: bytes  # tenant bytes that shared a record with the end of the preamble
    meter: ConnMeter
    close_timeout: float


class DataPlane(Protocol):
    name: str

    def on_accept(self, sock: socket.socket) -> None:
        """Called on each accepted socket before the handshake (kTLS attaches its ULP here)."""

    async def run(self, handoff: Handoff) -> Outcome: ...


def abort(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), so the peer sees a reset rather than end of stream."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
