"""cffi build for ``native._tls_keys``: TLS 1.3 keys from OpenSSL into kernel TLS (native/tls_keys.c).

Links the system libssl/libcrypto: the same libraries Python's own ``_ssl`` module uses, so the
SSL_CTX and SSL objects behind ``ssl.SSLContext`` / ``ssl.SSLObject`` are ours to call into.
"""


from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef(
    """
    typedef struct ssl_ctx_st SSL_CTX;
    typedef struct ssl_st SSL;
    struct tk_info {
        int version;
        int is_server;
        int init_finished;
        int suite;
        int pending;
        int has_pending;
        int have_client_secret;
        int have_server_secret;
        int installed;
        uint64_t tx_records;
        uint64_t rx_records;
        uint64_t tx_other;
        uint64_t rx_other;
        uint64_t hs_records;
    };
    int tk_prepare_ctx(SSL_CTX *ctx);
    int tk_ctx_prepared(SSL_CTX *ctx);
    uint64_t tk_ctx_options(SSL_CTX *ctx);
    SSL_CTX *tk_ssl_ctx(SSL *ssl);
    int tk_info(SSL *ssl, struct tk_info *out);
    int tk_expand_label(int sha384, const unsigned char *secret, size_t secret_len, const char *label,
                        unsigned char *out, size_t out_len);
    int tk_install(SSL *ssl, int fd, int64_t expect_tx, int64_t expect_rx, int *sys_errno);
    int tk_export_for_test(SSL *ssl, int64_t expect_tx, int64_t expect_rx, unsigned char *tx_out,
                           unsigned char *rx_out, int out_len);
    int tk_attach_ulp(int fd);
    int tk_set_ciphersuites(SSL_CTX *ctx, const char *suites);
    int tk_key_update(SSL *ssl, int request_peer);
    """
)
ffibuilder.set_source(
    "native._tls_keys",
    '#include "tls_keys.h"',
    sources=["native/tls_keys.c"],
    include_dirs=["native"],
    depends=["native/tls_keys.h"],
    libraries=["ssl", "crypto"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
