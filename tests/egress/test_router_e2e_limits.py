"""A claim's limits end to end (issue 12): byte rate, quota and the flow cap, with the guest's own kernel
stacks through the four namespaces of test_router_e2e.py (the daemons of test_router_e2e_control.py,
the claim armed through the control API with its limits).

Rate: a claim limited to 1 MB/s (burst 100 kB) uploads 4 MiB over TCP. The daemon's audit record of the flow gives
what it charged (inner bytes plus the encapsulation per wire packet) and, by the daemon's clock, when
the flow's first and last packets passed; a token bucket lets through at most its burst plus the rate
times that span, whatever the load on the machine. The flow still moves (at least a tenth of the rate)
and the daemon counts ``byte_rate`` drops. Unlimited, the same upload takes well under a second.

Quota: a claim with 40,000 bytes of quota starts a 1 MiB upload. The daemon refuses the frames that
would pass the quota (``quota`` drops) and never charges past it; once less is left than one full-size
segment costs (every segment of the upload is full-size), nothing more of the claim reaches the exit
while the guest keeps retransmitting, and the upload never completes.

Flow cap: a daemon with ``flow_cap`` 8; the guest opens ten UDP flows, one datagram each: the first
eight are echoed, the other two refused (``flow_cap``), and a TCP connection after them never opens.
The exit saw exactly the eight admitted datagrams.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_router_e2e import CLAIM, HERE, SERVER, Net, _readline, net  # noqa: F401
from test_router_e2e_control import _claim, _daemon, _relay, _stop, _until

from forwarder.egress.limits import MAX_FRAME_COST, WIRE_OVERHEAD
from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

FULL_PACKET_COST = 1500 + WIRE_OVERHEAD  # what one full-size packet is charged


def _arm(n: Net, limits: dict[str, Any], **env: str) -> tuple[subprocess.Popen[str], Path]:
    d, ctl = _daemon(n, "h1", "10.77.0.2", **env)
    st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(n.tmp / "vm1.vsock"), "exit": "a", "limits": limits})
    assert st == 201 and body["address"] == CLAIM, body
    server = n.ns_python(n.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    _relay(n, n.tmp / "vm1.vsock")
    return d, ctl


def _refused_again(ctl: Path, seen: dict[str, Any]) -> dict[str, Any]:
    """The claim's stats once another frame has been refused for the quota since ``seen``."""
    got: dict[str, Any] = _until("another frame refused for the quota", lambda: (
        s := _claim(ctl)["stats"])["drops"]["quota"] > seen["drops"]["quota"] and s, 30)
    return got


def test_a_byte_rate_bounds_the_claims_throughput(net: Net) -> None:  # noqa: F811
    rate, burst, size = 1_000_000, 100_000, 4 << 20
    audit = net.tmp / "audit.jsonl"
    d, _ = _arm(net, {"byte_rate": rate, "byte_burst": burst}, SBXNET_EGRESS_AUDIT_FILE=str(audit))
    up = net.client("tcp-up", SERVER, str(size), timeout=120)
    assert up["match"] is True, up
    stats = _stop(d)["claims"]["c1"]
    assert stats["drops"].get("byte_rate", 0) > 0, stats
    flows = [json.loads(line) for line in audit.read_text().splitlines()]
    (t,) = [r for r in flows if r["type"] == "flow" and r["proto"] == "tcp" and r["dport"] == 5001]
    charged = t["bytes_out"] + WIRE_OVERHEAD * t["packets_out"]
    span = t["last"] - t["start"]  # the daemon's clock: the flow's first packet to its last
    assert charged > size, t
    # the bucket starts full (its burst, at least one maximal frame) and refills at the rate
    assert charged <= max(burst, MAX_FRAME_COST) + rate * (span + 2e-6), (charged, span, t)  # 2e-6: rounding
    assert charged / span >= rate / 10, (charged, span)  # bounded, not stopped
    print(f"\n1 MB/s claim: {charged} bytes charged in {span:.2f} s by the daemon's clock "
          f"({charged / span / 1e6:.3f} MB/s); the client took {up['s']:.2f} s; drops {stats['drops']}")


def test_a_quota_stops_the_claims_traffic_once_used(net: Net) -> None:  # noqa: F811
    quota = 40_000
    d, ctl = _arm(net, {"quota_bytes": quota})
    before = net.counter("from_claim")
    upload = net.ns_python(net.guest, str(HERE / "e2e_peer.py"), "tcp-up", SERVER, str(1 << 20))
    s1 = _until("a frame refused for the quota", lambda: (s := _claim(ctl)["stats"])["drops"].get("quota") and s, 30)
    # After a refusal of a large frame the guest's TCP retransmits single segments, and what still fits
    # passes, until less is left than one full-size segment costs: all its segments are full-size.
    deadline = time.monotonic() + 60
    while quota - s1["quota_used"] >= FULL_PACKET_COST:
        assert time.monotonic() < deadline, f"the quota was never used up: {s1}"
        s1 = _refused_again(ctl, s1)
    assert s1["quota_used"] <= quota, s1
    at_exit = net.counter("from_claim")
    assert at_exit > before, at_exit  # the quota's worth did leave
    s2 = _refused_again(ctl, s1)  # the guest still trying, refused
    assert s2["quota_used"] == s1["quota_used"], (s1, s2)
    assert net.counter("from_claim") == at_exit  # nothing more reached the exit
    assert upload.poll() is None  # the upload never completes
    stopped = _stop(d)["claims"]["c1"]
    assert stopped["quota_used"] == s2["quota_used"] and stopped["bytes_out"] <= quota, stopped
    print(f"\nquota {quota}: {s2['quota_used']} used, {s2['drops']['quota']} frames refused, "
          f"{at_exit - before} packets at the exit")


def test_the_flow_cap_refuses_and_counts_the_flows_past_it(net: Net) -> None:  # noqa: F811
    cap = 8
    d, ctl = _arm(net, {}, SBXNET_EGRESS_FLOW_CAP=str(cap))
    before = net.counter("from_claim")
    got = net.client("udp-flows", SERVER, str(cap + 2))
    assert got["answered"] == list(range(cap)), got  # the first eight flows, in the order they were opened
    assert net.client("tcp-connect", SERVER, "2") == {"connected": False, "error": "TimeoutError"}
    stats = _claim(ctl)["stats"]
    assert stats["flows"] == cap, stats
    assert stats["flow_refusals"].get("flow_cap", 0) >= 3, stats  # two datagrams and the SYN (and its retries)
    assert net.counter("from_claim") - before == cap  # only the admitted flows' datagrams reached the exit
    _stop(d)
