"""Each extension's ``.pyi`` stub names exactly what the compiled extension's ``lib`` has: every
constant and function of its header, nothing else (mypy checks the wrappers against these stubs)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"
EXTENSIONS = sorted(p.name.removeprefix("build_").removesuffix(".py") for p in NATIVE.glob("build_*.py"))


def _stub_lib_names(module: str) -> set[str]:
    """Names declared on ``class Lib`` in ``native/<module>.pyi``, with those of the stub classes it
    extends."""
    tree = ast.parse((NATIVE / f"{module}.pyi").read_text())
    imported = {
        a.asname or a.name: n.module
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("native.")
        for a in n.names
    }
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Lib"]
    names = {
        n.target.id if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) else getattr(n, "name", "")
        for n in cls.body
    } - {""}
    for base in cls.bases:
        assert isinstance(base, ast.Name) and base.id in imported, ast.dump(base)
        names |= _stub_lib_names(imported[base.id].removeprefix("native."))
    return names


def test_every_extension_has_a_stub() -> None:
    assert EXTENSIONS, "no native/build_*.py found"
    for name in EXTENSIONS:
        assert (NATIVE / f"_{name}.pyi").is_file(), f"native/_{name}.pyi is missing"


@pytest.mark.parametrize("name", EXTENSIONS)
def test_stub_matches_the_extension(name: str) -> None:
    lib = importlib.import_module(f"native._{name}").lib
    assert _stub_lib_names(f"_{name}") == set(dir(lib))
