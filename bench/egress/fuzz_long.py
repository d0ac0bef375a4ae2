"""A longer fuzz run of the egress packet-core targets (tests/fuzz/fuzz_rewrite.py, fuzz_segment.py).

Mutates the stored seeds (byte flips, truncation, splicing, and field-aware edits of the virtio_net_hdr
and IPv4/TCP/UDP headers toward boundary values) and feeds each target for a time budget. A failing
input is written to ``--crashes`` and the run exits 1. No coverage feedback (atheris is not installed
here); the field-aware mutator is what reaches the deep paths.

    .venv/bin/python bench/egress/fuzz_long.py --seconds 120 [--target rewrite|segment] [--seed N]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
sys.path.insert(0, str(ROOT))

from fuzz_rewrite import one_input as rewrite_input  # noqa: E402
from fuzz_segment import one_input as segment_input  # noqa: E402

TARGETS: dict[str, Callable[[bytes], None]] = {"rewrite": rewrite_input, "segment": segment_input}
SEEDS = ROOT / "tests" / "seeds"

# (offset in data, width, little-endian, interesting values); data[0] is the selector, then the frame.
FIELDS = [
    (1, 1, True, [0, 1, 2, 3, 0xFF]),  # vnet flags
    (2, 1, True, [0, 1, 3, 4, 5, 0x80, 0x81, 0x85, 0xFF]),  # gso_type
    (3, 2, True, [0, 20, 40, 60, 0xFFFF]),  # hdr_len
    (5, 2, True, [0, 1, 2, 7, 536, 1448, 1460, 1472, 1480, 1500, 8960, 0xFFFF]),  # gso_size
    (7, 2, True, [0, 4, 12, 16, 20, 24, 40, 0xFFFF]),  # csum_start
    (9, 2, True, [0, 2, 6, 8, 10, 12, 16, 18, 0xFFFF]),  # csum_offset
    (11, 1, False, [0x45, 0x46, 0x4F, 0x44, 0x65, 0x00]),  # version/IHL
    (13, 2, False, [0, 19, 20, 28, 40, 576, 1500, 0xFFFF]),  # total length
    (17, 2, False, [0, 0x2000, 0x4000, 0x0001, 0x8000, 0x1FFF]),  # flags/fragment offset
    (20, 1, False, [1, 6, 17, 0, 41, 255]),  # protocol
    (31, 1, False, [3, 8, 11, 12, 0]),  # ICMP type
    (43, 1, False, [0x00, 0x40, 0x50, 0x80, 0xF0]),  # TCP data offset
    (44, 1, False, [0x00, 0x01, 0x02, 0x08, 0x10, 0x80, 0xFF]),  # TCP flags
]


def mutate(rnd: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randrange(1, 4)):
        op = rnd.randrange(7)
        if op == 0 and b:
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
        elif op == 1 and b:
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif op == 2 and b:
            del b[rnd.randrange(len(b)) :]
        elif op == 3:
            b += rnd.randbytes(rnd.randrange(1, 64))
        elif op == 4:
            other = rnd.choice(corpus)
            cut = rnd.randrange(len(other) + 1)
            b = b[: rnd.randrange(len(b) + 1)] + other[cut:]
        elif op == 5 and b:
            b[0] = rnd.randrange(256)
        else:
            off, width, le, values = rnd.choice(FIELDS)
            if off + width <= len(b):
                b[off : off + width] = rnd.choice(values).to_bytes(width, "little" if le else "big")
    b = b[: 65535 + 11]
    if len(b) >= 31 and rnd.random() < 0.5:
        # fix up lengths so that more mutants get past the length checks to the deep paths
        b[13:15] = (len(b) - 11).to_bytes(2, "big")
        ihl = (b[11] & 15) * 4
        if b[20] == 17 and len(b) >= 11 + ihl + 8:
            b[11 + ihl + 4 : 11 + ihl + 6] = (len(b) - 11 - ihl).to_bytes(2, "big")
    return bytes(b)


def run(target: str, seconds: float, seed: int, crashes: Path) -> tuple[int, int]:
    """Fuzz ``target`` for ``seconds``; returns (executions, failures)."""
    fn = TARGETS[target]
    corpus = [p.read_bytes() for p in sorted((SEEDS / target).iterdir())]
    rnd = random.Random(seed)
    execs = fails = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = mutate(rnd, rnd.choice(corpus), corpus)
        execs += 1
        try:
            fn(data)
        except Exception:
            fails += 1
            crashes.mkdir(parents=True, exist_ok=True)
            path = crashes / f"{target}-{hashlib.sha256(data).hexdigest()[:16]}"
            path.write_bytes(data)
            print(f"FAIL {target}: {path}\n{traceback.format_exc()}", file=sys.stderr)
    return execs, fails


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="per target")
    ap.add_argument("--target", choices=sorted(TARGETS), action="append")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--crashes", type=Path, default=ROOT / "bench" / "egress" / "crashes")
    args = ap.parse_args(argv)
    failed = 0
    for target in args.target or sorted(TARGETS):
        execs, fails = run(target, args.seconds, args.seed, args.crashes)
        print(f"{target}: {execs} inputs in {args.seconds:.0f} s, {fails} failures (seed {args.seed})")
        failed += fails
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
