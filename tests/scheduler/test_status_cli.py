"""``sbxnet scheduler status`` finds the scheduler the way the daemon reads its settings (issue 22, point 19):
``resolve`` fills the URL, CA and token file from the flags first, then ``--config`` (the scheduler's own
file and SBXNET_SCHEDULER_* environment), then SBXNET_SCHEDULER_URL/_CA_FILE/_TOKEN_FILE, then the
default URL. Before, status had no --config and always went to $SBXNET_SCHEDULER_URL or 127.0.0.1:8700."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scheduler.cli import configure
from scheduler.status_cli import api_url, resolve


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure(p)
    return p.parse_args(["status", *argv])


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for k in ("SBXNET_SCHEDULER_LISTEN_PORT", "SBXNET_SCHEDULER_LISTEN_HOST", "SBXNET_SCHEDULER_CA_FILE"):
        monkeypatch.delenv(k, raising=False)
    for name in ("s.crt", "s.key", "ca.crt", "admin.token"):
        (tmp_path / name).write_text("x\n")
    path = tmp_path / "scheduler.toml"
    path.write_text("\n".join([
        "[scheduler]", 'listen_host = "10.1.2.3"', "listen_port = 9711",
        f'cert_file = "{tmp_path / "s.crt"}"', f'key_file = "{tmp_path / "s.key"}"',
        f'ca_file = "{tmp_path / "ca.crt"}"', 'gateway_san_allow = ["g"]', 'forwarder_san_allow = ["f"]',
        f'admin_token_file = "{tmp_path / "admin.token"}"',
    ]) + "\n")
    return path


def test_the_config_gives_the_address_ca_and_token(config: Path) -> None:
    args = parse("--config", str(config))
    assert resolve(args, {"SBXNET_SCHEDULER_URL": "https://elsewhere:1"}) is None
    assert (args.url, args.ca_file, args.token_file) == (
        "https://10.1.2.3:9711", config.parent / "ca.crt", config.parent / "admin.token")


def test_flags_override_the_config(config: Path, tmp_path: Path) -> None:
    args = parse("--config", str(config), "--url", "https://x:1", "--ca-file", "/c", "--token-file", "/t")
    assert resolve(args, {}) is None
    assert (args.url, args.ca_file, args.token_file) == ("https://x:1", Path("/c"), Path("/t"))


def test_without_config_the_environment_then_the_default(tmp_path: Path) -> None:
    args = parse()
    assert resolve(args, {}) is None and args.url == "https://127.0.0.1:8700" and args.token_file is None
    args = parse()
    env = {"SBXNET_SCHEDULER_URL": "https://s:8", "SBXNET_SCHEDULER_CA_FILE": "/ca",
           "SBXNET_SCHEDULER_TOKEN_FILE": "/tok"}
    assert resolve(args, env) is None
    assert (args.url, args.ca_file, args.token_file) == ("https://s:8", Path("/ca"), Path("/tok"))


def test_a_bad_config_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\nlisten_port = 70000\n")
    problem = resolve(parse("--config", str(bad)), {})
    assert problem is not None and str(bad) in problem and "listen_port" in problem


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "https://127.0.0.1:1"), ("0.0.0.0", "https://127.0.0.1:1"), ("::", "https://[::1]:1"),
    ("fd00::5", "https://[fd00::5]:1"),
])
def test_a_wildcard_listener_is_reached_on_loopback(host: str, url: str) -> None:
    assert api_url(host, 1) == url
