"""sbxnet/config.py, the one settings loader: one line per error, the table and field named, secret values
redacted, a missing field named as missing, an unknown setting or table named with the known ones listed;
and the CLI's exit code 2."""

from __future__ import annotations

import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbxnet.config import KNOWN_TABLES, load_settings, redact
from sbxnet.errors import ConfigError
from scheduler.settings import SchedulerSettings

CLI = [sys.executable, "-m", "sbxnet.app.cli"]
PASSWORD = "s3cret-Pa55"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SBXNET_"):
            monkeypatch.delenv(name)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for stem in ("cert", "key", "ca", "token"):
        out[stem] = tmp_path / stem
        out[stem].write_text("x\n")
    return out


def good_table(files: dict[str, Path], **extra: str) -> str:
    lines = [f'cert_file = "{files["cert"]}"', f'key_file = "{files["key"]}"', f'ca_file = "{files["ca"]}"',
             'gateway_san_allow = ["spiffe://t/gw"]', 'forwarder_san_allow = ["spiffe://t/fwd"]',
             f'admin_token_file = "{files["token"]}"']
    lines += [f"{k} = {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def error_of(tmp_path: Path, text: str) -> str:
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(SchedulerSettings, section="scheduler", config_file=tmp_path / "c.toml")
    return str(info.value)


def test_a_bad_database_url_is_one_line_with_its_password_redacted(tmp_path: Path, files: dict[str, Path]) -> None:
    text = error_of(tmp_path, "[scheduler]\n" + good_table(files, database=f'"mysql://app:{PASSWORD}@db/x"'))
    assert PASSWORD not in text
    assert text.splitlines() == [
        "config: scheduler.database = 'mysql://app:<redacted>@db/x': sqlite:///<path> or postgresql://user@host/db "
        "(set SBXNET_SCHEDULER_DATABASE or database in [scheduler])"]


def test_a_rule_across_fields_prints_no_settings_and_no_secret(tmp_path: Path, files: dict[str, Path]) -> None:
    # both token settings: the model-level rule fails, and its input (the whole table) is not printed
    table = good_table(files, admin_token_sha256='"' + "a" * 64 + '"', database=f'"postgresql://u:{PASSWORD}@h/d"')
    text = error_of(tmp_path, "[scheduler]\n" + table)
    assert PASSWORD not in text and "a" * 64 not in text and "cert_file" not in text
    assert text.splitlines() == ["config: [scheduler]: set exactly one of admin_token_sha256 and admin_token_file"]


def test_a_bad_token_hash_is_redacted(tmp_path: Path, files: dict[str, Path]) -> None:
    table = good_table(files).replace(f'admin_token_file = "{files["token"]}"', 'admin_token_sha256 = "TOKEN-ITSELF"')
    text = error_of(tmp_path, "[scheduler]\n" + table)
    assert "TOKEN-ITSELF" not in text
    assert text.splitlines() == [
        "config: scheduler.admin_token_sha256 = <redacted>: 64 lower-case hex digits (`sbxnet certs token --hash FILE` "
        "prints it) "
        "(set SBXNET_SCHEDULER_ADMIN_TOKEN_SHA256 or admin_token_sha256 in [scheduler])"]


def test_a_missing_field_is_named_missing_without_a_value(tmp_path: Path, files: dict[str, Path]) -> None:
    table = good_table(files, database=f'"postgresql://u:{PASSWORD}@h/d"').replace(f'ca_file = "{files["ca"]}"\n', "")
    text = error_of(tmp_path, "[scheduler]\n" + table)
    assert text.splitlines() == [
        "config: scheduler.ca_file: missing, required (set SBXNET_SCHEDULER_CA_FILE or ca_file in [scheduler])"]


def test_an_unknown_setting_lists_the_known_ones(tmp_path: Path, files: dict[str, Path]) -> None:
    text = error_of(tmp_path, "[scheduler]\n" + good_table(files, route_cache="5"))
    (line,) = text.splitlines()
    assert line.startswith("config: scheduler.route_cache: unknown setting (known: ")
    assert "route_cache_s" in line and "--help" not in line


def test_a_misnamed_table_is_named_as_unknown(tmp_path: Path, files: dict[str, Path]) -> None:
    text = error_of(tmp_path, "[schedular]\n" + good_table(files))
    lines = text.splitlines()
    known = ", ".join(f"[{t}]" for t in KNOWN_TABLES)
    assert lines[0] == f"config: [schedular] in {str(tmp_path / 'c.toml')!r}: unknown table (known: {known})"
    # the fields the misnamed table held are then missing from [scheduler]: each named, none with a value
    assert all(ln.startswith("config: scheduler.") and ": missing, required" in ln for ln in lines[1:])
    assert "{}" not in text


def test_an_unknown_table_beside_a_good_one_is_still_an_error(tmp_path: Path, files: dict[str, Path]) -> None:
    text = error_of(tmp_path, "[scheduler]\n" + good_table(files) + "[gatewy]\ndomain = 'x'\n")
    assert text.splitlines() == [
        f"config: [gatewy] in {str(tmp_path / 'c.toml')!r}: unknown table (known: "
        + ", ".join(f"[{t}]" for t in KNOWN_TABLES) + ")"]


def test_other_daemons_tables_are_welcome(tmp_path: Path, files: dict[str, Path]) -> None:
    (tmp_path / "c.toml").write_text("[scheduler]\n" + good_table(files) + "[gateway]\ndomain = 'x'\n")
    s = load_settings(SchedulerSettings, section="scheduler", config_file=tmp_path / "c.toml")
    assert s.ca_file == files["ca"]


@pytest.mark.parametrize("field", ["admin_token_sha256", "webhook_secret", "mesh_dsn", "password", "api_key"])
def test_secret_fields_are_never_shown(field: str) -> None:
    assert redact(field, "hunter2") == "<redacted>"


@pytest.mark.parametrize("field", ["key_file", "key_files", "admin_token_file", "webhook_secret_file", "domain"])
def test_paths_and_plain_fields_are_shown(field: str) -> None:
    assert redact(field, "/etc/sbxnet/x") == "'/etc/sbxnet/x'"


@given(user=st.text(string.ascii_letters + string.digits + "._-", max_size=8),
       password=st.text(string.ascii_letters + string.digits + "!#$%^&*()-_=+.,;:~?[]{}", min_size=1, max_size=20),
       scheme=st.sampled_from(["postgresql", "postgres", "https", "mysql"]))
def test_a_url_or_dsn_password_never_survives_redaction(user: str, password: str, scheme: str) -> None:
    assert redact("database", f"{scheme}://{user}:{password}@db.example/x") == repr(
        f"{scheme}://{user}:<redacted>@db.example/x")
    assert redact("database", f"host=db user=u password={password} dbname=x") == repr(
        "host=db user=u password=<redacted> dbname=x")


def test_the_cli_exits_2_with_one_line_per_error(tmp_path: Path, files: dict[str, Path]) -> None:
    (tmp_path / "c.toml").write_text("[schedular]\n" + good_table(files, database=f'"postgresql://u:{PASSWORD}@h/d"'))
    out = subprocess.run([*CLI, "scheduler", "--check", "--config", str(tmp_path / "c.toml")],
                         env={k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert PASSWORD not in out.stderr
    lines = out.stderr.splitlines()
    assert "[schedular]" in lines[0] and "unknown table" in lines[0]
    assert all(ln.startswith("config: ") for ln in lines), lines
