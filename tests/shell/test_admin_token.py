"""The admin token (issue 22 point 14): ``sbxnet certs token`` makes a token file and prints the hash to
configure; a token file's trailing newline is never part of the token (the hash printed, the scheduler's
``admin_token_file`` and its ``admin_token_sha256`` agree); and a refused admin call is logged, one line,
without the token."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from shell_support import clean_env

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
