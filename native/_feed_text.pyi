"""``native._feed_text``, built by native/build_feed_text.py from native/feed_text.h (the contract of each
function is there); used by sbxnet/protocol/feed.py."""

from native._cffi_types import FFI, CData

class Lib:
    FT_BAD_VALUE: int
    FT_NO_ROOM: int
    FT_DIGITS: int
    def ft_int_array(self, v: CData, n: int, high: int, out: CData, room: int, /) -> int: ...
    def ft_ages_ms(self, now: float, last: CData, n: int, high_ms: int, ms: CData, /) -> int: ...

ffi: FFI
lib: Lib
