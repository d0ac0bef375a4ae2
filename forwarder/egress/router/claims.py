"""Claims armed at start, read from a JSON file; the claim models the control API and the state file share.

File form::

    {"claims": [{"id": "c1", "address": "100.64.1.2", "exit": "a", "uds": "/run/vm/c1.vsock",
                 "policy": {"rules": ["deny tcp any 25"], "default_allow": true},
                 "limits": {"byte_rate": 12500000, "quota_bytes": 10000000000}}]}

``uds`` is the VMM's vsock Unix socket path: the guest's stream arrives at ``<uds>_2051``. ``address`` is
optional: without it the allocator gives one (docs/egress.md, "Addresses"); with it that address is
reserved and must be free. Every fault
is a ``ConfigError`` naming the claim and the field, checked against the settings (address inside the
overlay, exit label configured, no id, address or socket given twice).
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from forwarder.egress.flows import Policy, Rule
from sbxnet.errors import ConfigError

GUEST_PORT = 2051  # the vsock port the guest dials; the VMM delivers it to <uds>_2051


class PolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: list[str] = Field(default_factory=list, description="flows.Rule texts, first match decides")
    default_allow: bool = True

    @field_validator("rules")
    @classmethod
    def _rules_parse(cls, value: list[str]) -> list[str]:
        for text in value:
            Rule.parse(text)
        return value

    def policy(self) -> Policy:
        return Policy(self.rules, self.default_allow)


class LimitsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    byte_rate: float | None = Field(None, gt=0)
    packet_rate: float | None = Field(None, gt=0)
    byte_burst: float | None = Field(None, gt=0)
    packet_burst: float | None = Field(None, gt=0)
    quota_bytes: int | None = Field(None, ge=0)


class _ClaimFields(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    exit: str = Field(min_length=1, max_length=64)
    uds: Path = Field(description="the VMM's vsock socket path; the guest stream is <uds>_2051")
    policy: PolicySpec = Field(default_factory=PolicySpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)

    @field_validator("uds", mode="before")
    @classmethod
    def _uds_plain(cls, value: object) -> object:
        # Refused unless already in plain form: a path that a Path would rewrite ("/a/./b", "/a/", "/.")
        # would name another socket than the one asked for.
        text = str(value) if isinstance(value, Path) else value
        if isinstance(text, str) and (not text.startswith("/") or "\0" in text or len(text.encode()) > 100
                                      or os.path.normpath(text) != text or text == "/"):
            raise ValueError("want a plain absolute path (no '.', '..', '//' or trailing '/') of at most 100 "
                             "bytes; the stream socket adds _2051")
        return value

    @property
    def stream_path(self) -> Path:
        return Path(f"{self.uds}_{GUEST_PORT}")


class ClaimRequest(_ClaimFields):
    """A claim asked for (the claims file, the control API's arm): the allocator gives its address,
    unless ``address`` pins one (which must then be free)."""

    address: ipaddress.IPv4Address | None = None

    def armed(self, address: ipaddress.IPv4Address) -> ClaimSpec:
        return ClaimSpec(**{**self.model_dump(exclude={"address"}), "address": address})


class ClaimSpec(_ClaimFields):
    """An armed claim: it has its address."""

    address: ipaddress.IPv4Address


class ClaimState(ClaimSpec):
    """What persists of an armed claim (the state file) and moves with it (export, import)."""

    enabled: bool = True
    quota_used: int = Field(0, ge=0, le=2**63 - 1)


class _ClaimsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    claims: list[ClaimRequest]


@dataclass(frozen=True, slots=True)
class Known:
    """What a claim is checked against: the overlay and the configured exit labels."""

    overlay: ipaddress.IPv4Network
    exits: frozenset[str]


def _describe(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or str(p).isidentifier())
        lines.append(f"config: {source}.{field or '(file)'} = {err.get('input')!r}: {err['msg']}")
    return "\n".join(lines)


def check_address(address: ipaddress.IPv4Address, net: ipaddress.IPv4Network) -> str | None:
    """Why ``address`` cannot be a claim's in ``net``, or None."""
    if address not in net or address in (net.network_address, net.broadcast_address):
        return f"not a host address of the overlay {net}"
    return None


def parse_claims(text: str | bytes, known: Known, source: str = "claims") -> list[ClaimRequest]:
    """The claims in ``text`` (the file form above), or ``ConfigError`` naming each bad field."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"config: {source} is not valid JSON: {e}") from None
    try:
        claims = _ClaimsFile.model_validate(raw).claims
    except ValidationError as e:
        raise ConfigError(_describe(e, source)) from None
    seen: dict[str, set[object]] = {"id": set(), "address": set(), "uds": set()}
    net = known.overlay
    for i, c in enumerate(claims):
        where = f"config: {source}.claims.{i} ({c.id})"
        if c.address is not None and (why := check_address(c.address, net)) is not None:
            raise ConfigError(f"{where}.address = {str(c.address)!r}: {why}")
        if c.exit not in known.exits:
            raise ConfigError(f"{where}.exit = {c.exit!r}: no such exit (configured: {', '.join(sorted(known.exits))})")
        for field, value in (("id", c.id), ("address", c.address), ("uds", c.uds)):
            if value is None:
                continue
            if value in seen[field]:
                raise ConfigError(f"{where}.{field} = {str(value)!r}: given to two claims")
            seen[field].add(value)
    return claims


def load_claims(path: Path, known: Known) -> list[ClaimRequest]:
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config: claims_file {str(path)!r}: {e.strerror}") from None
    return parse_claims(text, known, source=f"claims_file {str(path)!r}")
