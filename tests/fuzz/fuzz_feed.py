"""Fuzz target for the idle feed's codec (``one_input(data)``).

Invariant: ``pull_batch`` and ``pull_answer`` return a value or raise ``FeedError``, nothing else. A value
re-encodes to canonical bytes that parse back to the same value and re-encode to the same bytes (by
``push_batch`` and by ``push_columns`` from the batch's columns alike), and it means what the JSON meant
(``json.loads`` of the input and of the canonical bytes are equal: no value was changed on the way, only
its spelling; a batch in the row form means its columns, idle_s to the ms). ``classify`` is the batch
outcome: "ok" or the refusal reason.
"""

from __future__ import annotations

import json
from typing import Any

from sbxnet.protocol.feed import (
    FeedError,
    are_sandbox_ids,
    pull_answer,
    pull_batch,
    push_answer,
    push_batch,
    push_columns,
)


def classify(data: bytes) -> str:
    try:
        batch = pull_batch(data)
    except FeedError as exc:
        return exc.reason
    again = push_batch(batch)
    if pull_batch(again) != batch or push_batch(pull_batch(again)) != again:
        raise AssertionError(f"{batch!r} does not round-trip")
    rs = batch.sandboxes
    columns = ([r.sandbox for r in rs], [r.bytes_in for r in rs], [r.bytes_out for r in rs], [r.open for r in rs],
               [round(r.idle_s * 1000) for r in rs])
    if push_columns(batch.epoch, batch.seq, *columns) != again or not are_sandbox_ids(columns[0]):
        raise AssertionError(f"{batch!r}: push_columns disagrees with push_batch")
    if json.loads(again) != _as_columns(json.loads(data.decode("utf-8"))):
        raise AssertionError("the canonical bytes mean another batch than the input")
    return "ok"


def _as_columns(doc: dict[str, Any]) -> dict[str, Any]:
    """A batch's JSON in the column form: the row form's entries turned into arrays, its idle_s to ms."""
    if "bytes_in" in doc:
        return doc
    rows = doc["sandboxes"]
    return {
        "epoch": doc["epoch"],
        "seq": doc["seq"],
        "sandboxes": [r["sandbox"] for r in rows],
        **{k: [r[k] for r in rows] for k in ("bytes_in", "bytes_out", "open")},
        "idle_ms": [round(r["idle_s"] * 1000) for r in rows],
    }


def check_answer(data: bytes) -> None:
    try:
        answer = pull_answer(data)
    except FeedError:
        return
    again = push_answer(answer)
    if pull_answer(again, answer.http_status) != answer or json.loads(again) != json.loads(data.decode("utf-8")):
        raise AssertionError(f"{answer!r} does not round-trip")


def one_input(data: bytes) -> None:
    classify(data)
    check_answer(data)


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
