"""Build hook: every ``native/build_*.py`` declares one cffi extension (``ffibuilder``).

Each C component is its own extension so that a component can be added without touching the others.
"""

from pathlib import Path

from setuptools import setup

here = Path(__file__).parent
modules = sorted(f"native/{p.name}:ffibuilder" for p in (here / "native").glob("build_*.py"))
setup(cffi_modules=modules)
