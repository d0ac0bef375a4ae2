"""Which authenticated peers may talk to the forwarder: a plain value, judged without sockets.

A pattern matches a URI SAN (``spiffe://td/gateway``) or a DNS SAN (``gw1.edge.example``). It is either
exact or contains ``*`` segments, where ``*`` matches exactly one non-empty segment (a path segment
for URIs, a label for DNS names). ``*`` never matches across separators and never inside a segment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def _segments(name: str) -> tuple[str, list[str]]:
    if "://" in name:
        scheme, rest = name.split("://", 1)
        return f"uri:{scheme.lower()}", rest.split("/")
    return "dns", name.lower().rstrip(".").split(".")


def validate_pattern(pattern: str) -> None:
    """Raise ValueError naming what is wrong with ``pattern``."""
    if not pattern or pattern.strip() != pattern:
        raise ValueError(f"SAN pattern {pattern!r} is empty or has surrounding spaces")
    _, segs = _segments(pattern)
    for seg in segs:
        if "*" in seg and seg != "*":
            raise ValueError(f"SAN pattern {pattern!r}: '*' must be a whole segment, not part of {seg!r}")
        if not seg:
            raise ValueError(f"SAN pattern {pattern!r} has an empty segment")


def _match(pattern: str, name: str) -> bool:
    pkind, psegs = _segments(pattern)
    nkind, nsegs = _segments(name)
    if pkind != nkind or len(psegs) != len(nsegs):
        return False
    return all((p == "*" and n != "") or p == n for p, n in zip(psegs, nsegs, strict=True))


@dataclass(frozen=True)
class SanAllowlist:
    patterns: tuple[str, ...]

    def __post_init__(self) -> None:
        for p in self.patterns:
            validate_pattern(p)

    def first_match(self, sans: Iterable[str]) -> str | None:
        """The first peer SAN that some pattern allows, or None."""
        for name in sans:
            if any(_match(p, name) for p in self.patterns):
                return name
        return None


def peer_sans(peercert: dict[str, object] | None) -> list[str]:
    """URI and DNS SANs from ``ssl``'s decoded peer certificate (other SAN types are ignored).

    Patterns tell a URI from a DNS name by its spelling (``scheme://``), so a SAN whose spelling
    contradicts its type is dropped rather than judged as the other type: a DNS SAN containing ``/`` or
    ``:`` (no host name does; it would be read as a URI, or let ``*`` take in a ``/``), and a URI SAN
    without ``://`` (it would be read as a DNS name). A CA that checks URI SANs strictly may still
    issue DNS SANs freely."""
    if not peercert:
        return []
    out = []
    entries = peercert.get("subjectAltName", ())
    for kind, value in entries if isinstance(entries, tuple | list) else ():
        name = str(value)
        if (kind == "URI" and "://" in name) or (kind == "DNS" and "/" not in name and ":" not in name):
            out.append(name)
    return out
