"""Regenerates the gateway-name seed corpus under tests/seeds/names/ (run by hand; the files are committed).

Each seed is what ``fuzz_names.one_input`` takes: one byte choosing the entry point, then its input; each is
named ``<expected>-<what>`` (``ok`` or the refusal's reason), which the replay checks with ``classify``.
The literal cases come from tests/gateway/names_cases.py. Usage: .venv/bin/python tests/fuzz/make_names_seeds.py
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gateway"))

import fuzz_names  # noqa: E402
from names_cases import (  # noqa: E402
    AUTHORITIES_OK,
    AUTHORITIES_REFUSED,
    DOMAIN,
    HOSTS_OK,
    HOSTS_REFUSED,
    LISTEN_PORT,
    TARGETS,
    TARGETS_REFUSED,
)
from seed_dir import write_seeds  # noqa: E402

OUT = HERE.parent / "seeds" / "names"
HOST, SNI, AUTHORITY, TARGET, H1, H2 = range(6)


def _what(text: str) -> str:
    """A file-name-safe label for an input: its printable letters, and a short hash so labels stay unique."""
    label = "".join(c if c.isascii() and c.isalnum() else "_" for c in text.split(".")[0])[:24] or "empty"
    return f"{label}_{hashlib.sha256(text.encode()).hexdigest()[:6]}"


def seeds() -> dict[str, bytes]:
    assert (fuzz_names.DOMAIN, fuzz_names.LISTEN_PORT) == (DOMAIN, LISTEN_PORT)
    out: dict[str, bytes] = {}

    def add(expected: str, what: str, which: int, data: bytes) -> None:
        name = f"{expected}-{what}"
        assert name not in out, name
        out[name] = bytes([which]) + data

    for text, _ in HOSTS_OK:
        add("ok", "host_" + _what(text), HOST, text.encode())
    for text, reason in HOSTS_REFUSED:
        add(reason, "host_" + _what(text), HOST, text.encode())
    for text, _ in AUTHORITIES_OK:
        add("ok", "authority_" + _what(text), AUTHORITY, text.encode())
    for text, reason in AUTHORITIES_REFUSED:
        add(reason, "authority_" + _what(text), AUTHORITY, text.encode())
    for text, _ in TARGETS:
        add("ok", "target_" + _what(text), TARGET, text.encode())
    for text, reason in TARGETS_REFUSED:
        add(reason, "target_" + _what(text), TARGET, text.encode())
    add("ok", "sni-a-name", SNI, b"a.sandbox.example.com")
    # whole requests: HTTP/1.1 target and Host, HTTP/2 :authority and Host
    add("ok", "h1-origin-form", H1, b"/x?y=1\na.sandbox.example.com:8443")
    add("ok", "h1-absolute-form-ignores-host", H1, b"https://b.sandbox.example.com/x\na.sandbox.example.com")
    add("missing_host", "h1-no-host", H1, b"/x")
    add("wrong_port", "h1-absolute-form-other-port", H1, b"https://b.sandbox.example.com:9/\na.sandbox.example.com")
    add("ok", "h2-authority-only", H2, b"22-a.sandbox.example.com")
    add("ok", "h2-authority-and-same-host", H2, b"a.sandbox.example.com:443\nA.SANDBOX.EXAMPLE.COM.")
    add("host_mismatch", "h2-authority-and-other-host", H2, b"a.sandbox.example.com\nb.sandbox.example.com")
    add("bad_char", "h2-authority-with-nul", H2, b"a\x00.sandbox.example.com")
    add("too_long", "host-huge", HOST, b"a" * 300)
    add("bad_char", "host-high-bytes", HOST, bytes(range(0x80, 0x90)))
    return out


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
