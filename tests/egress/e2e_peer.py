"""Both ends of the end-to-end traffic (tests/egress/test_router_e2e.py), run in the namespaces.

``server ADDR``: in the internet namespace, a UDP echo on port 7 and a TCP service on 5001 (``up N``:
read N bytes, answer their SHA-256; ``down N SEED``: send N bytes of a seeded stream). Prints ``ready``.
The client commands run in the guest namespace and print one JSON line: ``ping ADDR`` (three ICMP
echoes, raw socket), ``udp ADDR``, ``tcp-up ADDR N``, ``tcp-down ADDR N SEED`` (also the longest wait between two reads,
``max_gap``, and when it ended, ``max_gap_end``, by ``time.monotonic()``), ``forge SRC ADDR PORT``
(a UDP datagram with a forged source, through a raw socket).
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import struct
import sys
import threading
import time

CHUNK = 1 << 16


def stream_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def checksum(data: bytes) -> int:
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def serve(addr: str) -> None:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((addr, 7))
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
                while n:
                    chunk = f.read(min(CHUNK, n))
                    if not chunk:
                        break
                    h.update(chunk)
                    n -= len(chunk)
                c.sendall(h.hexdigest().encode() + b"\n")
            elif words[0] == b"down":
                c.sendall(stream_bytes(int(words[1]), int(words[2])))

    threading.Thread(target=echo, daemon=True).start()
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
        data = stream_bytes(n, 12)
        with socket.create_connection((addr, 5001), timeout=30) as c:
            c.sendall(f"up {n}\n".encode() + data)
            answer = c.makefile("rb").readline().strip().decode()
        return {"match": answer == hashlib.sha256(data).hexdigest(), "s": time.monotonic() - t0}
    if cmd == "tcp-down":
        n, seed = int(argv[2]), int(argv[3])
        h, received = hashlib.sha256(), 0
        gap, gap_at, last = 0.0, 0.0, t0  # the longest wait for bytes, and when it ended (monotonic)
        with socket.create_connection((addr, 5001), timeout=30) as c:
            c.sendall(f"down {n} {seed}\n".encode())
            while received < n:
                chunk = c.recv(CHUNK)
                now = time.monotonic()
                if not chunk:
                    break
                if received and now - last > gap:
                    gap, gap_at = now - last, now
                last = now
                h.update(chunk)
                received += len(chunk)
        return {"match": h.hexdigest() == hashlib.sha256(stream_bytes(n, seed)).hexdigest(), "got": received,
                "s": time.monotonic() - t0, "max_gap": gap, "max_gap_end": gap_at}
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
