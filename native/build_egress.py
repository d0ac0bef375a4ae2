"""cffi build of the egress packet core (``native._egress``); wrapped by ``forwarder.egress.fastpath``."""

import os
from pathlib import Path

from cffi import FFI

_here = Path(__file__).parent


def _rel(name: str) -> str:
    # setuptools refuses absolute source paths; relative to the working directory (the repo root
    # when setup.py runs) this is native/<name> however the file was imported.
    return os.path.relpath(_here / name)


CDEF = """
#define EG_VNET_HDR_LEN 10
#define EG_PREFIX_LEN 22
#define EG_OK 0
#define EG_MERGED 1
#define EG_ARP 2
#define EG_ERR_SLICE -1
#define EG_ERR_SHORT_HEADER -2
#define EG_ERR_IP_HEADER -3
#define EG_ERR_IP_OPTIONS -4
#define EG_ERR_IP_LENGTH -5
#define EG_ERR_L4_HEADER -6
#define EG_ERR_ICMP_QUOTE -7
#define EG_ERR_FRAGMENT -8
#define EG_ERR_UNSUPPORTED_PROTO -9
#define EG_ERR_ICMP_CSUM -10
#define EG_ERR_CSUM_START -11
#define EG_ERR_CSUM_OFFSET -12
#define EG_ERR_GSO_TYPE -13
#define EG_ERR_GSO_PROTO -14
#define EG_ERR_ZERO_GSO_SIZE -15
#define EG_ERR_SIZE -16
#define EG_ERR_NO_SPACE -17
#define EG_ERR_SHORT_VXLAN -18
#define EG_ERR_SHORT_ETHERNET -19
#define EG_ERR_VXLAN_FLAGS -20
#define EG_ERR_UNKNOWN_VNI -21
#define EG_ERR_ETHERTYPE -22

struct eg_out_params {
    uint32_t claim;
    uint32_t mtu;
    uint32_t max_segs;
    uint32_t max_gso_segs;
    uint32_t max_send_bytes;
    uint8_t prefix[22];
};
struct eg_seg_info { uint32_t packets; uint32_t bytes; uint32_t stride; };
struct eg_out_result { int32_t status; uint32_t packets; uint32_t off; uint32_t len; };
struct eg_send { uint32_t off; uint32_t len; uint32_t seg; uint32_t count; };
struct eg_in_result { int32_t status; uint32_t dst; uint32_t off; uint32_t len; };

uint16_t eg_csum(const uint8_t *p, size_t n, uint16_t initial);
uint16_t eg_csum_update32(uint16_t check, uint32_t from, uint32_t to, int partial);
int eg_rewrite(uint8_t *frame, size_t len, uint32_t claim);
int eg_segment(const uint8_t *frame, size_t len, const struct eg_out_params *p, uint8_t *out, size_t cap,
               struct eg_seg_info *info);
uint32_t eg_outbound_batch(const uint8_t *in, size_t in_len, const uint32_t *offs, const uint32_t *lens,
                           uint32_t n, const struct eg_out_params *p, uint8_t *out, size_t out_cap,
                           struct eg_out_result *res, struct eg_send *sends, uint32_t max_sends,
                           uint32_t *n_sends, size_t *out_used);
uint32_t eg_inbound_batch(const uint8_t *in, size_t in_len, const uint32_t *offs, const uint32_t *lens,
                          uint32_t n, uint32_t vni, const uint32_t *gro_addrs, uint32_t n_gro, uint8_t *out,
                          size_t out_cap, struct eg_in_result *res, size_t *out_used);
uint32_t eg_split_frames(const uint8_t *buf, size_t len, uint32_t *offs, uint32_t *lens, uint32_t max,
                         size_t *consumed, int *bad);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "native._egress",
    '#include "egress_core.h"',
    sources=[_rel("egress_core.c")],
    include_dirs=[_rel(".")],
    depends=[_rel("egress_core.h")],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
