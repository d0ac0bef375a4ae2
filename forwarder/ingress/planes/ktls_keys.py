"""Kernel TLS on the gateway link: the start-up probe, and handing a TLS 1.3 session's keys to the kernel.

Linux-specific operations only; the decisions around them (fail closed, when to install) live in the
server and in ``ktls_plane``. The traffic secrets are captured and turned into kernel keys inside
``native/tls_keys.c``: they never become Python objects, are never logged and never touch a file.

Reaching OpenSSL's objects: Python's ``ssl`` module does not expose the ``SSL_CTX *`` behind an
``SSLContext`` or the ``SSL *`` behind an ``SSLObject``. CPython (3.11-3.13) lays both out as a plain
object header followed by the pointer (``PySSLContext.ctx``; ``PySSLSocket.Socket, .ssl, .ctx``). We
read those words at the object's address and accept them only after checks against things Python
tells us independently: ``PySSLSocket.ctx`` must be the address of the very ``SSLContext`` object that
``.context`` returns, the ``SSL_CTX``'s options must equal ``SSLContext.options``, and
``SSL_get_SSL_CTX(ssl)`` must be that ``SSL_CTX``. On any other interpreter, or if a check fails, we
refuse (``KtlsError("layout")``) rather than guess.
"""

from __future__ import annotations

import errno
import os
import platform
import socket
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sbxnet.errors import SbxnetError

if TYPE_CHECKING:
    from native._cffi_types import FFI
    from native._tls_keys import Lib

SOL_TLS = 282
TLS_TX = 1
TLS_RX = 2
TCP_ULP = 31
AVAILABLE_ULP = Path("/proc/sys/net/ipv4/tcp_available_ulp")
TLS_STAT = Path("/proc/net/tls_stat")

SUITES = {0x1301: "TLS_AES_128_GCM_SHA256", 0x1302: "TLS_AES_256_GCM_SHA384"}

# The TK_E_* codes of native/tls_keys.h, named for metrics (tests/native/test_header_mirrors.py checks them).
_TK_ERRORS = {
    -1: "bad_argument",
    -2: "openssl_error",
    -3: "not_prepared",
    -4: "bad_state",
    -5: "cipher_not_offloadable",
    -6: "buffered_in_openssl",
    -7: "record_count_mismatch",
    -8: "ulp_attach_failed",
    -9: "tls_tx_failed",
    -10: "tls_rx_failed",
    -11: "foreign_keylog_callback",
}


class KtlsError(SbxnetError):
    """Kernel TLS could not be set up for this context or connection; ``reason`` says why."""


# -- the probe --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    cause: str  # "ok", "module_not_loaded", "not_built", "attach_failed"
    detail: str

    def message(self) -> str:
        """The one start-up line for a failed probe: the cause and both ways out."""
        if self.ok:
            return "kernel TLS available"
        what = {
            "module_not_loaded": "the kernel's `tls` module is not loaded",
            "not_built": "the running kernel was built without CONFIG_TLS (no `tls` module exists)",
            "attach_failed": "the TLS ULP is listed but could not be attached to a TCP socket",
        }[self.cause]
        fix = (
            "boot a kernel built with CONFIG_TLS and load the module (`modprobe tls`)"
            if self.cause == "not_built"
            else "load the module with `modprobe tls`"
        )
        return (
            f"forwarder: data_plane = \"ktls\" but {what} ({self.detail}). Either {fix}, or choose the "
            "userspace plane explicitly (data_plane = \"userspace\", SBXNET_FORWARDER_DATA_PLANE=userspace). "
            "Refusing to start: the forwarder never falls back by itself."
        )


def _module_exists(release: str) -> bool:
    base = Path("/lib/modules") / release
    for listing in ("modules.dep", "modules.builtin"):
        try:
            if "net/tls/tls.ko" in (base / listing).read_text():
                return True
        except OSError:
            continue
    return False


def _attach_on_loopback() -> int:
    """0 if the "tls" ULP attaches to an established loopback TCP socket, else the errno."""
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        with socket.create_connection(lst.getsockname(), timeout=2) as c:
            s, _ = lst.accept()
            with s:
                try:
                    c.setsockopt(socket.SOL_TCP, TCP_ULP, b"tls")
                except OSError as e:
                    return e.errno or errno.EIO
    return 0


def probe() -> ProbeResult:
    """Can this kernel carry kernel TLS? Lists the ULP and actually attaches it on a loopback pair."""
    try:
        listed = "tls" in AVAILABLE_ULP.read_text().split()
    except OSError:
        listed = False
    err = _attach_on_loopback()
    if err == 0:
        return ProbeResult(True, "ok", "tls ULP attached")
    detail = f"{AVAILABLE_ULP} lists {'tls' if listed else 'no tls'}; attach: {os.strerror(err)}"
    if listed:
        return ProbeResult(False, "attach_failed", detail)
    cause = "module_not_loaded" if _module_exists(platform.release()) else "not_built"
    return ProbeResult(False, cause, detail)


# -- OpenSSL objects --------------------------------------------------------------------------------


def _lib() -> tuple[FFI, Lib]:
    """The binding. Tests that read keys back swap in ``native._tls_keys_test`` (the same C with the
    test entry points), which only they load: see tests/ingress/planes/ktls_test_hooks.py."""
    from native._tls_keys import ffi, lib

    return ffi, lib


def _check_interpreter() -> None:
    import _ssl

    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13):
        raise KtlsError("layout", f"unsupported interpreter {sys.implementation.name} {sys.version}")
    if _ssl._SSLContext.__basicsize__ < 24 or _ssl._SSLSocket.__basicsize__ < 40:  # type: ignore[attr-defined]
        raise KtlsError("layout", "unexpected _ssl object sizes")


def _ctx_ptr(ctx: ssl.SSLContext) -> Any:
    ffi, lib = _lib()
    _check_interpreter()
    import _ssl

    if not isinstance(ctx, _ssl._SSLContext):
        raise KtlsError("layout", "not an ssl.SSLContext")
    p = ffi.cast("SSL_CTX *", ffi.cast("uintptr_t *", id(ctx))[2])
    if p == ffi.NULL or int(lib.tk_ctx_options(p)) != int(ctx.options):
        raise KtlsError("layout", "SSL_CTX pointer check failed")
    return p


def _ssl_ptr(obj: ssl.SSLObject) -> Any:
    ffi, lib = _lib()
    _check_interpreter()
    import _ssl

    inner: Any = getattr(obj, "_sslobj", None)
    if type(inner) is not _ssl._SSLSocket:  # type: ignore[attr-defined]
        raise KtlsError("layout", "not an ssl.SSLObject")
    ctx = inner.context
    words = ffi.cast("uintptr_t *", id(inner))
    if int(words[4]) != id(ctx):
        raise KtlsError("layout", "SSL object layout check failed")
    p = ffi.cast("SSL *", words[3])
    if p == ffi.NULL or lib.tk_ssl_ctx(p) != _ctx_ptr(ctx):
        raise KtlsError("layout", "SSL pointer check failed")
    return p


def prepare_context(ctx: ssl.SSLContext) -> None:
    """Make ``ctx`` ready for kernel TLS: AES-GCM suites only, no tickets, our in-memory secret capture.

    Must run before the context's first handshake (and again on every reloaded context). Refuses a
    context that logs keys anywhere else (``keylog_filename``).
    """
    if ctx.keylog_filename:
        raise KtlsError("foreign_keylog_callback", "the context writes a key log file")
    if ctx.minimum_version != ssl.TLSVersion.TLSv1_3:
        raise KtlsError("bad_state", "kernel TLS on this link needs a TLS 1.3-only context")
    _, lib = _lib()
    rc = int(lib.tk_prepare_ctx(_ctx_ptr(ctx)))
    if rc:
        raise KtlsError(_TK_ERRORS.get(rc, "openssl_error"), "preparing the SSL context")


@dataclass(frozen=True)
class SessionInfo:
    suite: str
    is_server: bool
    tx_records: int
    rx_records: int
    tx_other: int
    rx_other: int
    pending: int
    installed: bool


def session_info(obj: ssl.SSLObject) -> SessionInfo:
    ffi, lib = _lib()
    i = ffi.new("struct tk_info *")
    lib.tk_info(_ssl_ptr(obj), i)
    return SessionInfo(
        SUITES.get(int(i.suite), hex(int(i.suite))), bool(i.is_server), int(i.tx_records),
        int(i.rx_records), int(i.tx_other), int(i.rx_other), int(i.pending) + int(i.has_pending),
        bool(i.installed),
    )


@dataclass(frozen=True)
class Installed:
    suite: str
    tx_seq: int  # the first record sequence number the kernel uses, each direction
    rx_seq: int


def install(
    obj: ssl.SSLObject,
    incoming: ssl.MemoryBIO,
    fd: int,
    *,
    expect_tx: int | None = None,
    expect_rx: int | None = None,
) -> Installed:
    """Install the session's application keys on ``fd`` (TLS_TX and TLS_RX); then ``obj`` is dead.

    Preconditions, each refused with a reason: a prepared context saw the handshake; TLS 1.3 with
    AES-GCM; nothing left in OpenSSL or in ``incoming``; no non-data record after the handshake; the
    record counts equal ``expect_tx`` / ``expect_rx`` when given. The secrets are wiped whatever the
    result; after a failure the connection must be closed. The caller must never use ``obj`` again.
    """
    if incoming.pending:
        raise KtlsError("buffered_in_openssl", f"{incoming.pending} unread bytes in the memory BIO")
    ffi, lib = _lib()
    p = _ssl_ptr(obj)
    info = session_info(obj)
    err = ffi.new("int *")
    rc = int(lib.tk_install(p, fd, -1 if expect_tx is None else expect_tx, -1 if expect_rx is None else expect_rx, err))
    if rc:
        detail = os.strerror(err[0]) if err[0] else ""
        raise KtlsError(_TK_ERRORS.get(rc, "openssl_error"), detail)
    return Installed(info.suite, info.tx_records, info.rx_records)


def attach_ulp(sock: socket.socket) -> None:
    """Attach the "tls" ULP now, while the socket is surely ESTABLISHED (call right after accept).

    With no keys set the socket behaves as plain TCP, so the handshake in user space is unaffected;
    ``install`` later only sets TLS_TX/TLS_RX, which the kernel accepts even after the peer's FIN.
    """
    ffi, lib = _lib()
    err = ffi.new("int *")
    if int(lib.tk_attach_ulp(sock.fileno(), err)):
        raise KtlsError("ulp_attach_failed", os.strerror(err[0]))


def installed_directions(fd: int) -> tuple[bool, bool]:
    """(TLS_TX, TLS_RX) installed on ``fd``, read back from the kernel (header only, never the key)."""
    out = []
    for opt in (TLS_TX, TLS_RX):
        s = socket.socket(fileno=os.dup(fd))
        try:
            hdr = s.getsockopt(SOL_TLS, opt, 4)
            out.append(int.from_bytes(hdr[:2], "little") != 0)
        except OSError:
            out.append(False)
        finally:
            s.close()
    return out[0], out[1]


def tls_stat() -> dict[str, int]:
    """/proc/net/tls_stat as a dict (empty where the kernel has no TLS)."""
    try:
        text = TLS_STAT.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


# -- test helpers (never used by the product) -------------------------------------------------------


def expand_label(sha384: bool, secret: bytes, label: str, length: int) -> bytes:
    """HKDF-Expand-Label with an empty context, by the C code (compared against a Python reference)."""
    ffi, lib = _lib()
    out = ffi.new("unsigned char[]", length)
    if lib.tk_expand_label(1 if sha384 else 0, secret, len(secret), label.encode(), out, length):
        raise KtlsError("bad_argument", "expand_label")
    return bytes(ffi.buffer(out, length))
