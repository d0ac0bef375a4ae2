"""Python face of the C splice pump (``native/splice_pump.c``).

The pump moves bytes both ways between a gateway socket (plain TCP, or TCP with kernel TLS installed)
and a sandbox socket with splice(2), in its own threads: no Python code runs per chunk. Python hands a
pair over with :meth:`SplicePump.add` (the pump owns both descriptors from then on), may read exact
per-connection counters at any time, and learns that a connection finished when :attr:`event_fd`
becomes readable and :meth:`take_events` returns its :class:`PumpEvent` (final, exact byte counts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from native._cffi_types import FFI
    from native._splice import Lib

# Capacity of each direction's pipe. A kernel-TLS read must find room for a whole record (see the C
# file), and a larger pipe means fewer calls per byte on plain TCP.
DEFAULT_PIPE_SIZE = 1 << 20


# Every constant below mirrors native/splice_pump.h (tests/native/test_header_mirrors.py holds them to it).

# sp_add() flag: the gateway fd has kernel TLS TX and RX installed (SP_GW_KTLS).
GW_KTLS = 0x1
# The smallest pipe a kernel-TLS connection is taken with (SP_KTLS_MIN_PIPE): a whole record must fit.
KTLS_MIN_PIPE = 32768


class PumpOutcome(enum.IntEnum):
    CLOSED = 0
    RESET_GATEWAY = 1
    RESET_SANDBOX = 2
    CLOSE_TIMEOUT = 3
    TLS_ERROR = 4
    ABORTED = 5
    INTERNAL = 6


# Stable reason tokens, indexed by the C SP_R_* codes.
REASONS = (
    "none",
    "eof",
    "reset",
    "timeout",
    "tls_decrypt_error",
    "tls_key_update",
    "tls_alert",
    "tls_unexpected_record",
    "tls_bad_record",
    "abort",
    "abort_reset",
    "internal",
)

# sp_event.flags: how each side ended (SP_EV_*).
EV_GW_CLOSE_NOTIFY = 0x1
EV_GW_FIN = 0x2  # the gateway's TCP stream ended with no close_notify (kTLS: a truncation, reset)
EV_SB_EOF = 0x4
EV_SENT_CLOSE_NOTIFY = 0x8


class PipeTooSmall(OSError):
    """The kernel gave a kernel-TLS connection a pipe smaller than :data:`KTLS_MIN_PIPE` (an
    unprivileged user past ``fs/pipe-user-pages-soft`` gets 8 KiB pipes that cannot grow), so a record
    could be cut in it: the pump refused the connection and the caller still owns its descriptors."""


@dataclass(frozen=True)
class PumpEvent:
    conn_id: int
    outcome: PumpOutcome
    reason: str
    bytes_up: int  # gateway -> sandbox, delivered
    bytes_down: int  # sandbox -> gateway, delivered
    err: int  # errno behind the reason, 0 if none
    flags: int  # EV_* bits: how each side ended


# sp_detached.dir_state (SP_DS_*): which ends each direction has met.
DS_UP_IN_EOF = 0x1
DS_UP_OUT_SHUT = 0x2
DS_DOWN_IN_EOF = 0x4
DS_DOWN_OUT_SHUT = 0x8

_DETACHED_FIELDS = (
    "gw_fd", "sb_fd", "up_pr", "up_pw", "down_pr", "down_pw", "up_pipe_bytes", "down_pipe_bytes", "flags",
    "evflags", "close_timeout_ms", "close_left_ms", "dir_state", "bytes_up", "bytes_down",
)


@dataclass(frozen=True)
class Detached:
    """A connection taken out of a pump (:meth:`SplicePump.detach`): its six descriptors, now the
    caller's, and its state, for :meth:`SplicePump.adopt` here or in another process (the descriptors
    go over SCM_RIGHTS; :meth:`with_fds` gives the numbers they arrive as). The pipes carry the bytes
    in them (``up_pipe_bytes``, ``down_pipe_bytes``), so moving them loses none and sends none twice."""

    gw_fd: int
    sb_fd: int
    up_pr: int
    up_pw: int
    down_pr: int
    down_pw: int
    up_pipe_bytes: int
    down_pipe_bytes: int
    flags: int  # GW_* as given to add
    evflags: int  # EV_* so far
    close_timeout_ms: int
    close_left_ms: int  # -1: no direction has ended
    dir_state: int  # DS_* bits
    bytes_up: int  # delivered so far: an adopted connection's counters go on from these
    bytes_down: int

    @property
    def fds(self) -> list[int]:
        return [self.gw_fd, self.sb_fd, self.up_pr, self.up_pw, self.down_pr, self.down_pw]

    def with_fds(self, fds: list[int]) -> Detached:
        """The same connection, its descriptors as numbered in this process (in :attr:`fds`' order)."""
        if len(fds) != 6:
            raise ValueError(f"a detached connection has 6 descriptors, not {len(fds)}")
        return dataclasses.replace(self, gw_fd=fds[0], sb_fd=fds[1], up_pr=fds[2], up_pw=fds[3], down_pr=fds[4],
                                   down_pw=fds[5])

    def close(self) -> None:
        """Close this process's copies of the six descriptors (after another process adopted them: its
        copies keep the sockets and pipes open, and nothing is sent)."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(frozen=True)
class PumpStats:
    added: int
    finished: int
    active: int
    bytes_up: int
    bytes_down: int
    splice_calls: int
    control_records: int


def _lib() -> tuple[FFI, Lib]:
    from native._splice import ffi, lib

    return ffi, lib


class SplicePump:
    """A running pump: ``threads`` worker threads, at most ``max_conns`` connections at once.

    Not safe to share between event loops; call every method from one thread. ``close()`` stops the
    threads and closes every descriptor the pump still owns (with a reset, no events).
    """

    def __init__(self, threads: int = 1, max_conns: int = 4096, pipe_size: int = DEFAULT_PIPE_SIZE) -> None:
        self._ffi, self._lib = _lib()
        err = self._ffi.new("char[]", 256)
        p = self._lib.sp_new(threads, max_conns, pipe_size, err, 256)
        if p == self._ffi.NULL:
            raise OSError(f"splice pump: {self._ffi.string(err).decode()}")
        self._p: Any = p
        self._events = self._ffi.new("struct sp_event[]", 256)
        self._u64 = self._ffi.new("uint64_t[2]")
        self._moved = self._ffi.new("struct sp_moved[]", 256)
        self._cursor = self._ffi.new("uint32_t[1]")

    @property
    def event_fd(self) -> int:
        """Readable while finished-connection events wait in :meth:`take_events`."""
        return int(self._lib.sp_event_fd(self._live()))

    def _live(self) -> Any:
        if self._p is None:
            raise ValueError("splice pump is closed")
        return self._p

    def add(self, gateway_fd: int, sandbox_fd: int, *, ktls: bool = False, close_timeout: float = 30.0) -> int:
        """Hand a connected, non-blocking pair to the pump; returns the connection id.

        On success the pump owns both descriptors (the caller must forget them: detach, never close).
        ``ktls``: the gateway fd has kernel TLS TX and RX installed; the pump then reads its non-data
        records itself, ends its direction with close_notify, and takes only the gateway's close_notify
        as the end of the gateway's direction: a TCP FIN without one resets both sides (outcome
        RESET_GATEWAY, reason ``reset``, err 0, flag EV_GW_FIN). Without ``ktls`` a FIN is the end.
        ``close_timeout`` (seconds) bounds the wait for the remaining direction once one direction has
        ended. Raises OSError and leaves the descriptors with the caller if the pump cannot take them:
        :class:`PipeTooSmall` when ``ktls`` and the kernel gave a pipe too small for a whole record.
        """
        ms = max(1, min(int(close_timeout * 1000), 0xFFFFFFFF))
        r = self._lib.sp_add(self._live(), gateway_fd, sandbox_fd, GW_KTLS if ktls else 0, ms)
        if r == -errno.ENOBUFS and ktls:
            raise PipeTooSmall(errno.ENOBUFS, f"splice pump add: the kernel gave a pipe under {KTLS_MIN_PIPE} bytes "
                               "(fs/pipe-user-pages-soft reached?); a TLS record would not fit")
        if r < 0:
            raise OSError(-r, f"splice pump add: {os.strerror(-r)}")
        return int(r)

    def counters(self, conn_id: int) -> tuple[int, int] | None:
        """(bytes_up, bytes_down) delivered so far, or None once the connection has finished."""
        if self._lib.sp_counters(self._live(), conn_id, self._u64, self._u64 + 1) < 0:
            return None
        return int(self._u64[0]), int(self._u64[1])

    def take_moved(self) -> list[tuple[int, int, int]]:
        """``(conn_id, bytes_up, bytes_down)`` of each live connection whose counters changed since the
        last call reported it: one walk in C under one lock, so the cost per call follows the tunnels that
        moved bytes, not the idle ones (the ktls plane's meter refresh)."""
        out: list[tuple[int, int, int]] = []
        p, moved, cursor = self._live(), self._moved, self._cursor
        cursor[0] = 0
        while True:
            n = self._lib.sp_take_moved(p, moved, 256, cursor)
            for i in range(n):
                m = moved[i]
                out.append((int(m.id), int(m.bytes_up), int(m.bytes_down)))
            if n < 256:  # the walk stops early only when the batch is full
                return out

    def take_events(self) -> list[PumpEvent]:
        """Every finished connection's event not yet taken, oldest first (resets :attr:`event_fd`)."""
        out: list[PumpEvent] = []
        while True:
            n = self._lib.sp_take_events(self._live(), self._events, 256)
            for i in range(n):
                e = self._events[i]
                reason = REASONS[e.reason] if 0 <= e.reason < len(REASONS) else "internal"
                out.append(
                    PumpEvent(
                        int(e.id), PumpOutcome(e.outcome), reason, int(e.bytes_up), int(e.bytes_down),
                        int(e.err), int(e.flags),
                    )
                )
            if n < 256:
                return out

    def abort(self, conn_id: int, *, reset: bool = False) -> bool:
        """Ask the pump to end a connection (with a TCP reset both ways if ``reset``); False if gone."""
        return int(self._lib.sp_abort(self._live(), conn_id, 1 if reset else 0)) == 0

    def detach(self, conn_id: int) -> Detached | None:
        """Take a live connection out of the pump: its thread stops watching it, nothing is closed, and
        the descriptors are the caller's from now on. None if it is unknown or finished first (its event
        then comes as usual). Blocks until the pump's thread has let go of it (within one of its batches)."""
        out = self._ffi.new("struct sp_detached *")
        if self._lib.sp_detach(self._live(), conn_id, out) < 0:
            return None
        return Detached(*(int(getattr(out, name)) for name in _DETACHED_FIELDS))

    def adopt(self, d: Detached, *, paused: bool = False) -> int:
        """Take over a detached connection (its descriptors the pump's on success, as with :meth:`add`):
        its counters go on from ``d``'s, its pipes' bytes go out before anything more is read. With
        ``paused`` nothing moves until :meth:`resume`. OSError (the descriptors stay the caller's):
        EINVAL for a descriptor missing, repeated or blocking, ENOBUFS for a kTLS one's pipe too small."""
        c = self._ffi.new("struct sp_detached *")
        for name in _DETACHED_FIELDS:
            setattr(c, name, getattr(d, name))
        r = self._lib.sp_adopt(self._live(), c, 1 if paused else 0)
        if r < 0:
            raise OSError(-r, f"splice pump adopt: {os.strerror(-r)}")
        return int(r)

    def resume(self, conn_id: int) -> bool:
        """Start a connection adopted paused; False if there is none such."""
        return int(self._lib.sp_resume(self._live(), conn_id)) == 0

    def stats(self) -> PumpStats:
        s = self._ffi.new("struct sp_stats *")
        self._lib.sp_get_stats(self._live(), s)
        return PumpStats(
            int(s.added), int(s.finished), int(s.active), int(s.bytes_up), int(s.bytes_down),
            int(s.splice_calls), int(s.control_records),
        )

    def close(self) -> None:
        if self._p is not None:
            p, self._p = self._p, None
            self._lib.sp_free(p)

    def __enter__(self) -> SplicePump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
