"""Connecting to a peer that may still be starting (cold start): the forwarder to a sandbox, the gateway
to a forwarder.

Two separate clocks, both from the design contract:
- an attempt that gets no answer (no SYN-ACK, no RST) is abandoned after ``syn_interval`` and a fresh
  socket sends a fresh SYN at once, instead of waiting for the kernel's 1 s SYN retransmit;
- a refused attempt (RST: nothing listening yet) waits ``backoff_initial``, doubling up to
  ``backoff_cap``, before the next one.
Everything happens inside one deadline.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
import time
from dataclasses import dataclass

from sbxnet.backoff import backoff_delays

# Errors that mean "nobody is there yet" rather than "this can never work".
_RETRYABLE = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNRESET, errno.ETIMEDOUT}


def _established(sock: socket.socket) -> bool:
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
        return False
    try:
        sock.getpeername()  # ENOTCONN while the SYN is unanswered
    except OSError:
        return False
    return True


@dataclass
class ConnectResult:
    sock: socket.socket | None
    attempts: int
    elapsed: float
    last_error: str  # "" on success; "refused", "no_answer", "unreachable", ...
    # time.monotonic() when the last attempt began (on success, the one that connected), so a caller can
    # tell how soon after a sandbox started listening it was reached; the call's start if none began.
    attempt_started: float


async def connect_with_retry(
    addr: ipaddress.IPv4Address | ipaddress.IPv6Address,
    port: int,
    *,
    deadline_s: float,
    syn_interval: float,
    backoff_initial: float,
    backoff_cap: float,
) -> ConnectResult:
    """Connect to (addr, port) before the deadline; the caller owns the returned non-blocking socket."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    start = time.monotonic()
    deadline = start + deadline_s
    delays = backoff_delays(backoff_initial, backoff_cap)
    attempts = 0
    last = "deadline"
    attempt_started = start
    while True:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            return ConnectResult(None, attempts, now - start, last, attempt_started)
        attempts += 1
        attempt_started = now
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.timeout(min(syn_interval, remaining)):
                await loop.sock_connect(sock, (str(addr), port))
            return ConnectResult(sock, attempts, time.monotonic() - start, "", attempt_started)
        except TimeoutError:
            if _established(sock):
                # The answer came, but this loop was too busy to see it in time: use it rather than
                # leave the sandbox a connection that opens and closes for nothing.
                return ConnectResult(sock, attempts, time.monotonic() - start, "", attempt_started)
            sock.close()
            last = "no_answer"
            continue  # fresh SYN now
        except OSError as e:
            sock.close()
            if e.errno not in _RETRYABLE:
                reason = errno.errorcode.get(e.errno or 0, "oserror")
                return ConnectResult(None, attempts, time.monotonic() - start, reason, attempt_started)
            last = "refused" if e.errno == errno.ECONNREFUSED else "unreachable"
        except BaseException:
            sock.close()
            raise
        delay = min(next(delays), deadline - time.monotonic())
        if delay > 0:
            await asyncio.sleep(delay)
