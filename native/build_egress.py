"""cffi build of the egress packet core (``native._egress``); wrapped by ``forwarder.egress.fastpath``."""

from cffi import FFI

from native._cdef import header_cdef, rel

CDEF = header_cdef("egress_core.h")

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "native._egress",
    '#include "egress_core.h"',
    sources=[rel("egress_core.c")],
    include_dirs=[rel(".")],
    depends=[rel("egress_core.h")],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
