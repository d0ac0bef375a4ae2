/* Egress packet core: checksums, identity rewrite, GSO segmentation into VXLAN send buffers, inbound
 * delivery framing with TCP merging. Contracts are in egress_core.h; slow references that the tests
 * compare against are in forwarder/egress/reference.py and must follow the same order of checks.
 */
#include "egress_core.h"

#include <string.h>

#define IP_MF 0x2000u
#define IP_OFFMASK 0x1fffu
#define IP_DF 0x4000u
#define TH_FIN 0x01u
#define TH_SYN 0x02u
#define TH_RST 0x04u
#define TH_PSH 0x08u
#define TH_ACK 0x10u
#define TH_URG 0x20u
#define TH_CWR 0x80u
#define VNET_NEEDS_CSUM 1u
#define GSO_NONE 0u
#define GSO_TCPV4 1u
#define GSO_UDP_L4 5u
#define GSO_ECN 0x80u
#define MAX_IP 65535u
#define MIN_FRAME 30u    /* vnet hdr + 20 bytes of IPv4 */
#define MAX_FRAME 65545u /* vnet hdr + 65535 */

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t rd32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint16_t rdle16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline void wr16(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static inline void wrle16(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void wr32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static inline uint16_t fold32(uint32_t s)
{
    s = (s & 0xffffu) + (s >> 16);
    s = (s & 0xffffu) + (s >> 16);
    return (uint16_t)s;
}

static inline uint16_t fold64(uint64_t s)
{
    s = (s & 0xffffffffu) + (s >> 32);
    s = (s & 0xffffffffu) + (s >> 32);
    return fold32((uint32_t)(s & 0xffffffffu) + (uint32_t)(s >> 32) /* s < 2^33 here */);
}

/* The sum is taken in the machine's byte order and swapped once at the end: ones' complement addition
 * commutes with byte swapping (RFC 1071 section 2B), so no per-word swap is needed. `acc_*` return a
 * 64-bit ones' complement accumulator (end-around carries kept); `finish` folds and swaps it. */
static inline uint64_t add64(uint64_t s, uint64_t v)
{
    s += v;
    return s + (s < v);
}

static uint64_t acc_tail(const uint8_t *p, size_t n, uint64_t s)
{
    uint64_t tail = 0;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        s = add64(s, w);
        p += 8;
        n -= 8;
    }
    if (n >= 4) {
        uint32_t v;
        memcpy(&v, p, 4);
        tail += v;
        p += 4;
        n -= 4;
    }
    if (n >= 2) {
        uint16_t v;
        memcpy(&v, p, 2);
        tail += v;
        p += 2;
        n -= 2;
    }
    if (n) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        tail += p[0];
#else
        tail += (uint64_t)p[0] << 8;
#endif
    }
    return add64(s, tail);
}

#if defined(__x86_64__) && !defined(EG_NO_ASM)
/* One add-with-carry chain, 64 bytes per iteration, as Linux's csum_partial does on x86-64: the carry
 * flag is the accumulator's 65th bit, so no compare per word. After an adc that carries out the register
 * is at most 2^64 - 2, so the closing `adcq $0` cannot carry out again. */
static uint64_t acc_adc(const uint8_t *p, size_t n, uint64_t s)
{
    while (n >= 64) {
        __asm__("addq 0(%[p]), %[s]\n\t"
                "adcq 8(%[p]), %[s]\n\t"
                "adcq 16(%[p]), %[s]\n\t"
                "adcq 24(%[p]), %[s]\n\t"
                "adcq 32(%[p]), %[s]\n\t"
                "adcq 40(%[p]), %[s]\n\t"
                "adcq 48(%[p]), %[s]\n\t"
                "adcq 56(%[p]), %[s]\n\t"
                "adcq $0, %[s]"
                : [s] "+r"(s)
                : [p] "r"(p)
                : "cc", "memory");
        p += 64;
        n -= 64;
    }
    return acc_tail(p, n, s);
}

#ifndef EG_NO_AVX2
/* AVX2: each 32-bit lane adds the two 16-bit words it holds, so one load serves 16 words; a lane grows
 * by at most 2 * 0xFFFF per 64 bytes, so lanes are flushed every 1 MiB, far before they could wrap.
 * The copying variant reads the payload once for both the copy and the sum.
 * GCC inserts no vzeroupper in a function made AVX by a target attribute (only under -mavx), and the
 * legacy-SSE code that follows (inlined memcpy of headers, glibc) then runs with dirty upper halves:
 * that made the segmenter 2.3x slower here, so each function clears them itself before leaving. */
typedef uint32_t v8u32 __attribute__((vector_size(32)));
#define AVX2_BLOCK (1u << 20)

__attribute__((target("avx2"))) static uint64_t hsum(v8u32 a, v8u32 b, uint64_t s)
{
    a += b;
    uint64_t t = 0;
    for (int i = 0; i < 8; i++)
        t += a[i];
    return add64(s, t);
}

__attribute__((target("avx2"))) static uint64_t acc_avx2(const uint8_t *p, size_t n, uint64_t s)
{
    while (n >= 64) {
        size_t blk = n < AVX2_BLOCK ? n : AVX2_BLOCK;
        v8u32 a = {0}, b = {0}, w, x;
        for (; blk >= 64; blk -= 64, n -= 64, p += 64) {
            memcpy(&w, p, 32);
            memcpy(&x, p + 32, 32);
            a += (w & 0xffff) + (w >> 16);
            b += (x & 0xffff) + (x >> 16);
        }
        s = hsum(a, b, s);
    }
    __builtin_ia32_vzeroupper();
    return acc_tail(p, n, s);
}

__attribute__((target("avx2"))) static uint64_t acc_copy_avx2(uint8_t *d, const uint8_t *p, size_t n, uint64_t s)
{
    while (n >= 64) {
        size_t blk = n < AVX2_BLOCK ? n : AVX2_BLOCK;
        v8u32 a = {0}, b = {0}, w, x;
        for (; blk >= 64; blk -= 64, n -= 64, p += 64, d += 64) {
            memcpy(&w, p, 32);
            memcpy(&x, p + 32, 32);
            memcpy(d, &w, 32);
            memcpy(d + 32, &x, 32);
            a += (w & 0xffff) + (w >> 16);
            b += (x & 0xffff) + (x >> 16);
        }
        s = hsum(a, b, s);
    }
    __builtin_ia32_vzeroupper();
    /* Sum the source, not the copy: words read back from d would straddle the copy's stores, and a
     * load that store-to-load forwarding cannot serve waits for them to reach the cache. */
    memcpy(d, p, n);
    return acc_tail(p, n, s);
}

static inline int use_avx2(void) { return __builtin_cpu_supports("avx2"); }
#else
static inline int use_avx2(void) { return 0; }
#define acc_avx2(p, n, s) acc_adc(p, n, s)
#define acc_copy_avx2(d, p, n, s) (memcpy(d, p, n), acc_adc(p, n, s))
#endif

static uint64_t acc_native(const uint8_t *p, size_t n, uint64_t s)
{
    return use_avx2() ? acc_avx2(p, n, s) : acc_adc(p, n, s);
}

static uint64_t acc_copy(uint8_t *d, const uint8_t *p, size_t n, uint64_t s)
{
    if (use_avx2())
        return acc_copy_avx2(d, p, n, s);
    memcpy(d, p, n);
    return acc_adc(p, n, s);
}
#else
/* Portable: 128-bit accumulators let the compiler use add-with-carry on four independent chains. */
static uint64_t acc_native(const uint8_t *p, size_t n, uint64_t s)
{
    unsigned __int128 a0 = s, a1 = 0, a2 = 0, a3 = 0;
    uint64_t w0, w1, w2, w3;
    while (n >= 32) {
        memcpy(&w0, p, 8);
        memcpy(&w1, p + 8, 8);
        memcpy(&w2, p + 16, 8);
        memcpy(&w3, p + 24, 8);
        a0 += w0;
        a1 += w1;
        a2 += w2;
        a3 += w3;
        p += 32;
        n -= 32;
    }
    a0 += a1;
    a2 += a3;
    a0 += a2;
    /* 2^64 == 1 (mod 2^16 - 1) */
    return acc_tail(p, n, add64((uint64_t)a0, (uint64_t)(a0 >> 64)));
}

static uint64_t acc_copy(uint8_t *d, const uint8_t *p, size_t n, uint64_t s)
{
    memcpy(d, p, n);
    return acc_native(p, n, s);
}
#endif

static uint16_t finish(uint64_t s)
{
    uint16_t r = fold64(s);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    r = (uint16_t)((r >> 8) | (r << 8));
#endif
    return r;
}

static uint16_t sum_native(const uint8_t *p, size_t n) { return finish(acc_native(p, n, 0)); }

/* Folded big-endian sum of src[0..n), copied to dst on the way. */
static uint16_t csum_copy(uint8_t *dst, const uint8_t *src, size_t n) { return finish(acc_copy(dst, src, n, 0)); }

static inline uint16_t add16(uint32_t a, uint32_t b) { return fold32(a + b); }

uint16_t eg_csum(const uint8_t *p, size_t n, uint16_t initial) { return add16(sum_native(p, n), initial); }

/* RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m'). A partial (non-inverted) field is a running sum: S' = S + ~m + m'. */
static inline uint16_t upd16(uint16_t check, uint16_t from, uint16_t to, int partial)
{
    uint32_t s = partial ? check : (uint16_t)~check;
    s += (uint16_t)~from;
    s += to;
    uint16_t r = fold32(s);
    return partial ? r : (uint16_t)~r;
}

uint16_t eg_csum_update32(uint16_t check, uint32_t from, uint32_t to, int partial)
{
    uint32_t s = partial ? check : (uint16_t)~check;
    s += (uint16_t)~(from >> 16);
    s += (uint16_t)~(from & 0xffffu);
    s += to >> 16;
    s += to & 0xffffu;
    uint16_t r = fold32(s);
    return partial ? r : (uint16_t)~r;
}

static inline uint16_t pseudo_sum(uint32_t src, uint32_t dst, uint32_t proto, uint32_t l4len)
{
    return fold32((src >> 16) + (src & 0xffffu) + (dst >> 16) + (dst & 0xffffu) + proto + l4len);
}

/* ---- outbound ---------------------------------------------------------------------------------- */

/* What parse_out learnt; every offset is derived from the packet, never from the guest's vnet hdr. */
struct opkt {
    const uint8_t *ip;
    uint32_t ip_len;  /* IPv4 total length (bytes past it are ignored) */
    uint32_t ihl;     /* bytes */
    uint32_t proto;
    uint32_t l4h;     /* L4 header bytes (0: no L4 header in this fragment) */
    uint32_t flags;   /* vnet flags */
    uint32_t gso;     /* vnet gso_type without the ECN bit */
    uint32_t gso_size;
    int has_l4;       /* not a later fragment */
    int icmp_err;     /* ICMP error quoting an IPv4 header */
};

static int parse_out(const uint8_t *f, size_t len, struct opkt *k)
{
    if (len < EG_VNET_HDR_LEN)
        return EG_ERR_SHORT_HEADER;
    if (len < EG_VNET_HDR_LEN + 20)
        return EG_ERR_IP_HEADER;
    const uint8_t *ip = f + EG_VNET_HDR_LEN;
    size_t avail = len - EG_VNET_HDR_LEN;
    if ((ip[0] >> 4) != 4 || (ip[0] & 15) < 5)
        return EG_ERR_IP_HEADER;
    /* Options refused, as validate_outbound refuses them: the L4 header then always starts at 20, the
     * only csum_start the contract allows, and no wire packet carries options the guest chose. */
    if ((ip[0] & 15) != 5)
        return EG_ERR_IP_OPTIONS;
    uint32_t ihl = 20;
    uint32_t tot = rd16(ip + 2);
    if (tot < ihl || tot > avail)
        return EG_ERR_IP_LENGTH;
    uint32_t fragw = rd16(ip + 6);
    int frag = (fragw & (IP_MF | IP_OFFMASK)) != 0;
    int has_l4 = (fragw & IP_OFFMASK) == 0;
    uint32_t proto = ip[9];
    uint32_t l4len = tot - ihl;
    const uint8_t *l4 = ip + ihl;
    uint32_t l4h = 0;
    int icmp_err = 0;
    if (has_l4) {
        if (proto == 6) {
            if (l4len < 20)
                return EG_ERR_L4_HEADER;
            l4h = (uint32_t)(l4[12] >> 4) * 4;
            if (l4h < 20 || l4h > l4len)
                return EG_ERR_L4_HEADER;
        } else if (proto == 17) {
            if (l4len < 8)
                return EG_ERR_L4_HEADER;
            l4h = 8;
        } else if (proto == 1 && l4len >= 1 && (l4[0] == 3 || l4[0] == 11 || l4[0] == 12)) {
            if (l4len < 8)
                return EG_ERR_L4_HEADER;
            if (l4len < 8 + 20)
                return EG_ERR_ICMP_QUOTE;
            const uint8_t *e = l4 + 8;
            if ((e[0] >> 4) != 4 || (e[0] & 15) < 5)
                return EG_ERR_ICMP_QUOTE;
            /* A genuine error goes back to the sender of the packet it quotes. Any other quoted source
             * (another claim's overlay address, say) would leave as the guest wrote it: only the
             * quoted destination becomes the claim address. */
            if (rd32(e + 12) != rd32(ip + 16))
                return EG_ERR_ICMP_QUOTE_SRC;
            icmp_err = 1;
        }
    }
    uint32_t flags = f[0], gso_type = f[1];
    uint32_t gso_size = rdle16(f + 4), csum_start = rdle16(f + 6), csum_offset = rdle16(f + 8);
    /* The checksum write may only ever land on the L4 checksum field: anything else would let the
     * guest aim it at the IPv4 header after policy judged the destination. */
    if (flags & VNET_NEEDS_CSUM) {
        if (frag)
            return EG_ERR_FRAGMENT;
        if (proto == 1)
            return EG_ERR_ICMP_CSUM;
        if (proto != 6 && proto != 17)
            return EG_ERR_UNSUPPORTED_PROTO;
        if (csum_start != ihl)
            return EG_ERR_CSUM_START;
        if (csum_offset != (proto == 6 ? 16u : 6u))
            return EG_ERR_CSUM_OFFSET;
    }
    uint32_t gso = gso_type & ~GSO_ECN;
    if (gso == GSO_NONE) {
        if (gso_type & GSO_ECN)
            return EG_ERR_GSO_TYPE;
    } else if (gso == GSO_TCPV4) {
        if (proto != 6)
            return EG_ERR_GSO_PROTO;
    } else if (gso == GSO_UDP_L4) {
        if (proto != 17)
            return EG_ERR_GSO_PROTO;
        if (gso_type & GSO_ECN)
            return EG_ERR_GSO_TYPE;
    } else {
        return EG_ERR_GSO_TYPE;
    }
    if (gso != GSO_NONE && frag)
        return EG_ERR_FRAGMENT;
    if (gso != GSO_NONE && gso_size == 0)
        return EG_ERR_ZERO_GSO_SIZE;
    k->ip = ip;
    k->ip_len = tot;
    k->ihl = ihl;
    k->proto = proto;
    k->l4h = l4h;
    k->flags = flags;
    k->gso = gso;
    k->gso_size = gso_size;
    k->has_l4 = has_l4;
    k->icmp_err = icmp_err;
    return EG_OK;
}

/* Writes only: parse_out has checked every offset used here against k->ip_len. */
static void rewrite_ip(uint8_t *ip, const struct opkt *k, uint32_t claim)
{
    uint32_t old = rd32(ip + 12);
    if (old != claim) {
        wr32(ip + 12, claim);
        wr16(ip + 10, eg_csum_update32(rd16(ip + 10), old, claim, 0));
        if (k->has_l4 && k->proto == 6) {
            uint8_t *c = ip + k->ihl + 16;
            wr16(c, eg_csum_update32(rd16(c), old, claim, (int)(k->flags & VNET_NEEDS_CSUM)));
        } else if (k->has_l4 && k->proto == 17) {
            uint8_t *c = ip + k->ihl + 6;
            uint16_t v = rd16(c);
            if (k->flags & VNET_NEEDS_CSUM) {
                wr16(c, eg_csum_update32(v, old, claim, 1));
            } else if (v != 0) { /* 0 means "no checksum" (RFC 768) and stays so */
                v = eg_csum_update32(v, old, claim, 0);
                wr16(c, v ? v : 0xffff);
            }
        }
    }
    if (k->icmp_err) {
        /* The quoted header is the packet as the guest received it: its destination is the guest's
         * own address, which the exit side knows only as the claim address. */
        uint8_t *icmp = ip + k->ihl, *e = icmp + 8;
        uint32_t eold = rd32(e + 16);
        if (eold != claim) {
            uint16_t ecs_old = rd16(e + 10);
            uint16_t ecs_new = eg_csum_update32(ecs_old, eold, claim, 0);
            wr32(e + 16, claim);
            wr16(e + 10, ecs_new);
            uint16_t ic = eg_csum_update32(rd16(icmp + 2), eold, claim, 0);
            wr16(icmp + 2, upd16(ic, ecs_old, ecs_new, 0));
        }
    }
}

int eg_rewrite(uint8_t *frame, size_t len, uint32_t claim)
{
    struct opkt k;
    if (!frame)
        return EG_ERR_SLICE;
    int st = parse_out(frame, len, &k);
    if (st)
        return st;
    rewrite_ip(frame + EG_VNET_HDR_LEN, &k, claim);
    return EG_OK;
}

struct plan {
    uint32_t nseg, stride, bytes;
};

static int plan_out(const struct opkt *k, const struct eg_out_params *p, struct plan *pl)
{
    if (k->gso == GSO_NONE) {
        if (k->ip_len > p->mtu)
            return EG_ERR_SIZE;
        pl->nseg = 1;
        pl->stride = pl->bytes = EG_PREFIX_LEN + k->ip_len;
        return EG_OK;
    }
    uint32_t hl = k->ihl + k->l4h, payload = k->ip_len - hl;
    if (hl + k->gso_size > p->mtu)
        return EG_ERR_SIZE;
    uint32_t nseg = payload ? (payload + k->gso_size - 1) / k->gso_size : 1;
    if (p->max_segs && nseg > p->max_segs)
        return EG_ERR_SIZE;
    uint32_t first = payload < k->gso_size ? payload : k->gso_size;
    pl->nseg = nseg;
    pl->stride = EG_PREFIX_LEN + hl + first;
    pl->bytes = nseg * (EG_PREFIX_LEN + hl) + payload; /* < 65536 * 82 + 65536: no overflow */
    return EG_OK;
}

static void write_out(const struct opkt *k, const struct eg_out_params *p, const struct plan *pl, uint8_t *out)
{
    const uint8_t *ip = k->ip;
    if (k->gso == GSO_NONE) {
        memcpy(out, p->prefix, EG_PREFIX_LEN);
        uint8_t *q = out + EG_PREFIX_LEN;
        memcpy(q, ip, k->ip_len);
        rewrite_ip(q, k, p->claim);
        if (k->flags & VNET_NEEDS_CSUM) {
            /* Complete the offload: the field holds the pseudo-header sum, so summing the L4 bytes
             * as they stand gives the full sum. */
            uint8_t *l4 = q + k->ihl, *c = l4 + (k->proto == 6 ? 16 : 6);
            uint16_t v = (uint16_t)~eg_csum(l4, k->ip_len - k->ihl, 0);
            if (k->proto == 17 && v == 0)
                v = 0xffff;
            wr16(c, v);
        }
        return;
    }
    uint32_t ihl = k->ihl, l4h = k->l4h, hl = ihl + l4h, payload = k->ip_len - hl, mss = k->gso_size;
    const uint8_t *pay = ip + hl;
    uint32_t dst = rd32(ip + 16), id0 = rd16(ip + 4), seq0 = rd32(ip + ihl + 4);
    int tcp = k->proto == 6;
    uint32_t coff = tcp ? 16 : 6;
    /* Segments' headers differ only in a few words, so each header is summed once with those words
     * zeroed and every segment adds its own (a ones' complement sum does not depend on the order of its
     * words). Summing each header as written would also read back bytes still in the store queue. */
    uint8_t h[20 + 60]; /* hl <= 20 + 60 (TCP data offset is 4 bits) */
    memcpy(h, ip, hl);
    uint8_t *th = h + ihl, fl0 = th[13];
    wr16(h + 2, 0);
    wr16(h + 4, 0);
    wr16(h + 10, 0);
    wr32(h + 12, p->claim);
    if (tcp) {
        wr32(th + 4, 0);
        th[13] = 0;
    } else {
        wr16(th + 4, 0);
    }
    wr16(th + coff, 0);
    uint32_t ip_base = eg_csum(h, ihl, 0);
    uint32_t l4_base = add16(eg_csum(th, l4h, 0), pseudo_sum(p->claim, dst, k->proto, 0));
    for (uint32_t i = 0, off = 0; i < pl->nseg; i++, off += mss) {
        uint32_t len = payload - off < mss ? payload - off : mss, l4len = l4h + len, id = (id0 + i) & 0xffffu;
        uint8_t *rec = out + (size_t)i * pl->stride, *q = rec + EG_PREFIX_LEN, *t = q + ihl;
        memcpy(rec, p->prefix, EG_PREFIX_LEN);
        memcpy(q, ip, hl);
        wr32(q + 12, p->claim);
        wr16(q + 2, hl + len);
        wr16(q + 4, id);
        wr16(q + 10, (uint16_t)~fold32(ip_base + hl + len + id));
        uint32_t l4 = l4_base + l4len; /* the pseudo-header's length */
        if (tcp) {
            uint32_t seq = seq0 + off;
            uint8_t fl = fl0;
            if (i + 1 != pl->nseg)
                fl &= (uint8_t)~(TH_FIN | TH_PSH);
            if (i != 0)
                fl &= (uint8_t)~TH_CWR;
            wr32(t + 4, seq);
            t[13] = fl;
            l4 += (seq >> 16) + (seq & 0xffffu) + fl;
        } else {
            wr16(t + 4, l4len);
            l4 += l4len;
        }
        uint16_t v = (uint16_t)~add16(csum_copy(q + hl, pay + off, len), fold32(l4));
        if (!tcp && v == 0)
            v = 0xffff;
        wr16(t + coff, v);
    }
}

int eg_segment(const uint8_t *frame, size_t len, const struct eg_out_params *p, uint8_t *out, size_t cap,
               struct eg_seg_info *info)
{
    struct opkt k;
    struct plan pl;
    if (!frame || !p || !info)
        return EG_ERR_SLICE;
    int st = parse_out(frame, len, &k);
    if (st)
        return st;
    st = plan_out(&k, p, &pl);
    if (st)
        return st;
    if (!out || pl.bytes > cap)
        return EG_ERR_NO_SPACE;
    write_out(&k, p, &pl, out);
    info->packets = pl.nseg;
    info->bytes = pl.bytes;
    info->stride = pl.stride;
    return EG_OK;
}

/* Greedy grouping of records into sends that UDP GSO accepts: equal sizes, the last may be shorter
 * (and then ends the send), bounded in count and bytes. */
struct grouper {
    struct eg_send *sends;
    uint32_t n, open, closed, max_count, max_bytes;
};

static void group_add(struct grouper *g, uint32_t off, uint32_t len)
{
    if (g->open && !g->closed) {
        struct eg_send *s = &g->sends[g->n - 1];
        if (len <= s->seg && s->count < g->max_count && s->len + len <= g->max_bytes) {
            s->len += len;
            s->count++;
            if (len < s->seg)
                g->closed = 1;
            return;
        }
    }
    struct eg_send *s = &g->sends[g->n++];
    s->off = off;
    s->len = len;
    s->seg = len;
    s->count = 1;
    g->open = 1;
    g->closed = 0;
}

uint32_t eg_outbound_batch(const uint8_t *in, size_t in_len, const uint32_t *offs, const uint32_t *lens,
                           uint32_t n, const struct eg_out_params *p, uint8_t *out, size_t out_cap,
                           struct eg_out_result *res, struct eg_send *sends, uint32_t max_sends,
                           uint32_t *n_sends, size_t *out_used)
{
    struct grouper g = {sends, 0, 0, 0, p->max_gso_segs, p->max_send_bytes};
    size_t pos = 0;
    uint32_t i;
    if (out_cap > UINT32_MAX) /* offsets in results are u32 */
        out_cap = UINT32_MAX;
    for (i = 0; i < n; i++) {
        struct eg_out_result *r = &res[i];
        struct opkt k;
        struct plan pl;
        r->packets = 0;
        r->off = (uint32_t)pos;
        r->len = 0;
        if (!in || offs[i] > in_len || lens[i] > in_len - offs[i]) {
            r->status = EG_ERR_SLICE;
            continue;
        }
        int st = parse_out(in + offs[i], lens[i], &k);
        if (!st)
            st = plan_out(&k, p, &pl);
        if (st) {
            r->status = st;
            continue;
        }
        if (pl.bytes > out_cap - pos || pl.nseg > max_sends - g.n) {
            if (pos == 0 && g.n == 0) { /* would not fit an empty buffer either */
                r->status = EG_ERR_NO_SPACE;
                continue;
            }
            break;
        }
        write_out(&k, p, &pl, out + pos);
        for (uint32_t j = 0; j < pl.nseg; j++) {
            uint32_t roff = (uint32_t)pos + j * pl.stride;
            group_add(&g, roff, j + 1 == pl.nseg ? pl.bytes - j * pl.stride : pl.stride);
        }
        r->status = EG_OK;
        r->packets = pl.nseg;
        r->len = pl.bytes;
        pos += pl.bytes;
    }
    *n_sends = g.n;
    *out_used = pos;
    return i;
}

/* ---- inbound ----------------------------------------------------------------------------------- */

/* The frame currently open for merging: always the last frame written to the output. */
struct gro {
    int active, closed;
    uint32_t head;    /* result index of the frame's first packet */
    size_t off;       /* frame start (its u32 length) in out */
    uint32_t ip_len;  /* merged IPv4 length so far */
    uint32_t mss, thlen, next_seq, nseg;
};

static int in_gro_table(uint32_t a, const uint32_t *t, uint32_t n)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (t[mid] == a)
            return 1;
        if (t[mid] < a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

/* A TCP segment that may start or join a merged frame: plain ACK data (PSH allowed), no IP options or
 * fragments, DF set. Its checksums are checked as it is copied (gro_sums_ok): a bad one is delivered
 * alone, for the guest to drop. */
static int gro_shape(const uint8_t *ip, uint32_t ip_len)
{
    if (ip[0] != 0x45 || ip[9] != 6 || ip_len < 40)
        return 0;
    if (rd16(ip + 6) != IP_DF)
        return 0;
    const uint8_t *t = ip + 20;
    uint32_t thlen = (uint32_t)(t[12] >> 4) * 4;
    if (thlen < 20 || thlen >= ip_len - 20) /* needs payload */
        return 0;
    uint8_t fl = t[13];
    return (fl & TH_ACK) && !(fl & (TH_SYN | TH_FIN | TH_RST | TH_URG | TH_CWR));
}

/* Both checksums right, given the sum of the payload (taken while copying it). */
static int gro_sums_ok(const uint8_t *ip, uint32_t ip_len, uint16_t payload_sum)
{
    uint32_t thlen = (uint32_t)(ip[32] >> 4) * 4;
    if (eg_csum(ip, 20, 0) != 0xffff)
        return 0;
    uint16_t s = add16(pseudo_sum(rd32(ip + 12), rd32(ip + 16), 6, ip_len - 20), payload_sum);
    return eg_csum(ip + 20, thlen, s) == 0xffff;
}

static int gro_fits(const struct gro *g, const uint8_t *head, const uint8_t *ip, uint32_t ip_len)
{
    const uint8_t *t = ip + 20, *ht = head + 20;
    uint32_t thlen = (uint32_t)(t[12] >> 4) * 4, payload = ip_len - 20 - thlen;
    if (g->closed || thlen != g->thlen || payload > g->mss || g->ip_len + payload > MAX_IP)
        return 0;
    /* same TOS; same TTL; same addresses and ports; same ack; same flags but PSH; same window;
     * identical options; in order */
    if (ip[1] != head[1] || ip[8] != head[8] || memcmp(ip + 12, head + 12, 8) != 0)
        return 0;
    if (memcmp(t, ht, 4) != 0 || memcmp(t + 8, ht + 8, 4) != 0 || (t[13] & ~TH_PSH) != (ht[13] & ~TH_PSH))
        return 0;
    if (memcmp(t + 14, ht + 14, 2) != 0 || memcmp(t + 20, ht + 20, thlen - 20) != 0)
        return 0;
    return rd32(t + 4) == g->next_seq;
}

uint32_t eg_inbound_batch(const uint8_t *in, size_t in_len, const uint32_t *offs, const uint32_t *lens,
                          uint32_t n, uint32_t vni, const uint32_t *gro_addrs, uint32_t n_gro, uint8_t *out,
                          size_t out_cap, struct eg_in_result *res, size_t *out_used)
{
    struct gro g = {0};
    size_t pos = 0;
    uint32_t i;
    if (out_cap > UINT32_MAX)
        out_cap = UINT32_MAX;
    for (i = 0; i < n; i++) {
        struct eg_in_result *r = &res[i];
        r->dst = 0;
        r->off = 0;
        r->len = 0;
        if (!in || offs[i] > in_len || lens[i] > in_len - offs[i]) {
            r->status = EG_ERR_SLICE;
            continue;
        }
        const uint8_t *d = in + offs[i];
        size_t len = lens[i];
        if (len < 8) {
            r->status = EG_ERR_SHORT_VXLAN;
            continue;
        }
        if (len < EG_PREFIX_LEN) {
            r->status = EG_ERR_SHORT_ETHERNET;
            continue;
        }
        if (!(d[0] & 0x08)) {
            r->status = EG_ERR_VXLAN_FLAGS;
            continue;
        }
        if ((((uint32_t)d[4] << 16) | ((uint32_t)d[5] << 8) | d[6]) != vni) {
            r->status = EG_ERR_UNKNOWN_VNI;
            continue;
        }
        uint32_t et = rd16(d + 20);
        if (et == 0x0806) {
            r->status = EG_ARP;
            continue;
        }
        if (et != 0x0800) {
            r->status = EG_ERR_ETHERTYPE;
            continue;
        }
        const uint8_t *ip = d + EG_PREFIX_LEN;
        size_t avail = len - EG_PREFIX_LEN;
        if (avail < 20 || (ip[0] >> 4) != 4 || (ip[0] & 15) < 5) {
            r->status = EG_ERR_IP_HEADER;
            continue;
        }
        /* A header longer than the datagram fails here too (tot >= ihl > avail), as in inner_ipv4. */
        uint32_t ihl = (uint32_t)(ip[0] & 15) * 4, tot = rd16(ip + 2);
        if (tot < ihl || tot > avail) { /* bytes past tot are Ethernet padding */
            r->status = EG_ERR_IP_LENGTH;
            continue;
        }
        r->dst = rd32(ip + 16);
        int cand = n_gro && gro_addrs && ip[9] == 6 && in_gro_table(r->dst, gro_addrs, n_gro) &&
                   gro_shape(ip, tot);
        uint32_t thlen = cand ? (uint32_t)(ip[32] >> 4) * 4 : 0, payload = cand ? tot - 20 - thlen : 0;
        if (cand && g.active) {
            uint8_t *fr = out + g.off, *head = fr + 4 + EG_VNET_HDR_LEN;
            if (gro_fits(&g, head, ip, tot) && payload <= out_cap - pos) {
                /* Copied before its checksums are known: past `pos` is scratch until committed. */
                if (gro_sums_ok(ip, tot, csum_copy(out + pos, ip + 20 + thlen, payload))) {
                    pos += payload;
                    g.ip_len += payload;
                    g.next_seq += payload;
                    g.nseg++;
                    if (payload < g.mss)
                        g.closed = 1;
                    uint8_t *ht = head + 20;
                    if (ip[20 + 13] & TH_PSH) {
                        ht[13] |= TH_PSH;
                        g.closed = 1;
                    }
                    wr32(fr, EG_VNET_HDR_LEN + g.ip_len);
                    uint8_t *vh = fr + 4;
                    vh[0] = VNET_NEEDS_CSUM;
                    vh[1] = GSO_TCPV4;
                    wrle16(vh + 2, 20 + thlen);
                    wrle16(vh + 4, g.mss);
                    wrle16(vh + 6, 20);
                    wrle16(vh + 8, 16);
                    wr16(head + 2, g.ip_len);
                    wr16(head + 10, 0);
                    wr16(head + 10, (uint16_t)~eg_csum(head, 20, 0));
                    wr16(ht + 16, pseudo_sum(rd32(head + 12), rd32(head + 16), 6, g.ip_len - 20));
                    res[g.head].len = 4 + EG_VNET_HDR_LEN + g.ip_len;
                    r->status = EG_MERGED;
                    r->off = (uint32_t)g.off;
                    r->len = res[g.head].len;
                    continue;
                }
                cand = 0;
            }
        }
        size_t need = 4 + EG_VNET_HDR_LEN + (size_t)tot;
        if (need > out_cap - pos) {
            if (pos == 0) {
                r->status = EG_ERR_NO_SPACE;
                r->dst = 0;
                continue;
            }
            break;
        }
        uint8_t *fr = out + pos, *q = fr + 4 + EG_VNET_HDR_LEN;
        wr32(fr, EG_VNET_HDR_LEN + tot);
        memset(fr + 4, 0, EG_VNET_HDR_LEN);
        if (cand) {
            memcpy(q, ip, 20 + thlen);
            cand = gro_sums_ok(ip, tot, csum_copy(q + 20 + thlen, ip + 20 + thlen, payload));
        } else {
            memcpy(q, ip, tot);
        }
        r->status = EG_OK;
        r->off = (uint32_t)pos;
        r->len = (uint32_t)need;
        g.active = cand;
        if (cand) {
            const uint8_t *t = ip + 20;
            g.closed = (t[13] & TH_PSH) != 0;
            g.head = i;
            g.off = pos;
            g.ip_len = tot;
            g.thlen = thlen;
            g.mss = payload;
            g.next_seq = rd32(t + 4) + g.mss;
            g.nseg = 1;
        }
        pos += need;
    }
    *out_used = pos;
    return i;
}

uint32_t eg_split_frames(const uint8_t *buf, size_t len, uint32_t *offs, uint32_t *lens, uint32_t max,
                         size_t *consumed, int *bad)
{
    size_t pos = 0;
    uint32_t cnt = 0;
    *bad = 0;
    if (len > UINT32_MAX)
        len = UINT32_MAX;
    while (buf && cnt < max && len - pos >= 4) {
        uint32_t fl = rd32(buf + pos);
        if (fl < MIN_FRAME || fl > MAX_FRAME) {
            *bad = 1;
            break;
        }
        if (fl > len - pos - 4)
            break;
        offs[cnt] = (uint32_t)(pos + 4);
        lens[cnt] = fl;
        cnt++;
        pos += 4 + (size_t)fl;
    }
    *consumed = pos;
    return cnt;
}
