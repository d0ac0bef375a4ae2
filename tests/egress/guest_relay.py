"""A test guest: owns a TUN device in its network namespace and speaks stream protocol v1 to the router.

It stands in for the guest agent, so the real kernel TCP/UDP/ICMP stacks of the guest namespace are on
one end of the egress path. Run inside the guest namespace::

    python guest_relay.py --uds /path/vm.vsock_2051 --addr 100.64.1.2 [--offloads 0x2b] [--mtu 1500]

It opens ``/dev/net/tun`` (IFF_TUN | IFF_NO_PI | IFF_VNET_HDR), dials the Unix socket, sends the hello
and sets the offloads the router granted (TUNSETOFFLOAD: TSO frames up to 64 KiB come out of the kernel;
USO4 only if USO6 came too, as Linux insists), gives the device the claim's address and the default
route, prints ``ready <granted> <mtu> <set on the device>`` and then pumps frames both ways (two
threads). The framing is written here independently of the product's codec. A line ``inject <hex>`` on
stdin sends that frame (vnet header + IPv4) as a guest agent could, bytes the kernel would never build
(fragments, lengths that lie).

With ``--reconnect`` it behaves like a guest agent whose host side went away (a daemon restart, a move):
the device and the guest's sockets stay, frames the kernel sends meanwhile are dropped, and it dials
again every 10 ms (the path a line ``uds <path>`` on stdin last named: a move's new host) until the hello
is answered. It prints ``closed <t>`` and ``reconnected <t> <granted>`` with ``time.monotonic()``, the
clock the daemon's own timestamps use, so a test can measure the outage. Without it a closed stream
ends the relay.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import struct
import subprocess
import sys
import threading
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_USO4 = 0x20
TUN_F_USO6 = 0x40
HELLO = struct.Struct("!HHIHH")
RX_SIZE = 1 << 20


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
    return fd


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


class Conn:
    """The stream now in use (None while redialling) and where to dial next."""

    def __init__(self, path: str, offloads: int, mtu: int) -> None:
        self.path = path
        self.offloads = offloads
        self.mtu = mtu
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def dial(self) -> tuple[int, int]:
        """Connect and say hello: (offloads granted, mtu), or OSError/EOFError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            sock.sendall(HELLO.pack(1, 1, self.offloads, self.mtu, 0))
            version, flags, offloads, mtu, _ = HELLO.unpack(recv_exact(sock, 12))
        except (OSError, EOFError):
            sock.close()
            raise
        if version != 1 or not flags & 1:
            sock.close()
            print(f"refused {version} {flags}", flush=True)
            os._exit(1)
        with self.lock:
            self.sock = sock
        return offloads, mtu


def tun_to_stream(fd: int, conn: Conn) -> None:
    while True:
        frame = os.read(fd, 65536 + 16)
        with conn.lock:
            if conn.sock is None:
                continue  # no host side now: dropped, as a guest's agent would while it redials
            try:
                conn.sock.sendmsg([struct.pack("!I", len(frame)), frame])
            except OSError:
                pass  # the stream is going; the reader notices and redials


def stream_to_tun(fd: int, conn: Conn, reconnect: bool) -> None:
    while True:
        sock = conn.sock
        assert sock is not None
        # One buffer read into and written from in place: a frame is at most 4 + 65545 bytes, so a partial
        # one moved to the front always leaves room for the rest.
        buf = bytearray(RX_SIZE)
        mv = memoryview(buf)
        end = 0
        while True:
            try:
                got = sock.recv_into(mv[end:])
            except OSError:
                got = 0  # reset: the router closed the stream with our frames still unread
            if not got:
                break
            end += got
            pos = 0
            while end - pos >= 4:
                (n,) = struct.unpack_from("!I", buf, pos)
                if end - pos - 4 < n:
                    break
                os.write(fd, mv[pos + 4 : pos + 4 + n])
                pos += 4 + n
            if pos:
                buf[: end - pos] = bytes(mv[pos:end])  # a copy: the two ranges may overlap
                end -= pos
        if not reconnect:
            os._exit(0)  # the router closed the stream
        with conn.lock:
            conn.sock = None
        sock.close()
        print(f"closed {time.monotonic():.6f}", flush=True)
        while True:
            try:
                offloads, _ = conn.dial()
                break
            except (OSError, EOFError):
                time.sleep(0.01)
        print(f"reconnected {time.monotonic():.6f} {offloads:#x}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--uds", required=True)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--offloads", type=lambda s: int(s, 0), default=0x2B)  # CSUM TSO4 TSO_ECN USO4
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--dev", default="gtun0")
    ap.add_argument("--reconnect", action="store_true", help="redial a closed stream instead of ending")
    a = ap.parse_args()
    fd = open_tun(a.dev)
    conn = Conn(a.uds, a.offloads, a.mtu)
    offloads, mtu = conn.dial()
    tun_offloads = offloads
    if offloads & TUN_F_USO4 and not offloads & TUN_F_USO6:
        # Linux's TUNSETOFFLOAD takes USO4 only together with USO6, which this host never grants: the
        # kernel then sends no UDP GSO frames, which the granted bit allows but does not require.
        tun_offloads &= ~TUN_F_USO4
    fcntl.ioctl(fd, TUNSETOFFLOAD, tun_offloads)
    for cmd in (["addr", "add", f"{a.addr}/32", "dev", a.dev], ["link", "set", a.dev, "mtu", str(mtu), "up"],
                ["link", "set", "lo", "up"], ["route", "add", "default", "dev", a.dev]):
        subprocess.run(["ip", *cmd], check=True)
    threading.Thread(target=tun_to_stream, args=(fd, conn), daemon=True).start()
    threading.Thread(target=stream_to_tun, args=(fd, conn, a.reconnect), daemon=True).start()
    print(f"ready {offloads:#x} {mtu} {tun_offloads:#x}", flush=True)
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        if word == "inject":
            frame = bytes.fromhex(arg)
            with conn.lock:
                if conn.sock is not None:
                    conn.sock.sendall(struct.pack("!I", len(frame)) + frame)
            print("injected", flush=True)
        elif word == "uds":
            conn.path = arg  # the next dial goes there
            print("uds", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
