"""One armed claim's packet path, no sockets: guest frames judged, then segmented by the C core; the
exits' delivery frames checked against the claim's flows.

The guest's stream bytes sit in the stream adapter's own receive buffer; ``ClaimPath.take`` finds the
whole frames there (the C splitter, ``OutboundBatch.split``: the same frames as ``FrameDecoder``, as
offsets into that buffer, with no copy), judges each one in the order docs/egress.md gives (decode →
``validate_outbound`` → ``flow_key`` → ``FlowTable.admit`` → ``ClaimLimits``) and loads only the frames
that passed into the core's batch. The core never sees a frame the validator has not accepted (it
accepts a superset: fragments, bytes past the total length, an unchecked UDP length). Every refusal is
counted under its reason token in ``drops``; the C's own refusals (none are expected) under
``core_types.REASONS``. A claim's flows, limits and counters outlive the guest's connection.

Inbound (``accept_inbound``): a delivery frame reaches the guest only as part of one of the claim's
flows (``reply.pull_reply`` gives the outbound key it answers). A TCP segment of an unknown flow with
neither SYN nor RST reopens it, judged as a first packet (``FlowTable.admit``: flow cap, new-flow rate,
guard, policy), so a download that straddles a re-arm (a restart, a move) goes on; anything else of an
unknown flow is dropped (``no_flow``), a refused reopen as ``resume_<reason>``, and neither leaves a flow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from forwarder.egress.core_types import OK, PREFIX_LEN, REASONS, OutParams, vxlan_eth_prefix
from forwarder.egress.errors import FlowRefused, InboundRefused
from forwarder.egress.fastpath import OutboundBatch
from forwarder.egress.flows import TCP_FIN, TCP_RST, FlowTable, flow_key
from forwarder.egress.guard import AddressGuard
from forwarder.egress.limits import WIRE_OVERHEAD, ClaimLimits
from forwarder.egress.refusals import RefusalLog
from forwarder.egress.reply import IP_OFF, pull_reply, wire_size
from forwarder.egress.router.claims import ClaimSpec
from forwarder.egress.router.settings import ExitSpec
from forwarder.egress.validate import PROTO_TCP, validate_outbound
from forwarder.egress.vnet import HOST_OFFLOADS, VNET_HDR_LEN
from sbxnet.errors import RemoteProtocolError

FIN_OR_RST = TCP_FIN | TCP_RST

Buf = bytes | bytearray | memoryview

MAX_FRAMES = 64  # frames per core call
OUT_CAPACITY = 1 << 20  # the send buffer: ~15 full 64 KiB GSO frames of 1500-byte packets


@dataclass(slots=True)
class Sent:
    frames: int = 0  # guest frames accepted
    packets: int = 0  # wire packets
    bytes: int = 0  # inner IPv4 bytes on the wire (prefixes excluded)


@dataclass(slots=True)
class Received:
    frames: int = 0  # delivery frames written toward the guest
    packets: int = 0  # the wire packets they were (a merged TCP frame is several)
    bytes: int = 0  # their IPv4 bytes on the wire


class ClaimPath:
    """``take(buf, now)`` judges and segments the whole frames at the start of ``buf``; the caller then
    sends ``sends()`` from ``out`` and calls ``take`` again on what is left (``take`` returns the bytes
    consumed and whether the framing was lost, which closes the stream)."""

    def __init__(
        self, spec: ClaimSpec, exit: ExitSpec, *, vni: int, router_mac: bytes, guard: AddressGuard, mtu: int,
        flow_cap: int, new_flow_rate: float, flow_idle_timeout: float, now: float,
    ) -> None:
        self.spec = spec
        self.id = spec.id
        self.address = int(spec.address)
        self.exit = exit
        self.flows = FlowTable(spec.policy.policy(), guard, cap=flow_cap, new_flow_rate=new_flow_rate,
                               idle_timeout=flow_idle_timeout, now=now)
        self.refused = RefusalLog()  # outbound first packets refused since the last audit round
        self.limits = ClaimLimits(**spec.limits.model_dump(), now=now)
        self._vni, self._router_mac = vni, router_mac
        self.batch = self._batch(exit, mtu)
        self.enabled = True
        self.switched_at = now  # monotonic time of the last disable or enable (or the arm)
        self.frames_since_switch = 0  # guest frames accepted since then
        self.first_frame_after_switch: float | None = None
        self.host_mtu = mtu
        self.mtu = mtu  # the guest stream's, once negotiated
        self.offloads = HOST_OFFLOADS
        self.drops: Counter[str] = Counter()
        self.sent = Sent()
        self.received = Received()
        self.resumed = 0  # flows reopened by an inbound segment
        self._pending = 0  # frames loaded in the batch that the core has not consumed yet
        self._consumed = 0

    def _batch(self, exit: ExitSpec, mtu: int) -> OutboundBatch:
        return OutboundBatch(OutParams(self.address, vxlan_eth_prefix(self._vni, exit.mac, self._router_mac), mtu=mtu),
                             max_frames=MAX_FRAMES, out_capacity=OUT_CAPACITY)

    def set_enabled(self, on: bool, now: float) -> None:
        """Disable: from the next frame on nothing of this claim is judged or sent, and its flows are
        forgotten (an enable judges every flow again). Enable: the next frame is judged as usual."""
        if on == self.enabled:
            return
        self.enabled = on
        self.switched_at = now
        self.frames_since_switch = 0
        self.first_frame_after_switch = None
        if not on:
            self.flows.clear("disabled")

    def set_exit(self, exit: ExitSpec) -> None:
        """Send to another exit from the next frame on (called between batches: nothing is pending)."""
        self.exit = exit
        self.spec = self.spec.model_copy(update={"exit": exit.label})
        self.batch = self._batch(exit, self.host_mtu)

    def set_stream(self, mtu: int, offloads: int) -> None:
        self.mtu = min(mtu, self.host_mtu)
        self.offloads = offloads

    def take(self, buf: Buf, now: float) -> tuple[int, bool]:
        """Judge the whole frames at the start of ``buf`` and segment the accepted ones into ``out``.

        Returns (bytes of ``buf`` consumed, framing lost). Once it returns, ``sends()`` lists what is
        ready; if ``more()`` the send buffer filled up: send, then call ``resume(buf)``."""
        batch = self.batch
        n, consumed, bad = batch.split(buf)
        if not self.enabled:
            self.drops["disabled"] += n
            self._pending = self._consumed = 0
            batch.n_sends = 0
            return consumed, bad
        offs, lens = batch.offs, batch.lens
        mv = memoryview(buf)
        k = 0
        for i in range(n):
            off, ln = offs[i], lens[i]
            frame = mv[off : off + ln]
            try:
                f = validate_outbound(frame, self.mtu, self.offloads)
                key = flow_key(frame, VNET_HDR_LEN, self.address)
                flow = self.flows.open(key, now)
                nbytes, packets = self.limits.charge_frame(f, now)
            except FlowRefused as exc:  # the flow's first packet: audited as refused
                self.drops[exc.reason] += 1
                self.refused.note(key, exc.reason, now)
                continue
            except RemoteProtocolError as exc:
                self.drops[exc.reason] += 1
                continue
            flow.bytes_out += nbytes - packets * WIRE_OVERHEAD  # the inner IPv4 bytes, as ``sent`` counts
            flow.packets_out += packets
            if f.proto == PROTO_TCP and (flags := frame[VNET_HDR_LEN + f.l4_offset + 13]) & FIN_OR_RST:
                self.flows.tcp_flags(flow, flags, False, now)
            offs[k], lens[k] = off, ln
            k += 1
        self._pending = k
        self._consumed = 0
        if k:
            if self.first_frame_after_switch is None:
                self.first_frame_after_switch = now
            self.frames_since_switch += k
        self._run(buf)
        return consumed, bad

    def accept_inbound(self, frames: list[memoryview], now: float) -> list[memoryview]:
        """The delivery frames (in order) that belong to the claim's flows; the rest dropped and counted."""
        flows, drops, rcv = self.flows, self.drops, self.received
        kept: list[memoryview] = []
        for frame in frames:
            try:
                key, resumable = pull_reply(frame)
            except InboundRefused as exc:
                drops[exc.reason] += 1
                continue
            flow = flows.touch(key, now)
            if flow is None:
                if not resumable:
                    drops["no_flow"] += 1
                    continue
                try:
                    flow = flows.open(key, now, resumed=True)
                except FlowRefused as exc:
                    drops["resume_" + exc.reason] += 1
                    continue
                self.resumed += 1
            nbytes, packets = wire_size(frame)
            flow.bytes_in += nbytes
            flow.packets_in += packets
            if frame[IP_OFF + 9] == PROTO_TCP and (
                    flags := frame[IP_OFF + (frame[IP_OFF] & 15) * 4 + 13]) & FIN_OR_RST:
                flows.tcp_flags(flow, flags, True, now)
            rcv.frames += 1
            rcv.packets += packets
            rcv.bytes += nbytes
            kept.append(frame)
        return kept

    def more(self) -> bool:
        return self._pending > 0

    def resume(self, buf: Buf) -> None:
        """After the sends of a full batch: segment the frames that did not fit."""
        self._run(buf)

    def _run(self, buf: Buf) -> None:
        batch = self.batch
        k = self._pending
        if self._consumed:
            offs, lens, c = batch.offs, batch.lens, self._consumed
            for j in range(k):
                offs[j], lens[j] = offs[j + c], lens[j + c]
        if k == 0:
            batch.n_sends = 0
            return
        done = batch.run(buf, k)
        if done == 0:  # cannot happen with OUT_CAPACITY over one maximal frame; never loop on it
            self.drops["no_space"] += k
            self._pending = self._consumed = 0
            batch.n_sends = 0
            return
        sent = self.sent
        for i in range(done):
            r = batch.results[i]
            if r.status == OK:
                sent.frames += 1
                sent.packets += r.packets
                sent.bytes += r.len - r.packets * PREFIX_LEN
            else:
                self.drops[REASONS.get(r.status, "core")] += 1
        self._pending = k - done
        self._consumed = done

    def sends(self) -> Iterator[tuple[int, int, int, int]]:
        """(offset, length, segment size, records) of each send ready in ``batch.out``."""
        for s in self.batch.sends[0 : self.batch.n_sends]:
            yield s.off, s.len, s.seg, s.count
