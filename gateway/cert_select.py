"""Which of the gateway's certificates answers a TLS ClientHello: pure, over names.

Each certificate is known by its DNS SANs (``*.sandbox.example.com`` included). For the SNI a client
sent: an exact SAN wins over a wildcard; a wildcard covers exactly one left-most label (RFC 6125 6.4.3:
``*.example.com`` covers ``a.example.com``, not ``example.com`` or ``a.b.example.com``); among equals the
first configured wins. No SNI, or no match, gets the first certificate (the default), so a client that
sends no SNI still completes a handshake and is then answered by routing, not by a TLS alert it cannot
explain: each of its requests is routed by its own Host / ``:authority`` when the default certificate
covers that name (``covered``), and answered 421 when it does not (``routing.request_target``).

``covered`` answers the other question a certificate settles: which names a connection may carry once
it is made. A client may reuse one HTTP/2 connection for every name the certificate it was shown covers
(RFC 9113 9.1.1), by the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence


def normalise(name: str) -> str:
    """Lower-case, one trailing dot dropped (DNS names compare case-insensitively)."""
    name = name.lower()
    return name[:-1] if name.endswith(".") else name


def covers(san: str, server_name: str) -> bool:
    """Whether DNS SAN ``san`` (possibly ``*.rest``) covers ``server_name``."""
    san, name = normalise(san), normalise(server_name)
    if not san.startswith("*."):
        return san == name
    first, sep, rest = name.partition(".")
    return bool(sep) and bool(first) and rest == san[2:] and "*" not in first


def choose(server_name: str | None, certs: Sequence[Sequence[str]]) -> int:
    """The index in ``certs`` (each a sequence of DNS SANs) of the certificate to present."""
    if not certs:
        raise ValueError("no certificates configured")
    if not server_name:
        return 0
    for i, sans in enumerate(certs):
        if any(not s.startswith("*.") and covers(s, server_name) for s in sans):
            return i
    for i, sans in enumerate(certs):
        if any(s.startswith("*.") and covers(s, server_name) for s in sans):
            return i
    return 0


def covered(sans: Sequence[str], name: str) -> bool:
    """Whether any of the DNS SANs ``sans`` (one certificate's) covers ``name``."""
    return any(covers(s, name) for s in sans)
