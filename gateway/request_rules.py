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

An HTTP/2 request head that ends its stream (``check_h2_head``): RFC 9113 8.1.1 makes a request
malformed when its ``content-length`` does not equal the DATA it carries; h2 (4.4) checks that against
DATA frames, but not for a HEADERS frame with END_STREAM, which carries none: so ``content-length`` must
then be ``0`` (``content_length_mismatch``). What h2 does check itself (each a connection error it
answers with GOAWAY PROTOCOL_ERROR before any stream event): upper-case header names, connection-specific
headers (``connection``, ``keep-alive``, ``proxy-connection``, ``transfer-encoding``, ``upgrade``), ``te``
other than ``trailers``, a malformed or conflicting ``content-length``, DATA that disagrees with it,
missing, duplicated, misplaced, unknown or response-only pseudo-headers, an empty ``:path``, bytes a
header may not carry, ``:authority`` and Host that disagree, pseudo-headers in trailers.

Reason tokens (``RequestRefused.reason``; stable, counted by metrics, answered 400): ``bad_target``,
``bad_method``, ``content_length_mismatch``.
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


def check_h2_head(headers: Sequence[tuple[bytes, bytes]], *, ended: bool) -> None:
    """What of RFC 9113 8.1.1 an HTTP/2 request head breaks that h2 does not check (the module docstring);
    ``ended``: END_STREAM came with the HEADERS frame."""
    for n, v in headers:
        if n == b":method":
            check_method(v)
        elif n == b"content-length" and ended and not (v.isdigit() and int(v) == 0):
            raise RequestRefused("content_length_mismatch", "content-length on a request with no DATA")
