"""Per-packet cost of the egress packet core through the batched entry points the router calls.

Run: .venv/bin/pytest bench/egress/test_bench_core.py -p no:cacheprovider --benchmark-columns=min,median,max
Each benchmark runs one batch call; ``extra_info['ns_per_packet']`` divides the median by the wire (or
delivered) packets in the batch. Public figures this mirrors (Go, arm64 laptop): 63 KB GSO frame
8.8-9.0 us (~200 ns per wire packet), small packet 104 ns, inbound packet delivered 251-261 ns.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "egress"))

from core_packets import CLAIM, PREFIX, REMOTE, VNI, csum_frame, tcp, vnet, vxlan_datagram

from forwarder.egress import core_types as ct
from forwarder.egress import fastpath as fp

PARAMS = ct.OutParams(claim=CLAIM, prefix=PREFIX, mtu=1500, max_segs=128)


def _per_packet(benchmark: Any, packets: int) -> None:
    benchmark.extra_info["packets_per_call"] = packets
    if benchmark.stats is None:  # --benchmark-disable: ran once as a plain test
        return
    benchmark.extra_info["ns_per_packet"] = round(benchmark.stats.stats.median / packets * 1e9, 1)


def _outbound(frames: list[bytes]) -> tuple[fp.OutboundBatch, bytes]:
    inbuf = b"".join(frames)
    b = fp.OutboundBatch(PARAMS, max_frames=len(frames))
    pos = 0
    pairs = []
    for f in frames:
        pairs.append((pos, len(f)))
        pos += len(f)
    b.set_frames(pairs)
    return b, inbuf


@pytest.mark.parametrize("frames", [1, 4])
def test_gso_63k_frame_segmented(benchmark: Any, frames: int) -> None:
    """63 000 bytes of TCP payload, gso_size 1448: 44 wire packets with full checksums, VXLAN+Ethernet."""
    big = csum_frame(tcp(random.Random(1).randbytes(63000), flags=0x18), 1, 1448)
    b, inbuf = _outbound([big] * frames)
    assert b.run(inbuf) == frames and b.result(0).packets == 44
    benchmark(b.run, inbuf)
    _per_packet(benchmark, 44 * frames)
    if benchmark.stats is not None:
        benchmark.extra_info["us_per_frame"] = round(benchmark.stats.stats.median / frames * 1e6, 2)


def test_small_packet(benchmark: Any) -> None:
    """64 small TCP packets (64-byte IPv4: an ACK with 24 bytes) per call: rewrite + record + send group."""
    b, inbuf = _outbound([vnet() + tcp(bytes(24), seq=i) for i in range(64)])
    assert b.run(inbuf) == 64
    benchmark(b.run, inbuf)
    _per_packet(benchmark, 64)


def _inbound(gro: bool) -> tuple[fp.InboundBatch, bytes]:
    rnd = random.Random(2)
    segs = [
        vxlan_datagram(tcp(rnd.randbytes(1448), src=REMOTE, dst=CLAIM, sport=443, dport=40000, seq=i * 1448))
        for i in range(64)
    ]
    b = fp.InboundBatch(VNI, max_frames=64, out_capacity=1 << 20)
    b.set_gro([CLAIM] if gro else [])
    pos = 0
    pairs = []
    for s in segs:
        pairs.append((pos, len(s)))
        pos += len(s)
    b.set_frames(pairs)
    return b, b"".join(segs)


@pytest.mark.parametrize("gro", [False, True], ids=["plain", "merged"])
def test_inbound_packet_delivered(benchmark: Any, gro: bool) -> None:
    """64 full-size TCP segments from the exit per call, delivered (plain) or merged into GSO frames."""
    b, inbuf = _inbound(gro)
    assert b.run(inbuf) == 64
    benchmark(b.run, inbuf)
    _per_packet(benchmark, 64)
