"""virtio_net_hdr (10 bytes, little-endian) and the TUN_F_* offload bits the stream hello negotiates.

Layout (``struct virtio_net_hdr`` without ``num_buffers``): flags u8, gso_type u8, hdr_len u16,
gso_size u16, csum_start u16, csum_offset u16. The guest's values are data to be judged by
``validate.validate_outbound``; ``hdr_len`` in particular is never used to index anything.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from forwarder.egress.errors import FrameRefused
from sbxnet.errors import LocalProtocolError

VNET_HDR_LEN = 10

VIRTIO_NET_HDR_F_NEEDS_CSUM = 1
VIRTIO_NET_HDR_F_DATA_VALID = 2

GSO_NONE = 0
GSO_TCPV4 = 1
GSO_UDP = 3
GSO_TCPV6 = 4
GSO_UDP_L4 = 5
GSO_ECN = 0x80

# TUN_F_* offload bits (linux/if_tun.h), carried big-endian in the stream hello.
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
TUN_F_TSO_ECN = 0x08
TUN_F_UFO = 0x10
TUN_F_USO4 = 0x20
TUN_F_USO6 = 0x40
TUN_F_ALL = 0x7F
# What this host implements: IPv4 only, no UFO (it fragments), so TSO6/UFO/USO6 are never granted.
HOST_OFFLOADS = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO_ECN | TUN_F_USO4

_HDR = struct.Struct("<BBHHHH")


@dataclass(frozen=True, slots=True)
class VnetHdr:
    flags: int
    gso_type: int
    hdr_len: int
    gso_size: int
    csum_start: int
    csum_offset: int


VNET_HDR_NONE = VnetHdr(0, GSO_NONE, 0, 0, 0, 0)


def pull_vnet_hdr(buf: bytes | bytearray | memoryview) -> VnetHdr:
    """Decode the first 10 bytes of ``buf``; raises ``FrameRefused("short_header")`` if fewer.

    No field is judged here: every u8/u16 value decodes. ``validate_outbound`` decides what is allowed.
    """
    if len(buf) < VNET_HDR_LEN:
        raise FrameRefused("short_header", f"{len(buf)} bytes, need {VNET_HDR_LEN}")
    return VnetHdr(*_HDR.unpack_from(buf, 0))


def push_vnet_hdr(h: VnetHdr) -> bytes:
    """Encode ``h``; raises ``LocalProtocolError("vnet_field")`` if a field does not fit its width."""
    try:
        return _HDR.pack(h.flags, h.gso_type, h.hdr_len, h.gso_size, h.csum_start, h.csum_offset)
    except struct.error as exc:
        raise LocalProtocolError("vnet_field", str(exc)) from None
