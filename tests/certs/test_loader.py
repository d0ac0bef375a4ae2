"""certs/loader.py: the link's TLS profile both ends load, key pinning, and reload that keeps the old
certificates on failure. Handshakes run over memory BIOs: no sockets."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509

from certs import loader
from certs.mint import mint_ca, mint_leaf, spki_pin, write_issued


def _pki(d: Path) -> dict[str, Path]:
    ca = mint_ca()
    write_issued(ca, d, "ca")
    out = {"ca": d / "ca.crt"}
    for stem, leaf in {
        "forwarder": mint_leaf(ca, "forwarder", dns=("localhost",), server=True),
        "other": mint_leaf(ca, "other", dns=("localhost",), server=True),
        "gateway": mint_leaf(ca, "gateway", uris=("spiffe://t/gateway",), server=False, client=True),
    }.items():
        write_issued(leaf, d, stem)
        out[stem] = d / f"{stem}.crt"
        out[stem + "_key"] = d / f"{stem}.key"
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _pki(tmp_path_factory.mktemp("pki"))


def _server(pki: dict[str, Path], stem: str = "forwarder") -> ssl.SSLContext:
    return loader.server_context(cert_file=pki[stem], key_file=pki[stem + "_key"], ca_file=pki["ca"])


def _client(pki: dict[str, Path]) -> ssl.SSLContext:
    return loader.client_context(cert_file=pki["gateway"], key_file=pki["gateway_key"], ca_file=pki["ca"])


def handshake(client: ssl.SSLContext, server: ssl.SSLContext) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname="forwarder.invalid")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(10):
        for name, obj in (("c", c), ("s", s)):
            if not done[name]:
                try:
                    obj.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            # TLS 1.3: the server sees the client's certificate only after the client's last flight.
            s.write(b"x")
            c_in.write(s_out.read())
            assert c.read(1) == b"x"
            return c, s
    raise AssertionError("handshake did not finish")


def test_the_profile_is_tls13_mutual_without_tickets(pki: dict[str, Path]) -> None:
    srv, cli = _server(pki), _client(pki)
    for ctx in (srv, cli):
        assert ctx.minimum_version == ctx.maximum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.options & ssl.OP_NO_TICKET
    assert srv.num_tickets == 0
    assert not cli.check_hostname  # the forwarder is identified by its pinned key, not a name
    c, s = handshake(cli, srv)
    assert c.version() == s.version() == "TLSv1.3"
    peer = s.getpeercert()
    assert peer and ("URI", "spiffe://t/gateway") in peer["subjectAltName"]


def test_pin_matches_the_forwarders_key_and_refuses_another(pki: dict[str, Path]) -> None:
    want = spki_pin(_cert(pki["forwarder"]))
    c, _ = handshake(_client(pki), _server(pki))
    assert loader.check_pin(c, {want}) == want
    c2, _ = handshake(_client(pki), _server(pki, "other"))
    with pytest.raises(loader.PinMismatch, match="is not pinned"):
        loader.check_pin(c2, {want})


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_pin_of_der_agrees_with_mint(pki: dict[str, Path]) -> None:
    from cryptography.hazmat.primitives.serialization import Encoding

    cert = _cert(pki["forwarder"])
    assert loader.spki_pin_of_der(cert.public_bytes(Encoding.DER)) == spki_pin(cert)


def test_a_server_refuses_a_client_without_a_certificate(pki: dict[str, Path]) -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname = False
    bare.load_verify_locations(cafile=str(pki["ca"]))
    with pytest.raises(ssl.SSLError):
        handshake(bare, _server(pki))


def test_prepare_runs_on_every_fresh_server_context(pki: dict[str, Path]) -> None:
    seen: list[ssl.SSLContext] = []
    ctx = loader.server_context(
        cert_file=pki["forwarder"], key_file=pki["forwarder_key"], ca_file=pki["ca"], prepare=seen.append
    )
    assert seen == [ctx]


def test_reload_swaps_on_success_and_keeps_the_old_on_failure(tmp_path: Path, pki: dict[str, Path]) -> None:
    d = tmp_path / "live"
    d.mkdir()
    for stem in ("forwarder", "other"):
        (d / f"{stem}.crt").write_bytes(pki[stem].read_bytes())
        (d / f"{stem}.key").write_bytes(pki[stem + "_key"].read_bytes())
    cert, key = d / "cert.pem", d / "key.pem"
    cert.write_bytes((d / "forwarder.crt").read_bytes())
    key.write_bytes((d / "forwarder.key").read_bytes())
    r = loader.Reloadable(lambda: loader.server_context(cert_file=cert, key_file=key, ca_file=pki["ca"]))
    first = r.current

    cert.write_text("not a certificate")
    err = r.reload()
    assert isinstance(err, loader.LOAD_ERRORS)
    assert r.current is first
    c, _ = handshake(_client(pki), r.current)
    assert loader.check_pin(c, {spki_pin(_cert(d / "forwarder.crt"))})

    cert.write_bytes((d / "other.crt").read_bytes())
    key.write_bytes((d / "other.key").read_bytes())
    assert r.reload() is None
    assert r.current is not first
    c, _ = handshake(_client(pki), r.current)
    assert loader.check_pin(c, {spki_pin(_cert(d / "other.crt"))})


def test_reloadable_lets_other_errors_through() -> None:
    calls = iter([1])

    def load() -> int:
        return next(calls)  # StopIteration on the second call: not a loading error, so not swallowed

    r = loader.Reloadable(load)
    with pytest.raises(StopIteration):
        r.reload()
