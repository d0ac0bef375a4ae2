"""Key capture, HKDF-Expand-Label and record accounting, checked without kernel TLS.

The keys the C module would hand the kernel are exported (a test-only entry point, in the test build
``native._tls_keys_test`` only) and used with an independent AES-GCM implementation to decrypt what
OpenSSL sends next and to seal records OpenSSL must accept: that proves secret capture, key derivation
and the sequence numbers on any kernel. Every test here runs ``ktls_keys`` over that build, the
product's C compiled with the test entry points (see ``ktls_test_hooks``).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import socket
import ssl
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ktls_test_hooks import export_keys_for_test, key_update_for_test, set_ciphersuites_for_test, use_test_build
from tls_support import CryptoInfo, MemPair, handshake

from forwarder.ingress.planes import ktls_keys as ktls

Ctx = Callable[[], ssl.SSLContext]


@pytest.fixture(autouse=True)
def _test_build(monkeypatch: pytest.MonkeyPatch) -> None:
    use_test_build(monkeypatch)


def ref_expand_label(sha384: bool, secret: bytes, label: str, length: int) -> bytes:
    """RFC 8446 7.1 / RFC 5869, straight from the text."""
    h = hashlib.sha384 if sha384 else hashlib.sha256
    full = b"tls13 " + label.encode()
    info = struct.pack(">H", length) + bytes([len(full)]) + full + b"\x00"
    okm, t, i = b"", b"", 1
    while len(okm) < length:
        t = hmac.new(secret, t + info + bytes([i]), h).digest()
        okm += t
        i += 1
    return okm[:length]


def test_expand_label_rfc8448_vector() -> None:
    # RFC 8448 section 3, server handshake traffic keys.
    secret = bytes.fromhex("b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38")
    assert ktls.expand_label(False, secret, "key", 16) == bytes.fromhex("3fce516009c21727d0f2e4e86ee403bc")
    assert ktls.expand_label(False, secret, "iv", 12) == bytes.fromhex("5d313eb2671276ee13000b30")


@settings(max_examples=200, deadline=None)
@given(
    sha384=st.booleans(),
    secret=st.binary(min_size=1, max_size=48),
    label=st.text(alphabet="abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=40),
    length=st.integers(min_value=1, max_value=32),
)
def test_expand_label_matches_reference(sha384: bool, secret: bytes, label: str, length: int) -> None:
    assert ktls.expand_label(sha384, secret, label, length) == ref_expand_label(sha384, secret, label, length)


def test_expand_label_refuses_longer_than_one_block() -> None:
    with pytest.raises(ktls.KtlsError):
        ktls.expand_label(False, b"k" * 32, "key", 33)


def prepared_pair(server_ctx: Ctx, client_ctx: Ctx, client_suites: str | None = None) -> MemPair:
    sctx = server_ctx()
    ktls.prepare_context(sctx)
    cctx = client_ctx()
    if client_suites:
        set_ciphersuites_for_test(cctx, client_suites)
    return handshake(sctx, cctx)


def preamble_and_status(p: MemPair, preamble_records: int) -> None:
    for i in range(preamble_records):
        p.cli.write(b"P%d" % i * 10)
        p.to_server()
        assert p.srv.read(16384) == b"P%d" % i * 10
    p.srv.write(b"\x00status")
    p.to_client()
    assert p.cli.read(100) == b"\x00status"


@pytest.mark.parametrize(
    "suite,cipher_type",
    [("TLS_AES_256_GCM_SHA384", 52), ("TLS_AES_128_GCM_SHA256", 51)],
)
@pytest.mark.parametrize("preamble_records", [0, 1, 3])
def test_exported_keys_continue_the_session(
    server_ctx: Ctx, client_ctx: Ctx, suite: str, cipher_type: int, preamble_records: int
) -> None:
    p = prepared_pair(server_ctx, client_ctx, suite)
    preamble_and_status(p, preamble_records)
    info = ktls.session_info(p.srv)
    assert (info.suite, info.is_server) == (suite, True)
    assert (info.rx_records, info.tx_records) == (preamble_records, 1)
    raw_tx, raw_rx = export_keys_for_test(p.srv, expect_tx=1, expect_rx=preamble_records)
    tx, rx = CryptoInfo.parse(raw_tx), CryptoInfo.parse(raw_rx)
    assert (tx.version, tx.cipher_type, tx.rec_seq) == (0x0304, cipher_type, 1)
    assert (rx.version, rx.cipher_type, rx.rec_seq) == (0x0304, cipher_type, preamble_records)
    # What the gateway's OpenSSL sends next decrypts with the RX key at the RX sequence number...
    for k in range(3):
        p.cli.write(b"tenant %d" % k)
        assert rx.open(rx.rec_seq + k, p.c_out.read()) == (23, b"tenant %d" % k)
    # ...and records sealed with the TX key at the TX sequence number are accepted by the gateway.
    for k in range(3):
        p.c_in.write(tx.seal(tx.rec_seq + k, b"answer %d" % k))
        assert p.cli.read(100) == b"answer %d" % k
    # A close_notify alert record from the kernel side ends the gateway's stream.
    p.c_in.write(tx.seal(tx.rec_seq + 3, b"\x01\x00", content_type=21))
    assert p.cli.read(100) == b""
    # The secrets are gone: nothing can be exported or installed twice.
    assert ktls.session_info(p.srv).installed
    with pytest.raises(ktls.KtlsError) as e:
        export_keys_for_test(p.srv)
    assert e.value.reason == "bad_state"


def test_preamble_and_tenant_bytes_in_one_record(server_ctx: Ctx, client_ctx: Ctx) -> None:
    p = prepared_pair(server_ctx, client_ctx)
    p.cli.write(b"PREAMBLE|tenant-bytes")
    p.to_server()
    assert p.srv.read(16384) == b"PREAMBLE|tenant-bytes"
    p.srv.write(b"\x00")
    _tx, rx = map(CryptoInfo.parse, export_keys_for_test(p.srv, expect_tx=1, expect_rx=1))
    p.cli.write(b"more")
    assert rx.open(1, p.c_out.read()) == (23, b"more")


def test_refuses_bytes_left_in_openssl(server_ctx: Ctx, client_ctx: Ctx) -> None:
    p = prepared_pair(server_ctx, client_ctx)
    p.cli.write(b"x" * 100)
    p.to_server()
    assert p.srv.read(10) == b"x" * 10  # 90 bytes stay decrypted inside OpenSSL
    with pytest.raises(ktls.KtlsError) as e:
        export_keys_for_test(p.srv)
    assert e.value.reason == "buffered_in_openssl"


def test_refuses_unread_bytes_in_the_bio(server_ctx: Ctx, client_ctx: Ctx) -> None:
    p = prepared_pair(server_ctx, client_ctx)
    p.cli.write(b"one")
    p.cli.write(b"two")
    p.to_server()
    assert p.srv.read(16384) == b"one"  # the second record is still in the memory BIO
    with pytest.raises(ktls.KtlsError) as e:
        ktls.install(p.srv, p.s_in, -1)
    assert e.value.reason == "buffered_in_openssl"


def test_refuses_a_record_count_that_disagrees(server_ctx: Ctx, client_ctx: Ctx) -> None:
    p = prepared_pair(server_ctx, client_ctx)
    preamble_and_status(p, 2)
    with pytest.raises(ktls.KtlsError) as e:
        export_keys_for_test(p.srv, expect_tx=1, expect_rx=1)
    assert e.value.reason == "record_count_mismatch"


def test_refuses_after_a_key_update(server_ctx: Ctx, client_ctx: Ctx) -> None:
    p = prepared_pair(server_ctx, client_ctx)
    key_update_for_test(p.cli)
    p.cli.do_handshake()  # sends the KeyUpdate
    p.to_server()
    with pytest.raises(ssl.SSLWantReadError):
        p.srv.read(100)
    assert ktls.session_info(p.srv).rx_other == 1
    with pytest.raises(ktls.KtlsError) as e:
        export_keys_for_test(p.srv)
    assert e.value.reason == "record_count_mismatch"


def test_unprepared_context_refused(server_ctx: Ctx, client_ctx: Ctx) -> None:
    p = handshake(server_ctx(), client_ctx())
    with pytest.raises(ktls.KtlsError) as e:
        export_keys_for_test(p.srv)
    assert e.value.reason == "not_prepared"


def test_prepared_context_offers_aes_gcm_only(server_ctx: Ctx, client_ctx: Ctx) -> None:
    sctx = server_ctx()
    ktls.prepare_context(sctx)
    cctx = client_ctx()
    set_ciphersuites_for_test(cctx, "TLS_CHACHA20_POLY1305_SHA256")
    with pytest.raises(ssl.SSLError):
        handshake(sctx, cctx)


def test_context_with_key_log_file_refused(server_ctx: Ctx, tmp_path: object) -> None:
    sctx = server_ctx()
    sctx.keylog_filename = str(tmp_path) + "/keys.log"
    with pytest.raises(ktls.KtlsError) as e:
        ktls.prepare_context(sctx)
    assert e.value.reason == "foreign_keylog_callback"


def test_pointer_checks_refuse_foreign_objects(server_ctx: Ctx, client_ctx: Ctx) -> None:
    with pytest.raises(ktls.KtlsError):
        ktls.session_info(object())  # type: ignore[arg-type]
    p = prepared_pair(server_ctx, client_ctx)
    # The layout check ties PySSLSocket.ctx to the context object Python reports.
    assert ktls.session_info(p.srv).is_server and not ktls.session_info(p.cli).is_server


def test_no_secret_reaches_python_or_disk(server_ctx: Ctx, client_ctx: Ctx) -> None:
    sctx = server_ctx()
    ktls.prepare_context(sctx)
    assert sctx.keylog_filename is None
    p = handshake(sctx, client_ctx())
    assert not [a for a in vars(p.srv) if "secret" in a.lower()]


@pytest.mark.skipif(ktls.probe().ok, reason="this kernel has TLS: the refusal path cannot be shown here")
def test_install_without_kernel_tls_fails_and_wipes(server_ctx: Ctx, client_ctx: Ctx) -> None:
    p = prepared_pair(server_ctx, client_ctx)
    preamble_and_status(p, 1)
    a, b = _tcp_pair()
    with a, b, pytest.raises(ktls.KtlsError) as e:
        ktls.install(p.srv, p.s_in, a.fileno(), expect_tx=1, expect_rx=1)
    assert e.value.reason == "ulp_attach_failed"
    assert e.value.detail == os.strerror(errno.ENOENT)
    assert ktls.session_info(p.srv).installed  # wiped


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        c = socket.create_connection(lst.getsockname())
        s, _ = lst.accept()
    return c, s
