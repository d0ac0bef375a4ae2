"""Writes the seed corpora of fuzz_rewrite and fuzz_segment (run by hand: python tests/fuzz/make_egress_seeds.py).

Each seed is one selector byte (see the targets) followed by a frame. The corpora include the two cases
the design names: a checksum offset aimed into the IPv4 header and a TCP GSO type on a UDP packet.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "egress"))
sys.path.insert(0, str(HERE.parent.parent))

import dpkt  # noqa: E402
from core_packets import (  # noqa: E402
    CLAIM,
    GUEST,
    REMOTE,
    csum_frame,
    icmp_echo,
    icmp_error,
    tcp,
    udp,
    vnet,
)

TH = dpkt.tcp


def frames() -> dict[str, bytes]:
    rnd = random.Random(2051)
    t = tcp(b"hello")
    u = udp(b"query")
    f: dict[str, bytes] = {
        "tcp-plain": vnet() + t,
        "tcp-syn-options": vnet() + tcp(b"", flags=TH.TH_SYN, opts=b"\x02\x04\x05\xb4\x01\x03\x03\x07"),
        "tcp-partial": csum_frame(tcp(rnd.randbytes(700))),
        "tcp-source-is-claim": vnet() + tcp(b"x", src=CLAIM),
        "udp-plain": vnet() + u,
        "udp-no-checksum": vnet() + udp(b"nocsum", no_csum=True),
        "udp-partial": csum_frame(udp(rnd.randbytes(300))),
        "icmp-echo": vnet() + icmp_echo(),
        "icmp-unreach": vnet() + icmp_error(3, udp(b"dns", src=REMOTE, dst=GUEST)[:28]),
        "icmp-time-exceeded": vnet() + icmp_error(11, tcp(b"t", src=REMOTE, dst=GUEST)[:28]),
        "icmp-param-problem": vnet() + icmp_error(12, udp(b"p" * 40, src=REMOTE, dst=GUEST)),
        "icmp-error-short-quote": vnet() + icmp_error(3, b"\x45" + bytes(12)),
        "icmp-error-quote-not-ipv4": vnet() + icmp_error(11, b"\x60" + bytes(39)),
        "icmp-error-quotes-other-claim": vnet() + icmp_error(3, udp(b"dns", src=CLAIM + 1, dst=GUEST)[:28]),
        "icmp-error-quotes-own-packet": vnet() + icmp_error(11, tcp(b"t")[:28]),
        "tso-63k-1448": csum_frame(tcp(rnd.randbytes(63000), flags=TH.TH_ACK | TH.TH_PUSH), 1, 1448),
        "tso-fin-psh-cwr-ecn": csum_frame(
            tcp(rnd.randbytes(5000), flags=TH.TH_ACK | TH.TH_PUSH | TH.TH_FIN | TH.TH_CWR), 0x81, 536
        ),
        "tso-gso-size-1": csum_frame(tcp(rnd.randbytes(100)), 1, 1),
        "tso-timestamps": csum_frame(tcp(rnd.randbytes(9000), opts=b"\x01\x01\x08\x0a" + bytes(8)), 1, 1448),
        "tso-empty": csum_frame(tcp(b""), 1, 1448),
        "uso-10000-1000": csum_frame(udp(rnd.randbytes(10000)), 5, 1000),
        "uso-1472": csum_frame(udp(rnd.randbytes(3000)), 5, 1472),
        # The two the design names:
        "csum-offset-into-ip-dst": vnet(1, 0, 0, 0, 0, 16) + t,
        "tcp-gso-on-udp": vnet(1, 1, 28, 100, 20, 6) + udp(rnd.randbytes(500)),
        "csum-offset-into-ip-src": vnet(1, 0, 0, 0, 4, 8) + t,
        "csum-start-past-packet": vnet(1, 0, 0, 0, 60000, 16) + t,
        "uso-on-tcp": vnet(1, 5, 40, 100, 20, 16) + tcp(rnd.randbytes(500)),
        "ecn-on-uso": vnet(1, 0x85, 28, 100, 20, 6) + udp(rnd.randbytes(500)),
        "gso-size-0": vnet(1, 1, 40, 0, 20, 16) + tcp(rnd.randbytes(500)),
        "icmp-asks-csum": vnet(1, 0, 0, 0, 20, 2) + icmp_echo(),
        "fragment-later": vnet() + bytes([*u[:6], 0x00, 0x10, *u[8:]]),
        "fragment-first-gso": vnet(1, 5, 28, 10, 20, 6) + bytes([*u[:6], 0x20, 0x00, *u[8:]]),
        "ip-options": vnet() + bytes([0x46, *t[1:3], *t[3:20]]) + b"\x01\x01\x01\x00" + t[20:],
        # options with the checksum request pointing past them, at the TCP checksum: still refused
        "ip-options-csum-at-ihl": vnet(1, 0, 0, 0, 24, 16)
        + bytes([0x46, *(len(t) + 4).to_bytes(2, "big"), *t[3:20]]) + b"\x01\x01\x01\x00" + t[20:],
        "trailing-bytes": vnet() + t + b"trailer",
        "total-length-over": vnet() + t[:2] + b"\xff\xff" + t[4:],
        "tcp-doff-past-end": vnet() + t[:32] + b"\xf0" + t[33:],
        "truncated-header": vnet() + t[:15],
        "version-6": vnet() + b"\x60" + t[1:],
        "empty": b"",
        "garbage": rnd.randbytes(64),
    }
    return f


def main() -> None:
    for target in ("rewrite", "segment"):
        d = HERE.parent / "seeds" / target
        d.mkdir(parents=True, exist_ok=True)
        for name, frame in frames().items():
            for sel in (0, 0x15) if target == "segment" else (0, 1):
                (d / f"{name}-{sel:02x}").write_bytes(bytes([sel]) + frame)


if __name__ == "__main__":
    main()
