"""Resume end to end (issue 12 point 6): a download that straddles a daemon restart, then one that
straddles a move to a second daemon, both complete with their SHA-256 right.

The four namespaces and daemons of test_router_e2e_control.py. The guest relay runs with
``--reconnect`` (a guest agent redialling its host side: the device and the guest's TCP sockets stay).
The guest downloads 48 MiB from the internet namespace's server; once a quarter of it has reached the
guest (the daemon's own count of bytes in), the daemon is stopped and started again on the same state
directory; the claim keeps its address, the server's next segments reopen the flow on the new daemon
(``flows_resumed``), and the download completes. Then the same across a move: export from the first
daemon, import into a second (its own VTEP address and MAC, announced by gratuitous ARP), the relay
redialling the new host's socket. The gap is reported from the guest's side (the longest wait between
two reads of the download) and the relay's (stream closed to stream back), both by the monotonic clock.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_router_e2e import CLAIM, HERE, SERVER, Net, _must, _readline, net  # noqa: F401
from test_router_e2e_control import EXIT2_IP, HOST2_IP, MAC2, _claim, _daemon, _stop, _until

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

SIZE = 48 << 20


def _download(n: Net, seed: int) -> subprocess.Popen[str]:
    return n.ns_python(n.guest, str(HERE / "e2e_peer.py"), "tcp-down", SERVER, str(SIZE), str(seed))


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    got: dict[str, Any] = json.loads(out)
    return got


def _midway(ctl: Path, base: int) -> None:
    _until("a quarter of the download in", lambda: _claim(ctl)["stats"]["bytes_in"] - base > SIZE // 4, 60)


def _outage(relay: subprocess.Popen[str]) -> tuple[float, float]:
    closed = float(_readline(relay, "closed", 30).split()[1])
    back = float(_readline(relay, "reconnected", 30).split()[1])
    return closed, back


def test_a_download_straddles_a_restart_and_a_move(net: Net) -> None:  # noqa: F811
    for ns, dev, addr in ((net.host, "hx", f"{HOST2_IP}/24"), (net.exit, "xh", f"{EXIT2_IP}/24")):
        _must("ip", "-n", ns, "addr", "add", addr, "dev", dev)
    d1, ctl1 = _daemon(net, "h1", "10.77.0.2")
    st, body = call(ctl1, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a"})
    assert st == 201 and body["address"] == CLAIM, body
    server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    relay = net.ns_python(net.guest, str(HERE / "guest_relay.py"), "--uds", str(net.tmp / "vm1.vsock_2051"),
                          "--addr", CLAIM, "--reconnect")
    _readline(relay, "ready")
    assert net.client("ping", SERVER) == {"replies": 3}

    # Restart during a download.
    down = _download(net, 21)
    _midway(ctl1, 0)
    first = _stop(d1)
    assert first["router"]["flows_ended"] >= 1  # the live download among them, ended by the stop
    d1, ctl1 = _daemon(net, "h1", "10.77.0.2")
    assert _claim(ctl1)["address"] == CLAIM  # the claim keeps its address across the restart
    closed, back = _outage(relay)
    got = _result(down)
    assert got["match"] is True and got["got"] == SIZE, got
    stats = _claim(ctl1)["stats"]
    assert stats["flows_resumed"] >= 1 and stats["bytes_in"] > 0, stats
    print(f"\nrestart: the guest's longest wait for download bytes {got['max_gap']:.3f} s; stream down for "
          f"{back - closed:.3f} s; download {got['s']:.2f} s")

    # Move during a download: export from the first daemon, import into a second one.
    d2, ctl2 = _daemon(net, "h2", HOST2_IP, SBXNET_EGRESS_ROUTER_MAC=MAC2)
    _must("ip", "netns", "exec", net.exit, "bridge", "fdb", "append", "00:00:00:00:00:00", "dev", "vx0", "dst",
          HOST2_IP)
    base = stats["bytes_in"]
    down = _download(net, 22)
    _midway(ctl1, base)
    assert relay.stdin is not None
    relay.stdin.write(f"uds {net.tmp / 'vm1b.vsock_2051'}\n")
    relay.stdin.flush()
    _readline(relay, "uds")
    t_export = time.monotonic()
    st, exported = call(ctl1, "POST", "/v1/claims/c1/export")
    assert st == 200, exported
    exported["uds"] = str(net.tmp / "vm1b.vsock")
    st, body = call(ctl2, "POST", "/v1/import", exported)
    assert st == 201 and body["address"] == CLAIM, body
    t_import = time.monotonic()
    closed, back = _outage(relay)
    got = _result(down)
    assert got["match"] is True and got["got"] == SIZE, got
    moved = _claim(ctl2)["stats"]
    assert moved["flows_resumed"] >= 1 and moved["bytes_in"] > 0, moved
    assert f"lladdr {MAC2}" in _must("ip", "-n", net.exit, "neigh", "show", CLAIM, "dev", "vx0")
    print(f"move: export to import answered {t_import - t_export:.3f} s; stream down for {back - closed:.3f} s; "
          f"the guest's longest wait for download bytes {got['max_gap']:.3f} s; download {got['s']:.2f} s")
    _stop(d1)
    second = _stop(d2)
    assert second["claims"]["c1"]["flows_resumed"] >= 1
