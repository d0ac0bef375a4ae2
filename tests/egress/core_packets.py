"""Packets for the packet-core tests, built and checked by dpkt (an independent implementation).

Addresses are ints (host order) as the core takes them; dpkt gets their 4-byte form.
"""

from __future__ import annotations

import struct

import dpkt

from forwarder.egress import reference as ref
from forwarder.egress.core_types import PREFIX_LEN, VNET_HDR_LEN, vxlan_eth_prefix

GUEST = 0x0A000002  # 10.0.0.2: what the guest wrote
CLAIM = 0x64400A07  # 100.64.10.7: the claim's overlay address
REMOTE = 0x5DB8D822  # 93.184.216.34
GW_MAC = bytes.fromhex("020000000001")
ROUTER_MAC = bytes.fromhex("020000000002")
VNI = 4242
PREFIX = vxlan_eth_prefix(VNI, GW_MAC, ROUTER_MAC)


def a4(addr: int) -> bytes:
    return addr.to_bytes(4, "big")


def tcp(
    payload: bytes = b"",
    *,
    src: int = GUEST,
    dst: int = REMOTE,
    sport: int = 40000,
    dport: int = 443,
    seq: int = 1000,
    ack: int = 5000,
    flags: int = dpkt.tcp.TH_ACK,
    win: int = 502,
    opts: bytes = b"",
    ident: int = 7,
    df: bool = True,
    tos: int = 0,
    ttl: int = 64,
) -> bytes:
    """An IPv4/TCP packet with correct checksums (dpkt computes them)."""
    t = dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, ack=ack, flags=flags, win=win, opts=opts, data=payload)
    t.off = 5 + len(opts) // 4
    ip = dpkt.ip.IP(src=a4(src), dst=a4(dst), p=6, id=ident, tos=tos, ttl=ttl, data=t)
    ip.df = int(df)
    return bytes(ip)


def udp(
    payload: bytes = b"", *, src: int = GUEST, dst: int = REMOTE, sport: int = 5353, dport: int = 53,
    ident: int = 9, no_csum: bool = False,
) -> bytes:
    u = dpkt.udp.UDP(sport=sport, dport=dport, ulen=8 + len(payload), data=payload)
    ip = dpkt.ip.IP(src=a4(src), dst=a4(dst), p=17, id=ident, data=u)
    raw = bytearray(bytes(ip))
    if no_csum:
        raw[26:28] = b"\x00\x00"
    return bytes(raw)


def icmp_error(
    icmp_type: int, quoted: bytes, *, code: int = 3, src: int = GUEST, dst: int = REMOTE
) -> bytes:
    """An ICMP error (3 unreachable, 11 time exceeded, 12 parameter problem) quoting ``quoted``."""
    body = dpkt.icmp.ICMP.Unreach(data=quoted)  # the same 4-byte unused/pointer field for 11 and 12
    ic = dpkt.icmp.ICMP(type=icmp_type, code=code, data=body)
    ip = dpkt.ip.IP(src=a4(src), dst=a4(dst), p=1, id=3, data=ic)
    return bytes(ip)


def icmp_echo(payload: bytes = b"ping", *, src: int = GUEST, dst: int = REMOTE) -> bytes:
    ic = dpkt.icmp.ICMP(type=8, code=0, data=dpkt.icmp.ICMP.Echo(id=1, seq=2, data=payload))
    return bytes(dpkt.ip.IP(src=a4(src), dst=a4(dst), p=1, id=4, data=ic))


def vnet(flags: int = 0, gso_type: int = 0, hdr_len: int = 0, gso_size: int = 0, start: int = 0,
         offset: int = 0) -> bytes:
    return struct.pack("<BBHHHH", flags, gso_type, hdr_len, gso_size, start, offset)


def partial_form(ip: bytes) -> bytes:
    """``ip`` as a guest kernel hands it over with NEEDS_CSUM: the L4 checksum field holds the
    non-inverted pseudo-header sum, the rest of the L4 checksum left to whoever completes it."""
    b = bytearray(ip)
    ihl = (b[0] & 15) * 4
    proto = b[9]
    c = ihl + (16 if proto == 6 else 6)
    s = ref.pseudo_sum(int.from_bytes(b[12:16], "big"), int.from_bytes(b[16:20], "big"), proto, len(b) - ihl)
    b[c : c + 2] = s.to_bytes(2, "big")
    return bytes(b)


def csum_frame(ip: bytes, gso_type: int = 0, gso_size: int = 0) -> bytes:
    """A NEEDS_CSUM frame (partial checksum) around ``ip``, optionally GSO."""
    proto = ip[9]
    ihl = (ip[0] & 15) * 4
    l4h = (ip[ihl + 12] >> 4) * 4 if proto == 6 else 8
    return vnet(1, gso_type, ihl + l4h, gso_size, ihl, 16 if proto == 6 else 6) + partial_form(ip)


def complete(ip: bytes | bytearray) -> bytes:
    """Finish a NEEDS_CSUM packet the way a NIC does: sum the L4 bytes as they stand, store ~sum."""
    b = bytearray(ip)
    ihl = (b[0] & 15) * 4
    c = ihl + (16 if b[9] == 6 else 6)
    v = ~ref.csum(b[ihl:]) & 0xFFFF
    b[c : c + 2] = (0xFFFF if b[9] == 17 and v == 0 else v).to_bytes(2, "big")
    return bytes(b)


def dpkt_checked(raw: bytes | bytearray) -> dpkt.ip.IP:
    """Parse ``raw`` with dpkt and check, by having dpkt recompute them, the IPv4 header checksum and
    the TCP/UDP/ICMP checksum (a UDP checksum of 0 means none). Returns the parsed packet."""
    raw = bytes(raw)
    ip = dpkt.ip.IP(raw)
    assert ip.v == 4 and ip.len == len(raw), "IPv4 total length"
    assert dpkt.in_cksum(raw[: ip.hl * 4]) == 0, "IPv4 header checksum"
    again = dpkt.ip.IP(raw)
    again.sum = 0
    if isinstance(again.data, dpkt.tcp.TCP | dpkt.udp.UDP | dpkt.icmp.ICMP):
        if isinstance(again.data, dpkt.udp.UDP) and again.data.sum == 0:
            return ip
        want = ip.data.sum
        again.data.sum = 0
        if isinstance(again.data, dpkt.icmp.ICMP):
            got = dpkt.icmp.ICMP(bytes(again.data)).sum
        else:
            got = dpkt.ip.IP(bytes(again)).data.sum
        assert got == want, f"L4 checksum {want:#06x}, dpkt computes {got:#06x}"
    return ip


def records(out: bytes | bytearray | memoryview, stride: int, nbytes: int) -> list[bytes]:
    """Cut a send buffer into its records: all ``stride`` long but the last."""
    buf = bytes(out[:nbytes])
    return [buf[i : i + stride] for i in range(0, len(buf), stride)]


def inner(rec: bytes) -> bytes:
    """The inner IPv4 packet of a record, after checking its VXLAN and Ethernet headers."""
    assert rec[:PREFIX_LEN] == PREFIX, "VXLAN/Ethernet prefix"
    eth = dpkt.ethernet.Ethernet(rec[8:])
    assert eth.dst == GW_MAC and eth.src == ROUTER_MAC and eth.type == dpkt.ethernet.ETH_TYPE_IP
    return rec[PREFIX_LEN:]


def vxlan_datagram(ip: bytes, *, vni: int = VNI, pad_to: int = 0) -> bytes:
    """What an exit sends: VXLAN + Ethernet (exit MAC -> router MAC) + ``ip`` (+ Ethernet padding)."""
    body = vxlan_eth_prefix(vni, ROUTER_MAC, GW_MAC) + ip
    return body + bytes(max(0, pad_to - len(body)))


def frame_ip(frame: bytes | bytearray) -> bytes:
    return bytes(frame[VNET_HDR_LEN:])
