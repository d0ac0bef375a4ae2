from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import pytest

from certs.mint import mint_ca, mint_leaf, write_issued


@pytest.fixture(scope="session")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ktls-pki")
    ca = mint_ca("ktls test CA")
    write_issued(ca, d, "ca")
    write_issued(mint_leaf(ca, "forwarder", dns=("localhost",), ips=("127.0.0.1",), server=True), d, "forwarder")
    write_issued(
        mint_leaf(ca, "gateway", uris=("spiffe://sbxnet.test/gateway",), server=False, client=True), d, "gateway"
    )
    return d


@pytest.fixture
def server_ctx(pki_dir: Path) -> Callable[[], ssl.SSLContext]:
    def make() -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(pki_dir / "forwarder.crt"), str(pki_dir / "forwarder.key"))
        ctx.num_tickets = 0
        return ctx

    return make


@pytest.fixture
def client_ctx(pki_dir: Path) -> Callable[[], ssl.SSLContext]:
    def make() -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cafile=str(pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(pki_dir / "gateway.crt"), str(pki_dir / "gateway.key"))
        return ctx

    return make


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from forwarder.ingress.planes.ktls_keys import probe

    marked = [item for item in items if item.get_closest_marker("ktls") is not None]
    if marked and not probe().ok:
        skip = pytest.mark.skip(
            reason="no kernel TLS in this kernel; scripts/ktls-tests.sh runs these inside a Debian kernel"
        )
        for item in marked:
            item.add_marker(skip)
