"""Two claims sending at the same time get distinct addresses at the server (issue 12).

The namespaces of test_router_e2e.py and a second guest namespace, each guest with its own test relay
and its own claim, both armed through the control API on one daemon (the allocator gives 100.64.1.2 and
100.64.1.3). Here the exit does not masquerade and the internet routes the overlay back to the exit,
so the server sees the overlay source itself. Both guests, started together, send to the server's
"who am I" port every 2 ms for 2 s and upload 8 MiB over TCP (SHA-256 checked) meanwhile: each guest is
answered only with its own claim's address, the two runs overlap in time, and the daemon accounts each
claim's bytes to that claim alone.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_router_e2e import CLAIM, HERE, HOST_IP, OTHER, SERVER, UPLINK_EXIT, Net, _must, _readline, _run, net  # noqa: F401
from test_router_e2e_control import _daemon, _stop

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

UPLOAD = 8 << 20


def _guest_relay(n: Net, ns: str, uds: Path, addr: str) -> None:
    relay = n.ns_python(ns, str(HERE / "guest_relay.py"), "--uds", f"{uds}_2051", "--addr", addr)
    _readline(relay, "ready")


def _clients(n: Net, ns: str) -> list[subprocess.Popen[str]]:
    peer = str(HERE / "e2e_peer.py")
    return [n.ns_python(ns, peer, "whoami", SERVER, "2"), n.ns_python(ns, peer, "tcp-up", SERVER, str(UPLOAD))]


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    got: dict[str, Any] = json.loads(out)
    return got


def test_two_claims_at_once_reach_the_server_with_their_own_addresses(net: Net) -> None:  # noqa: F811
    guest2 = f"sbxeG{secrets.token_hex(3)}"
    r = _run("ip", "netns", "add", guest2)
    assert r.returncode == 0, r.stderr
    try:
        _must("ip", "-n", guest2, "link", "set", "lo", "up")
        _must("ip", "netns", "exec", net.exit, "nft", "flush", "chain", "ip", "sbx", "post")  # no masquerade
        _must("ip", "-n", net.inet, "route", "add", "100.64.0.0/10", "via", UPLINK_EXIT)
        d, ctl = _daemon(net, "h1", HOST_IP)
        for cid, uds, want in (("c1", net.tmp / "vm1.vsock", CLAIM), ("c2", net.tmp / "vm2.vsock", OTHER)):
            st, body = call(ctl, "PUT", f"/v1/claims/{cid}", {"uds": str(uds), "exit": "a"})
            assert st == 201 and body["address"] == want, body
        server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
        _readline(server, "ready")
        _guest_relay(net, net.guest, net.tmp / "vm1.vsock", CLAIM)
        _guest_relay(net, guest2, net.tmp / "vm2.vsock", OTHER)

        first, second = _clients(net, net.guest), _clients(net, guest2)
        who1, up1 = (_result(p) for p in first)
        who2, up2 = (_result(p) for p in second)
        assert up1["match"] is True and up2["match"] is True, (up1, up2)
        assert set(who1["seen"]) == {CLAIM}, who1
        assert set(who2["seen"]) == {OTHER}, who2
        for who in (who1, who2):  # most answered (UDP; the uploads share the path)
            assert sum(who["seen"].values()) >= who["sent"] // 2, who
        # the two senders overlapped (both clocks are the host's monotonic clock)
        assert who1["t0"] < who2["end"] and who2["t0"] < who1["end"], (who1, who2)
        stopped = _stop(d)["claims"]
        for cid in ("c1", "c2"):
            assert stopped[cid]["bytes_out"] > UPLOAD, stopped[cid]
            assert stopped[cid]["bytes_out"] < 2 * UPLOAD, stopped[cid]  # not the other's upload too
    finally:
        _run("ip", "netns", "del", guest2)
