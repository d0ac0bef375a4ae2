"""Flow keys, the per-claim flow table and the first-packet hook (policy + internal-address guard).

A flow's first packet is judged; later packets of an admitted flow only refresh its idle timer. Order
of the checks on a first packet, cheapest and least guest-steerable first: ``flow_cap`` (after
evicting idle flows), ``flow_rate`` (a token is spent on every judged first packet, admitted or not,
so a guest hammering a denied destination pays for it), ``internal_address`` (``guard.AddressGuard``
on the destination), ``policy_denied`` (the policy callback). Refused first packets are not
remembered: the next packet of that flow is judged again. Time is passed in (seconds, monotonic).

A TCP flow also ends by itself: once a RST has passed either way, or a FIN each way, it ends
``CLOSE_LINGER`` seconds later (``closed`` or ``reset``), so a retransmitted FIN or the last ACK still
belongs to it; otherwise flows end idle.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import NamedTuple

from forwarder.egress.errors import FlowRefused, FrameRefused
from forwarder.egress.guard import AddressGuard
from forwarder.egress.limits import TokenBucket
from forwarder.egress.validate import PROTO_ICMP, PROTO_TCP, PROTO_UDP

DEFAULT_FLOW_CAP = 16384
DEFAULT_NEW_FLOW_RATE = 1000.0
DEFAULT_IDLE_TIMEOUT = 120.0
CLOSE_LINGER = 2.0  # seconds a closed or reset TCP flow is kept for its last packets

TCP_FIN, TCP_RST = 0x01, 0x04
_FIN_OUT, _FIN_IN, _RST_SEEN = 1, 2, 4

# ICMP query messages carry an identifier at bytes 4-5 that tells flows apart (echo, timestamp,
# information, address mask; request and reply).
ICMP_QUERY_TYPES = frozenset({0, 8, 13, 14, 15, 16, 17, 18})

_ADDRS = struct.Struct("!4xII")  # at IPv4 offset 8: skip ttl/proto/csum; src, dst
_PORTS = struct.Struct("!HH")


class FlowKey(NamedTuple):
    """The 5-tuple. Addresses are host-order ints; ICMP query messages carry their identifier as
    ``sport`` (``dport`` 0); other ICMP messages have both ports 0."""

    proto: int
    src: int
    sport: int
    dst: int
    dport: int

    def __str__(self) -> str:
        return f"{self.proto} {IPv4Address(self.src)}:{self.sport} -> {IPv4Address(self.dst)}:{self.dport}"


def flow_key(buf: bytes | bytearray | memoryview, offset: int = 0, src: int | None = None) -> FlowKey:
    """The flow key of the IPv4 packet at ``buf[offset:]`` (IHL 5, as validation guarantees).

    ``src`` replaces the packet's source: the router passes the claim's address, since the guest's
    own source is rewritten and must not split or merge flows. Raises ``FrameRefused`` (bad_ip_header,
    bad_l4_header, unsupported_proto) if the packet is too short for its key.
    """
    if len(buf) - offset < 20:
        raise FrameRefused("bad_ip_header", "too short for a flow key")
    proto = buf[offset + 9]
    psrc, dst = _ADDRS.unpack_from(buf, offset + 8)
    if src is None:
        src = psrc
    l4 = offset + 20
    if proto in (PROTO_TCP, PROTO_UDP):
        if len(buf) - l4 < 4:
            raise FrameRefused("bad_l4_header", "too short for ports")
        sport, dport = _PORTS.unpack_from(buf, l4)
        return FlowKey(proto, src, sport, dst, dport)
    if proto == PROTO_ICMP:
        if len(buf) - l4 < 8:
            raise FrameRefused("bad_l4_header", "too short for ICMP")
        if buf[l4] in ICMP_QUERY_TYPES:
            ident = _PORTS.unpack_from(buf, l4 + 4)[0]
            return FlowKey(proto, src, ident, dst, 0)
        return FlowKey(proto, src, 0, dst, 0)
    raise FrameRefused("unsupported_proto", f"protocol {proto}")


@dataclass(frozen=True, slots=True)
class Rule:
    """One policy rule. Empty ``nets``/``protos``/``ports`` match anything. ``ports`` are inclusive
    destination-port ranges; a rule with ports never matches ICMP."""

    allow: bool
    nets: tuple[IPv4Network, ...] = ()
    protos: frozenset[int] = frozenset()
    ports: tuple[tuple[int, int], ...] = ()
    _spans: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for lo, hi in self.ports:
            if not 0 <= lo <= hi <= 65535:
                raise ValueError(f"port range {lo}-{hi}")
        spans = tuple((int(n.network_address), int(n.broadcast_address)) for n in self.nets)
        object.__setattr__(self, "_spans", spans)

    def matches(self, key: FlowKey) -> bool:
        if self.protos and key.proto not in self.protos:
            return False
        if self.ports:
            if key.proto == PROTO_ICMP:
                return False
            if not any(lo <= key.dport <= hi for lo, hi in self.ports):
                return False
        return not self._spans or any(lo <= key.dst <= hi for lo, hi in self._spans)

    @classmethod
    def parse(cls, text: str) -> Rule:
        """``"allow|deny [tcp|udp|icmp|any] [NET[,NET...]|any] [PORT|LO-HI[,...]]"``, e.g.
        ``"deny tcp any 25"``, ``"allow udp 8.8.8.8/32,1.1.1.1/32 53"``."""
        words = text.split()
        if not words or words[0] not in ("allow", "deny") or len(words) > 4:
            raise ValueError(f"rule {text!r}: want 'allow|deny [proto] [nets] [ports]'")
        protos: frozenset[int] = frozenset()
        nets: tuple[IPv4Network, ...] = ()
        ports: list[tuple[int, int]] = []
        if len(words) > 1 and words[1] != "any":
            names = {"tcp": PROTO_TCP, "udp": PROTO_UDP, "icmp": PROTO_ICMP}
            try:
                protos = frozenset(names[p] for p in words[1].split(","))
            except KeyError:
                raise ValueError(f"rule {text!r}: protocol must be tcp, udp, icmp or any") from None
        if len(words) > 2 and words[2] != "any":
            nets = tuple(IPv4Network(n) for n in words[2].split(","))
        if len(words) > 3:
            for p in words[3].split(","):
                lo, _, hi = p.partition("-")
                ports.append((int(lo), int(hi or lo)))
        return cls(words[0] == "allow", nets, protos, tuple(ports))


class Policy:
    """First matching rule decides; ``default_allow`` if none matches. Callable as a flow judge."""

    __slots__ = ("default_allow", "rules")

    def __init__(self, rules: Iterable[Rule | str] = (), default_allow: bool = True) -> None:
        self.rules = tuple(r if isinstance(r, Rule) else Rule.parse(r) for r in rules)
        self.default_allow = default_allow

    def __call__(self, key: FlowKey) -> bool:
        for rule in self.rules:
            if rule.matches(key):
                return rule.allow
        return self.default_allow


class Flow:
    """One open flow: its key, when it opened and last saw a packet (monotonic), what it carried each way
    (inner IPv4 bytes and wire packets), whether an inbound segment reopened it, and how many of its
    bytes out a usage event has reported."""

    __slots__ = ("bytes_in", "bytes_out", "closed_at", "closing", "key", "last", "packets_in", "packets_out",
                 "reported_bytes", "reported_packets", "resumed", "start")

    def __init__(self, key: FlowKey, now: float, resumed: bool = False) -> None:
        self.key = key
        self.start = self.last = now
        self.bytes_out = self.packets_out = self.bytes_in = self.packets_in = 0
        self.reported_bytes = self.reported_packets = 0
        self.resumed = resumed
        self.closing = 0  # FIN out, FIN in, RST seen (bits)
        self.closed_at: float | None = None  # when a RST or the second FIN passed


class FlowTable:
    """One claim's flows: LRU by last packet, capped, with a token bucket on new flows.

    ``admit(key, now)`` returns True for an admitted first packet, False for a packet of a known flow,
    and raises ``FlowRefused`` (reasons in the module docstring) otherwise. ``refusals`` counts them.
    ``open`` is the same but gives the ``Flow``. A flow that ends (``expire``: idle; ``clear(why)``;
    ``remove``) is appended to ``ended`` with why, for the caller to record and empty.
    """

    __slots__ = ("_closing", "_flows", "_rate", "cap", "ended", "guard", "idle_timeout", "judge", "opened",
                 "refusals")

    def __init__(
        self,
        judge: Callable[[FlowKey], bool] | None = None,
        guard: AddressGuard | None = None,
        *,
        cap: int = DEFAULT_FLOW_CAP,
        new_flow_rate: float = DEFAULT_NEW_FLOW_RATE,
        new_flow_burst: float | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        now: float = 0.0,
    ) -> None:
        if cap < 1 or idle_timeout <= 0:
            raise ValueError(f"cap {cap} and idle_timeout {idle_timeout} must be positive")
        self.judge = judge
        self.guard = guard
        self.cap = cap
        self.idle_timeout = idle_timeout
        self._rate = TokenBucket(new_flow_rate, new_flow_burst or new_flow_rate, now)
        self._flows: OrderedDict[FlowKey, Flow] = OrderedDict()
        self._closing: dict[FlowKey, Flow] = {}  # TCP flows past their RST or second FIN
        self.ended: list[tuple[Flow, str]] = []
        self.refusals: Counter[str] = Counter()
        self.opened = 0  # first packets admitted

    def __len__(self) -> int:
        return len(self._flows)

    def __contains__(self, key: object) -> bool:
        return key in self._flows

    def touch(self, key: FlowKey, now: float) -> Flow | None:
        """The flow of ``key`` if it is known (its idle timer refreshed); otherwise None and nothing is
        judged or remembered (the inbound path: only the claim's own side opens flows)."""
        flows = self._flows
        f = flows.get(key)
        if f is not None:
            flows.move_to_end(key)
            f.last = now
        return f

    def tcp_flags(self, f: Flow, flags: int, inbound: bool, now: float) -> None:
        """A TCP segment of ``f`` passed with ``flags``: a RST, or the second direction's FIN, starts its
        ``CLOSE_LINGER``. Callers may skip segments without FIN or RST."""
        if flags & TCP_RST:
            f.closing |= _RST_SEEN
        elif flags & TCP_FIN:
            f.closing |= _FIN_IN if inbound else _FIN_OUT
        else:
            return
        if f.closed_at is None and (f.closing & _RST_SEEN or f.closing == _FIN_OUT | _FIN_IN):
            f.closed_at = now
            self._closing[f.key] = f

    def admit(self, key: FlowKey, now: float) -> bool:
        n = self.opened
        self.open(key, now)
        return self.opened != n

    def open(self, key: FlowKey, now: float, *, resumed: bool = False) -> Flow:
        """The flow of ``key``, judged and opened if it is new (``FlowRefused`` if refused)."""
        flows = self._flows
        f = flows.get(key)
        if f is not None:
            flows.move_to_end(key)
            f.last = now
            return f
        try:
            self._judge_first(key, now)
        except FlowRefused as exc:
            self.refusals[exc.reason] += 1
            raise
        f = flows[key] = Flow(key, now, resumed)
        self.opened += 1
        return f

    def _judge_first(self, key: FlowKey, now: float) -> None:
        if len(self._flows) >= self.cap:
            self.expire(now, limit=1)
        if len(self._flows) >= self.cap:
            raise FlowRefused("flow_cap", f"{self.cap} flows")
        if not self._rate.take(1, now):
            raise FlowRefused("flow_rate")
        if self.guard is not None:
            self.guard.check(key.dst)
        if self.judge is not None and not self.judge(key):
            raise FlowRefused("policy_denied", str(key))

    def expire(self, now: float, limit: int | None = None) -> int:
        """Forget flows idle for ``idle_timeout`` or longer (at most ``limit`` of them) and, without a
        limit, TCP flows closed or reset ``CLOSE_LINGER`` ago; returns how many."""
        flows, closing = self._flows, self._closing
        deadline = now - self.idle_timeout
        n = 0
        while flows and (limit is None or n < limit):
            key, f = next(iter(flows.items()))
            if f.last > deadline:
                break
            del flows[key]
            closing.pop(key, None)
            self.ended.append((f, "idle"))
            n += 1
        if limit is None and closing:
            for key, f in list(closing.items()):
                assert f.closed_at is not None
                if now - f.closed_at >= CLOSE_LINGER:
                    del closing[key]
                    del flows[key]
                    self.ended.append((f, "reset" if f.closing & _RST_SEEN else "closed"))
                    n += 1
        return n

    def remove(self, key: FlowKey, why: str = "removed") -> bool:
        f = self._flows.pop(key, None)
        if f is None:
            return False
        self._closing.pop(key, None)
        self.ended.append((f, why))
        return True

    def clear(self, why: str = "cleared") -> None:
        self.ended.extend((f, why) for f in self._flows.values())
        self._flows.clear()
        self._closing.clear()

    def live(self) -> list[Flow]:
        return list(self._flows.values())

    def take_ended(self) -> list[tuple[Flow, str]]:
        ended, self.ended = self.ended, []
        return ended
