"""``sbxnet <daemon> --check`` changes nothing on disk (issue 22 point 16): every daemon, run on a sample
config whose state lives under a temporary tree, leaves that tree (and its working directory) as it was;
and the scheduler's check still tells a store it cannot use."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shell_support import DAEMONS, clean_env, mint, sample_configs, tree

CLI = [sys.executable, "-m", "sbxnet.app.cli"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    mint(CLI, d)
    return d


def check(daemon: str, config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, daemon, "--check", "--config", str(config)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("daemon", DAEMONS)
def test_check_changes_nothing_on_disk(daemon: str, pki: Path, tmp_path: Path) -> None:
    var, work = tmp_path / "var", tmp_path / "work"
    configs = sample_configs(pki, tmp_path / "etc", var=var)
    work.mkdir()
    before, pki_before = tree(tmp_path), tree(pki)
    out = check(daemon, configs[daemon], work)
    assert out.returncode == 0, out.stderr
    assert "valid" in out.stdout
    assert tree(tmp_path) == before and tree(pki) == pki_before
    assert not var.exists()


def test_check_of_an_existing_sqlite_database_leaves_it_untouched(pki: Path, tmp_path: Path) -> None:
    var = tmp_path / "var"
    configs = sample_configs(pki, tmp_path / "etc", var=var)
    db = var / "lib/sbxnet/scheduler.db"
    db.parent.mkdir(parents=True)
    import sqlite3

    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    before = tree(tmp_path)
    out = check("scheduler", configs["scheduler"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"the SQLite database {db} exists" in out.stdout
    assert tree(tmp_path) == before


def test_check_refuses_a_database_file_that_is_not_sqlite(pki: Path, tmp_path: Path) -> None:
    var = tmp_path / "var"
    configs = sample_configs(pki, tmp_path / "etc", var=var)
    db = var / "lib/sbxnet/scheduler.db"
    db.parent.mkdir(parents=True)
    db.write_text("not a database\n")
    before = tree(tmp_path)
    out = check("scheduler", configs["scheduler"], tmp_path)
    assert out.returncode == 1 and f"{db} is not an SQLite database" in out.stderr, out
    assert tree(tmp_path) == before


def test_check_refuses_a_database_that_cannot_be_created(pki: Path, tmp_path: Path) -> None:
    configs = sample_configs(pki, tmp_path / "etc", var=tmp_path / "var")
    (tmp_path / "var").write_text("a file where a directory should be\n")
    out = check("scheduler", configs["scheduler"], tmp_path)
    assert out.returncode == 1 and "cannot be created" in out.stderr, out


@pytest.mark.parametrize(("daemon", "broken", "how"), [
    ("gateway", "scheduler.crt", "empty"),  # its client-facing certificate in the sample config
    ("gateway", "gateway.key", "other_key"),  # its link client key, not its certificate's
    ("forwarder", "forwarder.key", "empty"),
    ("forwarder", "ca.crt", "empty"),
    ("scheduler", "scheduler.key", "other_key"),
])
def test_check_names_the_tls_file_that_cannot_be_loaded(
        daemon: str, broken: str, how: str, pki: Path, tmp_path: Path) -> None:
    own = Path(shutil.copytree(pki, tmp_path / "pki"))
    configs = sample_configs(own, tmp_path / "etc", var=tmp_path / "var")
    if how == "empty":
        (own / broken).write_text("")
        named = own / broken
    else:  # a valid key that belongs to another certificate: the certificate is the file named
        (own / broken).write_bytes((own / "forwarder.key").read_bytes())
        named = own / broken.replace(".key", ".crt")
    out = check(daemon, configs[daemon], tmp_path)
    assert out.returncode == 2, out
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"{daemon}: cannot load the TLS material: {named}: "), line
