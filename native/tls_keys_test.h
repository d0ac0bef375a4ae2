/* TESTS ONLY: entry points built into native._tls_keys_test (tls_keys.c + tls_keys_test.c), never into
 * the product's native._tls_keys. Same error convention as tls_keys.h.
 *
 * native/build_tls_keys_test.py gives cffi tls_keys.h and then this header (past the includes,
 * comments dropped) as its cdef: keep it to plain integer #defines, structs and prototypes. */
#ifndef SBXNET_TLS_KEYS_TEST_H
#define SBXNET_TLS_KEYS_TEST_H

#include "tls_keys.h"

/* The two crypto_info structs tk_install would hand the kernel, copied out (key material: tests only).
 * Wipes the secrets as tk_install does. Returns the size of each struct, or a TK_E_*. */
int tk_export_for_test(SSL *ssl, int64_t expect_tx, int64_t expect_rx, unsigned char *tx_out,
                       unsigned char *rx_out, int out_len);
/* SSL_CTX_set_ciphersuites (Python's ssl cannot restrict TLS 1.3 suites). 0 or TK_E_OPENSSL. */
int tk_set_ciphersuites(SSL_CTX *ctx, const char *suites);
/* Queues a KeyUpdate (a gateway that sends one); the next handshake call sends it. 0 or TK_E_OPENSSL. */
int tk_key_update(SSL *ssl, int request_peer);

#endif
