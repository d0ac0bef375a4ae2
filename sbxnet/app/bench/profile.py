"""Where each process's CPU went, from a py-spy profile of a ``sbxnet bench`` run (no I/O but the file).

    py-spy record -s -n -r 97 -f raw -o prof.txt -- .venv/bin/python -m sbxnet.app.cli bench --arms ... --out DIR
    .venv/bin/python -m sbxnet.app.bench.profile prof.txt

py-spy's raw format is one line per distinct stack, ``frame;frame;...;frame count``, outermost first;
with ``--subprocesses`` a ``process PID:"command line"`` frame heads each process's part. Each sample is
put in one category by its innermost frame and its innermost Python frame (py-spy names unresolved
native frames by address only: in libc those are memmove/memcpy), and counted per process kind.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable

KINDS = (("sbxnet gateway", "gateway"), ("sbxnet forwarder", "forwarder"), ("bench.l7_hop", "l7 hop"),
         ("bench.http_app", "app"), ("forwarder_hop.py _client", "client"))

CATEGORIES = ("socket send/recv/read/write", "TLS (OpenSSL)", "HTTP parsing and framing", "epoll",
              "libc memcpy/malloc", "Python (our code, asyncio, the interpreter)")


def category(frames: list[str]) -> str:
    leaf = frames[-1] if frames else ""
    inner = next((f for f in reversed(frames) if ".py:" in f), "")
    if re.match(r"(__libc_)?(send|recv|read|write|splice)\w* \(", leaf):  # uvloop reads and writes sockets
        return CATEGORIES[0]
    if "SSLObject" in inner or "sslproto" in inner or "libcrypto" in leaf or "libssl" in leaf:
        return CATEGORIES[1]
    if "h11/" in inner or "httptools" in leaf:
        return CATEGORIES[2]
    if leaf.startswith("epoll"):
        return CATEGORIES[3]
    if "(libc.so" in leaf:
        return CATEGORIES[4]
    return CATEGORIES[5]


def summarize(lines: Iterable[str]) -> dict[str, Counter[str]]:
    """process kind -> category -> samples. Stacks of other processes (the runner, curl) are left out."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        heads = [i for i, f in enumerate(frames) if f.startswith("process ")]
        head = frames[heads[-1]] if heads else ""
        kind = next((k for needle, k in KINDS if needle in head), None)
        if kind is not None:
            out[kind][category(frames[heads[-1] + 1 if heads else 0:])] += int(count)
    return out


def table(summary: dict[str, Counter[str]]) -> str:
    kinds = [k for _, k in KINDS if k in summary]
    lines = ["| category | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for c in CATEGORIES:
        cells = [f"{100 * summary[k][c] / max(1, sum(summary[k].values())):.1f}%" for k in kinds]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("| samples | " + " | ".join(str(sum(summary[k].values())) for k in kinds) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="py-spy record -f raw output")
    args = ap.parse_args(argv)
    with open(args.raw) as f:
        print(table(summarize(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
