"""What the daemon refuses end to end (issue 12), in the four namespaces of test_router_e2e.py.

Policy: a claim armed through the control API with the rules ``deny any <sink>/32`` and ``deny tcp any
5001`` (default allow). From the guest's own kernel: datagrams to the sink are refused as the flow's first
packet (``policy_denied``, counted per attempt) and never reach the exit (its counter for the sink stays 0);
a TCP connection to the server's port 5001 never opens, while UDP echo and ping to the same server pass,
so the refusal is the rule's and not a broken path.

Exits only: the exit's namespace gets a second address on its underlay link, not a configured VTEP. From
it: VXLAN datagrams (the right VNI, an Ethernet frame with an IPv4 packet to the claim) and ARP requests
for the claim, built here; the daemon drops every one before parsing (``unknown_vtep``), answers none
and delivers nothing to the guest. The same ARP request from the configured exit VTEP is answered (the
control: the request itself is good).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

import pytest
from netns_support import scrape_metrics
from test_router_e2e import CLAIM, EXIT_IP, HERE, HOST_IP, SERVER, SINK, VNI, Net, _must, _readline, net  # noqa: F401
from test_router_e2e_control import _claim, _daemon, _relay, _stop, _until

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

STRANGER = "10.77.0.5"  # on the exit's underlay link, but no configured exit
EXIT_OVERLAY = "100.64.0.1"
SEND_FROM = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
for hexed in sys.argv[3:]:
    s.sendto(bytes.fromhex(hexed), (sys.argv[2], 4789))
"""


def _vxlan(inner: bytes) -> bytes:
    return struct.pack("!BxxxI", 0x08, VNI << 8) + inner  # flags I, the VNI in the top 24 bits


def _arp_request(sender_mac: bytes, target: str) -> bytes:
    arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, sender_mac, socket.inet_aton(EXIT_OVERLAY),
                      bytes(6), socket.inet_aton(target))
    return _vxlan(b"\xff" * 6 + sender_mac + b"\x08\x06" + arp)


def _udp_to_claim(sender_mac: bytes, router_mac: bytes) -> bytes:
    payload = b"from a stranger"
    udp = struct.pack("!HHHH", 7, 40000, 8 + len(payload), 0) + payload
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                               socket.inet_aton(SERVER), socket.inet_aton(CLAIM)))
    s = sum(struct.unpack("!10H", ip))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    struct.pack_into("!H", ip, 10, ~s & 0xFFFF)
    return _vxlan(router_mac + sender_mac + b"\x08\x00" + bytes(ip) + udp)


def test_a_destination_the_policy_denies_is_dropped_and_counted(net: Net) -> None:  # noqa: F811
    d, ctl = _daemon(net, "h1", HOST_IP)
    policy = {"rules": [f"deny any {SINK}/32", "deny tcp any 5001"], "default_allow": True}
    st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a", "policy": policy})
    assert st == 201 and body["address"] == CLAIM, body
    server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    _relay(net, net.tmp / "vm1.vsock")

    assert net.client("udp", SERVER) == {"ok": 5}  # allowed: the default
    assert net.client("ping", SERVER) == {"replies": 3}
    got = net.client("udp-flows", SINK, "4")  # four flows to the denied destination
    assert got["answered"] == [], got
    assert net.client("tcp-connect", SERVER, "2") == {"connected": False, "error": "TimeoutError"}
    stats = _claim(ctl)["stats"]
    # four datagrams and the SYN with at least one of its retries, each a refused first packet
    assert stats["flow_refusals"].get("policy_denied", 0) >= 6, stats
    assert net.counter("sink") == 0
    stopped = _stop(d)["claims"]["c1"]
    assert stopped["flow_refusals"]["policy_denied"] >= stats["flow_refusals"]["policy_denied"], stopped


def test_vxlan_and_arp_from_an_address_that_is_no_exit_are_dropped_and_counted(net: Net) -> None:  # noqa: F811
    d, ctl = _daemon(net, "h1", HOST_IP, SBXNET_EGRESS_METRICS_PORT="9467")
    st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a"})
    assert st == 201 and body["address"] == CLAIM, body
    _relay(net, net.tmp / "vm1.vsock")
    _must("ip", "-n", net.exit, "addr", "add", f"{STRANGER}/32", "dev", "xh")
    _must("ip", "-n", net.host, "route", "add", f"{STRANGER}/32", "dev", "hx")  # passes any rp_filter
    vx = json.loads(_must("ip", "-n", net.exit, "-j", "link", "show", "vx0"))[0]["address"]
    exit_mac = bytes.fromhex(vx.replace(":", ""))
    router_mac = bytes.fromhex("027362780001")
    before = scrape_metrics(net)
    assert before.get('sbxnet_egress_inbound_drops_total{reason="unknown_vtep"}', 0) == 0

    bad = [_udp_to_claim(exit_mac, router_mac).hex()] * 3 + [_arp_request(exit_mac, CLAIM).hex()] * 2
    _must("ip", "netns", "exec", net.exit, sys.executable, "-c", SEND_FROM, STRANGER, HOST_IP, *bad)
    answered = 'sbxnet_egress_arp_total{kind="answered"}'
    dropped = 'sbxnet_egress_inbound_drops_total{reason="unknown_vtep"}'
    got = _until("the stranger's five datagrams dropped",
                 lambda: (m := scrape_metrics(net)).get(dropped, 0) >= 5 and m, 10)
    # the control: the same request from the configured exit's VTEP is answered
    _must("ip", "netns", "exec", net.exit, sys.executable, "-c", SEND_FROM, EXIT_IP, HOST_IP,
          _arp_request(exit_mac, CLAIM).hex())
    after = _until("the exit's ARP answered", lambda: (m := scrape_metrics(net)).get(answered, 0)
                   > got.get(answered, 0) and m, 10)
    assert after[dropped] == 5, after  # the stranger's, and nothing else
    assert got.get(answered, 0) == before.get(answered, 0), (before, got)  # none of the stranger's ARP
    stats = _claim(ctl)["stats"]
    assert stats["frames_in"] == 0 and stats["packets_in"] == 0, stats  # nothing reached the guest
    time.sleep(0.2)
    stopped = _stop(d)
    assert stopped["inbound_drops"].get("unknown_vtep") == 5, stopped
