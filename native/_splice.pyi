"""``native._splice``, built by native/build_splice.py from native/splice_pump.h (the contract of each
function is there); wrapped by forwarder/ingress/planes/splice_pump.py."""

from native._cffi_types import FFI, CData

class Lib:
    SP_GW_KTLS: int
    SP_KTLS_MIN_PIPE: int
    SP_OUT_CLOSED: int
    SP_OUT_RESET_GATEWAY: int
    SP_OUT_RESET_SANDBOX: int
    SP_OUT_CLOSE_TIMEOUT: int
    SP_OUT_TLS_ERROR: int
    SP_OUT_ABORTED: int
    SP_OUT_INTERNAL: int
    SP_R_NONE: int
    SP_R_EOF: int
    SP_R_RESET: int
    SP_R_TIMEOUT: int
    SP_R_TLS_DECRYPT: int
    SP_R_TLS_KEY_UPDATE: int
    SP_R_TLS_ALERT: int
    SP_R_TLS_UNEXPECTED: int
    SP_R_TLS_RECORD: int
    SP_R_ABORT: int
    SP_R_ABORT_RESET: int
    SP_R_INTERNAL: int
    SP_EV_GW_CLOSE_NOTIFY: int
    SP_EV_GW_FIN: int
    SP_EV_SB_EOF: int
    SP_EV_SENT_CLOSE_NOTIFY: int
    SP_DS_UP_IN_EOF: int
    SP_DS_UP_OUT_SHUT: int
    SP_DS_DOWN_IN_EOF: int
    SP_DS_DOWN_OUT_SHUT: int
    def sp_new(self, threads: int, max_conns: int, pipe_size: int, errbuf: CData, errlen: int, /) -> CData: ...
    def sp_event_fd(self, p: CData, /) -> int: ...
    def sp_add(self, p: CData, gw_fd: int, sb_fd: int, flags: int, close_timeout_ms: int, /) -> int: ...
    def sp_counters(self, p: CData, id: int, up: CData, down: CData, /) -> int: ...
    def sp_take_moved(self, p: CData, out: CData, max: int, cursor: CData, /) -> int: ...
    def sp_take_events(self, p: CData, out: CData, max: int, /) -> int: ...
    def sp_abort(self, p: CData, id: int, reset: int, /) -> int: ...
    def sp_get_stats(self, p: CData, out: CData, /) -> None: ...
    def sp_free(self, p: CData, /) -> None: ...
    def sp_detach(self, p: CData, id: int, out: CData, /) -> int: ...
    def sp_adopt(self, p: CData, d: CData, paused: int, /) -> int: ...
    def sp_resume(self, p: CData, id: int, /) -> int: ...

ffi: FFI
lib: Lib
