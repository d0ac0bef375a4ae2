"""``pip install .`` gives daemons that start (issue 22 point 13): the wheel, built from a copy of the tree
without build isolation (no network; setuptools comes with the test extras), installed into a fresh venv
without extras, imports every product module and passes ``sbxnet gateway|forwarder|scheduler|egress --check``
on sample configs. A runtime import missing from ``[project] dependencies`` fails here, as httptools did."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from shell_support import DAEMONS, clean_env, mint, sample_configs

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("sbxnet", "forwarder", "gateway", "scheduler", "certs", "native")
# Imported by name in the installed venv: every product module except the benchmark (its own extra, run from
# a checkout) and the extensions' build scripts (setup.py's, not the product's).
IMPORT_ALL = """
import importlib, pkgutil, sys
names = []
for top in sys.argv[1:]:
    pkg = importlib.import_module(top)
    names.append(top)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".")]
skip = ("sbxnet.app.bench", "native.build_", "native._cdef")
failed = []
for name in names:
    if name.startswith(skip):
        continue
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed) or f"imported {len(names)} modules")
sys.exit(1 if failed else 0)
"""


def run(cmd: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: {out.stdout}\n{out.stderr}"
    return out


def test_the_wheel_alone_installs_daemons_that_pass_check(tmp_path: Path) -> None:
    src = tmp_path / "src"
    built = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")

    def ignore(d: str, names: list[str]) -> set[str]:
        # what a build made (here or in a clean clone's CI), and the checkout's own tooling at the top
        top = {".git", ".venv", "build", ".mypy_cache", ".ruff_cache", ".hypothesis", "tests", "bench"}
        return set(built(d, names)) | (top & set(names) if Path(d) == ROOT else set())

    shutil.copytree(ROOT, src, ignore=ignore)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(src)], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("sbxnet-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    run([str(venv / "bin/pip"), "install", "-q", str(wheel)], tmp_path)
    frozen = run([str(venv / "bin/pip"), "freeze"], tmp_path).stdout.split()
    installed = {line.split("==")[0].lower() for line in frozen}
    assert "pytest" not in installed and "websockets" not in installed  # no extras came with it
    # cwd is outside the checkout: the modules come from the venv, not from the tree
    print(run([str(venv / "bin/python"), "-c", IMPORT_ALL, *PRODUCT], tmp_path).stdout)
    sbxnet = [str(venv / "bin/sbxnet")]
    mint(sbxnet, tmp_path / "pki")
    configs = sample_configs(tmp_path / "pki", tmp_path / "etc", var=tmp_path / "var")
    for daemon in DAEMONS:
        out = run([*sbxnet, daemon, "--check", "--config", str(configs[daemon])], tmp_path, timeout=60)
        assert "valid" in out.stdout, out
