"""Per-route authentication of HTTP requests, and what of a request's head may go upstream.

Pure: a request head (target bytes, header list as h1_codec and h2 give it: ``[(name, value)]`` of bytes)
and the route's auth in, a decision out. No sockets, no clocks.

Where a token may come from (``AuthConfig`` names them):

- ``Authorization: Bearer <token>``;
- the platform header (default ``X-Sbx-Token: <token>``);
- the platform cookie (default ``sbx_token=<token>``), set by the exchange below;
- ``?token=<token>`` in the target. On an upgrade request (a WebSocket handshake: ``new WebSocket(url)``
  in a browser can neither send headers nor follow a redirect) a right one authenticates the request
  itself, removed from the target like any ``token`` parameter (no cookie is set). On any other request,
  since a browser cannot send headers on a navigation, the parameter is
  exchanged: the answer is a redirect (303) to the same URL without the parameter (other parameters kept,
  in order, byte for byte) with ``Set-Cookie: sbx_token=<token>; HttpOnly; Secure; SameSite=Lax; Path=/``,
  which has no ``Domain`` attribute and so belongs to exactly the host that set it; the cookie then
  authenticates. The redirect's ``Location`` is absolute, built from the routed host (and the port the
  client named, once validated: a browser on ``https://x.<domain>:8443/?token=`` stays on port 8443),
  so a target such as ``//evil.example/`` cannot turn it into a redirect elsewhere.

Each presented token is hashed (SHA-256) and its hex digest compared with the route's ``token_sha256``
by ``hmac.compare_digest``. Results: ``Allow``; ``Deny`` 401 when no token came (with
``WWW-Authenticate: Bearer``), 403 when none of those that came is right; ``Redirect`` for a right
``?token=`` (``Allow`` on an upgrade). Several tokens may come at once (a stale cookie and a fresh
header): one right one allows.

What goes upstream (``Allow.headers``, ``Allow.target``): the platform's token never does, in any form:

- token routes: every ``Authorization: Bearer`` header is removed (on a token route the bearer is the
  platform's; other schemes such as Basic pass), every ``token`` query parameter is removed;
- all routes: the platform header, and the platform cookie out of every Cookie header (other cookies
  kept, in order; the Cookie headers joined into one, as RFC 9113 8.2.3 asks before HTTP/1.1);
- all routes: ``X-Forwarded-For``, ``-Proto``, ``-Host`` and ``Forwarded`` from the client are dropped
  and the gateway's own three appended.

Header names match case-insensitively and with ``_`` read as ``-``: several app servers (CGI, WSGI) map
both to the same variable, so an ``X_Forwarded_For`` or ``X_Sbx_Token`` left in would reach the app as the
real thing. Query parameter names match after percent-decoding (``tok%65n`` is ``token`` to the app).

Deny reason tokens: ``missing_token`` (401), ``wrong_token`` (403), ``no_token_configured`` (403: a token
route without a hash), ``auth_unsupported`` (403: an auth mode HTTP does not do), ``bad_target`` (400: a
target with bytes outside printable ASCII), ``token_not_cookie_safe`` (400: a right token that a cookie
cannot carry).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

from sbxnet.errors import ConfigError

Headers = list[tuple[bytes, bytes]]

_TOKEN_CHARS = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token (header and cookie names)
_PARAM = re.compile(rb"[A-Za-z0-9._~-]+")
_COOKIE_OCTETS = re.compile(rb"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]+")  # RFC 6265 cookie-octet
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PRINTABLE = re.compile(rb"[\x21-\x7e]*")
_FORWARDED = (b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded")


def _norm(name: bytes) -> bytes:
    return name.lower().replace(b"_", b"-")


@dataclass(frozen=True)
class AuthConfig:
    """Where tokens come from. ``ConfigError`` for a name HTTP cannot carry."""

    header: bytes = b"X-Sbx-Token"
    cookie: bytes = b"sbx_token"
    query_param: bytes = b"token"
    redirect_status: int = 303

    def __post_init__(self) -> None:
        if not _TOKEN_CHARS.fullmatch(self.header) or _norm(self.header) in (*_FORWARDED, b"authorization", b"cookie"):
            raise ConfigError(f"gateway.token_header = {self.header!r}: an HTTP header name of our own")
        if not _TOKEN_CHARS.fullmatch(self.cookie):
            raise ConfigError(f"gateway.token_cookie = {self.cookie!r}: a cookie name (RFC 6265 token)")
        if not _PARAM.fullmatch(self.query_param):
            raise ConfigError(f"gateway.token_param = {self.query_param!r}: letters, digits and ._~-")
        if self.redirect_status not in (302, 303):
            raise ConfigError(f"gateway.token_redirect_status = {self.redirect_status!r}: 302 or 303")


@dataclass(frozen=True)
class Allow:
    """Forward the request with this target and these headers (the token removed, X-Forwarded-* set)."""

    target: bytes
    headers: Headers
    via: str  # "public", "bearer", "header", "cookie" or "query" (an upgrade's ?token=): how it was let in


@dataclass(frozen=True)
class Deny:
    """Answer ``status`` with ``message`` (one line) and ``headers``; nothing goes upstream."""

    status: int
    reason: str
    message: str
    headers: Headers = field(default_factory=list)


@dataclass(frozen=True)
class Redirect:
    """Answer ``status`` with ``headers`` (Location, Set-Cookie, Cache-Control); nothing goes upstream."""

    status: int
    location: bytes
    set_cookie: bytes

    @property
    def headers(self) -> Headers:
        return [(b"location", self.location), (b"set-cookie", self.set_cookie), (b"cache-control", b"no-store")]


def token_matches(candidate: bytes, token_sha256: str) -> bool:
    """Whether ``candidate`` hashes to ``token_sha256`` (lower-case hex), compared in constant time."""
    return hmac.compare_digest(hashlib.sha256(candidate).hexdigest(), token_sha256)


def _any_match(candidates: Sequence[bytes], token_sha256: str) -> bytes | None:
    found: bytes | None = None
    for c in candidates:  # every candidate is hashed and compared, whichever matches
        if token_matches(c, token_sha256) and found is None:
            found = c
    return found


# -- the target's query ---------------------------------------------------------------------------


def _split_target(target: bytes) -> tuple[bytes, bytes | None]:
    path, sep, query = target.partition(b"?")
    return path, (query if sep else None)


def _decode(component: bytes) -> bytes:
    return unquote_to_bytes(component.replace(b"+", b" "))


def split_query(query: bytes | None, param: bytes) -> tuple[list[bytes], list[bytes]]:
    """The query's ``&``-separated parts other than ``param`` (byte for byte, in order), and the decoded
    values of the ``param`` parts (a part named ``param`` with no ``=`` has the value ``b""``)."""
    if query is None:
        return [], []
    kept: list[bytes] = []
    values: list[bytes] = []
    for part in query.split(b"&"):
        name, _, value = part.partition(b"=")
        if _decode(name) == param:
            values.append(_decode(value))
        else:
            kept.append(part)
    return kept, values


def _join(path: bytes, kept: list[bytes]) -> bytes:
    return path + b"?" + b"&".join(kept) if kept else path


def _origin_path(path: bytes) -> bytes:
    """The path of an origin-form or absolute-form target's part before ``?``."""
    if path.startswith(b"/"):
        return path
    rest = path.split(b"://", 1)[-1]
    slash = rest.find(b"/")
    return rest[slash:] if slash >= 0 else b"/"


# -- headers ---------------------------------------------------------------------------------------


def _bearer(value: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer`` value (possibly empty), None for another scheme."""
    scheme, _, rest = value.strip(b" \t").partition(b" ")
    return rest.strip(b" \t") if scheme.lower() == b"bearer" else None


def _split_cookie(value: bytes, name: bytes) -> tuple[list[bytes], list[bytes]]:
    """The crumbs of one Cookie header other than ``name``, and the values of those named ``name``."""
    kept: list[bytes] = []
    values: list[bytes] = []
    for crumb in value.split(b";"):
        crumb = crumb.strip(b" \t")
        if not crumb:
            continue
        k, _, v = crumb.partition(b"=")
        if k.strip(b" \t") == name:
            v = v.strip(b" \t")
            if len(v) >= 2 and v[:1] == b'"' and v[-1:] == b'"':
                v = v[1:-1]
            values.append(v)
        else:
            kept.append(crumb)
    return kept, values


@dataclass
class _Credentials:
    headers: Headers
    bearer: list[bytes]
    header: list[bytes]
    cookie: list[bytes]


def _clean_headers(config: AuthConfig, headers: Sequence[tuple[bytes, bytes]], *, strip_bearer: bool) -> _Credentials:
    """The headers without anything the gateway owns, and the tokens found in them."""
    platform = _norm(config.header)
    out: Headers = []
    bearer: list[bytes] = []
    header: list[bytes] = []
    cookie: list[bytes] = []
    crumbs: list[bytes] = []
    cookie_at: int | None = None
    for name, value in headers:
        n = _norm(name)
        if n in _FORWARDED:
            continue
        if n == platform:
            header.append(value.strip(b" \t"))
            continue
        if n == b"authorization":
            token = _bearer(value)
            if token is not None and strip_bearer:
                bearer.append(token)
                continue
        if n == b"cookie":
            kept, values = _split_cookie(value, config.cookie)
            cookie.extend(values)
            crumbs.extend(kept)
            if cookie_at is None:
                cookie_at = len(out)
                out.append((name, b""))
            continue
        out.append((name, value))
    if cookie_at is not None:
        if crumbs:
            out[cookie_at] = (out[cookie_at][0], b"; ".join(crumbs))
        else:
            del out[cookie_at]
    return _Credentials(out, bearer, header, cookie)


def forwarded_headers(client_ip: str, proto: str, host: str) -> Headers:
    """The three headers the gateway sets (what ``Allow.headers`` ends with)."""
    return [
        (b"x-forwarded-for", client_ip.encode("ascii")),
        (b"x-forwarded-proto", proto.encode("ascii")),
        (b"x-forwarded-host", host.encode("ascii")),
    ]


def _missing(config: AuthConfig) -> Deny:
    return Deny(
        401,
        "missing_token",
        f"a token is required: Authorization: Bearer, {config.header.decode()}, "
        f"the {config.cookie.decode()} cookie or ?{config.query_param.decode()}=",
        [(b"www-authenticate", b'Bearer realm="sbxnet"')],
    )


def authorize(
    config: AuthConfig,
    *,
    auth: str,
    token_sha256: str | None,
    target: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    client_ip: str,
    host: str,
    proto: str = "https",
    port: int | None = None,
    upgrade: bool = False,
) -> Allow | Deny | Redirect:
    """Decide one request on a route whose port has ``auth`` ("public" or "token").

    ``host`` is the routed host name (``names.Names.host_of``: validated, canonical); it goes into
    X-Forwarded-Host and the redirect's Location. ``port``: the port the request's authority named, as
    ``routing.requested_port`` validated it (None when it named none, or the scheme's default); the
    redirect's Location keeps it. ``client_ip`` goes into X-Forwarded-For. ``upgrade``: the request asks
    for a protocol upgrade (a WebSocket handshake), which cannot follow a redirect: a right ``?token=``
    authenticates the request itself (``Allow``, via ``query``, the parameter removed)."""
    if not _PRINTABLE.fullmatch(target):
        return Deny(400, "bad_target", "the request target has bytes outside printable ASCII")
    forwarded = forwarded_headers(client_ip, proto, host)
    if auth == "public":
        creds = _clean_headers(config, headers, strip_bearer=False)
        return Allow(target, creds.headers + forwarded, "public")
    if auth != "token":
        return Deny(403, "auth_unsupported", f"this port's auth ({auth[:16]}) is not served over HTTP")
    if token_sha256 is None or not _HEX64.fullmatch(token_sha256):
        return Deny(403, "no_token_configured", "this sandbox has no token configured")

    path, query = _split_target(target)
    kept, from_query = split_query(query, config.query_param)
    from_query = [v for v in from_query if v]
    if from_query:
        good = _any_match(from_query, token_sha256)
        if good is None:
            return Deny(403, "wrong_token", "wrong token")
        if upgrade:
            creds = _clean_headers(config, headers, strip_bearer=True)
            return Allow(_join(path, kept), creds.headers + forwarded, "query")
        if not _COOKIE_OCTETS.fullmatch(good):
            return Deny(400, "token_not_cookie_safe", "this token cannot be carried in a cookie: send it in a header")
        origin = f"{proto}://{host}" if port is None else f"{proto}://{host}:{int(port)}"
        location = origin.encode("ascii") + _join(_origin_path(path), kept)
        cookie = config.cookie + b"=" + good + b"; HttpOnly; Secure; SameSite=Lax; Path=/"
        return Redirect(config.redirect_status, location, cookie)

    creds = _clean_headers(config, headers, strip_bearer=True)
    for via, values in (("bearer", creds.bearer), ("header", creds.header), ("cookie", creds.cookie)):
        values = [v for v in values if v]
        if values and _any_match(values, token_sha256) is not None:
            return Allow(_join(path, kept), creds.headers + forwarded, via)
    if not any(v for v in (*creds.bearer, *creds.header, *creds.cookie)):
        return _missing(config)
    return Deny(403, "wrong_token", "wrong token")
