"""TLS contexts for the gateway→forwarder link from certificate files, and a reload that keeps the old
certificates when the new ones fail.

Both ends of the link use these, so both speak the same profile: TLS 1.3 only, mutual (the server
requires a client certificate from the CA it is given), no session tickets (the forwarder's record
sequence numbers must start at zero when the kernel takes over, and resumption buys nothing on a
long-lived hop). The client identifies the forwarder by pinning its key (SPKI SHA-256, the form
``sbxnet certs pin`` prints), after checking the chain against the CA.

Loading raises what the ``ssl`` module raises (``OSError``, ``ssl.SSLError``, ``ValueError``); ``LOAD_ERRORS``
names them so callers catch exactly those.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Generic, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import serialization

LOAD_ERRORS = (OSError, ssl.SSLError, ValueError)

T = TypeVar("T")


def _tls13_only(ctx: ssl.SSLContext) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def server_context(
    *,
    cert_file: str | Path,
    key_file: str | Path,
    ca_file: str | Path,
    prepare: Callable[[ssl.SSLContext], None] | None = None,
) -> ssl.SSLContext:
    """A fresh server context: TLS 1.3 only, client certificate required and verified against
    ``ca_file``, no tickets. ``prepare`` runs last (the kTLS plane restricts suites and hooks key capture)."""
    ctx = _tls13_only(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(ca_file))
    ctx.load_cert_chain(certfile=str(cert_file), keyfile=str(key_file))
    ctx.num_tickets = 0
    ctx.options |= ssl.OP_NO_TICKET
    if prepare is not None:
        prepare(ctx)
    return ctx


def client_context(*, cert_file: str | Path, key_file: str | Path, ca_file: str | Path) -> ssl.SSLContext:
    """A fresh client context: TLS 1.3 only, presents ``cert_file``, verifies the server's chain
    against ``ca_file``. Host names are not checked: the forwarder is identified by its pinned key
    (``check_pin`` after the handshake), since one gateway reaches many hosts by address."""
    ctx = _tls13_only(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(ca_file))
    ctx.load_cert_chain(certfile=str(cert_file), keyfile=str(key_file))
    ctx.options |= ssl.OP_NO_TICKET
    return ctx


def spki_pin_of_der(cert_der: bytes) -> str:
    """Base64 SHA-256 of a DER certificate's SubjectPublicKeyInfo (as ``certs.mint.spki_pin``)."""
    cert = x509.load_der_x509_certificate(cert_der)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


class PinMismatch(ssl.SSLError):
    """The peer's key is not one of the pins: the handshake succeeded with the wrong host."""


def check_pin(tls: ssl.SSLObject | ssl.SSLSocket, pins: Collection[str]) -> str:
    """Raise ``PinMismatch`` unless the peer's certificate key is in ``pins``; returns the pin matched."""
    der = tls.getpeercert(binary_form=True)
    if not der:
        raise PinMismatch("no peer certificate to check against the pins")
    pin = spki_pin_of_der(der)
    if pin not in pins:
        raise PinMismatch(f"peer key {pin} is not pinned")
    return pin


class Reloadable(Generic[T]):
    """The current value made by ``load`` (a context, usually), swapped only when a reload succeeds.

    Holders of the old value keep it: a live connection keeps the context it was accepted with.
    """

    def __init__(self, load: Callable[[], T]) -> None:
        self._load = load
        self.current: T = load()

    def load(self) -> T:
        """A fresh value, not yet in use (raises what loading raises); ``use`` swaps it in."""
        return self._load()

    def use(self, fresh: T) -> None:
        self.current = fresh

    def reload(self) -> BaseException | None:
        """Load again; on success swap and return None, on a loading error keep the old value and
        return the error (the caller logs and counts it)."""
        try:
            fresh = self._load()
        except LOAD_ERRORS as e:
            return e
        self.current = fresh
        return None


def diagnose(error: BaseException, *, certs: Collection[str | Path] = (), keys: Collection[str | Path] = (),
             cas: Collection[str | Path] = ()) -> tuple[str, str]:
    """Which file made loading fail, and why, for a log line: ``ssl`` names no file (``[SSL] PEM lib``), so
    each one is read again. Certificates and CA bundles must hold PEM certificates, keys an unencrypted PEM
    private key; if all do, the key does not belong to its certificate (``certs``[i] with ``keys``[i])."""
    for path in (*certs, *keys, *cas):
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            return str(path), e.strerror or str(e)
        if path in keys:
            try:
                serialization.load_pem_private_key(data, password=None)
            except (ValueError, TypeError) as e:
                return str(path), f"not an unencrypted PEM private key ({e})"
        else:
            try:
                x509.load_pem_x509_certificates(data)
            except ValueError as e:
                return str(path), f"no PEM certificate in it ({e})"
    for cert, key in zip(certs, keys, strict=False):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile=str(cert), keyfile=str(key))
        except LOAD_ERRORS as e:
            return str(cert), f"cannot be used with its key {key} ({getattr(e, 'reason', None) or e})"
    for ca in cas:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(ca))
        except LOAD_ERRORS as e:
            return str(ca), f"cannot be used as a CA bundle ({getattr(e, 'reason', None) or e})"
    first = next(iter((*certs, *keys, *cas)), "")
    return str(first), str(error)
