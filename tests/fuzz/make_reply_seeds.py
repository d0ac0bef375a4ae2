"""Writes the seed corpus of fuzz_reply (run by hand: python tests/fuzz/make_reply_seeds.py).

Each seed is a delivery frame (u32 len | virtio_net_hdr | IPv4) from the exit toward the claim, named
``<expected>-<what>``: replies of each protocol, the segments that may and may not reopen a flow, ICMP
errors quoting the claim's packets, and quotes that do not fit or are another's.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "egress"))
sys.path.insert(0, str(HERE.parent.parent))

import dpkt  # noqa: E402
from core_packets import CLAIM, REMOTE, icmp_echo, icmp_error, tcp, udp  # noqa: E402
from seed_dir import write_seeds  # noqa: E402

TH = dpkt.tcp


def frame(ip: bytes, vnet: bytes = bytes(10)) -> bytes:
    return struct.pack("!I", len(vnet) + len(ip)) + vnet + ip


def seeds() -> dict[str, bytes]:
    out_udp = udp(b"dns?", src=CLAIM, dst=REMOTE)
    out_tcp = tcp(b"GET", src=CLAIM, dst=REMOTE)
    reply = bytearray(icmp_echo(b"pong", src=REMOTE, dst=CLAIM))
    reply[20] = 0  # echo reply
    merged_vnet = bytes([1, 1]) + (40).to_bytes(2, "little") + (1448).to_bytes(2, "little") + bytes(4)
    s = {
        "ok-tcp-ack-resumable": frame(tcp(b"data", src=REMOTE, dst=CLAIM, sport=443, dport=40000)),
        "ok-tcp-syn-ack": frame(tcp(b"", src=REMOTE, dst=CLAIM, flags=TH.TH_SYN | TH.TH_ACK)),
        "ok-tcp-syn": frame(tcp(b"", src=REMOTE, dst=CLAIM, flags=TH.TH_SYN)),
        "ok-tcp-rst": frame(tcp(b"", src=REMOTE, dst=CLAIM, flags=TH.TH_RST | TH.TH_ACK)),
        "ok-tcp-fin": frame(tcp(b"", src=REMOTE, dst=CLAIM, flags=TH.TH_FIN | TH.TH_ACK)),
        "ok-tcp-merged-3-segments": frame(tcp(bytes(1448 * 2 + 100), src=REMOTE, dst=CLAIM), merged_vnet),
        "ok-udp-reply": frame(udp(b"dns!", src=REMOTE, dst=CLAIM, sport=53, dport=5353)),
        "ok-icmp-echo-reply": frame(bytes(reply)),
        "ok-icmp-frag-needed-quotes-udp": frame(icmp_error(3, out_udp[:28], code=4, src=REMOTE, dst=CLAIM)),
        "ok-icmp-port-unreachable-whole-quote": frame(icmp_error(3, out_udp, code=3, src=REMOTE, dst=CLAIM)),
        "ok-icmp-time-exceeded-quotes-tcp": frame(icmp_error(11, out_tcp[:28], src=0x0A000001, dst=CLAIM)),
        "ok-icmp-error-quotes-echo": frame(icmp_error(3, icmp_echo(src=CLAIM, dst=REMOTE)[:28], src=REMOTE,
                                                      dst=CLAIM)),
        "bad_reply-icmp-error-quotes-another": frame(icmp_error(3, udp(b"x", src=CLAIM + 1, dst=REMOTE)[:28],
                                                                src=REMOTE, dst=CLAIM)),
        "bad_reply-icmp-error-quote-short": frame(icmp_error(3, out_udp[:22], src=REMOTE, dst=CLAIM)),
        "bad_reply-icmp-error-quote-not-ipv4": frame(icmp_error(3, b"\x60" + out_udp[1:28], src=REMOTE, dst=CLAIM)),
        "bad_reply-icmp-error-quote-ihl-past-end": frame(icmp_error(3, b"\x4f" + out_udp[1:28], src=REMOTE,
                                                                    dst=CLAIM)),
        "bad_reply-icmp-redirect-short": frame(icmp_error(5, b"", src=REMOTE, dst=CLAIM)),
        "bad_reply-icmp-router-advert": frame(icmp_error(9, out_udp[:28], src=REMOTE, dst=CLAIM)),
        "bad_reply-gre": frame(bytes([0x45, 0, 0, 24]) + bytes(5) + b"\x2f" + bytes(2)
                                + struct.pack("!II", REMOTE, CLAIM) + bytes(4)),
        "bad_reply-tcp-short": frame(tcp(b"", src=REMOTE, dst=CLAIM)[:32]),
        "bad_reply-udp-short": frame(udp(b"", src=REMOTE, dst=CLAIM)[:22]),
        "bad_reply-no-ip": frame(b"\x45\x00"),
        "bad_reply-empty": b"",
    }
    return s


def main() -> None:
    write_seeds(HERE.parent / "seeds" / "reply", seeds())


if __name__ == "__main__":
    main()
