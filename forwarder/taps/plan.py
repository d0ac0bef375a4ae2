"""What to change to turn an existing tap into its spec, and whether it is ours to change: pure logic.

``plan_tap`` compares a ``TapSpec`` with an observed tap (``ObservedTap``, filled in by
``forwarder.taps.netlink`` from netlink) and returns the ordered changes to apply; ``check_adoptable``
refuses a device that is not ours to change. Both are plain functions over values, tested without root
or devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Interface

from forwarder.taps.errors import NotATapError, TapInUseError, TapNotPersistentError, TapOwnerMismatchError
from forwarder.taps.spec import NUD_PERMANENT, TUN_TYPE_TAP, TapRef, TapSpec, nud_name

# ---------------------------------------------------------------- what is there


@dataclass(frozen=True)
class ObservedNeighbour:
    ip: IPv4Address
    mac: str | None
    state: int


@dataclass(frozen=True)
class ObservedTap:
    """An existing interface of the tap's name, as netlink reports it."""

    ifindex: int
    kind: str | None  # IFLA_INFO_KIND: "tun" for TUN/TAP devices
    tun_type: int | None  # IFLA_TUN_TYPE: TUN_TYPE_TUN or TUN_TYPE_TAP
    persistent: bool
    owner_uid: int | None
    owner_gid: int | None
    carrier: bool  # a tun/tap has carrier exactly while a process holds a queue
    num_queues: int | None  # only reported for multi-queue devices
    master: int | None
    mac: str
    mtu: int
    up: bool
    ipv4: tuple[IPv4Interface, ...] = ()
    neighbours: tuple[ObservedNeighbour, ...] = field(default=())

    @property
    def attached(self) -> bool:
        return self.carrier or bool(self.num_queues)


def check_adoptable(ref: TapRef, obs: ObservedTap, *, allow_attached: bool = False) -> None:
    """Raise unless ``obs`` is a device this spec may change (adopt) or delete.

    Refused, in this order: not a TAP device; a non-persistent tap (the process holding its descriptor
    owns it and it vanishes when that process exits); a persistent tap of another owner uid/gid; a tap
    enslaved to a bridge/bond; a tap a process has attached (a running VMM), unless ``allow_attached``
    says that process is this VM's own VMM.
    """
    if obs.kind != "tun":
        kind = f"a {obs.kind} link" if obs.kind else "a plain (non-tun) interface"
        raise NotATapError(
            "not_a_tap",
            f"interface {ref.name} in {ref.where} exists and is {kind}, not a tap",
            "choose another --name, or delete that interface if it is a leftover (ip link del "
            f"{ref.name})",
        )
    if obs.tun_type != TUN_TYPE_TAP:
        raise NotATapError(
            "not_a_tap",
            f"interface {ref.name} in {ref.where} is a TUN (layer-3, no Ethernet) device, not a TAP",
            f"choose another --name, or delete it (ip tuntap del {ref.name} mode tun) if it is a leftover",
        )
    if not obs.persistent:
        raise TapNotPersistentError(
            "tap_not_persistent",
            f"tap {ref.name} in {ref.where} is not persistent: it belongs to the process holding its "
            "descriptor (find it with: grep -l 'iff:[[:space:]]*" + ref.name + "$' /proc/*/fdinfo/*) and "
            "disappears when that process closes it",
            "stop that process or choose another --name; taps set up here are persistent",
        )
    if obs.owner_uid != ref.owner_uid or obs.owner_gid != ref.owner_gid:
        raise TapOwnerMismatchError(
            "tap_owner_mismatch",
            f"tap {ref.name} in {ref.where} is owned by uid {_show_id(obs.owner_uid)} gid "
            f"{_show_id(obs.owner_gid)}, the spec asks for uid {_show_id(ref.owner_uid)} gid "
            f"{_show_id(ref.owner_gid)}",
            "if that user's VMM is meant to use it, pass the same --owner/--group; otherwise it belongs "
            "to someone else: choose another --name, or remove it on purpose with `sbxnet tap remove` "
            "giving its --owner/--group",
        )
    if obs.master is not None:
        raise TapInUseError(
            "tap_enslaved",
            f"tap {ref.name} in {ref.where} is enslaved to interface index {obs.master} (a bridge or bond)",
            "release it from the bridge (ip link set dev NAME nomaster) or choose another --name: a "
            "routed VM tap carries its own address and neighbour entry",
        )
    if obs.attached and not allow_attached:
        raise TapInUseError(
            "tap_attached",
            f"tap {ref.name} in {ref.where} is attached to a running process (carrier on: a VMM holds "
            "its queue)",
            "stop the VMM using it first, or pass --allow-attached (allow_attached=True) if that process "
            "is this VM's own VMM",
        )


def _show_id(v: int | None) -> str:
    return "none" if v is None else str(v)


# ---------------------------------------------------------------- what to change


@dataclass(frozen=True)
class Created:
    op = "create"
    name: str
    where: str

    def describe(self) -> str:
        return f"created persistent tap {self.name} in {self.where}"


@dataclass(frozen=True)
class SetMac:
    op = "mac"
    old: str
    new: str

    def describe(self) -> str:
        return f"tap MAC {self.old} -> {self.new}"


@dataclass(frozen=True)
class SetMtu:
    op = "mtu"
    old: int
    new: int

    def describe(self) -> str:
        return f"mtu {self.old} -> {self.new}"


@dataclass(frozen=True)
class SetUp:
    op = "up"

    def describe(self) -> str:
        return "link set up"


@dataclass(frozen=True)
class DelAddr:
    op = "addr_del"
    iface: IPv4Interface

    def describe(self) -> str:
        return f"removed address {self.iface}"


@dataclass(frozen=True)
class AddAddr:
    op = "addr_add"
    iface: IPv4Interface

    def describe(self) -> str:
        return f"added address {self.iface}"


@dataclass(frozen=True)
class DelNeighbour:
    op = "neigh_del"
    ip: IPv4Address
    mac: str | None
    state: int

    def describe(self) -> str:
        return f"removed stale pinned neighbour {self.ip} lladdr {self.mac} {nud_name(self.state)}"


@dataclass(frozen=True)
class SetNeighbour:
    op = "neigh_set"
    ip: IPv4Address
    mac: str
    old_mac: str | None
    old_state: int | None

    def describe(self) -> str:
        was = "absent" if self.old_state is None else f"{self.old_mac} {nud_name(self.old_state)}"
        return f"neighbour {self.ip} lladdr {self.mac} PERMANENT (was {was})"


Action = SetMac | SetMtu | SetUp | DelAddr | AddAddr | DelNeighbour | SetNeighbour
Change = Created | Action


def plan_tap(spec: TapSpec, obs: ObservedTap) -> tuple[Action, ...]:
    """The ordered changes that turn ``obs`` into ``spec``; empty when it already matches.

    Order matters: MAC and MTU first, then the link up, then addresses (wrong ones removed before the
    right one is added, so a wrong prefix on the right address is replaced), then neighbours. Other
    IPv4 addresses on the tap and PERMANENT neighbour entries for other addresses are removed: the tap
    belongs to one guest, and pins left by a previous guest of a pooled namespace are wrong.
    Dynamic (kernel-managed) neighbour entries for other addresses are left alone.
    """
    actions: list[Action] = []
    if obs.mac != spec.tap_mac:
        actions.append(SetMac(obs.mac, spec.tap_mac))
    if spec.mtu is not None and obs.mtu != spec.mtu:
        actions.append(SetMtu(obs.mtu, spec.mtu))
    if not obs.up:
        actions.append(SetUp())
    actions.extend(DelAddr(a) for a in obs.ipv4 if a != spec.host_addr)
    if spec.host_addr not in obs.ipv4:
        actions.append(AddAddr(spec.host_addr))
    current = None
    for n in obs.neighbours:
        if n.ip == spec.guest_ip:
            current = n
        elif n.state & NUD_PERMANENT:
            actions.append(DelNeighbour(n.ip, n.mac, n.state))
    if current is None or current.state != NUD_PERMANENT or current.mac != spec.guest_mac:
        actions.append(SetNeighbour(spec.guest_ip, spec.guest_mac,
                                    current.mac if current else None, current.state if current else None))
    return tuple(actions)


def first_round(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    """The part of a plan to apply before observing the tap again: link and address changes first,
    neighbour changes only in a round of their own.

    Link and address changes can flush the tap's neighbour table, PERMANENT entries included: a MAC
    change (NETDEV_CHANGEADDR -> neigh_changeaddr) and removing the last IPv4 address
    (fib_disable_ip -> arp_ifdown) both do. Neighbour changes planned before them would be undone, so
    they are planned again from a fresh observation once the link and addresses are right.
    """
    link = tuple(a for a in actions if not isinstance(a, (DelNeighbour, SetNeighbour)))
    return link or actions

