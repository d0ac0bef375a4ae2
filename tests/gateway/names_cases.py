"""Literal name cases shared by test_names.py and the seed generator (tests/fuzz/make_names_seeds.py).

Every case is under ``DOMAIN`` for a listener on ``LISTEN_PORT``; ``names()`` builds that parser.
"""

from __future__ import annotations

from gateway.names import Name, Names

DOMAIN = "sandbox.example.com"
LISTEN_PORT = 8443


def names() -> Names:
    return Names(DOMAIN, listen_port=LISTEN_PORT)


# (host as a TLS server name or a Host's host part, the name it reads as)
HOSTS_OK: list[tuple[str, Name]] = [
    ("web.sandbox.example.com", Name("web", None)),
    ("8080-web.sandbox.example.com", Name("web", 8080)),
    ("WEB.Sandbox.Example.COM", Name("web", None)),
    ("8080-WeB.SANDBOX.example.com", Name("web", 8080)),
    ("web.sandbox.example.com.", Name("web", None)),
    ("22-web.sandbox.example.com.", Name("web", 22)),
    ("1-a.sandbox.example.com", Name("a", 1)),
    ("65535-a.sandbox.example.com", Name("a", 65535)),
    ("8080-8080-web.sandbox.example.com", Name("8080-web", 8080)),
    ("sbx_1.sandbox.example.com", Name("sbx_1", None)),
    ("-.sandbox.example.com", Name("-", None)),
    ("_.sandbox.example.com", Name("_", None)),
    ("8080.sandbox.example.com", Name("8080", None)),
    ("a-8080.sandbox.example.com", Name("a-8080", None)),
    ("443--x.sandbox.example.com", Name("-x", 443)),
    ("z" * 64 + ".sandbox.example.com", Name("z" * 64, None)),
    ("65535-" + "z" * 64 + ".sandbox.example.com", Name("z" * 64, 65535)),
    ("xn--nxasmq6b.sandbox.example.com", Name("xn--nxasmq6b", None)),
]

# (host, reason)
HOSTS_REFUSED: list[tuple[str, str]] = [
    ("", "empty"),
    (".", "empty_label"),
    ("web.sandbox.example.com..", "empty_label"),
    (".web.sandbox.example.com", "empty_label"),
    ("web..sandbox.example.com", "empty_label"),
    ("sandbox.example.com", "outside_domain"),
    ("sandbox.example.com.", "outside_domain"),
    ("web.example.com", "outside_domain"),
    ("web.sandbox.example.com.evil", "outside_domain"),
    ("websandbox.example.com", "outside_domain"),
    ("web.xsandbox.example.com", "outside_domain"),
    ("a.b.sandbox.example.com", "nested_label"),
    ("8080-a.b.sandbox.example.com", "nested_label"),
    ("0-web.sandbox.example.com", "bad_port"),
    ("08080-web.sandbox.example.com", "bad_port"),
    ("65536-web.sandbox.example.com", "bad_port"),
    ("99999999999999999999-web.sandbox.example.com", "bad_port"),
    ("8080-.sandbox.example.com", "bad_sandbox"),
    ("z" * 65 + ".sandbox.example.com", "bad_sandbox"),
    ("1-" + "z" * 65 + ".sandbox.example.com", "bad_sandbox"),
    ("127.0.0.1", "ip_literal"),
    ("127.0.0.1.", "ip_literal"),
    ("::1", "ip_literal"),
    ("fe80::1%eth0", "ip_literal"),
    ("[::1]", "ip_literal"),
    ("we b.sandbox.example.com", "bad_char"),
    ("web\x00.sandbox.example.com", "bad_char"),
    ("web\r\n.sandbox.example.com", "bad_char"),
    ("*.sandbox.example.com", "bad_char"),
    ("wéb.sandbox.example.com", "bad_char"),
    ("web:8443.sandbox.example.com", "bad_char"),
    ("a" * 254 + ".x", "too_long"),
]

# (Host / :authority value, the name it reads as): the listener's port and the scheme's default are ignored
AUTHORITIES_OK: list[tuple[str, Name]] = [
    ("web.sandbox.example.com", Name("web", None)),
    ("web.sandbox.example.com:443", Name("web", None)),
    ("web.sandbox.example.com:8443", Name("web", None)),
    ("web.sandbox.example.com.:8443", Name("web", None)),
    ("8080-Web.Sandbox.Example.Com:443", Name("web", 8080)),
    ("22-web.sandbox.example.com.", Name("web", 22)),
]

AUTHORITIES_REFUSED: list[tuple[str, str]] = [
    ("web.sandbox.example.com:80", "wrong_port"),
    ("web.sandbox.example.com:8080", "wrong_port"),
    ("web.sandbox.example.com:", "bad_authority"),
    ("web.sandbox.example.com:0443", "bad_authority"),
    ("web.sandbox.example.com:65536", "bad_authority"),
    ("web.sandbox.example.com:-1", "bad_authority"),
    ("web.sandbox.example.com:44 3", "bad_authority"),
    ("user@web.sandbox.example.com", "bad_authority"),
    ("user:pw@web.sandbox.example.com:443", "bad_authority"),
    ("[::1]:8443", "ip_literal"),
    ("[::1]", "ip_literal"),
    ("::1", "ip_literal"),
    ("fe80::1:8443", "ip_literal"),
    ("127.0.0.1:8443", "ip_literal"),
    ("web.sandbox.example.com::443", "bad_authority"),
    ("a:b:c", "bad_authority"),
    (":8443", "empty"),
    ("", "empty"),
    ("web.example.com:443", "outside_domain"),
    ("a.b.sandbox.example.com:443", "nested_label"),
]

# (request target, the authority it carries, or None for origin-form and '*')
TARGETS: list[tuple[str, str | None]] = [
    ("/", None),
    ("/path?x=1", None),
    ("*", None),
    ("https://web.sandbox.example.com/path", "web.sandbox.example.com"),
    ("HTTPS://8080-web.sandbox.example.com:443/p?q", "8080-web.sandbox.example.com:443"),
    ("https://web.sandbox.example.com", "web.sandbox.example.com"),
    ("https://web.sandbox.example.com?x=1", "web.sandbox.example.com"),
    ("https://web.sandbox.example.com#frag", "web.sandbox.example.com"),
]

TARGETS_REFUSED: list[tuple[str, str]] = [
    ("http://web.sandbox.example.com/", "bad_target"),
    ("web.sandbox.example.com:443", "bad_target"),
    ("ftp://web.sandbox.example.com/", "bad_target"),
    ("https:///path", "bad_target"),
    ("https://", "bad_target"),
    ("", "bad_target"),
    ("https://wéb.sandbox.example.com/", "bad_char"),
]
