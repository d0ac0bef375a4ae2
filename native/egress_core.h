/* Egress packet core: per-packet transforms for the egress router (see forwarder/egress/fastpath.py).
 *
 * Every function takes caller-owned buffers, allocates nothing and returns counts or a status code.
 * Every input byte is distrusted: the Python validator runs first, but these functions bound-check all
 * they read and write on their own, and check everything before writing anything, so a refused frame
 * leaves the caller's buffers as they were.
 *
 * Numbers cross this interface in host order (addresses as the u32 value of a.b.c.d), bytes on the wire
 * in network order. native/build_egress.py gives cffi this header (past the includes, comments dropped)
 * as its cdef: keep it to plain integer #defines, structs and prototypes.
 */
#ifndef EGRESS_CORE_H
#define EGRESS_CORE_H

#include <stddef.h>
#include <stdint.h>

#define EG_VNET_HDR_LEN 10
#define EG_PREFIX_LEN 22 /* VXLAN header 8 + inner Ethernet header 14 */

/* Status codes: >= 0 success, < 0 refusal. core_types.REASONS names each for metrics with the token the
 * Python layer uses for the same fault (validate_outbound for guest frames, vxlan.decap/inner_ipv4 for
 * datagrams from the exit), so one fault is counted under one name whichever layer saw it. */
#define EG_OK 0
#define EG_MERGED 1 /* inbound: appended to an earlier frame of the same batch */
#define EG_ARP 2    /* inbound: an ARP frame, left to the caller */
/* Only here: the caller's (offset, length) lies outside its input buffer, or a NULL buffer: our bug. */
#define EG_ERR_SLICE -1             /* bad_slice */
/* Outbound (guest frames), in the order the checks run. */
#define EG_ERR_SHORT_HEADER -2      /* short_header */
#define EG_ERR_IP_HEADER -3         /* bad_ip_header */
#define EG_ERR_IP_OPTIONS -4        /* ip_options */
#define EG_ERR_IP_LENGTH -5         /* bad_ip_length (also inbound) */
#define EG_ERR_L4_HEADER -6         /* bad_l4_header */
#define EG_ERR_ICMP_QUOTE -7        /* bad_icmp_quote */
#define EG_ERR_FRAGMENT -8          /* fragment: here only a fragment asking for a checksum or GSO */
#define EG_ERR_UNSUPPORTED_PROTO -9 /* unsupported_proto: here only a checksum asked on one */
#define EG_ERR_ICMP_CSUM -10        /* icmp_csum */
#define EG_ERR_CSUM_START -11       /* bad_csum_start */
#define EG_ERR_CSUM_OFFSET -12      /* bad_csum_offset */
#define EG_ERR_GSO_TYPE -13         /* bad_gso_type */
#define EG_ERR_GSO_PROTO -14        /* gso_proto_mismatch */
#define EG_ERR_ZERO_GSO_SIZE -15    /* zero_gso_size */
#define EG_ERR_SIZE -16             /* size */
/* Only here: the caller's output buffer (or send array) cannot hold even this one frame. */
#define EG_ERR_NO_SPACE -17         /* no_space */
/* Inbound (VXLAN datagrams), in order; bad_ip_header and bad_ip_length as above. */
#define EG_ERR_SHORT_VXLAN -18      /* short_vxlan */
#define EG_ERR_SHORT_ETHERNET -19   /* short_ethernet */
#define EG_ERR_VXLAN_FLAGS -20      /* vxlan_flags */
#define EG_ERR_UNKNOWN_VNI -21      /* unknown_vni */
#define EG_ERR_ETHERTYPE -22        /* unsupported_ethertype */
/* Outbound, checked right after EG_ERR_ICMP_QUOTE (numbered last to keep the others stable). */
#define EG_ERR_ICMP_QUOTE_SRC -23   /* icmp_quote_source: an ICMP error's quoted source is not its destination */

struct eg_out_params {
    uint32_t claim;          /* the claim's overlay address: every source becomes this */
    uint32_t mtu;            /* largest inner IPv4 packet put on the wire */
    uint32_t max_segs;       /* most wire packets one frame may become; 0 = no limit */
    uint32_t max_gso_segs;   /* most records in one send (the kernel's UDP_MAX_SEGMENTS) */
    uint32_t max_send_bytes; /* most bytes in one send (65507 for UDP over IPv4) */
    uint8_t prefix[EG_PREFIX_LEN]; /* VXLAN header + inner Ethernet header, copied before each packet */
};

struct eg_seg_info {
    uint32_t packets; /* wire packets (records) written */
    uint32_t bytes;   /* bytes written, prefixes included */
    uint32_t stride;  /* record size: every record but the last has exactly this size */
};

struct eg_out_result {
    int32_t status;
    uint32_t packets;
    uint32_t off; /* where this frame's records start in the send buffer */
    uint32_t len;
};

/* One sendmsg: `count` records at `off`, all `seg` bytes except the last (<= seg); UDP_SEGMENT = seg. */
struct eg_send {
    uint32_t off;
    uint32_t len;
    uint32_t seg;
    uint32_t count;
};

struct eg_in_result {
    int32_t status;
    uint32_t dst; /* inner IPv4 destination (0 unless status >= 0 and not EG_ARP) */
    uint32_t off; /* the delivery frame (u32 len | vnet hdr | IPv4) this packet went into */
    uint32_t len; /* that frame's length; final on the frame's first packet once the batch returns */
};

/* Ones' complement sum of p[0..n) added to `initial`, folded to 16 bits, NOT inverted. */
uint16_t eg_csum(const uint8_t *p, size_t n, uint16_t initial);
/* RFC 1624 update of a checksum field for a 32-bit word changing from `from` to `to` (both aligned at
 * an even offset). partial != 0: the field holds a non-inverted partial sum (virtio NEEDS_CSUM). */
uint16_t eg_csum_update32(uint16_t check, uint32_t from, uint32_t to, int partial);
/* Identity rewrite in place of frame = vnet hdr + IPv4 packet. Returns EG_OK or an EG_ERR_*. */
int eg_rewrite(uint8_t *frame, size_t len, uint32_t claim);
/* One frame -> wire records in out. Returns EG_OK (info filled) or an EG_ERR_*. */
int eg_segment(const uint8_t *frame, size_t len, const struct eg_out_params *p, uint8_t *out, size_t cap,
               struct eg_seg_info *info);
/* Frames in[offs[i] .. +lens[i]) -> records in out, grouped into sends. Returns frames consumed. */
uint32_t eg_outbound_batch(const uint8_t *in, size_t in_len, const uint32_t *offs, const uint32_t *lens,
                           uint32_t n, const struct eg_out_params *p, uint8_t *out, size_t out_cap,
                           struct eg_out_result *res, struct eg_send *sends, uint32_t max_sends,
                           uint32_t *n_sends, size_t *out_used);
/* VXLAN datagrams (UDP payloads) -> delivery frames in out, merging TCP segments of one flow for
 * destinations in the sorted array gro_addrs. Returns datagrams consumed. */
uint32_t eg_inbound_batch(const uint8_t *in, size_t in_len, const uint32_t *offs, const uint32_t *lens,
                          uint32_t n, uint32_t vni, const uint32_t *gro_addrs, uint32_t n_gro, uint8_t *out,
                          size_t out_cap, struct eg_in_result *res, size_t *out_used);
/* Split a guest stream buffer (u32 len | frame ...) into frame offsets/lengths (the frame excludes the
 * u32). Stops at a partial frame, at max, or at a bad length (*bad = 1). Returns frames found. */
uint32_t eg_split_frames(const uint8_t *buf, size_t len, uint32_t *offs, uint32_t *lens, uint32_t max,
                         size_t *consumed, int *bad);

#endif
