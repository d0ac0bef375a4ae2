"""The contract shared by the C packet core (``native/egress_core.c``) and its Python reference.

Status codes are the C ones (``EG_*``): ``>= 0`` success, ``< 0`` a refusal whose metrics token is
``REASONS[code]``. Addresses are ints in host order (``int(ipaddress.IPv4Address(...))``).
"""

from __future__ import annotations

from dataclasses import dataclass

from forwarder.egress.vnet import VNET_HDR_LEN as VNET_HDR_LEN  # re-exported: the contract in one import
from forwarder.egress.vxlan import ETH_HDR_LEN, ETH_P_IP, VXLAN_HDR_LEN, push_ethernet, push_vxlan
from forwarder.egress.vxlan import VXLAN_PORT as VXLAN_PORT
from sbxnet.errors import LocalProtocolError

PREFIX_LEN = VXLAN_HDR_LEN + ETH_HDR_LEN  # 22: VXLAN header + inner Ethernet header before every wire packet
UDP_MAX_PAYLOAD_V4 = 65507  # most bytes one UDP send over IPv4 can carry
UDP_MAX_SEGMENTS = 64  # Linux 6.1's UDP_MAX_SEGMENTS (128 from 6.9); the daemon may raise it

OK = 0
MERGED = 1
ARP = 2
ERR_SLICE = -1
ERR_SHORT_HEADER = -2
ERR_IP_HEADER = -3
ERR_IP_OPTIONS = -4
ERR_IP_LENGTH = -5
ERR_L4_HEADER = -6
ERR_ICMP_QUOTE = -7
ERR_FRAGMENT = -8
ERR_UNSUPPORTED_PROTO = -9
ERR_ICMP_CSUM = -10
ERR_CSUM_START = -11
ERR_CSUM_OFFSET = -12
ERR_GSO_TYPE = -13
ERR_GSO_PROTO = -14
ERR_ZERO_GSO_SIZE = -15
ERR_SIZE = -16
ERR_NO_SPACE = -17
ERR_SHORT_VXLAN = -18
ERR_SHORT_ETHERNET = -19
ERR_VXLAN_FLAGS = -20
ERR_UNKNOWN_VNI = -21
ERR_ETHERTYPE = -22
ERR_ICMP_QUOTE_SRC = -23  # checked right after ERR_ICMP_QUOTE; numbered last

# The metrics token of each refusal: the Python layer's name for the same fault (validate.py for guest
# frames, vxlan.py for datagrams from the exit). Only bad_slice and no_space are the core's own: they
# are the caller's doing, not the peer's.
REASONS: dict[int, str] = {
    ERR_SLICE: "bad_slice",
    ERR_SHORT_HEADER: "short_header",
    ERR_IP_HEADER: "bad_ip_header",
    ERR_IP_OPTIONS: "ip_options",
    ERR_IP_LENGTH: "bad_ip_length",
    ERR_L4_HEADER: "bad_l4_header",
    ERR_ICMP_QUOTE: "bad_icmp_quote",
    ERR_ICMP_QUOTE_SRC: "icmp_quote_source",
    ERR_FRAGMENT: "fragment",
    ERR_UNSUPPORTED_PROTO: "unsupported_proto",
    ERR_ICMP_CSUM: "icmp_csum",
    ERR_CSUM_START: "bad_csum_start",
    ERR_CSUM_OFFSET: "bad_csum_offset",
    ERR_GSO_TYPE: "bad_gso_type",
    ERR_GSO_PROTO: "gso_proto_mismatch",
    ERR_ZERO_GSO_SIZE: "zero_gso_size",
    ERR_SIZE: "size",
    ERR_NO_SPACE: "no_space",
    ERR_SHORT_VXLAN: "short_vxlan",
    ERR_SHORT_ETHERNET: "short_ethernet",
    ERR_VXLAN_FLAGS: "vxlan_flags",
    ERR_UNKNOWN_VNI: "unknown_vni",
    ERR_ETHERTYPE: "unsupported_ethertype",
}


def vxlan_eth_prefix(vni: int, dst_mac: bytes, src_mac: bytes) -> bytes:
    """The 22 bytes put before every wire packet: VXLAN (I flag, ``vni``) + Ethernet (``dst_mac`` =
    the exit gateway, ``src_mac`` = this router, type IPv4), built by the same codec as every other
    header the router sends. Raises ``LocalProtocolError`` on bad input."""
    return push_vxlan(vni) + push_ethernet(bytes(dst_mac), bytes(src_mac), ETH_P_IP)


@dataclass(frozen=True, slots=True)
class OutParams:
    """Per claim/exit settings for outbound segmentation (see ``struct eg_out_params``).

    ``mtu`` bounds every inner IPv4 packet put on the wire; ``max_segs`` the wire packets one frame may
    become (0: no limit); ``max_gso_segs``/``max_send_bytes`` how many records and bytes one send holds.
    """

    claim: int
    prefix: bytes
    mtu: int = 1500
    max_segs: int = 128
    max_gso_segs: int = UDP_MAX_SEGMENTS
    max_send_bytes: int = UDP_MAX_PAYLOAD_V4

    def __post_init__(self) -> None:
        if len(self.prefix) != PREFIX_LEN:
            raise LocalProtocolError("prefix", f"{len(self.prefix)} bytes, need {PREFIX_LEN}")
        for name in ("claim", "mtu", "max_segs", "max_gso_segs", "max_send_bytes"):
            v = getattr(self, name)
            if not 0 <= v < 1 << 32:
                raise LocalProtocolError(name, f"{v} does not fit u32")


@dataclass(frozen=True, slots=True)
class SegInfo:
    packets: int  # wire packets (records)
    bytes: int  # bytes written, prefixes included
    stride: int  # every record but the last is exactly this long


@dataclass(frozen=True, slots=True)
class Send:
    """One ``sendmsg``: ``count`` records at ``off``, each ``seg`` bytes but the last; UDP_SEGMENT = seg."""

    off: int
    len: int
    seg: int
    count: int


@dataclass(frozen=True, slots=True)
class OutResult:
    status: int
    packets: int
    off: int
    len: int


@dataclass(frozen=True, slots=True)
class InResult:
    status: int
    dst: int
    off: int
    len: int
