"""Every Python mirror of a C header constant equals the header's.

Names come from the header's text (so a constant added there and not mirrored fails here); values
come from the compiled extension's ``lib``, where cffi puts every ``#define`` of the cdef, checked
against the C compiler at build time. The first test ties the two: the extension was built from this
header, not an older one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from forwarder.ingress.planes import ktls_keys, splice_pump

NATIVE = Path(__file__).resolve().parents[2] / "native"


def header_defines(header: str, prefix: str) -> dict[str, int]:
    """``#define <prefix>NAME <integer>`` lines of ``native/<header>``, as name -> value."""
    text = (NATIVE / header).read_text()
    found = re.findall(rf"^#define ({prefix}\w+)\s+(-?(?:0x[0-9a-fA-F]+|\d+))u?\b", text, flags=re.M)
    assert found, f"no {prefix}* in {header}"
    return {name: int(value, 0) for name, value in found}


def lib_of(module: str) -> Any:
    return __import__(f"native.{module}", fromlist=["lib"]).lib


@pytest.mark.parametrize(
    "header,module,prefix",
    [
        ("splice_pump.h", "_splice", "SP_"),
        ("tls_keys.h", "_tls_keys", "TK_E_"),
        ("egress_core.h", "_egress", "EG_"),
    ],
)
def test_extension_built_from_this_header(header: str, module: str, prefix: str) -> None:
    defines = header_defines(header, prefix)
    lib = lib_of(module)
    assert {name: getattr(lib, name) for name in defines} == defines


SPLICE = lib_of("_splice")
KEYS = lib_of("_tls_keys")

# Each coded cause -> the stable token Python counts it under: the splice pump's SP_R_* reasons
# (splice_pump.REASONS, indexed by code) and the key installer's TK_E_* errors (the KtlsError reason,
# ktls_keys._TK_ERRORS).
TOKENS = {
    "SP_R_NONE": "none",
    "SP_R_EOF": "eof",
    "SP_R_RESET": "reset",
    "SP_R_TIMEOUT": "timeout",
    "SP_R_TLS_DECRYPT": "tls_decrypt_error",
    "SP_R_TLS_KEY_UPDATE": "tls_key_update",
    "SP_R_TLS_ALERT": "tls_alert",
    "SP_R_TLS_UNEXPECTED": "tls_unexpected_record",
    "SP_R_TLS_RECORD": "tls_bad_record",
    "SP_R_ABORT": "abort",
    "SP_R_ABORT_RESET": "abort_reset",
    "SP_R_INTERNAL": "internal",
    "TK_E_ARG": "bad_argument",
    "TK_E_OPENSSL": "openssl_error",
    "TK_E_NOT_PREPARED": "not_prepared",
    "TK_E_STATE": "bad_state",
    "TK_E_CIPHER": "cipher_not_offloadable",
    "TK_E_BUFFERED": "buffered_in_openssl",
    "TK_E_RECORDS": "record_count_mismatch",
    "TK_E_ULP": "ulp_attach_failed",
    "TK_E_TX": "tls_tx_failed",
    "TK_E_RX": "tls_rx_failed",
    "TK_E_FOREIGN_KEYLOG": "foreign_keylog_callback",
}


@pytest.mark.parametrize(
    "header,prefix,lib,mirror",
    [
        ("splice_pump.h", "SP_R_", SPLICE, dict(enumerate(splice_pump.REASONS))),
        ("tls_keys.h", "TK_E_", KEYS, ktls_keys._TK_ERRORS),
    ],
    ids=["splice_reasons", "key_install_errors"],
)
def test_tokens(header: str, prefix: str, lib: Any, mirror: dict[int, str]) -> None:
    tokens = {name: token for name, token in TOKENS.items() if name.startswith(prefix)}
    assert set(header_defines(header, prefix)) == set(tokens)
    assert {getattr(lib, name): token for name, token in tokens.items()} == mirror


def test_key_install_errors_are_negative() -> None:
    assert all(code < 0 for code in ktls_keys._TK_ERRORS)  # the header's convention


def test_splice_outcomes() -> None:
    codes = header_defines("splice_pump.h", "SP_OUT_")
    assert {f"SP_OUT_{m.name}": int(m) for m in splice_pump.PumpOutcome} == {n: getattr(SPLICE, n) for n in codes}


def test_splice_event_flags() -> None:
    codes = header_defines("splice_pump.h", "SP_EV_")
    mirrors = {n: getattr(splice_pump, n) for n in dir(splice_pump) if n.startswith("EV_")}
    assert mirrors == {n.removeprefix("SP_"): getattr(SPLICE, n) for n in codes}


def test_splice_add_flags() -> None:
    assert set(header_defines("splice_pump.h", "SP_GW_")) == {"SP_GW_KTLS"}
    assert splice_pump.GW_KTLS == SPLICE.SP_GW_KTLS
