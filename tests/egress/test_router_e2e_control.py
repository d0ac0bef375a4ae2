"""The control API end to end, real kernels on both ends (the namespaces and exit of test_router_e2e.py).

The daemon runs with a state directory and a control socket and no claims file: the claim is armed
through the API and gets its address from the allocator (pool 100.64.1.0/24: the first claim address is
100.64.1.2, which the exit's counters watch). A guest process sends a datagram to the sink every 2 ms
throughout. Then: disable -> the daemon accepts no frame of the claim from that moment (its own counter)
and nothing reaches the exit 100 ms later; enable -> the daemon's first accepted frame is within 1 s of the
enable (its own timestamps) and the exit sees traffic again; a restart keeps the claim's address and its
switch; export to a second daemon (a second address of the host, its own MAC) and import there -> the
exit learns the claim at the new MAC from its gratuitous ARP, and once its neighbour entry is gone it
finds the claim again by asking (the second daemon answers its ARP) and the guest's ping comes back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_router_e2e import CLAIM, EXIT_IP, HERE, SERVER, SINK, VNI, Net, _must, _readline, net  # noqa: F401

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

HOST2_IP, EXIT2_IP = "10.77.1.2", "10.77.1.1"  # the second daemon's underlay address, on the same link
MAC2 = "02:73:62:78:00:02"
SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    try:
        s.sendto(b"tick", (sys.argv[2], 9))
    except OSError:
        pass  # no route while the guest's device is away (restart, move)
    time.sleep(0.002)
"""


def _daemon(n: Net, name: str, listen: str, **env: str) -> tuple[subprocess.Popen[str], Path]:
    d = n.tmp / name
    d.mkdir(exist_ok=True)
    ctl = d / "ctl.sock"
    vx_mac = json.loads(_must("ip", "-n", n.exit, "-j", "link", "show", "vx0"))[0]["address"]
    p = n.ns_python(n.host, "-m", "sbxnet.app.cli", "egress", env={
        "SBXNET_EGRESS_EXITS": f"a={EXIT_IP}@{vx_mac}", "SBXNET_EGRESS_VNI": str(VNI),
        "SBXNET_EGRESS_LISTEN": listen, "SBXNET_EGRESS_STATE_DIR": str(d), "SBXNET_EGRESS_CONTROL_SOCKET": str(ctl),
        "SBXNET_EGRESS_ADDRESS_POOL": "100.64.1.0/24", "SBXNET_EGRESS_METRICS_PORT": "0", **env})
    deadline = time.monotonic() + 20
    while not ctl.exists():
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
        assert time.monotonic() < deadline, "the control socket never appeared"
        time.sleep(0.05)
    return p, ctl


def _stop(p: subprocess.Popen[str]) -> dict[str, Any]:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    stopped = [json.loads(line) for line in err.splitlines() if '"egress_stopped"' in line]
    assert len(stopped) == 1, err
    return stopped[0]


def _relay(n: Net, uds: Path) -> subprocess.Popen[str]:
    relay = n.ns_python(n.guest, str(HERE / "guest_relay.py"), "--uds", f"{uds}_2051", "--addr", CLAIM)
    _readline(relay, "ready")
    return relay


def _until(what: str, check: Any, timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def _claim(ctl: Path) -> dict[str, Any]:
    st, body = call(ctl, "GET", "/v1/claims/c1")
    assert st == 200, body
    return body


def test_disable_enable_restart_and_move_through_the_control_api(net: Net) -> None:  # noqa: F811
    for ns, dev, addr in ((net.host, "hx", f"{HOST2_IP}/24"), (net.exit, "xh", f"{EXIT2_IP}/24")):
        _must("ip", "-n", ns, "addr", "add", addr, "dev", dev)
    d1, ctl1 = _daemon(net, "h1", "10.77.0.2")
    st, body = call(ctl1, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a"})
    assert st == 201 and body["address"] == CLAIM, body  # the pool's first claim address, from the allocator
    server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    relay = _relay(net, net.tmp / "vm1.vsock")
    assert net.client("ping", SERVER) == {"replies": 3}
    net.ns_python(net.guest, "-c", SENDER, "180", SINK)
    _until("the guest's datagrams at the exit", lambda: net.counter("sink") > 10)

    # Disable: revoked at once. The daemon accepts no frame of the claim after it (its own counter), while
    # the guest keeps sending (counted as disabled), and 100 ms on nothing more reaches the exit.
    st, body = call(ctl1, "POST", "/v1/claims/c1/disable")
    assert st == 200 and body["enabled"] is False
    time.sleep(0.1)
    at_100ms = net.counter("sink")
    time.sleep(0.5)
    assert net.counter("sink") == at_100ms
    stats = _claim(ctl1)["stats"]
    assert stats["frames_since_switch"] == 0 and stats["drops"].get("disabled", 0) > 50, stats

    # Enable: the first frame accepted again within 1 s of the enable, by the daemon's clock.
    st, body = call(ctl1, "POST", "/v1/claims/c1/enable")
    assert st == 200 and body["enabled"] is True
    stats = _until("a frame after the enable", lambda: (s := _claim(ctl1)["stats"])["first_frame_after_switch"] and s)
    assert 0 <= stats["first_frame_after_switch"] - stats["switched_at"] < 1.0, stats
    _until("the exit sees the guest again", lambda: net.counter("sink") > at_100ms)

    # Restart (disabled first): the claim comes back with its address and its switch off.
    call(ctl1, "POST", "/v1/claims/c1/disable")
    _stop(d1)
    relay.wait(timeout=10)  # its stream was closed
    d1, ctl1 = _daemon(net, "h1", "10.77.0.2")
    claim = _claim(ctl1)
    assert (claim["address"], claim["enabled"]) == (CLAIM, False), claim
    relay = _relay(net, net.tmp / "vm1.vsock")
    before = net.counter("sink")
    time.sleep(0.3)
    assert net.counter("sink") == before  # still off
    assert call(ctl1, "POST", "/v1/claims/c1/enable")[0] == 200
    _until("the exit sees the guest after the restart", lambda: net.counter("sink") > before)
    assert net.client("ping", SERVER) == {"replies": 3}

    # Move: export from the first daemon, import into a second one with its own MAC and VTEP address.
    d2, ctl2 = _daemon(net, "h2", HOST2_IP, SBXNET_EGRESS_ROUTER_MAC=MAC2)
    # the exit floods what it cannot place (its ARP requests) to the second daemon's VTEP
    _must("ip", "netns", "exec", net.exit, "bridge", "fdb", "append", "00:00:00:00:00:00", "dev", "vx0", "dst",
          HOST2_IP)
    st, exported = call(ctl1, "POST", "/v1/claims/c1/export")
    assert st == 200 and exported["address"] == CLAIM and exported["enabled"] is True, exported
    relay.wait(timeout=10)
    exported["uds"] = str(net.tmp / "vm1b.vsock")
    st, body = call(ctl2, "POST", "/v1/import", exported)
    assert st == 201 and body["address"] == CLAIM and body["quota_used"] == exported["quota_used"], body
    # the import's gratuitous ARP: the exit now reaches the claim at the second daemon's MAC
    _until("the exit's neighbour entry at the new MAC", lambda: f"lladdr {MAC2}" in _must(
        "ip", "-n", net.exit, "neigh", "show", CLAIM, "dev", "vx0"))
    relay = _relay(net, net.tmp / "vm1b.vsock")
    # forgotten: the exit must ask, and only the second daemon answers for the claim now
    _must("ip", "-n", net.exit, "neigh", "flush", "dev", "vx0")
    assert net.client("ping", SERVER) == {"replies": 3}
    assert f"lladdr {MAC2}" in _must("ip", "-n", net.exit, "neigh", "show", CLAIM, "dev", "vx0")
    assert net.counter("from_other") == 0
    first = _stop(d1)
    assert "c1" not in first["claims"]
    second = _stop(d2)
    assert second["arp_answered"] >= 1 and second["router"]["garp_sent"] >= 1, second
    assert second["claims"]["c1"]["frames_out"] > 0
    assert os.path.exists(net.tmp / "h2" / "claims.json")
