"""Cold start: the sandbox's program starts listening 400 ms after the connection arrives."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, preamble_for

from sbxnet.backoff import backoff_delays
from sbxnet.protocol.status import Status


def test_backoff_schedule_is_5ms_doubling_to_a_50ms_cap() -> None:
    gen = backoff_delays(0.005, 0.05)
    assert [round(next(gen), 4) for _ in range(7)] == [0.005, 0.01, 0.02, 0.04, 0.05, 0.05, 0.05]


def _answer_after_listen(fwd: ForwarderThread, pki: Pki, listen_after: float) -> tuple[float, float]:
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
    assert client.recv_exact(2) == b"hi"
    client.close()
    app.close()
    return answered - app.listened_at, app.listened_at - t0


@pytest.mark.parametrize("cap", [0.05, 0.015])
def test_answered_promptly_after_listen(make_forwarder, pki: Pki, cap: float) -> None:  # type: ignore[no-untyped-def]
    fwd = make_forwarder(connect_backoff_cap=cap)
    lags = []
    for _ in range(3):
        lag, listened = _answer_after_listen(fwd, pki, 0.4)
        assert 0.39 < listened < 0.5
        lags.append(lag)
    # Between the listen and the next attempt there is at most one capped backoff step; the old
    # 1 s-SYN backoff held the answer 300-370 ms.
    print(f"cap {cap * 1000:.0f} ms: answered {[round(x * 1000, 1) for x in lags]} ms after listen")
    assert max(lags) < cap + 0.02, lags
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_connect_seconds_count", {"result": "ok"}) == 3


def test_unanswered_syn_is_replaced_every_50ms(make_forwarder, pki: Pki) -> None:  # type: ignore[no-untyped-def]
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

