"""Flow keys, the flow table's first-packet hook, the internal-address guard and per-claim limits."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import dpkt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress.errors import FlowRefused, FrameRefused, LimitRefused
from forwarder.egress.flows import CLOSE_LINGER, TCP_FIN, TCP_RST, FlowKey, FlowTable, Policy, Rule, flow_key
from forwarder.egress.guard import INTERNAL_RANGES, AddressGuard
from forwarder.egress.limits import MAX_FRAME_COST, WIRE_OVERHEAD, ClaimLimits, TokenBucket, wire_cost
from forwarder.egress.validate import OutboundFrame, validate_outbound
from forwarder.egress.vnet import GSO_TCPV4, VnetHdr, push_vnet_hdr


def ip(a: str) -> int:
    return int(IPv4Address(a))


PUBLIC = ip("93.184.216.34")


def key(dst: int = PUBLIC, dport: int = 443, proto: int = 6, sport: int = 40000) -> FlowKey:
    return FlowKey(proto, ip("100.64.1.2"), sport, dst, dport)


# ---------------------------------------------------------------- flow keys


def _pkt(l4: dpkt.Packet, p: int) -> bytes:
    return bytes(dpkt.ip.IP(src=bytes([10, 0, 0, 2]), dst=bytes([1, 2, 3, 4]), p=p, data=l4))


def test_flow_key_tcp_udp_icmp() -> None:
    t = _pkt(dpkt.tcp.TCP(sport=1234, dport=443), 6)
    assert flow_key(t) == FlowKey(6, ip("10.0.0.2"), 1234, ip("1.2.3.4"), 443)
    assert flow_key(bytes(10) + t, offset=10) == flow_key(t)
    assert flow_key(t, src=ip("100.64.0.9")).src == ip("100.64.0.9")
    u = _pkt(dpkt.udp.UDP(sport=5353, dport=53, ulen=8), 17)
    assert flow_key(u) == FlowKey(17, ip("10.0.0.2"), 5353, ip("1.2.3.4"), 53)
    echo = dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=0xBEEF, seq=3))
    assert flow_key(_pkt(echo, 1)) == FlowKey(1, ip("10.0.0.2"), 0xBEEF, ip("1.2.3.4"), 0)
    unreach = dpkt.icmp.ICMP(type=3, code=3, data=dpkt.icmp.ICMP.Unreach(data=b"\x45" + bytes(27)))
    assert flow_key(_pkt(unreach, 1)) == FlowKey(1, ip("10.0.0.2"), 0, ip("1.2.3.4"), 0)
    assert str(flow_key(t)) == "6 10.0.0.2:1234 -> 1.2.3.4:443"


@pytest.mark.parametrize(
    ("buf", "reason"),
    [(bytes(19), "bad_ip_header"), (bytes.fromhex("45000016 00000000 4006 0000 0a000002 01020304 0001"),
                                     "bad_l4_header"),
     (bytes.fromhex("4500001b 00000000 4001 0000 0a000002 01020304 08000000 0000 00"), "bad_l4_header"),
     (bytes.fromhex("45000014 00000000 402f 0000 0a000002 01020304"), "unsupported_proto")],
)
def test_flow_key_refused(buf: bytes, reason: str) -> None:
    with pytest.raises(FrameRefused) as exc:
        flow_key(buf)
    assert exc.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.integers(0, 12))
def test_flow_key_any_bytes(buf: bytes, offset: int) -> None:
    try:
        flow_key(buf, offset)
    except FrameRefused:
        pass


# ---------------------------------------------------------------- guard


@pytest.mark.parametrize(
    "addr",
    ["0.0.0.0", "0.255.255.255", "10.0.0.1", "10.255.255.255", "100.64.0.0", "100.64.0.3", "100.127.255.255",
     "127.0.0.1", "169.254.169.254", "172.16.0.1", "172.31.255.255", "192.0.0.8", "192.0.2.1",
     "192.168.1.1", "198.18.0.1", "198.19.255.255", "198.51.100.7", "203.0.113.9", "224.0.0.1",
     "239.255.255.250", "240.0.0.1", "255.255.255.255", "192.88.99.1"],
)
def test_guard_refuses_internal(addr: str) -> None:
    g = AddressGuard()
    assert g.is_internal(addr)
    assert g.is_internal(ip(addr))
    with pytest.raises(FlowRefused) as exc:
        g.check(addr)
    assert exc.value.reason == "internal_address"


@pytest.mark.parametrize(
    "addr", ["1.1.1.1", "8.8.8.8", "9.255.255.255", "11.0.0.0", "100.63.255.255", "100.128.0.0",
             "126.255.255.255", "128.0.0.0", "169.253.255.255", "172.15.255.255", "172.32.0.0",
             "192.167.255.255", "192.169.0.0", "223.255.255.255", "93.184.216.34"],
)
def test_guard_allows_public(addr: str) -> None:
    AddressGuard().check(addr)


def test_guard_overlay_and_extra() -> None:
    g = AddressGuard(overlay="44.0.0.0/16", extra=["81.2.0.0/24"])
    assert g.is_internal("44.0.200.1") and g.is_internal("81.2.0.255")
    assert not g.is_internal("44.1.0.0") and not g.is_internal("81.2.1.0")


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_guard_agrees_with_ipaddress(a: int) -> None:
    overlay = IPv4Network("44.0.0.0/16")
    nets = [IPv4Network(n) for n, _ in INTERNAL_RANGES] + [overlay]
    assert AddressGuard(overlay).is_internal(a) == any(IPv4Address(a) in n for n in nets)


# ---------------------------------------------------------------- policy


def test_policy_rules() -> None:
    pol = Policy(["deny tcp any 25,465-587", "allow udp 8.8.8.8/32,1.1.1.1/32 53", "deny udp any 53",
                  "deny icmp 203.0.0.0/8"])
    assert not pol(key(dport=25)) and not pol(key(dport=500)) and pol(key(dport=588))
    assert pol(key(dst=ip("8.8.8.8"), dport=53, proto=17))
    assert not pol(key(dst=ip("9.9.9.9"), dport=53, proto=17))
    assert not pol(key(dst=ip("203.1.1.1"), dport=0, proto=1))
    assert pol(key(dst=ip("204.1.1.1"), dport=0, proto=1))
    assert not Policy(["allow tcp any 443"], default_allow=False)(key(dport=80))
    assert Policy(["allow tcp any 443"], default_allow=False)(key(dport=443))
    # a port rule never matches ICMP, even with dport 0
    assert Policy([Rule(False, ports=((0, 65535),))])(key(proto=1, dport=0))


@pytest.mark.parametrize("text", ["", "permit tcp", "allow sctp", "allow tcp any 70000", "allow tcp any 9-1",
                                  "allow tcp 1.2.3.4/33", "allow tcp any 1 extra"])
def test_rule_parse_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        Rule.parse(text)


# ---------------------------------------------------------------- flow table


def refused(table: FlowTable, k: FlowKey, now: float) -> str:
    with pytest.raises(FlowRefused) as exc:
        table.admit(k, now)
    return exc.value.reason


def test_first_packet_judged_once() -> None:
    seen: list[FlowKey] = []

    def judge(k: FlowKey) -> bool:
        seen.append(k)
        return True

    t = FlowTable(judge, AddressGuard())
    assert t.admit(key(), 0.0) is True
    assert t.admit(key(), 0.1) is False
    assert seen == [key()]
    assert len(t) == 1 and key() in t


def test_a_tcp_flow_ends_closed_after_a_fin_each_way_and_its_linger() -> None:
    t = FlowTable(idle_timeout=60)
    f = t.open(key(), 0.0)
    t.tcp_flags(f, TCP_FIN | 0x10, False, 1.0)  # the guest's FIN: half closed, it lives on
    t.expire(10.0)
    assert key() in t and f.closed_at is None
    t.tcp_flags(f, TCP_FIN | 0x10, True, 11.0)  # the peer's FIN: closed from now
    t.tcp_flags(f, TCP_FIN | 0x10, True, 11.5)  # a retransmission changes nothing
    assert f.closed_at == 11.0
    t.expire(11.0 + CLOSE_LINGER - 0.01)
    assert key() in t  # still there for the last ACK
    t.expire(11.0 + CLOSE_LINGER)
    assert key() not in t and t.take_ended() == [(f, "closed")]
    assert t.open(key(), 20.0) is not f  # the same 5-tuple again is a new flow, judged again


def test_a_tcp_flow_ends_reset_after_a_rst_either_way() -> None:
    for inbound in (False, True):
        t = FlowTable(idle_timeout=60)
        f = t.open(key(), 0.0)
        t.tcp_flags(f, 0x10, inbound, 0.5)  # a plain ACK: nothing
        assert f.closing == 0
        t.tcp_flags(f, TCP_RST, inbound, 1.0)
        t.expire(1.0 + CLOSE_LINGER)
        assert t.take_ended() == [(f, "reset")] and len(t) == 0


def test_a_closing_flow_that_goes_idle_or_is_removed_ends_once() -> None:
    t = FlowTable(idle_timeout=1)
    f = t.open(key(), 0.0)
    t.tcp_flags(f, TCP_RST, True, 0.0)
    t.expire(1.0)  # idle first (its linger is longer than this table's idle timeout)
    t.expire(10.0)
    assert t.take_ended() == [(f, "idle")]
    g = t.open(key(dport=80), 20.0)
    t.tcp_flags(g, TCP_RST, False, 20.0)
    assert t.remove(key(dport=80), "disarmed")
    t.expire(30.0)
    assert t.take_ended() == [(g, "disarmed")]


def test_policy_denied_and_internal_address() -> None:
    t = FlowTable(Policy(["deny tcp any 25"]), AddressGuard(overlay="100.64.0.0/16"))
    assert refused(t, key(dport=25), 0.0) == "policy_denied"
    assert refused(t, key(dst=ip("10.1.2.3")), 0.0) == "internal_address"
    assert refused(t, key(dst=ip("100.64.0.1")), 0.0) == "internal_address"
    assert len(t) == 0
    assert t.refusals == {"policy_denied": 1, "internal_address": 2}
    # the guard comes before the policy: an allow-all policy cannot open internal addresses
    t2 = FlowTable(lambda k: True, AddressGuard())
    assert refused(t2, key(dst=ip("169.254.169.254"), dport=80), 0.0) == "internal_address"


def test_flow_cap_with_idle_eviction() -> None:
    t = FlowTable(cap=3, new_flow_rate=1000, idle_timeout=10.0)
    for i in range(3):
        t.admit(key(sport=i), 0.0)
    assert refused(t, key(sport=99), 5.0) == "flow_cap"
    t.admit(key(sport=0), 6.0)  # refreshed: now the youngest
    # at 10.0 flow 1 has been idle for 10 s: evicted to make room, flow 0 is kept
    assert t.admit(key(sport=99), 10.0) is True
    assert key(sport=1) not in t and key(sport=0) in t and len(t) == 3
    assert t.expire(16.0) == 2 and len(t) == 1  # flows 2 (0.0) and 0 (6.0)
    assert t.remove(key(sport=99)) and len(t) == 0


def test_flow_rate() -> None:
    t = FlowTable(new_flow_rate=1000)
    for i in range(1000):
        t.admit(key(sport=i), 0.0)
    assert refused(t, key(sport=5000), 0.0) == "flow_rate"
    t.admit(key(sport=1), 0.0)  # known flows are not rate limited
    assert t.admit(key(sport=5000), 0.001) is True  # one token back after 1 ms
    assert refused(t, key(sport=5001), 0.001) == "flow_rate"
    # a denied first packet spends a token too
    t2 = FlowTable(lambda k: False, new_flow_rate=2)
    assert refused(t2, key(), 0.0) == "policy_denied"
    assert refused(t2, key(), 0.0) == "policy_denied"
    assert refused(t2, key(), 0.0) == "flow_rate"


def test_flow_table_defaults() -> None:
    t = FlowTable()
    assert t.cap == 16384
    for i in range(1000):
        t.admit(key(sport=i), 0.0)
    assert refused(t, key(sport=1000), 0.0) == "flow_rate"
    for s in range(1, 16):
        for i in range(1000):
            t.admit(key(sport=s * 1000 + i, dport=1), float(s))
    for i in range(384):
        t.admit(key(sport=60000 + i % 5000, dport=2 + i), 16.0)
    assert len(t) == 16384
    assert refused(t, key(dport=9), 17.0) == "flow_cap"


# ---------------------------------------------------------------- limits


def gso_frame(payload: int, gso_size: int) -> OutboundFrame:
    seg = dpkt.tcp.TCP(sport=1, dport=2, data=b"x" * payload)
    pkt = bytes(dpkt.ip.IP(src=bytes(4), dst=bytes([1, 1, 1, 1]), p=6, data=seg))
    return validate_outbound(push_vnet_hdr(VnetHdr(1, GSO_TCPV4, 0, gso_size, 20, 16)) + pkt, 1500)


def test_wire_cost_counts_every_packet_and_header() -> None:
    f = gso_frame(14480, 1448)
    assert f.segments == 10
    assert wire_cost(f) == (14480 + 10 * (40 + WIRE_OVERHEAD), 10)
    assert wire_cost(f, overhead=0) == (14480 + 400, 10)
    one = gso_frame(100, 1448)
    assert wire_cost(one) == (140 + WIRE_OVERHEAD, 1)
    assert wire_cost(gso_frame(65495, 512))[0] <= MAX_FRAME_COST


def test_packet_rate_charges_segments() -> None:
    lim = ClaimLimits(packet_rate=100, packet_burst=20)  # raised to 128 (one maximal GSO frame)
    f = gso_frame(14480, 1448)
    for _ in range(12):
        lim.charge_frame(f, 0.0)
    with pytest.raises(LimitRefused) as exc:
        lim.charge_frame(f, 0.0)
    assert exc.value.reason == "packet_rate"
    assert lim.packets_used == 120
    lim.charge_frame(f, 0.02)  # 2 more tokens + 8 left = 10


def test_byte_rate_and_all_or_nothing() -> None:
    lim = ClaimLimits(byte_rate=100_000, packet_rate=1000, now=0.0)
    f = gso_frame(14480, 1448)
    cost, _ = wire_cost(f)
    n = 0
    with pytest.raises(LimitRefused) as exc:
        while True:
            lim.charge_frame(f, 0.0)
            n += 1
    assert exc.value.reason == "byte_rate"
    assert n == int(max(100_000, MAX_FRAME_COST) // cost)
    assert lim.bytes_used == n * cost and lim.packets_used == n * 10  # the refused frame cost nothing


def test_quota() -> None:
    lim = ClaimLimits(quota_bytes=1000)
    lim.charge(600, 1, 0.0)
    with pytest.raises(LimitRefused) as exc:
        lim.charge(401, 1, 100.0)
    assert exc.value.reason == "quota"
    lim.charge(400, 1, 100.0)
    assert lim.bytes_used == 1000


def test_unlimited_and_bucket_clock() -> None:
    lim = ClaimLimits()
    for _ in range(1000):
        lim.charge(MAX_FRAME_COST, 128, 0.0)
    b = TokenBucket(10, 10, now=5.0)
    assert b.take(10, 5.0) and not b.take(1, 4.0)  # time going backwards refills nothing
    assert b.take(4, 5.5) and not b.take(2, 5.5)
    with pytest.raises(ValueError):
        TokenBucket(0, 1, 0.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 70_000), st.integers(1, 128), st.floats(0, 0.05)), max_size=60))
def test_limits_never_exceed_rate(charges: list[tuple[int, int, float]]) -> None:
    rate_b, rate_p = 1_000_000.0, 10_000.0
    lim = ClaimLimits(byte_rate=rate_b, packet_rate=rate_p)
    now = 0.0
    for nbytes, packets, dt in charges:
        now += dt
        try:
            lim.charge(nbytes, packets, now)
        except LimitRefused:
            pass
        assert lim.bytes_used <= max(rate_b, MAX_FRAME_COST) + rate_b * now + 1e-6
        assert lim.packets_used <= max(rate_p, 128) + rate_p * now + 1e-6
