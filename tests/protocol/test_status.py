"""The 4-byte status record the forwarder sends after the preamble (documented in docs/preamble.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbxnet.protocol.status import STATUS_LEN, Status, StatusError, pull_status, push_status

GOLDEN = [
    (Status.OK, "53580100", False),
    (Status.NOT_LISTENING, "53580101", True),
    (Status.FORBIDDEN, "53580102", False),
    (Status.BAD_PREAMBLE, "53580103", False),
    (Status.INTERNAL, "53580104", False),
    (Status.UNAVAILABLE, "53580105", True),
]


@pytest.mark.parametrize(("status", "hexstr", "retryable"), GOLDEN)
def test_golden(status: Status, hexstr: str, retryable: bool) -> None:
    data = bytes.fromhex(hexstr)
    assert push_status(status) == data
    assert pull_status(data) == (status, STATUS_LEN)
    assert pull_status(data + b"tenant bytes") == (status, STATUS_LEN)
    assert status.retryable is retryable
    for n in range(STATUS_LEN):
        assert pull_status(data[:n]) is None


def test_every_code_has_a_golden() -> None:
    assert {g[0] for g in GOLDEN} == set(Status)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"X", "bad_magic"),
        (b"SY", "bad_magic"),
        (b"HTTP", "bad_magic"),
        (b"SX\x02\x00", "bad_version"),
        (b"SX\x00\x00", "bad_version"),
        (b"SX\x01\x06", "unknown_status"),
        (b"SX\x01\xff", "unknown_status"),
    ],
)
def test_refused(data: bytes, reason: str) -> None:
    with pytest.raises(StatusError) as ei:
        pull_status(data)
    assert ei.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=8))
def test_parse_or_refuse(data: bytes) -> None:
    try:
        got = pull_status(data)
    except StatusError:
        return
    if got is not None:
        status, n = got
        assert n == STATUS_LEN and push_status(status) == data[:STATUS_LEN]
