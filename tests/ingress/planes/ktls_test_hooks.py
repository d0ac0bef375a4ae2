"""Test-only entry points into the key installer, over ``native._tls_keys_test``.

The product's ``native._tls_keys`` cannot hand key material to Python: the C that reads keys back
(``native/tls_keys_test.c``) is built only into the test extension, which links the same
``tls_keys.c``. Each extension captures secrets in its own callbacks and its own per-connection
slot, so a test that exports keys must run ``ktls_keys`` over the test build from ``prepare_context``
on: :func:`use_test_build`. Setting suites and sending a KeyUpdate touch no captured state and work
whichever build prepared the context.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

import pytest

from forwarder.ingress.planes import ktls_keys as ktls
from forwarder.ingress.planes.ktls_keys import KtlsError

if TYPE_CHECKING:
    from native._cffi_types import FFI
    from native._tls_keys_test import Lib


def binding() -> tuple[FFI, Lib]:
    """The test extension's (ffi, lib): the product's functions plus the test entry points."""
    from native._tls_keys_test import ffi, lib

    return ffi, lib


def use_test_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``ktls_keys`` over the test build until ``monkeypatch`` undoes it."""
    monkeypatch.setattr(ktls, "_lib", binding)


def _ours(p: Any, ctype: str) -> Any:
    """``p`` (from whichever build made it) as a pointer of the test build."""
    ffi, _ = binding()
    return ffi.cast(ctype, ffi.cast("uintptr_t", p))


def export_keys_for_test(obj: ssl.SSLObject, *, expect_tx: int = -1, expect_rx: int = -1) -> tuple[bytes, bytes]:
    """The two crypto_info structs tk_install would hand the kernel (holds key material); wipes the
    secrets as an install does. Needs :func:`use_test_build` since before ``prepare_context``."""
    if ktls._lib is not binding:
        raise AssertionError("export_keys_for_test needs use_binding() before prepare_context")
    ffi, lib = binding()
    tx = ffi.new("unsigned char[]", 64)
    rx = ffi.new("unsigned char[]", 64)
    rc = int(lib.tk_export_for_test(ktls._ssl_ptr(obj), expect_tx, expect_rx, tx, rx, 64))
    if rc < 0:
        raise KtlsError(ktls._TK_ERRORS.get(rc, "openssl_error"), "export")
    return bytes(ffi.buffer(tx, rc)), bytes(ffi.buffer(rx, rc))


def set_ciphersuites_for_test(ctx: ssl.SSLContext, suites: str) -> None:
    """Restrict a context's TLS 1.3 suites (Python's ssl cannot)."""
    _, lib = binding()
    if int(lib.tk_set_ciphersuites(_ours(ktls._ctx_ptr(ctx), "SSL_CTX *"), suites.encode())):
        raise KtlsError("openssl_error", "SSL_CTX_set_ciphersuites")


def key_update_for_test(obj: ssl.SSLObject, *, request_peer: bool = False) -> None:
    """(A gateway that sends KeyUpdate.) Queue a KeyUpdate; the next do_handshake sends it."""
    _, lib = binding()
    if int(lib.tk_key_update(_ours(ktls._ssl_ptr(obj), "SSL *"), 1 if request_peer else 0)):
        raise KtlsError("openssl_error", "SSL_key_update")
