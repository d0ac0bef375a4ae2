"""Interop with Linux's own VXLAN device, the exit's reference implementation.

Two network namespaces of our own joined by a veth pair: an "exit" with a learning ``vxlan`` device
configured as DESIGN.md's exit (VNI 7, dstport 4789, ``arp_accept``, an overlay gateway address), and a
"router" where this test's UDP socket on port 4789 plays the egress router. Our gratuitous ARP,
encapsulated by us, must make the exit's kernel learn the claim's neighbour entry and our VTEP in its
FDB; an ICMP echo built by dpkt inside our VXLAN/Ethernet headers must be answered; and the kernel's
VXLAN reply, received on our socket, must pass ``decap`` (from a configured VTEP) and ``inner_ipv4`` as
a packet for the claim. No traffic leaves the two namespaces.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parent.parent.parent
EXIT_IP, ROUTER_IP = "10.77.0.1", "10.77.0.2"

# Runs inside the router namespace; argv[1] is the exit namespace's name.
SCRIPT = r"""
import json, socket, subprocess, sys, time
from ipaddress import IPv4Address
import dpkt
from forwarder.egress.arp import gratuitous_arp
from forwarder.egress.vxlan import ETH_P_IP, decap, encap, inner_ipv4, push_vxlan

EXIT_NS, EXIT_IP = sys.argv[1], sys.argv[2]
ROUTER = bytes.fromhex("02005e000001")
CLAIM, GW = "100.64.1.2", "100.64.0.1"

def ex(*a):
    return subprocess.run(["ip", "-n", EXIT_NS, *a], check=True, capture_output=True, text=True).stdout

vx_mac = bytes.fromhex(json.loads(ex("-j", "link", "show", "vx0"))[0]["address"].replace(":", ""))
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", 4789))
sock.settimeout(0.2)

sock.sendto(push_vxlan(7) + gratuitous_arp(int(IPv4Address(CLAIM)), ROUTER), (EXIT_IP, 4789))
time.sleep(0.3)
neigh = ex("neigh", "show", CLAIM, "dev", "vx0")
fdb = subprocess.run(["bridge", "-n", EXIT_NS, "fdb", "show", "dev", "vx0"], capture_output=True, text=True).stdout

echo = dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=0x4242, seq=1, data=b"sbxnet" * 5))
ping = dpkt.ip.IP(src=IPv4Address(CLAIM).packed, dst=IPv4Address(GW).packed, p=1, ttl=64, id=9, data=echo)
sock.sendto(encap(7, vx_mac, ROUTER, ETH_P_IP, bytes(ping)), (EXIT_IP, 4789))

reply = None
deadline = time.monotonic() + 5
while reply is None and time.monotonic() < deadline:
    try:
        data, (src, _port) = sock.recvfrom(70000)
    except socket.timeout:
        continue
    inb = decap(data, src, {EXIT_IP}, vni=7, local_mac=ROUTER)
    inner = dpkt.ip.IP(bytes(inner_ipv4(inb)))
    if inner.p == 1 and inner.data.type == 0:
        reply = {"src": str(IPv4Address(inner.src)), "dst": str(IPv4Address(inner.dst)), "id": inner.data.data.id,
                 "data": inner.data.data.data.decode(), "eth": [inb.eth.dst.hex(), inb.eth.src == vx_mac]}
print(json.dumps({"neigh": neigh, "fdb": fdb, "reply": reply}))
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def _must(*args: str) -> None:
    r = _run(*args)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    tag = secrets.token_hex(3)
    exit_ns, router_ns = f"sbxvxe{tag}", f"sbxvxr{tag}"
    made: list[str] = []
    try:
        for ns in (exit_ns, router_ns):
            r = _run("ip", "netns", "add", ns)
            if r.returncode:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            made.append(ns)
        _must("ip", "-n", exit_ns, "link", "add", f"vxe{tag}", "type", "veth", "peer", "name", f"vxr{tag}",
              "netns", router_ns)
        _must("ip", "-n", exit_ns, "addr", "add", f"{EXIT_IP}/30", "dev", f"vxe{tag}")
        _must("ip", "-n", router_ns, "addr", "add", f"{ROUTER_IP}/30", "dev", f"vxr{tag}")
        for ns, dev in ((exit_ns, f"vxe{tag}"), (router_ns, f"vxr{tag}")):
            _must("ip", "-n", ns, "link", "set", "lo", "up")
            _must("ip", "-n", ns, "link", "set", dev, "up")
        r = _run("ip", "-n", exit_ns, "link", "add", "vx0", "type", "vxlan", "id", "7", "local", EXIT_IP,
                 "dstport", "4789", "dev", f"vxe{tag}")
        if r.returncode:
            pytest.skip(f"no VXLAN devices here: {r.stderr.strip()}")
        _must("ip", "-n", exit_ns, "addr", "add", "100.64.0.1/16", "dev", "vx0")
        _must("ip", "netns", "exec", exit_ns, "sysctl", "-qw", "net.ipv4.conf.vx0.arp_accept=1")
        _must("ip", "-n", exit_ns, "link", "set", "vx0", "up")
        yield exit_ns, router_ns
    finally:
        for ns in made:
            _run("ip", "netns", "del", ns)  # takes the veth pair and vx0 with it


def test_linux_vxlan_exit_accepts_our_headers_and_we_parse_its(namespaces: tuple[str, str]) -> None:
    exit_ns, router_ns = namespaces
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(["ip", "netns", "exec", router_ns, sys.executable, "-c", SCRIPT, exit_ns, EXIT_IP],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "lladdr 02:00:5e:00:00:01" in out["neigh"], out  # the kernel believed our announcement
    assert f"02:00:5e:00:00:01 dst {ROUTER_IP}" in out["fdb"], out  # and learned our VTEP
    assert out["reply"] == {"src": "100.64.0.1", "dst": "100.64.1.2", "id": 0x4242, "data": "sbxnet" * 5,
                            "eth": ["02005e000001", True]}, out
