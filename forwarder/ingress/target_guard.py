"""Judging the preamble's destination: the forwarder is never an open relay.

Pure: an address, a port and a policy in; None or ``TargetRefused`` out. The host's own addresses are
passed in (see ``forwarder.ingress.host_addrs``), so nothing here touches the network.

Rules, in the order they are applied (the first that matches names the reason):

    bad_port          port outside 1..65535
    (IPv4-mapped IPv6 ``::ffff:a.b.c.d`` is judged as ``a.b.c.d`` from here on: a v6 socket
     connecting to it reaches the IPv4 host)
    unspecified       0.0.0.0/8 ("this network", which Linux routes to the host itself), ::
    loopback          127.0.0.0/8, ::1
    link_local        169.254.0.0/16 (cloud metadata 169.254.169.254 included), fe80::/10
    multicast         224.0.0.0/4, ff00::/8
    broadcast         255.255.255.255
    reserved          240.0.0.0/4, the IETF-reserved IPv6 blocks (``::/8`` with the deprecated
                      IPv4-compatible form and NAT64 64:ff9b::/96, ...), deprecated site-local
                      fec0::/10, and the IPv4 tunnel forms 6to4 2002::/16 and Teredo 2001::/32
    host_address      any address configured on this host (``TargetPolicy.host_addresses``)
    outside_prefixes  not inside any of ``TargetPolicy.prefixes``

Every class above except ``bad_port`` and ``outside_prefixes`` is waived for an address inside one of
``TargetPolicy.allow`` (e.g. the demo allows 127.0.0.1/32). ``allow`` is an exception to the always-
refused classes only: an allowed address must still fall inside a prefix.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from sbxnet.errors import RemoteProtocolError
from sbxnet.protocol.codes import Status

IPNet = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
_SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")
# Transition forms that tunnel to an embedded IPv4 address (6to4, Teredo): a way around the IPv4 rules.
_V4_TUNNELS = (ipaddress.IPv6Network("2002::/16"), ipaddress.IPv6Network("2001::/32"))


@dataclass(frozen=True)
class TargetPolicy:
    """Where the forwarder may connect.

    ``prefixes``: the sandbox prefixes; a target must fall inside one. ``allow``: explicit exceptions to
    the always-refused classes (loopback, link-local, ...). ``host_addresses``: this host's own
    addresses, refused unless allowed.
    """

    prefixes: tuple[IPNet, ...]
    allow: tuple[IPNet, ...] = ()
    host_addresses: frozenset[IPAddress] = frozenset()

    def __post_init__(self) -> None:
        # Canonicalised once here rather than per connection in judge_target.
        object.__setattr__(self, "host_addresses", frozenset(canonical(h) for h in self.host_addresses))


class TargetRefused(RemoteProtocolError):
    """The preamble asks for a destination the forwarder will not connect to; see the module docstring
    for the reason tokens."""

    status_hint = Status.FORBIDDEN


def canonical(addr: IPAddress) -> IPAddress:
    """The address a connect would actually reach: IPv4-mapped IPv6 becomes its IPv4 address, and an
    IPv6 zone (scope) is dropped, since the preamble cannot carry one."""
    if isinstance(addr, ipaddress.IPv6Address):
        mapped = addr.ipv4_mapped
        if mapped is not None:
            return mapped
        if addr.scope_id is not None:
            return ipaddress.IPv6Address(addr.packed)
    return addr


def _in_any(addr: IPAddress, nets: tuple[IPNet, ...]) -> bool:
    # Mixed-version membership is simply False (``in`` across versions is False, never an error).
    return any(addr in net for net in nets)


def _refused_class(addr: IPAddress, host_addresses: frozenset[IPAddress]) -> str | None:
    if isinstance(addr, ipaddress.IPv4Address):
        if addr in _THIS_NETWORK:
            return "unspecified"
        if addr.is_loopback:
            return "loopback"
        if addr.is_link_local:
            return "link_local"
        if addr.is_multicast:
            return "multicast"
        if addr == _BROADCAST:
            return "broadcast"
        if addr.is_reserved:
            return "reserved"
    else:
        if addr.is_unspecified:
            return "unspecified"
        if addr.is_loopback:
            return "loopback"
        if addr.is_link_local:
            return "link_local"
        if addr.is_multicast:
            return "multicast"
        if addr.is_reserved or addr in _SITE_LOCAL or any(addr in n for n in _V4_TUNNELS):
            return "reserved"
    if addr in host_addresses:
        return "host_address"
    return None


def judge_target(addr: IPAddress, port: int, policy: TargetPolicy) -> None:
    """Return None if the forwarder may connect to ``addr``:``port`` under ``policy``; otherwise raise
    ``TargetRefused`` with the reason. Connect to ``canonical(addr)``, the address judged here."""
    if not 1 <= port <= 0xFFFF:
        raise TargetRefused("bad_port", f"port {port}")
    target = canonical(addr)
    reason = _refused_class(target, policy.host_addresses)
    if reason is not None and not _in_any(target, policy.allow):
        raise TargetRefused(reason, str(target))
    if not _in_any(target, policy.prefixes):
        raise TargetRefused("outside_prefixes", str(target))
