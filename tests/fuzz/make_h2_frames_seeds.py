"""Regenerates the HTTP/2 frame-size seed corpus under tests/seeds/h2_frames/ (run by hand; the files are committed).

Each seed is what ``fuzz_h2_frames.one_input`` takes: ``P`` and a client's bytes (the 24-byte preface is
skipped), or ``A`` and an app's; each is named ``<expected>-<what>``: ``ok`` when no frame header names
more than 16384 bytes, ``too_large`` when one does (the replay checks the name with ``classify``). Well-formed
frames are serialised by hyperframe, an encoder that is not the guard's; the over-limit headers are written
by hand, since no encoder should produce them. Usage: .venv/bin/python tests/fuzz/make_h2_frames_seeds.py
"""

from __future__ import annotations

from pathlib import Path

from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from seed_dir import write_seeds

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "seeds" / "h2_frames"

LIMIT = 16384  # fuzz_h2_frames.LIMIT
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
CLIENT, APP = b"P", b"A"
SSH_BANNER = b"SSH-2.0-OpenSSH_9.2\r\n"  # 0x535348 = 5,460,808 bytes, read as a frame header


def header(length: int, kind: int = 0, flags: int = 0, stream_id: int = 1) -> bytes:
    """A frame header naming ``length`` payload bytes (any length, unlike an encoder's)."""
    return length.to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big")


def data(n: int, stream_id: int = 1, fill: bytes = b"d") -> bytes:
    return DataFrame(stream_id, data=(fill * n)[:n]).serialize()


def settings() -> bytes:
    return SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 100,
                                      SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 20}).serialize()


def settings_ack() -> bytes:
    return SettingsFrame(0, flags=["ACK"]).serialize()


def zero_length() -> bytes:
    """Frames with no payload at all: a SETTINGS ack, an empty DATA that ends its stream, an empty HEADERS."""
    return (settings_ack() + DataFrame(1, flags=["END_STREAM"]).serialize()
            + HeadersFrame(3, data=b"", flags=["END_HEADERS"]).serialize())


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    # Nothing to judge.
    out["ok-empty"] = b""
    out["ok-empty-app-stream"] = APP
    out["ok-empty-client-stream"] = CLIENT
    out["ok-client-preface-only"] = CLIENT + PREFACE
    out["ok-client-half-a-preface"] = CLIENT + PREFACE[:11]
    out["ok-app-half-a-header-over-limit"] = APP + header(LIMIT + 1)[:3]  # not judged until it is whole
    out["ok-app-eight-bytes-of-a-huge-header"] = APP + header(1 << 20)[:8]
    # At the limit and one over it.
    out["ok-app-data-at-limit"] = APP + settings() + data(LIMIT)
    out["ok-app-unknown-type-at-limit"] = APP + header(LIMIT, kind=0xFA, stream_id=0) + b"u" * LIMIT
    out["ok-app-continuation-at-limit"] = (
        APP + HeadersFrame(1, data=b"h" * 100).serialize() + ContinuationFrame(1, data=b"c" * LIMIT).serialize())
    out["ok-client-preface-then-data-at-limit"] = (
        CLIENT + PREFACE + settings() + HeadersFrame(1, data=b"h" * 10, flags=["END_HEADERS"]).serialize()
        + data(LIMIT))
    out["too_large-app-data-one-over-limit"] = APP + header(LIMIT + 1) + b"d" * (LIMIT + 1)
    out["too_large-app-header-one-over-limit-alone"] = APP + header(LIMIT + 1)
    out["too_large-app-at-limit-then-one-over"] = APP + data(LIMIT) + header(LIMIT + 1) + b"x" * 100
    out["too_large-client-preface-then-one-over-limit"] = CLIENT + PREFACE + header(LIMIT + 1) + b"x" * 100
    out["too_large-app-largest-24-bit-length"] = APP + header((1 << 24) - 1)
    out["too_large-client-one-mib-data-header"] = CLIENT + PREFACE + header(1 << 20) + b"x" * 100
    # Zero-length frames, many tiny ones, payloads that look like headers.
    out["ok-app-zero-length-frames"] = APP + zero_length() * 20
    out["ok-client-preface-then-zero-length-frames"] = CLIENT + PREFACE + zero_length() * 20
    out["too_large-app-zero-length-frames-then-one-over"] = APP + zero_length() * 5 + header(LIMIT + 1)
    tiny = b"".join(data(1 + i % 8, stream_id=1 + 2 * (i % 50)) for i in range(600))  # headers at every offset mod 9
    out["ok-app-600-tiny-data-frames"] = APP + tiny
    out["ok-app-many-tiny-control-frames"] = APP + b"".join(
        PingFrame(0, opaque_data=b"p" * 8).serialize() + WindowUpdateFrame(0, window_increment=1 + i).serialize()
        + RstStreamFrame(1 + 2 * i, error_code=8).serialize() for i in range(300))
    out["too_large-app-600-tiny-frames-then-one-over"] = APP + tiny + header(LIMIT + 1) + b"x"
    out["ok-app-payload-that-reads-as-a-huge-header"] = APP + data(LIMIT, fill=b"\xff") + data(9, fill=b"\xff")
    goaway = GoAwayFrame(0, last_stream_id=7, additional_data=b"g" * 300).serialize()
    out["ok-app-goaway-with-debug-data"] = APP + goaway
    # The preface is skipped whatever it says, and only for a client.
    out["ok-client-ssh-banner-inside-the-skipped-preface"] = CLIENT + SSH_BANNER
    out["ok-client-any-24-bytes-skipped"] = CLIENT + (SSH_BANNER + b"\x00" * 24)[:24] + settings()
    out["too_large-app-connection-preface-reads-as-a-frame"] = APP + PREFACE + settings()
    # Peers that are not speaking HTTP/2.
    out["too_large-app-ssh-banner"] = APP + SSH_BANNER
    out["too_large-client-ssh-banner-after-preface"] = CLIENT + PREFACE + SSH_BANNER
    out["too_large-app-http11-response"] = APP + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
    out["too_large-client-http11-request-after-preface"] = CLIENT + PREFACE + b"GET / HTTP/1.1\r\nhost: a\r\n\r\n"
    out["too_large-app-tls-client-hello"] = APP + bytes.fromhex("160301020001000200030309") + b"\x00" * 40
    return out


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
