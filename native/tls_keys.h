/* TLS 1.3 application traffic keys from OpenSSL into kernel TLS; see tls_keys.c.
 *
 * native/build_tls_keys.py gives cffi this header (past the includes, comments dropped, with SSL and
 * SSL_CTX declared opaque) as its cdef: keep it to plain integer #defines, structs and prototypes. */
#ifndef SBXNET_TLS_KEYS_H
#define SBXNET_TLS_KEYS_H

#include <openssl/ssl.h>
#include <stddef.h>
#include <stdint.h>

/* One convention for every function below that can fail: a negative TK_E_* code on failure, 0 (or a
 * count, where one is documented) on success. Where a system call failed (TK_E_ULP, TK_E_TX, TK_E_RX),
 * its errno is written to *sys_errno; otherwise *sys_errno is 0. forwarder/ingress/planes/ktls_keys.py
 * names each code for metrics (_TK_ERRORS). */
#define TK_E_ARG -1
#define TK_E_OPENSSL -2
#define TK_E_NOT_PREPARED -3   /* our callbacks did not see this handshake */
#define TK_E_STATE -4          /* not TLS 1.3, handshake not finished, or already installed */
#define TK_E_CIPHER -5         /* not an AES-GCM suite */
#define TK_E_BUFFERED -6       /* OpenSSL still holds bytes the kernel would never see */
#define TK_E_RECORDS -7        /* record counts disagree, or a non-data record was exchanged */
#define TK_E_ULP -8            /* setsockopt(TCP_ULP, "tls") failed: see sys_errno */
#define TK_E_TX -9             /* setsockopt(SOL_TLS, TLS_TX) failed: see sys_errno */
#define TK_E_RX -10            /* setsockopt(SOL_TLS, TLS_RX) failed: see sys_errno */
#define TK_E_FOREIGN_KEYLOG -11 /* the context already has someone else's keylog callback */

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

/* Puts our keylog and message callbacks on ctx (AES-GCM suites only, no tickets, OpenSSL's own kTLS
 * off). Before the context's first handshake. 0 or a TK_E_*. */
int tk_prepare_ctx(SSL_CTX *ctx);
/* Accessors that cannot fail: SSL_CTX_get_options(ctx), SSL_get_SSL_CTX(ssl). */
uint64_t tk_ctx_options(SSL_CTX *ctx);
SSL_CTX *tk_ssl_ctx(SSL *ssl);
/* What this session looks like to the installer (never a secret). Always 0. */
int tk_info(SSL *ssl, struct tk_info *out);
/* TLS 1.3 HKDF-Expand-Label with an empty context, out_len at most the hash length. 0 or a TK_E_*. */
int tk_expand_label(int sha384, const unsigned char *secret, size_t secret_len, const char *label,
                    unsigned char *out, size_t out_len);
/* Installs both directions on fd, each record count checked against expect_* when >= 0; wipes the
 * secrets whatever the result (but TK_E_NOT_PREPARED, where there were none). 0 or a TK_E_*. */
int tk_install(SSL *ssl, int fd, int64_t expect_tx, int64_t expect_rx, int *sys_errno);
/* Attaches the "tls" ULP (no keys yet: the socket still behaves as TCP). 0 or TK_E_ULP. */
int tk_attach_ulp(int fd, int *sys_errno);

#endif
