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

from feed_cases import (  # noqa: E402
    ANSWER_GOLDEN,
    BATCH_REFUSALS,
    EQUIVALENT,
    GOLDEN,
    ROW_REFUSALS,
    ROWS,
    body,
    raw_columns,
)
from seed_dir import write_seeds  # noqa: E402

OUT = HERE.parent / "seeds" / "feed"


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, _batch, data in GOLDEN:
        out[f"ok-golden-{name}"] = data
        out[f"ok-golden-{name}-trailing-whitespace"] = data + b" \r\n"
        out[f"trailing_data-golden-{name}-then-bytes"] = data + b"POST /v1/feed"
    for name, data, _batch in EQUIVALENT:
        out[f"ok-{name}"] = data
    for reason, name, data in BATCH_REFUSALS + ROW_REFUSALS:
        out[f"{reason}-{name}"] = data
    for name, data, _batch in ROWS:
        out[f"ok-rows-{name}"] = data
    for i, (_answer, data, _status) in enumerate(ANSWER_GOLDEN):
        # An answer is no batch (its keys are unknown to one); the target also parses it as an answer.
        out[f"unknown_field-answer-{i}"] = data
    # tricky: many entries, an entry with every field at its bound, escapes that spell valid values, the
    # text push_columns judges (an ID holding the separator, numbers at the digit count of their bound)
    n = 300
    ids = ",".join(f'"s{i}"' for i in range(n))
    ins, outs = ",".join(str(i) for i in range(n)), ",".join(str(2 * i) for i in range(n))
    opens, idles = ",".join(str(i % 3) for i in range(n)), ",".join(str(i * 143) for i in range(n))
    out["ok-tricky-300-sandboxes"] = raw_columns(ids, ins, outs, opens, idles)
    out["duplicate_sandbox-tricky-last-of-300"] = raw_columns(ids + ',"s0"', ins + ",0", outs + ",0", opens + ",0",
                                                              idles + ",0")
    out["bad_length-tricky-one-short-of-300"] = raw_columns(ids, ins, outs, opens, idles.rpartition(",")[0])
    out["ok-tricky-bounds"] = body({"seq": 2**63 - 1, "epoch": "9223372036854775807-ffffffffffffffff"},
                                   {"sandbox": "Z" * 64, "bytes_in": 2**63 - 1, "bytes_out": 0, "open": 2**63 - 1,
                                    "idle_ms": 2**32 * 1000})
    out["bad_count-tricky-19-digits-over"] = body(entry={"bytes_in": 9999999999999999999})
    out["bad_idle-tricky-13-digits-over"] = body(entry={"idle_ms": 9999999999999})
    out["bad_sandbox_id-tricky-separator-inside-an-id"] = raw_columns('"a\\",\\"b"', "1", "1", "0", "0")
    out["ok-tricky-escaped-keys"] = body().replace(b'"seq"', b'"\\u0073eq"')
    out["duplicate_key-tricky-escaped-duplicate"] = body().replace(b'"seq":3', b'"seq":3,"\\u0073eq":3')
    out["bad_count-tricky-negative-zero-is-fine-but-minus-one-not"] = body(entry={"bytes_in": -1, "open": 0})
    out["bad_type-tricky-big-float-for-int"] = body().replace(b'"seq":3', b'"seq":1e3')
    out["bad_json-tricky-deep-object"] = b'{"a":' * 3000 + b"1" + b"}" * 3000
    return out


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
