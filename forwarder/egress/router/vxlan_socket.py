"""The VXLAN UDP socket: datagrams received into slots of one buffer we own, records sent with GSO.

One non-blocking socket bound to (``listen``, ``port``). ``recv_columns`` reads up to ``slots`` datagrams
with one ``recvmmsg`` (libc's, through cffi's ABI mode: Python's socket module has none), each into its
own fixed slot of ``rx`` (no allocation for the bytes; a datagram longer than a slot is dropped as
``truncated``); the headers, lengths and sources are C arrays made once, read back through strided integer
views into lists, so a datagram costs no syscall and no Python step of its own. ``send_records`` sends the C
core's records for one send: with ``UDP_SEGMENT`` (one ``sendmsg`` for up to 64 records) while the kernel
takes it; a GSO send that fails with EIO (a device that cannot checksum the segments) turns GSO off for
good and the records go one ``sendto`` each, the same bytes another way. Blocked or failed sends are
counted, never retried: the guests' TCP does that.
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
from collections import Counter

import cffi

SOL_UDP = 17
UDP_SEGMENT = 103  # linux/udp.h
SLOT = 9216 + 64  # a jumbo-frame datagram and then some
_SEG = struct.Struct("=H")
# socket.MSG_TRUNC is an IntFlag: ``int & MSG_TRUNC`` builds an enum member each time (about 1 us, once per
# datagram received); the plain int costs nothing.
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)

_ffi = cffi.FFI()
# Linux's layouts with glibc (cffi lays the fields out by the platform's C ABI).
_ffi.cdef("""
struct iovec { void *iov_base; size_t iov_len; };
struct msghdr { void *msg_name; uint32_t msg_namelen; struct iovec *msg_iov; size_t msg_iovlen;
                void *msg_control; size_t msg_controllen; int msg_flags; };
struct mmsghdr { struct msghdr msg_hdr; unsigned int msg_len; };
int recvmmsg(int sockfd, struct mmsghdr *msgvec, unsigned int vlen, int flags, void *timeout);
""")
_libc = _ffi.dlopen(None)
_MMSG = _ffi.sizeof("struct mmsghdr")
_LEN_AT = _ffi.offsetof("struct mmsghdr", "msg_len")
_FLAGS_AT = _ffi.offsetof("struct msghdr", "msg_flags")
_NAME = 16  # struct sockaddr_in


def source_key(host: str) -> int:
    """A source address in the form ``recv_columns`` reports it (its ``sin_addr`` as a native integer)."""
    return int.from_bytes(socket.inet_aton(host), sys.byteorder)


def source_host(key: int) -> str:
    """The dotted quad of a ``source_key``."""
    return socket.inet_ntoa(key.to_bytes(4, sys.byteorder))


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
        # recvmmsg's arrays, made once: slot i's iovec points at rx[i*SLOT:], its name at names[i]
        self._rxp = _ffi.from_buffer(self.rx)
        self._iov = _ffi.new("struct iovec[]", slots)
        self._names = _ffi.new("char[]", slots * _NAME)
        self._msgs = _ffi.new("struct mmsghdr[]", slots)
        for i in range(slots):
            self._iov[i].iov_base = self._rxp + i * SLOT
            self._iov[i].iov_len = SLOT
            h = self._msgs[i].msg_hdr
            h.msg_name = self._names + i * _NAME
            h.msg_namelen = _NAME
            h.msg_iov = self._iov + i
            h.msg_iovlen = 1
        assert _MMSG % 4 == 0 and _LEN_AT % 4 == 0 and _FLAGS_AT % 4 == 0
        self._words = memoryview(_ffi.buffer(self._msgs)).cast("I")  # msg_len, msg_flags per slot
        self._addrs = memoryview(_ffi.buffer(self._names)).cast("I")  # sin_addr at word 1 of each name
        self._step, self._len_w, self._flags_w = _MMSG // 4, _LEN_AT // 4, _FLAGS_AT // 4
        self._offsets = [i * SLOT for i in range(slots)]
        self.gso = True
        self.counts: Counter[str] = Counter()

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def recv_columns(self) -> tuple[list[int], list[int], list[int]]:
        """The datagrams waiting, at most ``slots``, as three lists: offsets in ``rx``, lengths, and
        sources as ``source_key`` gives them (``sin_addr`` as read). Read as strided views of the C
        arrays, so a batch costs a few list builds and no Python step per datagram; a truncated one
        (rare) is counted and left out, which alone takes the per-datagram path."""
        fd = self.sock.fileno()
        for _ in range(self.slots):  # another call only after an error on the socket's first datagram
            n = _libc.recvmmsg(fd, self._msgs, self.slots, _MSG_DONTWAIT, _ffi.NULL)
            if n >= 0:
                break
            err = _ffi.errno
            if err in (errno.EAGAIN, errno.EINTR):
                return [], [], []
            self.counts["recv_error"] += 1  # an ICMP error queued on the socket: nothing to read
        else:
            return [], [], []
        words, step = self._words, self._step
        end = n * step
        offs = self._offsets[:n]
        lens = words[self._len_w : end : step].tolist()
        srcs = self._addrs[1 : 4 * n : 4].tolist()
        flags = words[self._flags_w : end : step].tolist()
        if any(flags):  # some flag set: look for MSG_TRUNC datagram by datagram
            keep = [i for i, f in enumerate(flags) if not f & _MSG_TRUNC]
            self.counts["truncated"] += n - len(keep)
            offs, lens, srcs = [offs[i] for i in keep], [lens[i] for i in keep], [srcs[i] for i in keep]
        self.counts["datagrams_in"] += len(offs)
        return offs, lens, srcs

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
