"""The router daemon over loopback, no namespaces: a real Unix socket for the guest, real UDP sockets
for the exits (127.0.0.2 is exit ``a``, 127.0.0.3 a stranger), the daemon's own event loop.

What leaves is parsed by dpkt and ``core_packets`` (the tests' own oracle). The daemon's path must
refuse every fragment and every length mismatch, though the C core alone accepts some of them
(docs/egress.md, "The C packet core"): each is sent between two good frames and must never reach the
exit, counted under the validator's reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dpkt
import pytest
from core_packets import (
    GW_MAC,
    REMOTE,
    ROUTER_MAC,
    VNI,
    a4,
    csum_frame,
    dpkt_checked,
    icmp_error,
    tcp,
    udp,
    vnet,
    vxlan_datagram,
)

from forwarder.egress.arp import ArpPacket, pull_arp, push_arp
from forwarder.egress.router.claims import Known, parse_claims
from forwarder.egress.router.daemon import Router
from forwarder.egress.router.settings import EgressSettings
from forwarder.egress.stream import Hello, pull_hello, push_hello
from forwarder.egress.vxlan import ETH_P_ARP, ETH_P_IP, decap, encap, push_ethernet, push_vxlan
from sbxnet.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent.parent
CLAIM, OTHER = 0x64400102, 0x64400103  # 100.64.1.2, 100.64.1.3
EXIT, STRANGER = "127.0.0.2", "127.0.0.3"


def _free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((EXIT, 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@dataclass
class Rig:
    router: Router
    exit: socket.socket
    stranger: socket.socket
    port: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    answer: Hello

    def datagrams(self, sock: socket.socket | None = None, wait: float = 0.3) -> list[bytes]:
        sock = sock or self.exit
        sock.settimeout(wait)
        out = []
        while True:
            try:
                out.append(sock.recv(65536))
            except TimeoutError:
                return out

    def inner(self, sock: socket.socket | None = None, wait: float = 0.3) -> list[bytes]:
        """The IPv4 packets that reached the exit (ARP left out)."""
        got = []
        for d in self.datagrams(sock, wait):
            inb = decap(d, "x", {"x"}, vni=VNI)
            if inb.eth.ethertype == ETH_P_IP:
                assert inb.eth.dst == GW_MAC and inb.eth.src == ROUTER_MAC
                got.append(bytes(inb.payload))
        return got

    async def send(self, *frames: bytes) -> None:
        self.writer.write(b"".join(struct.pack("!I", len(f)) + f for f in frames))
        await self.writer.drain()
        await asyncio.sleep(0.05)

    def drops(self) -> dict[str, int]:
        return dict(self.router.paths["c1"].drops)


async def _rig(tmp_path: Path, policy: dict[str, object] | None = None, **settings: Any) -> AsyncIterator[Rig]:
    """The daemon with claims c1 (``policy``) and c2 and ``settings`` besides the rig's own, c1's guest hello'd."""
    port = _free_port()
    exit_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    exit_sock.bind((EXIT, port))
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind((STRANGER, port))
    s = EgressSettings(listen="127.0.0.1", port=port, vni=VNI, exits=[f"a={EXIT}@{GW_MAC.hex(':')}"],
                       router_mac=ROUTER_MAC.hex(":"), **settings)
    claims = parse_claims(json.dumps({"claims": [
        {"id": "c1", "address": "100.64.1.2", "exit": "a", "uds": str(tmp_path / "vm1"), "policy": policy or {}},
        {"id": "c2", "address": "100.64.1.3", "exit": "a", "uds": str(tmp_path / "vm2"),
         "policy": {"rules": ["deny udp any 53"]}},
    ]}), Known(s.overlay, frozenset({"a"})))
    router = Router(s, claims)
    await router.start()
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "vm1_2051"))
    writer.write(push_hello(Hello(offloads=0x2B, mtu=1500)))
    answer = pull_hello(await asyncio.wait_for(reader.readexactly(12), 5))
    await asyncio.sleep(0.05)
    rig = Rig(router, exit_sock, stranger, port, reader, writer, answer)
    try:
        yield rig
    finally:
        writer.close()
        await router.stop()
        exit_sock.close()
        stranger.close()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async for r in _rig(tmp_path):
        yield r


def _arp_of(datagram: bytes) -> ArpPacket:
    inb = decap(datagram, "x", {"x"}, vni=VNI)
    assert inb.eth.ethertype == ETH_P_ARP
    return pull_arp(inb.payload)


async def test_arm_announces_each_claim_to_its_exit(rig: Rig) -> None:
    # the gratuitous ARPs of arm went out before the guest connected
    anns = [_arp_of(d) for d in rig.datagrams()]
    assert {(a.spa, a.tpa, a.sha) for a in anns} == {(CLAIM, CLAIM, ROUTER_MAC), (OTHER, OTHER, ROUTER_MAC)}
    assert rig.answer.on and rig.answer.offloads == 0x2B and rig.answer.mtu == 1500
    assert os.stat(rig.router.paths["c1"].spec.stream_path).st_mode & 0o777 == 0o600


async def test_frames_leave_as_the_claim_whatever_the_guest_wrote(rig: Rig) -> None:
    rig.datagrams()
    await rig.send(vnet() + udp(b"hello", src=0x0A000002), vnet() + tcp(b"data", src=0x01020304))
    got = [dpkt_checked(p) for p in rig.inner()]
    assert [(bytes(p.src), bytes(p.dst)) for p in got] == [(a4(CLAIM), a4(REMOTE))] * 2
    assert bytes(got[0].data.data) == b"hello" and bytes(got[1].data.data) == b"data"
    c1 = rig.router.paths["c1"]
    assert (c1.sent.frames, c1.sent.packets, len(c1.flows)) == (2, 2, 2)


async def test_a_tso_frame_leaves_as_segments_in_one_gso_send(rig: Rig) -> None:
    rig.datagrams()
    payload = os.urandom(20000)
    await rig.send(csum_frame(tcp(payload), 1, 1448))
    got = [dpkt_checked(p) for p in rig.inner()]
    assert b"".join(bytes(p.data.data) for p in got) == payload
    assert all(len(p) <= 1500 for p in got) and len(got) == 14
    assert rig.router.vx is not None and rig.router.vx.counts["gso_sends"] >= 1


def _frag(ip: bytes, word: int) -> bytes:
    b = bytearray(ip)
    struct.pack_into("!H", b, 6, word)
    struct.pack_into("!H", b, 10, 0)
    struct.pack_into("!H", b, 10, dpkt.in_cksum(bytes(b[:20])))
    return bytes(b)


def _total(ip: bytes, total: int) -> bytes:
    b = bytearray(ip)
    struct.pack_into("!H", b, 2, total)
    return bytes(b)


def _udp_len(ip: bytes, n: int) -> bytes:
    b = bytearray(ip)
    struct.pack_into("!H", b, 24, n)
    return bytes(b)


U = udp(b"x" * 100)
BAD = [
    # every kind of fragment: first (MF), middle (MF + offset), last (offset), with and without a checksum
    ("fragment", vnet() + _frag(U, 0x2000)),
    ("fragment", vnet() + _frag(U, 0x2000 | 185)),
    ("fragment", vnet() + _frag(U, 185)),
    ("fragment", vnet() + _frag(U, 1)),
    ("fragment", vnet() + _frag(tcp(b"t" * 64), 0x4000 | 0x2000)),  # DF and MF
    ("fragment", vnet() + _frag(bytes(icmp_error(3, udp(b"q", src=REMOTE)[:28])), 0x2000)),
    # every length that lies: bytes past the total length, a total length past the bytes, under the header
    ("bad_ip_length", vnet() + U + b"\x00"),
    ("bad_ip_length", vnet() + U + b"\x00" * 1000),
    ("bad_ip_length", vnet() + _total(U, len(U) - 1)),
    ("bad_ip_length", vnet() + _total(U, len(U) + 1)),
    ("bad_ip_length", vnet() + _total(U, 19)),
    ("bad_ip_length", vnet() + _total(U, 0)),
    ("bad_l4_header", vnet() + _udp_len(U, 8 + 99)),
    ("bad_l4_header", vnet() + _udp_len(U, 8 + 101)),
    ("bad_l4_header", vnet() + _udp_len(U, 0)),
    ("bad_l4_header", vnet() + _udp_len(U, 0xFFFF)),
]


async def test_every_fragment_and_length_mismatch_is_refused_on_the_daemons_path(rig: Rig) -> None:
    rig.datagrams()
    good = vnet() + udp(b"good")
    for _, frame in BAD:
        await rig.send(good, frame, good)
    got = rig.inner(wait=0.5)
    assert len(got) == 2 * len(BAD) and all(bytes(dpkt.ip.IP(p).data.data) == b"good" for p in got)
    want: dict[str, int] = {}
    for reason, _ in BAD:
        want[reason] = want.get(reason, 0) + 1
    assert rig.drops() == want


async def test_guarded_and_denied_destinations_are_dropped_and_counted(rig: Rig) -> None:
    rig.datagrams()
    await rig.send(vnet() + udp(b"x", dst=OTHER), vnet() + udp(b"x", dst=0x0A000001), vnet() + udp(b"ok"))
    assert len(rig.inner()) == 1
    assert dict(rig.router.paths["c1"].flows.refusals) == {"internal_address": 2}


async def test_inbound_reaches_the_guest_and_strangers_do_not(rig: Rig) -> None:
    await rig.send(vnet() + udp(b"question"))  # the flow the answer belongs to
    reply = udp(b"answer", src=REMOTE, dst=CLAIM, sport=53, dport=5353)
    rig.exit.sendto(vxlan_datagram(reply), ("127.0.0.1", rig.port))
    rig.stranger.sendto(vxlan_datagram(udp(b"stranger", src=REMOTE, dst=CLAIM)), ("127.0.0.1", rig.port))
    rig.exit.sendto(vxlan_datagram(udp(b"nobody", src=REMOTE, dst=0x64400109)), ("127.0.0.1", rig.port))
    (n,) = struct.unpack("!I", await asyncio.wait_for(rig.reader.readexactly(4), 5))
    frame = await rig.reader.readexactly(n)
    assert frame[10:] == reply
    await asyncio.sleep(0.1)
    assert rig.router.inbound.drops == {"unknown_vtep": 1, "unknown_claim": 1}


async def test_arp_answered_for_armed_claims_only_and_only_from_exits(rig: Rig) -> None:
    rig.datagrams()
    asker = bytes.fromhex("020000000009")

    def request(tpa: int) -> bytes:
        req = ArpPacket(1, asker, 0x64400001, bytes(6), tpa)
        return push_vxlan(VNI) + push_ethernet(b"\xff" * 6, asker, ETH_P_ARP) + push_arp(req)

    for tpa in (CLAIM, 0x64400109):
        rig.exit.sendto(request(tpa), ("127.0.0.1", rig.port))
    rig.stranger.sendto(request(CLAIM), ("127.0.0.1", rig.port))
    await asyncio.sleep(0.1)  # the daemon runs on this loop: let it answer before reading blocks
    replies = [_arp_of(d) for d in rig.datagrams()]
    assert [(r.op, r.spa, r.sha, r.tpa, r.tha) for r in replies] == [(2, CLAIM, ROUTER_MAC, 0x64400001, asker)]
    assert rig.datagrams(rig.stranger) == []


async def test_a_reconnect_keeps_the_claims_flows_and_quota(rig: Rig, tmp_path: Path) -> None:
    await rig.send(vnet() + udp(b"before"))
    c1 = rig.router.paths["c1"]
    used = c1.limits.bytes_used
    assert used > 0 and len(c1.flows) == 1
    rig.writer.close()
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "vm1_2051"))
    writer.write(push_hello(Hello(offloads=0x01, mtu=1400)))
    assert pull_hello(await asyncio.wait_for(reader.readexactly(12), 5)).mtu == 1400
    writer.write(struct.pack("!I", len(vnet() + udp(b"again!"))) + vnet() + udp(b"again!"))
    await writer.drain()
    await asyncio.sleep(0.1)
    assert len(c1.flows) == 1 and c1.limits.bytes_used == 2 * used
    writer.close()


async def test_a_bad_frame_length_closes_the_stream(rig: Rig) -> None:
    rig.writer.write(struct.pack("!I", 29) + bytes(29))
    assert await asyncio.wait_for(rig.reader.read(), 5) == b""
    assert rig.drops() == {"bad_frame_length": 1}


async def test_a_bad_hello_closes_the_stream(rig: Rig, tmp_path: Path) -> None:
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "vm2_2051"))
    writer.write(b"\x00\x02" + bytes(10))
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert dict(rig.router.paths["c2"].drops) == {"hello_version": 1}
    writer.close()


async def test_quota_refuses_once_used(tmp_path: Path) -> None:
    port = _free_port()
    exit_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    exit_sock.bind((EXIT, port))
    s = EgressSettings(listen="127.0.0.1", port=port, vni=VNI, exits=[f"a={EXIT}@{GW_MAC.hex(':')}"])
    claims = parse_claims(json.dumps({"claims": [{"id": "c1", "address": "100.64.1.2", "exit": "a",
                                                 "uds": str(tmp_path / "vm"), "limits": {"quota_bytes": 300}}]}),
                          Known(s.overlay, frozenset({"a"})))
    router = Router(s, claims)
    await router.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "vm_2051"))
        writer.write(push_hello(Hello()))
        await reader.readexactly(12)
        f = vnet() + udp(b"q" * 100)  # 100 + 28 + 64 = 192 wire bytes: one fits the quota, two do not
        writer.write((struct.pack("!I", len(f)) + f) * 2)
        await writer.drain()
        await asyncio.sleep(0.1)
        assert router.paths["c1"].sent.frames == 1 and dict(router.paths["c1"].drops) == {"quota": 1}
        writer.close()
    finally:
        await router.stop()
        exit_sock.close()


# ---------------------------------------------------------------- settings and claims


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
    full.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sbxnet.app.cli", "egress", "--check", *args], env=full,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "egress.exits"),
        ({"SBXNET_EGRESS_EXITS": "a=10.0.0.1"}, "SBXNET_EGRESS_EXITS"),
        ({"SBXNET_EGRESS_EXITS": "a=10.0.0.1@01:00:00:00:00:01"}, "not a unicast address"),
        ({"SBXNET_EGRESS_EXITS": "a=10.0.0.1@02:00:00:00:00:01,a=10.0.0.2@02:00:00:00:00:02"}, "given twice"),
        ({"SBXNET_EGRESS_EXITS": "a=10.0.0.1@02:00:00:00:00:01", "SBXNET_EGRESS_PORT": "0"}, "SBXNET_EGRESS_PORT"),
        ({"SBXNET_EGRESS_EXITS": "a=10.0.0.1@02:00:00:00:00:01", "SBXNET_EGRESS_VNI": "16777216"}, "egress.vni"),
        ({"SBXNET_EGRESS_EXITS": "a=10.0.0.1@02:00:00:00:00:01", "SBXNET_EGRESS_CLAIMS_FILE": "/nonexistent"},
         "egress.claims_file"),
    ],
)
def test_each_bad_setting_is_named_with_exit_2(env: dict[str, str], named: str) -> None:
    r = _cli(env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert named in r.stderr


def test_good_settings_and_claims_check(tmp_path: Path) -> None:
    f = tmp_path / "claims.json"
    f.write_text(json.dumps({"claims": [{"id": "c1", "address": "100.64.1.2", "exit": "a", "uds": "/x"}]}))
    r = _cli({"SBXNET_EGRESS_EXITS": "a=10.0.0.1@02:00:00:00:00:01"}, "--claims-file", str(f))
    assert r.returncode == 0, r.stderr
    assert "1 claims" in r.stdout


KNOWN = Known(EgressSettings(exits=["a=10.0.0.1@02:00:00:00:00:01"]).overlay, frozenset({"a"}))


@pytest.mark.parametrize(
    ("claim", "named"),
    [
        ({"address": "10.0.0.2"}, "claims.0 (c1).address"),
        ({"address": "100.64.0.0"}, "claims.0 (c1).address"),
        ({"exit": "b"}, "claims.0 (c1).exit"),
        ({"policy": {"rules": ["permit all"]}}, "claims.0.policy.rules"),
        ({"limits": {"byte_rate": -1}}, "claims.0.limits.byte_rate"),
        ({"colour": "red"}, "claims.0.colour"),
        ({"id": "c 1"}, "claims.0.id"),
    ],
)
def test_bad_claims_are_named(claim: dict[str, object], named: str) -> None:
    base: dict[str, object] = {"id": "c1", "address": "100.64.1.2", "exit": "a", "uds": "/x"}
    with pytest.raises(ConfigError) as exc:
        parse_claims(json.dumps({"claims": [{**base, **claim}]}), KNOWN)
    assert named in str(exc.value)


def test_claims_given_twice_are_refused() -> None:
    one = {"id": "c1", "address": "100.64.1.2", "exit": "a", "uds": "/x"}
    for field, value in (("id", "c1"), ("address", "100.64.1.2"), ("uds", "/x")):
        two = {"id": "c2", "address": "100.64.1.3", "exit": "a", "uds": "/y", field: value}
        with pytest.raises(ConfigError, match=f"claims.1 \\(.*\\).{field} .*given to two claims"):
            parse_claims(json.dumps({"claims": [one, two]}), KNOWN)
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_claims("{", KNOWN)


def test_encap_helper_matches_the_datagrams_the_tests_build() -> None:
    # the tests' own datagram builder and the product's codec agree, so the loopback checks mean something
    ip = udp(b"x", src=REMOTE, dst=CLAIM)
    assert vxlan_datagram(ip) == encap(VNI, ROUTER_MAC, GW_MAC, ETH_P_IP, ip)


async def test_a_guest_that_stops_reading_is_closed(tmp_path: Path) -> None:
    port = _free_port()
    exit_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    exit_sock.bind((EXIT, port))
    s = EgressSettings(listen="127.0.0.1", port=port, vni=VNI, exits=[f"a={EXIT}@{GW_MAC.hex(':')}"],
                       router_mac=ROUTER_MAC.hex(":"), stream_stall_timeout=0.5)
    claims = parse_claims(json.dumps({"claims": [{"id": "c1", "address": "100.64.1.2", "exit": "a",
                                                 "uds": str(tmp_path / "vm")}]}), Known(s.overlay, frozenset({"a"})))
    router = Router(s, claims)
    await router.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "vm_2051"))
        writer.write(push_hello(Hello()))
        await reader.readexactly(12)
        await asyncio.sleep(0.05)
        stream = router.streams["c1"]
        writer.write(struct.pack("!I", len(vnet() + udp(b"q"))) + vnet() + udp(b"q"))  # the flow
        await writer.drain()
        await asyncio.sleep(0.05)
        # The guest reads nothing more; the exit keeps sending until the stream's write buffer is full.
        dgram = vxlan_datagram(udp(b"z" * 1400, src=REMOTE, dst=CLAIM, sport=53, dport=5353))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while stream.paused_since is None:
            assert loop.time() < deadline, "the stream's write buffer never filled"
            for _ in range(64):
                exit_sock.sendto(dgram, ("127.0.0.1", port))
            await asyncio.sleep(0.001)
        paused = stream.paused_since  # the program's own timestamp (monotonic, as loop.time())
        while not stream.closed:
            assert loop.time() < deadline, "a stalled guest was never closed"
            exit_sock.sendto(dgram, ("127.0.0.1", port))
            await asyncio.sleep(0.01)
        # closed by the tick after the stall timeout, not before it
        assert loop.time() - paused >= 0.5
        drops = router.paths["c1"].drops
        assert drops["guest_stalled"] == 1 and drops["guest_backlog"] >= 1
        while "c1" in router.streams:  # connection_lost runs a loop iteration after the abort
            assert loop.time() < deadline, "the closed stream was never detached"
            await asyncio.sleep(0.01)
        writer.close()
    finally:
        await router.stop()
        exit_sock.close()
