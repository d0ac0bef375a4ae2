"""``native._tls_keys``, built by native/build_tls_keys.py from native/tls_keys.h (the contract and the
error convention are there); wrapped by forwarder/ingress/planes/ktls_keys.py."""

from native._cffi_types import FFI, CData

class Lib:
    TK_E_ARG: int
    TK_E_OPENSSL: int
    TK_E_NOT_PREPARED: int
    TK_E_STATE: int
    TK_E_CIPHER: int
    TK_E_BUFFERED: int
    TK_E_RECORDS: int
    TK_E_ULP: int
    TK_E_TX: int
    TK_E_RX: int
    TK_E_FOREIGN_KEYLOG: int
    def tk_prepare_ctx(self, ctx: CData, /) -> int: ...
    def tk_ctx_options(self, ctx: CData, /) -> int: ...
    def tk_ssl_ctx(self, ssl: CData, /) -> CData: ...
    def tk_info(self, ssl: CData, out: CData, /) -> int: ...
    def tk_expand_label(
        self, sha384: int, secret: bytes | CData, secret_len: int, label: bytes, out: CData, out_len: int, /
    ) -> int: ...
    def tk_install(self, ssl: CData, fd: int, expect_tx: int, expect_rx: int, sys_errno: CData, /) -> int: ...
    def tk_attach_ulp(self, fd: int, sys_errno: CData, /) -> int: ...

ffi: FFI
lib: Lib
