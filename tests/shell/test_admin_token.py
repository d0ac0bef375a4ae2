"""The admin token (issue 22 point 14): ``sbxnet certs token`` makes a token file and prints the hash to
configure; a token file's trailing newline is never part of the token (the hash printed, the scheduler's
``admin_token_file`` and its ``admin_token_sha256`` agree); and a refused admin call is logged, one line,
without the token."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from shell_support import clean_env, mint, sample_configs

from certs.tokens import read_token_file, token_sha256

CLI = [sys.executable, "-m", "sbxnet.app.cli"]


def sbxnet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=clean_env(), capture_output=True, text=True, timeout=60)


def test_token_makes_a_0600_file_and_prints_the_hash_of_the_token_without_its_newline(tmp_path: Path) -> None:
    out = sbxnet("certs", "token", "--out", str(tmp_path / "admin.token"))
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "admin.token").read_text()
    assert text.endswith("\n") and text.count("\n") == 1 and len(text.strip()) >= 40
    assert stat.S_IMODE((tmp_path / "admin.token").stat().st_mode) == 0o600
    printed = out.stdout.splitlines()[-1]
    assert printed == f"admin_token_sha256 = {hashlib.sha256(text.strip().encode()).hexdigest()}"
    # the docs' old recipe (sha256sum < admin.token) hashed the newline too: a different value
    assert printed.split(" = ")[1] != hashlib.sha256(text.encode()).hexdigest()


def test_token_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / "admin.token").write_text("kept\n")
    out = sbxnet("certs", "token", "--out", str(tmp_path / "admin.token"))
    assert out.returncode == 2 and "exists" in out.stderr
    assert (tmp_path / "admin.token").read_text() == "kept\n"


@pytest.mark.parametrize("content", ["tok-123", "tok-123\n", "tok-123\r\n", "  tok-123  \n\n"])
def test_hash_of_a_token_file_ignores_the_newline(tmp_path: Path, content: str) -> None:
    (tmp_path / "t").write_text(content)
    out = sbxnet("certs", "token", "--hash", str(tmp_path / "t"))
    assert out.returncode == 0 and out.stdout == f"admin_token_sha256 = {token_sha256('tok-123')}\n"
    assert read_token_file(tmp_path / "t") == "tok-123"


@pytest.mark.parametrize("content", ["", "\n", "two words\n", "line1\nline2\n"])
def test_hash_refuses_a_file_that_is_not_one_token(tmp_path: Path, content: str) -> None:
    (tmp_path / "t").write_text(content)
    out = sbxnet("certs", "token", "--hash", str(tmp_path / "t"))
    assert out.returncode == 2 and str(tmp_path / "t") in out.stderr and out.stdout == ""


def _call(port: int, ca: Path, token: str) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(f"https://localhost:{port}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.parametrize("how", ["admin_token_sha256", "admin_token_file"])
def test_the_scheduler_takes_the_printed_hash_and_logs_a_refusal_without_the_token(tmp_path: Path, how: str) -> None:
    pki = tmp_path / "pki"
    mint(CLI, pki)
    (pki / "admin.token").unlink()
    made = sbxnet("certs", "token", "--out", str(pki / "admin.token"))
    assert made.returncode == 0, made.stderr
    digest = made.stdout.splitlines()[-1].split(" = ")[1]
    config = sample_configs(pki, tmp_path / "etc", var=tmp_path / "var")["scheduler"]
    if how == "admin_token_sha256":
        config.write_text(config.read_text().replace(f'admin_token_file = "{pki}/admin.token"',
                                                     f'admin_token_sha256 = "{digest}"'))
    port = int(next(ln for ln in config.read_text().splitlines() if ln.startswith("listen_port")).split("=")[1])
    proc = subprocess.Popen([*CLI, "scheduler", "--config", str(config)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        token = (pki / "admin.token").read_text().strip()
        assert _call(port, pki / "ca.crt", token) == 200
        wrong = token[:-4] + "XXXX"
        assert _call(port, pki / "ca.crt", wrong) == 403
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert token not in err.decode() and wrong not in err.decode()
    logs = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    refused = [r for r in logs if r.get("event") == "refused"]
    assert len(refused) == 1, err.decode()
    (r,) = refused
    assert r["reason"] == "wrong_token" and r["status"] == 403 and r["path"] == "/v1/sandboxes"
    assert r["peer"].startswith("127.0.0.1:") and "certs token --hash" in r["msg"]


@pytest.mark.parametrize("content", ["", "\n"])
def test_an_empty_webhook_secret_file_is_refused_at_start(tmp_path: Path, content: str) -> None:
    pki = tmp_path / "pki"
    mint(CLI, pki)
    (pki / "webhook.secret").write_text(content)
    config = sample_configs(pki, tmp_path / "etc", var=tmp_path / "var")["scheduler"]
    config.write_text(config.read_text() + f'webhook_url = "https://platform.invalid/hook"\n'
                                           f'webhook_secret_file = "{pki}/webhook.secret"\n')
    out = sbxnet("scheduler", "--check", "--config", str(config))
    assert out.returncode == 2, out
    assert out.stderr == f"config: scheduler.webhook_secret_file: {pki}/webhook.secret: empty\n"
