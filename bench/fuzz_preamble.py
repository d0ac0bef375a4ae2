"""Longer fuzzing of the preamble parser than the seed replay in the test suite.

A small coverage-guided mutation loop in pure Python (no atheris needed): starts from the seed corpus
in tests/seeds/preamble/, mutates, runs ``tests/fuzz/fuzz_preamble.one_input``, and keeps an input
when it reaches a line transition of the parser not seen before (traced with ``sys.settrace``, so it
is slow but guided). A failing input is written to --crash-dir and the run exits 1.

    .venv/bin/python bench/fuzz_preamble.py --seconds 60 [--seed 1] [--save-new tests/seeds/preamble]

With atheris installed, ``python tests/fuzz/fuzz_preamble.py tests/seeds/preamble`` runs libFuzzer
on the same target instead.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import random
import struct
import sys
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sbxnet.protocol import preamble as preamble_mod  # noqa: E402

_spec = importlib.util.spec_from_file_location("fuzz_preamble", ROOT / "tests" / "fuzz" / "fuzz_preamble.py")
assert _spec is not None and _spec.loader is not None
fuzz_target = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_target)
one_input = fuzz_target.one_input

TARGET_FILE = preamble_mod.__file__
INTERESTING = [
    b"\x00\x00",
    b"\xff\xff",
    b"\x21\x11",
    b"\x21\x21",
    b"\xe0",
    b"\x05",
    b"\x03\x00\x04",
    b"\x04",
    b"\x7f\x00\x00\x01",
    b"\x00\x40",
    b"\x00\x80",
    b"\x01\xf0",
]


def coverage_of(data: bytes) -> frozenset[tuple[int, int]]:
    edges: set[tuple[int, int]] = set()
    last = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            edges.add((last[0], frame.f_lineno))
            last[0] = frame.f_lineno
        return local

    def glob(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == TARGET_FILE else None

    sys.settrace(glob)
    try:
        one_input(data)
    except Exception:
        pass  # reported by the untraced run
    finally:
        sys.settrace(None)
    return frozenset(edges)


def fix_length(b: bytearray) -> None:
    if len(b) >= 17:
        b[15:17] = struct.pack("!H", (len(b) - 17) % 0x10000)


def fix_crc(b: bytearray) -> None:
    # the fuzz input's first byte is the bound selector; the preamble starts at 1
    at = b.find(b"\x03\x00\x04", 17)
    if at >= 0 and at + 7 <= len(b):
        body = bytes(b[1:])
        v = at - 1 + 3
        crc = preamble_mod.crc32c_checksum(body[:v] + b"\0\0\0\0" + body[v + 4 :])
        b[at + 3 : at + 7] = struct.pack("!I", crc)


def mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        n = len(b)
        if op == 0 and n:
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            b[rng.randrange(n)] = rng.randrange(256)
        elif op == 2:
            at = rng.randint(0, n)
            b[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and n:
            at = rng.randrange(n)
            del b[at : at + rng.randint(1, 8)]
        elif op == 4:
            at = rng.randint(0, n)
            b[at:at] = rng.choice(INTERESTING)
        elif op == 5:
            b += (
                bytes((rng.randrange(256),)) + struct.pack("!H", rng.randint(0, 80)) + rng.randbytes(rng.randint(0, 80))
            )
        elif op == 6 and corpus:
            other = rng.choice(corpus)
            cut = rng.randint(0, len(b))
            b = b[:cut] + other[rng.randint(0, len(other)) :]
        elif op == 7:
            fix_length(b)
        elif op == 8:
            del b[rng.randint(0, len(b)) :]
    if rng.random() < 0.5:
        fix_length(b)
    if rng.random() < 0.5:
        fix_crc(b)
    return bytes(b[:4096])  # longer inputs only slow the loop: the bound is checked on the header


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=None, help="RNG seed (default: random, printed)")
    ap.add_argument("--seeds-dir", type=Path, default=ROOT / "tests" / "seeds" / "preamble")
    ap.add_argument("--crash-dir", type=Path, default=ROOT / "build" / "fuzz-crashes" / "preamble")
    ap.add_argument("--save-new", type=Path, default=None, help="write inputs that found new coverage here")
    args = ap.parse_args()

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    corpus = [p.read_bytes() for p in sorted(args.seeds_dir.iterdir())] if args.seeds_dir.is_dir() else []
    if not corpus:
        corpus = [b"\0"]
    seen: set[tuple[int, int]] = set()
    for c in corpus:
        seen |= coverage_of(c)
    start_edges = len(seen)
    runs = new = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        data = mutate(rng, rng.choice(corpus), corpus)
        runs += 1
        try:
            one_input(data)
        except Exception:
            args.crash_dir.mkdir(parents=True, exist_ok=True)
            path = args.crash_dir / f"crash-{hashlib.sha256(data).hexdigest()[:16]}"
            path.write_bytes(data)
            traceback.print_exc()
            print(f"FAILED after {runs} runs (rng seed {seed}); input saved to {path}")
            return 1
        edges = coverage_of(data)
        if not edges <= seen:
            seen |= edges
            corpus.append(data)
            new += 1
            if args.save_new is not None:
                args.save_new.mkdir(parents=True, exist_ok=True)
                (args.save_new / f"found-{hashlib.sha256(data).hexdigest()[:16]}").write_bytes(data)
    print(
        f"ok: {runs} runs in {args.seconds:.0f} s (rng seed {seed}); corpus {len(corpus)} (+{new}); "
        f"parser line transitions {len(seen)} (from {start_edges})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
