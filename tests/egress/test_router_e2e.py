"""The router daemon end to end, real kernels on both ends: guest, host, exit and internet namespaces.

guest: ``guest_relay.py`` owns a TUN device (IFF_VNET_HDR, TSO offloads) with the claim's address and
speaks the stream protocol to the daemon's ``<uds>_2051``. host: ``sbxnet egress`` (two claims armed
from a JSON file, exit ``a``). exit: plain Linux (learning ``vxlan`` with dstport 4789, ``arp_accept``,
forwarding, masquerade out of its uplink), with nftables counters ahead of conntrack (priority -500)
recording what arrives from the overlay. internet: the server (``e2e_peer.py``). Because the exit
masquerades, the server itself sees the exit's uplink address; what the claim's address must be is the
source the exit receives from the overlay, which its counters check. No traffic leaves the namespaces.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parent.parent.parent
HERE = Path(__file__).resolve().parent
EXIT_IP, HOST_IP = "10.77.0.1", "10.77.0.2"
UPLINK_EXIT, UPLINK_NET = "10.78.0.1", "10.78.0.2"
SERVER, SINK = "93.184.216.34", "93.184.216.99"  # the internet's server; where the hand-made frames go
CLAIM, OTHER = "100.64.1.2", "100.64.1.3"
VNI = 7
NFT = f"""
table ip sbx {{
    counter from_claim {{}}
    counter from_other {{}}
    counter sink {{}}
    counter to_other_claim {{}}
    chain pre {{
        type filter hook prerouting priority -500;
        iifname "vx0" ip daddr {SINK} counter name sink
        iifname "vx0" ip daddr {OTHER} counter name to_other_claim
        iifname "vx0" ip saddr {CLAIM} counter name from_claim
        iifname "vx0" ip saddr != {CLAIM} counter name from_other
    }}
    chain post {{
        type nat hook postrouting priority 100;
        oifname "xi" masquerade
    }}
}}
"""

ETHTOOL_TX_CSUM_OFF = """
import sys
from pyroute2 import Ethtool
e = Ethtool()
f = e.get_features(sys.argv[1])
f.features["tx-checksum-ip-generic"].enable = False
e.set_features(sys.argv[1], f)
"""


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def _must(*args: str) -> str:
    r = _run(*args)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


@dataclass
class Net:
    guest: str
    host: str
    exit: str
    inet: str
    tmp: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def ns_python(self, ns: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], cwd=ROOT, env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(p)
        return p

    def client(self, *args: str, timeout: float = 60) -> dict[str, object]:
        r = subprocess.run(["ip", "netns", "exec", self.guest, sys.executable, str(HERE / "e2e_peer.py"), *args],
                           capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 0, r.stderr
        out: dict[str, object] = json.loads(r.stdout)
        return out

    def counter(self, name: str) -> int:
        out = json.loads(_must("ip", "netns", "exec", self.exit, "nft", "-j", "list", "counter", "ip", "sbx", name))
        for item in out["nftables"]:
            if "counter" in item:
                return int(item["counter"]["packets"])
        raise AssertionError(out)


def _readline(p: subprocess.Popen[str], want: str, timeout: float = 20) -> str:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.startswith(want):
            return line
        if not line and p.poll() is not None:
            err = p.stderr.read() if p.stderr else ""
            raise AssertionError(f"process ended before {want!r}: {err}")
    raise AssertionError(f"no {want!r} within {timeout} s")


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("needs /dev/net/tun")
    if shutil.which("nft") is None:
        pytest.skip("needs nft (the exit's counters and masquerade)")
    tag = secrets.token_hex(3)
    names = [f"sbxeg{tag}", f"sbxeh{tag}", f"sbxex{tag}", f"sbxei{tag}"]
    made: list[str] = []
    n = Net(names[0], names[1], names[2], names[3], tmp=tmp_path)
    try:
        for ns in names:
            r = _run("ip", "netns", "add", ns)
            if r.returncode:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            made.append(ns)
            _must("ip", "-n", ns, "link", "set", "lo", "up")
        _must("ip", "-n", n.exit, "link", "add", "xh", "mtu", "1600", "type", "veth", "peer", "name", "hx",
              "mtu", "1600", "netns", n.host)
        _must("ip", "-n", n.exit, "link", "add", "xi", "type", "veth", "peer", "name", "ix", "netns", n.inet)
        for ns, dev, addr in ((n.exit, "xh", f"{EXIT_IP}/30"), (n.host, "hx", f"{HOST_IP}/30"),
                              (n.exit, "xi", f"{UPLINK_EXIT}/30"), (n.inet, "ix", f"{UPLINK_NET}/30")):
            _must("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _must("ip", "-n", ns, "link", "set", dev, "up")
        for addr in (SERVER, SINK):
            _must("ip", "-n", n.inet, "addr", "add", f"{addr}/32", "dev", "lo")
        _must("ip", "-n", n.exit, "route", "add", "default", "via", UPLINK_NET)
        # A veth pair hands a packet over with its checksum still to be done (CHECKSUM_PARTIAL) where a
        # NIC would complete it on the wire; the exit's underlay completes checksums itself, as on a NIC.
        _must("ip", "netns", "exec", n.exit, sys.executable, "-c", ETHTOOL_TX_CSUM_OFF, "xh")
        r = _run("ip", "-n", n.exit, "link", "add", "vx0", "type", "vxlan", "id", str(VNI), "local", EXIT_IP,
                 "dstport", "4789", "dev", "xh")
        if r.returncode:
            pytest.skip(f"no VXLAN devices here: {r.stderr.strip()}")
        _must("ip", "-n", n.exit, "link", "set", "vx0", "mtu", "1500")
        _must("ip", "-n", n.exit, "addr", "add", "100.64.0.1/10", "dev", "vx0")
        _must("ip", "netns", "exec", n.exit, "sysctl", "-qw", "net.ipv4.conf.vx0.arp_accept=1",
              "net.ipv4.ip_forward=1")
        _must("ip", "-n", n.exit, "link", "set", "vx0", "up")
        r = subprocess.run(["ip", "netns", "exec", n.exit, "nft", "-f", "-"], input=NFT, capture_output=True,
                           text=True, timeout=30)
        if r.returncode:
            pytest.skip(f"nftables not usable here: {r.stderr.strip()}")
        yield n
    finally:
        for p in n.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for ns in made:
            _run("ip", "netns", "del", ns)


def _ip_checksum(hdr: bytes) -> int:
    s = sum(struct.unpack(f"!{len(hdr) // 2}H", hdr))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _udp_frame(payload: bytes, *, frag: int = 0, udp_len: int | None = None, extra: bytes = b"") -> bytes:
    """vnet header (no offload) + IPv4/UDP from the claim to the sink, built here (not by the product)."""
    udp = struct.pack("!HHHH", 40002, 9, udp_len if udp_len is not None else 8 + len(payload), 0) + payload
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 77, frag, 64, 17, 0,
                               bytes(map(int, CLAIM.split("."))), bytes(map(int, SINK.split(".")))))
    struct.pack_into("!H", ip, 10, _ip_checksum(bytes(ip)))
    return bytes(10) + bytes(ip) + udp + extra


def test_guest_traffic_leaves_as_the_claim_and_comes_back(net: Net) -> None:
    vx_mac = json.loads(_must("ip", "-n", net.exit, "-j", "link", "show", "vx0"))[0]["address"]
    claims = {"claims": [
        {"id": "c1", "address": CLAIM, "exit": "a", "uds": str(net.tmp / "vm1.vsock")},
        {"id": "c2", "address": OTHER, "exit": "a", "uds": str(net.tmp / "vm2.vsock")},
    ]}
    (net.tmp / "claims.json").write_text(json.dumps(claims))
    daemon = net.ns_python(net.host, "-m", "sbxnet.app.cli", "egress", env={
        "SBXNET_EGRESS_EXITS": f"a={EXIT_IP}@{vx_mac}", "SBXNET_EGRESS_VNI": str(VNI),
        "SBXNET_EGRESS_CLAIMS_FILE": str(net.tmp / "claims.json")})
    sock = net.tmp / "vm1.vsock_2051"
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
        assert time.monotonic() < deadline, "the daemon's guest socket never appeared"
        time.sleep(0.05)
    server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    relay = net.ns_python(net.guest, str(HERE / "guest_relay.py"), "--uds", str(sock), "--addr", CLAIM)
    ready = _readline(relay, "ready").split()
    assert int(ready[1], 16) == 0x2B and ready[2] == "1500"  # CSUM TSO4 TSO_ECN USO4 granted, MTU kept

    assert net.client("ping", SERVER) == {"replies": 3}
    assert net.client("udp", SERVER) == {"ok": 5}
    size = 4 << 20
    up = net.client("tcp-up", SERVER, str(size))
    assert up["match"] is True, up
    down = net.client("tcp-down", SERVER, str(size), "5")
    assert down["match"] is True and down["got"] == size, down

    # A forged source leaves as the claim's address: the exit never sees another source from the overlay.
    before = net.counter("from_claim")
    net.client("forge", "10.9.9.9", SERVER, "9")
    net.client("forge", OTHER, SERVER, "9")
    # To another claim's overlay address: refused by the guard, never at the exit.
    _must("ip", "netns", "exec", net.guest, sys.executable, "-c",
          f"import socket; socket.socket(2, 2).sendto(b'x', ({OTHER!r}, 7))")
    # Frames the kernel would never build, from the guest agent's side of the stream: one good one to the
    # sink, then a fragment (no checksum, no GSO: the C core alone would pass it), bytes past the IPv4
    # total length and a UDP length that lies. Only the good one may reach the exit.
    assert relay.stdin is not None
    for frame in (_udp_frame(b"good"), _udp_frame(b"frag", frag=0x2000), _udp_frame(b"tail", extra=b"xx"),
                  _udp_frame(b"ulen", udp_len=20), _udp_frame(b"later-frag", frag=0x0010)):
        relay.stdin.write(f"inject {frame.hex()}\n")
        relay.stdin.flush()
        _readline(relay, "injected")
    deadline = time.monotonic() + 5
    while net.counter("sink") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # anything else on its way lands too
    assert net.counter("sink") == 1
    assert net.counter("from_claim") >= before + 3  # the two forged datagrams and the good frame
    assert net.counter("from_other") == 0
    assert net.counter("to_other_claim") == 0
    # the exit reaches the claim at the router's MAC, learnt from our ARP alone
    assert "lladdr 02:73:62:78:00:01" in _must("ip", "-n", net.exit, "neigh", "show", CLAIM, "dev", "vx0")

    daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=20)
    assert daemon.returncode == 0, err
    stopped = [json.loads(line) for line in err.splitlines() if '"egress_stopped"' in line]
    assert len(stopped) == 1, err
    c1 = stopped[0]["claims"]["c1"]
    assert c1["flow_refusals"].get("internal_address", 0) >= 1, c1
    assert c1["drops"].get("fragment", 0) == 2 and c1["drops"].get("bad_ip_length", 0) == 1, c1
    assert c1["drops"].get("bad_l4_header", 0) == 1, c1
    assert c1["bytes_out"] > size and c1["frames_out"] > 0, c1
    assert stopped[0]["claims"]["c2"]["frames_out"] == 0
    assert stopped[0]["router"]["garp_sent"] >= 2  # one per claim on arm
