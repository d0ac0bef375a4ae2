"""Both ends of the end-to-end traffic (tests/egress/test_router_e2e.py), run in the namespaces.

``server ADDR``: in the internet namespace, a UDP echo on port 7, a UDP "who am I" on port 8 (answers
the source address it saw) and a TCP service on 5001 (``up N``:
read N bytes, answer their SHA-256; ``down N SEED``: send N bytes of a seeded stream). Prints ``ready``.
The client commands run in the guest namespace and print one JSON line: ``ping ADDR`` (three ICMP
echoes, raw socket), ``udp ADDR``, ``tcp-up ADDR N`` (also the socket's ``IP_MTU`` at the end),
``tcp-down ADDR N SEED`` (also the longest wait between two reads, ``max_gap``, and when it ended,
``max_gap_end``, by ``time.monotonic()``; both TCP commands also give ``s``, the transfer's time, and
``cpu_s``, the client's CPU over it, and ``machine_busy_s``, the whole machine's; the expected digest
is worked out before either starts), ``forge SRC ADDR PORT`` (a UDP datagram with a forged source,
through a raw socket), ``udp-flows ADDR N`` (one datagram from each of N sockets: which were echoed),
``whoami ADDR SECONDS`` (a datagram to port 8 every 2 ms for that long: the sources the server
answered it saw), ``tcp-connect ADDR TIMEOUT`` and ``pmtu-udp ADDR SIZE`` (DF datagrams until the socket's error queue
holds the path's MTU: the ICMP's type, code, MTU and sender). The seeded streams are made and hashed a
chunk at a time, so 256 MiB is never held whole.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

CHUNK = 1 << 18
IP_MTU = 14  # <linux/in.h>; Python's socket module does not name it
IP_MTU_DISCOVER, IP_PMTUDISC_DO, IP_RECVERR = 10, 2, 11
SO_EE = struct.Struct("=IBBBBII")  # struct sock_extended_err: errno origin type code pad info data


def stream_chunks(n: int, seed: int) -> Iterator[bytes]:
    """The seeded stream of ``n`` bytes, a chunk at a time (a 256 MiB transfer is never held whole).

    The stream is the AES-256-CTR keystream under a key derived from the seed: it never repeats within a
    transfer, and it costs about 0.2 CPU-s per GiB here, where ``random.Random.randbytes`` cost 5 and
    made the two peers the largest consumer of the cores the router's benchmark shares with them.
    """
    key = hashlib.sha256(b"sbxnet e2e stream %d" % seed).digest()
    keystream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    zeros = bytes(CHUNK)
    while n > 0:
        chunk = keystream.update(zeros if n >= CHUNK else bytes(n))
        n -= len(chunk)
        yield chunk


def stream_digest(n: int, seed: int) -> str:
    h = hashlib.sha256()
    for chunk in stream_chunks(n, seed):
        h.update(chunk)
    return h.hexdigest()


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy so far (every CPU; not idle, not waiting for I/O)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:8]]
    return (sum(t) - t[3] - t[4]) / os.sysconf("SC_CLK_TCK")


def checksum(data: bytes) -> int:
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def serve(addr: str) -> None:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((addr, 7))
    w = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    w.bind((addr, 8))
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind((addr, 5001))
    t.listen(16)

    def echo() -> None:
        while True:
            data, peer = u.recvfrom(65536)
            u.sendto(data, peer)

    def handle(c: socket.socket) -> None:
        with c, c.makefile("rb") as f:
            words = f.readline().split()
            if words[0] == b"up":
                n, h = int(words[1]), hashlib.sha256()
                early = f.read1(n) if n else b""  # what the buffered line read took past the line, or one read
                h.update(early)
                n -= len(early)
                buf = memoryview(bytearray(CHUNK))
                while n:
                    got = c.recv_into(buf, min(CHUNK, n))
                    if not got:
                        break
                    h.update(buf[:got])
                    n -= got
                c.sendall(h.hexdigest().encode() + b"\n")
            elif words[0] == b"down":
                for chunk in stream_chunks(int(words[1]), int(words[2])):
                    c.sendall(chunk)

    def whoami() -> None:
        while True:
            _, peer = w.recvfrom(2048)
            w.sendto(peer[0].encode(), peer)

    threading.Thread(target=echo, daemon=True).start()
    threading.Thread(target=whoami, daemon=True).start()
    print("ready", flush=True)
    while True:
        c, _ = t.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()


def client(argv: list[str]) -> dict[str, object]:
    cmd, addr = argv[0], argv[1]
    t0 = time.monotonic()
    if cmd == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        got = []
        for i in range(5):
            msg = f"echo {i}".encode() * 50
            s.sendto(msg, (addr, 7))
            try:
                data, peer = s.recvfrom(65536)
                got.append(data == msg and peer == (addr, 7))
            except TimeoutError:
                got.append(False)
        return {"ok": sum(got)}
    if cmd == "ping":
        r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        r.settimeout(2)
        replies = 0
        for seq in range(3):
            body = struct.pack("!HH", 0x5B, seq) + b"sbxnet-ping" * 4
            msg = struct.pack("!BBH", 8, 0, 0) + body
            msg = struct.pack("!BBH", 8, 0, checksum(msg)) + body
            r.sendto(msg, (addr, 0))
            try:
                while True:
                    pkt, _ = r.recvfrom(65536)
                    ihl = (pkt[0] & 15) * 4
                    if pkt[ihl] == 0 and pkt[ihl + 4 :] == body:
                        replies += 1
                        break
            except TimeoutError:
                pass
        return {"replies": replies}
    if cmd == "tcp-up":
        n = int(argv[2])
        want = stream_digest(n, 12)  # what the server must answer, worked out before the clock starts
        t0, cpu0, busy0 = time.monotonic(), time.process_time(), machine_busy_s()
        with socket.create_connection((addr, 5001), timeout=30) as c:
            c.sendall(f"up {n}\n".encode())
            for chunk in stream_chunks(n, 12):
                c.sendall(chunk)
            answer = c.makefile("rb").readline().strip().decode()
            mtu = c.getsockopt(socket.IPPROTO_IP, IP_MTU)
        return {"match": answer == want, "s": time.monotonic() - t0, "mtu": mtu,
                "cpu_s": time.process_time() - cpu0, "machine_busy_s": machine_busy_s() - busy0}
    if cmd == "tcp-down":
        n, seed = int(argv[2]), int(argv[3])
        want = stream_digest(n, seed)  # before the clock starts: it is no part of the transfer
        t0, cpu0, busy0 = time.monotonic(), time.process_time(), machine_busy_s()
        h, received = hashlib.sha256(), 0
        gap, gap_at, last = 0.0, 0.0, t0  # the longest wait for bytes, and when it ended (monotonic)
        with socket.create_connection((addr, 5001), timeout=30) as c:
            c.sendall(f"down {n} {seed}\n".encode())
            buf = memoryview(bytearray(CHUNK))
            while received < n:
                k = c.recv_into(buf)
                now = time.monotonic()
                if not k:
                    break
                if received and now - last > gap:
                    gap, gap_at = now - last, now
                last = now
                h.update(buf[:k])
                received += k
        took = time.monotonic() - t0
        return {"match": h.hexdigest() == want, "got": received,
                "s": took, "max_gap": gap, "max_gap_end": gap_at, "cpu_s": time.process_time() - cpu0,
                "machine_busy_s": machine_busy_s() - busy0}
    if cmd == "udp-flows":
        # one datagram from each of N sockets (N flows), then which of them were echoed within 2 s
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(int(argv[2]))]
        for i, s in enumerate(socks):
            s.sendto(f"flow {i}".encode(), (addr, 7))
        answered: set[int] = set()
        end = time.monotonic() + 2
        while len(answered) < len(socks) and (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select([s for i, s in enumerate(socks) if i not in answered], [], [], left)
            for s in ready:
                data = s.recv(100)
                answered.add(int(data.split()[1]))
        return {"answered": sorted(answered)}
    if cmd == "whoami":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        sent, seen = 0, Counter[str]()
        end = time.monotonic() + float(argv[2])
        while (now := time.monotonic()) < end + 0.5:  # the last half second only collects the answers
            if now < end:
                s.sendto(b"who", (addr, 8))
                sent += 1
            if select.select([s], [], [], 0.002)[0]:
                seen[s.recv(100).decode()] += 1
        return {"sent": sent, "seen": dict(seen), "t0": t0, "end": end}
    if cmd == "tcp-connect":
        try:
            socket.create_connection((addr, 5001), timeout=float(argv[2])).close()
            return {"connected": True}
        except OSError as e:
            return {"connected": False, "error": type(e).__name__}
    if cmd == "pmtu-udp":
        # A datagram of SIZE bytes with DF set (IP_PMTUDISC_DO) until the kernel reports the path's MTU
        # on the socket's error queue (IP_RECVERR); the ICMP that said so, as the guest's kernel got it.
        size = int(argv[2])
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        s.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
        s.connect((addr, 9))
        errs = select.poll()
        errs.register(s, 0)  # poll reports POLLERR (a queued error) whatever it is asked for
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                s.send(bytes(size))
            except OSError as e:
                if e.errno != errno.EMSGSIZE:
                    raise
            if errs.poll(500):
                _, anc, _, _ = s.recvmsg(2048, 512, socket.MSG_ERRQUEUE)
                for level, kind, data in anc:
                    if (level, kind) == (socket.IPPROTO_IP, IP_RECVERR):
                        err, origin, typ, code, _, info, _ = SO_EE.unpack_from(data)
                        offender = socket.inet_ntoa(data[SO_EE.size + 4 : SO_EE.size + 8])  # sockaddr_in
                        return {"errno": err, "origin": origin, "type": typ, "code": code, "info": info,
                                "from": offender, "ip_mtu": s.getsockopt(socket.IPPROTO_IP, IP_MTU),
                                "s": time.monotonic() - t0}
        return {"errno": 0, "s": time.monotonic() - t0}
    if cmd == "forge":
        src, port = argv[1], int(argv[3])
        addr = argv[2]
        payload = b"forged"
        udp = struct.pack("!HHHH", 40001, port, 8 + len(payload), 0) + payload
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                         socket.inet_aton(src), socket.inet_aton(addr))
        r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        r.sendto(ip + udp, (addr, 0))
        return {"sent": True}
    raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(sys.argv[2])
    else:
        print(json.dumps(client(sys.argv[1:])), flush=True)
