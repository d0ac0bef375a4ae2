"""Resume (issue 12 point 6) over loopback: what an exit's packet for a flow the claim does not have does.

A fresh daemon has no flows, as after a restart or an import. The exit (127.0.0.2) sends what a server
would in the middle of a stream that predates the arm: a plain segment reopens its flow under the
claim's policy and flow limits and reaches the guest; a SYN, a reset, a UDP datagram or an ICMP error
of an unknown flow, and a segment from a peer the policy refuses, are dropped, counted and leave no
flow. An ICMP error quoting a packet of a known flow reaches the guest.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import dpkt
import pytest
from core_packets import REMOTE, icmp_error, tcp, udp, vnet, vxlan_datagram
from test_router import CLAIM, Rig, _rig

from forwarder.egress.flows import flow_key

TH = dpkt.tcp
DENIED = 0x5DB8D863  # 93.184.216.99: c1's policy refuses TCP to it


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async for r in _rig(tmp_path, {"rules": ["deny tcp 93.184.216.99/32"]}):
        yield r


async def _from_exit(rig: Rig, *ips: bytes) -> None:
    for ip in ips:
        rig.exit.sendto(vxlan_datagram(ip), ("127.0.0.1", rig.port))
    await asyncio.sleep(0.1)


async def _delivered(rig: Rig, wait: float = 0.3) -> list[bytes]:
    got: list[bytes] = []
    while True:
        try:
            (n,) = struct.unpack("!I", await asyncio.wait_for(rig.reader.readexactly(4), wait))
        except TimeoutError:
            return got
        got.append((await rig.reader.readexactly(n))[10:])


def _down(data: bytes = b"more of the download", *, src: int = REMOTE, flags: int = TH.TH_ACK) -> bytes:
    return tcp(data, src=src, dst=CLAIM, sport=443, dport=40000, flags=flags)


async def test_a_segment_of_a_stream_older_than_the_arm_reopens_its_flow(rig: Rig) -> None:
    c1 = rig.router.paths["c1"]
    assert len(c1.flows) == 0
    seg = _down()
    await _from_exit(rig, seg)
    assert await _delivered(rig) == [seg]
    ack = tcp(b"", sport=40000, dport=443)  # the guest's answer is now a packet of a known flow
    assert flow_key(ack, 0, CLAIM) in c1.flows and c1.resumed == 1
    await rig.send(vnet() + ack)
    assert (len(c1.flows), c1.resumed, c1.sent.frames) == (1, 1, 1)
    await _from_exit(rig, _down(b"and more"))
    assert len(await _delivered(rig)) == 1 and c1.resumed == 1  # known now: not reopened again
    assert c1.received.frames == 2 and c1.received.bytes == len(seg) + len(_down(b"and more"))


async def test_what_may_not_reopen_a_flow_is_dropped_and_leaves_none(rig: Rig) -> None:
    c1 = rig.router.paths["c1"]
    await _from_exit(
        rig,
        _down(b"", flags=TH.TH_SYN),  # a connection from outside: the claim only dials out
        _down(b"", flags=TH.TH_SYN | TH.TH_ACK),
        _down(b"", flags=TH.TH_RST | TH.TH_ACK),
        udp(b"late answer", src=REMOTE, dst=CLAIM, sport=53, dport=5353),
        icmp_error(3, udp(b"q", src=CLAIM)[:28], code=4, src=REMOTE, dst=CLAIM),
        _down(src=DENIED),  # a stream the policy refuses is not reopened either
    )
    assert await _delivered(rig) == []
    assert len(c1.flows) == 0 and c1.resumed == 0
    assert dict(c1.drops) == {"no_flow": 5, "resume_policy_denied": 1}
    assert c1.flows.refusals == {"policy_denied": 1}


async def test_an_icmp_error_about_a_known_flow_reaches_the_guest(rig: Rig) -> None:
    out = udp(b"x" * 1400, sport=5353, dport=53)
    await rig.send(vnet() + out)
    sent = rig.inner()
    assert len(sent) == 1
    frag_needed = icmp_error(3, sent[0][:28], code=4, src=0x0A000001, dst=CLAIM)  # quotes what left: the claim's
    other = icmp_error(3, udp(b"x", src=CLAIM, sport=9999)[:28], code=3, src=REMOTE, dst=CLAIM)
    await _from_exit(rig, frag_needed, other)
    assert await _delivered(rig) == [frag_needed]
    assert rig.router.paths["c1"].drops == {"no_flow": 1}


async def test_a_reopen_is_under_the_flow_cap(tmp_path: Path) -> None:
    async for rig in _rig(tmp_path, flow_cap=1):
        c1 = rig.router.paths["c1"]
        await rig.send(vnet() + udp(b"q"))
        assert len(c1.flows) == 1
        await _from_exit(rig, _down())
        assert await _delivered(rig) == []
        assert c1.drops == {"resume_flow_cap": 1} and len(c1.flows) == 1 and c1.resumed == 0
