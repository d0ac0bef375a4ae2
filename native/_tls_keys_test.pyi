"""``native._tls_keys_test`` (TESTS ONLY), built by native/build_tls_keys_test.py from native/tls_keys.h
and native/tls_keys_test.h: the product's functions and the test entry points."""

from native._cffi_types import FFI, CData
from native._tls_keys import Lib as _KeysLib

class Lib(_KeysLib):
    def tk_export_for_test(
        self, ssl: CData, expect_tx: int, expect_rx: int, tx_out: CData, rx_out: CData, out_len: int, /
    ) -> int: ...
    def tk_set_ciphersuites(self, ctx: CData, suites: bytes, /) -> int: ...
    def tk_key_update(self, ssl: CData, request_peer: int, /) -> int: ...

ffi: FFI
lib: Lib
