"""The forwarder's one-record answer to a preamble.

Wire format, 4 bytes, sent by the forwarder as its first application data (one TLS record):

    0x53 0x58 ('SX')  version (0x01)  code (u8)

The gateway reads exactly four bytes. ``retryable`` tells it whether another attempt may succeed.
"""

from __future__ import annotations

from sbxnet.errors import RemoteProtocolError
from sbxnet.protocol.codes import Status

__all__ = ["MAGIC", "STATUS_LEN", "VERSION", "Status", "StatusError", "pull_status", "push_status"]

MAGIC = b"SX"
VERSION = 1
STATUS_LEN = 4


class StatusError(RemoteProtocolError):
    pass


def push_status(status: Status) -> bytes:
    return MAGIC + bytes((VERSION, int(status)))


def pull_status(buf: bytes | bytearray | memoryview) -> tuple[Status, int] | None:
    """Parse a status record from the start of ``buf``: (status, bytes consumed), or None if short."""
    view = memoryview(buf)
    if len(view) < STATUS_LEN:
        if bytes(view[:2]) != MAGIC[: len(view[:2])]:
            raise StatusError("bad_magic")
        return None
    if bytes(view[:2]) != MAGIC:
        raise StatusError("bad_magic")
    if view[2] != VERSION:
        raise StatusError("bad_version", f"version {view[2]}")
    try:
        return Status(view[3]), STATUS_LEN
    except ValueError:
        raise StatusError("unknown_status", f"code {view[3]}") from None
