"""The scheduler's one typed settings object, validated at start-up (env SBXNET_SCHEDULER_*, [scheduler])."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, FilePath, IPvAnyAddress, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sbxnet.config import split_list

_HEX64 = re.compile(r"[0-9a-f]{64}")


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SBXNET_SCHEDULER_", extra="forbid", frozen=True)

    listen_host: IPvAnyAddress = ipaddress.IPv4Address("127.0.0.1")
    listen_port: int = Field(8700, ge=1, le=65535)
    metrics_host: IPvAnyAddress = ipaddress.IPv4Address("127.0.0.1")
    metrics_port: int = Field(9466, ge=0, le=65535, description="0 disables /metrics, /healthz, /readyz")

    cert_file: FilePath = Field(description="the scheduler's server certificate")
    key_file: FilePath
    ca_file: FilePath = Field(description="CA that gateway and forwarder client certificates chain to")
    gateway_san_allow: Annotated[list[str], NoDecode] = Field(
        min_length=1, description="URI/DNS SANs of gateway certificates allowed route lookups and wakes"
    )
    forwarder_san_allow: Annotated[list[str], NoDecode] = Field(
        min_length=1, description="URI/DNS SANs of forwarder certificates allowed to post the idle feed"
    )
    admin_token_sha256: str | None = Field(
        None, description="hex SHA-256 of the platform's bearer token (`sbxnet certs token` prints it)")
    admin_token_file: FilePath | None = Field(None, description="a file holding the token itself (one line)")

    database: str = Field(
        "sqlite:///var/lib/sbxnet/scheduler.db",
        description="sqlite:///<absolute path> (one replica) or postgresql://... (replicas sharing it)",
    )
    sqlite_synchronous: Literal["FULL", "NORMAL"] = Field(
        "FULL", description="SQLite: FULL syncs every commit (an acknowledged batch is on disk); NORMAL may lose "
        "the last commits on power loss",
    )
    webhook_url: str | None = Field(None, description="the platform's driver: idle and waking events POSTed here")
    webhook_secret_file: FilePath | None = Field(None, description="HMAC-SHA256 key for X-Sbxnet-Signature")
    webhook_ca_file: FilePath | None = Field(None, description="CA for an https webhook (default: the system's)")
    route_cache_s: int = Field(2, ge=0, le=300, description="Cache-Control max-age of a route")
    negative_cache_s: int = Field(1, ge=0, le=300, description="Cache-Control max-age of an unknown sandbox")
    resync_s: float = Field(5.0, gt=0, le=300, description="shared store: re-read every row this often")
    source_stale_s: float = Field(
        30.0, ge=0, le=3600,
        description="a feed stream silent this long has its open connections forgotten (0: never)",
    )
    feed_interval: float = Field(
        1.0, ge=0.05, le=60, description="the forwarders' feed_interval (the longest, if they differ)",
    )
    feed_retry_cap: float = Field(
        2.0, ge=0.25, le=60, description="the forwarders' feed_retry_cap (the longest, if they differ)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    _split = field_validator("gateway_san_allow", "forwarder_san_allow", mode="before")(split_list)

    @field_validator("admin_token_sha256")
    @classmethod
    def _hash(cls, value: str | None) -> str | None:
        if value is not None and not _HEX64.fullmatch(value):
            raise ValueError("64 lower-case hex digits (`sbxnet certs token --hash FILE` prints it)")
        return value

    @field_validator("database")
    @classmethod
    def _database(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if scheme == "sqlite":
            path = value.removeprefix("sqlite://")
            if not path.startswith("/"):
                raise ValueError("sqlite:///<absolute path to the database file>")
        elif scheme not in ("postgresql", "postgres"):
            raise ValueError("sqlite:///<path> or postgresql://user@host/db")
        return value

    @field_validator("webhook_url")
    @classmethod
    def _webhook(cls, value: str | None) -> str | None:
        if value is None:
            return None
        u = urlsplit(value)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError("an http:// or https:// URL with a host")
        return value

    @model_validator(mode="after")
    def _one_token(self) -> SchedulerSettings:
        if (self.admin_token_sha256 is None) == (self.admin_token_file is None):
            raise ValueError("set exactly one of admin_token_sha256 and admin_token_file")
        return self

    @property
    def feed_stale_s(self) -> float:
        """How long a forwarder's feed may be silent and still be live (5.4 s by default): three of its
        intervals, then its longest retry with the jitter (+20 %). Silent longer, none of its sandboxes is
        idled until it reports again (docs/scheduler-api.md "Feed liveness")."""
        return 3 * self.feed_interval + 1.2 * self.feed_retry_cap

    @property
    def sqlite_path(self) -> Path | None:
        return Path(self.database.removeprefix("sqlite://")) if self.database.startswith("sqlite:") else None

    def admin_hash(self) -> str:
        """The admin token's SHA-256 (read from the file if that is how it was given: the token without its
        trailing newline, as ``certs.tokens`` reads every token file)."""
        from certs.tokens import TokenFileError, read_token_file, token_sha256

        if self.admin_token_sha256 is not None:
            return self.admin_token_sha256
        assert self.admin_token_file is not None
        try:
            return token_sha256(read_token_file(self.admin_token_file))
        except TokenFileError as e:
            from sbxnet.errors import ConfigError

            raise ConfigError(f"config: scheduler.admin_token_file: {e}") from None
