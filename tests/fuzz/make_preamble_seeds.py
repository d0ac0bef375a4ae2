"""Regenerates the preamble seed corpus under tests/seeds/preamble/ (run by hand; the files are committed).

Each seed is what ``fuzz_preamble.one_input`` takes: one byte choosing ``max_len`` (0: the default),
then the bytes the parser sees. Usage: .venv/bin/python tests/fuzz/make_preamble_seeds.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "protocol"))

from preamble_cases import GOLDEN, V4_ADDRS, build, golden_bytes  # noqa: E402
from seed_dir import write_seeds  # noqa: E402
from test_preamble import REASON_CASES  # noqa: E402

OUT = HERE.parent / "seeds" / "preamble"


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, _p, _crc, hexstr in GOLDEN:
        data = golden_bytes(hexstr)
        out[f"valid-{name}"] = b"\0" + data
        out[f"valid-{name}-trailing"] = b"\0" + data + b"GET / HTTP/1.1\r\n\r\n"
    v4 = golden_bytes(GOLDEN[0][3])
    crc6 = golden_bytes(GOLDEN[5][3])
    for cut in (1, 12, 13, 14, 15, 16, 27, 28, 30, len(v4) - 1):
        out[f"trunc-v4-{cut}"] = b"\0" + v4[:cut]
    for cut in (16, 52, 55, 59, len(crc6) - 1):
        out[f"trunc-v6crc-{cut}"] = b"\0" + crc6[:cut]
    for reason, name, data in REASON_CASES:
        out[f"refuse-{reason}-{name}"] = b"\0" + data
    # tricky: bounds at the edges, padding up to the bound, a back-to-back pair, huge declared lengths
    out["tricky-noop-pad-to-512"] = b"\0" + build(tlvs=[(0x04, bytes(512 - 16 - 12 - 3 - 7)), (0xE0, b"s")])
    out["tricky-noop-pad-to-513"] = b"\0" + build(tlvs=[(0x04, bytes(513 - 16 - 12 - 3 - 7)), (0xE0, b"s")])
    out["tricky-max-len-16"] = b"\x01" + v4
    out["tricky-max-len-huge-ffff"] = b"\x07" + build(tlvs=[(0x04, bytes(0xFFFF - 12 - 3 - 7)), (0xE0, b"s")])
    out["tricky-back-to-back"] = b"\0" + v4 + v4
    out["tricky-tlv-len-ffff"] = b"\x07" + build(length=12 + 3 + 4) + b"\xe0\xff\xff"
    out["tricky-crc-over-noop"] = b"\0" + build(tlvs=[(0x04, b"\0\0\0\0"), (0xE0, b"s")], crc=True)
    out["tricky-all-ignored"] = b"\0" + build(
        tlvs=[(t, b"v") for t in (0x01, 0x02, 0x04, 0x20, 0x30)] + [(0x05, b"u" * 128), (0xE0, b"z" * 64)]
    )
    out["tricky-v6-mapped-dst"] = b"\0" + build(
        fam=0x21, addrs=bytes(10) + b"\xff\xff\x7f\0\0\x01" + bytes(10) + b"\xff\xff\x7f\0\0\x01" + b"\0\x01\0\x01"
    )
    out["tricky-v4-all-zero-src"] = b"\0" + build(addrs=bytes(10) + V4_ADDRS[10:])
    # the deadline TLV (0xE1): its bounds, before the sandbox ID, under a CRC, beside every other field
    out["tricky-deadline-1ms"] = b"\0" + build(tlvs=[(0xE0, b"s"), (0xE1, b"\0\0\0\1")])
    out["tricky-deadline-300000ms-first"] = b"\0" + build(tlvs=[(0xE1, b"\0\x04\x93\xe0"), (0xE0, b"s")])
    out["tricky-deadline-300001ms"] = b"\0" + build(tlvs=[(0xE0, b"s"), (0xE1, b"\0\x04\x93\xe1")])
    out["tricky-deadline-under-crc"] = b"\0" + build(tlvs=[(0x05, b"c"), (0xE0, b"s"), (0xE1, b"\0\0\x27\x10")],
                                                      crc=True)
    out["tricky-deadline-cut-in-value"] = b"\0" + build(tlvs=[(0xE0, b"s"), (0xE1, b"\0\0\x27\x10")])[:-1]
    out["empty"] = b""
    out["only-bound-byte"] = b"\x05"
    return out


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
