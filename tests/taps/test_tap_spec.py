"""Pure tap logic: spec validation, MAC derivation, adoption checks and the change plan. No devices."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, IPv4Interface

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.taps.errors import (
    InvalidMacError,
    InvalidTapNameError,
    NotATapError,
    TapError,
    TapInUseError,
    TapNotPersistentError,
    TapOwnerMismatchError,
    TapSpecError,
)
from forwarder.taps.plan import (
    AddAddr,
    DelAddr,
    DelNeighbour,
    ObservedNeighbour,
    ObservedTap,
    SetMac,
    SetMtu,
    SetNeighbour,
    SetUp,
    check_adoptable,
    first_round,
    plan_tap,
)
from forwarder.taps.spec import (
    NUD_PERMANENT,
    NUD_REACHABLE,
    NUD_STALE,
    TUN_TYPE_TAP,
    TUN_TYPE_TUN,
    TapRef,
    TapSpec,
    derive_mac,
    nud_name,
    parse_mac,
)

TAP_MAC = "02:aa:00:00:00:01"
GUEST_MAC = "06:00:ac:10:00:02"


def spec(**kw: object) -> TapSpec:
    base: dict[str, object] = dict(name="tap0", tap_mac=TAP_MAC, host_addr="172.16.0.1/30",
                                   guest_ip="172.16.0.2", guest_mac=GUEST_MAC)
    base.update(kw)
    return TapSpec.parse(**base)  # type: ignore[arg-type]


def matching(s: TapSpec, **kw: object) -> ObservedTap:
    obs = ObservedTap(
        ifindex=7, kind="tun", tun_type=TUN_TYPE_TAP, persistent=True, owner_uid=s.owner_uid,
        owner_gid=s.owner_gid, carrier=False, num_queues=None, master=None, mac=s.tap_mac,
        mtu=s.mtu or 1500, up=True, ipv4=(s.host_addr,),
        neighbours=(ObservedNeighbour(s.guest_ip, s.guest_mac, NUD_PERMANENT),),
    )
    return replace(obs, **kw)  # type: ignore[arg-type]


def assert_error(exc: pytest.ExceptionInfo[TapError], cls: type, reason: str, *fragments: str) -> None:
    assert type(exc.value) is cls, type(exc.value)
    assert exc.value.reason == reason
    text = str(exc.value)
    assert text.startswith(f"{reason}: ") and "; fix: " in text, text
    for frag in fragments:
        assert frag in text, (frag, text)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["t", "tap0", "vm-12.eth_0", "a" * 15])
def test_valid_names(name: str) -> None:
    assert spec(name=name).name == name


def test_name_too_long_names_the_limit_and_a_fix() -> None:
    with pytest.raises(InvalidTapNameError) as e:
        spec(name="a" * 16)
    assert_error(e, InvalidTapNameError, "name_too_long", "16 bytes", "at most 15 bytes")


def test_name_length_is_counted_in_bytes_not_characters() -> None:
    with pytest.raises(InvalidTapNameError) as e:
        spec(name="é" * 8)  # 8 characters, 16 bytes
    assert e.value.reason in ("name_too_long", "name_invalid")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a:b", "a b", "tap%d", "a\tb", "tä"])
def test_invalid_names(name: str) -> None:
    with pytest.raises(InvalidTapNameError) as e:
        spec(name=name)
    assert e.value.reason == "name_invalid"
    assert "fix:" in str(e.value)


# ---------------------------------------------------------------- MACs


@pytest.mark.parametrize(
    ("text", "want"),
    [("02:AA:00:00:00:01", "02:aa:00:00:00:01"), ("02-aa-00-00-00-01", "02:aa:00:00:00:01"),
     (" 06:00:ac:10:00:02 ", "06:00:ac:10:00:02"), ("00:16:3e:00:00:01", "00:16:3e:00:00:01")],
)
def test_parse_mac_normalises(text: str, want: str) -> None:
    assert parse_mac(text) == want


MULTICAST = ["01:00:5e:00:00:01", "33:33:00:00:00:01", "ff:ff:ff:ff:ff:ff", "03:00:00:00:00:01"]


@pytest.mark.parametrize("mac", MULTICAST)
def test_multicast_mac_refused_for_tap_and_guest(mac: str) -> None:
    for field in ("tap_mac", "guest_mac"):
        with pytest.raises(InvalidMacError) as e:
            spec(**{field: mac})
        assert_error(e, InvalidMacError, "mac_multicast", mac, "multicast")


def test_zero_mac_refused() -> None:
    with pytest.raises(InvalidMacError) as e:
        spec(tap_mac="00:00:00:00:00:00")
    assert_error(e, InvalidMacError, "mac_zero", "all-zero")


@pytest.mark.parametrize("mac", ["", "02:00:00:00:00", "02:00:00:00:00:00:00", "02:00:00:00:00:0g",
                                 "2:0:0:0:0:1",
                                 "0200.0000.0001"])
def test_unparsable_mac_refused(mac: str) -> None:
    with pytest.raises(InvalidMacError) as e:
        spec(guest_mac=mac)
    assert e.value.reason == "mac_invalid"


def test_tap_and_guest_mac_must_differ() -> None:
    with pytest.raises(InvalidMacError) as e:
        spec(guest_mac=TAP_MAC.upper())
    assert e.value.reason == "mac_duplicate"


def test_derive_mac_golden_values() -> None:
    # Pinned literals: a snapshot taken today must find the same tap MAC after any upgrade, so a change
    # to the derivation is a breaking change that this test makes visible.
    assert derive_mac("lineage-1") == derive_mac("lineage-1", "tap") == "7e:91:6f:87:9c:78"
    assert derive_mac("lineage-1", "guest") == "de:ad:0c:d7:ec:87"


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.sampled_from(["tap", "guest"]))
def test_derive_mac_is_unicast_locally_administered_and_stable(sid: str, role: str) -> None:
    mac = derive_mac(sid, role)
    first = int(mac[:2], 16)
    assert first & 0x01 == 0 and first & 0x02 == 0x02
    assert parse_mac(mac) == mac == derive_mac(sid, role)
    other = "guest" if role == "tap" else "tap"
    assert derive_mac(sid, other) != mac


def test_derive_mac_refuses_bad_input() -> None:
    with pytest.raises(TapSpecError):
        derive_mac("")
    with pytest.raises(TapSpecError):
        derive_mac("x", "host")


# ---------------------------------------------------------------- addresses, mtu, owner, netns


@pytest.mark.parametrize(
    ("host", "guest", "reason"),
    [("172.16.0.1/30", "172.16.0.1", "guest_is_host"),
     ("172.16.0.1/30", "172.16.0.5", "guest_not_on_link"),
     ("172.16.0.1/32", "172.16.0.2", "guest_not_on_link"),
     ("172.16.0.1/30", "172.16.0.3", "address_invalid"),
     ("172.16.0.0/30", "172.16.0.2", "address_invalid"),
     ("172.16.0.1", "172.16.0.2", "address_invalid"),
     ("172.16.0.1/33", "172.16.0.2", "address_invalid"),
     ("fd00::1/64", "172.16.0.2", "address_invalid"),
     ("172.16.0.1/30", "nope", "address_invalid")],
)
def test_bad_addresses(host: str, guest: str, reason: str) -> None:
    with pytest.raises(TapSpecError) as e:
        spec(host_addr=host, guest_ip=guest)
    assert e.value.reason == reason
    assert "fix:" in str(e.value)


def test_point_to_point_31_is_fine() -> None:
    s = spec(host_addr="172.16.0.0/31", guest_ip="172.16.0.1")
    assert s.host_addr == IPv4Interface("172.16.0.0/31")


@pytest.mark.parametrize("mtu", [0, 67, 65536, -1, True])
def test_mtu_out_of_range(mtu: int) -> None:
    with pytest.raises(TapSpecError) as e:
        spec(mtu=mtu)
    assert e.value.reason == "mtu_out_of_range"


@pytest.mark.parametrize("uid", [-1, 2**32, 2**32 - 1, True])
def test_owner_invalid(uid: int) -> None:
    with pytest.raises(TapSpecError) as e:
        spec(owner_uid=uid)
    assert e.value.reason == "owner_invalid"


@pytest.mark.parametrize("ns", ["", ".", "..", "a/b", "x" * 256])
def test_netns_name_invalid(ns: str) -> None:
    with pytest.raises(TapSpecError) as e:
        spec(netns=ns)
    assert e.value.reason == "netns_name_invalid"


# ---------------------------------------------------------------- adoption


def test_adopt_matching_tap() -> None:
    s = spec(owner_uid=1000, owner_gid=1000)
    check_adoptable(s.ref, matching(s))


def test_not_a_tap_veth() -> None:
    s = spec()
    with pytest.raises(NotATapError) as e:
        check_adoptable(s.ref, matching(s, kind="veth", tun_type=None))
    assert_error(e, NotATapError, "not_a_tap", "veth", "not a tap", "choose another --name")


def test_not_a_tap_plain_interface() -> None:
    s = spec()
    with pytest.raises(NotATapError) as e:
        check_adoptable(s.ref, matching(s, kind=None, tun_type=None))
    assert "plain" in str(e.value)


def test_tun_is_not_a_tap() -> None:
    s = spec()
    with pytest.raises(NotATapError) as e:
        check_adoptable(s.ref, matching(s, tun_type=TUN_TYPE_TUN))
    assert_error(e, NotATapError, "not_a_tap", "TUN (layer-3")


def test_non_persistent_tap_belongs_to_its_process() -> None:
    s = spec()
    with pytest.raises(TapNotPersistentError) as e:
        check_adoptable(s.ref, matching(s, persistent=False, carrier=True))
    assert_error(e, TapNotPersistentError, "tap_not_persistent", "/proc/*/fdinfo", "stop that process")


Id = int | None


@pytest.mark.parametrize(("obs_uid", "obs_gid", "want_uid", "want_gid"),
                         [(4242, None, None, None), (None, None, 1000, None), (1000, 5, 1000, 6),
                          (None, 7, None, None)])
def test_owner_mismatch(obs_uid: Id, obs_gid: Id, want_uid: Id, want_gid: Id) -> None:
    s = spec(owner_uid=want_uid, owner_gid=want_gid)
    with pytest.raises(TapOwnerMismatchError) as e:
        check_adoptable(s.ref, matching(s, owner_uid=obs_uid, owner_gid=obs_gid))
    shown = obs_uid if obs_uid is not None else "none"
    assert_error(e, TapOwnerMismatchError, "tap_owner_mismatch", f"uid {shown}",
                 "--owner")


def test_attached_tap_refused_unless_allowed() -> None:
    s = spec()
    with pytest.raises(TapInUseError) as e:
        check_adoptable(s.ref, matching(s, carrier=True))
    assert_error(e, TapInUseError, "tap_attached", "running process", "--allow-attached")
    with pytest.raises(TapInUseError):
        check_adoptable(s.ref, matching(s, num_queues=2))
    check_adoptable(s.ref, matching(s, carrier=True), allow_attached=True)


def test_enslaved_tap_refused_even_when_attached_allowed() -> None:
    s = spec()
    with pytest.raises(TapInUseError) as e:
        check_adoptable(s.ref, matching(s, master=3), allow_attached=True)
    assert_error(e, TapInUseError, "tap_enslaved", "bridge")


def test_checks_apply_in_order() -> None:
    s = spec()
    # A non-persistent tun of another owner, attached: the first problem (not a tap) is the one reported.
    obs = matching(s, tun_type=TUN_TYPE_TUN, persistent=False, owner_uid=1, carrier=True)
    with pytest.raises(NotATapError):
        check_adoptable(s.ref, obs)


def test_ref_validates() -> None:
    with pytest.raises(InvalidTapNameError):
        TapRef("x" * 16)
    assert TapRef("tap0").where == "the host namespace"
    assert TapRef("tap0", "pool-1").where == "netns pool-1"


# ---------------------------------------------------------------- plan


def test_plan_empty_when_matching() -> None:
    s = spec(mtu=1400)
    assert plan_tap(s, matching(s)) == ()


def test_plan_for_fresh_tap_orders_changes() -> None:
    s = spec(mtu=1400)
    fresh = matching(s, mac="5e:00:00:00:00:01", mtu=1500, up=False, ipv4=(), neighbours=())
    assert plan_tap(s, fresh) == (
        SetMac("5e:00:00:00:00:01", s.tap_mac),
        SetMtu(1500, 1400),
        SetUp(),
        AddAddr(s.host_addr),
        SetNeighbour(s.guest_ip, s.guest_mac, None, None),
    )


def test_plan_mtu_none_leaves_mtu() -> None:
    s = spec()
    assert plan_tap(s, matching(s, mtu=9000)) == ()


@pytest.mark.parametrize(
    ("mac", "state"),
    [("5e:00:00:00:00:09", NUD_REACHABLE), (GUEST_MAC, NUD_STALE), ("5e:00:00:00:00:09", NUD_PERMANENT),
     (None, 0x01)],
)
def test_plan_corrects_wrong_neighbour(mac: str | None, state: int) -> None:
    s = spec()
    obs = matching(s, neighbours=(ObservedNeighbour(s.guest_ip, mac, state),))
    assert plan_tap(s, obs) == (SetNeighbour(s.guest_ip, s.guest_mac, mac, state),)


def test_plan_removes_pins_of_a_previous_guest_but_not_dynamic_entries() -> None:
    s = spec(host_addr="172.16.0.5/30", guest_ip="172.16.0.6")
    old_pin = ObservedNeighbour(IPv4Address("172.16.0.2"), "06:00:00:00:00:01", NUD_PERMANENT)
    dynamic = ObservedNeighbour(IPv4Address("172.16.0.9"), "06:00:00:00:00:02", NUD_REACHABLE)
    obs = matching(s, ipv4=(IPv4Interface("172.16.0.1/30"),), neighbours=(old_pin, dynamic))
    assert plan_tap(s, obs) == (
        DelAddr(IPv4Interface("172.16.0.1/30")),
        AddAddr(s.host_addr),
        DelNeighbour(old_pin.ip, old_pin.mac, NUD_PERMANENT),
        SetNeighbour(s.guest_ip, s.guest_mac, None, None),
    )


def test_plan_replaces_wrong_prefix_delete_first() -> None:
    s = spec()
    wrong = IPv4Interface("172.16.0.1/24")
    assert plan_tap(s, matching(s, ipv4=(wrong,))) == (DelAddr(wrong), AddAddr(s.host_addr))


def test_first_round_defers_neighbours_when_addresses_are_removed() -> None:
    s = spec()
    wrong = IPv4Interface("172.16.0.1/24")
    full = plan_tap(s, matching(s, ipv4=(wrong,), neighbours=()))
    assert first_round(full) == (DelAddr(wrong), AddAddr(s.host_addr))
    fresh = plan_tap(s, matching(s, mac="5e:00:00:00:00:01", neighbours=()))
    assert first_round(fresh) == (SetMac("5e:00:00:00:00:01", s.tap_mac),)
    neigh_only = plan_tap(s, matching(s, neighbours=()))
    assert first_round(neigh_only) == neigh_only == (SetNeighbour(s.guest_ip, s.guest_mac, None, None),)


def test_descriptions_are_readable() -> None:
    s = spec()
    assert SetNeighbour(s.guest_ip, s.guest_mac, "5e:00:00:00:00:09", NUD_REACHABLE).describe() == (
        "neighbour 172.16.0.2 lladdr 06:00:ac:10:00:02 PERMANENT (was 5e:00:00:00:00:09 REACHABLE)")
    assert nud_name(0) == "NONE" and nud_name(NUD_STALE | NUD_PERMANENT) == "STALE|PERMANENT"


# ---------------------------------------------------------------- CLI input errors (no devices touched)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [(["--name", "a" * 16, "--stable-id", "x"], "name_too_long"),
     (["--name", "tap0", "--tap-mac", "01:00:5e:00:00:01", "--stable-id", "x"], "mac_multicast"),
     (["--name", "tap0"], "mac_missing")],
)
def test_cli_input_errors_exit_2(argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sbxnet.app.cli import main

    rc = main(["tap", "ensure", "--host-addr", "172.16.0.1/30", "--guest-ip", "172.16.0.2", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"sbxnet tap ensure: {reason}: " in err and "fix:" in err
