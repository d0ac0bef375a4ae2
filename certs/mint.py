"""Minting certificates with the cryptography library. No I/O except ``write_issued``.

Keys are ECDSA P-256. Validity is explicit so tests can mint expired and not-yet-valid certificates.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _validity(not_before: dt.datetime | None, days: float) -> tuple[dt.datetime, dt.datetime]:
    start = not_before or (_now() - dt.timedelta(minutes=5))
    return start, start + dt.timedelta(days=days)


def mint_ca(common_name: str = "sbxnet dev CA", *, days: float = 3650, not_before: dt.datetime | None = None) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start, end = _validity(not_before, days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(key, cert)


def mint_leaf(
    ca: Issued,
    common_name: str,
    *,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    uris: tuple[str, ...] = (),
    server: bool = True,
    client: bool = False,
    days: float = 365,
    not_before: dt.datetime | None = None,
) -> Issued:
    """A leaf certificate signed by ``ca`` with the given SANs and extended key usages."""
    if not (dns or ips or uris):
        raise ValueError("a leaf certificate needs at least one SAN (DNS, IP or URI)")
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    sans += [x509.UniformResourceIdentifier(u) for u in uris]
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    start, end = _validity(not_before, days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(key, cert)


def reissue(
    ca: Issued,
    template: x509.Certificate,
    key: ec.EllipticCurvePrivateKey | None = None,
    *,
    days: float = 365,
    not_before: dt.datetime | None = None,
) -> Issued:
    """A certificate like ``template`` (its subject and every extension: SANs, usages, constraints) for
    ``key`` (None: a fresh key), signed by ``ca`` with a fresh serial and validity. With the key it had,
    this is a renewal that keeps its SPKI pin; with a fresh one, its next key (a new pin)."""
    if key is None:
        key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(not_before, days)
    builder = (
        x509.CertificateBuilder()
        .subject_name(template.subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )
    for ext in template.extensions:
        if isinstance(ext.value, x509.AuthorityKeyIdentifier | x509.SubjectKeyIdentifier):
            continue  # both name keys: made afresh below for this key and this CA
        builder = builder.add_extension(ext.value, ext.critical)
    builder = builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    if any(isinstance(ext.value, x509.SubjectKeyIdentifier) for ext in template.extensions):
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    return Issued(key, builder.sign(ca.key, hashes.SHA256()))


def spki_pin(cert: x509.Certificate) -> str:
    """Base64 SHA-256 of the DER SubjectPublicKeyInfo (the form Envoy and HPKP use)."""
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_issued(issued: Issued, directory: Path, stem: str) -> tuple[Path, Path]:
    """Write ``<stem>.crt`` (0644) and ``<stem>.key`` (0600, never briefly wider); return both paths."""
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    _atomic_write(key_path, issued.key_pem, 0o600)
    _atomic_write(cert_path, issued.cert_pem, 0o644)
    return cert_path, key_path


def write_cert(cert: x509.Certificate, directory: Path, stem: str) -> Path:
    """Write ``<stem>.crt`` (0644) alone, its key file untouched (a renewal keeping the key)."""
    path = directory / f"{stem}.crt"
    _atomic_write(path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return path


def load_issued(directory: Path, stem: str) -> Issued:
    cert = x509.load_pem_x509_certificate((directory / f"{stem}.crt").read_bytes())
    key = serialization.load_pem_private_key((directory / f"{stem}.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / stem}.key is not an EC key")
    return Issued(key, cert)
