"""cffi build for ``native._feed_text``: the idle feed's number columns as JSON text (native/feed_text.c),
bound from its header."""

from cffi import FFI

from native._cdef import header_cdef, rel

ffibuilder = FFI()
ffibuilder.cdef(header_cdef("feed_text.h"))
ffibuilder.set_source(
    "native._feed_text",
    '#include "feed_text.h"',
    sources=[rel("feed_text.c")],
    include_dirs=[rel(".")],
    depends=[rel("feed_text.h")],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
