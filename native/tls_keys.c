/* TLS 1.3 traffic keys from OpenSSL into the kernel (TLS_TX and TLS_RX), without the secrets ever
 * reaching Python, a log or a file.
 *
 * How: tk_prepare_ctx() puts two callbacks on the SSL_CTX behind Python's ssl.SSLContext. The keylog
 * callback (public API since OpenSSL 1.1.1) receives each handshake's CLIENT_/SERVER_TRAFFIC_SECRET_0
 * as a line of text; we decode the two application secrets into a per-SSL struct held in the SSL's
 * ex_data and ignore every other line. The message callback sees the inner content type of every
 * TLS 1.3 record OpenSSL encrypts or decrypts; counting those after the handshake finished gives the
 * record sequence numbers the kernel must continue from. tk_install() derives key and IV with
 * HKDF-Expand-Label, attaches the "tls" ULP and installs both directions, then wipes the secrets.
 * The ex_data free callback wipes them too, should a connection end before installing.
 *
 * Nothing here hands key material back to the caller: the entry points that read keys back for the
 * tests (tls_keys_test.c) are built only into the test extension, native._tls_keys_test. */
#define _GNU_SOURCE
#include "tls_keys.h"
#include "tls_keys_internal.h"

#include <errno.h>
#include <linux/tls.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#ifndef SOL_TLS
#define SOL_TLS 282
#endif
#ifndef TCP_ULP
#define TCP_ULP 31
#endif

#define MAX_SECRET 48
#define SUITE_AES_128_GCM_SHA256 0x1301
#define SUITE_AES_256_GCM_SHA384 0x1302
#define INNER_APPLICATION_DATA 23

struct tk_conn {
    unsigned char client[MAX_SECRET];
    unsigned char server[MAX_SECRET];
    size_t client_len, server_len;
    uint64_t tx_records, rx_records; /* records under the application keys */
    uint64_t tx_other, rx_other;     /* of which not application data (alerts, post-handshake) */
    uint64_t hs_records;             /* records seen before the handshake finished */
    int installed;
};

static int ex_index = -1;
static pthread_once_t ex_once = PTHREAD_ONCE_INIT;

static void conn_free(void *parent, void *ptr, CRYPTO_EX_DATA *ad, int idx, long argl, void *argp)
{
    (void)parent;
    (void)ad;
    (void)idx;
    (void)argl;
    (void)argp;
    if (ptr)
        OPENSSL_clear_free(ptr, sizeof(struct tk_conn));
}

static void ex_init(void)
{
    ex_index = SSL_get_ex_new_index(0, NULL, NULL, NULL, conn_free);
}

static struct tk_conn *conn_of(const SSL *ssl, int create)
{
    if (ex_index < 0)
        return NULL;
    struct tk_conn *c = SSL_get_ex_data(ssl, ex_index);
    if (!c && create) {
        c = OPENSSL_zalloc(sizeof *c);
        if (c && !SSL_set_ex_data((SSL *)ssl, ex_index, c)) {
            OPENSSL_free(c);
            c = NULL;
        }
    }
    return c;
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

/* NSS key log line: "<LABEL> <client_random hex> <secret hex>". Only the two application secrets are
 * kept; handshake secrets, exporter secrets and the rest are not even decoded. */
static void keylog_cb(const SSL *ssl, const char *line)
{
    static const char cl[] = "CLIENT_TRAFFIC_SECRET_0 ";
    static const char sv[] = "SERVER_TRAFFIC_SECRET_0 ";
    int is_client = strncmp(line, cl, sizeof cl - 1) == 0;
    if (!is_client && strncmp(line, sv, sizeof sv - 1) != 0)
        return;
    const char *p = strchr(line + sizeof cl - 1, ' ');
    struct tk_conn *c = conn_of(ssl, 1);
    if (!p || !c)
        return;
    p++;
    unsigned char *dst = is_client ? c->client : c->server;
    size_t n = 0;
    while (p[0] && p[1] && n < MAX_SECRET) {
        int hi = hexval(p[0]), lo = hexval(p[1]);
        if (hi < 0 || lo < 0)
            break;
        dst[n++] = (unsigned char)(hi << 4 | lo);
        p += 2;
    }
    if (is_client)
        c->client_len = n;
    else
        c->server_len = n;
}

static void msg_cb(int write_p, int version, int content_type, const void *buf, size_t len, SSL *ssl,
                   void *arg)
{
    (void)version;
    (void)arg;
    if (content_type != SSL3_RT_INNER_CONTENT_TYPE || len != 1)
        return;
    struct tk_conn *c = conn_of(ssl, 1);
    if (!c)
        return;
    /* Until the handshake is finished, records are under the handshake keys (the server's
     * Finished, the client's Finished) and do not count toward the application sequence. */
    if (!SSL_is_init_finished(ssl)) {
        c->hs_records++;
        return;
    }
    int app = *(const unsigned char *)buf == INNER_APPLICATION_DATA;
    if (write_p) {
        c->tx_records++;
        c->tx_other += !app;
    } else {
        c->rx_records++;
        c->rx_other += !app;
    }
}

int tk_prepare_ctx(SSL_CTX *ctx)
{
    pthread_once(&ex_once, ex_init);
    if (ex_index < 0)
        return TK_E_OPENSSL;
    SSL_CTX_keylog_cb_func cur = SSL_CTX_get_keylog_callback(ctx);
    if (cur && cur != keylog_cb)
        return TK_E_FOREIGN_KEYLOG; /* someone else (keylog_filename) would see the secrets */
    if (SSL_CTX_set_ciphersuites(ctx, "TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256") != 1)
        return TK_E_OPENSSL;
    if (SSL_CTX_set_num_tickets(ctx, 0) != 1)
        return TK_E_OPENSSL;
#ifdef SSL_OP_ENABLE_KTLS
    /* OpenSSL must not attach the ULP or install TX itself: we install both directions. */
    SSL_CTX_clear_options(ctx, SSL_OP_ENABLE_KTLS);
#endif
    SSL_CTX_set_keylog_callback(ctx, keylog_cb);
    SSL_CTX_set_msg_callback(ctx, msg_cb);
    return 0;
}

static int ctx_prepared(SSL_CTX *ctx)
{
    return SSL_CTX_get_keylog_callback(ctx) == keylog_cb;
}

uint64_t tk_ctx_options(SSL_CTX *ctx)
{
    return (uint64_t)SSL_CTX_get_options(ctx);
}

SSL_CTX *tk_ssl_ctx(SSL *ssl)
{
    return SSL_get_SSL_CTX(ssl);
}

int tk_info(SSL *ssl, struct tk_info *out)
{
    memset(out, 0, sizeof *out);
    out->version = SSL_version(ssl);
    out->is_server = SSL_is_server(ssl);
    out->init_finished = SSL_is_init_finished(ssl);
    const SSL_CIPHER *ci = SSL_get_current_cipher(ssl);
    out->suite = ci ? SSL_CIPHER_get_protocol_id(ci) : 0;
    out->pending = SSL_pending(ssl);
    out->has_pending = SSL_has_pending(ssl);
    struct tk_conn *c = conn_of(ssl, 0);
    if (c) {
        out->have_client_secret = c->client_len > 0;
        out->have_server_secret = c->server_len > 0;
        out->tx_records = c->tx_records;
        out->rx_records = c->rx_records;
        out->tx_other = c->tx_other;
        out->rx_other = c->rx_other;
        out->hs_records = c->hs_records;
        out->installed = c->installed;
    }
    return 0;
}

int tk_expand_label(int sha384, const unsigned char *secret, size_t secret_len, const char *label,
                    unsigned char *out, size_t out_len)
{
    const EVP_MD *md = sha384 ? EVP_sha384() : EVP_sha256();
    size_t hlen = (size_t)EVP_MD_get_size(md);
    size_t llen = strlen(label);
    if (out_len > hlen || llen > 249 || secret_len > MAX_SECRET)
        return TK_E_ARG;
    /* HkdfLabel (RFC 8446 7.1) with an empty context, then HKDF-Expand's T(1) = HMAC(PRK, info | 1):
     * a single block suffices because every length asked for is at most the hash length. */
    unsigned char info[2 + 1 + 6 + 249 + 1 + 1];
    size_t n = 0;
    info[n++] = (unsigned char)(out_len >> 8);
    info[n++] = (unsigned char)out_len;
    info[n++] = (unsigned char)(6 + llen);
    memcpy(info + n, "tls13 ", 6);
    n += 6;
    memcpy(info + n, label, llen);
    n += llen;
    info[n++] = 0; /* context length */
    info[n++] = 1; /* HKDF-Expand block counter */
    unsigned char t[EVP_MAX_MD_SIZE];
    unsigned int tlen = 0;
    int ok = HMAC(md, secret, (int)secret_len, info, n, t, &tlen) != NULL && tlen == hlen;
    if (ok)
        memcpy(out, t, out_len);
    OPENSSL_cleanse(t, sizeof t);
    return ok ? 0 : TK_E_OPENSSL;
}

static void put_be64(unsigned char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        p[i] = (unsigned char)v;
        v >>= 8;
    }
}

/* Fills ci for one direction from its traffic secret and next record sequence number; returns size. */
static int build_info(int suite, const unsigned char *secret, size_t slen, uint64_t seq,
                      union tk_crypto_info *ci)
{
    unsigned char key[32], iv[12];
    int big = suite == SUITE_AES_256_GCM_SHA384;
    size_t klen = big ? 32 : 16;
    int rc = tk_expand_label(big, secret, slen, "key", key, klen);
    if (rc == 0)
        rc = tk_expand_label(big, secret, slen, "iv", iv, sizeof iv);
    int size = 0;
    memset(ci, 0, sizeof *ci);
    if (rc == 0 && big) {
        ci->g256.info.version = TLS_1_3_VERSION;
        ci->g256.info.cipher_type = TLS_CIPHER_AES_GCM_256;
        memcpy(ci->g256.key, key, 32);
        memcpy(ci->g256.salt, iv, 4); /* the kernel's nonce is salt | iv, XORed with the sequence */
        memcpy(ci->g256.iv, iv + 4, 8);
        put_be64(ci->g256.rec_seq, seq);
        size = sizeof ci->g256;
    } else if (rc == 0) {
        ci->g128.info.version = TLS_1_3_VERSION;
        ci->g128.info.cipher_type = TLS_CIPHER_AES_GCM_128;
        memcpy(ci->g128.key, key, 16);
        memcpy(ci->g128.salt, iv, 4);
        memcpy(ci->g128.iv, iv + 4, 8);
        put_be64(ci->g128.rec_seq, seq);
        size = sizeof ci->g128;
    }
    OPENSSL_cleanse(key, sizeof key);
    OPENSSL_cleanse(iv, sizeof iv);
    return rc == 0 ? size : rc;
}

int tk_check_and_build(SSL *ssl, int64_t expect_tx, int64_t expect_rx, union tk_crypto_info *tx,
                       int *tx_size, union tk_crypto_info *rx, int *rx_size)
{
    struct tk_conn *c = conn_of(ssl, 0);
    if (!c || !ctx_prepared(SSL_get_SSL_CTX(ssl)))
        return TK_E_NOT_PREPARED;
    if (c->installed)
        return TK_E_STATE;
    if (SSL_version(ssl) != TLS1_3_VERSION || !SSL_is_init_finished(ssl))
        return TK_E_STATE;
    if (c->client_len == 0 || c->server_len == 0 || c->hs_records == 0)
        return TK_E_NOT_PREPARED; /* the callbacks were not ours during this handshake */
    const SSL_CIPHER *ci = SSL_get_current_cipher(ssl);
    int suite = ci ? SSL_CIPHER_get_protocol_id(ci) : 0;
    size_t want = suite == SUITE_AES_256_GCM_SHA384 ? 48 : suite == SUITE_AES_128_GCM_SHA256 ? 32 : 0;
    if (want == 0)
        return TK_E_CIPHER;
    if (c->client_len != want || c->server_len != want)
        return TK_E_NOT_PREPARED;
    if (SSL_pending(ssl) > 0 || SSL_has_pending(ssl))
        return TK_E_BUFFERED; /* bytes inside OpenSSL would be skipped by the kernel */
    if (c->tx_other || c->rx_other)
        return TK_E_RECORDS; /* a post-handshake message (KeyUpdate...) may have changed keys */
    if ((expect_tx >= 0 && (uint64_t)expect_tx != c->tx_records) ||
        (expect_rx >= 0 && (uint64_t)expect_rx != c->rx_records))
        return TK_E_RECORDS;
    int server = SSL_is_server(ssl);
    const unsigned char *txs = server ? c->server : c->client;
    const unsigned char *rxs = server ? c->client : c->server;
    *tx_size = build_info(suite, txs, want, c->tx_records, tx);
    *rx_size = build_info(suite, rxs, want, c->rx_records, rx);
    if (*tx_size < 0 || *rx_size < 0)
        return TK_E_OPENSSL;
    return 0;
}

static void wipe_secrets(SSL *ssl)
{
    struct tk_conn *c = conn_of(ssl, 0);
    if (!c)
        return;
    OPENSSL_cleanse(c->client, sizeof c->client);
    OPENSSL_cleanse(c->server, sizeof c->server);
    c->client_len = c->server_len = 0;
    c->installed = 1;
}

int tk_done_with_keys(SSL *ssl, union tk_crypto_info *tx, union tk_crypto_info *rx, int rc)
{
    OPENSSL_cleanse(tx, sizeof *tx);
    OPENSSL_cleanse(rx, sizeof *rx);
    /* Success or not, this session's secrets are done with: a failed install closes the connection. */
    if (rc != TK_E_NOT_PREPARED)
        wipe_secrets(ssl);
    return rc;
}

int tk_install(SSL *ssl, int fd, int64_t expect_tx, int64_t expect_rx, int *sys_errno)
{
    union tk_crypto_info tx, rx;
    int tx_size = 0, rx_size = 0;
    *sys_errno = 0;
    int rc = tk_check_and_build(ssl, expect_tx, expect_rx, &tx, &tx_size, &rx, &rx_size);
    if (rc == 0) {
        /* The ULP may already be attached (tk_attach_ulp at accept): TCP_ULP refuses a socket that
         * is no longer ESTABLISHED, e.g. once a fast gateway has sent its data and FIN. */
        char ulp[16] = {0};
        socklen_t ulen = sizeof ulp - 1;
        int have = getsockopt(fd, SOL_TCP, TCP_ULP, ulp, &ulen) == 0 && strcmp(ulp, "tls") == 0;
        if (!have && setsockopt(fd, SOL_TCP, TCP_ULP, "tls", 3) < 0) {
            *sys_errno = errno;
            rc = TK_E_ULP;
        } else if (setsockopt(fd, SOL_TLS, TLS_TX, &tx, (socklen_t)tx_size) < 0) {
            *sys_errno = errno;
            rc = TK_E_TX;
        } else if (setsockopt(fd, SOL_TLS, TLS_RX, &rx, (socklen_t)rx_size) < 0) {
            *sys_errno = errno;
            rc = TK_E_RX;
        }
    }
    return tk_done_with_keys(ssl, &tx, &rx, rc);
}

int tk_attach_ulp(int fd, int *sys_errno)
{
    *sys_errno = 0;
    if (setsockopt(fd, SOL_TCP, TCP_ULP, "tls", 3) < 0) {
        *sys_errno = errno;
        return TK_E_ULP;
    }
    return 0;
}
