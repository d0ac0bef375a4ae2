"""What every ``native/build_*.py`` shares: its cffi cdef read from the C header it binds, and source
paths as setuptools wants them.

One source for the C and the binding, so the two cannot drift apart. A header bound this way keeps
what lies between its last ``#include`` and the include guard's closing ``#endif`` to what cffi's
parser takes: integer ``#define``s, structs, typedefs and prototypes (no other preprocessor lines).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HERE = Path(__file__).parent


def rel(name: str) -> str:
    """``native/<name>`` relative to the working directory: setuptools refuses absolute source paths,
    and setup.py runs from the repository root however this file was imported."""
    return os.path.relpath(HERE / name)


def header_cdef(name: str) -> str:
    """The declarations of ``native/<name>`` as cffi's cdef, comments dropped."""
    text = (HERE / name).read_text()
    includes = list(re.finditer(r"^#include .*$", text, flags=re.M))
    start = includes[-1].end() if includes else 0
    body = text[start : text.rindex("#endif")]
    return re.sub(r"/\*.*?\*/", "", body, flags=re.S)
