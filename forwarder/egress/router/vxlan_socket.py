"""The VXLAN UDP socket: datagrams received into slots of one buffer we own, records sent with GSO.

One non-blocking socket bound to (``listen``, ``port``). ``recv_batch`` reads up to ``slots``
datagrams, each into its own fixed slot of ``rx`` (no allocation for the bytes; a datagram longer than
a slot is dropped as ``truncated``). ``send_records`` sends the C core's records for one send: with
``UDP_SEGMENT`` (one ``sendmsg`` for up to 64 records) while the kernel takes it; a GSO send that fails
with EIO (a device that cannot checksum the segments) turns GSO off for good and the records go one
``sendto`` each, the same bytes another way. Blocked or failed sends are counted, never retried: the
guests' TCP does that.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections import Counter

SOL_UDP = 17
UDP_SEGMENT = 103  # linux/udp.h
SLOT = 9216 + 64  # a jumbo-frame datagram and then some
_SEG = struct.Struct("=H")
# socket.MSG_TRUNC is an IntFlag: ``int & MSG_TRUNC`` builds an enum member each time (about 1 us, once per
# datagram received); the plain int costs nothing.
_MSG_TRUNC = int(socket.MSG_TRUNC)


class VxlanSocket:
    def __init__(self, listen: str, port: int, *, slots: int = 64, buffer_bytes: int = 4 << 20) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setblocking(False)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            s.bind((listen, port))
        except BaseException:
            s.close()
            raise
        self.sock = s
        self.port = port
        self.slots = slots
        self.rx = bytearray(slots * SLOT)
        self._views = [memoryview(self.rx)[i * SLOT : (i + 1) * SLOT] for i in range(slots)]
        self._one = [[v] for v in self._views]  # the buffer lists recvmsg_into takes, made once
        self.gso = True
        self.counts: Counter[str] = Counter()

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def recv_batch(self) -> list[tuple[int, int, str]]:
        """(offset in ``rx``, length, source address) of each datagram waiting, at most ``slots``."""
        got: list[tuple[int, int, str]] = []
        recv = self.sock.recvmsg_into
        for i in range(self.slots):
            try:
                n, _anc, flags, addr = recv(self._one[i])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.counts["recv_error"] += 1  # an ICMP error queued on the socket: nothing to read
                continue
            if flags & _MSG_TRUNC:
                self.counts["truncated"] += 1
                continue
            got.append((i * SLOT, n, addr[0]))
        self.counts["datagrams_in"] += len(got)
        return got

    def sendto(self, data: bytes | memoryview, host: str) -> None:
        try:
            self.sock.sendto(data, (host, self.port))
            self.counts["datagrams_out"] += 1
        except (BlockingIOError, InterruptedError):
            self.counts["send_blocked"] += 1
        except OSError:
            self.counts["send_error"] += 1

    def send_records(self, out: memoryview, off: int, ln: int, seg: int, count: int, host: str) -> None:
        """Send ``count`` records at ``out[off:off+ln]``, each ``seg`` bytes but the last, to ``host``."""
        if count > 1 and self.gso:
            try:
                self.sock.sendmsg([out[off : off + ln]], [(SOL_UDP, UDP_SEGMENT, _SEG.pack(seg))], 0,
                                  (host, self.port))
                self.counts["datagrams_out"] += count
                self.counts["gso_sends"] += 1
                return
            except (BlockingIOError, InterruptedError):
                self.counts["send_blocked"] += count
                return
            except OSError as e:
                if e.errno != errno.EIO:
                    self.counts["send_error"] += count
                    return
                self.gso = False
                self.counts["gso_off"] += 1
        end = off + ln
        while off < end:
            self.sendto(out[off : min(off + seg, end)], host)
            off += seg
