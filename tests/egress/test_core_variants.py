"""The checksum code paths the running CPU does not pick (adc without AVX2, portable C) built here and
compared with the installed module, so a machine without AVX2 or x86 runs tested code."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from cffi import FFI
from core_packets import PREFIX, csum_frame, tcp, vxlan_datagram

from forwarder.egress import fastpath as fp
from forwarder.egress import reference as ref
from native.build_egress import CDEF

NATIVE = Path(__file__).resolve().parents[2] / "native"


@pytest.mark.parametrize("define", ["EG_NO_AVX2", "EG_NO_ASM"])
def test_variant_matches(define: str, tmp_path: Path) -> None:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    for f in ("egress_core.c", "egress_core.h"):
        shutil.copy(NATIVE / f, tmp_path / f)
    ffi = FFI()
    ffi.cdef(CDEF)
    name = f"_egress_{define.lower()}"
    ffi.set_source(name, '#include "egress_core.h"', sources=["egress_core.c"], include_dirs=["."],
                   extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror", f"-D{define}"])
    so = ffi.compile(tmpdir=str(tmp_path))
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, so)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lib, vffi = mod.lib, mod.ffi
    rnd = random.Random(define)
    blob = rnd.randbytes(3100)
    for n in range(3000):
        s = rnd.randrange(64)
        d = blob[s : s + n] if s + n <= len(blob) else blob[:n]
        assert lib.eg_csum(d, len(d), 0) == ref.csum(d) == fp.csum(d), n
    # segmentation (copy-and-sum path) and inbound merging agree with the installed build
    frame = csum_frame(tcp(rnd.randbytes(20000)), 1, 1337)
    p = vffi.new("struct eg_out_params *", {"claim": 1, "mtu": 1500, "max_segs": 128, "max_gso_segs": 64,
                                             "max_send_bytes": 65507, "prefix": PREFIX})
    out = bytearray(40000)
    info = vffi.new("struct eg_seg_info *")
    assert lib.eg_segment(frame, len(frame), p, vffi.from_buffer(out), len(out), info) == 0
    from forwarder.egress.core_types import OutParams

    want = bytearray(40000)
    st, winfo = fp.segment(frame, OutParams(claim=1, prefix=PREFIX, mtu=1500), want)
    assert st == 0 and winfo is not None and out[: winfo.bytes] == want[: winfo.bytes]
    dg = [vxlan_datagram(tcp(rnd.randbytes(1000), seq=1000 * i, src=9, dst=7)) for i in range(5)]
    inbuf = b"".join(dg)
    offs = vffi.new("uint32_t[]", [sum(map(len, dg[:i])) for i in range(5)])
    lens = vffi.new("uint32_t[]", [len(d) for d in dg])
    res = vffi.new("struct eg_in_result[]", 5)
    used = vffi.new("size_t *")
    gro = vffi.new("uint32_t[]", [7])
    obuf = bytearray(1 << 16)
    assert lib.eg_inbound_batch(inbuf, len(inbuf), offs, lens, 5, 4242, gro, 1, vffi.from_buffer(obuf),
                                len(obuf), res, used) == 5
    _, _, want_out = ref.inbound_batch(inbuf, list(offs), list(lens), 4242, [7], 1 << 16)
    assert bytes(obuf[: used[0]]) == want_out
    assert [r.status for r in res] == [0, 1, 1, 1, 1]


def test_core_types_match_the_header() -> None:
    # core_types (shared by the reference and the wrapper) repeats the header's constants for code that
    # must not need the built module; the built module is the header's, so they must agree.
    from forwarder.egress import core_types as ct
    from native._egress import lib

    names = [n for n in dir(lib) if n.startswith("EG_")]
    assert len(names) == len(ct.REASONS) + 5
    for n in names:
        assert getattr(ct, n[3:]) == getattr(lib, n), n
    assert set(ct.REASONS) == {getattr(lib, n) for n in names if n.startswith("EG_ERR_")}
