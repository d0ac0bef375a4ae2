"""cffi build for ``native._splice``: the splice pump (native/splice_pump.c), bound from its header."""

from cffi import FFI

from native._cdef import header_cdef, rel

ffibuilder = FFI()
ffibuilder.cdef(header_cdef("splice_pump.h"))
ffibuilder.set_source(
    "native._splice",
    '#include "splice_pump.h"',
    sources=[rel("splice_pump.c")],
    include_dirs=[rel(".")],
    depends=[rel("splice_pump.h")],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
