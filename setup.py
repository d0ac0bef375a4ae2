"""Build hook: every ``native/build_*.py`` declares one cffi extension (``ffibuilder``).

Each C component is its own extension so that a component can be added without touching the others.
Test extensions (``native/build_*_test.py``: entry points such as key export that must never be in
the product) are built only when ``SBXNET_BUILD_TEST_EXTENSIONS=1``, as ``scripts/setup.sh`` does for
the development and CI install; a plain ``pip install .`` leaves them out.
"""

import os
import sys
from pathlib import Path

from setuptools import setup

here = Path(__file__).parent
# The build files import native._cdef; an isolated build does not put the source tree on sys.path.
sys.path.insert(0, str(here))
with_tests = os.environ.get("SBXNET_BUILD_TEST_EXTENSIONS") == "1"
modules = sorted(
    f"native/{p.name}:ffibuilder"
    for p in (here / "native").glob("build_*.py")
    if with_tests or not p.stem.endswith("_test")
)
setup(cffi_modules=modules)
