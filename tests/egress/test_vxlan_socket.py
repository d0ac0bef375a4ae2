"""``VxlanSocket.recv_columns`` over real loopback sockets: one ``recvmmsg`` for up to ``slots`` datagrams.

Datagrams from two sources (two loopback addresses), of every size from 1 byte to a full slot, one
longer than a slot, and more of them than one batch holds: each batch gives each datagram's offset,
length and source, and ``rx`` holds its bytes at that offset; the oversize one is counted as
``truncated`` and not given; nothing is lost or given twice across
batches; an empty socket gives an empty batch; every source's key maps back to its address.
"""

from __future__ import annotations

import random
import socket

from forwarder.egress.router.vxlan_socket import SLOT, VxlanSocket, source_host, source_key


def _batch(vx: VxlanSocket) -> list[tuple[int, int, str]]:
    offs, lens, srcs = vx.recv_columns()
    assert len(offs) == len(lens) == len(srcs)
    return [(off, ln, source_host(src)) for off, ln, src in zip(offs, lens, srcs, strict=True)]


def _sender(addr: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, 0))
    return s


def test_recv_columns_give_each_datagram_its_slot_length_and_source() -> None:
    vx = VxlanSocket("127.0.0.1", 0, slots=8, buffer_bytes=1 << 20)
    port = vx.sock.getsockname()[1]
    a, b = _sender("127.0.0.1"), _sender("127.0.0.2")
    try:
        assert _batch(vx) == []
        rnd = random.Random(5)
        sizes = [1, 2, 63, 1500, SLOT - 1, SLOT] + [rnd.randrange(1, 9000) for _ in range(13)]
        sent: list[tuple[bytes, str]] = []
        for i, n in enumerate(sizes):
            s, host = (a, "127.0.0.1") if i % 3 else (b, "127.0.0.2")
            data = rnd.randbytes(n)
            s.sendto(data, ("127.0.0.1", port))
            sent.append((data, host))
            if i == 4:
                s.sendto(bytes(SLOT + 1), ("127.0.0.1", port))  # past a slot: truncated, dropped
        got: list[tuple[bytes, str]] = []
        batches = []
        while batch := _batch(vx):
            batches.append(len(batch))
            got.extend((bytes(vx.rx[off : off + ln]), host) for off, ln, host in batch)
            assert all(off % SLOT == 0 and off < 8 * SLOT for off, _, _ in batch)
        assert got == sent
        assert max(batches) == 8 and len(batches) >= 3, batches
        assert vx.counts["truncated"] == 1 and vx.counts["datagrams_in"] == len(sizes)
    finally:
        a.close()
        b.close()
        vx.close()


def test_every_source_is_reported_right_whoever_sends() -> None:
    vx = VxlanSocket("127.0.0.1", 0, slots=64, buffer_bytes=1 << 20)
    port = vx.sock.getsockname()[1]
    try:
        seen: set[str] = set()
        for k in range(300):  # 300 distinct loopback sources, more than the cache keeps
            addr = f"127.0.{1 + k // 250}.{1 + k % 250}"
            with _sender(addr) as s:
                s.sendto(b"x", ("127.0.0.1", port))
            if k % 50 == 49:
                seen.update(host for _, _, host in _batch(vx))
        seen.update(host for _, _, host in _batch(vx))
        assert len(seen) == 300  # every source reported right
        assert all(source_host(source_key(h)) == h for h in seen)
    finally:
        vx.close()
