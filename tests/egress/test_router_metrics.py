"""The router's /metrics (issue 12 point 8), scraped over a real socket after traffic through the loopback rig.

Each family is checked against what the test sent (frames out and in, a guarded destination, a packet of
no flow, a stranger's datagram, an ARP request) and against the daemon's own counters.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from core_packets import REMOTE, VNI, udp, vnet, vxlan_datagram
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_router import CLAIM, Rig, _rig

from forwarder.egress.arp import ArpPacket, push_arp
from forwarder.egress.router.metrics import registry_for
from forwarder.egress.vxlan import ETH_P_ARP, push_ethernet, push_vxlan
from sbxnet.ops_http import OpsServer


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async for r in _rig(tmp_path):
        yield r


async def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_after_traffic(rig: Rig) -> None:
    router = rig.router
    router.ready = True
    ops = OpsServer(lambda: generate_latest(registry_for(router)), lambda: router.ready)
    port = await ops.start("127.0.0.1", 0)
    try:
        rig.datagrams()
        await rig.send(vnet() + udp(b"q1"), vnet() + udp(b"q2", sport=5354), vnet() + udp(b"x", dst=0x0A000001))
        for ip in (udp(b"a1", src=REMOTE, dst=CLAIM, sport=53, dport=5353),
                   udp(b"a2", src=REMOTE, dst=CLAIM, sport=53, dport=5354),
                   udp(b"nobody asked", src=REMOTE, dst=CLAIM, sport=53, dport=6000)):
            rig.exit.sendto(vxlan_datagram(ip), ("127.0.0.1", rig.port))
        rig.stranger.sendto(vxlan_datagram(udp(b"s", src=REMOTE, dst=CLAIM)), ("127.0.0.1", rig.port))
        asker = bytes.fromhex("020000000009")
        req = ArpPacket(1, asker, 0x64400001, bytes(6), CLAIM)
        rig.exit.sendto(push_vxlan(VNI) + push_ethernet(b"\xff" * 6, asker, ETH_P_ARP) + push_arp(req),
                        ("127.0.0.1", rig.port))
        for _ in range(2):
            (n,) = struct.unpack("!I", await asyncio.wait_for(rig.reader.readexactly(4), 5))
            await rig.reader.readexactly(n)
        await asyncio.sleep(0.1)
        m = await _scrape(port)
    finally:
        await ops.close()
    c1 = router.paths["c1"]

    def v(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert v("sbxnet_egress_frames_total", claim="c1", direction="out") == 2 == c1.sent.frames
    assert v("sbxnet_egress_frames_total", claim="c1", direction="in") == 2 == c1.received.frames
    assert v("sbxnet_egress_bytes_total", claim="c1", direction="out") == c1.sent.bytes == 2 * (28 + 2)
    assert v("sbxnet_egress_bytes_total", claim="c1", direction="in") == c1.received.bytes == 2 * (28 + 2)
    assert v("sbxnet_egress_packets_total", claim="c1", direction="in") == 2
    assert v("sbxnet_egress_flows", claim="c1") == 2
    assert v("sbxnet_egress_flows_opened_total", claim="c1", how="outbound") == 2
    assert v("sbxnet_egress_flows_opened_total", claim="c1", how="resumed") == 0
    assert v("sbxnet_egress_flow_refusals_total", claim="c1", reason="internal_address") == 1
    assert v("sbxnet_egress_drops_total", claim="c1", reason="no_flow") == 1
    assert v("sbxnet_egress_inbound_drops_total", reason="unknown_vtep") == 1
    assert v("sbxnet_egress_arp_total", kind="answered") == 1
    assert v("sbxnet_egress_arp_total", kind="gratuitous") == 2  # one per claim on arm
    assert v("sbxnet_egress_datagrams_total", direction="in") == router.vx.counts["datagrams_in"] >= 4  # type: ignore[union-attr]
    assert v("sbxnet_egress_datagrams_total", direction="out") == router.vx.counts["datagrams_out"] >= 5  # type: ignore[union-attr]
    assert v("sbxnet_egress_quota_used_bytes", claim="c1") == c1.limits.bytes_used > 0
    assert v("sbxnet_egress_claims") == 2 and v("sbxnet_egress_guest_streams") == 1
    assert v("sbxnet_egress_claim_enabled", claim="c2") == 1
    assert ("sbxnet_egress_frames_total", (("claim", "c2"), ("direction", "out"))) in m
