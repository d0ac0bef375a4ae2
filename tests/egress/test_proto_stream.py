"""Stream protocol v1: hello codec and negotiation, frame codec and the incremental decoder."""

from __future__ import annotations

import os
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress.errors import FrameRefused, FramingLost, HelloRefused
from forwarder.egress.stream import (
    FRAME_LEN_MAX,
    FRAME_LEN_MIN,
    HOST_OFFLOADS,
    TUN_F_ALL,
    TUN_F_CSUM,
    TUN_F_TSO4,
    TUN_F_TSO6,
    TUN_F_TSO_ECN,
    TUN_F_UFO,
    TUN_F_USO4,
    TUN_F_USO6,
    FrameDecoder,
    Hello,
    negotiate,
    pull_hello,
    push_frame,
    push_hello,
)
from sbxnet.errors import LocalProtocolError

# ---------------------------------------------------------------- hello

HELLO_TABLE = [
    (Hello(1, 1, 0x23, 1500, 0), bytes.fromhex("0001 0001 00000023 05dc 0000")),
    (Hello(1, 0, 0, 576, 0), bytes.fromhex("0001 0000 00000000 0240 0000")),
    (Hello(1, 1, 0x7F, 65535, 0), bytes.fromhex("0001 0001 0000007f ffff 0000")),
]


@pytest.mark.parametrize(("hello", "wire"), HELLO_TABLE)
def test_hello_golden(hello: Hello, wire: bytes) -> None:
    assert push_hello(hello) == wire
    assert pull_hello(wire) == hello
    assert pull_hello(bytearray(wire)) == hello
    assert pull_hello(memoryview(wire)) == hello


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (b"", "hello_length"),
        (bytes.fromhex("0001 0001 00000023 05dc 00"), "hello_length"),
        (bytes.fromhex("0001 0001 00000023 05dc 0000 00"), "hello_length"),
        (bytes.fromhex("0002 0001 00000023 05dc 0000"), "hello_version"),
        (bytes.fromhex("0000 0001 00000023 05dc 0000"), "hello_version"),
        (bytes.fromhex("0001 0002 00000023 05dc 0000"), "hello_reserved"),
        (bytes.fromhex("0001 8001 00000023 05dc 0000"), "hello_reserved"),
        (bytes.fromhex("0001 0001 00000080 05dc 0000"), "hello_reserved"),
        (bytes.fromhex("0001 0001 80000000 05dc 0000"), "hello_reserved"),
        (bytes.fromhex("0001 0001 00000023 05dc 0001"), "hello_reserved"),
        (bytes.fromhex("0001 0001 00000023 023f 0000"), "hello_mtu"),
        (bytes.fromhex("0001 0001 00000023 0000 0000"), "hello_mtu"),
    ],
)
def test_hello_refused(wire: bytes, reason: str) -> None:
    with pytest.raises(HelloRefused) as exc:
        pull_hello(wire)
    assert exc.value.reason == reason


@pytest.mark.parametrize(
    "hello",
    [Hello(2, 1, 0, 1500, 0), Hello(1, 2, 0, 1500, 0), Hello(1, 1, 0x80, 1500, 0), Hello(1, 1, 0, 1500, 1),
     Hello(1, 1, 0, 65536, 0), Hello(1, 1, 0, -1, 0)],
)
def test_push_hello_refuses_what_v1_cannot_carry(hello: Hello) -> None:
    with pytest.raises(LocalProtocolError):
        push_hello(hello)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=12, max_size=12))
def test_pull_hello_any_bytes(wire: bytes) -> None:
    try:
        h = pull_hello(wire)
    except HelloRefused:
        return
    assert push_hello(h) == wire


def test_negotiate_subset_and_mtu() -> None:
    guest = Hello(offloads=TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_UFO | TUN_F_USO4, mtu=9000)
    ans = negotiate(guest, HOST_OFFLOADS, 1500)
    assert ans == Hello(1, 1, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_USO4, 1500, 0)
    assert negotiate(Hello(mtu=1400), HOST_OFFLOADS, 1500).mtu == 1400
    assert negotiate(Hello(mtu=576), HOST_OFFLOADS, 65535).mtu == 576


def test_negotiate_prerequisites() -> None:
    # Segmentation without checksum offload is never granted, nor ECN without TSO.
    assert negotiate(Hello(offloads=TUN_F_TSO4 | TUN_F_USO4 | TUN_F_TSO_ECN)).offloads == 0
    assert negotiate(Hello(offloads=TUN_F_CSUM | TUN_F_TSO_ECN)).offloads == TUN_F_CSUM
    assert negotiate(Hello(offloads=TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO_ECN)).offloads == (
        TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO_ECN
    )
    # The host never grants what it lacks, whatever the guest offers.
    assert negotiate(Hello(offloads=TUN_F_ALL), TUN_F_CSUM).offloads == TUN_F_CSUM
    assert negotiate(Hello(offloads=TUN_F_ALL), TUN_F_CSUM | TUN_F_TSO4 | TUN_F_USO6).offloads == (
        TUN_F_CSUM | TUN_F_TSO4 | TUN_F_USO6
    )


def test_negotiate_flags() -> None:
    assert negotiate(Hello(flags=1)).on
    assert not negotiate(Hello(flags=0)).on
    assert not negotiate(Hello(flags=1), enable=False).on


@pytest.mark.parametrize("mtu", [0, 575, 65536])
def test_negotiate_host_mtu_bounds(mtu: int) -> None:
    with pytest.raises(LocalProtocolError):
        negotiate(Hello(), HOST_OFFLOADS, mtu)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 1), st.integers(0, TUN_F_ALL), st.integers(576, 65535),
    st.integers(0, 0xFFFFFFFF), st.integers(576, 65535),
)
def test_negotiate_properties(flags: int, offloads: int, mtu: int, host_off: int, host_mtu: int) -> None:
    ans = negotiate(Hello(1, flags, offloads, mtu, 0), host_off, host_mtu)
    assert ans.offloads & ~(offloads & host_off) == 0
    assert ans.mtu == min(mtu, host_mtu)
    assert ans.on == bool(flags)
    if ans.offloads & (TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN | TUN_F_UFO | TUN_F_USO4 | TUN_F_USO6):
        assert ans.offloads & TUN_F_CSUM
    if ans.offloads & TUN_F_TSO_ECN:
        assert ans.offloads & (TUN_F_TSO4 | TUN_F_TSO6)
    assert pull_hello(push_hello(ans)) == ans  # the answer is itself a valid hello


# ---------------------------------------------------------------- frames

VNET = bytes.fromhex("01 01 3600 a805 1400 1000")  # NEEDS_CSUM, TCPV4, hdr_len 54, gso 1448, 20/16
PKT20 = bytes.fromhex("45000014 00000000 4006 0000 0a000001 08080808")


def test_frame_golden() -> None:
    assert push_frame(VNET, PKT20) == bytes.fromhex("0000001e") + VNET + PKT20
    assert push_frame(bytes(10), bytes(65535))[:4] == bytes.fromhex("00010009")


@pytest.mark.parametrize(("vnet", "pkt"), [(bytes(9), PKT20), (bytes(11), PKT20), (VNET, bytes(19)),
                                           (VNET, bytes(65536))])
def test_push_frame_bounds(vnet: bytes, pkt: bytes) -> None:
    with pytest.raises(LocalProtocolError) as exc:
        push_frame(vnet, pkt)
    assert exc.value.reason == "bad_frame_length"


def _frames(count: int, seed: int = 1) -> list[bytes]:
    rnd = __import__("random").Random(seed)
    return [os.urandom(10 + rnd.choice([20, 21, 100, 1500, 9000, 65535, rnd.randint(20, 3000)]))
            for _ in range(count)]


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(push_frame(f[:10], f[10:]) for f in frames)


def _collect(dec: FrameDecoder, chunks: list[bytes | bytearray | memoryview]) -> list[bytes]:
    out: list[bytes] = []
    for c in chunks:
        out.extend(bytes(f) for f in dec.feed(c))
    return out


def test_decoder_whole() -> None:
    frames = _frames(20)
    dec = FrameDecoder()
    got = dec.feed(_wire(frames))
    assert [bytes(f) for f in got] == frames
    assert all(isinstance(f, memoryview) for f in got)  # zero-copy out of immutable bytes
    assert dec.pending == 0


def test_decoder_byte_at_a_time() -> None:
    frames = [bytes(range(30)), os.urandom(10 + 1500), os.urandom(10 + 65535), bytes(30)]
    wire = _wire(frames)
    dec = FrameDecoder()
    out: list[bytes] = []
    for i in range(len(wire)):
        got = dec.feed(wire[i : i + 1])
        out.extend(bytes(f) for f in got)
        assert len(out) == sum(1 for end in _ends(frames) if end <= i + 1)
    assert out == frames
    assert dec.pending == 0


def _ends(frames: list[bytes]) -> list[int]:
    ends, pos = [], 0
    for f in frames:
        pos += 4 + len(f)
        ends.append(pos)
    return ends


def test_decoder_trailing_partial_kept() -> None:
    frames = _frames(3)
    wire = _wire(frames)
    extra = push_frame(VNET, PKT20)
    dec = FrameDecoder()
    assert [bytes(f) for f in dec.feed(wire + extra[:7])] == frames
    assert dec.pending == 7
    assert [bytes(f) for f in dec.feed(extra[7:])] == [VNET + PKT20]
    assert dec.pending == 0


def test_decoder_copies_mutable_input() -> None:
    wire = bytearray(_wire([VNET + PKT20, VNET + PKT20]))
    dec = FrameDecoder()
    got = dec.feed(wire)
    wire[:] = bytes(len(wire))  # the caller reuses its receive buffer
    assert [bytes(f) for f in got] == [VNET + PKT20] * 2
    rw = bytearray(_wire([VNET + PKT20]))
    got = dec.feed(memoryview(rw))
    rw[:] = bytes(len(rw))
    assert [bytes(f) for f in got] == [VNET + PKT20]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(min_size=30, max_size=400), max_size=8), st.data())
def test_decoder_any_chunking(frames: list[bytes], data: st.DataObject) -> None:
    wire = _wire(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    kind = st.sampled_from(["bytes", "bytearray", "memoryview"])
    kinds = data.draw(st.lists(kind, min_size=13, max_size=13))
    chunks: list[bytes | bytearray | memoryview] = []
    prev = 0
    for i, cut in enumerate([*cuts, len(wire)]):
        piece = wire[prev:cut]
        chunks.append(bytearray(piece) if kinds[i] == "bytearray"
                      else memoryview(piece) if kinds[i] == "memoryview" else piece)
        prev = cut
    dec = FrameDecoder()
    assert _collect(dec, chunks) == frames
    assert dec.pending == 0


@pytest.mark.parametrize("n", [0, 1, 29, FRAME_LEN_MAX + 1, 0xFFFFFFFF])
def test_decoder_bad_length_is_fatal(n: int) -> None:
    for split in (None, 2, 4):
        dec = FrameDecoder()
        wire = push_frame(VNET, PKT20) + struct.pack("!I", n) + bytes(40)
        with pytest.raises(FrameRefused) as exc:
            if split is None:
                dec.feed(wire)
            else:
                dec.feed(wire[: 34 + split])
                dec.feed(wire[34 + split :])
        assert exc.value.reason == "bad_frame_length"
        assert dec.failed
        with pytest.raises(FrameRefused) as again:
            dec.feed(push_frame(VNET, PKT20))
        assert again.value.reason == "bad_frame_length"


def test_decoder_failure_carries_earlier_frames() -> None:
    good = push_frame(VNET, PKT20)
    wire = good * 3 + struct.pack("!I", 5) + good
    dec = FrameDecoder()
    with pytest.raises(FramingLost) as exc:
        dec.feed(wire)
    assert [bytes(f) for f in exc.value.frames] == [VNET + PKT20] * 3
    # fed in pieces: the frames already returned plus those in the failing call are the same three
    for step in (1, 7, 35):
        dec = FrameDecoder()
        got: list[bytes] = []
        with pytest.raises(FramingLost) as exc:
            for i in range(0, len(wire), step):
                got.extend(bytes(f) for f in dec.feed(wire[i : i + step]))
        got.extend(bytes(f) for f in exc.value.frames)
        assert got == [VNET + PKT20] * 3
    with pytest.raises(FramingLost) as exc:
        dec.feed(good)
    assert exc.value.frames == []


def test_decoder_bounds_accepted() -> None:
    for n in (FRAME_LEN_MIN, FRAME_LEN_MAX):
        frame = bytes(n)
        assert [bytes(f) for f in FrameDecoder().feed(struct.pack("!I", n) + frame)] == [frame]


def test_decoder_linear_in_small_chunks() -> None:
    # 200 x 64 KiB frames fed 1000 bytes at a time: quadratic buffering would take minutes.
    frame = bytes(FRAME_LEN_MAX)
    wire = _wire([frame] * 200)
    dec = FrameDecoder()
    t0 = time.perf_counter()
    count = 0
    for i in range(0, len(wire), 1000):
        count += len(dec.feed(wire[i : i + 1000]))
    assert count == 200
    assert time.perf_counter() - t0 < 5.0
