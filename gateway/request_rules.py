"""What of a request's first line (or HTTP/2 pseudo-headers) may reach a sandbox: pure rules, shared by the
HTTP/1.1 and HTTP/2 fronts.

Pure: bytes in, the bytes to send upstream or a ``RequestRefused`` out. No sockets, no clocks.

The request target (``upstream_target``). A sandbox's app receives only origin-form, a path and an
optional query (RFC 9112 3.2.1), or ``*`` for OPTIONS (3.2.4); an app that reads an absolute-form target
(RFC 9112 3.2.2 says a server must) would otherwise take ``https://b.<domain>/x`` on a request routed to
``a`` for ``b``, around the 421 rule. So:

- origin-form (``/path?query``) passes as it came;
- ``*`` passes with OPTIONS only;
- absolute-form of the listener's scheme (``https://host[:port]/path?query``) passes over HTTP/1.1 only,
  rewritten to its origin-form (``/path?query``; ``/`` when it has no path). Its authority is what routes
  the request (``names.Names.request_name``: Host is then ignored, as RFC 9112 3.2.2 requires), checked
  exactly like a Host: a malformed one is 400, another name than the connection's is 421. Over HTTP/2
  ``:path`` is never absolute-form (RFC 9113 8.3.1): refused;
- anything else is refused (``bad_target``): a target without a leading ``/`` (``x``), a fragment (``#``:
  never part of a request target, RFC 9112 3.2), another scheme, authority-form, bytes outside printable
  ASCII, an empty target.

The method (``check_method``): a token (RFC 9110 9.1, 5.6.2), or ``bad_method``. The HTTP/1.1 parser
allows only token methods already; h2 (4.4) does not check ``:method`` at all.

An HTTP/2 request (``check_h2_head``, ``check_h2_trailers``, ``h2_content_length``). RFC 9113 8.1.1 makes
a malformed request a *stream* error: the gateway refuses it on its stream and the connection's other
streams go on. h2 (4.4) would raise most of these as connection errors (GOAWAY), so the HTTP/2 front runs
h2 with ``validate_inbound_headers`` and ``normalize_inbound_headers`` off and without its content-length
tracking (``http2.py``), and these rules do every check h2 did, on the header list as it came (h2 4.4's
function, the check, our reason):

- ``_reject_illegal_characters``: a name with upper-case or a byte 0x00-0x20 or 0x7f-0xff, or a ``:`` past
  its first byte; a value with NUL, CR or LF, or that starts or ends with SP or HTAB (8.2.1): ``bad_header``;
- ``_reject_empty_header_names``: an empty name (8.2.1): ``bad_header``;
- ``_reject_te``: ``te`` other than ``trailers`` (8.2.2): ``bad_header``;
- ``_reject_connection_header``: ``connection``, ``keep-alive``, ``proxy-connection``, ``transfer-encoding``,
  ``upgrade`` (8.2.2): ``bad_header``;
- ``_reject_pseudo_header_fields``: a pseudo-header repeated, after a regular field, or not one of
  ``:method :scheme :authority :path :status :protocol`` (8.3): ``bad_pseudo_header``;
- ``_check_pseudo_header_field_acceptability``: no ``:method``; CONNECT without ``:protocol`` but with
  ``:scheme`` or ``:path``; any other request without ``:scheme`` or ``:path``; ``:status``; ``:protocol``
  on a method other than CONNECT (8.3.1, 8.5, RFC 8441 4); any pseudo-header in trailers (8.1):
  ``bad_pseudo_header``;
- ``_validate_host_authority_header``: two Host fields (``duplicate_host``); neither ``:authority`` nor
  Host (``missing_host``); both, not the same bytes (8.3.1, ``host_mismatch``);
- ``_check_path_header``: an empty ``:path`` (8.3.1): ``bad_target``;
- ``H2Stream._initialize_content_length``: a ``content-length`` that is not 1*DIGIT, or two that differ
  (RFC 9110 8.6): ``bad_content_length``;
- ``H2Stream._track_content_length``: DATA that disagrees with ``content-length`` (8.1.1):
  ``content_length_mismatch`` (``h2_data``, as each DATA frame comes).

What h2 never checked, added here: a ``:method`` that is not a token (``bad_method``); ``content-length``
other than 0 on a HEADERS frame with END_STREAM, which carries no DATA (``content_length_mismatch``); a
``:path`` that is not origin-form (``upstream_target``). Trailers (``check_h2_trailers``) are held to the
field rules above and carry no pseudo-header (``bad_header``, ``bad_pseudo_header``). A refused head is
answered 400 on its stream (then reset PROTOCOL_ERROR if the client had not ended it), nothing upstream;
a refusal found later (DATA, trailers) resets the stream
with PROTOCOL_ERROR (``http2.py``).

Reason tokens (``RequestRefused.reason``; stable, counted by metrics): ``bad_target``, ``bad_method``,
``content_length_mismatch``, ``bad_content_length``, ``bad_header``, ``bad_pseudo_header``,
``duplicate_host``, ``missing_host``, ``host_mismatch``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sbxnet.errors import RemoteProtocolError

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.6.2 token
_PRINTABLE = re.compile(rb"[\x21-\x7e]+")
MAX_METHOD = 64  # longer than any registered method by far


class RequestRefused(RemoteProtocolError):
    """A request the fronts refuse (400) before anything of it goes upstream; ``detail`` never repeats the
    peer's text."""


def check_method(method: bytes) -> None:
    """``bad_method`` unless ``method`` is a token of at most ``MAX_METHOD`` bytes."""
    if len(method) > MAX_METHOD or not _TOKEN.fullmatch(method):
        raise RequestRefused("bad_method", "the method is not a token")


def upstream_target(method: bytes, target: bytes, *, scheme: str = "https", http2: bool = False) -> bytes:
    """The target to send upstream for a request whose method is ``method``: the module docstring's rule.
    ``scheme``: the listener's (``names.Names.scheme``), the only one an absolute-form target may name."""
    if not _PRINTABLE.fullmatch(target):
        raise RequestRefused("bad_target", "empty, or bytes outside printable ASCII")
    if b"#" in target:
        raise RequestRefused("bad_target", "a fragment is not part of a request target")
    if target[:1] == b"/":
        return target
    if target == b"*":
        if method != b"OPTIONS":
            raise RequestRefused("bad_target", "* is a target for OPTIONS only")
        return target
    prefix = scheme.encode("ascii") + b"://"
    if target[: len(prefix)].lower() != prefix:
        raise RequestRefused("bad_target", "neither origin-form, * nor absolute-form of our scheme")
    if http2:
        raise RequestRefused("bad_target", "an HTTP/2 :path is origin-form or *")
    rest = target[len(prefix) :]
    ends = [i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0]
    end = min(ends) if ends else len(rest)
    if end == 0:
        raise RequestRefused("bad_target", "no authority")
    origin = rest[end:]
    if not origin.startswith(b"/"):
        origin = b"/" + origin  # no path, or only a query: the path is "/" (RFC 9112 3.2.1)
    return origin


# Connection-specific fields, never in an HTTP/2 message (RFC 9113 8.2.2).
H2_CONNECTION_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                   b"upgrade"})
_PSEUDO_HEADERS = frozenset({b":method", b":scheme", b":authority", b":path", b":status", b":protocol"})
_BAD_NAME_BYTE = re.compile(rb"[\x00-\x20A-Z\x7f-\xff]")
_BAD_VALUE_BYTE = re.compile(rb"[\x00\r\n]")


def _check_fields(headers: Sequence[tuple[bytes, bytes]]) -> None:
    """The field rules of RFC 9113 8.2.1 and 8.2.2, on every field of a head or trailers."""
    for n, v in headers:
        if not n or _BAD_NAME_BYTE.search(n) or n.find(b":", 1) != -1:
            raise RequestRefused("bad_header", "a field name HTTP/2 does not allow")
        if v and (_BAD_VALUE_BYTE.search(v) or v[:1] in b" \t" or v[-1:] in b" \t"):
            raise RequestRefused("bad_header", "a field value HTTP/2 does not allow")
        if n in H2_CONNECTION_HEADERS:
            raise RequestRefused("bad_header", "a connection-specific field")
        if n == b"te" and v.lower() != b"trailers":
            raise RequestRefused("bad_header", "te other than trailers")


def _check_pseudo(headers: Sequence[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The request's pseudo-headers, each once, all before the regular fields, each one we know."""
    pseudo: dict[bytes, bytes] = {}
    regular = False
    for n, v in headers:
        if n[:1] != b":":
            regular = True
        elif n in pseudo or regular or n not in _PSEUDO_HEADERS:
            raise RequestRefused("bad_pseudo_header", "a pseudo-header repeated, misplaced or unknown")
        else:
            pseudo[n] = v
    return pseudo


def h2_content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    """The request's content length from its ``content-length`` fields (None: it has none);
    ``bad_content_length`` when one is not 1*DIGIT or two differ."""
    length: int | None = None
    for n, v in headers:
        if n != b"content-length":
            continue
        if not v or not v.isdigit():
            raise RequestRefused("bad_content_length", "content-length is not a number")
        value = int(v)
        if length is not None and value != length:
            raise RequestRefused("bad_content_length", "content-length fields that differ")
        length = value
    return length


def check_h2_head(headers: Sequence[tuple[bytes, bytes]], *, ended: bool) -> None:
    """A malformed HTTP/2 request head (RFC 9113 8.1.1: the module docstring's table) is ``RequestRefused``;
    ``ended``: END_STREAM came with the HEADERS frame."""
    _check_fields(headers)
    pseudo = _check_pseudo(headers)
    method = pseudo.get(b":method")
    if method is None:
        raise RequestRefused("bad_pseudo_header", "no :method")
    connect = method == b"CONNECT"
    if connect and b":protocol" not in pseudo:
        if b":scheme" in pseudo or b":path" in pseudo:
            raise RequestRefused("bad_pseudo_header", "CONNECT with :scheme or :path")
    elif b":scheme" not in pseudo or b":path" not in pseudo:
        raise RequestRefused("bad_pseudo_header", "no :scheme or no :path")
    if b":status" in pseudo or (b":protocol" in pseudo and not connect):
        raise RequestRefused("bad_pseudo_header", ":status, or :protocol without CONNECT")
    hosts = [v for n, v in headers if n == b"host"]
    if len(hosts) > 1:
        raise RequestRefused("duplicate_host", "two Host fields")
    authority = pseudo.get(b":authority")
    if authority is None and not hosts:
        raise RequestRefused("missing_host", "neither :authority nor Host")
    if authority is not None and hosts and hosts[0] != authority:
        raise RequestRefused("host_mismatch", ":authority and Host differ")
    if pseudo.get(b":path") == b"":
        raise RequestRefused("bad_target", "an empty :path")
    length = h2_content_length(headers)
    check_method(method)
    if ended and length:
        raise RequestRefused("content_length_mismatch", "content-length on a request with no DATA")


def h2_data(length: int | None, received: int, size: int, *, end: bool) -> bool:
    """A DATA frame of ``size`` bytes brought a stream's DATA to ``received`` bytes (``end``: END_STREAM came
    with it, or trailers came after it); ``length``: the request's content-length. ``content_length_mismatch``
    when they disagree (more DATA than it, or an end short of it: RFC 9113 8.1.1). True when this DATA
    completes the content-length before the stream has ended: it must wait for the end (or trailers) before
    it goes upstream, so that an app never takes a whole request that then turns out malformed."""
    if length is None:
        return False
    if received > length or (end and received != length):
        raise RequestRefused("content_length_mismatch", "the DATA disagrees with content-length")
    return received == length and size > 0 and not end


def check_h2_trailers(headers: Sequence[tuple[bytes, bytes]]) -> None:
    """Malformed HTTP/2 trailers: a field the rules of a head refuse, or any pseudo-header (RFC 9113 8.1)."""
    _check_fields(headers)
    if any(n[:1] == b":" for n, _ in headers):
        raise RequestRefused("bad_pseudo_header", "a pseudo-header in trailers")
