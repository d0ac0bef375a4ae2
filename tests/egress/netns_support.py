"""The four namespaces of the router daemon's end-to-end tests and benchmark: guest, host, exit, internet.

``four_namespaces`` makes them (a veth pair host-exit with MTU 1600, exit-internet, the exit's learning
``vxlan`` device with dstport 4789, ``arp_accept``, forwarding, masquerade out of its uplink, nftables
counters ahead of conntrack) and removes them, and every process started through its ``Net``, on leaving.
Where this machine cannot (not root, no TUN, no nft, no VXLAN), it calls ``pytest.skip`` with the reason.
The tests (``test_router_e2e*.py``, through the ``net`` fixture) and ``bench/egress/bench_router.py`` use it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

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



@contextmanager
def four_namespaces(tmp_path: Path) -> Iterator[Net]:
    """The four namespaces and the exit, torn down (with every process started through the ``Net``)
    on leaving; ``pytest.skip`` where this machine cannot make them."""
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



METRICS_PORT = 9467  # the daemon's default; each host namespace has its own loopback
_SAMPLE = re.compile(r"^(\w+)(\{[^}]*\})? ([-+0-9.eE]+|[+-]?Inf|NaN)$")


def scrape_metrics(n: Net, port: int = METRICS_PORT) -> dict[str, float]:
    """The daemon's /metrics in the host namespace, each sample as ``name{labels}`` -> value (the labels
    as the exposition writes them, e.g. ``sbxnet_egress_arp_total{kind="answered"}``)."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    text = _must("ip", "netns", "exec", n.host, sys.executable, "-c", code)
    got: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is not None:
            got[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return got
