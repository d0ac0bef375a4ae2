"""``sbxnet certs``: what each action mints, checked by reading the certificates back."""

from __future__ import annotations

import stat
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from sbxnet.app.cli import main


def sans(path: Path) -> tuple[list[str], list[str], list[str]]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (ext.get_values_for_type(x509.DNSName), [str(i) for i in ext.get_values_for_type(x509.IPAddress)],
            ext.get_values_for_type(x509.UniformResourceIdentifier))


def usages(path: Path) -> set[x509.ObjectIdentifier]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_dev_mints_every_certificate_a_loopback_deployment_needs(tmp_path: Path) -> None:
    assert main(["certs", "dev", "--dir", str(tmp_path), "--trust-domain", "t.example"]) == 0
    assert sans(tmp_path / "forwarder.crt") == (["localhost"], ["127.0.0.1", "::1"],
                                                ["spiffe://t.example/forwarder/forwarder"])
    # The forwarder serves the link and is a client of the scheduler's feed.
    assert usages(tmp_path / "forwarder.crt") == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert sans(tmp_path / "gateway.crt")[2] == ["spiffe://t.example/gateway"]
    assert usages(tmp_path / "scheduler.crt") == {ExtendedKeyUsageOID.SERVER_AUTH}
    token = tmp_path / "admin.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) >= 40
    for key in ("ca.key", "forwarder.key", "gateway.key", "scheduler.key"):
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600


def test_forwarder_and_scheduler_actions(tmp_path: Path, capsys: object) -> None:
    assert main(["certs", "ca", "--dir", str(tmp_path)]) == 0
    assert main(["certs", "forwarder", "--dir", str(tmp_path), "--name", "host-7", "--ip", "10.0.3.7"]) == 0
    assert sans(tmp_path / "host-7.crt") == ([], ["10.0.3.7"], ["spiffe://sbxnet.local/forwarder/host-7"])
    assert main(["certs", "scheduler", "--dir", str(tmp_path), "--dns", "sched.internal"]) == 0
    assert sans(tmp_path / "scheduler.crt") == (["sched.internal"], [], [])
    assert main(["certs", "scheduler", "--dir", str(tmp_path)]) == 2
