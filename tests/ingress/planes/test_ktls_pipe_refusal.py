"""The ktls plane refuses a tunnel whose pump pipe cannot hold a whole TLS record (a forwarder past
fs/pipe-user-pages-soft gets 8 KiB pipes): both ends are reset and the refusal is counted as
``pipe_too_small``; the sandbox never sees a clean end of a stream that was cut. Needs CONFIG_TLS:
scripts/ktls-tests.sh runs these inside a Debian kernel. The pump's own check runs on this host in
test_splice_pump_pipes.py."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ingress: fwd_support
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, make_pki, preamble_for

from forwarder.ingress.settings import ForwarderSettings
from sbxnet.protocol.status import Status

pytestmark = pytest.mark.ktls


@pytest.fixture(scope="module")
def kpki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("kpki-pipes"))


@pytest.fixture
def fwd(kpki: Pki) -> Iterator[ForwarderThread]:
    cert, key = kpki.paths["forwarder"]
    settings = ForwarderSettings(
        listen_host="127.0.0.1", listen_port=8443, metrics_port=0, cert_file=cert, key_file=key,
        ca_file=kpki.ca_file, client_san_allow=["spiffe://sbxnet.test/gateway"],
        sandbox_prefixes=[ipaddress.ip_network("127.0.0.0/8")],
        allow_targets=[ipaddress.ip_network("127.0.0.1/32")],
        connect_deadline=30.0, connect_syn_interval=1.0, close_timeout=120.0, data_plane="ktls",
    )
    f = ForwarderThread(settings)
    yield f
    f.call(f.server.drain(1.0))
    f.call(f.server.plane.close())
    f.stop()


def test_a_pipe_too_small_for_a_record_refuses_the_tunnel(fwd: ForwarderThread, kpki: Pki) -> None:
    plane = fwd.server.plane
    assert plane.name == "ktls"
    # The pump is made at the first tunnel: from then on every pipe is the 8 KiB a forwarder past the
    # per-user pipe limit is given.
    plane.pipe_size = 8192
    seen: list[str] = []

    def handler(conn: socket.socket) -> None:
        try:
            data = conn.recv(100)
            seen.append("eof" if data == b"" else "data")
        except ConnectionResetError:
            seen.append("reset")

    app = SandboxApp(handler)
    client = GwClient(fwd.port, kpki.client_ctx())
    assert client.open(preamble_for(app.port)) is Status.OK
    with contextlib.suppress(OSError):  # the reset may already be there
        client.send(b"a" * 40_000)  # more than one record
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        client.recv_all()
    app.join()
    assert seen == ["reset"]  # never an end of stream
    fwd.wait_idle()
    assert plane.install_failures["pipe_too_small"] == 1
    assert fwd.sample("sbxnet_forwarder_plane_refusals_total", {"plane": "ktls", "reason": "pipe_too_small"}) == 1
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "internal"}) == 1
