"""The control API over its real Unix socket (aiohttp client, the daemon on this event loop), the router
on loopback as in test_router.py (127.0.0.2 is exit ``a``, 127.0.0.4 exit ``b``): arm, disarm, disable,
enable, exit label, export and import, the state file across a restart, the peer-credential check, and a
one-line answer for every bad request."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from core_packets import GW_MAC, REMOTE, ROUTER_MAC, VNI, udp, vnet, vxlan_datagram

from forwarder.egress.arp import pull_arp
from forwarder.egress.router.allocator import make_allocator
from forwarder.egress.router.claim_state import StateFile
from forwarder.egress.router.control_api import ControlServer
from forwarder.egress.router.daemon import Router
from forwarder.egress.router.settings import EgressSettings
from forwarder.egress.stream import Hello, pull_hello, push_hello
from forwarder.egress.vxlan import ETH_P_ARP, ETH_P_IP, decap

EXIT_A, EXIT_B = "127.0.0.2", "127.0.0.4"
MAC_B = bytes.fromhex("020000000b0b")
POOL_FIRST = "100.64.0.2"  # the overlay's first claim address (.1 is the exits' gateway)


def _free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((EXIT_A, 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _settings(port: int, **kw: Any) -> EgressSettings:
    return EgressSettings(listen="127.0.0.1", port=port, vni=VNI, router_mac=ROUTER_MAC.hex(":"),
                          exits=[f"a={EXIT_A}@{GW_MAC.hex(':')}", f"b={EXIT_B}@{MAC_B.hex(':')}"], **kw)


@dataclass
class Api:
    router: Router
    server: ControlServer
    session: aiohttp.ClientSession
    exits: dict[str, socket.socket]
    tmp: Path

    async def call(self, method: str, path: str, body: object = None, raw: bytes | None = None
                   ) -> tuple[int, Any, str]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        async with self.session.request(method, f"http://egress{path}", data=data) as r:
            text = await r.text()
            return r.status, json.loads(text) if text.strip() else None, text

    def datagrams(self, label: str = "a", wait: float = 0.2) -> list[bytes]:
        sock = self.exits[label]
        sock.settimeout(wait)
        out = []
        while True:
            try:
                out.append(sock.recv(65536))
            except TimeoutError:
                return out

    def garps(self, label: str = "a") -> list[int]:
        got = []
        for d in self.datagrams(label):
            inb = decap(d, "x", {"x"}, vni=VNI)
            if inb.eth.ethertype == ETH_P_ARP:
                a = pull_arp(inb.payload)
                if a.spa == a.tpa:
                    got.append(a.spa)
        return got

    def inner(self, label: str = "a", wait: float = 0.2) -> list[bytes]:
        out = []
        for d in self.datagrams(label, wait):
            inb = decap(d, "x", {"x"}, vni=VNI)
            if inb.eth.ethertype == ETH_P_IP:
                out.append(bytes(inb.payload))
        return out


async def _start(tmp: Path, port: int, exits: dict[str, socket.socket], name: str = "ctl", **kw: Any) -> Api:
    settings = _settings(port, state_dir=tmp, **kw)
    router = Router(settings, allocator=make_allocator(settings), state=StateFile(tmp))
    await router.start()
    server = ControlServer(router, tmp / f"{name}.sock")
    await server.start()
    session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(tmp / f"{name}.sock")))
    return Api(router, server, session, exits, tmp)


async def _stop(api: Api) -> None:
    await api.session.close()
    await api.server.stop()
    await api.router.stop()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    port = _free_port()
    exits = {}
    for label, addr in (("a", EXIT_A), ("b", EXIT_B)):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((addr, port))
        exits[label] = s
    a = await _start(tmp_path, port, exits)
    try:
        yield a
    finally:
        await _stop(a)
        for s in exits.values():
            s.close()


async def _guest(uds: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(f"{uds}_2051")
    writer.write(push_hello(Hello()))
    assert pull_hello(await asyncio.wait_for(reader.readexactly(12), 5)).on
    await asyncio.sleep(0.05)
    return reader, writer


async def _send(writer: asyncio.StreamWriter, *frames: bytes) -> None:
    writer.write(b"".join(struct.pack("!I", len(f)) + f for f in frames))
    await writer.drain()
    await asyncio.sleep(0.05)


async def test_arm_gets_an_address_announces_it_and_disarm_releases_it(api: Api) -> None:
    st, body, _ = await api.call("PUT", "/v1/claims/c1", {"uds": str(api.tmp / "vm1"), "exit": "a",
                                                          "limits": {"quota_bytes": 10**9}})
    assert st == 201, body
    assert body["address"] == POOL_FIRST and body["enabled"] is True and body["exit"] == "a"
    assert os.stat(api.tmp / "vm1_2051").st_mode & 0o777 == 0o600
    assert api.garps() == [0x64400002]
    st, body, _ = await api.call("PUT", "/v1/claims/c2", {"uds": str(api.tmp / "vm2"), "exit": "a"})
    assert st == 201 and body["address"] == "100.64.0.3"
    st, listed, _ = await api.call("GET", "/v1/claims")
    assert [c["id"] for c in listed["claims"]] == ["c1", "c2"]
    st, body, _ = await api.call("DELETE", "/v1/claims/c1")
    assert st == 200 and body["address"] == POOL_FIRST
    assert not (api.tmp / "vm1_2051").exists() and "c1" not in api.router.paths
    # released into its reuse window: another claim does not get it
    st, body, _ = await api.call("PUT", "/v1/claims/c3", {"uds": str(api.tmp / "vm3"), "exit": "a"})
    assert st == 201 and body["address"] == "100.64.0.4"
    saved = json.loads((api.tmp / "claims.json").read_text())
    assert [c["id"] for c in saved["claims"]] == ["c2", "c3"]


async def test_disable_revokes_the_path_at_once_and_enable_reopens_it(api: Api) -> None:
    await api.call("PUT", "/v1/claims/c1", {"uds": str(api.tmp / "vm1"), "exit": "a"})
    _reader, writer = await _guest(api.tmp / "vm1")
    api.datagrams()
    await _send(writer, vnet() + udp(b"before"))
    assert len(api.inner()) == 1
    st, body, _ = await api.call("POST", "/v1/claims/c1/disable")
    assert st == 200 and body["enabled"] is False
    path = api.router.paths["c1"]
    assert len(path.flows) == 0  # flows forgotten: an enable judges them again
    await _send(writer, vnet() + udp(b"during"), vnet() + udp(b"during"))
    # inbound for the claim is not delivered either
    api.exits["a"].sendto(vxlan_datagram(udp(b"in", src=REMOTE, dst=0x64400002)),
                          ("127.0.0.1", api.router.settings.port))
    await asyncio.sleep(0.1)
    assert api.inner() == []
    assert path.drops["disabled"] == 3 and path.frames_since_switch == 0
    st, body, _ = await api.call("POST", "/v1/claims/c1/enable")
    assert st == 200 and body["enabled"] is True
    await _send(writer, vnet() + udp(b"after"))
    got = api.inner()
    assert len(got) == 1 and got[0].endswith(b"after")
    assert path.frames_since_switch == 1 and path.first_frame_after_switch is not None
    assert path.first_frame_after_switch >= path.switched_at
    writer.close()


async def test_exit_label_change_moves_the_traffic_and_announces_to_the_new_exit(api: Api) -> None:
    await api.call("PUT", "/v1/claims/c1", {"uds": str(api.tmp / "vm1"), "exit": "a"})
    _reader, writer = await _guest(api.tmp / "vm1")
    api.datagrams("a")
    st, body, _ = await api.call("PUT", "/v1/claims/c1/exit", {"exit": "b"})
    assert st == 200 and body["exit"] == "b"
    assert api.garps("b") == [0x64400002]
    await _send(writer, vnet() + udp(b"via b"))
    assert api.inner("a") == [] and len(api.inner("b")) == 1
    # inbound is now accepted from exit b only
    for label in ("a", "b"):
        api.exits[label].sendto(vxlan_datagram(udp(label.encode() * 3, src=REMOTE, dst=0x64400002)),
                                ("127.0.0.1", api.router.settings.port))
    await asyncio.sleep(0.1)
    assert api.router.inbound.drops["wrong_exit"] == 1
    writer.close()


async def test_announce_sends_every_claims_gratuitous_arp_now(api: Api) -> None:
    """After an exit reloads (its neighbour table and learning FDB empty): every claim announced at once,
    or only those of one exit."""
    addrs = {}
    for cid, label in (("c1", "a"), ("c2", "b")):
        st, body, _ = await api.call("PUT", f"/v1/claims/{cid}", {"uds": str(api.tmp / cid), "exit": label})
        assert st == 201
        addrs[label] = int.from_bytes(socket.inet_aton(body["address"]), "big")
    api.datagrams("a")
    api.datagrams("b")  # the announcements of arm
    st, body, _ = await api.call("POST", "/v1/announce")
    assert (st, body) == (200, {"exit": None, "announced": 2})
    assert api.garps("a") == [addrs["a"]] and api.garps("b") == [addrs["b"]]
    st, body, _ = await api.call("POST", "/v1/exits/b/announce")
    assert (st, body) == (200, {"exit": "b", "announced": 1})
    assert api.garps("b") == [addrs["b"]] and api.garps("a") == []
    st, body, _ = await api.call("POST", "/v1/exits/zz/announce")
    assert st == 400 and body["error"] == "bad_exit"
    assert api.garps("a") == [] and api.garps("b") == []


async def test_a_restart_keeps_address_switch_exit_and_quota(tmp_path: Path, api: Api) -> None:
    await api.call("PUT", "/v1/claims/c1", {"uds": str(api.tmp / "vm1"), "exit": "a"})
    await api.call("PUT", "/v1/claims/c2", {"uds": str(api.tmp / "vm2"), "exit": "a"})
    _reader, writer = await _guest(api.tmp / "vm2")
    await _send(writer, vnet() + udp(b"x" * 500))
    used = api.router.paths["c2"].limits.bytes_used
    assert used > 0
    await api.call("POST", "/v1/claims/c1/disable")
    await api.call("PUT", "/v1/claims/c2/exit", {"exit": "b"})
    await api.call("DELETE", "/v1/claims/c1")
    await api.call("PUT", "/v1/claims/c3", {"uds": str(api.tmp / "vm3"), "exit": "a"})
    await api.call("POST", "/v1/claims/c3/disable")
    writer.close()
    await _stop(api)
    api.datagrams("a")
    api.datagrams("b")
    again = await _start(api.tmp, api.router.settings.port, api.exits, name="ctl2")
    try:
        _st, listed, _ = await again.call("GET", "/v1/claims")
        got = {c["id"]: (c["address"], c["enabled"], c["exit"], c["quota_used"]) for c in listed["claims"]}
        assert got == {"c2": ("100.64.0.3", True, "b", used), "c3": ("100.64.0.4", False, "a", 0)}
        assert (again.garps("a"), again.garps("b")) == ([0x64400004], [0x64400003])  # announced again to its exit
        # c1's released address still cools across the restart (the release log): the next claim gets .5
        st, body, _ = await again.call("PUT", "/v1/claims/c4", {"uds": str(api.tmp / "vm4"), "exit": "a"})
        assert st == 201 and body["address"] == "100.64.0.5"
    finally:
        await _stop(again)
        api.session = again.session  # the fixture's teardown closes these again, harmlessly
        api.server, api.router = again.server, again.router


async def test_export_and_import_move_a_claim_to_another_daemon(tmp_path: Path, api: Api) -> None:
    await api.call("PUT", "/v1/claims/c1", {"uds": str(api.tmp / "vm1"), "exit": "a"})
    _reader, writer = await _guest(api.tmp / "vm1")
    await _send(writer, vnet() + udp(b"y" * 300))
    await api.call("POST", "/v1/claims/c1/disable")
    st, exported, _ = await api.call("POST", "/v1/claims/c1/export")
    assert st == 200 and exported["address"] == POOL_FIRST and exported["enabled"] is False
    assert exported["quota_used"] > 0 and "c1" not in api.router.paths
    writer.close()
    # the second daemon: another directory, another VXLAN port toward the same exit sockets is not
    # possible on loopback, so it listens on 127.0.0.5 with the same port
    other_dir = tmp_path / "second"
    other_dir.mkdir()
    state = StateFile(other_dir)
    s2 = EgressSettings(listen="127.0.0.5", port=api.router.settings.port, vni=VNI,
                        router_mac="02:73:62:78:00:02", exits=[f"a={EXIT_A}@{GW_MAC.hex(':')}"], state_dir=other_dir)
    second = Router(s2, state=state)
    await second.start()
    server2 = ControlServer(second, other_dir / "ctl.sock")
    await server2.start()
    session2 = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(other_dir / "ctl.sock")))
    try:
        api.datagrams()
        exported["uds"] = str(other_dir / "vm1")
        async with session2.post("http://egress/v1/import", data=json.dumps(exported)) as r:
            assert r.status == 201, await r.text()
            body = await r.json()
        assert body["address"] == POOL_FIRST and body["enabled"] is False and body["quota_used"] == exported[
            "quota_used"]
        # the new host announces the claim with its own MAC
        anns = []
        for d in api.datagrams():
            inb = decap(d, "x", {"x"}, vni=VNI)
            if inb.eth.ethertype == ETH_P_ARP:
                anns.append(pull_arp(inb.payload))
        assert [(a.spa, a.tpa, a.sha.hex(":")) for a in anns] == [(0x64400002, 0x64400002, "02:73:62:78:00:02")]
        # importing it twice, or into a daemon where its address is taken, is a conflict
        async with session2.post("http://egress/v1/import", data=json.dumps(exported)) as r:
            assert r.status == 409 and (await r.json())["error"] == "claim_exists"
        # the first daemon keeps the address cooling for c1 alone
        st, body, _ = await api.call("PUT", "/v1/claims/other", {"uds": str(api.tmp / "vmo"), "exit": "a"})
        assert body["address"] != POOL_FIRST
    finally:
        await session2.close()
        await server2.stop()
        await second.stop()


BAD_REQUESTS = [
    ("PUT", "/v1/claims/c1", b"{", 400, "not_json"),
    ("PUT", "/v1/claims/c1", b"[]", 400, "not_object"),
    ("PUT", "/v1/claims/c1", b'{"exit": "a"}', 400, "missing_field"),
    ("PUT", "/v1/claims/c1", b'{"exit": "a", "uds": "/tmp/x", "address": "100.64.0.9"}', 400, "unknown_field"),
    ("PUT", "/v1/claims/c1", b'{"exit": "z", "uds": "/tmp/x"}', 400, "bad_exit"),
    ("PUT", "/v1/claims/c1", b'{"exit": "a", "uds": "relative"}', 400, "bad_field"),
    ("PUT", "/v1/claims/c1", b'{"exit": "a", "uds": "/tmp/x", "limits": {"byte_rate": "fast"}}', 400, "bad_field"),
    ("PUT", "/v1/claims/c1", b"x" * 70000, 400, "too_long"),
    ("PUT", "/v1/claims/c%20d", b'{"exit": "a", "uds": "/tmp/x"}', 400, "bad_claim_id"),
    ("PUT", "/v1/claims/armed", b'{"exit": "a", "uds": "/tmp/y"}', 409, "claim_exists"),
    ("GET", "/v1/claims/nope", b"", 404, "no_such_claim"),
    ("DELETE", "/v1/claims/nope", b"", 404, "no_such_claim"),
    ("POST", "/v1/claims/nope/disable", b"", 404, "no_such_claim"),
    ("PUT", "/v1/claims/armed/exit", b'{"exit": "q"}', 400, "bad_exit"),
    ("PUT", "/v1/claims/armed/exit", b'{"exit": "a", "x": 1}', 400, "unknown_field"),
    ("POST", "/v1/import", b'{"id": "n", "address": "10.0.0.1", "exit": "a", "uds": "/tmp/n"}', 400, "bad_field"),
    ("POST", "/v1/import", b'{"id": "armed", "address": "100.64.0.9", "exit": "a", "uds": "/tmp/n"}', 409,
     "claim_exists"),
    ("POST", "/v1/import", b'{"id": "n", "address": "100.64.0.2", "exit": "a", "uds": "/tmp/n"}', 409,
     "address_in_use"),
    ("GET", "/v1/nothing", b"", 404, "no_such_route"),
    ("PATCH", "/v1/claims/armed", b"", 405, "method_not_allowed"),
]


async def test_every_bad_request_gets_a_one_line_answer(api: Api) -> None:
    st, body, _ = await api.call("PUT", "/v1/claims/armed", {"uds": str(api.tmp / "armed"), "exit": "a"})
    assert st == 201 and body["address"] == POOL_FIRST
    for method, path, raw, status, reason in BAD_REQUESTS:
        st, body, text = await api.call(method, path, raw=raw)
        assert (st, body["error"]) == (status, reason), (method, path, raw[:60], text)
        assert text.count("\n") == 1 and text.endswith("\n") and body["detail"]
    assert list(api.router.paths) == ["armed"]  # nothing half-armed
    st, body, _ = await api.call("PUT", "/v1/claims/c1", {"uds": str(api.tmp / "armed"), "exit": "a"})
    assert (st, body["error"]) == (409, "uds_in_use")


def test_a_peer_that_is_not_root_is_refused() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: to run a client as another user")
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs /usr/bin/python3 for the client run as another user")
    # a directory another user can reach (pytest's own are root's alone)
    tmp_path = Path(tempfile.mkdtemp(prefix="sbxnet-ctl-"))
    try:
        _peer_check(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _peer_check(tmp_path: Path) -> None:
    # The socket is 0600, so another user cannot even connect; opened up here so that the peer
    # credential check is what refuses it.
    script = f"""
import asyncio, os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent.parent)!r})
from forwarder.egress.router.control_api import ControlServer
from forwarder.egress.router.daemon import Router
from forwarder.egress.router.settings import EgressSettings
import subprocess

async def main():
    r = Router(EgressSettings(listen="127.0.0.1", port={_free_port()}, exits=["a=127.0.0.2@02:00:00:00:00:01"]))
    await r.start()
    c = ControlServer(r, __import__("pathlib").Path({str(tmp_path / "c.sock")!r}))
    await c.start()
    mode = os.stat({str(tmp_path / "c.sock")!r}).st_mode & 0o777
    os.chmod({str(tmp_path / "c.sock")!r}, 0o666)
    os.chmod({str(tmp_path)!r}, 0o755)
    def client(uid):
        code = "import http.client, socket\\n" \\
            "c = http.client.HTTPConnection('x')\\n" \\
            "c.sock = socket.socket(socket.AF_UNIX); c.sock.connect({str(tmp_path / "c.sock")!r})\\n" \\
            "c.request('GET', '/v1/claims'); r = c.getresponse(); print(r.status, r.read().decode().strip())"
        return subprocess.run(["/usr/bin/python3", "-c", code], user=uid, capture_output=True, text=True, timeout=30)
    loop = asyncio.get_running_loop()
    nobody = await loop.run_in_executor(None, client, 65534)
    root = await loop.run_in_executor(None, client, 0)
    print(oct(mode), "|", nobody.stdout.strip() or nobody.stderr.strip()[-200:], "|", root.stdout.strip(), "|",
          c.refused)
    await c.stop()
    await r.stop()

asyncio.run(main())
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    mode, nobody, root, refused = (part.strip() for part in r.stdout.strip().split("|"))
    assert mode == "0o600"
    assert nobody.startswith("403 ") and '"forbidden"' in nobody, nobody
    assert root.startswith("200 ") and refused == "1"


async def test_a_state_file_that_cannot_be_read_refuses_the_start(tmp_path: Path) -> None:
    # Starting without the claims it holds would hand their addresses to others.
    from sbxnet.errors import ConfigError

    for text, named in (("{", "claims.json"), ('{"version": 2, "claims": []}', "version 2"),
                        ('{"version": 1, "claims": [{"id": "c1"}]}', "claims.0.exit: Field required")):
        (tmp_path / "claims.json").write_text(text)
        router = Router(_settings(_free_port(), state_dir=tmp_path), state=StateFile(tmp_path))
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            await router.start()
        await router.stop()


def test_the_claims_cli_over_a_running_daemon(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
    env.update(PYTHONPATH=str(root), SBXNET_EGRESS_EXITS=f"a={EXIT_A}@{GW_MAC.hex(':')}",
               SBXNET_EGRESS_LISTEN="127.0.0.1", SBXNET_EGRESS_PORT=str(_free_port()),
               SBXNET_EGRESS_STATE_DIR=str(tmp_path), SBXNET_EGRESS_CONTROL_SOCKET=str(tmp_path / "ctl.sock"),
               SBXNET_EGRESS_METRICS_PORT="0")
    daemon = subprocess.Popen([sys.executable, "-m", "sbxnet.app.cli", "egress"], env=env, cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sbxnet.app.cli", "egress", "claims", *args], env=env,
                              cwd=root, input=stdin, capture_output=True, text=True, timeout=60)

    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ctl.sock").exists():
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr
            time.sleep(0.05)
        r = cli("arm", "c1", "--uds", str(tmp_path / "vm1"), "--exit", "a", "--limits", '{"quota_bytes": 1000}')
        assert r.returncode == 0 and json.loads(r.stdout)["address"] == POOL_FIRST, r.stderr
        r = cli("--socket", str(tmp_path / "ctl.sock"), "disable", "c1")
        assert r.returncode == 0 and json.loads(r.stdout)["enabled"] is False
        assert [c["id"] for c in json.loads(cli("list").stdout)["claims"]] == ["c1"]
        exported = cli("export", "c1")
        assert exported.returncode == 0 and json.loads(cli("list").stdout)["claims"] == []
        r = cli("import", "-", stdin=exported.stdout)
        assert r.returncode == 0 and json.loads(r.stdout)["enabled"] is False, r.stderr
        r = cli("show", "nope")
        assert r.returncode == 1 and "404 no_such_claim" in r.stderr and r.stderr.count("\n") == 1
        r = cli("exit", "c1", "zz")
        assert r.returncode == 1 and "400 bad_exit" in r.stderr
        r = cli("announce")
        assert r.returncode == 0 and json.loads(r.stdout) == {"exit": None, "announced": 1}, r.stderr
        r = cli("announce", "--exit", "a")
        assert r.returncode == 0 and json.loads(r.stdout) == {"exit": "a", "announced": 1}, r.stderr
        daemon.send_signal(signal.SIGHUP)  # the exits reloaded: the same as announce
        time.sleep(0.5)
        assert cli("disarm", "c1").returncode == 0
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=20)
    assert daemon.returncode == 0
    announced = [json.loads(line) for line in err.splitlines() if '"claims_announced"' in line]
    assert [(e["exit"], e["claims"]) for e in announced] == [(None, 1), ("a", 1), (None, 1)], err[-2000:]
