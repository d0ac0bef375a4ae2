"""One HTTP/2 client connection (ALPN ``h2``): every stream is a request, routed and proxied on its own.

The h2 library keeps the connection's state (frames, HPACK, both flow-control windows); this module moves
its bytes and turns each stream into one HTTP/1.1 exchange with the sandbox's app (h11 client side, one link
to the forwarder per stream, opened only once the stream is admitted and closed when it ends).

Per stream, exactly as the HTTP/1.1 front decides a request (``http1.admit``): ``routing.request_target``
with ``:authority`` and any Host (400; 421 for a stream whose authority names another sandbox or port than
the connection's server name: browsers coalesce connections for every name a wildcard certificate covers,
RFC 9113 9.1.1, and such a stream must never reach the connection's first sandbox), the route (404), a wake
(503 with Retry-After), ``auth.authorize`` (401/403/redirect), then the link (502/503/504). The request goes
upstream as ``:method :path HTTP/1.1`` with ``Host`` from the name, HTTP/2-only and hop-by-hop headers
dropped, cookies joined, a body without Content-Length chunked. The response comes back as HEADERS and
DATA; connection-specific response headers are dropped.

Bodies stream both ways, never buffered whole: received DATA is acknowledged (``acknowledge_received_data``)
only once written upstream, so the client's window is the backpressure; response DATA is sent no faster
than the client's stream and connection windows allow (a stream waits for WINDOW_UPDATE). A stream that
fails is reset (or answered 502 before its response began); the other streams go on. Not served: h2c to the
app (a port whose protocol is ``h2c`` is spoken to in HTTP/1.1 like any other), extended CONNECT
(WebSockets over HTTP/2: the SETTINGS_ENABLE_CONNECT_PROTOCOL setting is not sent, so clients use
HTTP/1.1 for them), server push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h11

from gateway.http1 import HOP_BY_HOP, Admitted, Refusal, admit
from gateway.names import Name
from gateway.upstream import UpstreamFailed
from sbxnet.tls_stream import TlsStream

log = logging.getLogger("sbxnet.gateway")

MAX_CONCURRENT_STREAMS = 100
STREAM_WINDOW = 1 << 20  # what a client may send on one stream before we acknowledge it
CONNECTION_WINDOW = 4 << 20
# Headers that mean something for one HTTP/1.1 connection only, never sent as HTTP/2 (RFC 9113 8.2.2).
_RESPONSE_DROP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"te",
                  b"trailer"}


class _ClientGone(Exception):
    pass


_END = object()


@dataclass
class _Stream:
    id: int
    headers: list[tuple[bytes, bytes]]
    ended: bool  # END_STREAM came with the request's HEADERS
    body: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)  # (data, flow length), trailers, _END
    window: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    done: bool = False  # the handler finished: later DATA is acknowledged and dropped
    chunked: bool = False  # the request goes upstream chunked (it had no Content-Length)


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
        config = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                           validate_inbound_headers=True, validate_outbound_headers=True)
        self.h2 = h2.connection.H2Connection(config=config)
        self.streams: dict[int, _Stream] = {}
        self._write_lock = asyncio.Lock()
        self._gone = False

    # -- the connection ----------------------------------------------------------------------------

    async def _flush(self) -> None:
        data = self.h2.data_to_send()
        if not data:
            return
        async with self._write_lock:  # FIFO: frames leave in the order h2 produced them
            if self._gone:
                raise _ClientGone()
            try:
                await self.client.write(data)
            except OSError:
                self._gone = True
                raise _ClientGone() from None

    async def run(self) -> None:
        cfg = self.gw.config
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: cfg.max_header_bytes,
        })
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        try:
            await self._flush()
            first = True
            while True:
                timeout = cfg.header_timeout if first else (None if self._active() else cfg.idle_timeout)
                try:
                    data = await asyncio.wait_for(self.client.read(), timeout)
                except TimeoutError:
                    self.gw.metrics.refusals.labels("header_timeout" if first else "idle_timeout").inc()
                    self.h2.close_connection()
                    await self._flush()
                    return
                except OSError:
                    return
                first = False
                if not data:
                    return
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError as e:
                    self.gw.metrics.refusals.labels("bad_request").inc()
                    code = getattr(e, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
                    with contextlib.suppress(h2.exceptions.ProtocolError):
                        self.h2.close_connection(error_code=code)
                    await self._flush()
                    return
                ended = False
                for ev in events:
                    ended = self._event(ev) or ended
                await self._flush()
                if ended:
                    await self._wait_streams()
                    return
        except _ClientGone:
            return
        finally:
            for st in list(self.streams.values()):
                if st.task is not None:
                    st.task.cancel()
            tasks = [st.task for st in self.streams.values() if st.task is not None]
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

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
            new = _Stream(ev.stream_id, list(ev.headers), ev.stream_ended is not None)
            self.streams[ev.stream_id] = new
            new.task = asyncio.create_task(self._serve(new))
        elif isinstance(ev, h2.events.DataReceived):
            st = self.streams.get(ev.stream_id)
            if st is None or st.done:
                self._ack(ev.flow_controlled_length, ev.stream_id)
            else:
                st.body.put_nowait((ev.data, ev.flow_controlled_length))
        elif isinstance(ev, h2.events.TrailersReceived):
            st = self.streams.get(ev.stream_id)
            if st is not None and not st.done:
                st.body.put_nowait(list(ev.headers))
        elif isinstance(ev, h2.events.StreamEnded):
            st = self.streams.get(ev.stream_id)
            if st is not None and not st.done:
                st.body.put_nowait(_END)
        elif isinstance(ev, h2.events.StreamReset):
            st = self.streams.get(ev.stream_id)
            if st is not None and st.task is not None and not st.done:
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

    def _ack(self, length: int, stream_id: int) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.h2.acknowledge_received_data(length, stream_id)

    # -- one stream --------------------------------------------------------------------------------

    async def _serve(self, st: _Stream) -> None:
        try:
            await self._stream(st)
        except (asyncio.CancelledError, _ClientGone, h2.exceptions.StreamClosedError):
            pass  # the client left or reset the stream
        except Exception:
            log.exception("internal error", extra={"event": "internal", "conn_id": self.conn_id})
            self._reset(st, h2.errors.ErrorCodes.INTERNAL_ERROR)
            with contextlib.suppress(_ClientGone):
                await self._flush()
        finally:
            st.done = True
            while not st.body.empty():  # what the client sent and nobody read: give its window back
                item = st.body.get_nowait()
                if isinstance(item, tuple):
                    self._ack(item[1], st.id)
            self.streams.pop(st.id, None)

    def _reset(self, st: _Stream, code: h2.errors.ErrorCodes) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.h2.reset_stream(st.id, error_code=code)

    async def _stream(self, st: _Stream) -> None:
        pseudo = {n: v for n, v in st.headers if n.startswith(b":")}
        method = pseudo.get(b":method", b"")
        path = pseudo.get(b":path")
        if self.bad_sni:
            await self.answer(st, 421, "this connection's server name is not served here", reason="misdirected")
            return
        if method == b"CONNECT" or path is None:
            await self.answer(st, 501, "CONNECT is not served over HTTP/2 here", reason="connect_unsupported")
            return
        hosts = [v for n, v in st.headers if n == b"host"]
        headers = _regular_headers(st.headers)
        d = await admit(self.gw, self.conn_name, self.peer[0], target=path, hosts=hosts, headers=headers,
                        authority=pseudo.get(b":authority"), http2=True)
        if isinstance(d, Refusal):
            await self.answer(st, d.status, d.message, d.headers, reason=d.reason)
            return
        await self._proxy(st, method, d)

    async def answer(self, st: _Stream, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None,
                     *, reason: str = "") -> None:
        body = (message + "\n").encode()
        hdrs = [(b":status", str(status).encode()), (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()), *(headers or [])]
        self.gw.metrics.requests.labels("http2", str(status)).inc()
        if reason:
            self.gw.metrics.refusals.labels(reason).inc()
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
            view = view[n:]
            await self._flush()
        if end and not data:
            self.h2.end_stream(st.id)
            await self._flush()

    # -- proxying ----------------------------------------------------------------------------------

    def _upstream_head(self, st: _Stream, method: bytes, d: Admitted) -> h11.Request:
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
        return h11.Request(method=method, target=d.allow.target, headers=headers, http_version=b"1.1")

    async def _proxy(self, st: _Stream, method: bytes, d: Admitted) -> None:
        fwd = d.fwd
        try:
            upstream = await self.gw.open_upstream(fwd, self.peer, self.conn_id)
        except UpstreamFailed as e:
            self.gw.invalidate(fwd.sandbox)
            extra = [(b"retry-after", str(e.retry_after).encode())] if e.retry_after else []
            await self.answer(st, e.http_status, e.detail, extra, reason=e.reason)
            return
        try:
            if not self.gw.take_sandbox_slot(fwd.sandbox):
                await self.answer(st, 503, "too many connections to this sandbox", [(b"retry-after", b"1")],
                                  reason="sandbox_connection_limit")
                return
            try:
                await self._exchange(st, method, d, upstream.stream, upstream.leftover)
            finally:
                self.gw.release_sandbox_slot(fwd.sandbox)
        finally:
            upstream.stream.abort()

    async def _exchange(self, st: _Stream, method: bytes, d: Admitted, stream: TlsStream, leftover: bytes) -> None:
        conn = h11.Connection(h11.CLIENT)
        if leftover:
            conn.receive_data(leftover)
        started = time.monotonic()
        await stream.write(conn.send(self._upstream_head(st, method, d)))
        body_task = asyncio.create_task(self._pump_request_body(st, conn, stream))
        responded = False
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    if body_task.done() and body_task.exception() is not None:
                        raise body_task.exception()  # type: ignore[misc]
                    conn.receive_data(await stream.read())
                    continue
                if isinstance(ev, h11.InformationalResponse):
                    if ev.status_code == 101:
                        raise h11.RemoteProtocolError("101 over HTTP/2")
                    continue  # 100 Continue and friends: the HTTP/2 client is not waiting for them
                if isinstance(ev, h11.Response):
                    status = ev.status_code
                    self.h2.send_headers(st.id, [(b":status", str(status).encode()), *_response_headers(ev.headers)])
                    responded = True
                    await self._flush()
                    self.gw.metrics.first_byte.observe(time.monotonic() - started)
                    self.gw.metrics.requests.labels("http2", str(status)).inc()
                elif isinstance(ev, h11.Data):
                    await self._send_data(st, bytes(ev.data))
                elif isinstance(ev, h11.EndOfMessage):
                    await self._send_data(st, b"", end=True)
                    break
                elif isinstance(ev, h11.ConnectionClosed):
                    raise ConnectionResetError("the sandbox closed before its response ended")
        except (OSError, h11.ProtocolError) as e:
            log.debug("stream %d upstream failed: %r", st.id, e)
            if responded:
                self._reset(st, h2.errors.ErrorCodes.INTERNAL_ERROR)
                await self._flush()
            else:
                await self.answer(st, 502, "the sandbox's app broke the connection", reason="upstream_broken")
            return
        finally:
            if not body_task.done():
                body_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await body_task
        if not st.done and self._remote_open(st):
            # The response is whole but the client is still sending: it need not (RFC 9113 8.1).
            self._reset(st, h2.errors.ErrorCodes.NO_ERROR)
            await self._flush()

    def _remote_open(self, st: _Stream) -> bool:
        s = self.h2.streams.get(st.id)
        return s is not None and not s.closed  # our side has ended: open means the client's is

    async def _pump_request_body(self, st: _Stream, conn: h11.Connection, stream: TlsStream) -> None:
        if st.ended:
            return
        while conn.our_state is h11.SEND_BODY:
            item = await st.body.get()
            if isinstance(item, tuple):
                data, length = item
                if data:
                    await stream.write(conn.send(h11.Data(data=data)))
                self._ack(length, st.id)
                await self._flush()
            elif isinstance(item, list):
                trailers = _regular_headers(item) if st.chunked else []  # none fit after a Content-Length body
                await stream.write(conn.send(h11.EndOfMessage(headers=trailers)))
                return
            else:
                await stream.write(conn.send(h11.EndOfMessage()))
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
