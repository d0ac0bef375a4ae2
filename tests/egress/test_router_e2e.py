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
import signal
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_support import (  # noqa: F401  (re-exported: the other e2e tests import them from here)
    CLAIM,
    EXIT_IP,
    HERE,
    HOST_IP,
    OTHER,
    ROOT,
    SERVER,
    SINK,
    UPLINK_EXIT,
    UPLINK_NET,
    VNI,
    Net,
    _must,
    _readline,
    _run,
    four_namespaces,
)

pytestmark = pytest.mark.netns


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    with four_namespaces(tmp_path) as n:
        yield n


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
