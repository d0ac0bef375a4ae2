"""TLS for the gateway link on the forwarder: its server context and the naming of handshake failures.

The profile (TLS 1.3 only, mutual, no session tickets) is ``certs.loader``'s, shared with the gateway;
this module adds what only the forwarder needs: the kTLS plane's preparation, and countable tokens
for why a handshake failed.
"""

from __future__ import annotations

import ssl

from certs import loader
from forwarder.ingress.settings import ForwarderSettings
from sbxnet.errors import SbxnetError


def server_context(settings: ForwarderSettings) -> ssl.SSLContext:
    """A fresh server context from the files named in ``settings`` (``certs.loader``'s link profile);
    raises ``certs.loader.LOAD_ERRORS`` on unreadable material."""
    prepare = None
    if settings.data_plane == "ktls":
        from forwarder.ingress.planes.ktls_keys import prepare_context

        prepare = prepare_context  # AES-GCM suites only; secrets captured in memory for the kernel
    return loader.server_context(
        cert_file=settings.cert_file, key_file=settings.key_file, ca_file=settings.ca_file, prepare=prepare
    )


# X509_V_ERR_* codes from OpenSSL's x509_vfy.h that we name separately.
_VERIFY_REASONS = {
    9: "cert_not_yet_valid",
    10: "cert_expired",
    2: "unknown_ca",
    18: "unknown_ca",  # self-signed leaf
    19: "unknown_ca",  # self-signed in chain
    20: "unknown_ca",
    21: "unknown_ca",
    23: "cert_revoked",
    26: "cert_wrong_purpose",
}


def handshake_failure_reason(exc: BaseException) -> str:
    """A short, countable token for why a handshake failed (never contains peer-controlled text)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _VERIFY_REASONS.get(exc.verify_code, "cert_invalid")
    if isinstance(exc, ssl.SSLError):
        r = (exc.reason or "").upper()
        if "PEER_DID_NOT_RETURN_A_CERTIFICATE" in r:
            return "no_client_cert"
        if "UNSUPPORTED_PROTOCOL" in r or "WRONG_VERSION_NUMBER" in r or "VERSION_TOO_LOW" in r:
            return "protocol_version"
        if "HTTP_REQUEST" in r or "WRONG_VERSION" in r or "RECORD" in r or "PACKET_LENGTH" in r:
            return "not_tls"
        if "NO_SHARED_CIPHER" in r or "NO_SUITABLE" in r:
            return "no_shared_cipher"
        return "tls_error"
    if isinstance(exc, SbxnetError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, EOFError):
        return "eof"
    return "io_error"
