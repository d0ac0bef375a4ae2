"""The gateway's client TLS: certificate by SNI (exact over wildcard, default otherwise), TLS 1.2 and 1.3,
ALPN h2/http1.1 or none, and a reload that keeps the old set when a file is bad. Handshakes run over
memory BIOs with clients that verify the certificate they get against the name they asked for."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest

from certs.mint import mint_ca, mint_leaf, write_issued
from gateway.cert_select import choose, covers
from gateway.tls_front import CertPair, FrontTls


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("front")
    ca = mint_ca("front test CA")
    write_issued(ca, d, "ca")
    write_issued(mint_leaf(ca, "wild", dns=("*.sbx.test",)), d, "wild")
    write_issued(mint_leaf(ca, "exact", dns=("8080-special.sbx.test",)), d, "exact")
    write_issued(mint_leaf(ca, "other", dns=("*.other.test", "other.test")), d, "other")
    return d


def pairs(d: Path, *stems: str) -> list[CertPair]:
    return [CertPair(d / f"{s}.crt", d / f"{s}.key") for s in stems]


def client(d: Path, *, alpn: list[str] | None = None, tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    if alpn is not None:
        ctx.set_alpn_protocols(alpn)
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def handshake(front: FrontTls, cctx: ssl.SSLContext, sni: str | None) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    ci, co, si, so = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    if sni is None:
        cctx.check_hostname = False
        cctx.verify_mode = ssl.CERT_NONE
    c = cctx.wrap_bio(ci, co, server_hostname=sni)
    s = front.context.wrap_bio(si, so, server_side=True)
    done = [False, False]
    for _ in range(10):
        for i, obj in enumerate((c, s)):
            if not done[i]:
                try:
                    obj.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        si.write(co.read())
        ci.write(so.read())
        if all(done):
            return c, s
    raise AssertionError("handshake did not finish")


def served_sans(c: ssl.SSLObject) -> set[str]:
    der = c.getpeercert(binary_form=True)
    assert der
    from cryptography import x509

    cert = x509.load_der_x509_certificate(der)
    return set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName))


@pytest.mark.parametrize(
    ("sni", "want"),
    [
        ("abc.sbx.test", {"*.sbx.test"}),
        ("8080-abc.sbx.test", {"*.sbx.test"}),
        ("8080-special.sbx.test", {"8080-special.sbx.test"}),  # exact beats the wildcard listed first
        ("ABC.SBX.TEST", {"*.sbx.test"}),
        ("x.other.test", {"*.other.test", "other.test"}),
        ("other.test", {"*.other.test", "other.test"}),
    ],
)
def test_the_certificate_follows_sni(pki: Path, sni: str, want: set[str]) -> None:
    front = FrontTls(pairs(pki, "wild", "exact", "other"))
    c, s = handshake(front, client(pki), sni)  # the client verifies the name: a wrong certificate fails here
    assert served_sans(c) == want
    assert front.server_name(s) == sni


@pytest.mark.parametrize("sni", ["abc.sbx.test", "8080-special.sbx.test", "x.other.test", None, "unknown.example"])
def test_presented_names_are_the_sans_of_the_certificate_the_client_was_shown(pki: Path, sni: str | None) -> None:
    front = FrontTls(pairs(pki, "wild", "exact", "other"))
    cctx = client(pki)
    if sni == "unknown.example":  # the default certificate, which does not cover it: the client must not check
        cctx.check_hostname = False
    c, s = handshake(front, cctx, sni)
    assert set(front.presented_names(s)) == served_sans(c)


def test_presented_names_outlive_a_reload_for_the_connections_made_before(pki: Path, tmp_path: Path) -> None:
    live = CertPair(tmp_path / "live.crt", tmp_path / "live.key")
    shutil.copy(pki / "wild.crt", live.cert_file)
    shutil.copy(pki / "wild.key", live.key_file)
    front = FrontTls([live])
    _, before = handshake(front, client(pki), "a.sbx.test")
    shutil.copy(pki / "other.crt", live.cert_file)
    shutil.copy(pki / "other.key", live.key_file)
    assert front.reload() is None
    c, after = handshake(front, client(pki), "x.other.test")
    assert front.presented_names(before) == ("*.sbx.test",)
    assert set(front.presented_names(after)) == served_sans(c) == {"*.other.test", "other.test"}


def test_no_sni_or_an_unknown_name_gets_the_default_certificate(pki: Path) -> None:
    front = FrontTls(pairs(pki, "other", "wild"))
    c, s = handshake(front, client(pki), None)
    assert served_sans(c) == {"*.other.test", "other.test"}
    assert front.server_name(s) is None
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(front, client(pki), "unknown.example")


@pytest.mark.parametrize(("tls12", "version"), [(False, "TLSv1.3"), (True, "TLSv1.2")])
def test_tls12_and_tls13(pki: Path, tls12: bool, version: str) -> None:
    c, s = handshake(FrontTls(pairs(pki, "wild")), client(pki, tls12=tls12), "a.sbx.test")
    assert c.version() == s.version() == version


@pytest.mark.parametrize(
    ("offer", "chosen"),
    [(["h2", "http/1.1"], "h2"), (["http/1.1"], "http/1.1"), (None, None), (["ssh"], None)],
)
def test_alpn_h2_http11_or_none_for_raw_routes(pki: Path, offer: list[str] | None, chosen: str | None) -> None:
    c, s = handshake(FrontTls(pairs(pki, "wild")), client(pki, alpn=offer), "22-a.sbx.test")
    assert s.selected_alpn_protocol() == chosen
    assert c.selected_alpn_protocol() == chosen


def test_alpn_can_be_narrowed_to_http11(pki: Path) -> None:
    front = FrontTls(pairs(pki, "wild"), alpn=("http/1.1",))
    _, s = handshake(front, client(pki, alpn=["h2", "http/1.1"]), "a.sbx.test")
    assert s.selected_alpn_protocol() == "http/1.1"


def test_reload_swaps_the_set_and_keeps_it_when_a_file_is_bad(pki: Path, tmp_path: Path) -> None:
    for stem in ("wild", "other"):
        for ext in ("crt", "key"):
            shutil.copy(pki / f"{stem}.{ext}", tmp_path / f"{stem}.{ext}")
    live = CertPair(tmp_path / "live.crt", tmp_path / "live.key")
    shutil.copy(tmp_path / "wild.crt", live.cert_file)
    shutil.copy(tmp_path / "wild.key", live.key_file)
    front = FrontTls([live])
    assert served_sans(handshake(front, client(pki), "a.sbx.test")[0]) == {"*.sbx.test"}

    live.cert_file.write_text("garbage")
    assert front.reload() is not None
    assert served_sans(handshake(front, client(pki), "a.sbx.test")[0]) == {"*.sbx.test"}

    shutil.copy(tmp_path / "other.crt", live.cert_file)
    shutil.copy(tmp_path / "other.key", live.key_file)
    assert front.reload() is None
    assert front.names == (("*.other.test", "other.test"),)
    assert served_sans(handshake(front, client(pki), "x.other.test")[0]) == {"*.other.test", "other.test"}


def test_a_certificate_without_dns_names_is_refused_at_start(pki: Path, tmp_path: Path) -> None:
    ca = mint_ca("x")
    write_issued(mint_leaf(ca, "ip-only", ips=("127.0.0.1",)), tmp_path, "ip")
    with pytest.raises(ValueError, match="DNS"):
        FrontTls([CertPair(tmp_path / "ip.crt", tmp_path / "ip.key")])


@pytest.mark.parametrize(
    ("san", "name", "ok"),
    [
        ("*.sbx.test", "a.sbx.test", True),
        ("*.sbx.test", "sbx.test", False),
        ("*.sbx.test", "a.b.sbx.test", False),
        ("*.sbx.test", ".sbx.test", False),
        ("*.sbx.test", "A.SBX.TEST.", True),
        ("sbx.test", "SBX.test", True),
        ("sbx.test", "a.sbx.test", False),
    ],
)
def test_covers(san: str, name: str, ok: bool) -> None:
    assert covers(san, name) is ok


def test_choose_prefers_exact_then_wildcard_then_the_first() -> None:
    certs = [("*.a.test",), ("x.a.test",), ("b.test",)]
    assert choose("x.a.test", certs) == 1
    assert choose("y.a.test", certs) == 0
    assert choose("b.test", certs) == 2
    assert choose("c.test", certs) == 0
    assert choose(None, certs) == 0
    with pytest.raises(ValueError):
        choose("a", [])
