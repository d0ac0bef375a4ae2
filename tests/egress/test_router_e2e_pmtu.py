"""Path-MTU discovery end to end: the exit's uplink device has an MTU of 1400 while the overlay, the
guest and the server have 1500 (had the server's device 1400 too, its SYN-ACK's MSS would keep the
guest's segments small and no ICMP would be needed; what the server sends here is small). The exit's
kernel, forwarding the guest's DF packets, answers each too large one with an ICMP
fragmentation-needed (type 3 code 4, MTU 1400) to the claim's address, and the daemon must deliver it
to the guest (an ICMP error about one of the claim's flows), whose kernel then lowers the path's MTU.

TCP: a 4 MiB upload can only complete if that ICMP arrives (Linux does not probe MTUs by default, so
without it the full-size segments are lost for good: with the daemon dropping inbound ICMP the upload
times out); the guest's socket reports ``IP_MTU`` 1400 at the end, and its route cache the same. UDP
(to another destination, so the route cache does not already know): 1472-byte datagrams with DF until
the socket's error queue (``IP_RECVERR``) holds ``EMSGSIZE`` from an ICMP type 3 code 4 sent by the
exit's overlay address, with MTU 1400.
"""

from __future__ import annotations

import errno

import pytest
from test_router_e2e import CLAIM, HERE, SERVER, SINK, Net, _must, _readline, net  # noqa: F401
from test_router_e2e_control import _daemon, _relay, _stop

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

NARROW = 1400
EXIT_OVERLAY = "100.64.0.1"  # the exit's address on vx0: the sender of its ICMP errors toward the overlay
SO_EE_ORIGIN_ICMP = 2


def test_fragmentation_needed_from_beyond_the_exit_reaches_the_guests_sockets(net: Net) -> None:  # noqa: F811
    _must("ip", "-n", net.exit, "link", "set", "xi", "mtu", str(NARROW))
    d, ctl = _daemon(net, "h1", "10.77.0.2")
    st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a"})
    assert st == 201 and body["address"] == CLAIM, body
    server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    _relay(net, net.tmp / "vm1.vsock")
    assert "mtu" not in _must("ip", "netns", "exec", net.guest, "ip", "route", "get", SERVER)  # nothing learnt yet

    up = net.client("tcp-up", SERVER, str(4 << 20), timeout=60)
    assert up["match"] is True and up["mtu"] == NARROW, up
    assert f"mtu {NARROW}" in _must("ip", "netns", "exec", net.guest, "ip", "route", "get", SERVER)

    got = net.client("pmtu-udp", SINK, str(1500 - 28), timeout=30)
    assert got["errno"] == errno.EMSGSIZE, got
    assert (got["origin"], got["type"], got["code"], got["info"]) == (SO_EE_ORIGIN_ICMP, 3, 4, NARROW), got
    assert got["from"] == EXIT_OVERLAY and got["ip_mtu"] == NARROW, got

    stats = _stop(d)["claims"]["c1"]
    assert stats["drops"].get("no_flow", 0) == 0, stats  # every ICMP error matched a flow of the claim
