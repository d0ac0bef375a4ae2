"""The link sequence as an in-memory gateway/forwarder pair: no sockets, no clock but the one passed in."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from preamble_cases import GOLDEN

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.link import Answered, ForwarderSequence, GatewaySequence, Opened
from sbxnet.protocol.preamble import Preamble, PreambleError, push_preamble
from sbxnet.protocol.status import Status, StatusError

P = Preamble(ipaddress.ip_address("192.0.2.7"), 40000, ipaddress.ip_address("10.0.0.5"), 8080, "sb-1", b"c-1")
T0 = 1000.0


def chunks(data: bytes, how: str) -> Iterator[bytes]:
    if how == "whole":
        yield data
    elif how == "bytewise":
        for i in range(len(data)):
            yield data[i : i + 1]
    else:  # in two, split in the middle
        yield data[: len(data) // 2]
        yield data[len(data) // 2 :]


def run_pair(
    p: Preamble, *, tenant_up: bytes, status: Status, tenant_down: bytes, how: str
) -> tuple[Opened, Answered, GatewaySequence]:
    gw = GatewaySequence.for_preamble(p, now=T0, timeout=2.0)
    fw = ForwarderSequence(now=T0, timeout=2.0)
    opened = None
    for c in chunks(gw.start() + tenant_up, how):
        assert opened is None
        opened = fw.receive_data(c, T0 + 0.1)
    assert opened is not None
    answered = None
    for c in chunks(fw.answer(status) + tenant_down, how):
        assert answered is None
        answered = gw.receive_data(c, T0 + 0.2)
    assert answered is not None
    return opened, answered, gw


@pytest.mark.parametrize("how", ["whole", "bytewise", "halves"])
@pytest.mark.parametrize(("name", "p", "crc", "_hex"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_every_golden_preamble_opens_and_the_answer_comes_back(
    how: str, name: str, p: Preamble, crc: bool, _hex: str
) -> None:
    opened, answered, gw = run_pair(p, tenant_up=b"", status=Status.OK, tenant_down=b"", how=how)
    assert opened.preamble == p and opened.leftover == b""
    assert answered == Answered(Status.OK, b"")
    assert gw.may_send


def test_tenant_bytes_that_share_records_are_kept_each_way() -> None:
    opened, answered, _ = run_pair(P, tenant_up=b"GET / HTTP/1.1\r\n", status=Status.OK, tenant_down=b"HTTP/1.1 200",
                                   how="whole")
    assert opened.leftover == b"GET / HTTP/1.1\r\n"
    assert answered == Answered(Status.OK, b"HTTP/1.1 200")


def test_leftover_is_exactly_what_followed_the_preamble_in_the_same_input() -> None:
    fw = ForwarderSequence(now=T0, timeout=2.0)
    wire = push_preamble(P)
    assert fw.receive_data(wire[:10], T0) is None
    opened = fw.receive_data(wire[10:] + b"tenant", T0)
    assert opened == Opened(P, b"tenant")


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.OK])
def test_a_refusal_reaches_the_gateway_and_forbids_sending(status: Status) -> None:
    _, answered, gw = run_pair(P, tenant_up=b"", status=status, tenant_down=b"", how="whole")
    assert answered.status is status
    assert not gw.may_send
    assert answered.status.retryable == (status in (Status.NOT_LISTENING, Status.UNAVAILABLE))


def test_the_forwarder_may_refuse_before_any_preamble_byte() -> None:
    fw = ForwarderSequence(now=T0, timeout=2.0)
    assert fw.answer(Status.FORBIDDEN) == b"SX\x01\x02"
    with pytest.raises(LocalProtocolError):
        fw.answer(Status.FORBIDDEN)


def test_ok_needs_a_whole_preamble_and_is_sent_once() -> None:
    fw = ForwarderSequence(now=T0, timeout=2.0)
    with pytest.raises(LocalProtocolError, match="not_opened"):
        fw.answer(Status.OK)
    fw.receive_data(push_preamble(P), T0)
    fw.answer(Status.OK)
    with pytest.raises(LocalProtocolError, match="answered"):
        fw.answer(Status.INTERNAL)
    with pytest.raises(LocalProtocolError, match="preamble_done"):
        fw.receive_data(b"more", T0)


def test_the_gateway_may_not_send_before_ok() -> None:
    gw = GatewaySequence.for_preamble(P, now=T0, timeout=2.0)
    assert not gw.may_send
    with pytest.raises(LocalProtocolError, match="not_started"):
        gw.receive_data(b"SX", T0)
    gw.start()
    with pytest.raises(LocalProtocolError, match="started"):
        gw.start()
    assert gw.receive_data(b"SX\x01", T0) is None
    assert not gw.may_send
    assert gw.receive_data(b"\x00", T0) == Answered(Status.OK, b"")
    assert gw.may_send


def test_preamble_deadline_comes_from_the_now_passed_in() -> None:
    fw = ForwarderSequence(now=T0, timeout=2.0)
    assert fw.deadline == T0 + 2.0
    wire = push_preamble(P)
    assert fw.receive_data(wire[:5], T0 + 2.0) is None  # at the deadline: still in time
    with pytest.raises(PreambleError) as e:
        fw.receive_data(wire[5:], T0 + 2.0001)
    assert e.value.reason == "timeout"
    assert "5 bytes in 2.0s" in e.value.detail


def test_an_idle_timeout_waits_for_the_first_byte_then_the_preamble_timeout_runs_from_it() -> None:
    fw = ForwarderSequence(now=T0, timeout=2.0, idle_timeout=30.0)
    assert fw.deadline == T0 + 30.0  # a pooled link may wait this long for its first byte
    wire = push_preamble(P)
    assert fw.receive_data(b"", T0 + 29.0) is None  # an empty read is not a first byte
    assert fw.deadline == T0 + 30.0
    assert fw.receive_data(wire[:5], T0 + 29.0) is None
    assert fw.deadline == T0 + 31.0  # from the first byte, not from the handshake
    assert fw.receive_data(wire[5:9], T0 + 30.5) is None  # past the idle deadline: the preamble's runs
    with pytest.raises(PreambleError) as e:
        fw.receive_data(wire[9:], T0 + 31.0001)
    assert (e.value.reason, e.value.detail) == ("timeout", "9 bytes in 2.0s")


def test_a_link_that_never_sends_a_byte_expires_as_idle() -> None:
    fw = ForwarderSequence(now=T0, timeout=2.0, idle_timeout=30.0)
    with pytest.raises(PreambleError) as e:
        fw.receive_data(push_preamble(P), T0 + 30.0001)
    assert (e.value.reason, e.value.detail) == ("idle", "no byte in 30.0s")
    with pytest.raises(PreambleError) as e:
        ForwarderSequence(now=T0, timeout=2.0, idle_timeout=30.0).expire()
    assert e.value.reason == "idle"
    # Without an idle timeout nothing changes: the preamble timeout runs from construction.
    with pytest.raises(PreambleError) as e:
        ForwarderSequence(now=T0, timeout=2.0).expire()
    assert e.value.reason == "timeout"


def test_expire_and_eof_name_what_had_arrived() -> None:
    fw = ForwarderSequence(now=T0, timeout=0.5)
    fw.receive_data(push_preamble(P)[:7], T0)
    with pytest.raises(PreambleError) as e:
        fw.expire()
    assert (e.value.reason, e.value.detail) == ("timeout", "7 bytes in 0.5s")
    with pytest.raises(PreambleError) as e:
        fw.receive_eof()
    assert (e.value.reason, e.value.detail) == ("eof", "after 7 bytes")
    with pytest.raises(PreambleError) as e:
        ForwarderSequence(now=T0, timeout=0.5).receive_eof()  # not one byte: a link nobody used
    assert e.value.reason == "unused"


def test_the_length_bound_is_the_forwarders() -> None:
    long = Preamble(P.src, P.src_port, P.dst, P.dst_port, "s" * 64, b"u" * 128)
    wire = push_preamble(long)
    assert len(wire) > 100
    fw = ForwarderSequence(now=T0, timeout=2.0, max_len=100)
    with pytest.raises(PreambleError) as e:
        fw.receive_data(wire, T0)
    assert e.value.reason == "too_long"
    assert ForwarderSequence(now=T0, timeout=2.0, max_len=len(wire)).receive_data(wire, T0) is not None


def test_bad_preamble_bytes_are_refused_on_the_first_wrong_byte() -> None:
    fw = ForwarderSequence(now=T0, timeout=2.0)
    with pytest.raises(PreambleError) as e:
        fw.receive_data(b"GET / HTTP/1.1\r\n", T0)
    assert e.value.reason == "bad_signature"


def test_gateway_status_errors() -> None:
    gw = GatewaySequence(b"x", now=T0, timeout=1.0)
    gw.start()
    with pytest.raises(StatusError) as e:
        gw.receive_data(b"HT", T0)
    assert e.value.reason == "bad_magic"
    gw = GatewaySequence(b"x", now=T0, timeout=1.0)
    gw.start()
    gw.receive_data(b"S", T0)
    with pytest.raises(StatusError) as e:
        gw.receive_data(b"X", T0 + 1.5)
    assert e.value.reason == "timeout"
    with pytest.raises(StatusError) as e:
        gw.receive_eof()
    assert e.value.reason == "eof"


@given(st.binary(max_size=64), st.binary(max_size=64), st.sampled_from(list(Status)), st.integers(1, 16))
def test_random_chunking_never_loses_or_duplicates_a_byte(up: bytes, down: bytes, status: Status, step: int) -> None:
    gw = GatewaySequence.for_preamble(P, now=T0, timeout=2.0)
    fw = ForwarderSequence(now=T0, timeout=2.0)
    wire = gw.start() + up
    opened = None
    i = 0
    while opened is None:
        opened = fw.receive_data(wire[i : i + step], T0)
        i += step
    assert opened.preamble == P
    assert opened.leftover + wire[i:] == up
    back = fw.answer(status) + down
    answered = None
    j = 0
    while answered is None:
        answered = gw.receive_data(back[j : j + step], T0)
        j += step
    assert answered.status is status
    assert answered.leftover + back[j:] == down
