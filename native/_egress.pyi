"""``native._egress``, built by native/build_egress.py from native/egress_core.h (the contract of each
function is there); wrapped by forwarder/egress/fastpath.py."""

from native._cffi_types import FFI, CData

class Lib:
    EG_VNET_HDR_LEN: int
    EG_PREFIX_LEN: int
    EG_OK: int
    EG_MERGED: int
    EG_ARP: int
    EG_ERR_SLICE: int
    EG_ERR_SHORT_HEADER: int
    EG_ERR_IP_HEADER: int
    EG_ERR_IP_OPTIONS: int
    EG_ERR_IP_LENGTH: int
    EG_ERR_L4_HEADER: int
    EG_ERR_ICMP_QUOTE: int
    EG_ERR_FRAGMENT: int
    EG_ERR_UNSUPPORTED_PROTO: int
    EG_ERR_ICMP_CSUM: int
    EG_ERR_CSUM_START: int
    EG_ERR_CSUM_OFFSET: int
    EG_ERR_GSO_TYPE: int
    EG_ERR_GSO_PROTO: int
    EG_ERR_ZERO_GSO_SIZE: int
    EG_ERR_SIZE: int
    EG_ERR_NO_SPACE: int
    EG_ERR_SHORT_VXLAN: int
    EG_ERR_SHORT_ETHERNET: int
    EG_ERR_VXLAN_FLAGS: int
    EG_ERR_UNKNOWN_VNI: int
    EG_ERR_ETHERTYPE: int
    EG_ERR_ICMP_QUOTE_SRC: int
    def eg_csum(self, p: CData | bytes, n: int, initial: int, /) -> int: ...
    def eg_csum_update32(self, check: int, from_: int, to: int, partial: int, /) -> int: ...
    def eg_rewrite(self, frame: CData, len: int, claim: int, /) -> int: ...
    def eg_segment(self, frame: CData | bytes, len: int, p: CData, out: CData, cap: int, info: CData, /) -> int: ...
    def eg_outbound_batch(
        self, in_: CData | bytes, in_len: int, offs: CData, lens: CData, n: int, p: CData, out: CData, out_cap: int,
        res: CData, sends: CData, max_sends: int, n_sends: CData, out_used: CData, /,
    ) -> int: ...
    def eg_inbound_batch(
        self, in_: CData | bytes, in_len: int, offs: CData, lens: CData, n: int, vni: int, gro_addrs: CData,
        n_gro: int, out: CData, out_cap: int, res: CData, out_used: CData, /,
    ) -> int: ...
    def eg_split_frames(
        self, buf: CData | bytes, len: int, offs: CData, lens: CData, max: int, consumed: CData, bad: CData, /
    ) -> int: ...

ffi: FFI
lib: Lib
