"""An exit reload, end to end on real kernels (the namespaces and exit of test_router_e2e.py): the exit
forgets everything it learnt of the router (its neighbour entry for the claim and its learning vxlan
device's forwarding entry for the router's MAC, as a reload that re-creates the device leaves them), and
``sbxnet egress claims announce`` (the control API's ``POST /v1/announce``; SIGHUP does the same) brings
both back at once, from the claim's gratuitous ARP, rather than at its next 45 s announcement."""

from __future__ import annotations

import json
import time

import pytest
from test_router_e2e import CLAIM, Net, _must, net  # noqa: F401
from test_router_e2e_control import _daemon, _stop, _until

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

ROUTER_MAC = "02:73:62:78:00:01"
ROUTER_VTEP = "10.77.0.2"


def _learnt(n: Net) -> tuple[bool, bool]:
    """(the exit's neighbour entry for the claim at the router's MAC, its FDB entry for that MAC)."""
    neigh = _must("ip", "-n", n.exit, "neigh", "show", CLAIM, "dev", "vx0")
    fdb = json.loads(_must("ip", "netns", "exec", n.exit, "bridge", "-j", "fdb", "show", "dev", "vx0"))
    return (f"lladdr {ROUTER_MAC}" in neigh,
            any(e.get("mac") == ROUTER_MAC and e.get("dst") == ROUTER_VTEP for e in fdb))


def _forget(n: Net) -> None:
    _must("ip", "-n", n.exit, "neigh", "flush", "dev", "vx0")
    _must("ip", "netns", "exec", n.exit, "bridge", "fdb", "del", ROUTER_MAC, "dev", "vx0", "dst", ROUTER_VTEP)


def test_announce_after_an_exit_reload_teaches_it_every_claim_at_once(net: Net) -> None:  # noqa: F811
    d, ctl = _daemon(net, "h1", ROUTER_VTEP, SBXNET_EGRESS_ROUTER_MAC=ROUTER_MAC)
    st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a"})
    assert st == 201 and body["address"] == CLAIM, body
    _until("the exit learns the claim from the arm's announcement", lambda: _learnt(net) == (True, True))

    _forget(net)
    time.sleep(0.5)
    assert _learnt(net) == (False, False)  # nothing brings them back by itself before the 45 s timer
    st, body = call(ctl, "POST", "/v1/announce")
    assert (st, body) == (200, {"exit": None, "announced": 1})
    _until("the exit learns the claim again", lambda: _learnt(net) == (True, True), timeout=2)

    _forget(net)
    time.sleep(0.5)
    assert _learnt(net) == (False, False)
    st, body = call(ctl, "POST", "/v1/exits/a/announce")
    assert (st, body) == (200, {"exit": "a", "announced": 1})
    _until("the exit learns the claim again", lambda: _learnt(net) == (True, True), timeout=2)
    stopped = _stop(d)
    assert stopped["router"]["garp_sent"] >= 3, stopped  # arm, and the two announcements
