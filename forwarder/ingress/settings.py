"""The forwarder's one typed settings object, validated at start-up (env SBXNET_FORWARDER_*, [forwarder])."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

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
    preamble_timeout: float = Field(2.0, gt=0, le=60, description="from the preamble's first byte to its last")
    preamble_idle_timeout: float = Field(
        30.0, gt=0, le=3600, description="a handshaken link's wait for its first byte (a gateway's warm pool)"
    )
    handshake_timeout: float = Field(5.0, gt=0, le=60)
    connect_deadline: float = Field(10.0, gt=0, le=300)
    connect_syn_interval: float = Field(SYN_INTERVAL_S, gt=0, le=5, description="fresh SYN after this long unanswered")
    connect_backoff_initial: float = Field(BACKOFF_INITIAL_S, gt=0, le=5)
    connect_backoff_cap: float = Field(BACKOFF_CAP_S, gt=0, le=30)
    close_timeout: float = Field(30.0, gt=0, le=3600, description="after one side ends, wait for the other")
    drain_timeout: float = Field(30.0, ge=0, le=3600)
    max_connections: int = Field(10000, ge=1, le=1_000_000)
    workers: int = Field(1, ge=0, le=256, description="processes sharing the port; 0 = one per core")
    pump_threads: int = Field(
        0, ge=0, le=256, description="ktls plane: splice threads per worker; 0 = the cores shared among the workers")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    takeover_socket: Path | None = Field(
        None, description="Unix socket (0600) a new forwarder connects to, to take the listening socket over "
                          "(sbxnet forwarder --takeover PATH); unset: no takeover")
    takeover_timeout: float = Field(
        30.0, gt=0, le=600, description="how long either side of a takeover waits for the other's next message")
    takeover_move_ktls: bool = Field(
        True, description="ktls plane: move live tunnels to the new process at a takeover (both must set it); "
                          "off: they stay with the old one until they end")

    # The idle feed (docs/scheduler-api.md, "The idle feed"). Unset feed_url: no feed.
    feed_url: str | None = Field(None, description="https URL of the scheduler's POST /v1/feed")
    feed_cert_file: FilePath | None = Field(None, description="client certificate for the feed (default cert_file)")
    feed_key_file: FilePath | None = Field(None, description="its key (default key_file)")
    feed_ca_file: FilePath | None = Field(None, description="CA for the scheduler's certificate (default ca_file)")
    feed_interval: float = Field(1.0, ge=0.05, le=60, description="seconds between reports")
    feed_request_timeout: float = Field(5.0, gt=0, le=60, description="one POST, connect to answer")
    feed_retry_cap: float = Field(
        2.0, ge=0.25, le=60,
        description="longest wait between retries of an unanswered report (0.25 s doubling to this, +-20 %)",
    )
    feed_open_refresh: float = Field(
        10.0, ge=0.1, le=3600,
        description="a sandbox with open but silent connections is reported again this often (keep it under "
                    "the scheduler's source_stale_s)",
    )

    _split = field_validator("client_san_allow", "sandbox_prefixes", "allow_targets", mode="before")(split_list)

    @field_validator("client_san_allow")
    @classmethod
    def _patterns_well_formed(cls, value: list[str]) -> list[str]:
        from forwarder.ingress.san_acl import validate_pattern

        for pattern in value:
            validate_pattern(pattern)
        return value

    @field_validator("feed_url")
    @classmethod
    def _feed_url_well_formed(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            url = urlsplit(value)
            port = url.port
        except ValueError as e:
            raise ValueError(f"not a URL with a valid port ({e})") from None
        if url.scheme != "https":
            raise ValueError("must be an https:// URL (the feed goes over mutual TLS)")
        if not url.hostname:
            raise ValueError("must name the scheduler's host")
        if port == 0:
            raise ValueError("port 0 is not a port to connect to")
        if url.username is not None or url.password is not None:
            raise ValueError("must not carry user information (the forwarder is identified by its certificate)")
        if url.query or url.fragment or value.endswith(("?", "#")):
            raise ValueError("must not carry a query or fragment (the forwarder adds ?stream=<worker>)")
        if not url.path.endswith("/v1/feed"):
            raise ValueError("must be the scheduler's feed endpoint, a path ending in /v1/feed")
        return value

    @model_validator(mode="after")
    def _feed_key_pair(self) -> ForwarderSettings:
        if (self.feed_cert_file is None) != (self.feed_key_file is None):
            raise ValueError(
                "feed_cert_file and feed_key_file go together: set both, or neither to use cert_file and key_file"
            )
        return self

    @model_validator(mode="after")
    def _takeover_single_process(self) -> ForwarderSettings:
        if self.takeover_socket is not None and self.workers != 1:
            raise ValueError(
                f"takeover_socket needs workers = 1 (workers = {self.workers}): a takeover hands over one "
                "process's listener"
            )
        return self

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

    @property
    def feed_files(self) -> tuple[Path, Path, Path]:
        """The feed's client certificate, key and CA, defaults applied."""
        return (
            self.feed_cert_file or self.cert_file,
            self.feed_key_file or self.key_file,
            self.feed_ca_file or self.ca_file,
        )
