"""What the pinned neighbour entry and the fixed tap MAC buy, measured on real taps.

- The probe: no guest answers ARP. A TCP SYN from the host to the guest's address leaves the tap within
  5 ms with no ARP request before it when the entry is pinned; without the pin the kernel sends an ARP
  request first and no SYN leaves. Times are kernel timestamps of the frames on a packet socket bound
  to the tap, measured from just before connect(). The tap is held open by the test (as a VMM holds
  it) so it has carrier.
- The stall: a guest that starts answering ARP 20 ms after the host's first SYN. Without the pin, even
  a fresh SYN sent at 50 ms waits for the kernel's next ARP solicitation, about a second later (the
  issue's 1.1 s cold-start stall); with the pin it leaves at once.
- The restore: a guest network namespace, wired to the tap by a frame pump (the VMM's role), holds a
  STALE ARP entry for the host with the tap's MAC, as a guest restored from a snapshot does. The tap is
  deleted and created anew (a restore onto a new tap). With the fixed MAC the guest's first SYN is
  accepted and answered at once, without any ARP; a new tap with another MAC (what taps got before
  the MAC was fixed) drops the guest's frames, which is the 43 s warm-start stall.

Numbers are printed (run with -s) and summarised in docs/taps.md.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import time
from dataclasses import dataclass, replace
from ipaddress import IPv4Address
from typing import TYPE_CHECKING

import pytest
from conftest import TapEnv
from tap_support import Capture, Frame, Pump, arp_reply, create_tap_queue, drain_fd, ip_json

from forwarder.taps.netlink import TapSpec, derive_mac, ensure_tap, open_tap_queue, remove_tap
from forwarder.taps.netns import call_in_netns
from forwarder.taps.plan import SetNeighbour
from forwarder.taps.spec import NUD_INCOMPLETE, NUD_STALE

if TYPE_CHECKING:  # for the annotation; pyroute2 is imported where used, as in the rest of the tap code
    from pyroute2 import IPRoute

pytestmark = pytest.mark.netns

MS = 1_000_000  # ns
SYN_BUDGET_MS = 5.0


def pooled_spec(ns: str, sid: str = "lineage-probe") -> TapSpec:
    return TapSpec.parse(name="tap0", tap_mac=derive_mac(sid), guest_mac=derive_mac(sid, "guest"),
                         host_addr="172.16.0.1/30", guest_ip="172.16.0.2", netns=ns)


def rtnl(netns: str) -> IPRoute:
    from pyroute2 import IPRoute

    return IPRoute(netns=netns, flags=0)


def tcp_socket(ns: str, env: TapEnv) -> socket.socket:
    s = env.sock(call_in_netns(ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
    s.setblocking(False)
    return s


def start_connect(s: socket.socket, ip: IPv4Address, port: int) -> None:
    try:
        s.connect((str(ip), port))
    except BlockingIOError:
        pass


@dataclass
class Probe:
    syn_ms: float | None
    arp_ms: float | None
    frames: list[Frame]

    @property
    def arp_before_syn(self) -> bool:
        return self.arp_ms is not None and (self.syn_ms is None or self.arp_ms <= self.syn_ms)


def probe(env: TapEnv, spec: TapSpec, cap: Capture, tap_fd: int, port: int, window_ms: float) -> Probe:
    """connect() to the guest; report when the first ARP request and the first SYN left the tap."""
    assert spec.netns is not None
    cap.drain()
    drain_fd(tap_fd)
    s = tcp_socket(spec.netns, env)
    t0 = time.time_ns()
    start_connect(s, spec.guest_ip, port)
    frames = cap.outgoing_until(t0 + int(window_ms * MS), stop=lambda f: f.is_syn_to(spec.guest_ip))
    s.close()
    env.socks.remove(s)
    syn = next((f.ts_ns for f in frames if f.is_syn_to(spec.guest_ip)), None)
    arp = next((f.ts_ns for f in frames if f.is_arp_request_for(spec.guest_ip)), None)
    return Probe((syn - t0) / MS if syn else None, (arp - t0) / MS if arp else None, frames)


def summary(values: list[float]) -> str:
    return (f"median {statistics.median(values):.3f} ms, min {min(values):.3f}, max {max(values):.3f} "
            f"(n={len(values)})")


def test_first_syn_leaves_at_once_only_with_the_pinned_entry(env: TapEnv) -> None:
    ns = env.netns("sbxprb")
    spec = pooled_spec(ns)
    first = ensure_tap(spec)
    tap_fd = env.fd(open_tap_queue("tap0", ns))  # carrier on; nobody answers ARP
    cap = Capture("tap0", ns)
    env.socks.append(cap.sock)

    pinned_syn: list[float] = []
    unpinned_arp: list[float] = []
    rounds = 12
    for i in range(rounds):  # the two arms interleaved, so machine noise hits both alike
        with_pin = probe(env, spec, cap, tap_fd, 8000 + i, window_ms=50)
        assert with_pin.syn_ms is not None, "SYN never left the tap with the pinned entry"
        assert with_pin.arp_ms is None, "an ARP request left before the SYN despite the pinned entry"
        assert with_pin.syn_ms <= SYN_BUDGET_MS, f"SYN left after {with_pin.syn_ms:.3f} ms"
        pinned_syn.append(with_pin.syn_ms)

        with rtnl(ns) as ipr:
            ipr.neigh("del", dst=str(spec.guest_ip), ifindex=first.ifindex)
        without = probe(env, spec, cap, tap_fd, 9000 + i, window_ms=50)
        assert without.arp_ms is not None, "no ARP request without the pinned entry"
        assert without.syn_ms is None, f"SYN left after {without.syn_ms} ms although nobody answered ARP"
        assert without.arp_before_syn
        unpinned_arp.append(without.arp_ms)

        # The unanswered resolution left an INCOMPLETE entry: ensure corrects it back to the pin (the
        # test's descriptor plays this VM's own VMM, hence allow_attached).
        fixed = ensure_tap(spec, allow_attached=True)
        assert fixed.changes == (SetNeighbour(spec.guest_ip, spec.guest_mac, None, NUD_INCOMPLETE),)

    print(f"\n[tap probe] pinned: first SYN on the tap after {summary(pinned_syn)}; no ARP in {rounds} rounds")
    print(f"[tap probe] not pinned: ARP request after {summary(unpinned_arp)}; no SYN within 50 ms "
          f"in {rounds} rounds")


def stall_run(env: TapEnv, spec: TapSpec, cap: Capture, tap_fd: int, tap_mac: str, *, boot_ms: float,
              fresh_at_ms: float, limit_ms: float) -> tuple[float | None, float | None, int]:
    """SYN at t=0 and a fresh SYN (new connect) at ``fresh_at_ms``; the guest answers ARP from
    ``boot_ms`` on. Returns (first SYN time, fresh SYN time, ARP requests seen), times from t=0."""
    assert spec.netns is not None
    cap.drain()
    drain_fd(tap_fd)
    first, fresh = tcp_socket(spec.netns, env), tcp_socket(spec.netns, env)
    t0 = time.time_ns()
    start_connect(first, spec.guest_ip, 7001)
    fresh_sent = False
    syn_first = syn_fresh = None
    arps = 0
    f: Frame | None  # a frame read from the tap, then each captured one
    while True:
        now = time.time_ns()
        if now >= t0 + limit_ms * MS or syn_fresh is not None:
            break
        wake = t0 + (fresh_at_ms if not fresh_sent else limit_ms) * MS
        watched: list[socket.socket | int] = [cap.sock, tap_fd]
        r, _, _ = select.select(watched, [], [], max(0.0, (wake - now) / 1e9))
        if not fresh_sent and time.time_ns() >= t0 + fresh_at_ms * MS:
            start_connect(fresh, spec.guest_ip, 7002)
            fresh_sent = True
        if tap_fd in r:  # the guest's side of the tap: answer ARP once "booted"
            while True:
                try:
                    data = os.read(tap_fd, 65536)
                except BlockingIOError:
                    break
                f = Frame(time.time_ns(), data)
                if f.is_arp_request_for(spec.guest_ip) and time.time_ns() >= t0 + boot_ms * MS:
                    os.write(tap_fd, arp_reply(src_mac=spec.guest_mac, src_ip=spec.guest_ip, dst_mac=tap_mac,
                                               dst_ip=spec.host_addr.ip))
        if cap.sock in r:
            while (f := cap.read_outgoing()) is not None:
                if f.is_arp_request_for(spec.guest_ip):
                    arps += 1
                tcp = f.tcp()
                if tcp and f.is_syn_to(spec.guest_ip):
                    at = (f.ts_ns - t0) / MS
                    if tcp[2] == 7001 and syn_first is None:
                        syn_first = at
                    if tcp[2] == 7002 and syn_fresh is None:
                        syn_fresh = at
    for s in (first, fresh):
        s.close()
        env.socks.remove(s)
    return syn_first, syn_fresh, arps


def test_arp_stall_on_cold_start_without_the_pin(env: TapEnv) -> None:
    ns = env.netns("sbxstl")
    spec = pooled_spec(ns)
    first = ensure_tap(spec)
    tap_fd = env.fd(open_tap_queue("tap0", ns))
    cap = Capture("tap0", ns)
    env.socks.append(cap.sock)

    pinned = stall_run(env, spec, cap, tap_fd, first.mac, boot_ms=20, fresh_at_ms=50, limit_ms=500)
    with rtnl(ns) as ipr:
        ipr.neigh("del", dst=str(spec.guest_ip), ifindex=first.ifindex)
    unpinned = stall_run(env, spec, cap, tap_fd, first.mac, boot_ms=20, fresh_at_ms=50, limit_ms=2500)
    print(f"\n[tap stall] guest answers ARP from 20 ms, fresh SYN at 50 ms: pinned first SYN "
          f"{pinned[0]:.3f} ms, fresh SYN {pinned[1]:.3f} ms, {pinned[2]} ARP; not pinned first SYN "
          f"{unpinned[0]} ms, fresh SYN {unpinned[1]} ms, {unpinned[2]} ARP")

    assert pinned[0] is not None and pinned[0] <= SYN_BUDGET_MS
    assert pinned[1] is not None and pinned[1] <= 50 + SYN_BUDGET_MS
    assert pinned[2] == 0
    # Without the pin both SYNs wait in the neighbour queue for the kernel's next solicitation, sent
    # retrans_time (1 s) after the first, unanswered one.
    assert unpinned[0] is not None and unpinned[1] is not None
    assert unpinned[0] >= 900 and unpinned[1] >= 900, unpinned
    assert unpinned[2] >= 2


# ---------------------------------------------------------------- snapshot restore onto a new tap


@dataclass
class Wiring:
    host_ns: str
    guest_ns: str
    guest_fd: int
    spec: TapSpec


def make_guest(env: TapEnv, spec: TapSpec) -> Wiring:
    """A guest namespace whose NIC (eth0: guest MAC and address) is a tap the test holds, like a VM's."""
    assert spec.netns is not None
    gns = env.netns("sbxgst")
    gfd = env.fd(create_tap_queue("eth0", gns))
    with rtnl(gns) as ipr:
        idx = ipr.link_lookup(ifname="eth0")[0]
        ipr.link("set", index=idx, address=spec.guest_mac)
        ipr.link("set", index=idx, state="up")
        ipr.addr("add", index=idx, address=str(spec.guest_ip), prefixlen=spec.host_addr.network.prefixlen)
    return Wiring(spec.netns, gns, gfd, spec)


def guest_connect(env: TapEnv, w: Wiring, port: int, timeout_s: float) -> float | None:
    """Seconds the guest's connect() to the host took, or None if it did not complete in time."""
    s = env.sock(call_in_netns(w.guest_ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
    s.settimeout(timeout_s)
    t0 = time.perf_counter()
    try:
        s.connect((str(w.spec.host_addr.ip), port))
    except (TimeoutError, OSError):
        return None
    finally:
        s.close()
        env.socks.remove(s)
    return time.perf_counter() - t0


def listener(env: TapEnv, w: Wiring, port: int) -> socket.socket:
    s = env.sock(call_in_netns(w.host_ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
    s.bind((str(w.spec.host_addr.ip), port))
    s.listen(8)
    return s


def guest_neighbour(w: Wiring) -> dict:
    entries = ip_json("-4", "neigh", "show", "dev", "eth0", netns=w.guest_ns)
    match = [n for n in entries if n["dst"] == str(w.spec.host_addr.ip)]
    assert len(match) == 1, entries
    return match[0]


def restore(env: TapEnv, *, fixed_mac: bool, budget_s: float | None = None
            ) -> tuple[Wiring, str, float | None, list[Frame]]:
    """Boot, learn the tap's MAC, snapshot, delete the tap, create a new one, restore; connect again."""
    host_ns = env.netns("sbxhst")
    spec = pooled_spec(host_ns, "lineage-restore")
    ensure_tap(spec)
    w = make_guest(env, spec)
    tap_fd = env.fd(open_tap_queue("tap0", host_ns))
    pump = Pump(tap_fd, w.guest_fd)
    try:
        ls = listener(env, w, 8080)
        # Before the snapshot: the guest resolves the host by ARP like any booted guest.
        assert guest_connect(env, w, 8080, 3.0) is not None
        ls.close()
        env.socks.remove(ls)
        cached = guest_neighbour(w)
        assert cached["lladdr"] == spec.tap_mac
    finally:
        pump.stop()

    # Snapshot taken; the VM and its tap go away. The guest keeps its ARP cache in the snapshot; by the
    # time it is restored the entry is STALE (the guest's clock jumped past reachable_time).
    env.close_fd(tap_fd)
    assert remove_tap(spec).removed
    with rtnl(w.guest_ns) as ipr:
        idx = ipr.link_lookup(ifname="eth0")[0]
        ipr.neigh("replace", dst=str(spec.host_addr.ip), lladdr=spec.tap_mac, ifindex=idx, state=NUD_STALE)
    assert guest_neighbour(w)["state"] == ["STALE"]

    # Restore onto a new tap: the fixed MAC again, or (the control) the MAC a new tap would get otherwise.
    new_spec = spec if fixed_mac else replace(spec, tap_mac=derive_mac("a-different-tap"))
    result = ensure_tap(new_spec)
    assert result.created and result.mac == new_spec.tap_mac
    tap_fd2 = env.fd(open_tap_queue("tap0", host_ns))
    listener(env, w, 8081)  # closed by the env fixture
    pump2 = Pump(tap_fd2, w.guest_fd)
    try:
        took = guest_connect(env, w, 8081, budget_s or (2.0 if fixed_mac else 1.5))
    finally:
        pump2.stop()
    return w, new_spec.tap_mac, took, list(pump2.log)


def test_restored_guest_with_stale_arp_entry_reaches_host_at_once(env: TapEnv) -> None:
    w, tap_mac, took, log = restore(env, fixed_mac=True)
    spec = w.spec
    assert tap_mac == spec.tap_mac == guest_neighbour(w)["lladdr"]
    assert took is not None, "the restored guest could not reach the host"
    print(f"\n[tap restore] fixed tap MAC: restored guest's connect() to the host took {took * 1000:.3f} ms")
    # The first SYN was answered: faster than TCP's 1 s SYN retransmit, and only one SYN was sent.
    assert took < 0.5
    to_host = [f for f in log if f.direction == "to_host"]
    syns = [f for f in to_host if f.is_syn_to(spec.host_addr.ip)]
    assert len(syns) == 1 and syns[0].dst == spec.tap_mac
    synack_at = next(f.ts_ns for f in log if f.direction == "to_guest" and f.is_synack_to(spec.guest_ip))
    # No ARP either way before the handshake: the guest used its cached entry, the host its pin.
    arps = [f for f in log if f.arp() is not None and f.ts_ns <= synack_at]
    assert arps == [], [(f.direction, f.arp()) for f in arps]


def test_restored_guest_is_stuck_when_the_new_tap_gets_another_mac(env: TapEnv) -> None:
    w, tap_mac, took, log = restore(env, fixed_mac=False)
    spec = w.spec
    assert tap_mac != spec.tap_mac == guest_neighbour(w)["lladdr"]
    print(f"\n[tap restore] new tap MAC: restored guest's connect() {'took ' + str(took) if took else 'timed out'}"
          " after 1.5 s")
    assert took is None, "the guest reached the host although its cached MAC is not the tap's"
    syns = [f for f in log if f.direction == "to_host" and f.is_syn_to(spec.host_addr.ip)]
    assert len(syns) >= 2  # the first SYN and TCP's retransmit 1 s later, both ...
    assert all(f.dst == spec.tap_mac != tap_mac for f in syns)  # ... sent to the old MAC, dropped by the tap
    assert not any(f.direction == "to_guest" and f.is_synack_to(spec.guest_ip) for f in log)


@pytest.mark.slow
def test_restored_guest_recovery_time_with_another_tap_mac(env: TapEnv) -> None:
    """How long a Linux guest (default neighbour settings) stays cut off when the new tap's MAC differs.

    Its STALE entry goes to DELAY (5 s), then unicast probes to the dead MAC (3 x 1 s) fail, and only then
    does it broadcast ARP; TCP's SYN backoff (1, 2, 4, 8 s) decides when the next SYN uses the new entry.
    The issue's trace saw 43 s with its guest's settings; this measures what a default Linux guest sees.
    """
    w, tap_mac, took, _log = restore(env, fixed_mac=False, budget_s=60.0)
    print(f"\n[tap restore] new tap MAC: restored guest reached the host after {took} s")
    assert took is not None and took > 5.0
    assert guest_neighbour(w)["lladdr"] == tap_mac  # it re-learned the new MAC in the end
