"""cffi build for ``native._tls_keys_test``: TESTS ONLY. The product's key installer (native/tls_keys.c)
compiled together with the entry points that read keys back (native/tls_keys_test.c), bound from both
headers. The product's ``native._tls_keys`` has none of them; tests that need them run
``forwarder.ingress.planes.ktls_keys`` over this build (tests/ingress/planes/ktls_test_hooks.py).
"""

from cffi import FFI

from native._cdef import header_cdef, rel
from native.build_tls_keys import OPENSSL_TYPES

ffibuilder = FFI()
ffibuilder.cdef(OPENSSL_TYPES + header_cdef("tls_keys.h") + header_cdef("tls_keys_test.h"))
ffibuilder.set_source(
    "native._tls_keys_test",
    '#include "tls_keys_test.h"',
    sources=[rel("tls_keys.c"), rel("tls_keys_test.c")],
    include_dirs=[rel(".")],
    depends=[rel("tls_keys.h"), rel("tls_keys_internal.h"), rel("tls_keys_test.h")],
    libraries=["ssl", "crypto"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
