"""cffi build of the egress packet core (``native._egress``); wrapped by ``forwarder.egress.fastpath``."""

import os
import re
from pathlib import Path

from cffi import FFI

_here = Path(__file__).parent


def _rel(name: str) -> str:
    # setuptools refuses absolute source paths; relative to the working directory (the repo root
    # when setup.py runs) this is native/<name> however the file was imported.
    return os.path.relpath(_here / name)


def _cdef(header: Path) -> str:
    """The header's declarations as cffi's cdef: what lies between its includes and its closing
    ``#endif``, comments dropped. One source for the C and the binding, so they cannot drift apart."""
    text = header.read_text()
    start = text.index("#include <stdint.h>") + len("#include <stdint.h>")
    return re.sub(r"/\*.*?\*/", "", text[start : text.rindex("#endif")], flags=re.S)


CDEF = _cdef(_here / "egress_core.h")

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "native._egress",
    '#include "egress_core.h"',
    sources=[_rel("egress_core.c")],
    include_dirs=[_rel(".")],
    depends=[_rel("egress_core.h")],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
