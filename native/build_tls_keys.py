"""cffi build for ``native._tls_keys``: TLS 1.3 keys from OpenSSL into kernel TLS (native/tls_keys.c),
bound from its header.

Links the system libssl/libcrypto: the same libraries Python's own ``_ssl`` module uses, so the
SSL_CTX and SSL objects behind ``ssl.SSLContext`` / ``ssl.SSLObject`` are ours to call into.
"""

from cffi import FFI

from native._cdef import header_cdef, rel

# The two OpenSSL types the header takes from <openssl/ssl.h>, opaque to Python.
OPENSSL_TYPES = """
typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;
"""

ffibuilder = FFI()
ffibuilder.cdef(OPENSSL_TYPES + header_cdef("tls_keys.h"))
ffibuilder.set_source(
    "native._tls_keys",
    '#include "tls_keys.h"',
    sources=[rel("tls_keys.c")],
    include_dirs=[rel(".")],
    depends=[rel("tls_keys.h"), rel("tls_keys_internal.h")],
    libraries=["ssl", "crypto"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
