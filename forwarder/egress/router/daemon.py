"""The router daemon: arms claims, owns the VXLAN socket and the guest streams, moves the bytes.

Per armed claim: a ``ClaimPath`` (flows, limits, the C batch; kept across guest reconnects) and a
Unix stream listener at ``<uds>_2051``. One VXLAN socket for every exit. Claims get their address from
the allocator (``allocator.py``); their state (address, switch, exit label, quota used) is saved in the
state file (``claim_state.py``) on every change made through the control API (``control_api.py``, which
calls ``arm_request``, ``disarm``, ``set_enabled``, ``set_exit``, ``export`` and ``import_state``) and
restored at start. A guest's frames go
``GuestStream`` → ``Router.outbound`` (judge, segment) → ``VxlanSocket.send_records`` to the claim's
exit; datagrams go ``VxlanSocket.recv_columns`` → ``InboundPath.run`` → the guest's stream, ARP answered.
A tick each second closes stalled guests and sends each claim's gratuitous ARP every
``garp_interval`` (and once on arm, and for every claim at SIGHUP or the control API's announce, after
an exit reloads). SIGTERM/SIGINT stop it; the last log line has every counter. SIGHUP is also the shell's
reload (``sbxnet.reload``), which finds no file to reload here: one ``reloaded`` line says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import stat
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forwarder.egress.arp import gratuitous_arp
from forwarder.egress.guard import AddressGuard
from forwarder.egress.router.addresses import AddressPool, AllocationError
from forwarder.egress.router.allocator import Allocator, LocalAllocator, make_allocator
from forwarder.egress.router.audit import AuditLog, flow_record, refused_record, suppressed_record, usage_record
from forwarder.egress.router.claim_state import StateFile
from forwarder.egress.router.claims import ClaimRequest, ClaimSpec, ClaimState, check_address
from forwarder.egress.router.control_body import ControlError
from forwarder.egress.router.guest_stream import GuestStream
from forwarder.egress.router.inbound import InboundPath
from forwarder.egress.router.outbound import ClaimPath
from forwarder.egress.router.settings import EgressSettings
from forwarder.egress.router.vxlan_socket import SLOT, VxlanSocket, source_host, source_key
from forwarder.egress.vnet import TUN_F_CSUM, TUN_F_TSO4
from forwarder.egress.vxlan import push_vxlan
from sbxnet.reload import reload, wire_signals

if TYPE_CHECKING:
    from sbxnet.ops_http import OpsServer

# Datagrams read from the exits per recvmmsg and judged per call into the C core. 256 rather than 64: a
# download then costs about a tenth less of the daemon's CPU (fewer calls, and merged frames toward the guest
# a half longer, so fewer writes to it and fewer ACKs back); the delivery buffer holds 256 jumbo datagrams.
RX_BATCH = 256

log = logging.getLogger("sbxnet.egress")

TICK_S = 1.0
QUOTA_SAVE_S = 10.0  # quota used is saved at most this often (and at every control change and the stop)


class Router:
    def __init__(
        self, settings: EgressSettings, claims: Sequence[ClaimRequest] = (), *, allocator: Allocator | None = None,
        state: StateFile | None = None,
    ) -> None:
        self.settings = settings
        self.exits = settings.exit_specs()
        self.router_mac = settings.router_mac_bytes()
        self.guard = AddressGuard(settings.overlay, settings.guard_extra)
        self.requests = list(claims)
        if allocator is None:
            pool = AddressPool(settings.address_pool or settings.overlay, settings.reuse_window,
                               exclude=[int(a) for a in settings.address_exclude], now=time.time())
            allocator = LocalAllocator(pool, None)
        self.allocator = allocator
        self.state = state
        self._saved_quota: dict[str, int] = {}
        self._saved_at = 0.0
        self._stopped = False
        self._restored = False
        self.ready = False  # every claim restored and armed; /readyz
        self.paths: dict[str, ClaimPath] = {}
        self.by_addr: dict[int, ClaimPath] = {}
        self.streams: dict[str, GuestStream] = {}
        self.servers: dict[str, asyncio.AbstractServer] = {}
        self.inbound = InboundPath(settings.vni, self.router_mac,
                                   {source_key(str(e.vtep)): e.label for e in self.exits.values()},
                                   max_frames=RX_BATCH, out_capacity=RX_BATCH * SLOT)
        self.counts: Counter[str] = Counter()
        self.vx: VxlanSocket | None = None
        self._garp_due: dict[str, float] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._vxlan_hdr = push_vxlan(settings.vni)
        self.audit = AuditLog(settings.audit_file)
        self._usage_at = time.monotonic()

    # ---------------------------------------------------------------- life cycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.vx = VxlanSocket(str(self.settings.listen), self.settings.port, slots=RX_BATCH)
        loop.add_reader(self.vx.fileno(), self._on_datagrams)
        for st in self.state.load() if self.state is not None else []:
            try:
                await self.allocator.reserve(st.id, int(st.address))
            except AllocationError as e:
                if e.reason == "allocator_unavailable":
                    raise  # fail closed, and keep the state file as it is: the claim is not given up
                # Someone else has the address now (the mesh gave it away): arming it would send as them.
                log.error("claim not restored", extra={"event": "claim_not_restored", "fields": {
                    "claim": st.id, "address": str(st.address), "reason": e.reason, "detail": e.detail}})
                continue
            await self.arm(st, enabled=st.enabled, quota_used=st.quota_used)
        self._restored = True  # from here on the claims armed are the state to save
        for req in self.requests:
            if req.id not in self.paths:  # one the state file restored keeps its state
                await self.arm_request(req, save=False)
        self.save()
        self._tick = loop.call_later(TICK_S, self._on_tick)
        self.ready = True

    # ---------------------------------------------------------------- control (control_api.py calls these)
    def _check_new(self, cid: str, exit: str, uds: Path) -> None:
        if cid in self.paths:
            raise ControlError("claim_exists", f"claim {cid} is armed here", 409)
        if exit not in self.exits:
            raise ControlError("bad_exit", f"no exit {exit!r} (configured: {', '.join(sorted(self.exits))})")
        if any(p.spec.uds == uds for p in self.paths.values()):
            raise ControlError("uds_in_use", f"{uds} is another claim's socket", 409)

    def path(self, cid: str) -> ClaimPath:
        p = self.paths.get(cid)
        if p is None:
            raise ControlError("no_such_claim", f"no claim {cid} armed here", 404)
        return p

    async def arm_request(self, req: ClaimRequest, *, save: bool = True) -> ClaimPath:
        """Arm a new claim: its address from the allocator (or the one it pins, reserved)."""
        self._check_new(req.id, req.exit, req.uds)
        if req.address is not None:
            await self.allocator.reserve(req.id, int(req.address))
            address = req.address
        else:
            address = ipaddress.IPv4Address(await self.allocator.allocate(req.id))
        try:
            path = await self.arm(req.armed(address))
        except BaseException:
            await self.allocator.release(req.id, int(address))
            raise
        if save:
            self.save()
        return path

    async def import_state(self, st: ClaimState) -> ClaimPath:
        """Arm a claim exported by another daemon with its address, switch and quota used (a move)."""
        self._check_new(st.id, st.exit, st.uds)
        why = check_address(st.address, self.settings.overlay)
        if why is not None:
            raise ControlError("bad_field", f"address: {why}")
        await self.allocator.reserve(st.id, int(st.address))
        try:
            path = await self.arm(st, enabled=st.enabled, quota_used=st.quota_used)
        except BaseException:
            await self.allocator.release(st.id, int(st.address))
            raise
        self.save()
        return path

    async def disarm(self, cid: str, *, hand_over: bool = False) -> ClaimState:
        """Disarm: the listener and the stream closed, the address released (or, for a move, handed over:
        the single node keeps it cooling for the claim, the mesh keeps it held for the importer)."""
        path = self.path(cid)
        st = self.claim_state(path)
        server = self.servers.pop(cid)
        server.close()
        stream = self.streams.get(cid)
        if stream is not None:
            stream.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()
        with contextlib.suppress(OSError):
            os.unlink(path.spec.stream_path)
        path.flows.clear("moved" if hand_over else "disarmed")
        self.record(path, time.monotonic())
        del self.paths[cid]
        del self.by_addr[path.address]
        self._garp_due.pop(cid, None)
        self._saved_quota.pop(cid, None)
        self.streams_changed()
        if hand_over:
            await self.allocator.hand_over(cid, path.address)
        else:
            await self.allocator.release(cid, path.address)
        self.save()
        log.info("claim disarmed", extra={"event": "claim_disarmed", "fields": {
            "claim": cid, "address": str(path.spec.address), "moved": hand_over}})
        return st

    async def export(self, cid: str) -> ClaimState:
        """The claim's state for ``import_state`` on another daemon; the claim is disarmed here."""
        return await self.disarm(cid, hand_over=True)

    def set_enabled(self, cid: str, on: bool) -> ClaimPath:
        path = self.path(cid)
        path.set_enabled(on, time.monotonic())
        self.save()
        log.info("claim switched", extra={"event": "claim_enabled" if on else "claim_disabled",
                                          "fields": {"claim": cid}})
        return path

    def set_exit(self, cid: str, label: str) -> ClaimPath:
        path = self.path(cid)
        exit = self.exits.get(label)
        if exit is None:
            raise ControlError("bad_exit", f"no exit {label!r} (configured: {', '.join(sorted(self.exits))})")
        if exit is not path.exit:
            path.set_exit(exit)
            self.streams_changed()
            self._announce(path)  # the new exit learns the claim at once
            self._garp_due[cid] = time.monotonic() + self.settings.garp_interval
            self.save()
        return path

    def claim_state(self, path: ClaimPath) -> ClaimState:
        return ClaimState(**path.spec.model_dump(), enabled=path.enabled, quota_used=path.limits.bytes_used)

    def save(self) -> None:
        if self.state is None or not self._restored:
            return  # a start that failed before its claims were restored must not write over their state
        self.state.save(self.claim_state(p) for p in self.paths.values())
        self._saved_quota = {cid: p.limits.bytes_used for cid, p in self.paths.items()}
        self._saved_at = time.monotonic()

    # ---------------------------------------------------------------- life cycle
    async def arm(self, spec: ClaimSpec, *, enabled: bool = True, quota_used: int = 0) -> ClaimPath:
        """Start a claim whose address is already its own (allocated or reserved by the caller)."""
        now = time.monotonic()
        s = self.settings
        spec = ClaimSpec(**spec.model_dump(exclude={"enabled", "quota_used"}))
        path = ClaimPath(spec, self.exits[spec.exit], vni=s.vni, router_mac=self.router_mac, guard=self.guard,
                         mtu=s.mtu, flow_cap=s.flow_cap, new_flow_rate=s.new_flow_rate,
                         flow_idle_timeout=s.flow_idle_timeout, now=now)
        path.limits.bytes_used = quota_used
        path.set_enabled(enabled, now)
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
            "claim": spec.id, "address": str(spec.address), "exit": spec.exit, "socket": str(sock_path),
            "enabled": enabled}})
        return path

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.ready = False
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
        now = time.monotonic()
        for path in self.paths.values():
            path.flows.clear("stopped")  # a clean stop ends the live flows, so each is recorded
            self.record(path, now)
        self.audit.close()
        self.save()  # the quota used since the last save
        await self.allocator.close()

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
        offs, lens, srcs = vx.recv_columns()
        if not offs:
            return
        deliver, replies = self.inbound.run(vx.rx, offs, lens, srcs)
        now = time.monotonic()
        for addr, frames in deliver.items():
            path = self.by_addr[addr]
            stream = self.streams.get(path.id)
            if not path.enabled:
                path.drops["disabled"] += len(frames)
            elif stream is None:
                path.drops["no_guest"] += len(frames)  # judged by no flow: nothing reopened for nobody
            elif stream.paused_since is not None:
                path.drops["guest_backlog"] += len(frames)
            elif kept := path.accept_inbound(frames, now):
                stream.deliver(kept)
        for reply, src in replies:
            vx.sendto(reply, source_host(src))
            self.counts["arp_replies"] += 1

    def announce(self, label: str | None = None) -> int:
        """A gratuitous ARP now for every armed claim (those sent through exit ``label``, or all): after an
        exit reloads (its neighbour table and learning FDB start empty), so it learns every claim at once
        rather than at each one's next announcement. Each claim's 45 s timer starts again. How many."""
        if label is not None and label not in self.exits:
            raise ControlError("bad_exit", f"no exit {label!r} (configured: {', '.join(sorted(self.exits))})")
        now = time.monotonic()
        n = 0
        for cid, path in self.paths.items():
            if label is None or path.exit.label == label:
                self._announce(path)
                self._garp_due[cid] = now + self.settings.garp_interval
                n += 1
        log.info("claims announced", extra={"event": "claims_announced", "fields": {
            "exit": label, "claims": n}})
        return n

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
        usage = now - self._usage_at >= self.settings.usage_interval
        if usage:
            self._usage_at = now
        for path in self.paths.values():
            path.flows.expire(now)
            self.record(path, now, usage=usage)
        if self.state is not None and now - self._saved_at >= QUOTA_SAVE_S and any(
                self._saved_quota.get(cid) != p.limits.bytes_used for cid, p in self.paths.items()):
            self.save()
        self._tick = asyncio.get_running_loop().call_later(TICK_S, self._on_tick)

    def record(self, path: ClaimPath, now: float, *, usage: bool = False) -> None:
        """Audit the claim's ended flows (each with its last usage event); with ``usage``, a usage event
        for each live flow that sent something since its last one."""
        ended = path.flows.take_ended()
        refused, suppressed = path.refused.take()
        if not ended and not usage and not refused and not suppressed:
            return
        offset = time.time() - now
        out = [refused_record(path.id, key, reason, n, first, last, offset) for key, reason, n, first, last in refused]
        if suppressed:
            out.append(suppressed_record(path.id, suppressed, now + offset))
        for flow, why in ended:
            u = usage_record(path.id, flow, now + offset)
            if u is not None:
                out.append(u)
            out.append(flow_record(path.id, flow, why, offset, now))
        if usage:
            out.extend(u for f in path.flows.live() if (u := usage_record(path.id, f, now + offset)) is not None)
        self.audit.write(out)
        self.counts["flows_ended"] += len(ended)

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
                    "bytes_out": p.sent.bytes, "frames_in": p.received.frames, "packets_in": p.received.packets,
                    "bytes_in": p.received.bytes, "flows": len(p.flows), "flows_resumed": p.resumed,
                    "drops": dict(p.drops),
                    "flow_refusals": dict(p.flows.refusals), "quota_used": p.limits.bytes_used,
                    "exit": p.exit.label, "enabled": p.enabled, "switched_at": p.switched_at,
                    "frames_since_switch": p.frames_since_switch,
                    "first_frame_after_switch": p.first_frame_after_switch,
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


async def _main(settings: EgressSettings, claims: list[ClaimRequest]) -> int:
    from forwarder.egress.router.control_api import ControlServer

    state = StateFile(settings.state_dir) if settings.state_dir is not None else None
    try:
        allocator = make_allocator(settings)
    except OSError as e:
        print(f"egress: cannot start: release log: {e}", file=sys.stderr)
        return 1
    try:
        router = Router(settings, claims, allocator=allocator, state=state)
    except OSError as e:
        print(f"egress: cannot start: audit_file: {e}", file=sys.stderr)
        return 1
    control = ControlServer(router, settings.control_socket) if settings.control_socket is not None else None
    ops = _ops(router) if settings.metrics_port else None
    try:
        if ops is not None:
            # first, as the other daemons do: /healthz answers while the claims are restored, /readyz after
            try:
                port = await ops.start(str(settings.metrics_host), settings.metrics_port)
            except OSError as e:
                raise OSError(f"cannot serve /metrics on {settings.metrics_host}:{settings.metrics_port}: "
                              f"{e.strerror} (choose another metrics_port, or 0 to disable)") from None
            log.info("ops endpoints up", extra={"event": "ops_listening", "fields": {
                "address": f"{settings.metrics_host}:{port}"}})
        await router.start()
        if control is not None:
            await control.start()
    except (OSError, AllocationError) as e:
        print(f"egress: cannot start: {e}", file=sys.stderr)
        if control is not None:
            await control.stop()
        await router.stop()
        if ops is not None:
            await ops.close()
        return 1
    stop = asyncio.Event()

    def on_hup() -> None:
        # The shell's reload: the router reads no certificate or token file (its settings and claims are
        # read at start; claims change through the control API), so the one outcome line says nothing
        # was reloaded. And SIGHUP keeps its own meaning: the exits reloaded, so every claim is announced.
        reload(log, [])
        router.announce()

    wire_signals(stop, on_hup)
    log.info("egress router up", extra={"event": "egress_listening", "fields": {
        "address": f"{settings.listen}:{settings.port}", "claims": len(claims)}})
    await stop.wait()
    if control is not None:
        await control.stop()
    await router.stop()
    if ops is not None:
        await ops.close()
    log.info("egress router stopped", extra={"event": "egress_stopped", "fields": router.stats()})
    return 0


def _ops(router: Router) -> OpsServer:
    from prometheus_client import generate_latest

    from forwarder.egress.router.metrics import registry_for
    from sbxnet.ops_http import OpsServer

    registry = registry_for(router)
    return OpsServer(lambda: generate_latest(registry), lambda: router.ready)


def serve(settings: EgressSettings, claims: list[ClaimRequest], *, check_only: bool = False) -> int:
    from sbxnet import jsonlog

    jsonlog.setup(settings.log_level)
    if check_only:
        print(f"egress: settings valid, {len(claims)} claims")
        return 0
    import uvloop  # the forwarder's loop too: its transports read and write in C, not in asyncio's Python

    return uvloop.run(_main(settings, claims))
