"""The gateway's client-facing TLS: several certificates chosen by SNI, ALPN, client certificates, reload.

TLS 1.2 and 1.3 (public clients), no client certificate asked by default. One ``ssl.SSLContext`` per
configured certificate; the listening context's SNI callback moves each connection onto the one
``cert_select.choose`` picks. ALPN offers ``h2`` and ``http/1.1``; a client offering neither (a raw TCP
route's ``openssl s_client``, or an ``ssh`` ALPN) completes the handshake with no protocol selected,
which is how raw TCP routes are told apart from HTTP ones after the handshake.

Client certificates (raw TCP routes whose auth is ``client_cert``), given a ``client_ca_file``: each
certificate also gets a context that requires a client certificate chaining to that CA
(``client_cert_context``). It has to be chosen before the handshake starts: OpenSSL copies whether to
ask for a certificate from the context the connection's object is made from, and moving the object onto
another context in the SNI callback changes the certificate presented but not that. So the caller reads
the server name from the ClientHello first (``hello_server_name``: OpenSSL itself reads it, on a
throw-away object fed the bytes the client sent, stopped in its SNI callback), looks the route up, and
makes the connection from the context the route calls for. Only the connections of such routes are
asked for a certificate; a browser on an HTTP route is never prompted for one.

``presented_names`` says which certificate a connection was shown (the DNS SANs of its context's):
what names its requests may carry (``routing.request_target``, for HTTP/2 coalescing).

A server name that is not ASCII (IDNA names travel as ``xn--`` A-labels, so only a broken or hostile
client sends one) never reaches an SNI callback: CPython decodes the name as ASCII first and, failing,
reports the error as "unraisable" (a traceback on stderr, not a JSON line) and fails the handshake with an
internal_error alert. ``guard_server_names`` (run by ``FrontTls`` and the probe) puts a hook in front of
``sys.unraisablehook`` that takes exactly that report: the handshake is refused as before, quietly, and
counted in ``refused_server_names`` (reason ``sni_not_ascii``); the probe answers ``UNREADABLE`` (and does
not count it: the handshake that follows does). Any other unraisable goes on to the hook that was there.

``reload()`` loads every certificate (and the client CA) again and swaps the whole set only if all of
them load (``certs.loader.Reloadable``): a bad file keeps the old set serving.
"""

from __future__ import annotations

import collections
import logging
import ssl
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509

from certs.loader import LOAD_ERRORS, Reloadable
from gateway.cert_select import choose

ALPN = ("h2", "http/1.1")

log = logging.getLogger("sbxnet.gateway")

# Handshakes refused for their server name before any SNI callback could see it, by reason, in this process
# (CPython's report names no connection): ``sni_not_ascii``.
refused_server_names: collections.Counter[str] = collections.Counter()
_probing = threading.local()  # set while hello_server_name's handshake runs on this thread


def _is_sni_decode_error(u: sys.UnraisableHookArgs) -> bool:
    """Whether ``u`` is CPython's report of a ClientHello server name it could not decode as ASCII (its
    ``_servername_callback``: the object is the name's bytes, the error their ASCII decoding)."""
    e = u.exc_value
    return (u.err_msg is None and isinstance(u.object, bytes) and isinstance(e, UnicodeDecodeError)
            and e.encoding == "ascii" and e.object == u.object)


def guard_server_names() -> None:
    """Put the server-name hook in front of ``sys.unraisablehook`` (once; again if it was replaced since)."""
    current = sys.unraisablehook
    if getattr(current, "_sbxnet_sni_guard", False):
        return

    def hook(u: sys.UnraisableHookArgs) -> None:
        if not _is_sni_decode_error(u):
            current(u)
        elif getattr(_probing, "active", False):
            _probing.refused = True
        else:
            refused_server_names["sni_not_ascii"] += 1
            log.debug("TLS server name not ASCII: handshake refused",
                      extra={"event": "sni_refused", "reason": "sni_not_ascii"})

    hook._sbxnet_sni_guard = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


@dataclass(frozen=True)
class CertPair:
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class _Loaded:
    names: tuple[tuple[str, ...], ...]  # DNS SANs of each certificate, in configured order
    contexts: tuple[ssl.SSLContext, ...]
    # The same certificates, each requiring a client certificate from the client CA; None without one.
    client_cert_contexts: tuple[ssl.SSLContext, ...] | None


def _dns_sans(cert_file: Path) -> tuple[str, ...]:
    pem = cert_file.read_bytes()
    try:
        cert = x509.load_pem_x509_certificate(pem)
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        raise ValueError(f"{cert_file}: the certificate has no subjectAltName with DNS names") from None
    names = tuple(ext.value.get_values_for_type(x509.DNSName))
    if not names:
        raise ValueError(f"{cert_file}: the certificate has no DNS subjectAltName")
    return names


def _context(pair: CertPair, alpn: Sequence[str], client_ca: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=str(pair.cert_file), keyfile=str(pair.key_file))
    ctx.set_alpn_protocols(list(alpn))
    if client_ca is not None:
        # OpenSSL checks the chain against this CA only, and (on a server) that the leaf may be a TLS
        # client: an extended key usage without clientAuth is refused.
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(client_ca))
    return ctx


SniRecorder = Callable[[ssl.SSLObject | ssl.SSLSocket, str | None, ssl.SSLContext], None]


def _load(pairs: Sequence[CertPair], alpn: Sequence[str], client_ca: Path | None, record: SniRecorder) -> _Loaded:
    if not pairs:
        raise ValueError("the gateway needs at least one certificate")
    client_cert_contexts = None
    if client_ca is not None:
        client_cert_contexts = tuple(_context(p, alpn, client_ca) for p in pairs)
        for ctx in client_cert_contexts:
            ctx.sni_callback = record  # chosen for this name already: only remember the name
    return _Loaded(tuple(_dns_sans(p.cert_file) for p in pairs), tuple(_context(p, alpn) for p in pairs),
                   client_cert_contexts)


class FrontTls:
    """The listening context (``context``), the client-certificate contexts, and the set behind them."""

    def __init__(self, pairs: Sequence[CertPair], *, alpn: Sequence[str] = ALPN,
                 client_ca_file: Path | None = None) -> None:
        guard_server_names()
        self._pairs = tuple(pairs)
        self.alpn = tuple(alpn)
        self.client_ca_file = client_ca_file
        # The DNS SANs of the certificate each context presents, kept for as long as the context lives
        # (a connection accepted before a reload keeps its context, so its names too).
        self._presented: weakref.WeakKeyDictionary[ssl.SSLContext, tuple[str, ...]] = weakref.WeakKeyDictionary()
        self._set = Reloadable(lambda: self._remember(
            _load(self._pairs, self.alpn, self.client_ca_file, self._record_sni)))
        # The SNI each connection sent, by its SSL object: routing needs it after the handshake.
        self._server_names: weakref.WeakKeyDictionary[object, str | None] = weakref.WeakKeyDictionary()
        # The context the listener wraps with: the default certificate, and the SNI switch. It is never
        # replaced, so a reload needs no new listener; the callback reads the current set each time.
        self.context = _context(self._pairs[0], self.alpn)
        self.context.sni_callback = self._on_sni
        self._presented[self.context] = self._set.current.names[0]

    def _remember(self, loaded: _Loaded) -> _Loaded:
        self._presented.update(zip(loaded.contexts, loaded.names, strict=True))
        if loaded.client_cert_contexts is not None:
            self._presented.update(zip(loaded.client_cert_contexts, loaded.names, strict=True))
        return loaded

    @property
    def names(self) -> tuple[tuple[str, ...], ...]:
        return self._set.current.names

    @property
    def verifies_client_certs(self) -> bool:
        """Whether a client CA is configured (``client_cert_context`` may be asked for)."""
        return self.client_ca_file is not None

    def _on_sni(self, obj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        loaded = self._set.current
        self._server_names[obj] = server_name
        obj.context = loaded.contexts[choose(server_name, loaded.names)]

    def _record_sni(self, obj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        self._server_names[obj] = server_name

    def client_cert_context(self, server_name: str | None) -> ssl.SSLContext:
        """The context for a connection to ``server_name`` that must present a client certificate chaining
        to the client CA: the handshake fails without one (TLS 1.3 alert certificate_required, TLS 1.2
        handshake_failure) or with one that does not verify (unknown_ca, certificate_expired...).
        ValueError if no client CA is configured."""
        loaded = self._set.current
        if loaded.client_cert_contexts is None:
            raise ValueError("no client_ca_file configured")
        return loaded.client_cert_contexts[choose(server_name, loaded.names)]

    @staticmethod
    def client_cert_verified(obj: ssl.SSLObject) -> bool:
        """Whether the client of this (finished) handshake presented a certificate that verified against
        the client CA: only a client-certificate context asks for one, and it fails the handshake otherwise."""
        return obj.context.verify_mode == ssl.CERT_REQUIRED and bool(obj.getpeercert())

    def presented_names(self, obj: ssl.SSLObject | ssl.SSLSocket) -> tuple[str, ...]:
        """The DNS SANs of the certificate the connection of ``obj`` (handshake done) was shown: the names
        its client may send requests for on it (RFC 9113 9.1.1). Empty for an object made elsewhere."""
        return self._presented.get(obj.context, ())

    def server_name(self, obj: ssl.SSLObject | ssl.SSLSocket) -> str | None:
        """The server name (SNI) the client sent on the connection of ``obj``; None if it sent none."""
        return self._server_names.get(obj)

    def reload(self) -> BaseException | None:
        """Load every certificate again; on any failure keep the current set and return the error."""
        return self._set.reload()

    def load(self) -> object:
        """Every certificate loaded again, not yet in use (raises ``certs.loader.LOAD_ERRORS``); ``use`` swaps
        the set in."""
        return self._set.load()

    def use(self, loaded: object) -> None:
        assert isinstance(loaded, _Loaded)
        self._set.use(loaded)


# -- the server name before the handshake ----------------------------------------------------------------


@dataclass(frozen=True)
class HelloName:
    """The ClientHello was read: the server name it carries (None: it sent no SNI)."""

    server_name: str | None


NEED_MORE: Literal["need_more"] = "need_more"  # the ClientHello is not whole yet
# OpenSSL refused the bytes before reaching the server name, or CPython refused the name (not ASCII)
UNREADABLE: Literal["unreadable"] = "unreadable"
HelloResult = HelloName | Literal["need_more", "unreadable"]

_probe_names: weakref.WeakKeyDictionary[object, str | None] = weakref.WeakKeyDictionary()


def _stop_at_sni(obj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext) -> int:
    _probe_names[obj] = server_name
    return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE  # stop here: the probe never answers anyone


def _probe_context() -> ssl.SSLContext:
    # No certificate: OpenSSL calls the SNI callback before it picks one.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.sni_callback = _stop_at_sni
    return ctx


_PROBE = _probe_context()


def hello_server_name(data: bytes) -> HelloResult:
    """The server name in the ClientHello that ``data`` (what a client sent first) starts with.

    OpenSSL parses it, with the same settings as the real handshake (TLS 1.2 at least): a throw-away server
    object is fed ``data`` from memory and stopped in its SNI callback, and what it would send is dropped.
    ``NEED_MORE`` while the ClientHello is incomplete; ``UNREADABLE`` when OpenSSL refuses the bytes before
    the server name (not TLS, an old version, a malformed hello) and for a server name that is not ASCII:
    the real handshake then fails the same way. Never raises, and writes nothing to stderr."""
    guard_server_names()
    incoming = ssl.MemoryBIO()
    obj = _PROBE.wrap_bio(incoming, ssl.MemoryBIO(), server_side=True)
    incoming.write(data)
    _probing.active, _probing.refused = True, False
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        return NEED_MORE
    except ssl.SSLError:
        pass
    finally:
        _probing.active = False
    if _probing.refused:
        return UNREADABLE
    if obj in _probe_names:
        return HelloName(_probe_names.pop(obj))
    return UNREADABLE


__all__ = ["ALPN", "LOAD_ERRORS", "NEED_MORE", "UNREADABLE", "CertPair", "FrontTls", "HelloName",
           "guard_server_names", "hello_server_name", "refused_server_names"]
