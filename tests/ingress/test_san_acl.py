"""The SAN allowlist against literal certificates and names, no sockets.

Each certificate is minted with ``certs.mint`` and decoded by the same C function ``ssl`` uses for
``getpeercert()`` (``_ssl._test_decode_cert`` reads a PEM file), so ``peer_sans`` sees exactly the form a
real handshake hands it.
"""

from __future__ import annotations

import _ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from certs.mint import Issued, mint_ca, mint_leaf
from forwarder.ingress.san_acl import SanAllowlist, peer_sans, validate_pattern

GATEWAY = "spiffe://sbxnet.test/gateway"
Decode = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def ca() -> Issued:
    return mint_ca("san acl test CA")


@pytest.fixture
def decode(ca: Issued, tmp_path: Path) -> Decode:
    """A client certificate with the given SANs, as ``SSLSocket.getpeercert()`` returns it."""
    counter = iter(range(1 << 30))

    def make(*, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (), uris: tuple[str, ...] = ()) -> dict[str, Any]:
        leaf = mint_leaf(ca, "peer", dns=dns, ips=ips, uris=uris, server=False, client=True)
        path = tmp_path / f"peer{next(counter)}.pem"
        path.write_bytes(leaf.cert_pem)
        decoded: dict[str, Any] = getattr(_ssl, "_test_decode_cert")(str(path))  # noqa: B009 (not in typeshed)
        return decoded

    return make


# -- peer_sans ------------------------------------------------------------------------------------


def test_peer_sans_keeps_uri_and_dns_in_certificate_order(decode: Decode) -> None:
    cert = decode(dns=("gw1.edge.example",), ips=("127.0.0.1",), uris=(GATEWAY, "spiffe://sbxnet.test/other"))
    assert ("IP Address", "127.0.0.1") in cert["subjectAltName"]  # really there, and ignored
    assert peer_sans(cert) == ["gw1.edge.example", GATEWAY, "spiffe://sbxnet.test/other"]


def test_peer_sans_of_nothing(decode: Decode) -> None:
    assert peer_sans(None) == []
    assert peer_sans({}) == []
    assert peer_sans(decode(ips=("192.0.2.1",))) == []
    assert peer_sans({"subjectAltName": "DNS:gw1.edge.example"}) == []  # not the decoded form: nothing


# -- one pattern, one certificate ----------------------------------------------------------------

# (pattern, the certificate's SANs, allowed)
CASES: list[tuple[str, dict[str, tuple[str, ...]], bool]] = [
    # DNS: exact, case-insensitive, one trailing dot ignored on either side, never a suffix match
    ("gw1.edge.example", {"dns": ("gw1.edge.example",)}, True),
    ("gw1.edge.example", {"dns": ("GW1.Edge.EXAMPLE",)}, True),
    ("GW1.EDGE.example", {"dns": ("gw1.edge.example",)}, True),
    ("gw1.edge.example", {"dns": ("gw1.edge.example.",)}, True),
    ("gw1.edge.example.", {"dns": ("gw1.edge.example",)}, True),
    ("edge.example", {"dns": ("gw1.edge.example",)}, False),
    ("gw1.edge.example", {"dns": ("gw1.edge.example.evil",)}, False),
    ("gw1.edge.example", {"dns": ("xgw1.edge.example",)}, False),
    # DNS '*': exactly one non-empty label, never across a '.'
    ("*.edge.example", {"dns": ("gw1.edge.example",)}, True),
    ("*.edge.example", {"dns": ("GW2.EDGE.EXAMPLE.",)}, True),
    ("*.edge.example", {"dns": ("a.gw1.edge.example",)}, False),
    ("*.edge.example", {"dns": ("edge.example",)}, False),
    ("*.edge.example", {"dns": (".edge.example",)}, False),
    ("gw1.*.example", {"dns": ("gw1..example",)}, False),
    ("*", {"dns": ("localhost",)}, True),
    ("*", {"dns": ("gw1.edge.example",)}, False),
    # URI: exact, scheme case-insensitive, the rest compared as written
    (GATEWAY, {"uris": (GATEWAY,)}, True),
    (GATEWAY, {"uris": ("SPIFFE://sbxnet.test/gateway",)}, True),
    ("Spiffe://sbxnet.test/gateway", {"uris": (GATEWAY,)}, True),
    (GATEWAY, {"uris": ("spiffe://sbxnet.test/Gateway",)}, False),
    (GATEWAY, {"uris": ("https://sbxnet.test/gateway",)}, False),
    (GATEWAY, {"uris": ("spiffe://sbxnet.test/gateway/",)}, False),
    (GATEWAY, {"uris": ("spiffe://sbxnet.test/gateway/x",)}, False),
    (GATEWAY, {"uris": ("spiffe://sbxnet.test/gateway?x=1",)}, False),
    (GATEWAY, {"uris": ("spiffe://sbxnet.test/gatewayx",)}, False),
    # URI '*': exactly one non-empty path segment, never across a '/'
    ("spiffe://sbxnet.test/*", {"uris": (GATEWAY,)}, True),
    ("spiffe://sbxnet.test/*", {"uris": ("spiffe://sbxnet.test/gw.v2",)}, True),  # '.' is no URI separator
    ("spiffe://sbxnet.test/*", {"uris": ("spiffe://sbxnet.test/a/b",)}, False),
    ("spiffe://sbxnet.test/*", {"uris": ("spiffe://sbxnet.test/",)}, False),
    ("spiffe://sbxnet.test/*", {"uris": ("spiffe://sbxnet.test",)}, False),
    ("spiffe://sbxnet.test/*/gw", {"uris": ("spiffe://sbxnet.test//gw",)}, False),
    ("spiffe://sbxnet.test/*/gw", {"uris": ("spiffe://sbxnet.test/ns/gw",)}, True),
    # A SAN is judged as its own type: a DNS SAN spelled like a URI, or a URI SAN spelled like a
    # host name, matches nothing (a CA that checks URI SANs strictly may issue DNS SANs freely)
    (GATEWAY, {"dns": (GATEWAY,)}, False),
    ("spiffe://sbxnet.test/*", {"dns": ("spiffe://sbxnet.test/gateway",)}, False),
    ("gw1.edge.example", {"uris": ("gw1.edge.example",)}, False),
    ("*.example", {"dns": ("a/b.example",)}, False),  # not a host name: '*' must not take in a '/'
]


@pytest.mark.parametrize(("pattern", "sans", "allowed"), CASES, ids=[f"{p} vs {s}" for p, s, _ in CASES])
def test_pattern_against_certificate(
    decode: Decode, pattern: str, sans: dict[str, tuple[str, ...]], allowed: bool
) -> None:
    names = [n for group in sans.values() for n in group]
    found = SanAllowlist((pattern,)).first_match(peer_sans(decode(**sans)))
    assert found == (names[0] if allowed else None)


def test_first_match_is_the_first_allowed_san_in_certificate_order(decode: Decode) -> None:
    cert = decode(dns=("gw1.edge.example", "gw2.edge.example"), uris=("spiffe://sbxnet.test/intruder", GATEWAY))
    acl = SanAllowlist((GATEWAY, "gw2.edge.example"))
    assert acl.first_match(peer_sans(cert)) == "gw2.edge.example"
    assert SanAllowlist((GATEWAY,)).first_match(peer_sans(cert)) == GATEWAY
    assert SanAllowlist(("spiffe://sbxnet.test/nobody",)).first_match(peer_sans(cert)) is None
    assert SanAllowlist(()).first_match(peer_sans(cert)) is None


# -- patterns refused at start-up ----------------------------------------------------------------

REFUSED = [
    "",
    " spiffe://sbxnet.test/gateway",
    "spiffe://sbxnet.test/gateway ",
    "spiffe://sbxnet.test/gate*",
    "spiffe://sbxnet.test/**",
    "*gw.edge.example",
    "gw*.edge.example",
    "gw1..edge.example",
    ".edge.example",
    "spiffe://sbxnet.test//gateway",
    "spiffe://sbxnet.test/gateway/",
    "spiffe://",
]


@pytest.mark.parametrize("pattern", REFUSED)
def test_validate_pattern_refuses(pattern: str) -> None:
    with pytest.raises(ValueError, match="SAN pattern"):
        validate_pattern(pattern)
    with pytest.raises(ValueError, match="SAN pattern"):
        SanAllowlist((GATEWAY, pattern))


@pytest.mark.parametrize("pattern", ["*", "*.edge.example", "gw1.edge.example.", "spiffe://sbxnet.test/*", GATEWAY])
def test_validate_pattern_accepts(pattern: str) -> None:
    validate_pattern(pattern)
