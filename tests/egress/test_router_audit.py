"""Audit records and usage events (issue 12 point 7) over loopback: an idle flow's record with its byte
counts, a resumed flow's verdict, live flows recorded at a clean stop, usage events adding up.

Byte counts are checked against the packets the test built (inner IPv4 lengths) and against the daemon's
per-claim counters, which come from the C core's results, not from the flow table.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import dpkt
from core_packets import REMOTE, tcp, udp, vnet, vxlan_datagram
from test_router import CLAIM, _rig

from forwarder.egress.refusals import REFUSED_PER_ROUND


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_ended_flows_are_audited_with_their_bytes(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    async for rig in _rig(tmp_path, flow_idle_timeout=0.5, usage_interval=0.5, audit_file=audit):
        q1, q2 = udp(b"q" * 100, sport=5353), udp(b"qq" * 10, sport=5353)
        await rig.send(vnet() + q1, vnet() + q2)
        answer = udp(b"a" * 300, src=REMOTE, dst=CLAIM, sport=53, dport=5353)
        rig.exit.sendto(vxlan_datagram(answer), ("127.0.0.1", rig.port))
        # a stream older than the arm: reopened by the server's segment, still live at the stop
        seg = tcp(b"d" * 500, src=REMOTE, dst=CLAIM, sport=443, dport=40000)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not any(r["type"] == "flow" for r in _records(audit)):
            assert loop.time() < deadline, "no record for the idle flow"
            await asyncio.sleep(0.1)
        rig.exit.sendto(vxlan_datagram(seg), ("127.0.0.1", rig.port))
        await asyncio.sleep(0.2)
        sent = rig.router.paths["c1"].sent.bytes
        await rig.router.stop()
    recs = _records(audit)
    flows = [r for r in recs if r["type"] == "flow"]
    assert len(flows) == 2, recs
    idle, live = flows
    assert (idle["proto"], idle["src"], idle["sport"], idle["dst"], idle["dport"]) == (
        "udp", "100.64.1.2", 5353, "93.184.216.34", 53)
    assert (idle["bytes_out"], idle["packets_out"]) == (len(q1) + len(q2), 2)
    assert (idle["bytes_in"], idle["packets_in"]) == (len(answer), 1)
    assert idle["verdict"] == "allowed" and idle["ended"] == "idle"
    assert idle["start"] <= idle["last"] <= idle["end"] and idle["end"] - idle["last"] >= 0.5
    assert idle["bytes_out"] == sent  # the claim's only outbound flow: the core's own count agrees
    assert (live["proto"], live["sport"], live["dport"]) == ("tcp", 40000, 443)
    assert live["verdict"] == "resumed" and live["ended"] == "stopped"
    assert (live["bytes_in"], live["packets_in"], live["bytes_out"]) == (len(seg), 1, 0)
    usage = [r for r in recs if r["type"] == "usage"]
    assert sum(u["bytes_out"] for u in usage if u["sport"] == 5353) == idle["bytes_out"]
    assert all(u["bytes_out"] > 0 for u in usage)


async def test_a_disarm_and_a_disable_end_their_flows(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    async for rig in _rig(tmp_path, audit_file=audit):
        await rig.send(vnet() + udp(b"one", sport=1000))
        rig.router.set_enabled("c1", False)
        rig.router.set_enabled("c1", True)
        await rig.send(vnet() + udp(b"two", sport=2000))
        await rig.router.disarm("c1")
        await rig.router.stop()
    ended = [(r["sport"], r["ended"]) for r in _records(audit) if r["type"] == "flow"]
    assert ended == [(1000, "disabled"), (2000, "disarmed")]


async def test_flows_refused_at_their_first_packet_are_audited_with_their_reason(tmp_path: Path) -> None:
    """Policy refusals: one record per refused tuple a round, its retransmissions counted as attempts,
    nothing sent; the allowed flow beside them recorded as usual."""
    audit = tmp_path / "audit.jsonl"
    syn = dpkt.tcp.TH_SYN
    async for rig in _rig(tmp_path, {"rules": ["deny tcp any 25"]}, audit_file=audit):
        smtp = tcp(dport=25, flags=syn, ack=0)
        await rig.send(vnet() + smtp, vnet() + smtp, vnet() + tcp(dport=25, sport=40001, flags=syn, ack=0),
                       vnet() + udp(b"ok"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while len([r for r in _records(audit) if r.get("verdict") == "refused"]) < 2:
            assert loop.time() < deadline, _records(audit)
            await asyncio.sleep(0.1)
        drops = dict(rig.router.paths["c1"].drops)
        await rig.router.stop()
    recs = _records(audit)
    refused = [r for r in recs if r.get("verdict") == "refused"]
    assert [(r["sport"], r["dport"], r["attempts"], r["reason"]) for r in refused] == [
        (40000, 25, 2, "policy_denied"), (40001, 25, 1, "policy_denied")]
    assert all(r["proto"] == "tcp" and r["src"] == "100.64.1.2" and r["bytes_out"] == r["packets_out"] == 0
               and r["start"] <= r["end"] and r["ended"] == "refused" for r in refused)
    assert drops["policy_denied"] == 3
    allowed = [r for r in recs if r["type"] == "flow" and r["verdict"] == "allowed"]
    assert [(a["proto"], a["dport"]) for a in allowed] == [("udp", 53)]


async def test_refused_tuples_past_the_cap_are_counted_not_listed(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    n = REFUSED_PER_ROUND + 6
    async for rig in _rig(tmp_path, {"rules": ["deny tcp any 25"]}, audit_file=audit):
        await rig.send(*(vnet() + tcp(dport=25, sport=41000 + i, flags=dpkt.tcp.TH_SYN, ack=0) for i in range(n)))
        await rig.router.stop()
    recs = _records(audit)
    listed = [r for r in recs if r.get("verdict") == "refused"]
    suppressed = sum(r["packets"] for r in recs if r["type"] == "refused_suppressed")
    assert len(listed) + suppressed == n  # every refused packet is in one or the other
    assert len({r["sport"] for r in listed}) == len(listed) >= REFUSED_PER_ROUND


async def test_a_tcp_flow_closed_by_fin_each_way_or_reset_is_recorded_then_not_idle(tmp_path: Path) -> None:
    """Long before the idle timeout: the FIN pair's flow ends ``closed`` and the reset one ``reset``, each
    with its end at its last packet."""
    audit = tmp_path / "audit.jsonl"
    syn, ack, fin, rst = dpkt.tcp.TH_SYN, dpkt.tcp.TH_ACK, dpkt.tcp.TH_FIN, dpkt.tcp.TH_RST
    async for rig in _rig(tmp_path, flow_idle_timeout=120, audit_file=audit):
        for sport in (40010, 40011):
            await rig.send(vnet() + tcp(sport=sport, flags=syn, ack=0))
            rig.exit.sendto(vxlan_datagram(tcp(src=REMOTE, dst=CLAIM, sport=443, dport=sport, flags=syn | ack)),
                            ("127.0.0.1", rig.port))
        await asyncio.sleep(0.1)
        await rig.send(vnet() + tcp(b"bye", sport=40010, flags=fin | ack))
        rig.exit.sendto(vxlan_datagram(tcp(src=REMOTE, dst=CLAIM, sport=443, dport=40010, flags=fin | ack)),
                        ("127.0.0.1", rig.port))
        rig.exit.sendto(vxlan_datagram(tcp(src=REMOTE, dst=CLAIM, sport=443, dport=40011, flags=rst)),
                        ("127.0.0.1", rig.port))
        await asyncio.sleep(0.1)
        await rig.send(vnet() + tcp(sport=40010, flags=ack))  # the last ACK, inside the linger
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while len([r for r in _records(audit) if r["type"] == "flow"]) < 2:
            assert loop.time() < deadline, _records(audit)
            await asyncio.sleep(0.1)
        assert len(rig.router.paths["c1"].flows) == 0
        await rig.router.stop()
    flows = {r["sport"]: r for r in _records(audit) if r["type"] == "flow"}
    assert (flows[40010]["ended"], flows[40011]["ended"]) == ("closed", "reset")
    assert (flows[40010]["packets_out"], flows[40010]["packets_in"]) == (3, 2)
    assert (flows[40011]["packets_out"], flows[40011]["packets_in"]) == (1, 2)
    assert all(r["end"] == r["last"] and r["verdict"] == "allowed" for r in flows.values())
