"""Loading one component's typed settings: CLI overrides > environment (``SBXNET_<COMPONENT>_*``) >
TOML file section ``[<component>]`` > defaults. Validation errors become one ``ConfigError`` message,
one line per error, each naming the table and the field, the value given (secrets redacted: passwords
in URLs, tokens, secrets, keys) and what would be valid. A missing field is named as missing, never
given the whole configuration as its value; an unknown setting is named with the known ones listed; a
table in the file that no component reads is named as unknown with the known tables listed.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

from sbxnet.errors import ConfigError

S = TypeVar("S", bound=BaseSettings)


def split_list(value: object) -> object:
    """A list setting's value: environment variables carry lists as comma-separated text, TOML real arrays
    (use as a pydantic ``mode="before"`` validator on ``NoDecode`` list fields)."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


# The tables a config file may hold: one per daemon (one file can configure several on a host).
KNOWN_TABLES = ("egress", "forwarder", "gateway", "scheduler")

# A setting whose name has one of these parts holds a secret (not a path to one: ``*_file`` names a file).
_SECRET_PARTS = ("token", "secret", "password", "passwd", "key", "dsn")
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<password>[^@/\s]*)@")
_DSN_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<password>'[^']*'|\S+)", re.IGNORECASE)
REDACTED = "<redacted>"


def _is_secret_field(name: str) -> bool:
    parts = name.lower().split("_")
    if parts[-1] in ("file", "files", "dir", "path", "socket"):
        return False
    return any(part in _SECRET_PARTS for part in parts)


def redact(field: str, value: object) -> str:
    """``value`` as a config error may print it: a secret field's value is never shown, and a password in
    a URL (``postgresql://user:pw@host``) or a DSN (``password=pw``) is replaced in any field."""
    if _is_secret_field(field):
        return REDACTED
    text = repr(value)
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)
    return _DSN_PASSWORD.sub(lambda m: f"{m.group('head')}{REDACTED}", text)


def _read_file(config_file: Path) -> dict[str, Any]:
    try:
        with config_file.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config: file {str(config_file)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config: {str(config_file)!r} is a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"config: {str(config_file)!r} cannot be read (permission denied)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {str(config_file)!r} is not valid TOML: {e}") from None


def _unknown_tables(data: dict[str, Any], config_file: Path) -> list[str]:
    known = ", ".join(f"[{t}]" for t in KNOWN_TABLES)
    return [f"config: [{name}] in {str(config_file)!r}: unknown table (known: {known})"
            for name in data if name not in KNOWN_TABLES]


def _section(data: dict[str, Any], config_file: Path, section: str) -> dict[str, Any]:
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"config: [{section}] in {str(config_file)!r} must be a table")
    return table


def format_validation_error(e: ValidationError, section: str, env_prefix: str,
                            known: Collection[str] = ()) -> str:
    """One line per error: ``config: <table>.<field> ...``, the value redacted where it is a secret."""
    lines = []
    for err in e.errors():
        # Union members show up in the location as validator descriptions; keep only names and indexes.
        loc = [p for p in err["loc"] if isinstance(p, int) or (isinstance(p, str) and p.isidentifier())]
        field = ".".join(str(p) for p in loc)
        top = str(err["loc"][0]) if err["loc"] else ""
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            listed = f"known: {', '.join(sorted(known))}" if known else "remove it"
            lines.append(f"config: {section}.{field}: unknown setting ({listed})")
            continue
        if not top:  # a rule across fields: its input is the whole table, never printed
            lines.append(f"config: [{section}]: {msg}")
            continue
        where = f"{env_prefix}{top.upper()} or {top} in [{section}]"
        if err["type"] == "missing":
            lines.append(f"config: {section}.{field}: missing, required (set {where})")
            continue
        value = redact(top, err.get("input"))
        lines.append(f"config: {section}.{field} = {value}: {msg} (set {where})")
    return "\n".join(lines)


def load_settings(
    cls: type[S], *, section: str, config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> S:
    """Build ``cls`` from the layered sources, or raise ConfigError with every bad field named."""
    problems: list[str] = []
    file_values: dict[str, Any] = {}
    if config_file is not None:
        data = _read_file(config_file)
        problems = _unknown_tables(data, config_file)
        file_values = _section(data, config_file, section)
    cli_values = {k: v for k, v in (overrides or {}).items() if v is not None}
    env_prefix = str(cls.model_config.get("env_prefix", ""))

    class Loaded(cls):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls_,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, file_values))

    Loaded.__name__ = cls.__name__
    try:
        loaded = Loaded(**cli_values)
    except ValidationError as e:
        problems.append(format_validation_error(e, section, env_prefix, cls.model_fields))
        raise ConfigError("\n".join(problems)) from None
    if problems:
        raise ConfigError("\n".join(problems))
    return loaded
