"""The gateway's HTTP/2 client to a sandbox app that speaks h2c: one HTTP/2 connection over one link.

For a port whose protocol is ``h2c`` (gRPC, or any app that serves HTTP/2 in cleartext) the forwarder
link, after the forwarder's OK, carries HTTP/2 with prior knowledge (RFC 9113 3.3): our connection preface
first, no Upgrade dance. The h2 library keeps the connection's state (frames, HPACK, both flow-control
windows); this module moves its bytes over the link and hands each stream's events to whoever opened it.
It parses nothing itself.

A stream (``H2cStream``) is opened with its request head; ``send_data`` sends no faster than the app's
stream and connection windows allow (it waits for WINDOW_UPDATE); ``send_trailers`` or ``end`` ends the
request; ``reset`` passes an error code on. ``next`` gives the response as the app sends it: ``Head``
(``informational`` for a 1xx; ``ended`` for a head with END_STREAM, which a gRPC trailers-only answer is),
``Data``, ``Trailers`` (always the end), ``End``, ``Reset`` (the app's RST_STREAM code), ``Broken`` (the
connection is gone; ``refused`` when the app said, by GOAWAY, that it never processed the stream, so a
client may retry it). Received DATA is acknowledged only when the reader calls ``ack``: the client front
does once it has passed the bytes on, so the app's window is the backpressure and nothing is buffered
beyond it.

One reader task moves link bytes into h2 and events to streams; writes leave in the order h2 produced
them, under one lock. A stream the app's SETTINGS_MAX_CONCURRENT_STREAMS has no room for waits until one
closes. A GOAWAY from the app ends the whole connection: h2 moves to CLOSED on GOAWAY and refuses every
later frame (python-hyper/h2 issue 1181), so the streams the app had taken cannot finish on it either;
they are ``Broken`` (not refused), the others ``Broken(refused=True)``, and ``usable`` goes False so the
caller opens a new connection for its next stream. The link ending, a write failing or the app breaking
the protocol breaks every open stream the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from sbxnet.tls_stream import TlsStream

log = logging.getLogger("sbxnet.gateway")

Headers = list[tuple[bytes, bytes]]

STREAM_WINDOW = 1 << 20  # what the app may send on one stream before the client front has passed it on
CONNECTION_WINDOW = 16 << 20  # larger than one stream's: one slow client stream must not stall the others
MAX_HEADER_LIST = 64 << 10  # a response head or trailers from the app (gRPC metadata rides here)


@dataclass(frozen=True)
class Head:
    headers: Headers  # with :status
    informational: bool = False  # a 1xx: the final head follows
    ended: bool = False  # END_STREAM came with it (no body, no trailers)


@dataclass(frozen=True)
class Data:
    data: bytes
    flow: int  # the flow-controlled length (padding included): what ``ack`` must be given


@dataclass(frozen=True)
class Trailers:
    headers: Headers  # the stream ends with them


@dataclass(frozen=True)
class End:
    pass


@dataclass(frozen=True)
class Reset:
    code: int  # the app's RST_STREAM error code


@dataclass(frozen=True)
class Broken:
    reason: str  # a stable token
    refused: bool = False  # the app's GOAWAY says it never processed this stream


Event = Head | Data | Trailers | End | Reset | Broken

_END = End()


class FrameSizeGuard:
    """Refuses an HTTP/2 frame over the size limit as soon as its 9-byte header is in.

    h2 (4.4) checks a frame's length only once the whole frame has arrived (``FrameBuffer``), so a peer
    that claims a 16 MiB frame is buffered that far before it is refused, and a peer that is not speaking
    HTTP/2 at all (an SSH banner reads as a 5 MB frame header) holds its streams until it sends 5 MB. This
    walks the frame boundaries (RFC 9113 4.1: a 24-bit length, then 6 more header bytes, then the payload)
    and reads nothing but the lengths; h2 still parses everything. ``skip`` bytes come before the first
    frame (a client's 24-byte connection preface, which h2 checks itself). Pure: bytes in, a verdict out."""

    def __init__(self, *, skip: int = 0) -> None:
        self._skip = skip
        self._need = 0  # payload bytes of the current frame still to come
        self._head = bytearray()

    def feed(self, data: bytes, limit: int) -> bool:
        """Account for ``data``; False when a frame header in it names a payload over ``limit`` bytes."""
        n = len(data)
        i = 0
        while i < n:
            if self._skip:
                k = min(self._skip, n - i)
                self._skip -= k
            elif self._need:
                k = min(self._need, n - i)
                self._need -= k
            else:
                k = min(9 - len(self._head), n - i)
                self._head += data[i : i + k]
                if len(self._head) == 9:
                    length = int.from_bytes(self._head[:3], "big")
                    self._head.clear()
                    if length > limit:
                        return False
                    self._need = length
            i += k
        return True


class H2cUnusable(Exception):
    """The connection takes no new stream (GOAWAY, closed, broken): open another."""


@dataclass
class H2cStream:
    """One request/response on the connection. One task reads it (``next``, ``ack``), one sends it."""

    conn: H2cConnection
    id: int
    _events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    _window: asyncio.Event = field(default_factory=asyncio.Event)
    _finished: bool = False  # the response is over (End, Trailers, an ended Head, Reset, Broken queued)
    _gone: bool = False  # reset (either way) or broken: nothing more can be sent on it

    @property
    def finished(self) -> bool:
        """The response is over (ended, reset or broken) as far as events go."""
        return self._finished

    async def next(self) -> Event:
        return await self._events.get()

    def _put(self, ev: Event) -> None:
        if self._finished:
            return  # h2 follows an ended head or trailers with StreamEnded: one end is enough
        if isinstance(ev, End | Trailers | Reset | Broken) or (isinstance(ev, Head) and ev.ended):
            self._finished = True
        if isinstance(ev, Reset | Broken):
            self._gone = True
            self._window.set()  # a sender waiting for window wakes and finds the stream gone
        self._events.put_nowait(ev)

    async def send_data(self, data: bytes, *, end: bool = False) -> None:
        """Send ``data`` within the app's windows, waiting for WINDOW_UPDATE as needed. Raises
        ``H2cUnusable`` when the connection broke, ``h2.exceptions.StreamClosedError`` when the stream
        was reset meanwhile."""
        c = self.conn
        view = memoryview(data)
        while view:
            c.check_alive()
            if self._gone:
                raise h2.exceptions.StreamClosedError(self.id)
            n = min(c.h2.local_flow_control_window(self.id), c.h2.max_outbound_frame_size, len(view))
            if n <= 0:
                self._window.clear()
                await self._window.wait()
                continue
            c.h2.send_data(self.id, view[:n].tobytes(), end_stream=end and n == len(view))
            view = view[n:]
            await c.flush()
        if end and not data:
            await self.end()

    async def end(self) -> None:
        self.conn.check_alive()
        self.conn.h2.end_stream(self.id)
        await self.conn.flush()

    async def send_trailers(self, headers: Headers) -> None:
        self.conn.check_alive()
        self.conn.h2.send_headers(self.id, headers, end_stream=True)
        await self.conn.flush()

    async def ack(self, flow: int) -> None:
        """Give the app ``flow`` bytes of window back (for this stream and the connection)."""
        c = self.conn
        if c.dead is not None or flow <= 0:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            c.h2.acknowledge_received_data(flow, self.id)
        with contextlib.suppress(H2cUnusable):
            await c.flush()

    def reset(self, code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        """RST_STREAM to the app with ``code``, unless the stream is over already. Does not wait: safe in
        a task being cancelled; the frame leaves with the connection's next write."""
        c = self.conn
        self._finished = self._gone = True
        c.forget(self.id)
        if c.dead is not None:
            return
        s = c.h2.streams.get(self.id)
        if s is None or s.closed:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            c.h2.reset_stream(self.id, error_code=code)
        c.flush_soon()

    def close(self) -> None:
        """The caller is done with the stream: stop routing its events (reset it first if it is open)."""
        self.conn.forget(self.id)


class H2cConnection:
    """HTTP/2 client side over ``link`` (a forwarder link after its OK; ``leftover`` came with the OK)."""

    def __init__(self, link: TlsStream, leftover: bytes = b"", *, max_header_list: int = MAX_HEADER_LIST,
                 on_dead: Callable[[H2cConnection], None] | None = None) -> None:
        self.link = link
        self._on_dead = on_dead  # called once, when the connection goes (the caller's bookkeeping)
        self._leftover = leftover
        config = h2.config.H2Configuration(client_side=True, header_encoding=None,
                                           validate_inbound_headers=True, validate_outbound_headers=True)
        self.h2 = h2.connection.H2Connection(config=config)
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0,  # no pushed streams
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list,
        })
        self.streams: dict[int, H2cStream] = {}
        self._guard = FrameSizeGuard()
        self.dead: str | None = None  # why the connection is gone (a stable token), once it is
        self.goaway = False
        self._write_lock = asyncio.Lock()
        self._slot = asyncio.Event()  # a stream closed or the app's limit changed
        self._reader: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.streams_opened = 0

    # -- the connection ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Send the preface and our SETTINGS; start reading."""
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        leftover, self._leftover = self._leftover, b""
        # The app's SETTINGS may have come with the forwarder's OK.
        if leftover and not self._receive(leftover):
            with contextlib.suppress(H2cUnusable):
                await self.flush()  # our GOAWAY
            self._break("upstream_protocol_error")
            return
        await self.flush()
        self._reader = asyncio.create_task(self._read_loop())

    @property
    def usable(self) -> bool:
        """Whether a new stream may be opened on it."""
        return self.dead is None and not self.goaway

    @property
    def closed(self) -> bool:
        """Dead, and no task of its own left running."""
        return self.dead is not None and all(t.done() for t in (self._reader, *self._background) if t is not None)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise H2cUnusable(self.dead)

    async def flush(self) -> None:
        async with self._write_lock:  # FIFO: frames leave in the order h2 produced them
            data = self.h2.data_to_send()
            if not data:
                return
            self.check_alive()
            try:
                await self.link.write(data)
            except (OSError, ssl.SSLError):
                self._break("link_write_failed")
                raise H2cUnusable("link_write_failed") from None

    def flush_soon(self) -> None:
        if self.dead is not None:
            return
        task = asyncio.get_running_loop().create_task(self._quiet_flush())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quiet_flush(self) -> None:
        with contextlib.suppress(H2cUnusable):
            await self.flush()

    async def open_stream(self, headers: Headers, *, end_stream: bool) -> H2cStream:
        """Send a request head on a new stream (waiting for room under the app's stream limit).
        ``H2cUnusable`` if the connection takes no new stream."""
        while True:
            if not self.usable:
                raise H2cUnusable(self.dead or "goaway")
            if self.h2.open_outbound_streams < self.h2.remote_settings.max_concurrent_streams:
                break
            self._slot.clear()
            await self._slot.wait()
        sid = self.h2.get_next_available_stream_id()
        st = H2cStream(self, sid)
        self.streams[sid] = st
        self.streams_opened += 1
        try:
            self.h2.send_headers(sid, headers, end_stream=end_stream)
            await self.flush()
        except BaseException:
            self.forget(sid)
            raise
        return st

    def forget(self, stream_id: int) -> None:
        if self.streams.pop(stream_id, None) is not None:
            self._slot.set()

    async def close(self, *, grace: float = 1.0) -> None:
        """Close: what is pending (the resets of streams given up) and a GOAWAY go out within ``grace``
        seconds, then the link is aborted (the forwarder passes the reset on to the app) and every open
        stream gets ``Broken``."""
        if self.dead is None and grace > 0:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.close_connection()
            with contextlib.suppress(H2cUnusable, TimeoutError):
                await asyncio.wait_for(self.flush(), grace)
        self._break("closed")
        tasks = [t for t in (self._reader, *self._background) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _break(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            self.link.abort()
            if self._on_dead is not None:
                self._on_dead(self)
        for st in list(self.streams.values()):
            st._put(Broken(reason))
        self.streams.clear()
        self._slot.set()

    async def _read_loop(self) -> None:
        reason = "link_closed"
        try:
            while True:
                data = await self.link.read()
                if not data:
                    break
                if not self._receive(data):
                    reason = "upstream_protocol_error"
                    with contextlib.suppress(H2cUnusable):
                        await self.flush()  # our GOAWAY
                    break
                if self.goaway:
                    reason = "upstream_goaway"
                    break
                await self.flush()  # SETTINGS and PING acknowledgements, connection WINDOW_UPDATEs
        except (OSError, ssl.SSLError):
            reason = "link_reset"
        except H2cUnusable as e:
            reason = str(e)
        finally:
            self._break(reason)

    def _receive(self, data: bytes) -> bool:
        """Feed the app's bytes to h2 and route the events; False if the app broke HTTP/2."""
        if not self._guard.feed(data, self.h2.max_inbound_frame_size):
            log.debug("h2c upstream: a frame over %d bytes", self.h2.max_inbound_frame_size)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.close_connection(error_code=h2.errors.ErrorCodes.FRAME_SIZE_ERROR)
            return False
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            log.debug("h2c upstream protocol error: %r", e)
            code = getattr(e, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.close_connection(error_code=code)
            return False
        for ev in events:
            self._event(ev)
        return True

    def _event(self, ev: h2.events.Event) -> None:
        st = self.streams.get(getattr(ev, "stream_id", 0) or 0)
        if isinstance(ev, h2.events.InformationalResponseReceived):
            if st is not None:
                st._put(Head(list(ev.headers), informational=True))
        elif isinstance(ev, h2.events.ResponseReceived):
            if st is not None:
                st._put(Head(list(ev.headers), ended=ev.stream_ended is not None))
        elif isinstance(ev, h2.events.DataReceived):
            if st is None:
                # Nobody will pass these bytes on (the stream was reset or given up): give the window back.
                with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            else:
                st._put(Data(ev.data, ev.flow_controlled_length))
        elif isinstance(ev, h2.events.TrailersReceived):
            if st is not None:
                st._put(Trailers(list(ev.headers)))
        elif isinstance(ev, h2.events.StreamEnded):
            if st is not None:
                st._put(_END)
            self._slot.set()  # it may be closed both ways now
        elif isinstance(ev, h2.events.StreamReset):
            if st is not None:
                st._put(Reset(int(ev.error_code)))
            self.forget(ev.stream_id)
        elif isinstance(ev, h2.events.WindowUpdated):
            if ev.stream_id == 0:
                for s in self.streams.values():
                    s._window.set()
            elif st is not None:
                st._window.set()
        elif isinstance(ev, h2.events.RemoteSettingsChanged):
            for s in self.streams.values():
                s._window.set()
            self._slot.set()
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.goaway = True
            last = ev.last_stream_id if ev.last_stream_id is not None else 0
            for sid, s in list(self.streams.items()):
                s._put(Broken("upstream_goaway", refused=sid > last))
            self.streams.clear()
            self._slot.set()
