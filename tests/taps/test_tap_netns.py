"""ensure_tap / remove_tap on real TAP devices, in the host namespace and in pooled namespaces.

The state after each call is read back with iproute2 (`ip -j`), independently of the product's own
netlink code, and "a second ensure is a no-op" is proved twice: identical `ip` state and no rtnetlink
change notification for the tap.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import struct
from ipaddress import IPv4Address
from typing import TYPE_CHECKING

import pytest
from conftest import TapEnv
from tap_support import NetlinkEvents, create_tap_queue, ip_json, ip_state, unique

from forwarder.taps.netlink import (
    IFF_NO_PI,
    TUNSETIFF,
    TUNSETPERSIST,
    NetnsNotFoundError,
    NotATapError,
    TapInUseError,
    TapNotPersistentError,
    TapOwnerMismatchError,
    TapRef,
    TapSpec,
    derive_mac,
    ensure_tap,
    open_tap_queue,
    remove_tap,
)
from forwarder.taps.netns import call_in_netns
from forwarder.taps.plan import AddAddr, DelAddr, DelNeighbour, SetMac, SetMtu, SetNeighbour, SetUp
from forwarder.taps.spec import NUD_PERMANENT, NUD_REACHABLE, NUD_STALE

if TYPE_CHECKING:  # for the annotation; pyroute2 is imported where used, as in the rest of the tap code
    from pyroute2 import IPRoute

pytestmark = pytest.mark.netns

IFF_TUN = 0x0001


def make_spec(name: str, netns: str | None, *, sid: str = "lineage-a", host: str | None = None,
              guest: str | None = None, tap_sid: str | None = None, **kw: object) -> TapSpec:
    if host is None:
        if netns is None:
            # Host namespace: a random /30 of 198.18.0.0/15 (benchmarking range, RFC 2544) so no real route
            # is shadowed; the tap has no carrier in these tests, so nothing is ever sent.
            base = (198 << 24) | (18 << 16) | (random.randrange(1, 1 << 15) << 2)
            host, guest = f"{IPv4Address(base + 1)}/30", str(IPv4Address(base + 2))
        else:
            host, guest = "172.16.0.1/30", "172.16.0.2"
    assert guest is not None
    return TapSpec.parse(name=name, tap_mac=derive_mac(tap_sid or sid), guest_mac=derive_mac(sid, "guest"),
                         host_addr=host, guest_ip=guest, netns=netns, **kw)  # type: ignore[arg-type]


def tap_details(name: str, netns: str | None) -> dict:
    return ip_json("-d", "link", "show", "dev", name, netns=netns)[0]["linkinfo"]


def assert_pinned(spec: TapSpec) -> dict:
    state = ip_state(spec.name, spec.netns)
    assert state["link"]["address"] == spec.tap_mac
    assert "UP" in state["link"]["flags"]
    assert state["addrs"] == [(str(spec.host_addr.ip), spec.host_addr.network.prefixlen)]
    assert state["neigh"] == [(str(spec.guest_ip), spec.guest_mac, ("PERMANENT",))]
    info = tap_details(spec.name, spec.netns)
    assert info["info_kind"] == "tun"
    assert info["info_data"]["type"] == "tap"
    assert info["info_data"]["persist"] is True
    return state


def rtnl(netns: str | None) -> IPRoute:
    from pyroute2 import IPRoute

    return IPRoute(netns=netns, flags=0) if netns else IPRoute()


@pytest.mark.parametrize("where", ["host", "pooled"])
def test_ensure_pins_guest_and_second_ensure_is_a_no_op(env: TapEnv, where: str) -> None:
    ns = env.netns() if where == "pooled" else None
    name = env.host_tap_name() if ns is None else "tap0"
    spec = make_spec(name, ns)

    first = ensure_tap(spec)
    assert first.created and first.changed
    assert first.mac == spec.tap_mac
    assert [c.op for c in first.changes] == ["create", "mac", "up", "addr_add", "neigh_set"]
    state = assert_pinned(spec)

    events = NetlinkEvents(ns)
    try:
        second = ensure_tap(spec)
        assert not second.created and not second.changed and second.changes == ()
        assert second.lines()[0].endswith("unchanged")
        assert ip_state(name, ns) == state
        assert events.collect(first.ifindex) == []
    finally:
        events.close()

    assert remove_tap(spec).removed
    assert all(link["ifname"] != name for link in ip_json("link", "show", netns=ns))
    assert not remove_tap(spec).removed


def test_pooled_namespace_reused_across_vms(env: TapEnv) -> None:
    ns = env.netns("sbxpool")
    vm_a = make_spec("tap0", ns, sid="lineage-a")
    ensure_tap(vm_a)
    # The next VM restored into this pooled namespace from the same snapshot lineage: identical config,
    # nothing to do (this is what makes one snapshot restorable into any namespace of the pool).
    assert not ensure_tap(vm_a).changed

    # A VM of another lineage inherits the leftover tap: everything of the previous guest is corrected,
    # including its pinned neighbour entry.
    vm_b = make_spec("tap0", ns, sid="lineage-b", host="172.16.0.9/29", guest="172.16.0.10")
    result = ensure_tap(vm_b)
    assert not result.created
    assert result.changes == (
        SetMac(vm_a.tap_mac, vm_b.tap_mac),
        DelAddr(vm_a.host_addr),
        AddAddr(vm_b.host_addr),
        # The MAC change flushed the tap's neighbour table, A's pin with it; B's is planned afresh.
        SetNeighbour(vm_b.guest_ip, vm_b.guest_mac, None, None),
    )
    assert_pinned(vm_b)
    assert not ensure_tap(vm_b).changed

    # Same tap MAC and address, another guest: the previous guest's pin is removed, the new one added.
    vm_c = make_spec("tap0", ns, sid="lineage-c", tap_sid="lineage-b", host="172.16.0.9/29", guest="172.16.0.11")
    assert ensure_tap(vm_c).changes == (
        DelNeighbour(vm_b.guest_ip, vm_b.guest_mac, NUD_PERMANENT),
        SetNeighbour(vm_c.guest_ip, vm_c.guest_mac, None, None),
    )
    assert_pinned(vm_c)


WRONG_MAC = "5e:00:00:00:be:ef"


@pytest.mark.parametrize(
    ("case", "lladdr", "state"),
    [("reachable-wrong-mac", WRONG_MAC, NUD_REACHABLE), ("stale-right-mac", None, NUD_STALE),
     ("permanent-wrong-mac", WRONG_MAC, NUD_PERMANENT), ("deleted", None, 0)],
)
def test_wrong_neighbour_entry_is_corrected(env: TapEnv, case: str, lladdr: str | None, state: int) -> None:
    ns = env.netns()
    spec = make_spec("tap0", ns)
    first = ensure_tap(spec)
    with rtnl(ns) as ipr:
        if state == 0:
            ipr.neigh("del", dst=str(spec.guest_ip), ifindex=first.ifindex)
        else:
            ipr.neigh("replace", dst=str(spec.guest_ip), lladdr=lladdr or spec.guest_mac, ifindex=first.ifindex,
                      state=state)
    before = ip_state("tap0", ns)["neigh"]
    if state:
        assert before == [(str(spec.guest_ip), lladdr or spec.guest_mac,
                           (("REACHABLE",) if state == NUD_REACHABLE else ("STALE",) if state == NUD_STALE
                            else ("PERMANENT",)))]
    fixed = ensure_tap(spec)
    old = None if state == 0 else (lladdr or spec.guest_mac)
    assert fixed.changes == (SetNeighbour(spec.guest_ip, spec.guest_mac, old, state or None),)
    assert "PERMANENT" in fixed.changes[0].describe()
    assert_pinned(spec)
    assert not ensure_tap(spec).changed


def test_wrong_mac_address_mtu_and_down_link_are_corrected(env: TapEnv) -> None:
    ns = env.netns()
    spec = make_spec("tap0", ns, mtu=1400)
    first = ensure_tap(spec)
    assert SetMtu(1500, 1400) in first.changes
    with rtnl(ns) as ipr:
        ipr.link("set", index=first.ifindex, state="down")  # also flushes the neighbour table of the tap
        ipr.link("set", index=first.ifindex, address=WRONG_MAC, mtu=9000)
        ipr.addr("del", index=first.ifindex, address=str(spec.host_addr.ip), prefixlen=30)
        ipr.addr("add", index=first.ifindex, address="172.16.0.1", prefixlen=24)
        ipr.addr("add", index=first.ifindex, address="10.9.9.9", prefixlen=8)
    assert ip_state("tap0", ns)["neigh"] == []
    fixed = ensure_tap(spec)
    ops = [c.op for c in fixed.changes]
    assert ops[:3] == ["mac", "mtu", "up"]
    assert SetMac(WRONG_MAC, spec.tap_mac) in fixed.changes and SetUp() in fixed.changes
    assert sorted(str(c.iface) for c in fixed.changes if isinstance(c, DelAddr)) == ["10.9.9.9/8", "172.16.0.1/24"]
    assert fixed.changes[-2:] == (AddAddr(spec.host_addr), SetNeighbour(spec.guest_ip, spec.guest_mac, None, None))
    state = assert_pinned(spec)
    assert state["link"]["mtu"] == 1400
    assert not ensure_tap(spec).changed


def test_owner_and_group_are_set_and_enforced(env: TapEnv) -> None:
    ns = env.netns()
    spec = make_spec("tap0", ns, owner_uid=4242, owner_gid=4243)
    ensure_tap(spec)
    info = tap_details("tap0", ns)["info_data"]
    assert (info["user"], info["group"]) in ((4242, 4243), ("4242", "4243"))
    assert not ensure_tap(spec).changed

    other = make_spec("tap0", ns)  # no owner: someone else's expectation
    with pytest.raises(TapOwnerMismatchError) as e:
        ensure_tap(other)
    assert e.value.reason == "tap_owner_mismatch" and "uid 4242 gid 4243" in str(e.value)
    with pytest.raises(TapOwnerMismatchError):
        remove_tap(TapRef("tap0", ns))
    assert remove_tap(TapRef("tap0", ns, 4242, 4243)).removed


def test_missing_namespace(env: TapEnv) -> None:
    missing = unique("sbxnone")
    spec = make_spec("tap0", missing)
    for call in (lambda: ensure_tap(spec), lambda: remove_tap(spec)):
        with pytest.raises(NetnsNotFoundError) as e:
            call()
        assert e.value.reason == "netns_missing"
        assert f"ip netns add {missing}" in str(e.value)
    assert not os.path.exists(f"/run/netns/{missing}")  # refused, not created behind the caller's back


def test_leftover_netns_file_is_not_a_namespace(env: TapEnv) -> None:
    name = unique("sbxfake")
    os.makedirs("/run/netns", exist_ok=True)
    path = f"/run/netns/{name}"
    env.files.append(path)
    with open(path, "w"):
        pass
    with pytest.raises(NetnsNotFoundError) as e:
        ensure_tap(make_spec("tap0", name))
    assert e.value.reason == "netns_not_a_namespace"


def test_name_taken_by_a_veth(env: TapEnv) -> None:
    ns = env.netns()
    with rtnl(ns) as ipr:
        ipr.link("add", ifname="tap0", kind="veth", peer="tap0peer")
    spec = make_spec("tap0", ns)
    with pytest.raises(NotATapError) as e:
        ensure_tap(spec)
    assert e.value.reason == "not_a_tap" and "veth" in str(e.value)
    with pytest.raises(NotATapError):
        remove_tap(spec)
    assert ip_json("-d", "link", "show", "dev", "tap0", netns=ns)[0]["linkinfo"]["info_kind"] == "veth"


def test_name_taken_by_a_tun(env: TapEnv) -> None:
    ns = env.netns()
    fd = call_in_netns(ns, lambda: os.open("/dev/net/tun", os.O_RDWR))
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", b"tap0", IFF_TUN | IFF_NO_PI))
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    finally:
        os.close(fd)
    with pytest.raises(NotATapError) as e:
        ensure_tap(make_spec("tap0", ns))
    assert e.value.reason == "not_a_tap" and "TUN (layer-3" in str(e.value)


def test_non_persistent_tap_of_another_process(env: TapEnv) -> None:
    ns = env.netns()
    env.fd(create_tap_queue("tap0", ns))  # this test plays the other process holding the tap
    with pytest.raises(TapNotPersistentError) as e:
        ensure_tap(make_spec("tap0", ns))
    assert e.value.reason == "tap_not_persistent" and "fdinfo" in str(e.value)
    assert ip_state("tap0", ns)["addrs"] == []  # nothing was touched


def test_attached_tap_is_in_use(env: TapEnv) -> None:
    ns = env.netns()
    spec = make_spec("tap0", ns)
    ensure_tap(spec)
    fd = env.fd(open_tap_queue("tap0", ns))  # a VMM attached to it
    for call in (lambda: ensure_tap(spec), lambda: remove_tap(spec)):
        with pytest.raises(TapInUseError) as e:
            call()
        assert e.value.reason == "tap_attached" and "--allow-attached" in str(e.value)
    assert not ensure_tap(spec, allow_attached=True).changed
    env.close_fd(fd)  # the VMM exits: carrier goes down, and the PERMANENT entry survives that
    assert not ensure_tap(spec).changed


def test_enslaved_tap_is_in_use(env: TapEnv) -> None:
    from pyroute2.netlink.exceptions import NetlinkError

    ns = env.netns()
    spec = make_spec("tap0", ns)
    first = ensure_tap(spec)
    with rtnl(ns) as ipr:
        try:
            ipr.link("add", ifname="br0", kind="bridge")
        except NetlinkError as exc:
            pytest.skip(f"no bridge support in this kernel: {exc}")
        ipr.link("set", index=first.ifindex, master=ipr.link_lookup(ifname="br0")[0])
    with pytest.raises(TapInUseError) as e:
        ensure_tap(spec, allow_attached=True)
    assert e.value.reason == "tap_enslaved"


def test_cli_ensure_remove(env: TapEnv, capsys: pytest.CaptureFixture[str]) -> None:
    from sbxnet.app.cli import main

    ns = env.netns()
    argv = ["tap", "ensure", "--name", "tap0", "--netns", ns, "--host-addr", "172.16.0.1/30", "--guest-ip",
            "172.16.0.2", "--stable-id", "lineage-a", "--mtu", "1500"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "created persistent tap tap0" in out and "PERMANENT" in out
    assert_pinned(make_spec("tap0", ns))
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().endswith("unchanged")
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["changed"] is False and payload["mac"] == derive_mac("lineage-a")

    assert main(["tap", "remove", "--name", "tap0", "--netns", ns]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["tap", "remove", "--name", "tap0", "--netns", ns]) == 0
    assert "absent" in capsys.readouterr().out

    with rtnl(ns) as ipr:
        ipr.link("add", ifname="tap0", kind="veth", peer="tap0peer")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("sbxnet tap ensure: not_a_tap: ") and "fix:" in err
    assert main([*argv[:4], "--netns", unique("sbxnone"), *argv[6:]]) == 1
    assert "netns_missing" in capsys.readouterr().err


def test_no_descriptor_or_thread_leak(env: TapEnv) -> None:
    import threading

    ns = env.netns()
    spec = make_spec("tap0", ns)
    ensure_tap(spec)
    remove_tap(spec)  # warm up lazy imports and pyroute2 caches
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(5):
        ensure_tap(spec)
        ensure_tap(spec)
        with pytest.raises(NetnsNotFoundError):
            ensure_tap(make_spec("tap0", unique("sbxnone")))
        remove_tap(spec)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() == threads
