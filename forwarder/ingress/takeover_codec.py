"""The takeover control messages, as bytes (pure: no sockets; ``takeover.py`` moves them).

A running forwarder and the new one that takes its listening sockets over exchange one message per
datagram of a Unix SOCK_SEQPACKET connection: ``HELLO`` (new -> running), ``OFFER`` (running -> new,
the descriptors it names ride on it with SCM_RIGHTS), ``READY`` (new -> running: it accepts on them),
``RELEASED`` (running -> new: it stopped accepting and closed its copies) or ``REFUSED`` (running ->
new, instead of ``OFFER``). docs/forwarder.md gives the sequence.

Each message is ``SXTK``, a version byte, a kind byte and a JSON object with exactly that kind's keys.
The peer is trusted only as far as its credentials were checked: every field is checked for type and
range, and a message that is not exactly one of these raises :class:`TakeoverError` with a countable
reason, never anything else.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any

from sbxnet.errors import RemoteProtocolError
from sbxnet.protocol.feed import MAX_STREAM

MAGIC = b"SXTK"
VERSION = 1
HEADER = len(MAGIC) + 2
MAX_MESSAGE = 2048  # the largest message read or written; an OFFER is under 200 bytes
MAX_PID = (1 << 22) - 1  # Linux's PID_MAX_LIMIT
MAX_COUNT = (1 << 31) - 1
MAX_TEXT = 200
ROLES = ("tls", "control")  # the descriptors an OFFER may carry, in this order


class TakeoverError(RemoteProtocolError):
    """A control message that is not one we speak. ``reason``: ``short``, ``too_long``, ``bad_magic``,
    ``bad_version``, ``bad_kind``, ``bad_json``, ``bad_field``."""


class Kind(enum.IntEnum):
    HELLO = 1
    OFFER = 2
    READY = 3
    RELEASED = 4
    REFUSED = 5


@dataclass(frozen=True)
class Hello:
    pid: int  # the new process


@dataclass(frozen=True)
class Offer:
    pid: int  # the running process
    listen: str  # the TLS listener's address, "host:port" as the running one serves it
    stream: int  # the idle-feed stream the new process reports on (the running one keeps its own)
    fds: tuple[str, ...]  # the roles of the descriptors attached, in order (ROLES)


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Released:
    pid: int
    open_connections: int  # tunnels the running process keeps until they end


@dataclass(frozen=True)
class Refused:
    reason: str  # a token: busy, draining, ...


Message = Hello | Offer | Ready | Released | Refused

_KIND = {Hello: Kind.HELLO, Offer: Kind.OFFER, Ready: Kind.READY, Released: Kind.RELEASED, Refused: Kind.REFUSED}
_TYPE = {kind: cls for cls, kind in _KIND.items()}


def push_message(msg: Message) -> bytes:
    """The datagram for ``msg`` (checked as :func:`pull_message` checks it: what we send, we would take)."""
    body: dict[str, Any] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(msg).items()}
    data = MAGIC + bytes((VERSION, _KIND[type(msg)])) + json.dumps(body, separators=(",", ":")).encode()
    try:
        ok = pull_message(data) == msg
    except TakeoverError:
        ok = False
    if not ok:  # a field out of range: our bug, never sent
        raise ValueError(f"not a valid takeover message: {msg!r}")
    return data


def pull_message(data: bytes) -> Message:
    """One message from one datagram, or :class:`TakeoverError`."""
    if len(data) > MAX_MESSAGE:
        raise TakeoverError("too_long", f"{len(data)} bytes")
    if len(data) < HEADER:
        raise TakeoverError("short", f"{len(data)} bytes")
    if data[: len(MAGIC)] != MAGIC:
        raise TakeoverError("bad_magic")
    if data[4] != VERSION:
        raise TakeoverError("bad_version", str(data[4]))
    try:
        kind = Kind(data[5])
    except ValueError:
        raise TakeoverError("bad_kind", str(data[5])) from None
    try:
        body = json.loads(data[HEADER:].decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise TakeoverError("bad_json") from None
    if not isinstance(body, dict):
        raise TakeoverError("bad_json", "not an object")
    names = {f.name for f in dataclasses.fields(_TYPE[kind])}
    if set(body) != names:
        raise TakeoverError("bad_field", f"{kind.name}: keys {sorted(body)[:8]!r}")
    if kind is Kind.HELLO:
        return Hello(_int(body, "pid", 1, MAX_PID))
    if kind is Kind.OFFER:
        return Offer(_int(body, "pid", 1, MAX_PID), _text(body, "listen"), _int(body, "stream", 0, MAX_STREAM),
                     _roles(body))
    if kind is Kind.READY:
        return Ready(_int(body, "pid", 1, MAX_PID))
    if kind is Kind.RELEASED:
        return Released(_int(body, "pid", 1, MAX_PID), _int(body, "open_connections", 0, MAX_COUNT))
    return Refused(_text(body, "reason"))


def _no_constant(name: str) -> None:
    raise ValueError(name)  # NaN, Infinity: not JSON we take


def _int(body: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = body[key]
    if type(v) is not int or not lo <= v <= hi:
        raise TakeoverError("bad_field", f"{key}: not an integer in {lo}..{hi}")
    return v


def _text(body: dict[str, Any], key: str) -> str:
    v = body[key]
    if not isinstance(v, str) or not 0 < len(v) <= MAX_TEXT or not v.isascii() or not v.isprintable():
        raise TakeoverError("bad_field", f"{key}: not printable ASCII of 1..{MAX_TEXT} characters")
    return v


def _roles(body: dict[str, Any]) -> tuple[str, ...]:
    v = body["fds"]
    if not isinstance(v, list) or not all(isinstance(r, str) for r in v):
        raise TakeoverError("bad_field", "fds: not a list of roles")
    roles = tuple(v)
    # "tls" first and each known role at most once, in ROLES' order: the receiver maps descriptors by it.
    if not roles or roles[0] != "tls" or roles != tuple(r for r in ROLES if r in roles):
        raise TakeoverError("bad_field", f"fds: not {ROLES}'s roles, each once, in that order, tls first")
    return roles
