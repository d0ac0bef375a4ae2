"""Longer fuzzing of the egress protocol layer than the seed replay in the test suite.

A small coverage-guided mutation loop in pure Python (no atheris needed) over three targets in
tests/fuzz/: ``fuzz_egress_frames`` (hello, frame decoder, validation), ``fuzz_vxlan`` (decap, inner
IPv4, ARP) and ``fuzz_arp``. Each starts from its seed corpus (tests/seeds/<corpus>/), mutates with
protocol-aware fix-ups (IPv4 total length, UDP length, stream length prefix), and keeps an input that
reaches a line transition in forwarder/egress not seen before (traced with ``sys.settrace`` on a
fraction of runs). Targets take turns for the whole time given. A failing input is written to
--crash-dir and the run exits 1.

    .venv/bin/python bench/fuzz_egress.py --seconds 60 [--target all|egress_frames|vxlan|arp] [--seed 1]
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
from collections.abc import Callable
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PKG = str(ROOT / "forwarder" / "egress")
TARGETS = {"egress_frames": "fuzz_egress_frames", "vxlan": "fuzz_vxlan", "arp": "fuzz_arp"}
INTERESTING = [b"\x00", b"\xff", b"\x45", b"\x46", b"\x08", b"\x00\x14", b"\x00\x10", b"\x00\x06", b"\x01\x01",
               b"\x01\x05", b"\x01\x03", b"\x81", b"\xff\xff", b"\x00\x00\x00\x1e", b"\x00\x01\x00\x09",
               b"\x08\x00", b"\x08\x06", b"\x20\x00", b"\x40\x00"]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "fuzz" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def coverage_of(fn: Callable[[bytes], None], data: bytes) -> frozenset[tuple[str, int, int]]:
    edges: set[tuple[str, int, int]] = set()
    last = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            edges.add((frame.f_code.co_filename, last[0], frame.f_lineno))
            last[0] = frame.f_lineno
        return local

    def glob(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(PKG) else None

    sys.settrace(glob)
    try:
        fn(data)
    except Exception:
        pass  # reported by the untraced run
    finally:
        sys.settrace(None)
    return frozenset(edges)


def fix_ipv4(b: bytearray, at: int) -> None:
    """Make the IPv4 total length (and a UDP length) at ``at`` agree with the bytes that follow."""
    n = len(b) - at
    if n >= 20 and b[at] >> 4 == 4:
        struct.pack_into("!H", b, at + 2, min(n, 0xFFFF))
        if b[at + 9] == 17 and n >= 28:
            struct.pack_into("!H", b, at + 24, min(n - 20, 0xFFFF))


def fix_prefix(b: bytearray) -> None:
    """In a stream input (selector, maybe a hello, then frames), fix the first frame's length prefix."""
    at = 1 + (12 if b and b[0] >> 6 == 3 else 0)
    if len(b) >= at + 4:
        struct.pack_into("!I", b, at, len(b) - at - 4)
        fix_ipv4(b, at + 14)


def mutate(rng: random.Random, corpus_name: str, data: bytes, corpus: list[bytes]) -> bytes:
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
        elif op == 4 and n:
            at = rng.randrange(n)
            v = rng.choice(INTERESTING)
            b[at : at + len(v)] = v
        elif op == 5 and corpus:
            other = rng.choice(corpus)
            cut = rng.randint(0, len(b))
            b = b[:cut] + other[rng.randint(0, len(other)) :]
        elif op == 6:
            del b[rng.randint(0, len(b)) :]
        elif op == 7 and n:
            b[0] = rng.randrange(256)  # another selector: MTU, offloads, mode / checks
        elif op == 8:
            b += rng.randbytes(rng.randint(1, 64))
    if corpus_name == "egress_frames" and rng.random() < 0.6:
        if b and b[0] >> 6 == 0:
            fix_ipv4(b, 11)
        else:
            fix_prefix(b)
    elif corpus_name == "vxlan" and rng.random() < 0.5:
        fix_ipv4(b, 1 + 8 + 14)
    return bytes(b[:70000])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--target", choices=["all", *TARGETS], default="all")
    ap.add_argument("--seed", type=int, default=None, help="RNG seed (default: random, printed)")
    ap.add_argument("--trace-every", type=int, default=4, help="trace coverage on 1 run in N")
    ap.add_argument("--crash-dir", type=Path, default=ROOT / "build" / "fuzz-crashes" / "egress")
    args = ap.parse_args()

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    names = list(TARGETS) if args.target == "all" else [args.target]
    state: dict[str, tuple[Callable[[bytes], None], list[bytes]]] = {}
    seen: set[tuple[str, int, int]] = set()
    for name in names:
        fn = load(TARGETS[name]).one_input
        seeds_dir = ROOT / "tests" / "seeds" / name
        corpus = [p.read_bytes() for p in sorted(seeds_dir.iterdir())] if seeds_dir.is_dir() else [b"\0"]
        for c in corpus:
            seen |= coverage_of(fn, c)
        state[name] = (fn, corpus)
    start_edges = len(seen)
    runs = dict.fromkeys(names, 0)
    new = 0
    deadline = time.monotonic() + args.seconds
    i = 0
    while time.monotonic() < deadline:
        name = names[i % len(names)]
        i += 1
        fn, corpus = state[name]
        data = mutate(rng, name, rng.choice(corpus), corpus)
        runs[name] += 1
        try:
            fn(data)
        except Exception:
            args.crash_dir.mkdir(parents=True, exist_ok=True)
            path = args.crash_dir / f"{name}-crash-{hashlib.sha256(data).hexdigest()[:16]}"
            path.write_bytes(data)
            traceback.print_exc()
            print(f"FAILED {name} after {sum(runs.values())} runs (rng seed {seed}); input saved to {path}")
            return 1
        if i % args.trace_every == 0:
            edges = coverage_of(fn, data)
            if not edges <= seen:
                seen |= edges
                corpus.append(data)
                new += 1
    per = ", ".join(f"{k} {v}" for k, v in runs.items())
    print(f"ok: {sum(runs.values())} runs in {args.seconds:.0f} s ({per}; rng seed {seed}); "
          f"corpus +{new}; line transitions {len(seen)} (from {start_edges})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
