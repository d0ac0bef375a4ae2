"""Audit records end to end (issue 12 point 7): a TCP flow and a UDP flow from the guest's own kernel
through the four namespaces of test_router_e2e.py, recorded with their bytes: the TCP one when both
kernels have closed it (a FIN each way), the UDP one at the daemon's clean stop.

The UDP echo's sizes are known exactly (five 300-byte datagrams each way: 328 IPv4 bytes each); the TCP
upload's bytes out are its payload plus one set of headers per wire packet; the records' bytes out add
up to the claim's count from the C core's results (the ``egress_stopped`` line), which is computed
apart from the flow table.
"""

from __future__ import annotations

import json
import time

import pytest
from test_router_e2e import CLAIM, HERE, SERVER, Net, _readline, net  # noqa: F401
from test_router_e2e_control import _daemon, _stop

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns


def test_a_tcp_flow_is_recorded_at_its_close_and_a_udp_flow_at_a_clean_stop_with_their_bytes(net: Net) -> None:  # noqa: F811
    audit = net.tmp / "audit.jsonl"
    d, ctl = _daemon(net, "h1", "10.77.0.2", SBXNET_EGRESS_AUDIT_FILE=str(audit))
    st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a"})
    assert st == 201 and body["address"] == CLAIM, body
    server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    relay = net.ns_python(net.guest, str(HERE / "guest_relay.py"), "--uds", str(net.tmp / "vm1.vsock_2051"),
                          "--addr", CLAIM)
    _readline(relay, "ready")
    assert net.client("udp", SERVER) == {"ok": 5}
    size = 1 << 20
    assert net.client("tcp-up", SERVER, str(size))["match"] is True
    # Both kernels closed the TCP connection (a FIN each way): its record comes CLOSE_LINGER later, at a
    # tick, long before the idle timeout; the UDP flow lives on until the stop.
    deadline = time.monotonic() + 30
    while not (audit.exists() and '"ended":"closed"' in audit.read_text()):
        assert time.monotonic() < deadline, audit.read_text() if audit.exists() else "no audit file"
        time.sleep(0.1)
    stopped = _stop(d)
    recs = [json.loads(line) for line in audit.read_text().splitlines()]
    flows = [r for r in recs if r["type"] == "flow"]
    udp = [r for r in flows if r["proto"] == "udp" and r["dport"] == 7]
    tcp = [r for r in flows if r["proto"] == "tcp" and r["dport"] == 5001]
    assert len(udp) == 1 and len(tcp) == 1, flows
    u, t = udp[0], tcp[0]
    assert (u["src"], u["dst"]) == (CLAIM, SERVER) == (t["src"], t["dst"])
    assert (u["bytes_out"], u["packets_out"], u["bytes_in"], u["packets_in"]) == (5 * 328, 5, 5 * 328, 5), u
    assert t["verdict"] == u["verdict"] == "allowed" and (t["ended"], u["ended"]) == ("closed", "stopped")
    assert t["end"] == t["last"]  # a closed flow ends with its last packet
    header = t["bytes_out"] - size - len(f"up {size}\n")
    assert 40 * t["packets_out"] <= header <= 60 * t["packets_out"], t  # IPv4 + TCP (+ options) per packet
    assert t["packets_in"] >= 1 and t["bytes_in"] >= 40 * t["packets_in"] + 65, t  # ACKs and the digest line
    assert t["start"] <= t["end"]
    c1 = stopped["claims"]["c1"]
    assert sum(r["bytes_out"] for r in flows) == c1["bytes_out"]
    assert sum(r["bytes_in"] for r in flows) == c1["bytes_in"]
    usage = [r for r in recs if r["type"] == "usage"]
    assert sum(r["bytes_out"] for r in usage) == c1["bytes_out"]
