"""Fuzz target for the idle feed's codec (``one_input(data)``).

Invariant: ``pull_batch`` and ``pull_answer`` return a value or raise ``FeedError``, nothing else. A value
re-encodes to canonical bytes that parse back to the same value and re-encode to the same bytes, and it
means what the JSON meant (``json.loads`` of the input and of the canonical bytes are equal: no value was
changed on the way, only its spelling). ``classify`` is the batch outcome: "ok" or the refusal reason.
"""

from __future__ import annotations

import json

from sbxnet.protocol.feed import FeedError, pull_answer, pull_batch, push_answer, push_batch


def classify(data: bytes) -> str:
    try:
        batch = pull_batch(data)
    except FeedError as exc:
        return exc.reason
    again = push_batch(batch)
    if pull_batch(again) != batch or push_batch(pull_batch(again)) != again:
        raise AssertionError(f"{batch!r} does not round-trip")
    if json.loads(again) != json.loads(data.decode("utf-8")):
        raise AssertionError("the canonical bytes mean another batch than the input")
    return "ok"


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
