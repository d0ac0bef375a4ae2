"""HTTP/1.1 for the gateway's two sides, without I/O: bytes in, events out; heads and bodies serialised.

httptools (llhttp, in C) parses; this module holds what a proxy adds around a parser, the part h11 did
before: one message at a time (pipelined requests are parsed ahead and queued, not acted on), the
framing each side writes, when a side must close, and the refusals. ``H1Server`` is the client
connection's side (requests in, responses out), ``H1Client`` a link's side (requests out, responses in).
Events are h11's shapes (``Request``, ``InformationalResponse``, ``Response``, ``Data``,
``EndOfMessage`` with trailers, ``ConnectionClosed``; ``NEED_DATA`` when the bytes so far end mid-event),
header names lowercased, values as received.

Refused (``H1Error``, a ``RemoteProtocolError`` with the HTTP status to answer and a reason token):
whatever llhttp refuses in its strict mode (bare LF, obs-fold, control bytes or NUL in a name or value,
a space before the colon, a Content-Length that is not one number, Content-Length with
Transfer-Encoding, bad chunk framing), and what h11 refused on top of it: a Transfer-Encoding other than
exactly ``chunked``, an HTTP/1.1 request without one Host, a version other than 1.0 and 1.1, a head over
the limit (431; a response's: 502), a message cut by the end of the stream, a ``Connection`` option that
names a framing or routing header (Content-Length, Transfer-Encoding, Host: hop-by-hop removal would
unframe the message; ``connection_names_framing``), a trailer field that frames, routes or is hop-by-hop
(``NOT_IN_TRAILERS``; ``bad_trailer``). A request llhttp
refuses gets the token ``smuggling_reason`` reads in llhttp's message (``obs_fold``,
``content_length_with_transfer_encoding``, ``duplicate_content_length``) or ``bad_request``. An
upgrade request (``Connection: upgrade`` with ``Upgrade``) may not carry a body (h11 read one first;
llhttp would pass it as the new protocol's bytes). A sandbox's response goes through the same checks
(``bad_response``; the gateway answers 502), and bytes after a whole response, before the next request
asked for one, make the link unfit (``H1Client.unfit``: such bytes would be taken for the next answer).

Framing written, as h11 wrote it: a response keeps its Content-Length; one of unknown length (chunked,
or ended by close) is chunked to an HTTP/1.1 client and sent bare, then closed, to an HTTP/1.0 one;
``Connection: close`` is added when the request asked for it, came as HTTP/1.0, or the response says
it. HEAD, 1xx, 204 and 304 answers have no body. Trailers go out only in a chunked body.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import httptools

from sbxnet.errors import LocalProtocolError, RemoteProtocolError

DEFAULT_MAX_HEAD = 16384  # h11's max_incomplete_event_size default: the bound for a sandbox's response head

# RFC 9110 7.6.1: meant for one connection, never forwarded (with whatever ``Connection`` names).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"te",
                        b"trailer", b"upgrade"})
# What a ``Connection`` option may not name: removing it as hop-by-hop would change how the message is framed
# (or which host it is for), so such a head is refused rather than forwarded unframed.
FRAMING = frozenset({b"content-length", b"transfer-encoding", b"host"})
# Trailer fields refused (RFC 9110 6.5.1): framing, routing and connection control belong in the head only.
NOT_IN_TRAILERS = FRAMING | HOP_BY_HOP


class H1Error(RemoteProtocolError):
    """The peer's HTTP/1.1 bytes are refused: ``http_status`` is the answer (400, 431; 502 for a
    sandbox's response), ``reason`` the metrics token."""

    def __init__(self, reason: str, detail: str = "", *, http_status: int = 400, method: bytes = b"") -> None:
        super().__init__(reason, detail)
        self.http_status = http_status
        self.method = method  # the refused request's method when its request line parsed, for the log


class _Need:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Any = _Need()


class Request:
    __slots__ = ("headers", "http_version", "keep_alive", "method", "target", "upgrade")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                 http_version: bytes = b"1.1", keep_alive: bool = True, upgrade: bool = False) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.http_version = http_version
        self.keep_alive = keep_alive  # HTTP/1.1 without Connection: close
        self.upgrade = upgrade  # Connection: upgrade with an Upgrade header

    def __repr__(self) -> str:
        return f"Request({self.method!r}, {self.target!r}, {self.headers!r}, {self.http_version!r})"


class Response:
    __slots__ = ("headers", "http_version", "reason", "status_code")

    def __init__(self, status_code: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"",
                 http_version: bytes = b"1.1") -> None:
        self.status_code = status_code
        self.headers = headers
        self.reason = reason
        self.http_version = http_version

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status_code}, {self.headers!r}, {self.reason!r})"


class InformationalResponse(Response):
    """A 1xx head (100 Continue, 101 Switching Protocols, 103 Early Hints)."""


class Data:
    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"Data({self.data!r})"


class EndOfMessage:
    __slots__ = ("headers",)

    def __init__(self, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.headers = headers if headers is not None else []  # trailers (a chunked body's only)

    def __repr__(self) -> str:
        return f"EndOfMessage({self.headers!r})"


class ConnectionClosed:
    """The peer ended the stream between messages."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ConnectionClosed()"


Event = Request | Response | Data | EndOfMessage | ConnectionClosed


# llhttp's refusals that are request smuggling's tricks, named as the gateway counted them with h11 (by the
# parser's own message: llhttp stops at the same byte however the stream is cut, so the name is the same).
_SMUGGLING = (
    ("Unexpected whitespace after header value", "obs_fold"),  # a folded line (RFC 9112 5.2)
    ("Unexpected space after start line", "obs_fold"),  # a folded first header line
    ("can't be present with", "content_length_with_transfer_encoding"),
    ("Duplicate Content-Length", "duplicate_content_length"),
)


def smuggling_reason(detail: str) -> str | None:
    """The smuggler's trick an llhttp refusal names (its message), or None."""
    for text, reason in _SMUGGLING:
        if text in detail:
            return reason
    return None


def _tokens(headers: list[tuple[bytes, bytes]], name: bytes) -> set[bytes]:
    return {t.strip().lower() for n, v in headers if n == name for t in v.split(b",")}


def _te_chunked(headers: list[tuple[bytes, bytes]], error: str, status: int) -> bool:
    """Whether the body is chunked; any other Transfer-Encoding is refused (h11 took only ``chunked``)."""
    te = [v for n, v in headers if n == b"transfer-encoding"]
    if not te:
        return False
    if len(te) != 1 or te[0].strip().lower() != b"chunked":
        raise H1Error(error, "a Transfer-Encoding other than chunked", http_status=status)
    return True


def end_to_end(headers: list[tuple[bytes, bytes]], *, keep_upgrade: bool = False) -> list[tuple[bytes, bytes]]:
    """``headers`` less the hop-by-hop ones (``HOP_BY_HOP`` and every name ``Connection`` lists), in their
    order: what a proxy may pass on. ``keep_upgrade``: an upgrade request's ``Upgrade`` stays (the proxy
    sends ``Connection: upgrade`` again). A proxy adds its own headers after this, so none can be named away."""
    drop = HOP_BY_HOP | _tokens(headers, b"connection")
    return [(n, v) for n, v in headers
            if n.lower() not in drop or (keep_upgrade and n.lower() == b"upgrade")]


def _connection_names_framing(headers: list[tuple[bytes, bytes]]) -> bool:
    return not _tokens(headers, b"connection").isdisjoint(FRAMING)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for n, v in headers:
        if n == b"content-length":
            return int(v)  # llhttp checked it is one number, once
    return None


# -- writing ------------------------------------------------------------------------------------------

def _head_lines(first: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    parts = [first]
    for n, v in headers:
        parts += (n, b": ", v, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    # What we write came from a parser or from our own code; a CR or LF inside a method, target, reason,
    # name or value would split the head (and smuggle a header or a message): one count over the whole
    # head finds any, at a fraction of checking each field.
    lines = len(headers) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise LocalProtocolError("bad_header", "a CR or LF inside a field would break the head")
    return head


def serialise_request_head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """``METHOD target HTTP/1.1`` and the headers, Host first (RFC 9112 3.2), in their order."""
    if b" " in target or b" " in method:
        raise LocalProtocolError("bad_target", "a method or target that would break the request line")
    if headers and headers[0][0] != b"host":
        headers = [h for h in headers if h[0].lower() == b"host"] + [h for h in headers if h[0].lower() != b"host"]
    return _head_lines(b"%s %s HTTP/1.1\r\n" % (method, target), headers)


def serialise_response_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """``HTTP/1.1 status reason`` and the headers in their order (an empty reason as h11 wrote it)."""
    if not 100 <= status <= 999:
        raise LocalProtocolError("bad_status", "a status out of range")
    return _head_lines(b"HTTP/1.1 %d %s\r\n" % (status, reason), headers)


class _Writer:
    """One outgoing body's framing: ``length`` (Content-Length n), ``chunked``, ``close`` (bytes until
    the connection ends) or ``none``."""

    __slots__ = ("kind", "left")

    def __init__(self, kind: str, left: int = 0) -> None:
        self.kind = kind
        self.left = left

    def data(self, data: bytes) -> bytes:
        if not data:
            return b""
        if self.kind == "chunked":
            return b"%x\r\n%s\r\n" % (len(data), data)
        if self.kind == "length":
            if len(data) > self.left:
                raise LocalProtocolError("too_much_data", "more body than its Content-Length")
            self.left -= len(data)
            return data
        if self.kind == "close":
            return data
        raise LocalProtocolError("no_body", "a body for a message that has none")

    def end(self, trailers: list[tuple[bytes, bytes]]) -> bytes:
        if self.kind == "chunked":
            return _head_lines(b"0\r\n", trailers)
        if self.kind == "length" and self.left:
            raise LocalProtocolError("short_body", "the body ended before its Content-Length")
        return b""


def _request_writer(headers: list[tuple[bytes, bytes]]) -> _Writer:
    if _te_chunked(headers, "bad_request_framing", 400):
        return _Writer("chunked")
    n = _content_length(headers)
    return _Writer("length", n) if n else _Writer("none")


# -- reading ------------------------------------------------------------------------------------------

class _HeadOnly(Exception):
    """Raised from a HEAD response's headers-complete callback: its body (by its headers) is not sent."""


class _Reader:
    """httptools fed, its callbacks turned into queued events. A parser error is queued where it came, so
    what was parsed before it is still served first; after it, nothing more is parsed."""

    def __init__(self, max_head: int, error_reason: str, error_status: int) -> None:
        self.max_head = max_head
        self._error_reason = error_reason
        self._error_status = error_status
        self.events: deque[Any] = deque()
        self._headers: list[tuple[bytes, bytes]] = []
        self._url = b""
        self._reason = b""
        self._in_head = False  # a head begun and not yet complete
        self._size = 0
        self._stalled = 0  # bytes fed since the parser last completed anything (a chunk line, a trailer)
        self._head_fed = 0  # bytes fed while a head was open (an over-count by one read at most)
        self._in_body = False
        self._chunked = False
        self._failed = False
        self.paused = False  # after an upgrade (or a HEAD response): bytes are kept, not parsed
        self.trailing = bytearray()
        self.eof = False
        self._parser = self._new_parser()

    def _new_parser(self) -> Any:
        raise NotImplementedError

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._in_head = True
        self._size = 0  # the head's fields' bytes, as received less whitespace around values
        self._headers = []
        self._url = b""
        self._reason = b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._size += len(name) + len(value) + 4
        if self._chunked and self._size > self.max_head:  # trailers: bounded as a head is
            raise H1Error(self._too_large_reason, "the trailers are over the limit", http_status=self._too_large_status)
        self._headers.append((name.lower(), value.rstrip(b" \t")))  # h11 strips trailing OWS; llhttp keeps it

    def on_headers_complete(self) -> None:
        self._stalled = 0
        self._in_head = False
        self._in_body = True
        self._head_fed = 0
        self._headers_done(self._headers)

    def _headers_done(self, headers: list[tuple[bytes, bytes]]) -> None:
        raise NotImplementedError

    def on_body(self, body: bytes) -> None:
        self._stalled = 0
        self.events.append(Data(body))

    def on_chunk_header(self) -> None:
        self._stalled = 0
        self._chunked = True
        self._size = 0
        self._headers = []  # the last chunk's header callbacks are the trailers

    def on_chunk_complete(self) -> None:
        self._stalled = 0

    def on_message_complete(self) -> None:
        self._stalled = 0
        trailers = self._headers if self._chunked else []
        # Judged once the trailers are whole (as a head's fields are at its end), so a malformed line after
        # a refused field is refused first however the bytes are cut.
        if any(n in NOT_IN_TRAILERS for n, _ in trailers):
            raise H1Error(self._trailer_reason, "a trailer field that frames, routes or is hop-by-hop",
                          http_status=self._error_status)
        self._in_body = self._chunked = False
        self._headers = []
        self.events.append(EndOfMessage(trailers))

    def _fail(self, reason: str, detail: str, status: int) -> None:
        self._failed = True
        self.events.append(H1Error(reason, detail, http_status=status))

    def _head_size(self, first_line: int) -> int:
        return first_line + 2 + self._size + 2

    def receive(self, data: bytes) -> None:
        """Bytes from the peer, or b"": its end of stream (h11's ``receive_data``)."""
        if data:
            self.feed(data)
        else:
            self.feed_eof()

    def feed(self, data: bytes) -> None:
        if self._failed:
            return
        if self.paused:
            self.trailing += data
            return
        if self._in_head or not self._in_body:
            self._head_fed += len(data)
        self._stalled += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self.paused = True
            self.trailing += data[e.args[0]:]
        except httptools.HttpParserError as e:
            cause = e.__context__  # a callback's own exception comes wrapped (HttpParserCallbackError)
            if isinstance(cause, _HeadOnly):
                self._head_only(data)
            elif isinstance(cause, H1Error):
                self._fail(cause.reason, cause.detail, cause.http_status)
            else:
                self._parse_error(str(e))
        else:
            if self._in_head and self._head_fed > self.max_head:
                self._fail(self._too_large_reason, "the head is over the limit", self._too_large_status)
            elif self._in_body and self._stalled > self.max_head:
                # A chunk-size line, its extensions or a trailer that never ends: llhttp would hold it all.
                self._fail(self._too_large_reason, "a chunk line or trailer over the limit", self._too_large_status)
        if len(self.trailing) > (1 << 20) and not self.events:
            self._fail("too_much_data", "bytes beyond an upgrade nobody reads", self._error_status)

    _too_large_status = 431
    _too_large_reason = "header_too_large"
    _trailer_reason = "bad_trailer"

    def _head_only(self, data: bytes) -> None:
        raise NotImplementedError

    def _parse_error(self, detail: str) -> None:
        self._fail(self._error_reason, detail, self._error_status)

    def feed_eof(self) -> None:
        """The stream ended: a message under way is cut (one ended by close is whole)."""
        if self._failed or self.eof:
            return
        self.eof = True
        if self.paused:
            return
        if self._in_head or self._in_body:
            if not self._close_ends_body():
                self._fail("truncated", "the stream ended inside a message", self._error_status)
                return
            self.on_message_complete()
        self.events.append(ConnectionClosed())

    def _close_ends_body(self) -> bool:
        return False

    def next_event(self) -> Any:
        if self.events:
            ev = self.events.popleft()
            if isinstance(ev, H1Error):
                self.events.appendleft(ev)  # it stays the answer: nothing after it is parsed
                raise ev
            return ev
        return NEED_DATA


class _RequestReader(_Reader):
    def _new_parser(self) -> Any:
        return httptools.HttpRequestParser(self)

    def _headers_done(self, headers: list[tuple[bytes, bytes]]) -> None:
        p = self._parser
        version = p.get_http_version()
        method = p.get_method()
        if version not in ("1.1", "1.0"):
            raise H1Error("bad_request", "an HTTP version other than 1.0 and 1.1")
        if self._head_size(len(method) + len(self._url) + 10) > self.max_head:
            raise H1Error("header_too_large", "the head is over the limit", http_status=431)
        hosts = sum(1 for n, _ in headers if n == b"host")
        if hosts > 1 or (hosts == 0 and version == "1.1"):
            raise H1Error("bad_request", "an HTTP/1.1 request needs one Host")
        chunked = _te_chunked(headers, "bad_request", 400)
        if _connection_names_framing(headers):
            raise H1Error("connection_names_framing", "a Connection option naming a framing or routing header")
        connection = _tokens(headers, b"connection")
        upgrade = p.should_upgrade() and method != b"CONNECT"
        if upgrade and (chunked or _content_length(headers)):
            raise H1Error("upgrade_with_body", "an upgrade request with a body")
        self.events.append(Request(method, self._url, headers, version.encode(),
                                   keep_alive=version == "1.1" and b"close" not in connection, upgrade=upgrade))

    def _head_only(self, data: bytes) -> None:  # never raised for requests
        raise AssertionError("unreachable")

    def _parse_error(self, detail: str) -> None:
        self._fail(smuggling_reason(detail) or "bad_request", detail, 400)

    def _fail(self, reason: str, detail: str, status: int) -> None:
        super()._fail(reason, detail, status)
        self.events[-1].method = self._method_or_none()

    def _method_or_none(self) -> bytes:
        # llhttp's method field reads DELETE (0) until one parsed: only once the target began is it real.
        return self._parser.get_method() if self._url and (self._in_head or self._in_body) else b""

    def resume(self) -> None:
        """An upgrade the app refused (a final response, not 101): the bytes after it are HTTP again."""
        if not self.paused:
            return
        self.paused = False
        rest, self.trailing = bytes(self.trailing), bytearray()
        self._in_head = self._in_body = False
        self._parser = self._new_parser()
        if rest:
            self.feed(rest)
        if self.eof:
            self.eof = False
            self.feed_eof()


class _ResponseReader(_Reader):
    """A link's responses. ``expect`` is told each request's method before its response is read: a HEAD
    response has no body whatever its headers say, which llhttp cannot know, so while one is awaited the
    parser is given one whole head at a time (up to its blank line; llhttp takes only CRLF) and a new
    parser takes what follows it."""

    _too_large_status = 502
    _too_large_reason = "bad_response"
    _trailer_reason = "bad_response"

    def __init__(self, max_head: int) -> None:
        super().__init__(max_head, "bad_response", 502)
        self._method = b"GET"
        self._upgrade_asked = False
        self._close_delimited = False
        self._informational = False
        self._held = bytearray()  # a HEAD response's bytes not yet given to the parser
        self._awaiting = False  # a request went and its final response has not ended
        self.final: Response | None = None

    def _new_parser(self) -> Any:
        return httptools.HttpResponseParser(self)

    def expect(self, method: bytes, upgrade: bool) -> None:
        self._method = method
        self._upgrade_asked = upgrade
        self.final = None
        self._close_delimited = False
        self._awaiting = True

    def on_message_begin(self) -> None:
        if not self._awaiting:
            # The gateway sends one request at a time: a response nobody asked for would be taken for the
            # next request's (a desync), so the link is refused instead.
            raise H1Error("bad_response", "a response before a request asked for it", http_status=502)
        super().on_message_begin()

    def _headers_done(self, headers: list[tuple[bytes, bytes]]) -> None:
        p = self._parser
        version = p.get_http_version()
        status = p.get_status_code()
        if version not in ("1.1", "1.0"):
            raise H1Error("bad_response", "an HTTP version other than 1.0 and 1.1", http_status=502)
        if self._head_size(len(self._reason) + 13) > self.max_head:
            raise H1Error("bad_response", "the response head is over the limit", http_status=502)
        if status < 200:
            if status == 101 and not (self._upgrade_asked and p.should_upgrade()):
                raise H1Error("bad_response", "101 without an upgrade asked for and named", http_status=502)
            self._informational = True
            self.events.append(InformationalResponse(status, headers, self._reason, version.encode()))
            return
        chunked = _te_chunked(headers, "bad_response", 502)
        if _connection_names_framing(headers):
            raise H1Error("bad_response", "a Connection option naming a framing header", http_status=502)
        ev = Response(status, headers, self._reason, version.encode())
        self.final = ev
        self.events.append(ev)
        bodiless = self._method == b"HEAD" or status in (204, 304)
        self._close_delimited = not bodiless and not chunked and _content_length(headers) is None
        if self._method == b"HEAD":
            raise _HeadOnly()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            self._in_body = self._chunked = False
            return  # a 1xx has no body and no end of its own: the final response (or the tunnel) follows
        self._awaiting = False
        super().on_message_complete()

    def feed(self, data: bytes) -> None:
        if self._method != b"HEAD" or self.final is not None or self._failed or self.paused:
            super().feed(data)
            return
        self._held += data
        while self.final is None and not self._failed:
            end = self._held.find(b"\r\n\r\n")
            if end < 0:
                if len(self._held) > self.max_head:
                    self._fail("bad_response", "the response head is over the limit", 502)
                return
            head, self._held = bytes(self._held[: end + 4]), self._held[end + 4:]
            super().feed(head)
        rest, self._held = bytes(self._held), bytearray()
        if rest and not self._failed:
            super().feed(rest)  # unasked bytes after the head, for the next exchange (it will find them unfit)

    def feed_eof(self) -> None:
        if self._held and not self._failed and not self.eof:
            self.eof = True
            self._fail("truncated", "the stream ended inside a head", 502)
            return
        super().feed_eof()

    def _head_only(self, data: bytes) -> None:
        self._in_head = self._in_body = False
        self._awaiting = False
        self.events.append(EndOfMessage())
        self._parser = self._new_parser()

    def _close_ends_body(self) -> bool:
        return self._in_body and self._close_delimited

    @property
    def close_delimited(self) -> bool:
        return self._close_delimited


# -- the two sides ------------------------------------------------------------------------------------

class H1Server:
    """The client connection's HTTP/1.1, server side: ``receive_data`` the client's bytes (b"" at its end
    of stream), take ``next_event``s (a request's head, its body, its end), answer it with
    ``send_response`` (or ``send_informational``), ``send_data``, ``send_eom``; then ``start_next_cycle``
    for the next request, unless ``must_close``."""

    def __init__(self, max_head: int) -> None:
        self._r = _RequestReader(max_head, "bad_request", 400)
        self.request: Request | None = None  # the request being answered
        self.request_done = False
        self.response_started = False
        self.response_done = False
        self.must_close = False  # after this exchange, the connection ends
        self._w: _Writer | None = None

    # reading
    def receive_data(self, data: bytes) -> None:
        self._r.receive(data)

    def next_event(self) -> Any:
        """The next event of the current request; NEED_DATA; after its EndOfMessage, NEED_DATA until
        ``start_next_cycle`` (pipelined requests wait). Raises H1Error for refused bytes."""
        if self.request_done:
            return NEED_DATA
        ev = self._r.next_event()
        if isinstance(ev, Request):
            self.request = ev
            if not ev.keep_alive:
                self.must_close = True
        elif isinstance(ev, EndOfMessage):
            self.request_done = True
        return ev

    def ready_body(self) -> Data | EndOfMessage | None:
        """The current request's next ``Data`` or ``EndOfMessage`` if it is parsed already (as
        ``next_event`` would give it), else None, taking nothing: NEED_DATA, a refusal and the end of the
        stream are left for ``next_event``."""
        if self.request_done or not self._r.events:
            return None
        ev = self._r.events[0]
        if type(ev) is not Data and type(ev) is not EndOfMessage:
            return None
        taken: Data | EndOfMessage = self.next_event()
        return taken

    def refusal_ahead(self) -> H1Error | None:
        """The refusal that the current request's body (or trailers) reaches in the bytes parsed so far, or
        None: the gateway answers it (400) before anything of the request goes upstream, instead of
        sending the head and the body up to the refusal point."""
        if self.request_done:
            return None
        for ev in self._r.events:
            if type(ev) is EndOfMessage:
                return None
            if isinstance(ev, H1Error):
                return ev
        return None

    @property
    def idle(self) -> bool:
        """No request begun: nothing of one has been taken."""
        return self.request is None

    @property
    def has_pending(self) -> bool:
        """Bytes of a next request are here already (pipelined): parsed into events, or a head begun."""
        return bool(self._r.events) or self._r._in_head

    @property
    def trailing_data(self) -> bytes:
        """After an upgrade request: the bytes after it (the new protocol's first)."""
        return bytes(self._r.trailing)

    # writing
    def send_informational(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"") -> bytes:
        return serialise_response_head(status, reason, headers)

    def send_response(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"", *,
                      body_ends_by_close: bool = False) -> bytes:
        """The head of the answer to the current request (or, before one parsed, to a refused one), its
        framing chosen as h11 chose it. ``body_ends_by_close``: the body's length is not known."""
        req = self.request
        head_req = req is not None and req.method == b"HEAD"
        http10 = req is None or req.http_version != b"1.1"
        hdrs = headers
        if status in (204, 304):
            self._w = _Writer("none")
        else:
            chunked = _te_chunked(hdrs, "bad_response", 502)
            length = None if chunked else _content_length(hdrs)
            if length is not None:
                self._w = _Writer("none" if head_req else "length", length)
            elif chunked or body_ends_by_close:
                hdrs = [(n, v) for n, v in hdrs if n not in (b"content-length", b"transfer-encoding")]
                if http10:
                    self._w = _Writer("none" if head_req else "close")
                    if not head_req:
                        self.must_close = True
                else:
                    hdrs.append((b"transfer-encoding", b"chunked"))
                    self._w = _Writer("none" if head_req else "chunked")
            else:
                self._w = _Writer("none")  # no framing header and a known empty body: our own answers
        if b"close" in _tokens(hdrs, b"connection"):
            self.must_close = True
        if self.must_close:
            tokens = _tokens(hdrs, b"connection") - {b"keep-alive", b""}
            tokens.add(b"close")
            hdrs = [(n, v) for n, v in hdrs if n != b"connection"]
            hdrs.append((b"connection", b", ".join(sorted(tokens))))
        self.response_started = True
        return serialise_response_head(status, reason, hdrs)

    def send_data(self, data: bytes) -> bytes:
        if self._w is None:
            raise LocalProtocolError("no_response", "a body before the response head")
        return self._w.data(data)

    def send_eom(self, trailers: list[tuple[bytes, bytes]] | None = None) -> bytes:
        if self._w is None:
            raise LocalProtocolError("no_response", "an end before the response head")
        w, self._w = self._w, None
        self.response_done = True
        return w.end((trailers or []) if w.kind == "chunked" else [])

    def switched(self) -> None:
        """A 101 went to the client: the connection is the new protocol's now."""
        self.must_close = True

    def start_next_cycle(self) -> None:
        """The exchange is whole (request read, response sent): the next request may be taken."""
        if not (self.request_done and self.response_done) or self.must_close:
            raise LocalProtocolError("not_done", "the exchange is not whole, or the connection must close")
        if self._r.paused and not self._r.events:
            # This was the upgrade (or CONNECT) request the parser paused after (none queued after it), and
            # the app did not take it: the bytes after it are the next request.
            self._r.resume()
        self.request = None
        self.request_done = self.response_started = self.response_done = False


class H1Client:
    """A link's HTTP/1.1, client side: ``send_request`` (its framing from its headers), ``send_data``,
    ``send_eom``; ``receive_data`` the app's bytes (b"" at their end), ``next_event`` (1xx heads, the
    response head, body, end); ``start_next_cycle`` when both are whole and not ``must_close``."""

    def __init__(self, max_head: int = DEFAULT_MAX_HEAD) -> None:
        self._r = _ResponseReader(max_head)
        self._w: _Writer | None = None
        self.request_sent = False  # the head went
        self.request_done = False  # and its body ended
        self.response_done = False
        self.switched = False  # a 101 came: the link carries the new protocol
        self._close = False
        self._upgrade = False

    @property
    def idle(self) -> bool:
        return not self.request_sent

    @property
    def sending_body(self) -> bool:
        return self.request_sent and not self.request_done

    def send_request(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
        if self.request_sent:
            raise LocalProtocolError("busy", "a request while another is under way")
        self._w = _request_writer(headers)
        self._upgrade = b"upgrade" in _tokens(headers, b"connection") and any(n.lower() == b"upgrade"
                                                                             for n, _ in headers)
        self._r.expect(method, self._upgrade)
        self.request_sent = True
        head = serialise_request_head(method, target, headers)
        if self._w.kind == "none":
            self.request_done = True
        return head

    def send_data(self, data: bytes) -> bytes:
        if self._w is None or self.request_done:
            raise LocalProtocolError("no_body", "a body where none is open")
        return self._w.data(data)

    def send_eom(self, trailers: list[tuple[bytes, bytes]] | None = None) -> bytes:
        if self._w is None:
            raise LocalProtocolError("no_request", "an end before the request head")
        if self.request_done:
            return b""
        self.request_done = True
        return self._w.end((trailers or []) if self._w.kind == "chunked" else [])

    def receive_data(self, data: bytes) -> None:
        self._r.receive(data)

    def next_event(self) -> Any:
        if self.response_done or self.switched:
            return NEED_DATA
        ev = self._r.next_event()
        if isinstance(ev, InformationalResponse) and ev.status_code == 101:
            self.switched = True
            self._close = True
        elif isinstance(ev, Response):
            if ev.http_version != b"1.1" or b"close" in _tokens(ev.headers, b"connection") or \
                    self._r.close_delimited:
                self._close = True
        elif isinstance(ev, EndOfMessage):
            self.response_done = True
        elif isinstance(ev, ConnectionClosed):
            self._close = True
        return ev

    @property
    def must_close(self) -> bool:
        """After this exchange the link ends: the app said so (Connection: close, HTTP/1.0, a body ended by
        close), it switched protocols, or it sent more than was asked (``unfit``)."""
        return self._close or self.unfit

    @property
    def unfit(self) -> bool:
        """Bytes came after the whole response, unasked (refused as the next event): the link is not reused."""
        return self.response_done and bool(self._r.events)

    @property
    def body_ends_by_close(self) -> bool:
        """The response being read has no length: it ends when the app closes."""
        return self._r.close_delimited

    @property
    def trailing_data(self) -> bytes:
        """After a 101: the app's bytes after it."""
        return bytes(self._r.trailing)

    def start_next_cycle(self) -> None:
        if not (self.request_done and self.response_done) or self.must_close:
            raise LocalProtocolError("not_done", "the exchange is not whole, or the link must close")
        self.request_sent = self.request_done = self.response_done = False
        self._w = None
