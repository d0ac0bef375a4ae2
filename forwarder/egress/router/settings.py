"""The egress router's one typed settings object (env SBXNET_EGRESS_*, TOML table [egress])."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, FilePath, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from forwarder.egress.vxlan import VNI_MAX, VXLAN_PORT
from sbxnet.config import split_list

DEFAULT_ROUTER_MAC = "02:73:62:78:00:01"  # locally administered, unicast


def parse_mac(text: str) -> bytes:
    """``aa:bb:cc:dd:ee:ff`` as 6 bytes; a unicast address only (a multicast one cannot be a host's)."""
    parts = text.split(":")
    if len(parts) != 6 or not all(len(p) == 2 for p in parts):
        raise ValueError(f"MAC {text!r}: want six hex pairs separated by ':'")
    try:
        mac = bytes(int(p, 16) for p in parts)
    except ValueError:
        raise ValueError(f"MAC {text!r}: want six hex pairs separated by ':'") from None
    if mac[0] & 1 or mac == bytes(6):
        raise ValueError(f"MAC {text!r} is not a unicast address")
    return mac


@dataclass(frozen=True, slots=True)
class ExitSpec:
    """One exit: its label (claims name it), its VTEP address (VXLAN goes there and is accepted only
    from there) and the MAC of its VXLAN device (the inner Ethernet destination of what we send)."""

    label: str
    vtep: ipaddress.IPv4Address
    mac: bytes

    @classmethod
    def parse(cls, text: str) -> ExitSpec:
        """``LABEL=VTEP@MAC``, e.g. ``a=10.77.0.1@02:00:00:00:00:01``."""
        label, eq, rest = text.partition("=")
        vtep, at, mac = rest.partition("@")
        if not eq or not at or not label.strip():
            raise ValueError(f"exit {text!r}: want LABEL=VTEP_ADDRESS@MAC")
        try:
            addr = ipaddress.IPv4Address(vtep.strip())
        except ValueError:
            raise ValueError(f"exit {text!r}: {vtep!r} is not an IPv4 address") from None
        return cls(label.strip(), addr, parse_mac(mac.strip()))


class EgressSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SBXNET_EGRESS_", extra="forbid", frozen=True)

    listen: ipaddress.IPv4Address = Field(ipaddress.IPv4Address("0.0.0.0"), description="VXLAN socket address")
    port: int = Field(VXLAN_PORT, ge=1, le=65535, description="VXLAN UDP port, ours and the exits'")
    vni: int = Field(1, ge=0, le=VNI_MAX, description="the overlay's VXLAN network identifier")
    exits: Annotated[list[str], NoDecode] = Field(
        min_length=1, description="LABEL=VTEP_ADDRESS@MAC per exit; VXLAN and ARP are accepted only from these"
    )
    router_mac: str = Field(DEFAULT_ROUTER_MAC, description="our MAC on the overlay (ARP replies, every frame)")
    overlay: ipaddress.IPv4Network = Field(ipaddress.IPv4Network("100.64.0.0/10"),
                                           description="the claims' overlay subnet (never a destination)")
    guard_extra: Annotated[list[ipaddress.IPv4Network], NoDecode] = Field(
        default_factory=list, description="more destinations no guest may reach (the host's internal networks)"
    )
    mtu: int = Field(1500, ge=576, le=9000, description="largest inner IPv4 packet (a stream MTU is at most this)")
    claims_file: FilePath | None = Field(None, description="JSON file of the claims armed at start")
    stream_stall_timeout: float = Field(10.0, gt=0, le=600, description="a guest not reading this long is closed")
    garp_interval: float = Field(45.0, gt=0, le=3600, description="seconds between gratuitous ARPs per claim")
    flow_cap: int = Field(16384, ge=1, le=1_000_000, description="flows per claim")
    new_flow_rate: float = Field(1000.0, gt=0, le=1e6, description="new flows per second per claim")
    flow_idle_timeout: float = Field(120.0, gt=0, le=86400)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # addresses (docs/egress.md, "Addresses")
    address_pool: ipaddress.IPv4Network | None = Field(
        None, description="the addresses claims get (default: the overlay); inside the overlay")
    address_exclude: Annotated[list[ipaddress.IPv4Address], NoDecode] = Field(
        default_factory=list, description="addresses never handed out (besides network, broadcast, first host)")
    reuse_window: float = Field(3600.0, ge=0, le=30 * 86400,
                                description="seconds a released address is not handed to another claim")
    mesh_dsn: str | None = Field(None, description="PostgreSQL DSN: allocate in the mesh's table, not locally")
    mesh_table: str = Field("egress_addresses", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    node: str = Field(default_factory=socket.gethostname, min_length=1, description="this daemon's name in the mesh")
    audit_file: Path | None = Field(None, description="JSON lines of ended flows and usage (else the log)")
    usage_interval: float = Field(60.0, gt=0, le=86400, description="seconds between a live flow's usage events")
    metrics_host: ipaddress.IPv4Address = Field(ipaddress.IPv4Address("127.0.0.1"),
                                                description="/metrics, /healthz, /readyz")
    metrics_port: int = Field(9467, ge=0, le=65535, description="0 disables /metrics, /healthz, /readyz")
    # state and control
    state_dir: Path | None = Field(None, description="claims.json (claim state) and releases.log live here")
    control_socket: Path | None = Field(None, description="the control API's Unix socket (root only)")

    _split = field_validator("exits", "guard_extra", "address_exclude", mode="before")(split_list)

    @field_validator("exits")
    @classmethod
    def _exits_well_formed(cls, value: list[str]) -> list[str]:
        labels: set[str] = set()
        vteps: set[ipaddress.IPv4Address] = set()
        for text in value:
            e = ExitSpec.parse(text)
            if e.label in labels or e.vtep in vteps:
                raise ValueError(f"exit {text!r}: label or VTEP given twice")
            labels.add(e.label)
            vteps.add(e.vtep)
        return value

    @field_validator("router_mac")
    @classmethod
    def _mac_well_formed(cls, value: str) -> str:
        parse_mac(value)
        return value

    @model_validator(mode="after")
    def _overlay_sane(self) -> EgressSettings:
        if self.overlay.prefixlen > 30:
            raise ValueError(f"overlay {self.overlay} leaves no claim addresses (want /30 or wider)")
        pool = self.address_pool
        if pool is not None and (pool.prefixlen > 30 or not pool.subnet_of(self.overlay)):
            raise ValueError(f"address_pool {pool}: want a /30 or wider inside the overlay {self.overlay}")
        return self

    def exit_specs(self) -> dict[str, ExitSpec]:
        return {e.label: e for e in map(ExitSpec.parse, self.exits)}

    def router_mac_bytes(self) -> bytes:
        return parse_mac(self.router_mac)
