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
HOST, SNI, AUTHORITY, TARGET, H1, H2, H1_TARGET, H2_PATH = range(8)
# What a sandbox may receive as a request target (gateway/request_rules.py, issue 22 point 8): origin-form
# only, * for OPTIONS; absolute-form over HTTP/1.1 rewritten. Nothing of a refused one goes upstream.
UPSTREAM_TARGETS: list[tuple[str, int, bytes]] = [
    ("ok", H1_TARGET, b"GET /x?y=1"),
    ("ok", H2_PATH, b"GET /x?y=1"),
    ("ok", H1_TARGET, b"GET //evil.example/x"),
    ("ok", H1_TARGET, b"OPTIONS *"),
    ("ok", H2_PATH, b"OPTIONS *"),
    ("ok", H1_TARGET, b"GET https://a.sandbox.example.com/x?y"),
    ("ok", H1_TARGET, b"GET HTTPS://B.sandbox.example.com:8443?q"),
    ("ok", H1_TARGET, b"GET https://a.sandbox.example.com"),
    ("bad_target", H1_TARGET, b"GET *"),
    ("bad_target", H2_PATH, b"GET *"),
    ("bad_target", H2_PATH, b"POST *"),
    ("bad_target", H2_PATH, b"GET x"),
    ("bad_target", H1_TARGET, b"GET x"),
    ("bad_target", H2_PATH, b"GET https://b.sandbox.example.com/x"),
    ("bad_target", H2_PATH, b"GET https://a.sandbox.example.com/"),
    ("bad_target", H1_TARGET, b"GET /x#frag"),
    ("bad_target", H2_PATH, b"GET /x#frag"),
    ("bad_target", H1_TARGET, b"GET https://a.sandbox.example.com/x#frag"),
    ("bad_target", H1_TARGET, b"GET http://a.sandbox.example.com/"),
    ("bad_target", H1_TARGET, b"GET https:///x"),
    ("bad_target", H1_TARGET, b"CONNECT a.sandbox.example.com:443"),
    ("bad_target", H2_PATH, b"GET /a\r\nX-Injected: 1"),
    ("bad_target", H2_PATH, b"GET /\xc3\xa9"),
    ("bad_target", H1_TARGET, b"GET "),
]


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
    for expected, which, data in UPSTREAM_TARGETS:
        front = "h1-target" if which == H1_TARGET else "h2-path"
        add(expected, f"{front}_" + _what(data.decode("latin-1").replace(".", "_")), which, data)
    add("too_long", "host-huge", HOST, b"a" * 300)
    add("bad_char", "host-high-bytes", HOST, bytes(range(0x80, 0x90)))
    return out


def main() -> None:
    write_seeds(OUT, seeds())


if __name__ == "__main__":
    main()
