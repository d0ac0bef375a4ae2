"""How TLS streams end: bytes both ways between two of them (a raw TCP route's client and its link, an
upgrade's pipe) by one ending rule, and the orderly close of one.

The rule at both TLS ends is the forwarder's (docs/forwarder.md): close_notify ends one direction only and
is passed on as close_notify then FIN, while the other direction goes on; a TCP FIN without close_notify
(a cut connection, or a truncation attack), a reset or a TLS error resets both sides, so neither takes a
truncated stream for a complete one. Nothing is parsed.

``close_cleanly`` is the orderly end the gateway itself chooses (an idle keep-alive client at a drain, a link
whose exchanges are all complete): close_notify then FIN, so the peer (through the forwarder, the sandbox's
app) reads an end of stream and not a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable

from sbxnet.tls_stream import TlsStream

log = logging.getLogger("sbxnet.gateway")

# How long an orderly close waits for the peer's own end after ours (and for ours to be sent). Reading on
# until the peer ends (a lingering close) keeps the kernel from answering its last bytes with a reset that
# could destroy what we sent before it was read; the bound keeps a peer that never ends from holding us.
CLOSE_LINGER = 1.0


class _Truncated(Exception):
    """A TLS stream ended with a TCP FIN but no close_notify."""


async def relay(client: TlsStream, link: TlsStream, *, idle: float, leftover: bytes = b"") -> tuple[str, int, int]:
    """A raw route's bytes, both ways, until both directions ended in order, or anything else.

    The rule at both TLS ends (the client and the link) is the forwarder's: close_notify ends that
    direction only, and is passed on as close_notify then FIN (the forwarder passes it to the sandbox as
    FIN) while the other direction goes on. A TCP FIN without close_notify is not an orderly end (an
    attacker or a crash can cut a stream so), nor is a reset or a TLS error: both sides are then reset,
    so neither takes a truncated stream for a complete one. ``idle`` seconds without a byte either way
    resets both too. ``leftover``: bytes that came with the forwarder's status, the first for the client.
    Returns how it ended (``closed``, ``truncated``, ``reset``, ``idle``) and the bytes moved up (client
    to sandbox) and down. Cancelled (a drain's cut at ``drain_timeout``), both sides are reset."""
    last = [time.monotonic()]
    moved = [0, 0]

    async def one(src: TlsStream, dst: TlsStream, i: int, first: bytes = b"") -> None:
        if first:
            await dst.write(first)
            moved[i] += len(first)
        while True:
            data = await src.read()
            if not data:
                if src.eof != "close_notify":
                    raise _Truncated()
                await dst.write_eof()
                return
            last[0] = time.monotonic()
            await dst.write(data)
            moved[i] += len(data)

    tasks = [asyncio.create_task(one(client, link, 0)), asyncio.create_task(one(link, client, 1, leftover))]
    ended = "closed"
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=max(0.05, last[0] + idle - time.monotonic()),
                                               return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in done if t.exception() is not None]
            if failed:
                ended = "truncated" if isinstance(failed[0], _Truncated) else "reset"
                log.debug("raw relay ended by %r", failed[0])
                break
            if not pending:
                break
            if time.monotonic() - last[0] >= idle:
                ended = "idle"
                break
    except asyncio.CancelledError:
        ended = "cut"
        raise
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if ended == "closed":
            client.close()
            link.close()
        else:
            client.abort()
            link.abort()
    return ended, moved[0], moved[1]


async def close_cleanly(stream: TlsStream, *, linger: float = CLOSE_LINGER,
                        reading: asyncio.Future[bytes] | None = None) -> bool:
    """End ``stream`` in order: close_notify then FIN, then whatever the peer still sends is read and dropped
    until its own end of stream, then the socket is closed; all of it within ``linger`` seconds. ``reading``:
    a read of ``stream`` already under way (its bytes are dropped too). True when the peer ended its side in
    time; False when it did not, or the stream broke (it is closed either way)."""
    ended = False
    try:
        async with asyncio.timeout(linger):
            await stream.write_eof()
            while True:
                if reading is not None:
                    data = await reading
                    reading = None
                else:
                    data = await stream.read()
                if not data:
                    ended = True
                    break
    except (OSError, ssl.SSLError, TimeoutError):
        pass
    finally:
        if reading is not None:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reading
        stream.close()
    return ended


def drop_link(stream: TlsStream, close_later: Callable[[TlsStream], None]) -> None:
    """A kept link found unfit for the next exchange (``TlsStream.usable_idle`` said no): one the far end
    ended in order is ended in order too (``close_later`` runs ``close_cleanly`` off the request's path),
    anything else (a bare FIN, a reset, bytes nobody asked for) is aborted."""
    if stream.eof == "close_notify":
        close_later(stream)
    else:
        stream.abort()
