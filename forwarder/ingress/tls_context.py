"""TLS for the gateway link: the server context and the naming of handshake failures.

The link is TLS 1.3 only, mutual, with no session tickets (the record sequence numbers must start at
zero when the kernel takes over, and resumption would add nothing on a long-lived hop).
"""

from __future__ import annotations

import ssl

from forwarder.ingress.settings import ForwarderSettings
from sbxnet.errors import SbxnetError


def server_context(settings: ForwarderSettings) -> ssl.SSLContext:
    """A fresh server context from the files named in ``settings``; raises on unreadable material."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(settings.ca_file))
    ctx.load_cert_chain(certfile=str(settings.cert_file), keyfile=str(settings.key_file))
    ctx.num_tickets = 0
    ctx.options |= ssl.OP_NO_TICKET
    if settings.data_plane == "ktls":
        from forwarder.ingress.planes.ktls_keys import prepare_context

        prepare_context(ctx)  # AES-GCM suites only; secrets captured in memory for the kernel
    return ctx


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
