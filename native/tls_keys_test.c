/* TESTS ONLY: reading back the keys tls_keys.c would install, and two OpenSSL calls Python's ssl lacks.
 * Linked with tls_keys.c into native._tls_keys_test; see tls_keys_test.h. */
#include "tls_keys_test.h"

#include <string.h>

#include "tls_keys_internal.h"

int tk_export_for_test(SSL *ssl, int64_t expect_tx, int64_t expect_rx, unsigned char *tx_out,
                       unsigned char *rx_out, int out_len)
{
    union tk_crypto_info tx, rx;
    int tx_size = 0, rx_size = 0;
    int rc = tk_check_and_build(ssl, expect_tx, expect_rx, &tx, &tx_size, &rx, &rx_size);
    if (rc == 0 && (out_len < tx_size || out_len < rx_size))
        rc = TK_E_ARG;
    if (rc == 0) {
        memcpy(tx_out, &tx, (size_t)tx_size);
        memcpy(rx_out, &rx, (size_t)rx_size);
        rc = tx_size;
    }
    return tk_done_with_keys(ssl, &tx, &rx, rc);
}

int tk_set_ciphersuites(SSL_CTX *ctx, const char *suites)
{
    return SSL_CTX_set_ciphersuites(ctx, suites) == 1 ? 0 : TK_E_OPENSSL;
}

int tk_key_update(SSL *ssl, int request_peer)
{
    int type = request_peer ? SSL_KEY_UPDATE_REQUESTED : SSL_KEY_UPDATE_NOT_REQUESTED;
    return SSL_key_update(ssl, type) == 1 ? 0 : TK_E_OPENSSL;
}
