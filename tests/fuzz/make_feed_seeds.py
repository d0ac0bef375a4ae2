"""Regenerates the idle-feed seed corpus under tests/seeds/feed/ (run by hand; the files are committed).

Each seed is a request body for ``fuzz_feed.one_input``, named ``<expected>-<what>``: ``ok`` or the
reason ``pull_batch`` refuses it with (the replay checks the name against ``fuzz_feed.classify``).
Usage: .venv/bin/python tests/fuzz/make_feed_seeds.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "protocol"))

from feed_cases import ANSWER_GOLDEN, BATCH_REFUSALS, EQUIVALENT, GOLDEN, body, raw_entry  # noqa: E402

OUT = HERE.parent / "seeds" / "feed"


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, _batch, data in GOLDEN:
        out[f"ok-golden-{name}"] = data
        out[f"ok-golden-{name}-trailing-whitespace"] = data + b" \r\n"
        out[f"trailing_data-golden-{name}-then-bytes"] = data + b"POST /v1/feed"
    for name, data, _batch in EQUIVALENT:
        out[f"ok-{name}"] = data
    for reason, name, data in BATCH_REFUSALS:
        out[f"{reason}-{name}"] = data
    for i, (_answer, data, _status) in enumerate(ANSWER_GOLDEN):
        # An answer is no batch (its keys are unknown to one); the target also parses it as an answer.
        out[f"unknown_field-answer-{i}"] = data
    # tricky: many entries, an entry with every field at its bound, escapes that spell valid values
    many = ",".join(
        f'{{"sandbox":"s{i}","bytes_in":{i},"bytes_out":{2 * i},"open":{i % 3},"idle_s":{i / 7!r}}}'
        for i in range(300)
    )
    out["ok-tricky-300-sandboxes"] = raw_entry(many)
    out["duplicate_sandbox-tricky-last-of-300"] = raw_entry(many + ',{"sandbox":"s0","bytes_in":0,"bytes_out":0,'
                                                            '"open":0,"idle_s":0}')
    out["ok-tricky-bounds"] = body({"seq": 2**63 - 1, "epoch": "9223372036854775807-ffffffffffffffff"},
                                   {"sandbox": "Z" * 64, "bytes_in": 2**63 - 1, "bytes_out": 0, "open": 2**63 - 1,
                                    "idle_s": 2.0**32})
    out["ok-tricky-escaped-keys"] = body().replace(b'"seq"', b'"\\u0073eq"')
    out["duplicate_key-tricky-escaped-duplicate"] = body().replace(b'"seq":3', b'"seq":3,"\\u0073eq":3')
    out["bad_count-tricky-negative-zero-is-fine-but-minus-one-not"] = body(entry={"bytes_in": -1, "open": 0})
    out["bad_idle-tricky-subnormal-negative"] = body(entry={"idle_s": -5e-324})
    out["bad_type-tricky-big-float-for-int"] = body().replace(b'"seq":3', b'"seq":1e3')
    out["bad_json-tricky-deep-object"] = b'{"a":' * 3000 + b"1" + b"}" * 3000
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    for name, data in seeds().items():
        (OUT / name).write_bytes(data)
    print(f"{len(seeds())} seeds in {OUT}")


if __name__ == "__main__":
    main()
