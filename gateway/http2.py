"""One HTTP/2 client connection (ALPN ``h2``): every stream is a request, routed and proxied on its own.

The h2 library keeps the connection's state (frames, HPACK, both flow-control windows); this module moves
its bytes and carries each stream to the sandbox's app in the way the port's protocol says.

Per stream, first whether the request is malformed (RFC 9113 8.1.1: a stream error, the other streams go
on; ``request_rules``, which does every check h2 would have done and more, h2's own being off: a malformed
head is answered 400 on its stream, then reset PROTOCOL_ERROR if the client had not ended it, nothing
upstream; DATA against its content-length or malformed
trailers reset the stream PROTOCOL_ERROR, its link aborted, ``_stream_error``), then exactly as the
HTTP/1.1 front decides a request (``http1.admit``): the target's form (400), ``routing.request_target``
with ``:authority`` and any Host (400), the route of the stream's own name (404), a wake (503 with
Retry-After), ``auth.authorize`` against that route (401/403/redirect), then the link (502/503/504).
Browsers coalesce: they send streams for every name the connection's certificate covers on one connection
(RFC 9113 9.1.1). A stream whose authority names another sandbox or port than the connection's server name
is therefore routed to its own sandbox and port, with its own authentication and its own slot of that
sandbox's connection limit, when the certificate this connection presented covers the name
(``tls_front.FrontTls.presented_names``), and answered 421 when it does not; it never reaches the
connection's first sandbox. Every link it opens is logged under the client connection's ``conn_id``.
Each stream gets its access-log line when it ends (``http1.RequestLog``), refused, answered or reset.

An ``http`` port: the stream becomes one HTTP/1.1 exchange (``h1_codec.H1Client``, on a link to the forwarder
opened only once the stream is admitted; after a whole exchange the app kept alive, the link is kept, up to
``KEPT_LINKS_PER_PORT`` per sandbox port, for the connection's next stream to that port, and checked before
that stream uses it, since the app may close an idle connection on its own clock): ``:method :path HTTP/1.1`` with
``Host`` from the name, HTTP/2-only and hop-by-hop headers dropped, cookies joined, a body without
Content-Length chunked. The response comes back as HEADERS and DATA; connection-specific response headers
are dropped.

An ``h2c`` port (gRPC): the stream becomes a stream of an HTTP/2 connection to the app
(``h2c_upstream.py``: prior knowledge over the link). One such connection per (sandbox, port, route) per
client connection, opened by the first stream that needs it (with the link's usual retries, and one slot
of the sandbox's connection limit), shared by the later ones (a gRPC channel's calls ride one link), closed
with the client connection; one the app ends (GOAWAY, close) is replaced for the next stream. The head goes
on with ``:authority`` the routed name, ``:scheme`` https, the token removed and X-Forwarded-* set (the same
``auth.authorize`` output), connection-specific headers dropped and ``te: trailers`` kept. Informational
heads, the head (END_STREAM on it kept: a gRPC trailers-only answer), DATA and trailers come back as they
came; RST_STREAM passes both ways with its code; a stream the app's GOAWAY refused is reset
REFUSED_STREAM (the client may retry it). Before the response head, a link or app failure is answered
502/503/504 like any route (gRPC clients read those as UNAVAILABLE, 401/403 as UNAUTHENTICATED and
PERMISSION_DENIED); after it, the stream is reset INTERNAL_ERROR.

Bodies stream both ways, never buffered whole: received DATA is acknowledged (``acknowledge_received_data``)
only once written upstream (over h2c: once the app's window took it), so the client's window is the
backpressure; response DATA is sent no faster than the client's stream and connection windows allow (a
stream waits for WINDOW_UPDATE), and an h2c app's DATA is acknowledged to it only once sent to the client.
A stream that fails is reset (or answered 502 before its response began); the other streams go on. Not
served: extended CONNECT (WebSockets over HTTP/2: the SETTINGS_ENABLE_CONNECT_PROTOCOL setting is not sent,
so clients use HTTP/1.1 for them), server push.

How it ends. An ``http`` stream's link is closed in order (close_notify then FIN: the app reads an end of
stream) once its exchange is complete both ways, and aborted (a reset at the app) when the request or the
response was cut. An h2c connection is closed with GOAWAY then close_notify and FIN when the client
connection ends: a stream cut by then has been reset at the app with its own RST_STREAM already.

Drain (``drain``): GOAWAY with NO_ERROR and the highest stream id taken so far goes out at once; those
streams finish; a stream the client opens after it (it had not read the GOAWAY yet) is reset
REFUSED_STREAM, so it knows the stream was not processed and may retry it elsewhere; once no stream is left
the connection is closed in order. h2 (4.4) cannot do this itself: after its own GOAWAY
(``close_connection``) it sends nothing more and refuses every later frame (python-hyper/h2 issue 1181), so
the streams in flight could not finish. The GOAWAY frame is therefore written here (``goaway_frame``),
beside h2's bytes, and h2 goes on serving the streams it has. ``idle_timeout`` (no stream open, no byte
from the client) ends a connection the same way; it is a timer, not a timeout on the read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import h2.utilities

from gateway import h1_codec as h1
from gateway import h2c_upstream as h2c
from gateway.http1 import HOP_BY_HOP, Admitted, Refusal, RequestLog, admit, replayable
from gateway.names import Name
from gateway.relay import CLOSE_LINGER, close_cleanly, drop_link
from gateway.request_rules import RequestRefused, check_h2_head, check_h2_trailers, h2_content_length, h2_data
from gateway.routing import Forward
from gateway.upstream import UpstreamFailed
from sbxnet.errors import LocalProtocolError, RemoteProtocolError
from sbxnet.tls_stream import TlsStream

log = logging.getLogger("sbxnet.gateway")

MAX_CONCURRENT_STREAMS = 100
_CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 3.4
STREAM_WINDOW = 1 << 20  # what a client may send on one stream before we acknowledge it
CONNECTION_WINDOW = 4 << 20
KEPT_LINKS_PER_PORT = 8  # idle HTTP/1.1 links kept per sandbox port on one client connection


class _KeptLinkFailed(Exception):
    """A kept link failed before any answer to a replayable request: send it again on a fresh link."""


def _link_key(fwd: Forward) -> tuple[object, ...]:
    r = fwd.route
    return (fwd.sandbox, fwd.port, r.incarnation, r.forwarder, r.target_ip)
# Headers that mean something for one HTTP/1.1 connection only, never sent as HTTP/2 (RFC 9113 8.2.2).
_RESPONSE_DROP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"te",
                  b"trailer"}


class _ClientGone(Exception):
    pass


_END = object()

_GOAWAY = 0x7  # RFC 9113 6.8


def goaway_frame(last_stream_id: int, error_code: int = 0, debug: bytes = b"") -> bytes:
    """A GOAWAY frame (RFC 9113 6.8): the 9-byte frame header (length, type 0x7, no flags, stream 0), then
    the last stream id (31 bits, the reserved bit clear), the error code and any debug data."""
    if not 0 <= last_stream_id < 1 << 31:
        raise ValueError(f"stream id out of range: {last_stream_id}")
    payload = struct.pack(">II", last_stream_id, error_code) + debug
    return len(payload).to_bytes(3, "big") + bytes((_GOAWAY, 0)) + bytes(4) + payload


class _TrailersWithoutEnd(h2.events.Event):
    """Trailers came without END_STREAM: h2 has reset the stream PROTOCOL_ERROR (``_RequestStream``)."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class _RequestStream(h2.stream.H2Stream):
    """h2's stream, where h2 (4.4) raises a malformed request as a connection error (GOAWAY: every stream on
    the connection dies), RFC 9113 8.1.1 making it a stream error:

    - no content-length checks (a malformed ``content-length``, DATA that disagrees with it):
      ``request_rules.h2_content_length`` and ``H2Session._data`` do them per stream;
    - a request whose ``:status`` starts with 1 (h2 takes the block for an informational response, a state
      error on a server): h2 gets the block without ``:status``, the event carries it as it came, and
      ``request_rules`` refuses it (``bad_pseudo_header``);
    - trailers without END_STREAM (RFC 9113 8.1): the stream is reset PROTOCOL_ERROR through h2's own
      stream-error path (a ``StreamClosedError`` for a stream we reset), with ``_TrailersWithoutEnd`` for
      the session."""

    def _initialize_content_length(self, headers: Any) -> None:
        self._expected_content_length = None

    def _track_content_length(self, length: int, end_stream: bool) -> None:
        self._actual_content_length += length

    def receive_headers(self, headers: Any, end_stream: bool, header_encoding: Any) -> Any:
        fields = list(headers)
        if (not end_stream and self.state_machine.headers_received
                and self.state_machine.state in (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL)):
            self.reset_stream(h2.errors.ErrorCodes.PROTOCOL_ERROR)  # its frame: h2 sends one for the error below
            error = h2.exceptions.StreamClosedError(self.stream_id)
            error.error_code = h2.errors.ErrorCodes.PROTOCOL_ERROR
            error._events = [_TrailersWithoutEnd(self.stream_id)]
            raise error
        if h2.utilities.is_informational_response(fields):
            frames, events = super().receive_headers([f for f in fields if f[0] != b":status"], end_stream,
                                                     header_encoding)
            events[0].headers = fields  # type: ignore[attr-defined]
            return frames, events
        return super().receive_headers(fields, end_stream, header_encoding)


class _ServerConnection(h2.connection.H2Connection):
    """h2's connection whose client streams are ``_RequestStream`` (h2 4.4 has no setting for it)."""

    def _begin_new_stream(self, stream_id: int, allowed_ids: h2.connection.AllowedStreamIDs) -> h2.stream.H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        stream.__class__ = _RequestStream  # the same object, only the methods above differ
        return stream


def server_connection() -> h2.connection.H2Connection:
    """An h2 server connection as the HTTP/2 front runs it. h2 would raise a malformed request as a
    connection error (GOAWAY): its inbound checks are off and ``request_rules`` does every one of them per
    stream, on the fields as they came (not normalized: h2's cookie joining moves cookies after the
    pseudo-headers, hiding a pseudo-header sent after one). Outbound validation stays."""
    config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=False,
                                       normalize_inbound_headers=False, validate_outbound_headers=True)
    return _ServerConnection(config=config)


@dataclass
class _Stream:
    id: int
    headers: list[tuple[bytes, bytes]]
    ended: bool  # END_STREAM came with the request's HEADERS (or, for content-length 0, before it went up)
    refused: RequestRefused | None = None  # the head is malformed (request_rules): answered 400
    length: int | None = None  # its content-length: the DATA must add up to it (RFC 9113 8.1.1)
    received: int = 0  # DATA bytes received
    held: tuple[bytes, int] | None = None  # the DATA that completed content-length, held until END_STREAM
    error: str = ""  # a stream error found after the head (reason token): reset PROTOCOL_ERROR
    started: bool = False  # its task has begun (a task cancelled before that never runs its finally: not done)
    body: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)  # (data, flow length), trailers, _END
    window: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    done: bool = False  # the handler finished: later DATA is acknowledged and dropped
    chunked: bool = False  # the request goes upstream chunked (it had no Content-Length)
    reset_code: int | None = None  # the client's RST_STREAM code, passed on to an h2c app
    rec: RequestLog = field(default_factory=lambda: RequestLog("h2", "", time.monotonic()))


class _SandboxFull(Exception):
    pass


@dataclass
class _H2cLink:
    """One h2c connection to a sandbox's port, shared by the client connection's streams for it."""

    sandbox: str  # whose connection slot it holds ("" once given back, or when it holds none)
    opening: asyncio.Task[h2c.H2cConnection] | None = None
    conn: h2c.H2cConnection | None = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # the connection is dead (its reader ended)


class H2Session:
    """Serve one client connection; ``run`` returns when it is closed."""

    def __init__(self, gw: Any, client: TlsStream, peer: tuple[str, int], conn_name: Name | None,
                 bad_sni: bool, conn_id: str) -> None:
        self.gw = gw
        self.client = client
        self.peer = peer
        self.conn_name = conn_name
        self.bad_sni = bad_sni
        self.conn_id = conn_id
        # The names this connection's certificate covers: the names its streams may be routed to.
        self.cert_names = gw.config.front.presented_names(client.ssl_object)
        self.h2 = server_connection()
        self._guard = h2c.FrameSizeGuard(skip=len(_CLIENT_PREFACE))  # h2 checks the preface itself
        self.streams: dict[int, _Stream] = {}
        self._write_lock = asyncio.Lock()
        self._gone = False
        self._h2c: dict[tuple[object, ...], _H2cLink] = {}  # the usable ones, by route and port
        self._h2c_all: list[_H2cLink] = []  # every one opened, closed when the client connection ends
        # HTTP/1.1 links whose last exchange was whole and kept alive by the app, for the next stream to
        # the same sandbox port (one exchange at a time on each), by route and port.
        self._kept: dict[tuple[object, ...], list[tuple[TlsStream, h1.H1Client]]] = {}
        self._link_closes: set[asyncio.Task[bool]] = set()  # kept links being closed in order
        self.kind = "h2"
        self._started = False  # our SETTINGS went first: a GOAWAY may follow
        self._drain_wanted = False
        self._last_stream: int | None = None  # the drain's GOAWAY: the last stream taken; later ones refused
        self._goaway_sent = False
        self._closing = False  # close_notify is out (or going): nothing more is written
        self._closer: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()  # run() is ending: the closer need not wait for the client any more
        self._tasks: set[asyncio.Task[None]] = set()
        self._cut = False
        self._idle: asyncio.TimerHandle | None = None  # idle_timeout, armed while no stream is open
        self._last_read = 0.0  # loop time of the client's last bytes
        self._conn_error = ""  # the reason token of a connection error h2 found (the connection is ending)

    def drain(self) -> None:
        """The gateway drains: GOAWAY (NO_ERROR, the highest stream taken) now; the streams in flight finish,
        later ones are refused; the connection closes in order when none is left."""
        if not self._started:
            self._drain_wanted = True  # run() sends it once our SETTINGS are out
            return
        self._go_away()

    def _arm_idle(self, delay: float | None = None) -> None:
        if self._idle is None and self._last_stream is None:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(self.gw.config.idle_timeout if delay is None else delay, self._idle_check)

    def _idle_check(self) -> None:
        """``idle_timeout`` with no stream open and no byte from the client: the connection goes away as at a
        drain (GOAWAY, then closed in order). A timer, not a timeout on the read: the read may have begun
        while a stream was open, and a read cut short by a timeout can lose what it had just received."""
        self._idle = None
        if self._last_stream is not None or self._gone or self._active():
            return  # going away already, gone, or a stream is open (its end arms the timer again)
        left = self._last_read + self.gw.config.idle_timeout - asyncio.get_running_loop().time()
        if left > 0:
            self._arm_idle(left)
            return
        self.gw.metrics.refusals.labels("idle_timeout").inc()
        self._go_away()

    def _go_away(self) -> None:
        """GOAWAY (NO_ERROR, the highest stream taken) now; later streams are refused; the connection is
        closed in order once no stream is left."""
        if self._last_stream is not None:
            return
        self._last_stream = self.h2.highest_inbound_stream_id
        task = asyncio.create_task(self._send_goaway(self._last_stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_goaway(self, last: int) -> None:
        async with self._write_lock:
            if self._gone or self._closing:
                return
            try:
                await self.client.write(goaway_frame(last))
            except OSError:
                self._gone = True
                return
            self._goaway_sent = True
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        if self._goaway_sent and self._closer is None and not self._gone and not self._active():
            self._closer = asyncio.create_task(self._close_drained())

    async def _close_drained(self) -> None:
        """After our GOAWAY, no stream left: close_notify then FIN, then the client's own end, which ends
        run(); a client that does not end its side within the linger is closed on."""
        async with self._write_lock:
            self._closing = True
            pending = self.h2.data_to_send()  # window updates, resets of refused streams: before the end
            try:
                async with asyncio.timeout(CLOSE_LINGER):
                    if pending:
                        await self.client.write(pending)
                    await self.client.write_eof()
            except (OSError, TimeoutError):
                pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended.wait(), CLOSE_LINGER)
            return
        self.client.close()  # run()'s read ends with it

    def _close_connection(self, code: h2.errors.ErrorCodes | int = 0) -> None:
        """h2's GOAWAY, naming no stream past the drain's (GOAWAY's last stream id never grows)."""
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection(error_code=code, last_stream_id=self._last_stream)

    # -- the connection ----------------------------------------------------------------------------

    async def _flush(self) -> None:
        data = self.h2.data_to_send()
        if not data:
            return
        async with self._write_lock:  # FIFO: frames leave in the order h2 produced them
            if self._closing:
                return  # closed in order after the drain: a late frame has nowhere to go
            if self._gone:
                raise _ClientGone()
            try:
                await self.client.write(data)
            except OSError:
                self._gone = True
                raise _ClientGone() from None

    async def run(self) -> None:
        cfg = self.gw.config
        loop = asyncio.get_running_loop()
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: cfg.max_header_bytes,
        })
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        try:
            await self._flush()
            self._started = True
            if self._drain_wanted or self.gw.draining:
                self.drain()
            first = True
            while True:
                try:
                    if first:
                        data = await asyncio.wait_for(self.client.read(), cfg.header_timeout)
                    else:
                        data = await self.client.read()  # idle_timeout: ``_idle_check``
                except TimeoutError:
                    self.gw.metrics.refusals.labels("header_timeout").inc()
                    self._close_connection()
                    await self._flush()
                    return
                except OSError:
                    return
                first = False
                if not data:
                    return
                self._last_read = loop.time()
                if not self._guard.feed(data, self.h2.max_inbound_frame_size):
                    self.gw.metrics.refusals.labels("frame_too_large").inc()
                    self._close_connection(h2.errors.ErrorCodes.FRAME_SIZE_ERROR)
                    await self._flush()
                    return
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError as e:
                    # A connection error h2 found (frames, HPACK, stream states: a malformed request is a
                    # stream error, ``_event``): GOAWAY, one line, no traceback. Its text is not logged: it
                    # may quote a header's value (a token).
                    reason = "bad_request"
                    self.gw.metrics.refusals.labels(reason).inc()
                    code = getattr(e, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
                    log.info("HTTP/2 protocol error: connection closed", extra={
                        "event": "h2_refused", "reason": reason, "conn_id": self.conn_id,
                        "fields": {"error_code": int(code), "error": type(e).__name__}})
                    self._conn_error = reason  # the streams it cuts say so in their lines
                    self._close_connection(code)
                    await self._flush()
                    return
                ended = False
                for ev in events:
                    ended = self._event(ev) or ended
                if self._idle is None and not self._active():
                    self._arm_idle()
                await self._flush()
                if ended:
                    await self._wait_streams()
                    return
        except _ClientGone:
            return
        except asyncio.CancelledError:
            self._cut = True  # a drain's cut: the h2c links are aborted, not closed in order
            raise
        finally:
            self._ended.set()
            if self._idle is not None:
                self._idle.cancel()
            for st in list(self.streams.values()):
                if st.task is not None:
                    st.task.cancel()
            tasks = [st.task for st in self.streams.values() if st.task is not None]
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in list(self._tasks):
                task.cancel()
            await self._close_kept()
            await self._close_h2c()
            if self._closer is not None:
                await self._closer

    def _active(self) -> bool:
        return any(not st.done for st in self.streams.values())

    async def _wait_streams(self) -> None:
        """After the client's GOAWAY: let the streams it had opened finish."""
        tasks = [st.task for st in self.streams.values() if st.task is not None and not st.done]
        if tasks:
            await asyncio.wait(tasks, timeout=self.gw.config.idle_timeout)

    def _event(self, ev: Any) -> bool:
        """Handle one h2 event; True when the client ended the connection (GOAWAY)."""
        st: _Stream | None
        if isinstance(ev, h2.events.RequestReceived):
            if self._last_stream is not None and ev.stream_id > self._last_stream:
                self._refuse(ev)
                return False
            new = _Stream(ev.stream_id, list(ev.headers), ev.stream_ended is not None,
                          rec=RequestLog("h2", self.conn_id, time.monotonic()))
            try:
                check_h2_head(new.headers, ended=new.ended)
                new.length = h2_content_length(new.headers)
            except RequestRefused as e:
                new.refused = e  # answered 400 by its task; its DATA is dropped
            self.streams[ev.stream_id] = new
            new.task = asyncio.create_task(self._serve(new))
        elif isinstance(ev, h2.events.DataReceived):
            st = self.streams.get(ev.stream_id)
            if st is None or st.done or st.error:
                self._ack(ev.flow_controlled_length, ev.stream_id)
            else:
                self._data(st, ev.data, ev.flow_controlled_length, ev.stream_ended is not None)
        elif isinstance(ev, h2.events.TrailersReceived):
            st = self.streams.get(ev.stream_id)
            if st is not None and not st.done and not st.error and st.refused is None:
                try:
                    check_h2_trailers(list(ev.headers))
                    h2_data(st.length, st.received, 0, end=True)  # the DATA is over
                except RequestRefused as e:
                    self._stream_error(st, e.reason)
                else:
                    self._release_held(st)
                    st.body.put_nowait(list(ev.headers))
        elif isinstance(ev, h2.events.StreamEnded):
            st = self.streams.get(ev.stream_id)
            if st is not None and not st.done and not st.error:
                self._release_held(st)
                st.body.put_nowait(_END)
        elif isinstance(ev, _TrailersWithoutEnd):
            st = self.streams.get(ev.stream_id)
            if st is not None and not st.done and not st.error and st.refused is None:
                self._stream_error(st, "bad_trailers")  # h2 has reset it already
        elif isinstance(ev, h2.events.StreamReset):
            st = self.streams.get(ev.stream_id)
            if st is not None and st.task is not None and not st.done:
                st.reset_code = int(ev.error_code)
                if st.started:  # else its task sees reset_code as it begins (cancelled unstarted, it never runs)
                    st.task.cancel()
        elif isinstance(ev, h2.events.WindowUpdated):
            if ev.stream_id == 0:
                for st in self.streams.values():
                    st.window.set()
            elif (st := self.streams.get(ev.stream_id)) is not None:
                st.window.set()
        elif isinstance(ev, h2.events.RemoteSettingsChanged):
            for st in self.streams.values():
                st.window.set()
        elif isinstance(ev, h2.events.ConnectionTerminated):
            return True
        return False

    def _data(self, st: _Stream, data: bytes, flow: int, end: bool) -> None:
        """DATA for a stream, held to its content-length (RFC 9113 8.1.1): more than it, or an end short of
        it, is a stream error; the DATA that completes it waits for END_STREAM (or trailers) before going
        upstream, so an app never sees a whole request that turns out malformed."""
        st.received += len(data)
        try:
            hold = st.refused is None and h2_data(st.length, st.received, len(data), end=end)
        except RequestRefused as e:
            self._ack(flow, st.id)
            self._stream_error(st, e.reason)
            return
        if hold:
            st.held = (data, flow)  # nothing was held: the DATA before it fell short of content-length
            return
        if end:
            self._release_held(st)
        st.body.put_nowait((data, flow))  # an empty DATA before the end leaves what is held where it is

    def _release_held(self, st: _Stream) -> None:
        if st.held is not None:
            st.body.put_nowait(st.held)
            st.held = None

    def _stream_error(self, st: _Stream, reason: str) -> None:
        """A request found malformed after its head (DATA against content-length, bad trailers): a stream
        error (RFC 9113 8.1.1), RST_STREAM PROTOCOL_ERROR; the other streams go on. Its task is cancelled
        (a link it opened is aborted: the app sees a reset, never an end), counted under ``reason``, which
        its access-log line says: one line, no traceback."""
        st.error = reason
        if st.held is not None:
            self._ack(st.held[1], st.id)
            st.held = None
        self.gw.metrics.refusals.labels(reason).inc()
        self._reset(st, h2.errors.ErrorCodes.PROTOCOL_ERROR)
        if st.task is not None and st.started:
            st.task.cancel()

    def _refuse(self, ev: h2.events.RequestReceived) -> None:
        """A stream opened after our GOAWAY (a drain's, idle_timeout's): not processed, reset REFUSED_STREAM
        (RFC 9113 8.7)."""
        rec = RequestLog("h2", self.conn_id, time.monotonic(), reason="after_goaway")
        rec.set_method(next((v for n, v in ev.headers if n == b":method"), b""))
        rec.emit()
        self.gw.metrics.refusals.labels("after_goaway").inc()
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.h2.reset_stream(ev.stream_id, error_code=h2.errors.ErrorCodes.REFUSED_STREAM)

    def _ack(self, length: int, stream_id: int) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.h2.acknowledge_received_data(length, stream_id)

    # -- one stream --------------------------------------------------------------------------------

    async def _serve(self, st: _Stream) -> None:
        st.started = True
        try:
            if st.error or st.reset_code is not None:  # reset before its task began: nothing to do but its line
                st.rec.reason = st.error or "client_reset"
            else:
                await self._stream(st)
        except (asyncio.CancelledError, _ClientGone, h2.exceptions.StreamClosedError):
            # the client left or reset the stream
            st.rec.reason = (st.error or self._conn_error
                             or ("client_reset" if st.reset_code is not None else "client_gone"))
        except Exception:
            log.exception("internal error", extra={"event": "internal", "conn_id": self.conn_id})
            st.rec.reason = "internal_error"
            self._reset(st, h2.errors.ErrorCodes.INTERNAL_ERROR)
            with contextlib.suppress(_ClientGone):
                await self._flush()
        finally:
            if st.error:
                st.rec.reason = st.error
            st.rec.emit()
            st.done = True
            while not st.body.empty():  # what the client sent and nobody read: give its window back
                item = st.body.get_nowait()
                if isinstance(item, tuple):
                    self._ack(item[1], st.id)
            self.streams.pop(st.id, None)
            if not self._active():
                self._arm_idle()
            self._close_if_drained()

    def _reset(self, st: _Stream, code: h2.errors.ErrorCodes | int) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.h2.reset_stream(st.id, error_code=code)

    async def _stream(self, st: _Stream) -> None:
        pseudo = {n: v for n, v in st.headers if n.startswith(b":")}
        method = pseudo.get(b":method", b"")
        path = pseudo.get(b":path")
        st.rec.set_method(method)
        if st.refused is not None:  # malformed (RFC 9113 8.1.1): nothing of it goes upstream
            await self.answer(st, 400, f"malformed request ({st.refused.reason})", reason=st.refused.reason)
            if self._remote_open(st):  # a stream error: the 400 first (8.1.1 allows it), then the reset
                self._reset(st, h2.errors.ErrorCodes.PROTOCOL_ERROR)
                await self._flush()
            return
        if self.bad_sni:
            await self.answer(st, 421, "this connection's server name is not served here", reason="misdirected")
            return
        if method == b"CONNECT" or path is None:
            await self.answer(st, 501, "CONNECT is not served over HTTP/2 here", reason="connect_unsupported")
            return
        hosts = [v for n, v in st.headers if n == b"host"]
        headers = _regular_headers(st.headers)
        d = await admit(self.gw, self.conn_name, self.peer[0], method=method, target=path, hosts=hosts,
                        headers=headers, authority=pseudo.get(b":authority"), http2=True,
                        cert_names=self.cert_names, rec=st.rec)
        if isinstance(d, Refusal):
            await self.answer(st, d.status, d.message, d.headers, reason=d.reason)
            return
        if d.fwd.protocol == "h2c":
            await self._proxy_h2c(st, method, d)
        else:
            if st.length == 0 and not st.ended:
                await self._await_end(st)
            await self._proxy(st, method, d)

    async def _await_end(self, st: _Stream) -> None:
        """A head with ``content-length: 0`` that did not end its stream: as HTTP/1.1 the head alone is a whole
        request, so it goes upstream only once the stream has ended well formed (END_STREAM, on an empty DATA
        or trailers, whose fields have nowhere to go after a Content-Length body); DATA meanwhile is a stream
        error (``_data``). Then it goes as a request whose stream ended with its head."""
        while True:
            item = await st.body.get()
            if isinstance(item, tuple):  # an empty DATA frame
                self._ack(item[1], st.id)
                await self._flush()
                continue
            if item is _END:
                break
        st.ended = True

    async def _upstream_broke(self, st: _Stream, responded: bool) -> None:
        """The app's side failed: a stream already answered is reset, one not yet answered gets a 502."""
        if responded:
            st.rec.reason = "upstream_broken"
            self._reset(st, h2.errors.ErrorCodes.INTERNAL_ERROR)
            await self._flush()
        else:
            await self.answer(st, 502, "the sandbox's app broke the connection", reason="upstream_broken")

    async def answer(self, st: _Stream, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None,
                     *, reason: str = "") -> None:
        body = (message + "\n").encode()
        hdrs = [(b":status", str(status).encode()), (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()), *(headers or [])]
        self.gw.metrics.requests.labels("http2", str(status)).inc()
        if reason:
            self.gw.metrics.refusals.labels(reason).inc()
        st.rec.status, st.rec.reason = status, reason
        self.h2.send_headers(st.id, hdrs)
        await self._flush()
        await self._send_data(st, body, end=True)

    async def _send_data(self, st: _Stream, data: bytes, *, end: bool = False) -> None:
        """Send ``data`` on the stream within the client's windows, waiting for WINDOW_UPDATE as needed."""
        view = memoryview(data)
        while view:
            n = min(self.h2.local_flow_control_window(st.id), self.h2.max_outbound_frame_size, len(view))
            if n <= 0:
                st.window.clear()
                await st.window.wait()
                continue
            self.h2.send_data(st.id, view[:n].tobytes(), end_stream=end and n == len(view))
            st.rec.bytes_down += n
            view = view[n:]
            await self._flush()
        if end and not data:
            self.h2.end_stream(st.id)
            await self._flush()

    # -- proxying ----------------------------------------------------------------------------------

    def _upstream_head(self, st: _Stream, method: bytes, d: Admitted, conn: h1.H1Client) -> bytes:
        headers: list[tuple[bytes, bytes]] = [(b"host", d.host.encode())]
        has_length = False
        for n, v in d.allow.headers:
            low = n.lower()
            if low == b"host" or low in HOP_BY_HOP or low == b"transfer-encoding":
                continue
            if low == b"content-length":
                has_length = True
            headers.append((n, v))
        if not st.ended and not has_length:
            headers.append((b"transfer-encoding", b"chunked"))
            st.chunked = True
        return conn.send_request(method, d.allow.target, headers)

    async def _proxy(self, st: _Stream, method: bytes, d: Admitted) -> None:
        fwd = d.fwd
        # The sandbox's slot first: a stream for a full sandbox costs no connection to its forwarder.
        if not self.gw.take_sandbox_slot(fwd.sandbox):
            await self.answer(st, 503, "too many connections to this sandbox", [(b"retry-after", b"1")],
                              reason="sandbox_connection_limit")
            return
        try:
            key = _link_key(fwd)
            kept = self._take_kept(key)
            # A kept link may fail before any answer (the app closed it just as the request went out): an
            # idempotent request with no body is then sent again on a fresh link (RFC 9112 9.3.1).
            replay = kept is not None and st.ended and replayable(method, d.allow.headers)
            try:
                await self._exchange_on(st, method, d, fwd, key, kept, replay=replay)
            except _KeptLinkFailed:
                self.gw.metrics.upstream_retries.labels("kept_link_closed").inc()
                await self._exchange_on(st, method, d, fwd, key, None, replay=False)
        finally:
            self.gw.release_sandbox_slot(fwd.sandbox)

    async def _exchange_on(self, st: _Stream, method: bytes, d: Admitted, fwd: Forward, key: tuple[object, ...],
                           kept: tuple[TlsStream, h1.H1Client] | None, *, replay: bool) -> None:
        """The exchange on ``kept``, or on a link opened now."""
        if kept is not None:
            stream, conn = kept
            leftover = b""
        else:
            try:
                upstream = await self.gw.open_upstream(fwd, self.peer, self.conn_id)
            except UpstreamFailed as e:
                self.gw.invalidate(fwd.sandbox)
                extra = [(b"retry-after", str(e.retry_after).encode())] if e.retry_after else []
                await self.answer(st, e.http_status, e.detail, extra, reason=e.reason)
                return
            stream, conn, leftover = upstream.stream, h1.H1Client(), upstream.leftover
        whole = False
        try:
            await self._exchange(st, method, d, stream, leftover, conn, replay=replay)
            # Complete both ways (the request sent whole, the response read whole): keep the link for the
            # next stream if the app keeps it alive, else end it in order.
            whole = conn.request_done and conn.response_done
        finally:
            if not whole:
                stream.abort()
            elif not self._keep(key, stream, conn):
                await close_cleanly(stream)

    def _take_kept(self, key: tuple[object, ...]) -> tuple[TlsStream, h1.H1Client] | None:
        """A kept link for ``key`` that is still fit (the app may have closed it while it was idle, on its
        own keep-alive clock), or None; unfit ones are dropped on the way."""
        links = self._kept.get(key)
        while links:
            stream, conn = links.pop()
            if stream.usable_idle():
                return stream, conn
            drop_link(stream, self._close_later)
        return None

    def _keep(self, key: tuple[object, ...], stream: TlsStream, conn: h1.H1Client) -> bool:
        """Keep a link after a whole exchange, for the next stream to the same sandbox port: not when the
        app said close, the session is ending or draining, or enough are kept already."""
        if not (conn.request_done and conn.response_done) or conn.must_close:
            return False
        if self._ended.is_set() or self._drain_wanted or self._closing:
            return False
        links = self._kept.setdefault(key, [])
        if len(links) >= KEPT_LINKS_PER_PORT:
            return False
        conn.start_next_cycle()
        links.append((stream, conn))
        return True

    def _close_later(self, stream: TlsStream) -> None:
        task = asyncio.create_task(close_cleanly(stream))
        self._link_closes.add(task)
        task.add_done_callback(self._link_closes.discard)

    async def _close_kept(self) -> None:
        """With the client connection: kept links end in order (aborted on a drain's cut), and the ends
        already under way are waited for."""
        kept, self._kept = self._kept, {}
        links = [stream for v in kept.values() for stream, _ in v]
        if self._cut:
            for stream in links:
                stream.abort()
            for task in list(self._link_closes):
                task.cancel()  # close_cleanly closes its stream however it ends
            return
        closes = [*(close_cleanly(stream) for stream in links), *self._link_closes]
        await asyncio.gather(*closes, return_exceptions=True)

    async def _exchange(self, st: _Stream, method: bytes, d: Admitted, stream: TlsStream, leftover: bytes,
                        conn: h1.H1Client, *, replay: bool = False) -> None:
        if leftover:
            conn.receive_data(leftover)
        started = time.monotonic()
        head = self._upstream_head(st, method, d, conn)
        body_task: asyncio.Task[None] | None = None
        responded = False
        try:
            # The link may break under the head's write as under any read of it: one rule for both, below.
            await stream.write(head)
            if st.ended:
                # No body: no byte to send, but the request is whole (the response may be read whole before
                # the body task first runs), or the link would count as cut and be aborted.
                conn.send_eom()
            body_task = asyncio.create_task(self._pump_request_body(st, conn, stream))
            while True:
                ev = conn.next_event()
                if ev is h1.NEED_DATA:
                    if body_task.done() and body_task.exception() is not None:
                        raise body_task.exception()  # type: ignore[misc]
                    conn.receive_data(await stream.read())
                    continue
                if isinstance(ev, h1.InformationalResponse):
                    if ev.status_code == 101:
                        raise h1.H1Error("bad_response", "101 over HTTP/2", http_status=502)
                    continue  # 100 Continue and friends: the HTTP/2 client is not waiting for them
                if isinstance(ev, h1.Response):
                    status = ev.status_code
                    self.h2.send_headers(st.id, [(b":status", str(status).encode()), *_response_headers(ev.headers)])
                    responded = True
                    st.rec.status = status
                    await self._flush()
                    self.gw.metrics.first_byte.observe(time.monotonic() - started)
                    self.gw.metrics.requests.labels("http2", str(status)).inc()
                elif isinstance(ev, h1.Data):
                    await self._send_data(st, bytes(ev.data))
                elif isinstance(ev, h1.EndOfMessage):
                    await self._send_data(st, b"", end=True)
                    break
                elif isinstance(ev, h1.ConnectionClosed):
                    raise ConnectionResetError("the sandbox closed before its response ended")
        except (OSError, RemoteProtocolError, LocalProtocolError) as e:
            log.debug("stream %d upstream failed: %r", st.id, e)
            if replay and not responded:
                raise _KeptLinkFailed() from e
            await self._upstream_broke(st, responded)
            return
        finally:
            if body_task is not None:
                await _stopped(body_task)
        if not st.done and self._remote_open(st):
            # The response is whole but the client is still sending: it need not (RFC 9113 8.1).
            self._reset(st, h2.errors.ErrorCodes.NO_ERROR)
            await self._flush()

    def _remote_open(self, st: _Stream) -> bool:
        s = self.h2.streams.get(st.id)
        return s is not None and not s.closed  # our side has ended: open means the client's is

    async def _pump_request_body(self, st: _Stream, conn: h1.H1Client, stream: TlsStream) -> None:
        if st.ended:
            return
        while conn.sending_body:
            item = await st.body.get()
            if isinstance(item, tuple):
                data, length = item
                if data:
                    await stream.write(conn.send_data(data))
                    st.rec.bytes_up += len(data)
                self._ack(length, st.id)
                await self._flush()
            elif isinstance(item, list):
                trailers = _regular_headers(item) if st.chunked else []  # none fit after a Content-Length body
                await stream.write(conn.send_eom(trailers))
                return
            else:
                await stream.write(conn.send_eom())
                return

    # -- h2c: HTTP/2 to the app ---------------------------------------------------------------------

    async def _h2c_conn(self, fwd: Forward) -> h2c.H2cConnection:
        """The connection this stream's sandbox port is spoken to on: opened by the first stream that
        needs it (a slot of the sandbox's connection limit, then the link with its retries), shared by
        the later ones while it is usable. Streams arriving while it opens wait for the same attempt."""
        key = _link_key(fwd)
        link = self._h2c.get(key)
        if link is not None and link.conn is not None and not link.conn.usable:
            self._drop_h2c(link)  # a GOAWAY came: its reader is about to close it
            link = None
        if link is None:
            self._h2c_all = [x for x in self._h2c_all if not (x.conn is not None and x.conn.closed)]
            link = _H2cLink(fwd.sandbox)
            link.opening = asyncio.create_task(self._open_h2c(fwd, link))
            self._h2c[key] = link
            self._h2c_all.append(link)

            def opened(task: asyncio.Task[h2c.H2cConnection], link: _H2cLink = link) -> None:
                if task.cancelled() or task.exception() is not None or (link.conn and link.conn.dead):
                    self._drop_h2c(link)

            link.opening.add_done_callback(opened)
        assert link.opening is not None
        return await asyncio.shield(link.opening)

    async def _open_h2c(self, fwd: Forward, link: _H2cLink) -> h2c.H2cConnection:
        if not self.gw.take_sandbox_slot(fwd.sandbox):
            link.sandbox = ""  # no slot to give back
            raise _SandboxFull()
        try:
            up = await self.gw.open_upstream(fwd, self.peer, self.conn_id)
        except BaseException:
            self.gw.release_sandbox_slot(fwd.sandbox)
            link.sandbox = ""
            raise
        def dead(_c: h2c.H2cConnection) -> None:
            link.gone.set()
            self._drop_h2c(link)

        conn = h2c.H2cConnection(up.stream, up.leftover, on_dead=dead)
        link.conn = conn
        try:
            await conn.start()
        except h2c.H2cUnusable:
            pass  # it is dead already: its streams will be told
        return conn

    def _drop_h2c(self, link: _H2cLink) -> None:
        """The link is gone (or never came): no new stream goes to it; its sandbox slot is given back."""
        for k, v in list(self._h2c.items()):
            if v is link:
                del self._h2c[k]
        if link.sandbox and link.opening is not None and link.opening.done():
            self.gw.release_sandbox_slot(link.sandbox)
            link.sandbox = ""  # released once

    async def _close_h2c(self) -> None:
        links, self._h2c_all = self._h2c_all, []
        self._h2c.clear()
        for link in links:
            if link.opening is not None:
                await _stopped(link.opening)
            if link.conn is not None:
                await self._end_h2c(link, link.conn)
            self._drop_h2c(link)

    async def _end_h2c(self, link: _H2cLink, conn: h2c.H2cConnection) -> None:
        """End an h2c connection with the client connection: what is pending (the resets of streams given
        up) and GOAWAY, then close_notify and FIN, and the app's own end (its reader sees it), within the
        linger; then it is closed (``close`` aborts a link the app has not ended by then)."""
        if conn.dead is None and not self._cut:
            try:
                async with asyncio.timeout(CLOSE_LINGER):
                    with contextlib.suppress(h2.exceptions.ProtocolError):
                        conn.h2.close_connection()
                    await conn.flush()
                    await conn.link.write_eof()
                    await link.gone.wait()
            except (h2c.H2cUnusable, OSError, ssl.SSLError, TimeoutError):
                pass
        await conn.close(grace=0)

    async def _proxy_h2c(self, st: _Stream, method: bytes, d: Admitted) -> None:
        fwd = d.fwd
        headers = _h2c_request_headers(method, d.allow.target, d.host, d.allow.headers)
        up: h2c.H2cStream | None = None
        for _ in range(2):  # a connection found dead before this stream's head went out: once more, fresh
            try:
                conn = await self._h2c_conn(fwd)
            except UpstreamFailed as e:
                self.gw.invalidate(fwd.sandbox)
                extra = [(b"retry-after", str(e.retry_after).encode())] if e.retry_after else []
                await self.answer(st, e.http_status, e.detail, extra, reason=e.reason)
                return
            except _SandboxFull:
                await self.answer(st, 503, "too many connections to this sandbox", [(b"retry-after", b"1")],
                                  reason="sandbox_connection_limit")
                return
            if not conn.usable:
                continue
            try:
                up = await conn.open_stream(headers, end_stream=st.ended)
            except h2c.H2cUnusable:
                break
            break
        if up is None:
            await self._upstream_broke(st, responded=False)
            return
        try:
            await self._exchange_h2c(st, up)
        finally:
            # Still open toward the app (the client reset it, or left): pass the reset on, the client's code
            # if it gave one. A stream already closed both ways is left alone.
            up.reset(st.reset_code if st.reset_code is not None else h2.errors.ErrorCodes.CANCEL)
            up.close()

    async def _exchange_h2c(self, st: _Stream, up: h2c.H2cStream) -> None:
        started = time.monotonic()
        pump = asyncio.create_task(self._pump_h2c_body(st, up))
        responded = False
        try:
            while True:
                ev = await up.next()
                if isinstance(ev, h2c.Head):
                    status = _status(ev.headers)
                    if ev.informational:
                        if status != b"101":  # 101 has no meaning in HTTP/2; h2 lets any 1xx through
                            self.h2.send_headers(st.id, _h2_response_headers(ev.headers))
                            await self._flush()
                        continue
                    self.h2.send_headers(st.id, _h2_response_headers(ev.headers), end_stream=ev.ended)
                    responded = True
                    st.rec.status = int(status) if status.isdigit() else 0
                    await self._flush()
                    self.gw.metrics.first_byte.observe(time.monotonic() - started)
                    self.gw.metrics.requests.labels("http2", status.decode("ascii", "replace")).inc()
                    if ev.ended:
                        break
                elif isinstance(ev, h2c.Data):
                    await self._send_data(st, ev.data)
                    await up.ack(ev.flow)  # passed on: the app may send that much more
                elif isinstance(ev, h2c.Trailers):
                    trailers = _h2_response_headers(ev.headers)
                    if trailers:
                        self.h2.send_headers(st.id, trailers, end_stream=True)
                        await self._flush()
                    else:
                        await self._send_data(st, b"", end=True)
                    break
                elif isinstance(ev, h2c.End):
                    await self._send_data(st, b"", end=True)
                    break
                elif isinstance(ev, h2c.Reset):
                    log.debug("stream %d reset by the app (%d)", st.id, ev.code)
                    st.rec.reason = "upstream_reset"
                    self._reset(st, _error_code(ev.code))
                    await self._flush()
                    return
                else:  # Broken
                    log.debug("stream %d: h2c link ended (%s)", st.id, ev.reason)
                    if ev.refused:
                        # The app's GOAWAY says it never saw the stream: the client may safely retry it.
                        st.rec.reason = "upstream_refused_stream"
                        self._reset(st, h2.errors.ErrorCodes.REFUSED_STREAM)
                        await self._flush()
                    else:
                        await self._upstream_broke(st, responded)
                    return
        finally:
            await _stopped(pump)
        if not st.done and self._remote_open(st):
            # The response is whole but the client is still sending: it need not (RFC 9113 8.1); nor the app.
            self._reset(st, h2.errors.ErrorCodes.NO_ERROR)
            await self._flush()
            up.reset(h2.errors.ErrorCodes.NO_ERROR)

    async def _pump_h2c_body(self, st: _Stream, up: h2c.H2cStream) -> None:
        """The client's DATA to the app, each piece acknowledged to the client only once the app's window
        took it: the app's window is the client's backpressure."""
        if st.ended:
            return
        while True:
            item = await st.body.get()
            if isinstance(item, tuple):
                data, length = item
                try:
                    if data:
                        await up.send_data(data)
                        st.rec.bytes_up += len(data)
                finally:
                    self._ack(length, st.id)
                await self._flush()
            elif isinstance(item, list):
                trailers = _h2_trailers(item)
                if trailers:
                    await up.send_trailers(trailers)
                else:
                    await up.end()
                return
            else:
                await up.end()
                return

def _regular_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers without pseudo-headers, cookies joined into one (RFC 9113 8.2.3)."""
    out: list[tuple[bytes, bytes]] = []
    cookies: list[bytes] = []
    for n, v in headers:
        if n.startswith(b":"):
            continue
        if n == b"cookie":
            cookies.append(v)
            continue
        out.append((n, v))
    if cookies:
        out.append((b"cookie", b"; ".join(cookies)))
    return out


def _response_headers(headers: Any) -> list[tuple[bytes, bytes]]:
    tokens = {t.strip().lower() for n, v in headers if n == b"connection" for t in v.split(b",")}
    return [(n, v) for n, v in headers if n not in _RESPONSE_DROP and n not in tokens]


# Connection-specific headers (RFC 9113 8.2.2) and what the gateway keeps for itself: never sent on to the app
# over h2c. ``te`` is handled on its own: only ``trailers`` passes (gRPC sends it, and servers may insist).
_H2C_REQUEST_DROP = HOP_BY_HOP | {b"transfer-encoding", b"host"}


def _h2c_request_headers(method: bytes, path: bytes, authority: str,
                         headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request head for an h2c app: ``:scheme`` stays ``https`` (the URI the client asked for;
    X-Forwarded-Proto says so too), ``:authority`` is the routed name (as Host is over HTTP/1.1), then
    ``headers`` as ``auth.authorize`` left them (token gone, X-Forwarded-* set) without Host and
    connection-specific headers."""
    out = [(b":method", method), (b":scheme", b"https"), (b":authority", authority.encode("ascii")),
           (b":path", path)]
    for n, v in headers:
        low = n.lower()
        if low == b"te":
            if v.strip().lower() == b"trailers":
                out.append((b"te", b"trailers"))
            continue
        if low in _H2C_REQUEST_DROP or low.startswith(b":"):
            continue
        out.append((low, v))
    return out


def _h2_trailers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Request trailers for the app: no pseudo-headers, nothing connection-specific."""
    return [(n, v) for n, v in headers if not n.startswith(b":") and n not in _H2C_REQUEST_DROP and n != b"te"]


def _h2_response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An h2c app's head or trailers for the client: as they came (h2 has checked them), minus
    connection-specific headers."""
    return [(n, v) for n, v in headers if n not in _RESPONSE_DROP]


def _status(headers: list[tuple[bytes, bytes]]) -> bytes:
    return next((v for n, v in headers if n == b":status"), b"")


def _error_code(code: int) -> h2.errors.ErrorCodes | int:
    try:
        return h2.errors.ErrorCodes(code)
    except ValueError:
        return code  # an unknown code passes as it came (RFC 9113 7: unknown codes are not errors)


async def _stopped(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs and wait for it; how it ended is its own business."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
