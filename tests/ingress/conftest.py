from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fwd_support import ForwarderThread, Pki, make_pki

from forwarder.ingress.settings import ForwarderSettings


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def settings_for(pki: Pki, **overrides: Any) -> ForwarderSettings:
    cert, key = pki.paths["forwarder"]
    values: dict[str, Any] = dict(
        listen_host="127.0.0.1",
        listen_port=8443,
        metrics_port=0,
        cert_file=cert,
        key_file=key,
        ca_file=pki.ca_file,
        client_san_allow=["spiffe://sbxnet.test/gateway"],
        sandbox_prefixes=[ipaddress.ip_network("127.0.0.0/8")],
        allow_targets=[ipaddress.ip_network("127.0.0.1/32")],
        connect_deadline=2.0,
        close_timeout=10.0,
        data_plane="userspace",  # no kernel TLS here; the ktls plane: tests/ingress/planes
    )
    values.update(overrides)
    return ForwarderSettings(**values)


@pytest.fixture
def make_forwarder(pki: Pki) -> Iterator[Callable[..., ForwarderThread]]:
    started: list[ForwarderThread] = []

    def make(**overrides: Any) -> ForwarderThread:
        fwd = ForwarderThread(settings_for(pki, **overrides))
        started.append(fwd)
        return fwd

    yield make
    for fwd in started:
        fwd.stop()


@pytest.fixture
def forwarder(make_forwarder: Callable[..., ForwarderThread]) -> ForwarderThread:
    return make_forwarder()


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path
