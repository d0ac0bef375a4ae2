"""Regenerates the egress seed corpora (run by hand; the files are committed):
tests/seeds/egress_frames/, tests/seeds/vxlan/, tests/seeds/arp/.

Each seed is what the target's ``one_input`` takes (a selector byte, then the bytes parsed). Names are
``<expected>-<what>``, where ``expected`` is ``ok`` or the refusal reason the target's ``classify``
must return; tests/fuzz/test_seed_replay.py checks every name on every run.
Usage: .venv/bin/python tests/fuzz/make_proto_seeds.py
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import dpkt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))

from fuzz_egress_frames import MODE_CHUNKED, MODE_HELLO, MODE_STREAM, selector  # noqa: E402
from seed_dir import write_seeds  # noqa: E402

from forwarder.egress.arp import ArpPacket, gratuitous_arp, push_arp  # noqa: E402
from forwarder.egress.stream import Hello, push_frame, push_hello  # noqa: E402
from forwarder.egress.vnet import GSO_ECN, GSO_TCPV4, GSO_UDP, GSO_UDP_L4, VnetHdr, push_vnet_hdr  # noqa: E402
from forwarder.egress.vxlan import ETH_P_ARP, ETH_P_IP, encap, push_vxlan  # noqa: E402

SEEDS = HERE.parent / "seeds"
SRC = bytes([10, 0, 0, 2])
DST = bytes([93, 184, 216, 34])
OTHER_CLAIM = bytes([100, 64, 10, 8])


def tcp(payload: int = 64, opts: bytes = b"") -> bytes:
    seg = dpkt.tcp.TCP(sport=40000, dport=443, seq=1, flags=0x18, opts=opts, data=b"t" * payload)
    seg.off = (20 + len(opts)) // 4
    return bytes(dpkt.ip.IP(src=SRC, dst=DST, p=6, id=1, data=seg))


def udp(payload: int = 64, src: bytes = SRC, dst: bytes = DST) -> bytes:
    return bytes(dpkt.ip.IP(src=src, dst=dst, p=17,
                            data=dpkt.udp.UDP(sport=5353, dport=53, ulen=8 + payload, data=b"u" * payload)))


def icmp(payload: int = 56) -> bytes:
    msg = dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=7, seq=1, data=b"p" * payload))
    return bytes(dpkt.ip.IP(src=SRC, dst=DST, p=1, data=msg))


def icmp_error(quoted: bytes) -> bytes:
    msg = dpkt.icmp.ICMP(type=3, code=3, data=dpkt.icmp.ICMP.Unreach(data=quoted))
    return bytes(dpkt.ip.IP(src=SRC, dst=DST, p=1, data=msg))


def vnet(flags: int = 0, gso: int = 0, hdr_len: int = 0, size: int = 0, start: int = 0, off: int = 0) -> bytes:
    return push_vnet_hdr(VnetHdr(flags, gso, hdr_len, size, start, off))


def patch(pkt: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(pkt)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def frame_seeds() -> dict[str, bytes]:
    f0 = bytes([selector()])  # MTU 1500, host offloads, one frame
    cases: dict[str, bytes] = {
        "ok-tcp": vnet() + tcp(),
        "ok-tcp-options": vnet() + tcp(8, b"\x01" * 40),
        "ok-udp-csum": vnet(1, 0, 0, 0, 20, 6) + udp(),
        "ok-icmp-echo": vnet() + icmp(),
        "ok-tso": vnet(1, GSO_TCPV4, 54, 1448, 20, 16) + tcp(65535 - 40),
        "ok-tso-ecn": vnet(1, GSO_TCPV4 | GSO_ECN, 54, 1000, 20, 16) + tcp(5000),
        "ok-uso": vnet(1, GSO_UDP_L4, 28, 1200, 20, 6) + udp(12000),
        "ok-mtu-exact": vnet() + udp(1472),
        "short_header-9": bytes(9),
        "bad_ip_header-ipv6": vnet() + b"\x60" + tcp()[1:],
        "bad_ip_header-short": vnet() + tcp()[:19],
        "ip_options": vnet() + patch(tcp(), 0, "!B", 0x46),
        "bad_ip_length": vnet() + tcp() + b"\0",
        "fragment-mf": vnet() + patch(tcp(), 6, "!H", 0x2000),
        "unsupported_proto-gre": vnet() + patch(tcp(), 9, "!B", 47),
        "bad_l4_header-tcp-doff": vnet() + patch(tcp(0), 32, "!B", 0xF0),
        "bad_l4_header-udp-len": vnet() + patch(udp(), 24, "!H", 9),
        # an ICMP error quotes the packet that caused it, which came from the error's destination
        "ok-icmp-error": vnet() + icmp_error(udp(src=DST, dst=SRC)[:28]),
        # an ICMP error whose quote cannot take the claim address
        "bad_icmp_quote-short": vnet() + icmp_error(udp(src=DST, dst=SRC)[:19]),
        "bad_icmp_quote-not-ipv4": vnet() + icmp_error(b"\x60" + udp(src=DST, dst=SRC)[1:28]),
        # an ICMP error quoting a packet from someone else: another claim's overlay address would leave
        "icmp_quote_source-other-claim": vnet() + icmp_error(udp(src=OTHER_CLAIM, dst=SRC)[:28]),
        "icmp_quote_source-own-packet": vnet() + icmp_error(udp()[:28]),
        "bad_vnet_flags": vnet(0x10) + tcp(),
        "bad_hdr_len": vnet(0, 0, 0xFFFF) + tcp(),
        "icmp_csum": vnet(1, 0, 0, 0, 20, 2) + icmp(),
        # the checksum write aimed into the IPv4 header: at the destination, the header checksum, the source
        "bad_csum_start-aimed-at-ip-dst": vnet(1, 0, 0, 0, 0, 16) + tcp(),
        "bad_csum_start-aimed-at-ip-csum": vnet(1, 0, 0, 0, 0, 10) + udp(),
        "bad_csum_start-aimed-at-ip-src-via-start": vnet(1, 0, 0, 0, 12, 0) + tcp(),
        "bad_csum_start-gso-aimed-at-ip-dst": vnet(1, GSO_TCPV4, 0, 1000, 4, 12) + tcp(3000),
        "bad_csum_offset-past-header": vnet(1, 0, 0, 0, 20, 0xFFF0) + udp(),
        "bad_csum_offset-tcp-offset-on-udp": vnet(1, 0, 0, 0, 20, 16) + udp(),
        "bad_gso_type-ufo": vnet(1, GSO_UDP, 0, 1000, 20, 6) + udp(3000),
        "bad_gso_type-ecn-alone": vnet(0, GSO_ECN) + tcp(),
        # a TCP GSO type on a UDP packet
        "gso_proto_mismatch-tcpv4-on-udp": vnet(1, GSO_TCPV4, 0, 1000, 20, 6) + udp(3000),
        "gso_proto_mismatch-uso-on-tcp": vnet(1, GSO_UDP_L4, 0, 1000, 20, 16) + tcp(3000),
        "gso_needs_csum": vnet(0, GSO_TCPV4, 0, 1000) + tcp(3000),
        "zero_gso_size": vnet(1, GSO_TCPV4, 0, 0, 20, 16) + tcp(3000),
        "bad_gso_size": vnet(0, 0, 0, 1000) + tcp(),
        "size-over-mtu": vnet() + tcp(1461),
        "size-segment-over-mtu": vnet(1, GSO_TCPV4, 0, 1461, 20, 16) + tcp(3000),
        "size-129-segments": vnet(1, GSO_UDP_L4, 0, 100, 20, 6) + udp(12801),
    }
    out = {name: f0 + data for name, data in cases.items()}
    out["offload_not_negotiated-tso-without-tso4"] = bytes([selector(0, 4)]) + cases["ok-tso"]
    out["offload_not_negotiated-csum-none"] = bytes([selector(0, 1)]) + cases["ok-udp-csum"]
    stream = b"".join(push_frame(f[:10], f[10:]) for f in (cases["ok-tcp"], cases["ok-uso"], cases["ok-icmp-echo"]))
    out["ok-stream-three"] = bytes([selector(0, 0, MODE_STREAM)]) + stream
    out["ok-stream-chunked"] = bytes([selector(0, 0, MODE_CHUNKED)]) + stream + stream[:17]
    out["bad_frame_length-short"] = bytes([selector(0, 0, MODE_STREAM)]) + stream + b"\0\0\0\x1d" + bytes(29)
    out["bad_frame_length-huge-chunked"] = bytes([selector(0, 0, MODE_CHUNKED)]) + stream + b"\xff" * 8
    out["gso_proto_mismatch-in-stream"] = bytes([selector(0, 0, MODE_STREAM)]) + push_frame(
        vnet(1, GSO_TCPV4, 0, 1000, 20, 6), udp(3000)) + stream
    hello = push_hello(Hello(1, 1, 0x23, 1500, 0))
    out["ok-hello-then-stream"] = bytes([selector(0, 0, MODE_HELLO)]) + hello + stream
    out["hello_reserved"] = bytes([selector(0, 0, MODE_HELLO)]) + hello[:10] + b"\0\1" + stream
    out["hello_version"] = bytes([selector(0, 0, MODE_HELLO)]) + b"\0\2" + hello[2:]
    # hello without TSO4: the stream's TSO frame is refused as not negotiated
    out["offload_not_negotiated-after-hello"] = bytes([selector(0, 0, MODE_HELLO)]) + push_hello(
        Hello(1, 1, 0x01, 1500, 0)) + push_frame(cases["ok-tso"][:10], cases["ok-tso"][10:])
    out["ok-empty"] = b""
    return out


def vxlan_seeds() -> dict[str, bytes]:
    router = bytes.fromhex("02005e000001")
    exit_mac = bytes.fromhex("0200c0ffee01")
    pkt = udp(10)
    arp = push_arp(ArpPacket(1, exit_mac, 0x64400001, bytes(6), 0x64400102))
    good = encap(7, router, exit_mac, ETH_P_IP, pkt)
    all_checks = b"\x07"
    return {
        "ok-ipv4": all_checks + good,
        "ok-ipv4-padded": all_checks + good + bytes(20),
        "ok-arp-request": all_checks + encap(7, b"\xff" * 6, exit_mac, ETH_P_ARP, arp),
        "ok-gratuitous": all_checks + push_vxlan(7) + gratuitous_arp(0x64400001, exit_mac),
        "unknown_vtep": b"\x06" + good,
        "short_vxlan": all_checks + good[:7],
        "vxlan_flags": all_checks + b"\x0c" + good[1:],
        "vxlan_reserved": all_checks + good[:7] + b"\x01" + good[8:],
        "unknown_vni": all_checks + encap(8, router, exit_mac, ETH_P_IP, pkt),
        "short_ethernet": all_checks + good[:21],
        "unsupported_ethertype-vlan": all_checks + good[:20] + b"\x81\x00" + good[22:],
        "foreign_mac": all_checks + encap(7, exit_mac, exit_mac, ETH_P_IP, pkt),
        "bad_ip_header-ipv6-in-ipv4-type": all_checks + encap(7, router, exit_mac, ETH_P_IP, b"\x60" + pkt[1:]),
        "bad_ip_length": all_checks + encap(7, router, exit_mac, ETH_P_IP, pkt[:-1]),
        "arp_not_ipv4": all_checks + encap(7, router, exit_mac, ETH_P_ARP, b"\0\6" + arp[2:]),
        "ok-no-checks": b"\x01" + encap(9, exit_mac, exit_mac, ETH_P_IP, pkt),
    }


def arp_seeds() -> dict[str, bytes]:
    exit_mac = bytes.fromhex("0200c0ffee01")
    req = push_arp(ArpPacket(1, exit_mac, 0x64400001, bytes(6), 0x64400102))
    return {
        "ok-request-armed": b"\x01" + req,
        "ok-request-not-armed": b"\x00" + req,
        "ok-request-padded": b"\x01" + req + bytes(18),
        "ok-reply": b"\x01" + push_arp(ArpPacket(2, exit_mac, 0x64400001, bytes(6), 0x64400102)),
        "ok-broadcast-asker": b"\x01" + push_arp(ArpPacket(1, b"\xff" * 6, 0x64400001, bytes(6), 0x64400102)),
        "ok-gratuitous": b"\x01" + gratuitous_arp(0x64400102, exit_mac)[14:],
        "short_arp": b"\x01" + req[:27],
        "arp_not_ipv4-ptype": b"\x01" + req[:2] + b"\x86\xdd" + req[4:],
        "arp_not_ipv4-hlen": b"\x01" + req[:4] + b"\x08" + req[5:],
        "bad_arp_op-rarp": b"\x01" + req[:6] + b"\x00\x03" + req[8:],
    }


def main() -> None:
    for target, seeds in (("egress_frames", frame_seeds()), ("vxlan", vxlan_seeds()), ("arp", arp_seeds())):
        write_seeds(SEEDS / target, seeds)


if __name__ == "__main__":
    main()
