"""The gateway's one typed settings object, validated at start-up (env SBXNET_GATEWAY_*, [gateway])."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import Field, FilePath, IPvAnyAddress, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sbxnet.config import split_list


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SBXNET_GATEWAY_", extra="forbid", frozen=True)

    listen_host: IPvAnyAddress = ipaddress.IPv4Address("0.0.0.0")
    listen_port: int = Field(443, ge=1, le=65535)
    metrics_host: IPvAnyAddress = ipaddress.IPv4Address("127.0.0.1")
    metrics_port: int = Field(9465, ge=0, le=65535, description="0 disables /metrics, /healthz, /readyz")

    domain: str = Field(description="sandboxes are <port>-<sandbox>.<domain> and <sandbox>.<domain>")
    cert_files: Annotated[list[FilePath], NoDecode] = Field(min_length=1, description="client-facing certificates")
    key_files: Annotated[list[FilePath], NoDecode] = Field(min_length=1, description="their keys, in the same order")

    routes_file: FilePath | None = Field(
        None, description="registrations as JSON: {\"sandboxes\": {\"<id>\": {...}}} (instead of a scheduler)")
    scheduler_url: str | None = Field(None, description="the scheduler's API, https://host:port (instead of a file)")
    scheduler_cert_file: FilePath | None = Field(None, description="client certificate for it (default upstream_*)")
    scheduler_key_file: FilePath | None = None
    scheduler_ca_file: FilePath | None = Field(None, description="CA its certificate chains to (default upstream_ca)")
    scheduler_timeout: float = Field(2.0, gt=0, le=60, description="a route lookup's time-out")
    route_stale_s: float = Field(
        60.0, ge=0, le=3600, description="while the scheduler cannot be reached, serve the last route it gave "
                                         "for a sandbox for up to this long after it gave it; 0: never")
    upstream_cert_file: FilePath = Field(description="the gateway's client certificate for the forwarder link")
    upstream_key_file: FilePath
    upstream_ca_file: FilePath = Field(description="CA the forwarders' certificates chain to (and are pinned)")
    client_ca_file: FilePath | None = Field(
        None, description="CA that client certificates for raw TCP routes with auth client_cert must chain to; "
                          "without it such routes are closed after the handshake")

    handshake_timeout: float = Field(10.0, gt=0, le=120)
    header_timeout: float = Field(10.0, gt=0, le=300, description="a request head must be whole within this")
    idle_timeout: float = Field(75.0, gt=0, le=3600, description="an idle HTTP keep-alive connection")
    websocket_idle_timeout: float = Field(3600.0, gt=0, le=86400)
    tcp_idle_timeout: float = Field(3600.0, gt=0, le=86400, description="a raw TCP route with no byte either way")
    max_header_bytes: int = Field(16384, ge=1024, le=1 << 20)
    max_connections: int = Field(10000, ge=1, le=1_000_000)
    max_connections_per_sandbox: int = Field(1000, ge=1, le=1_000_000)
    wake_wait: float = Field(10.0, gt=0, le=60)
    upstream_pool_size: int = Field(0, ge=0, le=64, description="ready links kept per forwarder (warm pool); 0: none")
    upstream_pool_idle: float = Field(
        20.0, gt=0, le=3600, description="a pooled link unused this long is retired; keep it below the "
                                         "forwarders' preamble_idle_timeout (30 s by default)")
    upstream_pool_max: int = Field(1024, ge=1, le=100_000, description="pooled links in all")
    drain_timeout: float = Field(30.0, ge=0, le=3600)
    token_header: str = "X-Sbx-Token"
    token_cookie: str = "sbx_token"
    token_param: str = "token"
    workers: int = Field(1, ge=0, le=256, description="processes sharing the port (SO_REUSEPORT); 0 = one per core")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    _split = field_validator("cert_files", "key_files", mode="before")(split_list)

    @field_validator("scheduler_url")
    @classmethod
    def _scheduler_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from urllib.parse import urlsplit

        u = urlsplit(value)
        if u.scheme != "https" or not u.hostname or u.query or u.fragment or u.username:
            raise ValueError("https://host[:port][/path]: the scheduler is reached over mutual TLS")
        try:
            u.port  # noqa: B018 - parses it
        except ValueError:
            raise ValueError("the port must be a number 1..65535") from None
        return value.rstrip("/")

    @model_validator(mode="after")
    def _one_route_source(self) -> GatewaySettings:
        if (self.routes_file is None) == (self.scheduler_url is None):
            raise ValueError("set exactly one of routes_file and scheduler_url")
        if (self.scheduler_cert_file is None) != (self.scheduler_key_file is None):
            raise ValueError("scheduler_cert_file and scheduler_key_file go together")
        return self

    @model_validator(mode="after")
    def _pairs(self) -> GatewaySettings:
        if len(self.cert_files) != len(self.key_files):
            raise ValueError(
                f"cert_files ({len(self.cert_files)}) and key_files ({len(self.key_files)}) must pair up one to one"
            )
        return self

    @field_validator("domain")
    @classmethod
    def _domain(cls, value: str) -> str:
        from gateway.names import Names
        from sbxnet.errors import ConfigError

        try:
            Names(value)
        except ConfigError as e:  # pydantic reports ValueErrors as field errors with the value given
            raise ValueError(str(e).split(": ", 1)[-1]) from None
        return value
