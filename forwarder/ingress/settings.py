"""The forwarder's one typed settings object, validated at start-up (env SBXNET_FORWARDER_*, [forwarder])."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, FilePath, IPvAnyAddress, IPvAnyNetwork, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sbxnet.backoff import BACKOFF_CAP_S, BACKOFF_INITIAL_S, SYN_INTERVAL_S
from sbxnet.config import split_list


class ForwarderSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SBXNET_FORWARDER_", extra="forbid", frozen=True)

    listen_host: IPvAnyAddress = ipaddress.IPv4Address("0.0.0.0")
    listen_port: int = Field(8443, ge=1, le=65535)
    metrics_host: IPvAnyAddress = ipaddress.IPv4Address("127.0.0.1")
    metrics_port: int = Field(9464, ge=0, le=65535, description="0 disables /metrics, /healthz, /readyz")

    cert_file: FilePath
    key_file: FilePath
    ca_file: FilePath = Field(description="CA bundle that gateway client certificates must chain to")
    client_san_allow: Annotated[list[str], NoDecode] = Field(
        min_length=1, description="URI/DNS SAN patterns; '*' matches one whole segment"
    )

    sandbox_prefixes: Annotated[list[IPvAnyNetwork], NoDecode] = Field(min_length=1)
    allow_targets: Annotated[list[IPvAnyNetwork], NoDecode] = Field(
        default_factory=list, description="explicit exceptions to the always-refused address classes"
    )

    data_plane: Literal["ktls", "userspace"] = Field(
        "ktls", description="ktls (default; fails closed without kernel TLS) or userspace, chosen explicitly"
    )

    preamble_max_bytes: int = Field(512, ge=32, le=4096)
    preamble_timeout: float = Field(2.0, gt=0, le=60)
    handshake_timeout: float = Field(5.0, gt=0, le=60)
    connect_deadline: float = Field(10.0, gt=0, le=300)
    connect_syn_interval: float = Field(SYN_INTERVAL_S, gt=0, le=5, description="fresh SYN after this long unanswered")
    connect_backoff_initial: float = Field(BACKOFF_INITIAL_S, gt=0, le=5)
    connect_backoff_cap: float = Field(BACKOFF_CAP_S, gt=0, le=30)
    close_timeout: float = Field(30.0, gt=0, le=3600, description="after one side ends, wait for the other")
    drain_timeout: float = Field(30.0, ge=0, le=3600)
    max_connections: int = Field(10000, ge=1, le=1_000_000)
    workers: int = Field(1, ge=0, le=256, description="processes sharing the port; 0 = one per core")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    _split = field_validator("client_san_allow", "sandbox_prefixes", "allow_targets", mode="before")(split_list)

    @field_validator("client_san_allow")
    @classmethod
    def _patterns_well_formed(cls, value: list[str]) -> list[str]:
        from forwarder.ingress.san_acl import validate_pattern

        for pattern in value:
            validate_pattern(pattern)
        return value

    @model_validator(mode="after")
    def _backoff_order(self) -> ForwarderSettings:
        if self.connect_backoff_initial > self.connect_backoff_cap:
            raise ValueError(
                f"connect_backoff_initial ({self.connect_backoff_initial}) must not exceed "
                f"connect_backoff_cap ({self.connect_backoff_cap})"
            )
        return self

    @property
    def config_files(self) -> tuple[Path, Path, Path]:
        return (self.cert_file, self.key_file, self.ca_file)
