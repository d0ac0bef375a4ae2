"""``sbxnet certs renew / next-key / promote``: renewing a leaf keeping its key, minting the next key ahead,
and installing it (issue 22 point 17; docs/forwarder.md "Rotating a forwarder's key"). Checked by reading
the files back: pins, SANs, usages, the issuer, and which files changed."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from certs.mint import mint_ca, mint_leaf, spki_pin, write_issued
from sbxnet.app.cli import main


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def pin(path: Path) -> str:
    return spki_pin(cert(path))


def profile(c: x509.Certificate) -> tuple[str, tuple[tuple[str, bool, str], ...]]:
    """What a renewal or the next key must keep: subject and every extension but the key identifiers."""
    exts = sorted((e.oid.dotted_string, e.critical, repr(e.value)) for e in c.extensions
                  if not isinstance(e.value, x509.AuthorityKeyIdentifier | x509.SubjectKeyIdentifier))
    return (c.subject.rfc4514_string(), tuple(exts))


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture
def d(tmp_path: Path) -> Path:
    assert main(["certs", "ca", "--dir", str(tmp_path)]) == 0
    assert main(["certs", "forwarder", "--dir", str(tmp_path), "--name", "host-7", "--ip", "10.0.3.7",
                 "--dns", "host-7.internal", "--days", "1"]) == 0
    return tmp_path


def test_renew_keeps_the_key_so_the_pin_and_everything_but_the_validity(d: Path, capsys: pytest.CaptureFixture[str]
                                                                          ) -> None:
    capsys.readouterr()
    before = files(d)
    old = cert(d / "host-7.crt")
    assert main(["certs", "renew", "--dir", str(d), "--name", "host-7", "--days", "30"]) == 0
    out = capsys.readouterr().out
    new = cert(d / "host-7.crt")
    assert pin(d / "host-7.crt") == spki_pin(old) and spki_pin(old) in out and "unchanged" in out
    assert profile(new) == profile(old) and len(profile(old)[1]) == 3  # constraints, SANs, usages
    assert new.serial_number != old.serial_number
    assert (new.not_valid_after_utc - old.not_valid_after_utc).days >= 28
    new.verify_directly_issued_by(cert(d / "ca.crt"))
    after = files(d)
    # Only the certificate changed: the key file is the same bytes, no other file appeared.
    assert set(after) == set(before) and after["host-7.key"] == before["host-7.key"]
    assert {n for n in after if after[n] != before[n]} == {"host-7.crt"}


def test_next_key_is_minted_beside_the_current_one_which_stays_untouched(d: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    before = files(d)
    current = pin(d / "host-7.crt")
    assert main(["certs", "next-key", "--dir", str(d), "--name", "host-7"]) == 0
    out = capsys.readouterr().out
    after = files(d)
    assert {n: after[n] for n in before} == before  # the current pair (and the CA) untouched
    assert set(after) - set(before) == {"host-7.next.crt", "host-7.next.key"}
    nxt = pin(d / "host-7.next.crt")
    assert nxt != current
    assert f"next SPKI pin {nxt}" in out and current in out
    assert profile(cert(d / "host-7.next.crt")) == profile(cert(d / "host-7.crt"))  # same SANs and usages
    cert(d / "host-7.next.crt").verify_directly_issued_by(cert(d / "ca.crt"))
    assert stat.S_IMODE((d / "host-7.next.key").stat().st_mode) == 0o600
    # A second next-key would mint another key while the first one's pin may be in routes: refused.
    assert main(["certs", "next-key", "--dir", str(d), "--name", "host-7"]) == 1
    assert "exists already" in capsys.readouterr().out
    assert files(d) == after


def test_promote_installs_the_next_key_and_keeps_the_old_pair(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = files(d)
    old_pin = pin(d / "host-7.crt")
    assert main(["certs", "next-key", "--dir", str(d), "--name", "host-7"]) == 0
    nxt = files(d)
    next_pin = pin(d / "host-7.next.crt")
    capsys.readouterr()
    assert main(["certs", "promote", "--dir", str(d), "--name", "host-7"]) == 0
    out = capsys.readouterr().out
    now = files(d)
    assert now["host-7.crt"] == nxt["host-7.next.crt"] and now["host-7.key"] == nxt["host-7.next.key"]
    assert pin(d / "host-7.prev.crt") == old_pin and now["host-7.prev.key"] == old["host-7.key"]
    assert "host-7.next.crt" not in now and "host-7.next.key" not in now
    assert next_pin in out and old_pin in out
    assert stat.S_IMODE((d / "host-7.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "host-7.prev.key").stat().st_mode) == 0o600
    # Nothing to promote now: refused, nothing moved.
    assert main(["certs", "promote", "--dir", str(d), "--name", "host-7"]) == 1
    assert "next-key" in capsys.readouterr().out and files(d) == now


def test_a_pair_that_does_not_match_or_another_ca_is_refused_and_nothing_changes(
        d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other_ca = mint_ca("another CA")
    stranger = mint_leaf(other_ca, "host-7", ips=("10.0.3.7",))
    write_issued(stranger, d, "host-7.next")  # a next pair from another CA
    before = files(d)
    assert main(["certs", "promote", "--dir", str(d), "--name", "host-7"]) == 1
    assert "not issued by" in capsys.readouterr().out and files(d) == before
    # A certificate that is not its key's: renew and next-key refuse, promote too.
    (d / "host-7.next.crt").write_bytes((d / "host-7.crt").read_bytes())
    (d / "host-7.crt").write_bytes(stranger.cert_pem)
    before = files(d)
    assert main(["certs", "renew", "--dir", str(d), "--name", "host-7"]) == 1
    assert main(["certs", "promote", "--dir", str(d), "--name", "host-7"]) == 1
    assert files(d) == before
    (d / "host-7.next.crt").unlink()
    (d / "host-7.next.key").unlink()
    before = files(d)
    assert main(["certs", "next-key", "--dir", str(d), "--name", "host-7"]) == 1
    assert "is not the certificate of" in capsys.readouterr().out and files(d) == before
    assert main(["certs", "renew", "--dir", str(d), "--name", "missing"]) == 1
