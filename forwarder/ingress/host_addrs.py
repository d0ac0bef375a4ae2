"""This host's own addresses, for the target guard (an adapter: it asks the kernel).

The list is a snapshot of the current network namespace; callers that live long refresh it (addresses
come and go as taps are created).
"""

from __future__ import annotations

import ipaddress
import logging
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _parse(text: object) -> IPAddress | None:
    if not isinstance(text, str):
        return None
    try:
        # Drop a zone (fe80::1%eth0): the preamble cannot carry one, so the guard compares without it.
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _from_netlink() -> frozenset[IPAddress]:
    from pyroute2 import IPRoute

    found: set[IPAddress] = set()
    with IPRoute() as ipr:
        for msg in ipr.get_addr():
            # IFA_LOCAL is the interface's own address on point-to-point links, where IFA_ADDRESS is
            # the peer's; take both so neither end of such a link slips through as a target.
            for attr in ("IFA_LOCAL", "IFA_ADDRESS"):
                addr = _parse(msg.get_attr(attr))
                if addr is not None:
                    found.add(addr)
    return frozenset(found)


def _from_socket() -> frozenset[IPAddress]:
    found: set[IPAddress] = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        infos = []
    for info in infos:
        addr = _parse(info[4][0])
        if addr is not None:
            found.add(addr)
    return frozenset(found)


def host_addresses() -> frozenset[IPAddress]:
    """Every address configured on any interface of this host (this network namespace).

    Netlink (pyroute2) when available; otherwise a partial fallback from the host name's addresses
    plus loopback, which misses addresses not in name resolution.
    """
    try:
        return _from_netlink()
    except Exception as e:  # pyroute2 missing, netlink refused (NetlinkError is not an OSError)
        logging.getLogger("sbxnet.forwarder").warning(
            "netlink address listing failed; the host-address guard falls back to name resolution",
            extra={"event": "host_addrs_fallback", "reason": type(e).__name__},
        )
        return _from_socket()
