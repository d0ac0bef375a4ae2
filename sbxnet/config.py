"""Loading one component's typed settings: CLI overrides > environment (``SBXNET_<COMPONENT>_*``) >
TOML file section ``[<component>]`` > defaults. Validation errors become one ``ConfigError`` message
that names the field, the value given and what would be valid.
"""

from __future__ import annotations

import tomllib
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


def _read_section(config_file: Path, section: str) -> dict[str, Any]:
    try:
        with config_file.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config: file {str(config_file)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {str(config_file)!r} is not valid TOML: {e}") from None
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"config: [{section}] in {str(config_file)!r} must be a table")
    return table


def format_validation_error(e: ValidationError, section: str, env_prefix: str) -> str:
    lines = []
    for err in e.errors():
        # Union members show up in the location as validator descriptions; keep only names and indexes.
        loc = [p for p in err["loc"] if isinstance(p, int) or (isinstance(p, str) and p.isidentifier())]
        field = ".".join(str(p) for p in loc) or "(settings)"
        top = str(err["loc"][0]) if err["loc"] else ""
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"config: {section}.{field}: unknown setting (remove it; see --help for the known ones)")
            continue
        where = f"{env_prefix}{top.upper()} or {top} in [{section}]" if top else f"[{section}]"
        lines.append(f"config: {section}.{field} = {value!r}: {err['msg']} (set {where})")
    return "\n".join(lines)


def load_settings(
    cls: type[S], *, section: str, config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> S:
    """Build ``cls`` from the layered sources, or raise ConfigError with every bad field named."""
    file_values = _read_section(config_file, section) if config_file else {}
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
        return Loaded(**cli_values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, section, env_prefix)) from None
