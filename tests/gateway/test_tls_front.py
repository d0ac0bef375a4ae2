"""The gateway's client TLS: certificate by SNI (exact over wildcard, default otherwise), TLS 1.2 and 1.3,
ALPN h2/http1.1 or none, and a reload that keeps the old set when a file is bad. Handshakes run over
memory BIOs with clients that verify the certificate they get against the name they asked for."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from gw_support import DOMAIN, client_hello, non_ascii_hello

from certs.mint import mint_ca, mint_leaf, write_issued
from gateway import tls_front
from gateway.cert_select import choose, covers
from gateway.tls_front import UNREADABLE, CertPair, FrontTls, HelloName, hello_server_name


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


# -- a server name that is not ASCII -------------------------------------------------------------------

# pytest turns any unraisable report into an error (pyproject's filterwarnings): these tests fail if the
# name's decoding error reaches sys.unraisablehook's default (the traceback on stderr) instead of the guard.


@pytest.mark.parametrize("tls12", [False, True])
def test_a_server_name_that_is_not_ascii_is_refused_quietly_and_counted(pki: Path, tls12: bool) -> None:
    front = FrontTls(pairs(pki, "wild"))
    hello = non_ascii_hello(tls12=tls12)
    before = tls_front.refused_server_names["sni_not_ascii"]
    assert hello_server_name(hello) == UNREADABLE  # the probe: refused, not counted (the handshake counts)
    assert tls_front.refused_server_names["sni_not_ascii"] == before
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = front.context.wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(hello)
    with pytest.raises(ssl.SSLError) as e:
        obj.do_handshake()
    assert not isinstance(e.value, ssl.SSLWantReadError)
    assert tls_front.refused_server_names["sni_not_ascii"] == before + 1
    alert = outgoing.read()
    assert alert[:1] == b"\x15" and alert[-2:] == b"\x02\x50"  # a fatal internal_error alert, then nothing
    # the same hello with an ASCII name is read as before
    assert hello_server_name(client_hello(f"xx.{DOMAIN}", tls12=tls12)) == HelloName(f"xx.{DOMAIN}")


def test_other_unraisable_reports_still_reach_the_hook_that_was_there(pki: Path) -> None:
    FrontTls(pairs(pki, "wild"))  # the guard is in place
    seen: list[object] = []
    inner = sys.unraisablehook

    def spy(u: sys.UnraisableHookArgs) -> None:
        seen.append(u.object)

    def report(exc: BaseException, obj: object, err_msg: str | None = None) -> None:
        # what CPython hands the hook (sys.UnraisableHookArgs cannot be made from Python)
        sys.unraisablehook(SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None,
                                           err_msg=err_msg, object=obj))

    bad = b"\xc3\xa9.x"
    sys.unraisablehook = spy
    before = tls_front.refused_server_names["sni_not_ascii"]
    try:
        tls_front.guard_server_names()  # wraps the spy
        report(ValueError("x"), b"obj")
        report(UnicodeDecodeError("ascii", b"other", 0, 1, "no"), bad)  # not the name's own decoding
        report(UnicodeDecodeError("utf-8", bad, 0, 1, "no"), bad)
        report(UnicodeDecodeError("ascii", bad, 0, 1, "no"), bad, "Exception ignored while closing")
        report(UnicodeDecodeError("ascii", bad, 0, 1, "ordinal not in range(128)"), bad)  # the name: taken
    finally:
        sys.unraisablehook = inner
    assert seen == [b"obj", bad, bad, bad]
    assert tls_front.refused_server_names["sni_not_ascii"] == before + 1


def test_a_process_reading_a_non_ascii_server_name_writes_nothing_to_stderr(pki: Path) -> None:
    """The real default hook (no pytest in front of it): a child process builds the front and the probe,
    is sent the hello both ways, and says what happened; its stderr must stay empty."""
    script = f"""
import json, ssl, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from gw_support import non_ascii_hello
from gateway import tls_front
from gateway.tls_front import CertPair, FrontTls, hello_server_name
front = FrontTls([CertPair(Path({str(pki / "wild.crt")!r}), Path({str(pki / "wild.key")!r}))])
hello = non_ascii_hello()
probe = hello_server_name(hello)
incoming = ssl.MemoryBIO()
obj = front.context.wrap_bio(incoming, ssl.MemoryBIO(), server_side=True)
incoming.write(hello)
try:
    obj.do_handshake()
    handshake = "done"
except ssl.SSLError as e:
    handshake = type(e).__name__
counted = tls_front.refused_server_names["sni_not_ascii"]
print(json.dumps({{"probe": probe, "handshake": handshake, "counted": counted}}))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert json.loads(r.stdout) == {"probe": "unreadable", "handshake": "SSLError", "counted": 1}
