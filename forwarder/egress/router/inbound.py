"""Datagrams from the exits, no sockets: VTEP check, the C inbound path, ARP, delivery per claim.

The VXLAN socket adapter receives datagrams into slots of one buffer it owns and hands their
offsets, lengths and sources here as three lists. Only a configured exit VTEP is accepted (``unknown_vtep``, before any
byte is parsed); the rest go through ``InboundBatch`` in one call, which decapsulates, checks the
framing, and merges TCP segments for guests that offered CSUM+TSO4. A delivery frame is kept only for
an armed claim whose exit sent it (``unknown_claim``, ``wrong_exit``); ARP frames are answered here
for armed claims only (``arp.arp_reply``). Refusals are counted in ``drops`` under the tokens
``vxlan.py`` uses (``core_types.REASONS``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from forwarder.egress.arp import arp_reply, pull_arp
from forwarder.egress.core_types import ARP, MERGED, OK, PREFIX_LEN, REASONS
from forwarder.egress.errors import InboundRefused
from forwarder.egress.fastpath import InboundBatch
from forwarder.egress.vxlan import push_vxlan

Buf = bytes | bytearray | memoryview


class InboundPath:
    """``run(buf, offs, lens, srcs)`` → per claim address, the delivery frames (views of ``out``) in order,
    and the ARP replies to send (datagram payload, VTEP). The views stay valid until the next run."""

    def __init__(
        self, vni: int, router_mac: bytes, vteps: Mapping[int, str], *, max_frames: int = 64,
        out_capacity: int = 1 << 20,
    ) -> None:
        # vteps: VTEP address (as an integer key, in the form the socket reports a source) -> exit label
        self.vni = vni
        self.router_mac = router_mac
        self.vteps = dict(vteps)
        self.batch = InboundBatch(vni, max_frames=max_frames, out_capacity=out_capacity)
        self.max_frames = max_frames
        self.claims: dict[int, str] = {}  # armed claim address -> its exit label
        self.drops: Counter[str] = Counter()
        self.arp_answered = 0
        self._vxlan = push_vxlan(vni)

    def set_claims(self, claims: Mapping[int, str], gro: Iterable[int]) -> None:
        """The armed claims (address -> exit label) and the addresses whose guests take merged TCP."""
        self.claims = dict(claims)
        self.batch.set_gro(gro)

    def run(
        self, buf: Buf, offs: list[int], lens: list[int], srcs: list[int]
    ) -> tuple[dict[int, list[memoryview]], list[tuple[bytes, int]]]:
        """One batch of datagrams, given as columns: offsets in ``buf``, lengths and sources (in the form
        the ``vteps`` keys take). A batch whose sources are all exits (every datagram of a download) is
        loaded and read back without a Python step per datagram; only a frame made, an ARP or a refusal
        costs one."""
        batch = self.batch
        vteps = self.vteps
        if not offs:
            return {}, []
        if not set(srcs) <= vteps.keys():
            keep = [i for i, src in enumerate(srcs) if src in vteps]
            self.drops["unknown_vtep"] += len(srcs) - len(keep)
            offs, lens, srcs = [offs[i] for i in keep], [lens[i] for i in keep], [srcs[i] for i in keep]
        deliver: dict[int, list[memoryview]] = {}
        replies: list[tuple[bytes, int]] = []
        n = batch.load(offs, lens)
        if n == 0:
            return deliver, replies
        k = batch.run(buf, n)
        out = memoryview(batch.out)
        claims = self.claims
        for i, st in enumerate(batch.statuses(k)):
            if st == MERGED:
                continue
            if st == OK:
                r = batch.results[i]
                label = claims.get(r.dst)
                if label is None:
                    self.drops["unknown_claim"] += 1
                elif label != vteps[srcs[i]]:
                    self.drops["wrong_exit"] += 1
                else:
                    deliver.setdefault(r.dst, []).append(out[r.off : r.off + r.len])
            elif st == ARP:
                reply = self._arp(memoryview(buf)[offs[i] + PREFIX_LEN : offs[i] + lens[i]], srcs[i])
                if reply is not None:
                    replies.append((reply, srcs[i]))
            else:
                self.drops[REASONS.get(st, "core")] += 1
        if k < n:
            self.drops["no_space"] += n - k  # the delivery buffer filled up: rare, and TCP retransmits
        return deliver, replies

    def _arp(self, payload: memoryview, src: int) -> bytes | None:
        try:
            req = pull_arp(payload)
        except InboundRefused as exc:
            self.drops[exc.reason] += 1
            return None
        label = self.vteps[src]
        # answered only for claims armed here and only to the claim's own exit
        mine = {a for a, lb in self.claims.items() if lb == label}
        frame = arp_reply(req, mine, self.router_mac)
        if frame is None:
            return None
        self.arp_answered += 1
        return self._vxlan + frame
