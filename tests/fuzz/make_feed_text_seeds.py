"""Regenerates the seed corpus of native/feed_text.c under tests/seeds/feed_text/ (run by hand; the files
are committed). Each seed is an input for ``fuzz_feed_text.one_input``: a time, a bound, then values.
Usage: .venv/bin/python tests/fuzz/make_feed_text_seeds.py
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from seed_dir import write_seeds

OUT = Path(__file__).resolve().parent.parent / "seeds" / "feed_text"
MAX = 2**63 - 1


def seed(now: float, high: int, values: list[int | float]) -> bytes:
    out = struct.pack("<dq", now, high)
    for v in values:
        out += struct.pack("<q", v) if isinstance(v, int) else struct.pack("<d", v)
    return out


def seeds() -> dict[str, bytes]:
    return {
        "empty": b"",
        "no-values": seed(1.0, MAX, []),
        "digits-of-every-length": seed(1.0, MAX, [10**k for k in range(19)] + [10**k - 1 for k in range(1, 19)]),
        "int64-bounds": seed(1.0, MAX, [0, MAX, -1, -(2**63)]),
        "above-a-bound": seed(1.0, 4294967296000, [4294967296000, 4294967296001]),
        "bound-zero": seed(1.0, 0, [0, 1]),
        "negative-bound": seed(1.0, -5, [0]),
        # ages: ties to even at half a millisecond, a time ahead, far older than the bound, not finite
        "ages-ties": seed(1.0, 2**32 * 1000, [0.9995, 0.9985, 0.9975, 1.0005, 0.5]),
        "ages-ahead-and-old": seed(100.0, 2**32 * 1000, [100.5, -1e300, 1e300, 99.9999999]),
        "ages-nan": seed(1.0, 10, [math.nan]),
        "ages-inf": seed(1.0, 10, [math.inf, -math.inf]),
        "ages-now-nan": seed(math.nan, 10, [1.0]),
        "ages-now-huge": seed(1.7976931348623157e308, 2**53 - 1, [-1.7976931348623157e308, 0.0]),
        "ages-subnormal": seed(5e-324, 1000, [0.0, -5e-324]),
    }


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
