"""What a VM tap must look like: validated values, pure logic, no devices.

``TapSpec`` is validated when it is built, so an invalid spec never reaches the kernel. What to change
to get an existing device there is ``forwarder.taps.plan``.

Why the settings exist (numbers in docs/taps.md): the tap's MAC is fixed so a guest restored from a
snapshot, whose ARP cache still holds the tap's MAC, keeps reaching the host; the guest's neighbour
entry on the tap is PERMANENT so the host's first packet to a guest still booting never waits on ARP.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface

from forwarder.taps.errors import (
    InvalidMacError,
    InvalidTapNameError,
    TapSpecError,
)

IFNAMSIZ = 16  # includes the trailing NUL: names are at most 15 bytes
MAX_NAME_BYTES = IFNAMSIZ - 1
MIN_MTU = 68  # IPv4 minimum (RFC 791)
MAX_MTU = 65535  # tun's max_mtu
MAX_ID = 0xFFFFFFFE  # uid/gid (u32, -1 means "none")

# Neighbour (NUD_*) states from include/uapi/linux/neighbour.h.
NUD_INCOMPLETE = 0x01
NUD_REACHABLE = 0x02
NUD_STALE = 0x04
NUD_DELAY = 0x08
NUD_PROBE = 0x10
NUD_FAILED = 0x20
NUD_NOARP = 0x40
NUD_PERMANENT = 0x80
_NUD_NAMES = {
    NUD_INCOMPLETE: "INCOMPLETE",
    NUD_REACHABLE: "REACHABLE",
    NUD_STALE: "STALE",
    NUD_DELAY: "DELAY",
    NUD_PROBE: "PROBE",
    NUD_FAILED: "FAILED",
    NUD_NOARP: "NOARP",
    NUD_PERMANENT: "PERMANENT",
}

TUN_TYPE_TUN = 1  # IFF_TUN: layer 3, no Ethernet header
TUN_TYPE_TAP = 2  # IFF_TAP: Ethernet frames

_MAC_DERIVATION_DOMAIN = b"sbxnet/tap-mac/v1"
MAC_ROLES = ("tap", "guest")


def nud_name(state: int) -> str:
    """Name a NUD state bitmask the way ``ip neigh`` prints it (``0`` is ``NONE``)."""
    names = [name for bit, name in _NUD_NAMES.items() if state & bit]
    return "|".join(names) if names else "NONE"


# ---------------------------------------------------------------- validation of single values


def validate_name(name: str) -> str:
    """Return ``name`` if Linux accepts it as a fixed interface name, else raise InvalidTapNameError.

    Linux (``dev_valid_name``) allows at most 15 bytes and no ``/``, ``:`` or whitespace, and refuses
    ``.`` and ``..``; ``%`` is refused too because the kernel treats it as a template ("tap%d") and would
    pick a different name than the one the VMM is told to open.
    """
    if not isinstance(name, str) or not name:
        raise InvalidTapNameError("name_invalid", "the tap name is empty", "give --name, e.g. tap0")
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidTapNameError(
            "name_too_long",
            f"tap name {name!r} is {len(encoded)} bytes; Linux interface names are at most "
            f"{MAX_NAME_BYTES} bytes (IFNAMSIZ {IFNAMSIZ} with the NUL)",
            f"choose a name of at most {MAX_NAME_BYTES} bytes, e.g. {name[:MAX_NAME_BYTES - 3]!r} plus a "
            "short index",
        )
    bad = sorted({c for c in name if c in "/:%" or c.isspace() or not c.isprintable() or not c.isascii()})
    if name in (".", "..") or bad:
        shown = ", ".join(repr(c) for c in bad) if bad else repr(name)
        raise InvalidTapNameError(
            "name_invalid",
            f"tap name {name!r} is not a valid interface name (refused: {shown})",
            "use printable ASCII without '/', ':', '%' or spaces, e.g. tap0 or vm-12",
        )
    return name


def parse_mac(text: str, what: str = "MAC") -> str:
    """Parse ``aa:bb:cc:dd:ee:ff`` (or ``-`` separators, any case) into lowercase colon form.

    Refused with InvalidMacError: anything else (``mac_invalid``), the all-zero address (``mac_zero``) and
    any address with the group bit set, broadcast included (``mac_multicast``): a tap or guest NIC needs
    a unicast station address, and a multicast one would make every frame to it a group frame.
    """
    raw = text.strip().replace("-", ":") if isinstance(text, str) else ""
    parts = raw.split(":")
    hexdigits = "0123456789abcdefABCDEF"
    if len(parts) != 6 or not all(len(p) == 2 and all(c in hexdigits for c in p) for p in parts):
        raise InvalidMacError(
            "mac_invalid",
            f"{what} {text!r} is not a MAC address",
            "write six hex octets separated by ':', e.g. 02:00:00:00:00:01",
        )
    octets = bytes(int(p, 16) for p in parts)
    mac = ":".join(f"{b:02x}" for b in octets)
    if octets == bytes(6):
        raise InvalidMacError(
            "mac_zero",
            f"{what} {mac} is the all-zero address, which no station may use",
            "use a locally administered unicast MAC (first octet 02, 06, 0a, ...), or derive one with "
            "derive_mac()/--stable-id",
        )
    if octets[0] & 0x01:
        raise InvalidMacError(
            "mac_multicast",
            f"{what} {mac} is a multicast address (the low bit of the first octet, 0x{octets[0]:02x}, is "
            "set)" + (" - it is the broadcast address" if octets == b"\xff" * 6 else ""),
            f"clear that bit (e.g. {octets[0] & 0xFE | 0x02:02x}:{mac[3:]}) or derive one with "
            "derive_mac()/--stable-id",
        )
    return mac


def derive_mac(stable_id: str, role: str = "tap") -> str:
    """Deterministic locally administered unicast MAC for ``role`` ("tap" or "guest") of ``stable_id``.

    The first six bytes of SHA-256("sbxnet/tap-mac/v1" NUL role NUL stable_id), with the first octet's
    group bit cleared (unicast) and its local bit set (locally administered: never collides with a
    vendor's burned-in address). Same input, same MAC, on every host and every release: that is the
    point. ``stable_id`` must be what a snapshot carries across restore (the snapshot/template lineage,
    or a platform-wide constant), not something that changes per restore such as a VM instance id,
    because the restored guest's ARP cache and NIC config come from the snapshot.
    """
    if not isinstance(stable_id, str) or not stable_id:
        raise TapSpecError("stable_id_invalid", "the stable id to derive a MAC from is empty",
                           "pass the snapshot lineage id (or a platform constant) as --stable-id")
    if role not in MAC_ROLES:
        raise TapSpecError("mac_role_invalid", f"MAC role {role!r} is not one of {MAC_ROLES}",
                           "use role 'tap' or 'guest'")
    material = _MAC_DERIVATION_DOMAIN + b"\0" + role.encode() + b"\0" + stable_id.encode()
    digest = hashlib.sha256(material).digest()
    octets = bytes([(digest[0] & 0xFC) | 0x02]) + digest[1:6]
    return ":".join(f"{b:02x}" for b in octets)


def validate_netns_name(netns: str) -> str:
    """Return ``netns`` if it can name an entry of /run/netns, else raise TapSpecError."""
    if not isinstance(netns, str) or not netns or netns in (".", "..") or "/" in netns or "\0" in netns \
            or len(netns.encode()) > 255:
        raise TapSpecError(
            "netns_name_invalid",
            f"network namespace name {netns!r} cannot name an entry of /run/netns",
            "give the name as `ip netns list` prints it (no '/'), or omit --netns for the host namespace",
        )
    return netns


def _validate_id(value: int | None, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        raise TapSpecError("owner_invalid", f"{what} {value!r} is not a uid/gid (0..{MAX_ID})",
                           f"give a numeric {what} or leave it unset")
    return value


# ---------------------------------------------------------------- the spec


@dataclass(frozen=True)
class TapRef:
    """Enough to find a tap and judge whether it is ours: name, namespace, owner."""

    name: str
    netns: str | None = None
    owner_uid: int | None = None
    owner_gid: int | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.netns is not None:
            validate_netns_name(self.netns)
        _validate_id(self.owner_uid, "owner uid")
        _validate_id(self.owner_gid, "group gid")

    @property
    def where(self) -> str:
        return f"netns {self.netns}" if self.netns else "the host namespace"


@dataclass(frozen=True)
class TapSpec:
    """A VM tap as it must be: validated on construction (raises a TapSpecError subclass).

    ``host_addr`` is the tap's own address with the prefix (the guest's gateway); ``guest_ip`` must be
    on that prefix (so the kernel's connected route sends it out of the tap) and differ from the host
    address. MACs are normalised to lowercase colon form. ``owner_uid``/``owner_gid`` are the tap's
    TUNSETOWNER/TUNSETGROUP: the unprivileged user a jailed VMM runs as. ``mtu`` None keeps the
    kernel's value.
    """

    name: str
    tap_mac: str
    host_addr: IPv4Interface
    guest_ip: IPv4Address
    guest_mac: str
    netns: str | None = None
    owner_uid: int | None = None
    owner_gid: int | None = None
    mtu: int | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)
        object.__setattr__(self, "tap_mac", parse_mac(self.tap_mac, "tap MAC"))
        object.__setattr__(self, "guest_mac", parse_mac(self.guest_mac, "guest MAC"))
        if self.tap_mac == self.guest_mac:
            raise InvalidMacError(
                "mac_duplicate",
                f"tap MAC and guest MAC are both {self.tap_mac}; they share one Ethernet segment",
                "give the guest a different MAC (derive_mac(id, 'guest') differs from the tap's)",
            )
        if self.netns is not None:
            validate_netns_name(self.netns)
        _validate_id(self.owner_uid, "owner uid")
        _validate_id(self.owner_gid, "group gid")
        if not isinstance(self.host_addr, IPv4Interface) or not isinstance(self.guest_ip, IPv4Address):
            raise TapSpecError("address_invalid", "host_addr must be an IPv4Interface and guest_ip an "
                               "IPv4Address", "use TapSpec.parse() to build a spec from strings")
        _validate_addresses(self.host_addr, self.guest_ip)
        if self.mtu is not None and (isinstance(self.mtu, bool) or not isinstance(self.mtu, int)
                                     or not MIN_MTU <= self.mtu <= MAX_MTU):
            raise TapSpecError("mtu_out_of_range", f"mtu {self.mtu!r} is outside {MIN_MTU}..{MAX_MTU}",
                               f"give an MTU between {MIN_MTU} and {MAX_MTU} (1500 for Ethernet)")

    @classmethod
    def parse(
        cls,
        *,
        name: str,
        tap_mac: str,
        host_addr: str,
        guest_ip: str,
        guest_mac: str,
        netns: str | None = None,
        owner_uid: int | None = None,
        owner_gid: int | None = None,
        mtu: int | None = None,
    ) -> TapSpec:
        """Build a spec from strings (``host_addr`` as ``a.b.c.d/len``); raises TapSpecError on bad input."""
        try:
            iface = IPv4Interface(host_addr.strip())
        except (ValueError, AttributeError):
            raise TapSpecError("address_invalid", f"host address {host_addr!r} is not IPv4 address/prefix",
                               "write it like 172.16.0.1/30") from None
        if "/" not in host_addr:
            raise TapSpecError("address_invalid", f"host address {host_addr!r} has no prefix length",
                               "write it like 172.16.0.1/30 (the prefix makes the guest on-link)")
        try:
            gip = IPv4Address(guest_ip.strip())
        except (ValueError, AttributeError):
            raise TapSpecError("address_invalid", f"guest address {guest_ip!r} is not an IPv4 address",
                               "write it like 172.16.0.2") from None
        return cls(name=name, tap_mac=tap_mac, host_addr=iface, guest_ip=gip, guest_mac=guest_mac,
                   netns=netns, owner_uid=owner_uid, owner_gid=owner_gid, mtu=mtu)

    @property
    def ref(self) -> TapRef:
        return TapRef(self.name, self.netns, self.owner_uid, self.owner_gid)


def _validate_addresses(host: IPv4Interface, guest: IPv4Address) -> None:
    net = host.network
    if host.ip == guest:
        raise TapSpecError("guest_is_host", f"guest address {guest} equals the tap's own address",
                           "give the guest another address on the tap's prefix")
    if net.prefixlen > 31 or guest not in net:
        raise TapSpecError(
            "guest_not_on_link",
            f"guest {guest} is not on the tap's prefix {net}, so no connected route leads to it",
            f"put the guest inside {host.ip}/{min(net.prefixlen, 30)} (e.g. a /30: host .1, guest .2)",
        )
    if net.prefixlen <= 30:
        for addr, who in ((host.ip, "host"), (guest, "guest")):
            if addr in (net.network_address, net.broadcast_address):
                raise TapSpecError(
                    "address_invalid",
                    f"{who} address {addr} is the network or broadcast address of {net}",
                    f"use addresses strictly inside {net}",
                )
