"""One guest's stream (the Unix socket ``<uds>_2051``): hello, then frames both ways.

Bytes are read straight into a receive buffer this connection owns (``asyncio.BufferedProtocol``):
the hello is answered (``stream.negotiate``), then the whole frames in the buffer go to the router's
outbound path as one batch per read, judged and segmented in place (no copy per frame). A partial
frame stays where it is until the rest arrives; the buffer is compacted only when too little room is
left for a whole frame. A bad frame length closes the stream (framing is lost for good); so does a
refused hello. Delivery frames from the exits are written one ``write`` per batch; while the guest
does not read, frames for it are dropped (``guest_backlog``), and after ``stall_timeout`` seconds of
that the stream is closed (the router's tick checks it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from forwarder.egress.errors import HelloRefused
from forwarder.egress.stream import FRAME_LEN_MAX, HELLO_LEN, negotiate, pull_hello, push_hello

if TYPE_CHECKING:
    from forwarder.egress.router.daemon import Router
    from forwarder.egress.router.outbound import ClaimPath

RX_SIZE = 1 << 20
WRITE_HIGH = 8 << 20  # bytes buffered toward a guest before we stop writing to it
_ROOM = 4 + FRAME_LEN_MAX  # one whole frame with its length


class GuestStream(asyncio.BufferedProtocol):
    def __init__(self, router: Router, path: ClaimPath, clock: Callable[[], float] = time.monotonic) -> None:
        self.router = router
        self.path = path
        self.clock = clock
        self.buf = bytearray(RX_SIZE)
        self._mv = memoryview(self.buf)
        self.start = 0  # first byte not yet consumed
        self.end = 0  # end of the bytes read
        self.hello_done = False
        self.offloads = 0
        self.transport: asyncio.Transport | None = None
        self.paused_since: float | None = None
        self.closed = False

    # -- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's Unix transport has a Transport's methods but is not a subclass of asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        self.router.attach(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._mv[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        if not self.hello_done and not self._hello():
            return
        self._frames()

    def eof_received(self) -> bool:
        return False  # close: the guest is gone

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.router.detach(self)

    def pause_writing(self) -> None:
        self.paused_since = self.clock()

    def resume_writing(self) -> None:
        self.paused_since = None

    # -- ours
    def _hello(self) -> bool:
        if self.end - self.start < HELLO_LEN:
            return False
        try:
            hello = pull_hello(self._mv[self.start : self.start + HELLO_LEN])
        except HelloRefused as exc:
            self.close(exc.reason)
            return False
        answer = negotiate(hello, host_mtu=self.path.host_mtu)
        assert self.transport is not None
        self.transport.write(push_hello(answer))
        self.start += HELLO_LEN
        self.hello_done = True
        self.offloads = answer.offloads
        self.path.set_stream(answer.mtu, answer.offloads)
        self.router.streams_changed()
        return True

    def _frames(self) -> None:
        now = self.clock()
        while not self.closed:
            view = self._mv[self.start : self.end]
            consumed, bad = self.router.outbound(self.path, view, now)
            self.start += consumed
            if bad:
                self.close("bad_frame_length")
                return
            if consumed == 0:
                break
        if self.start == self.end:
            self.start = self.end = 0
        elif RX_SIZE - self.end < _ROOM:
            # What is left is under one frame and sits past RX_SIZE - 2 frames: the copy cannot overlap.
            rem = self.end - self.start
            self.buf[:rem] = self._mv[self.start : self.end]
            self.start, self.end = 0, rem

    def deliver(self, frames: list[memoryview]) -> None:
        """Write delivery frames (``u32 len | vnet hdr | IPv4``) to the guest, one write for all."""
        if self.transport is None or self.closed or not self.hello_done:
            return
        if self.paused_since is not None:
            self.path.drops["guest_backlog"] += len(frames)
            return
        self.transport.write(b"".join(frames))

    def close(self, reason: str | None = None) -> None:
        if reason is not None:
            self.path.drops[reason] += 1
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()
