/* What tls_keys.c shares with tls_keys_test.c, and with nothing else: hidden symbols, so that no
 * shared object built from them exports a function that returns key material. Not a binding. */
#ifndef SBXNET_TLS_KEYS_INTERNAL_H
#define SBXNET_TLS_KEYS_INTERNAL_H

#include <linux/tls.h>
#include <openssl/ssl.h>
#include <stdint.h>

#define TK_INTERNAL __attribute__((visibility("hidden")))

/* One direction's keys as setsockopt(SOL_TLS, TLS_TX / TLS_RX) takes them. */
union tk_crypto_info {
    struct tls12_crypto_info_aes_gcm_128 g128;
    struct tls12_crypto_info_aes_gcm_256 g256;
};

/* Every precondition for handing this session to the kernel; on success fills the two directions
 * (their sizes in *tx_size, *rx_size) and returns 0, else a TK_E_*. Then tk_done_with_keys. */
TK_INTERNAL int tk_check_and_build(SSL *ssl, int64_t expect_tx, int64_t expect_rx, union tk_crypto_info *tx,
                                   int *tx_size, union tk_crypto_info *rx, int *rx_size);
/* Wipes tx and rx and, unless rc is TK_E_NOT_PREPARED (there were none), the session's secrets,
 * marking it installed: nothing can be built from it again. Returns rc. */
TK_INTERNAL int tk_done_with_keys(SSL *ssl, union tk_crypto_info *tx, union tk_crypto_info *rx, int rc);

#endif
