"""The tree's import rules (DESIGN.md "Where each part lives", STYLE.md 11), read from the source with ``ast``.

- ``sbxnet/`` outside ``sbxnet/app/``, and ``certs/`` and ``native/``, are the shared leaves: ``native/``
  (the C hot paths' bindings) imports none of our other packages, and ``sbxnet/`` and ``certs/`` import
  none but ``native/`` (a codec in ``sbxnet/protocol/`` may have a C accelerator, as ``json`` has ``_json``).
- A component (``forwarder``, ``gateway``, ``scheduler``) never imports another.
- Only ``sbxnet/app/`` wires components together.
- A module that docs/architecture.md lists as pure (between its ``pure-modules`` markers: the one list
  the document and this test share) imports no socket, ssl, asyncio, uvloop, selectors, threading,
  pyroute2 or time, and none of our modules that is not itself pure.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("sbxnet", "certs", "native", "forwarder", "gateway", "scheduler")
COMPONENTS = ("forwarder", "gateway", "scheduler")
LEAVES = ("sbxnet", "certs", "native")
IMPURE = ("socket", "ssl", "asyncio", "uvloop", "selectors", "threading", "pyroute2", "time")
ARCH = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def sources() -> dict[str, Path]:
    out = {}
    for pkg in OURS:
        for p in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            out[module_name(p)] = p
    return out


def parse_imports(src: str, mod: str, *, is_pkg: bool, known: set[str] | dict[str, Path]) -> frozenset[str]:
    """Every module ``src`` (module ``mod``) imports, at any depth of its body (a function-level import
    counts too); relative imports resolved; ``from pkg import name`` adds ``pkg.name`` when it is a
    module in ``known``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in known)
    return frozenset(found)


@cache
def imports_of(mod: str) -> frozenset[str]:
    path = sources()[mod]
    return parse_imports(path.read_text(), mod, is_pkg=path.name == "__init__.py", known=sources())


def top(name: str) -> str:
    return name.split(".")[0]


def ours(names: frozenset[str]) -> set[str]:
    return {n for n in names if top(n) in OURS}


def in_app(mod: str) -> bool:
    return mod == "sbxnet.app" or mod.startswith("sbxnet.app.")


def pure_entries() -> list[str]:
    text = ARCH.read_text()
    m = re.search(r"<!-- pure-modules -->(.*?)<!-- /pure-modules -->", text, re.S)
    assert m, "docs/architecture.md must hold the pure-module list between <!-- pure-modules --> markers"
    entries = re.findall(r"^\s*- `([^`]+)`", m.group(1), re.M)
    assert entries, "the pure-module list is empty"
    return entries


def pure_modules() -> set[str]:
    """Modules named by the list: a ``path.py`` is that module, a ``dir/`` every module under it."""
    out: set[str] = set()
    for entry in pure_entries():
        target = ROOT / entry
        assert target.exists(), f"docs/architecture.md lists {entry} as pure, and there is no such path"
        paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
        out.update(module_name(p) for p in paths)
    return out


def test_the_tree_is_read() -> None:
    mods = sources()
    assert {"sbxnet.errors", "forwarder.ingress.server", "gateway.link_client", "certs.loader"} <= set(mods)


@pytest.mark.parametrize("mod", [m for m in sources() if top(m) in LEAVES and not in_app(m)])
def test_shared_leaves_import_none_of_our_other_packages(mod: str) -> None:
    below = () if top(mod) == "native" else ("native",)  # the bottom: C bindings, which import nothing of ours
    bad = {n for n in ours(imports_of(mod)) if top(n) != top(mod) and top(n) not in below}
    assert not bad, f"{mod} is a shared leaf and imports {sorted(bad)}"


@pytest.mark.parametrize("mod", [m for m in sources() if top(m) in COMPONENTS])
def test_components_import_only_themselves_and_the_shared_leaves(mod: str) -> None:
    bad = {n for n in ours(imports_of(mod)) if top(n) != top(mod) and (top(n) not in LEAVES or in_app(n))}
    assert not bad, f"{mod} imports {sorted(bad)}: components never import each other or the app"


def test_only_the_app_imports_components_from_the_shared_package() -> None:
    offenders = {
        m: sorted(n for n in ours(imports_of(m)) if top(n) in COMPONENTS)
        for m in sources()
        if top(m) in LEAVES and not in_app(m)
    }
    assert not {m: v for m, v in offenders.items() if v}


@pytest.mark.parametrize("mod", sorted(pure_modules()))
def test_pure_modules_do_no_io_and_read_no_clock(mod: str) -> None:
    imported = imports_of(mod)
    bad = sorted(n for n in imported if top(n) in IMPURE)
    assert not bad, f"{mod} is listed as pure in docs/architecture.md and imports {bad}"
    pure = pure_modules()
    impure_ours = sorted(n for n in ours(imported) if n in sources() and n not in pure)
    assert not impure_ours, f"{mod} is listed as pure and imports modules that are not: {impure_ours}"


def test_the_checker_catches_what_it_is_for() -> None:
    # The rules above must be able to fail: feed the parser a module that breaks each of them.
    src = "import time\nfrom gateway import link_client\n\ndef f():\n    import socket\n    from . import sibling\n"
    known = {"gateway.link_client", "forwarder.ingress.sibling"}
    got = parse_imports(src, "forwarder.ingress.mod", is_pkg=False, known=known)
    assert {"time", "socket", "gateway", "gateway.link_client", "forwarder.ingress.sibling"} <= got
    foreign = {n for n in ours(got) if top(n) in COMPONENTS and top(n) != "forwarder"}
    assert foreign == {"gateway", "gateway.link_client"}
    assert sorted(n for n in got if top(n) in IMPURE) == ["socket", "time"]
    pkg = parse_imports("from .codes import Status\n", "sbxnet.protocol", is_pkg=True, known=set())
    assert "sbxnet.protocol.codes" in pkg
