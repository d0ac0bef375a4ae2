"""Cold start: the sandbox's program starts listening 400 ms after the connection arrives."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, preamble_for

from sbxnet.backoff import backoff_delays
from sbxnet.protocol.status import Status


def test_backoff_schedule_is_5ms_doubling_to_a_50ms_cap() -> None:
    gen = backoff_delays(0.005, 0.05)
    assert [round(next(gen), 4) for _ in range(7)] == [0.005, 0.01, 0.02, 0.04, 0.05, 0.05, 0.05]


@dataclass
class ColdStart:
    listened: float  # the program listened this long after the preamble was sent (the client's clock)
    attempt_lag: float  # the forwarder's connecting attempt began this long after the listen
    attempts: int
    answered_lag: float  # the client had its status this long after the listen


def _answer_after_listen(
    fwd: ForwarderThread, pki: Pki, caplog: pytest.LogCaptureFixture, listen_after: float
) -> ColdStart:
    app = SandboxApp(lambda conn: conn.sendall(b"hi"), listen=False)
    client = GwClient(fwd.port, pki.client_ctx())
    client.handshake()
    t0 = time.monotonic()
    timer = threading.Timer(listen_after, app.listen)
    timer.start()
    client.send(preamble_for(app.port))
    status = client.recv_exact(4)
    answered = time.monotonic()
    timer.join()
    assert status == b"SX\x01\x00"
    assert client.recv_exact(2) == b"hi"  # sent through the plane, so "connected" is logged by now
    client.close()
    app.close()
    # The forwarder runs in this process: its time.monotonic() is the clock app.listened_at was read on.
    (connected,) = [
        r
        for r in caplog.records
        if getattr(r, "event", None) == "connected" and getattr(r, "target", None) == f"127.0.0.1:{app.port}"
    ]
    fields = connected.__dict__["fields"]
    return ColdStart(
        listened=app.listened_at - t0,
        attempt_lag=fields["attempt_started"] - app.listened_at,
        attempts=fields["attempts"],
        answered_lag=answered - app.listened_at,
    )


@pytest.mark.parametrize("cap", [0.05, 0.015])
def test_answered_promptly_after_listen(
    make_forwarder: Callable[..., ForwarderThread], pki: Pki, caplog: pytest.LogCaptureFixture, cap: float
) -> None:
    caplog.set_level(logging.INFO, logger="sbxnet.forwarder")
    fwd = make_forwarder(connect_backoff_cap=cap)
    runs = [_answer_after_listen(fwd, pki, caplog, 0.4) for _ in range(3)]
    print(
        f"cap {cap * 1000:.0f} ms: connecting attempt began {[round(r.attempt_lag * 1000, 1) for r in runs]} ms, "
        f"status answered {[round(r.answered_lag * 1000, 1) for r in runs]} ms after listen"
    )
    for r in runs:
        assert 0.39 < r.listened < 0.7  # the setup: the program really started late
        assert r.attempts >= 5, r  # refused until then, the backoff ramped up to its cap
        # Between the listen and the next attempt there is at most one capped backoff step, plus the
        # event loop's lateness in waking from it (the margin). Taken from the forwarder's own attempt
        # timestamp: the client's view adds the TLS write and two thread wake-ups, which other jobs on
        # the same cores stretch. (An attempt that began a moment before the listen may still connect.)
        assert -0.02 < r.attempt_lag < cap + 0.025, r
        # End to end, loosely: the old 1 s-SYN backoff held the answer 300-370 ms.
        assert r.answered_lag < 0.25, r
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_connect_seconds_count", {"result": "ok"}) == 3


def test_unanswered_syn_is_replaced_every_50ms(make_forwarder: Callable[..., ForwarderThread], pki: Pki) -> None:
    # A listener whose accept queue is full drops new SYNs without answering (no RST): on loopback
    # that is the "sandbox still booting" case. Each attempt must be abandoned after 50 ms for a
    # fresh SYN instead of waiting for the kernel's 1 s retransmit.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    filler = socket.create_connection(lsock.getsockname())
    fwd = make_forwarder(connect_deadline=0.5)
    client = GwClient(fwd.port, pki.client_ctx())
    t0 = time.monotonic()
    status = client.open(preamble_for(lsock.getsockname()[1]))
    elapsed = time.monotonic() - t0
    client.close()
    filler.close()
    lsock.close()
    fwd.wait_idle()
    attempts = fwd.sample("sbxnet_forwarder_connect_attempts_total")
    assert status is Status.NOT_LISTENING
    assert 0.45 < elapsed < 1.0
    assert 8 <= attempts <= 11, attempts
