"""Helpers for the tap tests: skip checks, namespace/tap bookkeeping, frame parsing, captures, a pump.

The frame parsing here is written independently of the product (the product does not parse frames):
it is the test's own oracle for "what left the tap".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import select
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address

from forwarder.taps.netlink import IFF_NO_PI, IFF_TAP, TUNSETIFF
from forwarder.taps.netns import call_in_netns

ETH_P_ALL = 0x0003
ETH_P_ARP = 0x0806
ETH_P_IP = 0x0800
SO_TIMESTAMPNS = 35  # asm-generic/socket.h; SCM_TIMESTAMPNS has the same value
PACKET_OUTGOING = 4


def why_no_netns() -> str | None:
    """A reason to skip the namespace tests on this machine, or None if they can run."""
    if os.geteuid() != 0:
        return "needs root (creates network namespaces and TAP devices)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (tun module not loaded?)"
    try:
        from pyroute2 import netns
    except ImportError as e:  # pragma: no cover - pyroute2 is a dependency
        return f"needs pyroute2 ({e})"
    name = unique("sbxchk")
    try:
        netns.create(name)
    except Exception as e:
        return f"cannot create a network namespace here: {e}"
    netns.remove(name)
    return None


def unique(prefix: str) -> str:
    """A name unlikely to collide with parallel runs; prefix + 6 hex digits (keep prefix <= 9 bytes)."""
    name = f"{prefix}{secrets.token_hex(3)}"
    assert len(name) <= 15, name
    return name


def ip_json(*args: str, netns: str | None = None) -> list[dict]:
    """The test's independent oracle: iproute2's own JSON view (``ip [-n NS] -j ARGS``)."""
    cmd = ["ip"] + (["-n", netns] if netns else []) + ["-j", *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out) if out.strip() else []


def ip_state(name: str, netns: str | None) -> dict:
    """Link, IPv4 addresses and IPv4 neighbours of ``name`` as iproute2 sees them (no counters)."""
    link = ip_json("link", "show", "dev", name, netns=netns)[0]
    addrs = ip_json("-4", "addr", "show", "dev", name, netns=netns)
    neigh = ip_json("-4", "neigh", "show", "dev", name, netns=netns)
    return {
        "link": {k: link.get(k) for k in ("ifindex", "ifname", "flags", "mtu", "address", "operstate")},
        "addrs": sorted((a["local"], a["prefixlen"]) for x in addrs for a in x.get("addr_info", [])),
        "neigh": sorted((n["dst"], n.get("lladdr"), tuple(n.get("state", []))) for n in neigh),
    }


# ---------------------------------------------------------------- frames


@dataclass(frozen=True)
class Frame:
    ts_ns: int  # kernel timestamp (CLOCK_REALTIME) for captures, time.time_ns() for pump reads
    data: bytes
    direction: str = ""

    @property
    def dst(self) -> str:
        return ":".join(f"{b:02x}" for b in self.data[0:6])

    @property
    def src(self) -> str:
        return ":".join(f"{b:02x}" for b in self.data[6:12])

    @property
    def ethertype(self) -> int:
        return struct.unpack("!H", self.data[12:14])[0] if len(self.data) >= 14 else -1

    def arp(self) -> tuple[int, str, IPv4Address, IPv4Address] | None:
        """(op, sender MAC, sender IP, target IP) for an Ethernet/IPv4 ARP frame, else None."""
        d = self.data
        if self.ethertype != ETH_P_ARP or len(d) < 42:
            return None
        op = struct.unpack("!H", d[20:22])[0]
        sha = ":".join(f"{b:02x}" for b in d[22:28])
        return op, sha, IPv4Address(d[28:32]), IPv4Address(d[38:42])

    def is_arp_request_for(self, ip: IPv4Address) -> bool:
        a = self.arp()
        return a is not None and a[0] == 1 and a[3] == ip

    def tcp(self) -> tuple[IPv4Address, IPv4Address, int, int] | None:
        """(src, dst, dst port, TCP flags) for an IPv4/TCP frame, else None."""
        d = self.data
        if self.ethertype != ETH_P_IP or len(d) < 34 or d[14] >> 4 != 4 or d[23] != 6:
            return None
        ihl = (d[14] & 0x0F) * 4
        if len(d) < 14 + ihl + 14:
            return None
        tcp = 14 + ihl
        dport = struct.unpack("!H", d[tcp + 2:tcp + 4])[0]
        return IPv4Address(d[26:30]), IPv4Address(d[30:34]), dport, d[tcp + 13]

    def is_syn_to(self, ip: IPv4Address) -> bool:
        t = self.tcp()
        return t is not None and t[1] == ip and t[3] & 0x02 != 0 and t[3] & 0x10 == 0

    def is_synack_to(self, ip: IPv4Address) -> bool:
        t = self.tcp()
        return t is not None and t[1] == ip and t[3] & 0x12 == 0x12


def arp_reply(*, src_mac: str, src_ip: IPv4Address, dst_mac: str, dst_ip: IPv4Address) -> bytes:
    """An Ethernet ARP reply frame, as a booted guest would answer."""
    s, d = bytes.fromhex(src_mac.replace(":", "")), bytes.fromhex(dst_mac.replace(":", ""))
    header = struct.pack("!HHHBBH", ETH_P_ARP, 1, ETH_P_IP, 6, 4, 2)
    return d + s + header + s + src_ip.packed + d + dst_ip.packed


# ---------------------------------------------------------------- tap queues and captures


def create_tap_queue(name: str, netns: str | None) -> int:
    """Create a NON-persistent tap held by the returned fd (closing it destroys the device)."""
    fd = call_in_netns(netns, lambda: os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def drain_fd(fd: int) -> int:
    n = 0
    while True:
        try:
            os.read(fd, 65536)
            n += 1
        except BlockingIOError:
            return n


class Capture:
    """A packet socket on one interface reporting outgoing frames with kernel timestamps."""

    def __init__(self, ifname: str, netns: str | None) -> None:
        self.sock = call_in_netns(
            netns, lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL)))
        self.sock.bind((ifname, ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.setblocking(False)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.sock.recv(65536)

    def read_outgoing(self) -> Frame | None:
        """One queued frame if it was sent out of the interface, else None (incoming frames are skipped)."""
        try:
            data, anc, _flags, addr = self.sock.recvmsg(65536, socket.CMSG_SPACE(16))
        except BlockingIOError:
            return None
        if addr[2] != PACKET_OUTGOING:
            return None
        ts = time.time_ns()
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= 16:
                sec, nsec = struct.unpack("qq", payload[:16])
                ts = sec * 1_000_000_000 + nsec
        return Frame(ts, data, "out")

    def outgoing_until(self, deadline_ns: int, stop: Callable[[Frame], bool] | None = None) -> list[Frame]:
        """Outgoing frames until ``deadline_ns`` (time.time_ns()) or until ``stop(frame)`` is true."""
        frames: list[Frame] = []
        while True:
            left = (deadline_ns - time.time_ns()) / 1e9
            if left <= 0:
                return frames
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                return frames
            f = self.read_outgoing()
            if f is None:
                continue
            frames.append(f)
            if stop is not None and stop(f):
                return frames

    def close(self) -> None:
        self.sock.close()


@dataclass
class Pump:
    """Copies frames between two tap fds, the way a VMM moves them between a tap and a guest NIC.

    Every frame is logged with the time it was read and its direction ("to_guest"/"to_host").
    """

    host_fd: int
    guest_fd: int
    log: list[Frame] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="tap-pump", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        routes = {self.host_fd: (self.guest_fd, "to_guest"), self.guest_fd: (self.host_fd, "to_host")}
        while True:
            r, _, _ = select.select([self._stop_r, self.host_fd, self.guest_fd], [], [])
            if self._stop_r in r:
                return
            for fd in r:
                out, direction = routes[fd]
                with contextlib.suppress(BlockingIOError):
                    while True:
                        data = os.read(fd, 65536)
                        self.log.append(Frame(time.time_ns(), data, direction))
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.write(out, data)

    def stop(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(5)
        os.close(self._stop_r)
        os.close(self._stop_w)


@contextlib.contextmanager
def closing_fds(*fds: int) -> Iterator[None]:
    try:
        yield
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class NetlinkEvents:
    """Link, address and neighbour change notifications of one namespace (an rtnetlink multicast socket).

    Proof that a call changed nothing: the kernel announces every link/address/neighbour change on
    these groups, so an idempotent call must leave none for the tap's ifindex.
    """

    RTMGRP_LINK = 0x1
    RTMGRP_NEIGH = 0x4
    RTMGRP_IPV4_IFADDR = 0x10
    TYPES = {16: "NEWLINK", 17: "DELLINK", 20: "NEWADDR", 21: "DELADDR", 28: "NEWNEIGH", 29: "DELNEIGH"}

    def __init__(self, netns: str | None) -> None:
        self.sock = call_in_netns(
            netns, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))  # NETLINK_ROUTE
        self.sock.bind((0, self.RTMGRP_LINK | self.RTMGRP_NEIGH | self.RTMGRP_IPV4_IFADDR))
        self.sock.setblocking(False)

    def collect(self, ifindex: int, settle_s: float = 0.05) -> list[str]:
        """Notifications about ``ifindex`` received so far (waits ``settle_s`` for stragglers)."""
        time.sleep(settle_s)
        seen: list[str] = []
        with contextlib.suppress(BlockingIOError):
            while True:
                data = self.sock.recv(1 << 16)
                off = 0
                while off + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, off)
                    if length < 16:
                        break
                    if kind in self.TYPES and off + 24 <= len(data):
                        idx = struct.unpack_from("=i", data, off + 16 + 4)[0]
                        if idx == ifindex:
                            seen.append(self.TYPES[kind])
                    off += (length + 3) & ~3
        return seen

    def close(self) -> None:
        self.sock.close()
