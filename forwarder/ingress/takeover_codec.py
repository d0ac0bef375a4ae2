"""The takeover control messages, as bytes (pure: no sockets; ``takeover.py`` moves them).

A running forwarder and the new one that takes its listening sockets over exchange one message per
datagram of a Unix SOCK_SEQPACKET connection: ``HELLO`` (new -> running), ``OFFER`` (running -> new,
the descriptors it names ride on it with SCM_RIGHTS), ``READY`` (new -> running: it accepts on them),
``RELEASED`` (running -> new: it stopped accepting), the ktls plane's ``TUNNEL``, ``ADOPTED`` and
``COMMIT``, and ``DONE`` (new -> running: it serves from now on, and the running one closes its copies),
or ``REFUSED`` (running -> new, instead of ``OFFER``). docs/forwarder.md gives the sequence.

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
    TUNNEL = 6
    ADOPTED = 7
    COMMIT = 8
    DONE = 9


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
    tunnels: bool  # it can adopt live kTLS tunnels (its data plane is ktls)


@dataclass(frozen=True)
class Released:
    pid: int
    open_connections: int  # connections the running process keeps until they end
    moving: int  # kTLS tunnels it sends next, one TUNNEL each


# A kTLS tunnel's pump state (splice_pump.Detached without its descriptors), each key's range.
PUMP_STATE = {
    "up_pipe_bytes": (0, MAX_COUNT), "down_pipe_bytes": (0, MAX_COUNT), "flags": (0, 1), "evflags": (0, 15),
    "close_timeout_ms": (1, (1 << 32) - 1), "close_left_ms": (-1, MAX_COUNT), "dir_state": (0, 15),
    "bytes_up": (0, (1 << 63) - 1), "bytes_down": (0, (1 << 63) - 1),
}


@dataclass(frozen=True)
class Tunnel:
    """One live kTLS tunnel, its six descriptors attached (gateway, sandbox, up pipe read and write
    ends, down pipe read and write ends)."""

    conn_id: str  # the forwarder's, 16 hex digits: the logs of both processes join on it
    sandbox_id: str
    head: int  # tenant bytes delivered before the pump took it (the preamble record's), counted up
    pump: tuple[tuple[str, int], ...]  # PUMP_STATE's keys in order, with their values


@dataclass(frozen=True)
class Adopted:
    conn_id: str


@dataclass(frozen=True)
class Commit:
    count: int  # tunnels handed over; from now on they are the new process's


@dataclass(frozen=True)
class Done:
    pid: int  # the new process: it has what it was given, and serves the listener from now on


@dataclass(frozen=True)
class Refused:
    reason: str  # a token: busy, draining, ...


Message = Hello | Offer | Ready | Released | Refused | Tunnel | Adopted | Commit | Done

_KIND = {Hello: Kind.HELLO, Offer: Kind.OFFER, Ready: Kind.READY, Released: Kind.RELEASED, Refused: Kind.REFUSED,
         Tunnel: Kind.TUNNEL, Adopted: Kind.ADOPTED, Commit: Kind.COMMIT, Done: Kind.DONE}
_TYPE = {kind: cls for cls, kind in _KIND.items()}


def push_message(msg: Message) -> bytes:
    """The datagram for ``msg`` (checked as :func:`pull_message` checks it: what we send, we would take)."""
    body: dict[str, Any] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(msg).items()}
    if isinstance(msg, Tunnel):
        body["pump"] = dict(msg.pump)
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
        return Ready(_int(body, "pid", 1, MAX_PID), _bool(body, "tunnels"))
    if kind is Kind.RELEASED:
        return Released(_int(body, "pid", 1, MAX_PID), _int(body, "open_connections", 0, MAX_COUNT),
                        _int(body, "moving", 0, MAX_COUNT))
    if kind is Kind.TUNNEL:
        return Tunnel(_conn_id(body), _text(body, "sandbox_id"), _int(body, "head", 0, MAX_COUNT), _pump(body))
    if kind is Kind.ADOPTED:
        return Adopted(_conn_id(body))
    if kind is Kind.COMMIT:
        return Commit(_int(body, "count", 0, MAX_COUNT))
    if kind is Kind.DONE:
        return Done(_int(body, "pid", 1, MAX_PID))
    return Refused(_text(body, "reason"))


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body[key]
    if not isinstance(v, bool):
        raise TakeoverError("bad_field", f"{key}: not true or false")
    return v


def _conn_id(body: dict[str, Any]) -> str:
    v = body["conn_id"]
    if not isinstance(v, str) or len(v) != 16 or any(ch not in "0123456789abcdef" for ch in v):
        raise TakeoverError("bad_field", "conn_id: not 16 lower-case hex digits")
    return v


def _pump(body: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    v = body["pump"]
    if not isinstance(v, dict) or set(v) != set(PUMP_STATE):
        raise TakeoverError("bad_field", f"pump: not an object with exactly the keys {sorted(PUMP_STATE)}")
    return tuple((k, _int(v, k, lo, hi)) for k, (lo, hi) in PUMP_STATE.items())


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
