"""The gateway's client-facing TLS: several certificates chosen by SNI, ALPN, and reload.

TLS 1.2 and 1.3 (public clients), no client certificate asked by default. One ``ssl.SSLContext`` per
configured certificate; the listening context's SNI callback moves each connection onto the one
``cert_select.choose`` picks. ALPN offers ``h2`` and ``http/1.1``; a client offering neither (a raw TCP
route's ``openssl s_client``, or an ``ssh`` ALPN) completes the handshake with no protocol selected,
which is how raw TCP routes are told apart from HTTP ones after the handshake.

``reload()`` loads every certificate again and swaps the whole set only if all of them load
(``certs.loader.Reloadable``): a bad file keeps the old set serving.
"""

from __future__ import annotations

import ssl
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from certs.loader import LOAD_ERRORS, Reloadable
from gateway.cert_select import choose

ALPN = ("h2", "http/1.1")


@dataclass(frozen=True)
class CertPair:
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class _Loaded:
    names: tuple[tuple[str, ...], ...]  # DNS SANs of each certificate, in configured order
    contexts: tuple[ssl.SSLContext, ...]


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


def _context(pair: CertPair, alpn: Sequence[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=str(pair.cert_file), keyfile=str(pair.key_file))
    ctx.set_alpn_protocols(list(alpn))
    return ctx


def _load(pairs: Sequence[CertPair], alpn: Sequence[str]) -> _Loaded:
    if not pairs:
        raise ValueError("the gateway needs at least one certificate")
    return _Loaded(tuple(_dns_sans(p.cert_file) for p in pairs), tuple(_context(p, alpn) for p in pairs))


class FrontTls:
    """The listening context (``context``) and the certificate set behind it."""

    def __init__(self, pairs: Sequence[CertPair], *, alpn: Sequence[str] = ALPN) -> None:
        self._pairs = tuple(pairs)
        self.alpn = tuple(alpn)
        self._set = Reloadable(lambda: _load(self._pairs, self.alpn))
        # The SNI each connection sent, by its SSL object: routing needs it after the handshake.
        self._server_names: weakref.WeakKeyDictionary[object, str | None] = weakref.WeakKeyDictionary()
        # The context the listener wraps with: the default certificate, and the SNI switch. It is never
        # replaced, so a reload needs no new listener; the callback reads the current set each time.
        self.context = _context(self._pairs[0], self.alpn)
        self.context.sni_callback = self._on_sni

    @property
    def names(self) -> tuple[tuple[str, ...], ...]:
        return self._set.current.names

    def _on_sni(self, obj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        loaded = self._set.current
        self._server_names[obj] = server_name
        obj.context = loaded.contexts[choose(server_name, loaded.names)]

    def server_name(self, obj: ssl.SSLObject | ssl.SSLSocket) -> str | None:
        """The server name (SNI) the client sent on the connection of ``obj``; None if it sent none."""
        return self._server_names.get(obj)

    def reload(self) -> BaseException | None:
        """Load every certificate again; on any failure keep the current set and return the error."""
        return self._set.reload()


__all__ = ["ALPN", "LOAD_ERRORS", "CertPair", "FrontTls"]
