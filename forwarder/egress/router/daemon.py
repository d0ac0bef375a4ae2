"""The router daemon: arms claims, owns the VXLAN socket and the guest streams, moves the bytes.

Per armed claim: a ``ClaimPath`` (flows, limits, the C batch; kept across guest reconnects) and a
Unix stream listener at ``<uds>_2051``. One VXLAN socket for every exit. A guest's frames go
``GuestStream`` → ``Router.outbound`` (judge, segment) → ``VxlanSocket.send_records`` to the claim's
exit; datagrams go ``VxlanSocket.recv_batch`` → ``InboundPath.run`` → the guest's stream, ARP answered.
A tick each second closes stalled guests and sends each claim's gratuitous ARP every
``garp_interval`` (and once on arm). SIGTERM/SIGINT stop it; the last log line has every counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from forwarder.egress.arp import gratuitous_arp
from forwarder.egress.guard import AddressGuard
from forwarder.egress.router.claims import ClaimSpec
from forwarder.egress.router.guest_stream import GuestStream
from forwarder.egress.router.inbound import InboundPath
from forwarder.egress.router.outbound import ClaimPath
from forwarder.egress.router.settings import EgressSettings
from forwarder.egress.router.vxlan_socket import VxlanSocket
from forwarder.egress.vnet import TUN_F_CSUM, TUN_F_TSO4
from forwarder.egress.vxlan import push_vxlan

log = logging.getLogger("sbxnet.egress")

TICK_S = 1.0


class Router:
    def __init__(self, settings: EgressSettings, claims: list[ClaimSpec]) -> None:
        self.settings = settings
        self.exits = settings.exit_specs()
        self.router_mac = settings.router_mac_bytes()
        self.guard = AddressGuard(settings.overlay, settings.guard_extra)
        self.specs = claims
        self.paths: dict[str, ClaimPath] = {}
        self.by_addr: dict[int, ClaimPath] = {}
        self.streams: dict[str, GuestStream] = {}
        self.servers: dict[str, asyncio.AbstractServer] = {}
        self.inbound = InboundPath(settings.vni, self.router_mac, {str(e.vtep): e.label for e in self.exits.values()})
        self.counts: Counter[str] = Counter()
        self.vx: VxlanSocket | None = None
        self._garp_due: dict[str, float] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._vxlan_hdr = push_vxlan(settings.vni)

    # ---------------------------------------------------------------- life cycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.vx = VxlanSocket(str(self.settings.listen), self.settings.port)
        loop.add_reader(self.vx.fileno(), self._on_datagrams)
        for spec in self.specs:
            await self.arm(spec)
        self._tick = loop.call_later(TICK_S, self._on_tick)

    async def arm(self, spec: ClaimSpec) -> None:
        now = time.monotonic()
        s = self.settings
        path = ClaimPath(spec, self.exits[spec.exit], vni=s.vni, router_mac=self.router_mac, guard=self.guard,
                         mtu=s.mtu, flow_cap=s.flow_cap, new_flow_rate=s.new_flow_rate,
                         flow_idle_timeout=s.flow_idle_timeout, now=now)
        sock_path = spec.stream_path
        _remove_stale_socket(sock_path)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(lambda: GuestStream(self, path), path=str(sock_path))
        os.chmod(sock_path, 0o600)  # the VMM's side is root's too; no other user may speak for a guest
        self.paths[spec.id] = path
        self.by_addr[path.address] = path
        self.servers[spec.id] = server
        self.streams_changed()
        self._announce(path)
        self._garp_due[spec.id] = now + s.garp_interval
        log.info("claim armed", extra={"event": "claim_armed", "fields": {
            "claim": spec.id, "address": str(spec.address), "exit": spec.exit, "socket": str(sock_path)}})

    async def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
        for server in self.servers.values():
            server.close()
        for stream in list(self.streams.values()):
            stream.close()
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                await server.wait_closed()
        for path in self.paths.values():
            with contextlib.suppress(OSError):
                os.unlink(path.spec.stream_path)
        if self.vx is not None:
            asyncio.get_running_loop().remove_reader(self.vx.fileno())
            self.vx.close()

    # ---------------------------------------------------------------- guest streams
    def attach(self, stream: GuestStream) -> None:
        cid = stream.path.id
        old = self.streams.get(cid)
        if old is not None:
            old.close()  # a guest that reconnects replaces its old stream; flows and limits stay
            self.counts["stream_replaced"] += 1
        self.streams[cid] = stream
        self.counts["streams_opened"] += 1

    def detach(self, stream: GuestStream) -> None:
        cid = stream.path.id
        if self.streams.get(cid) is stream:
            del self.streams[cid]
            self.streams_changed()

    def streams_changed(self) -> None:
        gro = [p.address for cid, p in self.paths.items()
               if (st := self.streams.get(cid)) is not None and st.offloads & (TUN_F_CSUM | TUN_F_TSO4)
               == TUN_F_CSUM | TUN_F_TSO4]
        self.inbound.set_claims({p.address: p.exit.label for p in self.paths.values()}, gro)

    def outbound(self, path: ClaimPath, view: memoryview, now: float) -> tuple[int, bool]:
        consumed, bad = path.take(view, now)
        self._send(path)
        while path.more():
            path.resume(view)
            self._send(path)
        return consumed, bad

    def _send(self, path: ClaimPath) -> None:
        vx = self.vx
        assert vx is not None
        host = str(path.exit.vtep)
        out = memoryview(path.batch.out)
        for off, ln, seg, count in path.sends():
            vx.send_records(out, off, ln, seg, count, host)

    # ---------------------------------------------------------------- exits
    def _on_datagrams(self) -> None:
        vx = self.vx
        assert vx is not None
        got = vx.recv_batch()
        if not got:
            return
        deliver, replies = self.inbound.run(vx.rx, got)
        for addr, frames in deliver.items():
            path = self.by_addr[addr]
            stream = self.streams.get(path.id)
            if stream is None:
                path.drops["no_guest"] += len(frames)
            else:
                stream.deliver(frames)
        for reply, host in replies:
            vx.sendto(reply, host)
            self.counts["arp_replies"] += 1

    def _announce(self, path: ClaimPath) -> None:
        assert self.vx is not None
        self.vx.sendto(self._vxlan_hdr + gratuitous_arp(path.address, self.router_mac), str(path.exit.vtep))
        self.counts["garp_sent"] += 1

    def _on_tick(self) -> None:
        now = time.monotonic()
        limit = self.settings.stream_stall_timeout
        for stream in list(self.streams.values()):
            if stream.paused_since is not None and now - stream.paused_since >= limit:
                stream.close("guest_stalled")
        for cid, due in self._garp_due.items():
            if now >= due:
                self._announce(self.paths[cid])
                self._garp_due[cid] = now + self.settings.garp_interval
        self._tick = asyncio.get_running_loop().call_later(TICK_S, self._on_tick)

    # ---------------------------------------------------------------- numbers
    def stats(self) -> dict[str, Any]:
        vx = self.vx
        return {
            "router": dict(self.counts),
            "socket": dict(vx.counts) if vx is not None else {},
            "inbound_drops": dict(self.inbound.drops),
            "arp_answered": self.inbound.arp_answered,
            "claims": {
                cid: {
                    "address": str(p.spec.address), "frames_out": p.sent.frames, "packets_out": p.sent.packets,
                    "bytes_out": p.sent.bytes, "flows": len(p.flows), "drops": dict(p.drops),
                    "flow_refusals": dict(p.flows.refusals), "quota_used": p.limits.bytes_used,
                }
                for cid, p in self.paths.items()
            },
        }


def _remove_stale_socket(path: Path) -> None:
    """A socket file left by an earlier run is removed; anything else at that path is not ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    os.unlink(path)


async def _main(settings: EgressSettings, claims: list[ClaimSpec]) -> int:
    router = Router(settings, claims)
    try:
        await router.start()
    except OSError as e:
        print(f"egress: cannot start: {e}", file=sys.stderr)
        await router.stop()
        return 1
    log.info("egress router up", extra={"event": "egress_listening", "fields": {
        "address": f"{settings.listen}:{settings.port}", "claims": len(claims)}})
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await router.stop()
    log.info("egress router stopped", extra={"event": "egress_stopped", "fields": router.stats()})
    return 0


def serve(settings: EgressSettings, claims: list[ClaimSpec], *, check_only: bool = False) -> int:
    from sbxnet import jsonlog

    jsonlog.setup(settings.log_level)
    if check_only:
        print(f"egress: settings valid, {len(claims)} claims")
        return 0
    return asyncio.run(_main(settings, claims))
