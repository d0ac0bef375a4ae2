"""VM taps with a fixed MAC and a permanent neighbour entry for the guest: the Python API.

``ensure_tap(spec)`` creates or adopts a persistent TAP device (in the host namespace or a named,
possibly pooled, namespace), gives it the spec's fixed MAC, MTU and address, brings it up and pins the
guest's neighbour entry (NUD_PERMANENT, the guest's fixed MAC). It is idempotent: on a tap that already
matches it changes nothing and reports no change; anything wrong (MAC, address, a stale or dynamic
neighbour entry) is corrected and reported. ``remove_tap`` undoes it. Why each setting exists, with
the measured numbers, is in docs/taps.md.

Everything goes through netlink (pyroute2) except creation: Linux refuses to create TUN/TAP devices
over rtnetlink, so the device is made with the TUNSETIFF/TUNSETPERSIST ioctls on /dev/net/tun, opened
inside the target namespace. The decisions (is this device ours? what must change?) are pure
functions in ``forwarder.taps.spec``; this module only observes and applies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface
from typing import Any

from forwarder.taps.errors import (
    InvalidMacError,
    InvalidTapNameError,
    NetnsNotFoundError,
    NotATapError,
    TapError,
    TapInUseError,
    TapNetlinkError,
    TapNotPersistentError,
    TapOwnerMismatchError,
    TapSpecError,
)
from forwarder.taps.netns import call_in_netns, check_netns
from forwarder.taps.plan import (
    AddAddr,
    Change,
    Created,
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
from forwarder.taps.spec import NUD_PERMANENT, TapRef, TapSpec, derive_mac, nud_name, parse_mac

__all__ = [
    "NUD_PERMANENT",
    "InvalidMacError",
    "InvalidTapNameError",
    "NetnsNotFoundError",
    "NotATapError",
    "ObservedTap",
    "RemoveResult",
    "TapError",
    "TapInUseError",
    "TapNetlinkError",
    "TapNotPersistentError",
    "TapOwnerMismatchError",
    "TapRef",
    "TapResult",
    "TapSpec",
    "TapSpecError",
    "derive_mac",
    "ensure_tap",
    "observe_tap",
    "open_tap_queue",
    "parse_mac",
    "remove_tap",
]

# include/uapi/linux/if_tun.h (x86_64/arm64 ioctl encoding)
TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNSETOWNER = 0x400454CC
TUNSETGROUP = 0x400454CE
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_TUN_EXCL = 0x8000  # fail with EBUSY instead of attaching when the name already exists
IFF_UP = 0x1
_MAX_ROUNDS = 3  # a plan converges in at most two rounds (see plan.first_round); the third is slack


@dataclass(frozen=True)
class TapResult:
    """What ``ensure_tap`` found and did. ``changes`` is empty when the tap already matched."""

    name: str
    netns: str | None
    ifindex: int
    mac: str
    created: bool
    changes: tuple[Change, ...]

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def lines(self) -> list[str]:
        where = f"netns {self.netns}" if self.netns else "host namespace"
        head = f"tap {self.name} ({where}, ifindex {self.ifindex}, mac {self.mac}):"
        if not self.changes:
            return [f"{head} unchanged"]
        return [f"{head} {len(self.changes)} change(s)"] + [f"  {c.describe()}" for c in self.changes]


@dataclass(frozen=True)
class RemoveResult:
    """What ``remove_tap`` did: ``removed`` False means there was no such interface."""

    name: str
    netns: str | None
    removed: bool

    def lines(self) -> list[str]:
        where = f"netns {self.netns}" if self.netns else "host namespace"
        return [f"tap {self.name} ({where}): " + ("removed" if self.removed else "absent, nothing to do")]


# ---------------------------------------------------------------- netlink session


@contextmanager
def _rtnl(netns: str | None) -> Iterator[Any]:
    # flags=0: pyroute2 would otherwise *create* a missing namespace; we refuse it instead.
    from pyroute2 import IPRoute

    if netns is not None:
        check_netns(netns)
    try:
        ipr = IPRoute(netns=netns, flags=0) if netns is not None else IPRoute()
    except OSError as e:
        raise _netlink_error("open a netlink socket", netns, e) from e
    try:
        yield ipr
    finally:
        ipr.close()


def _netlink_error(what: str, netns: str | None, e: BaseException) -> TapNetlinkError:
    code = getattr(e, "code", None) or getattr(e, "errno", None)
    name = errno.errorcode.get(code, str(code)) if isinstance(code, int) else type(e).__name__
    where = f"netns {netns}" if netns else "the host namespace"
    return TapNetlinkError(
        "netlink",
        f"the kernel refused ({what}) in {where}: {name} ({e})",
        "run as root (CAP_NET_ADMIN in that namespace) and check the request; dmesg may say more",
    )


def _call(netns: str | None, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        return fn(*args, **kwargs)
    except (NetlinkError, OSError) as e:
        raise _netlink_error(what, netns, e) from e


def _observe(ipr: Any, ref: TapRef) -> ObservedTap | None:
    found = _call(ref.netns, f"look up {ref.name}", ipr.link_lookup, ifname=ref.name)
    if not found:
        return None
    ifindex = int(found[0])
    links = _call(ref.netns, f"read link {ref.name}", ipr.get_links, ifindex)
    link = links[0]
    info = link.get_attr("IFLA_LINKINFO")
    kind = info.get_attr("IFLA_INFO_KIND") if info is not None else None
    data = info.get_attr("IFLA_INFO_DATA") if info is not None and kind == "tun" else None

    def tun(attr: str) -> Any:
        return data.get_attr(attr) if data is not None else None

    addrs = _call(ref.netns, f"read addresses of {ref.name}", ipr.get_addr, family=socket.AF_INET,
                  index=ifindex)
    ipv4 = tuple(
        IPv4Interface(f"{a.get_attr('IFA_LOCAL') or a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}")
        for a in addrs
        if a["index"] == ifindex
    )
    neighs = _call(ref.netns, f"read neighbours of {ref.name}", ipr.get_neighbours, family=socket.AF_INET,
                   ifindex=ifindex)
    neighbours = tuple(
        ObservedNeighbour(IPv4Address(n.get_attr("NDA_DST")), n.get_attr("NDA_LLADDR"), int(n["state"]))
        for n in neighs
        if n["ifindex"] == ifindex and n.get_attr("NDA_DST")
    )
    num_queues = tun("IFLA_TUN_NUM_QUEUES")
    return ObservedTap(
        ifindex=ifindex,
        kind=kind,
        tun_type=tun("IFLA_TUN_TYPE"),
        persistent=bool(tun("IFLA_TUN_PERSIST")),
        owner_uid=tun("IFLA_TUN_OWNER"),
        owner_gid=tun("IFLA_TUN_GROUP"),
        carrier=bool(link.get_attr("IFLA_CARRIER")),
        num_queues=int(num_queues) if num_queues is not None else None,
        master=link.get_attr("IFLA_MASTER"),
        mac=str(link.get_attr("IFLA_ADDRESS") or "").lower(),
        mtu=int(link.get_attr("IFLA_MTU") or 0),
        up=bool(link["flags"] & IFF_UP),
        ipv4=ipv4,
        neighbours=neighbours,
    )


def observe_tap(ref: TapRef | TapSpec) -> ObservedTap | None:
    """The interface named ``ref.name`` in ``ref.netns`` as netlink reports it, or None if absent."""
    r = ref.ref if isinstance(ref, TapSpec) else ref
    with _rtnl(r.netns) as ipr:
        return _observe(ipr, r)


# ---------------------------------------------------------------- creation (ioctl: rtnetlink cannot)


def _ifreq(name: str, flags: int) -> bytes:
    return struct.pack("16sH22x", name.encode(), flags)


def open_tap_queue(name: str, netns: str | None = None, *, nonblocking: bool = True) -> int:
    """Attach to existing tap ``name`` as a VMM does (TUNSETIFF IFF_TAP|IFF_NO_PI); return the fd.

    While the descriptor is open the tap has carrier and frames the kernel sends out of it can be read
    from it (one Ethernet frame per read). The caller closes it. Used by tests and diagnostics.
    """

    def op() -> int:
        return os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC | (os.O_NONBLOCK if nonblocking else 0))

    fd = call_in_netns(netns, op)
    try:
        fcntl.ioctl(fd, TUNSETIFF, _ifreq(name, IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _create_tap(ref: TapRef) -> bool:
    """Create persistent tap ``ref`` exclusively; False if a device of that name appeared meanwhile."""
    try:
        fd = call_in_netns(ref.netns, lambda: os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC))
    except OSError as e:
        raise TapNetlinkError(
            "tun_unavailable",
            f"cannot open {TUN_DEVICE}: {os.strerror(e.errno or 0)}",
            "load the tun module (modprobe tun) and run as root (CAP_NET_ADMIN)",
        ) from e
    try:
        try:
            fcntl.ioctl(fd, TUNSETIFF, _ifreq(ref.name, IFF_TAP | IFF_NO_PI | IFF_TUN_EXCL))
        except OSError as e:
            if e.errno == errno.EBUSY:
                return False
            raise _netlink_error(f"create tap {ref.name}", ref.netns, e) from e
        try:
            if ref.owner_uid is not None:
                fcntl.ioctl(fd, TUNSETOWNER, ref.owner_uid)
            if ref.owner_gid is not None:
                fcntl.ioctl(fd, TUNSETGROUP, ref.owner_gid)
            fcntl.ioctl(fd, TUNSETPERSIST, 1)
        except OSError as e:
            # Not persistent yet, so closing the descriptor below destroys the half-made device.
            raise _netlink_error(f"set owner/persist on tap {ref.name}", ref.netns, e) from e
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------- ensure / remove


def _apply(ipr: Any, netns: str | None, ifindex: int, action: Any) -> None:
    if isinstance(action, SetMac):
        _call(netns, action.describe(), ipr.link, "set", index=ifindex, address=action.new)
    elif isinstance(action, SetMtu):
        _call(netns, action.describe(), ipr.link, "set", index=ifindex, mtu=action.new)
    elif isinstance(action, SetUp):
        _call(netns, action.describe(), ipr.link, "set", index=ifindex, state="up")
    elif isinstance(action, (DelAddr, AddAddr)):
        cmd = "del" if isinstance(action, DelAddr) else "add"
        _call(netns, action.describe(), ipr.addr, cmd, index=ifindex, address=str(action.iface.ip),
              prefixlen=action.iface.network.prefixlen)
    elif isinstance(action, DelNeighbour):
        try:
            _call(netns, action.describe(), ipr.neigh, "del", dst=str(action.ip), ifindex=ifindex)
        except TapNetlinkError as e:
            if e.__cause__ is None or getattr(e.__cause__, "code", None) != errno.ENOENT:
                raise  # ENOENT: already gone (flushed meanwhile), which is what we wanted
    elif isinstance(action, SetNeighbour):
        # "replace" = NLM_F_CREATE|NLM_F_REPLACE: overrides a dynamic (REACHABLE/STALE/INCOMPLETE) entry
        # or a wrong lladdr in one message.
        _call(netns, action.describe(), ipr.neigh, "replace", dst=str(action.ip), lladdr=action.mac,
              ifindex=ifindex, state=NUD_PERMANENT)
    else:  # pragma: no cover - plan_tap returns only the types above
        raise TypeError(f"unknown tap action {action!r}")


def ensure_tap(spec: TapSpec, *, allow_attached: bool = False) -> TapResult:
    """Make tap ``spec.name`` in ``spec.netns`` match ``spec``; return what changed.

    Creates the tap (persistent, TUNSETOWNER/TUNSETGROUP from the spec) if absent, or adopts an
    existing one that ``check_adoptable`` accepts; then applies ``plan_tap``'s changes and re-reads the
    device to confirm nothing is left to do. A second call on a matching tap sends no change to the
    kernel and returns ``changes == ()``.

    Raises NetnsNotFoundError, NotATapError, TapNotPersistentError, TapOwnerMismatchError,
    TapInUseError (attached: pass ``allow_attached=True`` only if the attached process is this VM's own
    VMM), or TapNetlinkError; each names the fix. Spec errors were raised when the spec was built.
    """
    ref = spec.ref
    with _rtnl(spec.netns) as ipr:
        obs = _observe(ipr, ref)
        created = False
        if obs is None:
            created = _create_tap(ref)
            obs = _observe(ipr, ref)
            if obs is None:
                raise TapNetlinkError("tap_vanished", f"tap {ref.name} in {ref.where} vanished right after "
                                      "creation", "check for another agent deleting taps concurrently")
        check_adoptable(ref, obs, allow_attached=allow_attached)
        done: list[Change] = [Created(ref.name, ref.where)] if created else []
        after: ObservedTap | None = obs
        for _ in range(_MAX_ROUNDS):
            assert after is not None
            actions = first_round(plan_tap(spec, after))
            if not actions:
                break
            for action in actions:
                _apply(ipr, spec.netns, after.ifindex, action)
            done.extend(actions)
            after = _observe(ipr, ref)
            if after is None:
                break
        left = plan_tap(spec, after) if after is not None else ()
        if after is None or left:
            raise TapNetlinkError(
                "tap_not_converged",
                f"tap {ref.name} in {ref.where} still differs after applying changes: "
                + ("it vanished" if after is None else "; ".join(a.describe() for a in left)),
                "check for another agent changing the same tap concurrently",
            )
    return TapResult(spec.name, spec.netns, after.ifindex, after.mac, created, tuple(done))


def remove_tap(target: TapSpec | TapRef, *, allow_attached: bool = False) -> RemoveResult:
    """Delete the tap (its address and neighbour entries go with it); absent is not an error.

    Refuses, like ``ensure_tap``, an interface that is not a tap, a non-persistent tap, a tap of
    another owner and an attached tap (unless ``allow_attached``), so it never deletes a device that
    belongs to someone else.
    """
    ref = target.ref if isinstance(target, TapSpec) else target
    with _rtnl(ref.netns) as ipr:
        obs = _observe(ipr, ref)
        if obs is None:
            return RemoveResult(ref.name, ref.netns, removed=False)
        check_adoptable(ref, obs, allow_attached=allow_attached)
        _call(ref.netns, f"delete tap {ref.name}", ipr.link, "del", index=obs.ifindex)
    return RemoveResult(ref.name, ref.netns, removed=True)


def describe_neighbour(n: ObservedNeighbour) -> str:
    """``ip neigh``-style one-line description (used in messages and tests)."""
    return f"{n.ip} lladdr {n.mac} {nud_name(n.state)}"

