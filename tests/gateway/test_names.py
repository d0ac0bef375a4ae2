"""gateway/names.py: server names, Host and :authority values, request targets, under one domain."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from names_cases import (
    AUTHORITIES_OK,
    AUTHORITIES_REFUSED,
    DOMAIN,
    HOSTS_OK,
    HOSTS_REFUSED,
    LISTEN_PORT,
    TARGETS,
    TARGETS_REFUSED,
    names,
)

from gateway.names import Name, NameRefused, Names
from sbxnet.errors import ConfigError, LocalProtocolError, RemoteProtocolError

N = names()


def refused(reason: str) -> pytest.RaisesExc[NameRefused]:
    return pytest.raises(NameRefused, match=rf"^{reason}(:|$)")


@pytest.mark.parametrize(("host", "want"), HOSTS_OK, ids=[h[:40] for h, _ in HOSTS_OK])
def test_host_names(host: str, want: Name) -> None:
    assert N.parse_host(host) == want
    assert N.parse_host(host.encode()) == want
    assert N.parse_sni(host) == want


@pytest.mark.parametrize(("host", "reason"), HOSTS_REFUSED, ids=[f"{r}-{h[:30]!r}" for h, r in HOSTS_REFUSED])
def test_host_names_refused(host: str, reason: str) -> None:
    with refused(reason) as e:
        N.parse_host(host)
    assert e.value.reason == reason
    assert isinstance(e.value, RemoteProtocolError)
    if host.isascii():
        with refused(reason):
            N.parse_host(host.encode())


@pytest.mark.parametrize(("value", "want"), AUTHORITIES_OK, ids=[a for a, _ in AUTHORITIES_OK])
def test_authorities(value: str, want: Name) -> None:
    assert N.parse_authority(value) == want
    assert N.parse_authority(value.encode()) == want


@pytest.mark.parametrize(("value", "reason"), AUTHORITIES_REFUSED, ids=[f"{r}-{a!r}" for a, r in AUTHORITIES_REFUSED])
def test_authorities_refused(value: str, reason: str) -> None:
    with refused(reason):
        N.parse_authority(value)


@pytest.mark.parametrize(("target", "want"), TARGETS, ids=[t for t, _ in TARGETS])
def test_targets(target: str, want: str | None) -> None:
    assert N.authority_of_target(target) == want
    assert N.authority_of_target(target.encode()) == want


@pytest.mark.parametrize(("target", "reason"), TARGETS_REFUSED, ids=[f"{r}-{t!r}" for t, r in TARGETS_REFUSED])
def test_targets_refused(target: str, reason: str) -> None:
    with refused(reason):
        N.authority_of_target(target)


def test_the_error_detail_never_repeats_the_peer() -> None:
    for host, _ in HOSTS_REFUSED:
        with pytest.raises(NameRefused) as e:
            N.parse_host(host)
        if len(host) > 3:
            assert host not in str(e.value)


def test_no_server_name_is_none() -> None:
    assert N.parse_sni(None) is None


def test_the_listener_port_and_the_scheme_default_are_the_ports_ignored() -> None:
    assert N.accepted_ports == {LISTEN_PORT, 443}
    plain = Names(DOMAIN, listen_port=8080, scheme="http")
    assert plain.accepted_ports == {8080, 80}
    assert plain.parse_authority("web.sandbox.example.com:80") == Name("web", None)
    with refused("wrong_port"):
        plain.parse_authority("web.sandbox.example.com:443")
    assert plain.authority_of_target("http://web.sandbox.example.com/") == "web.sandbox.example.com"
    with refused("bad_target"):
        plain.authority_of_target("https://web.sandbox.example.com/")


def test_a_domain_given_with_case_and_a_trailing_dot_is_the_same_domain() -> None:
    n = Names("Sandbox.Example.COM.", listen_port=443)
    assert n.domain == DOMAIN
    assert n.parse_host("web.sandbox.example.com") == Name("web", None)


@pytest.mark.parametrize(
    "domain", ["", ".", "a..b", "-a.com", "a-.com", "a_b.com", "*.example.com", "example.123", "10.0.0.1", "é.com",
               "a." * 100 + "com"]
)
def test_bad_domains_are_refused_at_start(domain: str) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.domain"):
        Names(domain)


@pytest.mark.parametrize("port", [0, 65536, -1, True])
def test_bad_listen_ports_are_refused_at_start(port: int) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.listen_port"):
        Names(DOMAIN, listen_port=port)


def test_a_bad_scheme_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="scheme"):
        Names(DOMAIN, scheme="ftp")


# -- request_name: which authority a request names ------------------------------------------------


def test_http1_routes_by_host() -> None:
    assert N.request_name(b"/x", [b"8080-web.sandbox.example.com:8443"]) == Name("web", 8080)


def test_http1_absolute_form_routes_by_the_target_and_ignores_host() -> None:
    got = N.request_name(b"https://other.sandbox.example.com/x?y", [b"web.sandbox.example.com"])
    assert got == Name("other", None)
    assert N.request_name(b"https://other.sandbox.example.com:443/", []) == Name("other", None)


def test_http1_absolute_form_authority_is_checked_like_a_host() -> None:
    with refused("wrong_port"):
        N.request_name(b"https://web.sandbox.example.com:9/", [b"web.sandbox.example.com"])
    with refused("bad_authority"):
        N.request_name(b"https://u@web.sandbox.example.com/", [])


def test_http11_without_host_is_refused_and_http10_without_host_gives_none() -> None:
    with refused("missing_host"):
        N.request_name(b"/", [])
    assert N.request_name(b"/", [], http10=True) is None


def test_more_than_one_host_is_refused() -> None:
    with refused("duplicate_host"):
        N.request_name(b"/", [b"web.sandbox.example.com", b"web.sandbox.example.com"])
    with refused("duplicate_host"):
        N.request_name(b"https://web.sandbox.example.com/", [b"a.sandbox.example.com", b"b.sandbox.example.com"])
    with refused("duplicate_host"):
        N.request_name(b"/", [b"a", b"b"], authority=b"web.sandbox.example.com", http2=True)


def test_http2_routes_by_authority_then_host() -> None:
    assert N.request_name(b"/", [], authority=b"22-web.sandbox.example.com", http2=True) == Name("web", 22)
    assert N.request_name(b"/", [b"web.sandbox.example.com"], http2=True) == Name("web", None)
    with refused("missing_host"):
        N.request_name(b"/", [], http2=True)


def test_http2_host_must_name_what_authority_names() -> None:
    same = N.request_name(b"/", [b"WEB.sandbox.example.com:443"], authority=b"web.sandbox.example.com.", http2=True)
    assert same == Name("web", None)
    with refused("host_mismatch"):
        N.request_name(b"/", [b"other.sandbox.example.com"], authority=b"web.sandbox.example.com", http2=True)
    with refused("host_mismatch"):
        N.request_name(b"/", [b"8080-web.sandbox.example.com"], authority=b"web.sandbox.example.com", http2=True)


def test_an_origin_form_target_longer_than_any_bound_is_still_origin_form() -> None:
    assert N.authority_of_target(b"/" + b"a" * 100_000) is None
    with refused("too_long"):
        N.authority_of_target(b"h" * 100_000)


# -- host_of: the builder, and the round trip -------------------------------------------------------


def test_host_of_builds_the_canonical_names() -> None:
    assert N.host_of(Name("web", None)) == "web.sandbox.example.com"
    assert N.host_of(Name("web", 8080)) == "8080-web.sandbox.example.com"
    assert N.host_of(Name("8080-web", 8080)) == "8080-8080-web.sandbox.example.com"


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        (Name("Web", None), "bad_sandbox"),
        (Name("", None), "bad_sandbox"),
        (Name("a.b", None), "bad_sandbox"),
        (Name("z" * 65, None), "bad_sandbox"),
        (Name("8080-web", None), "ambiguous_name"),
        (Name("0-web", None), "ambiguous_name"),
        (Name("web", 0), "bad_port"),
        (Name("web", 65536), "bad_port"),
    ],
)
def test_host_of_refuses_what_no_name_can_carry(name: Name, reason: str) -> None:
    with pytest.raises(LocalProtocolError, match=f"^{reason}"):
        N.host_of(name)


def test_every_accepted_case_round_trips_through_the_builder() -> None:
    for host, want in HOSTS_OK:
        assert N.parse_host(N.host_of(want)) == want, host


SANDBOXES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=64)
PORTS = st.none() | st.integers(1, 65535)


def _nameable(name: Name) -> bool:
    try:
        N.host_of(name)
    except LocalProtocolError:
        return False
    return True


@given(st.builds(Name, SANDBOXES, PORTS).filter(_nameable), st.booleans(), st.booleans(), st.sampled_from(
    ["", ":443", f":{LISTEN_PORT}"]))
def test_round_trip(name: Name, upper: bool, dot: bool, port_suffix: str) -> None:
    host = N.host_of(name)
    assert N.parse_host(host) == name
    spelled = (host.upper() if upper else host) + ("." if dot else "")
    assert N.parse_host(spelled) == name
    assert N.parse_sni(spelled) == name
    assert N.parse_authority(spelled + port_suffix) == name
    assert N.request_name(f"https://{spelled}{port_suffix}/p".encode(), []) == name
    assert N.request_name(b"/", [], authority=(spelled + port_suffix).encode(), http2=True) == name


@given(st.builds(Name, SANDBOXES, PORTS))
def test_a_name_is_either_nameable_or_refused_by_the_builder(name: Name) -> None:
    # a default-port sandbox that starts with <digits>- is the only sandbox the builder cannot name
    assert _nameable(name) == (name.port is not None or not (name.sandbox.split("-")[0].isdigit()
                                                              and "-" in name.sandbox))


def _only_named_errors(f: object, *args: object) -> None:
    try:
        f(*args)  # type: ignore[operator]
    except NameRefused as e:
        assert e.reason and e.reason.isidentifier(), e.reason


@given(st.binary(max_size=300))
def test_parse_of_any_bytes_raises_only_the_named_error(data: bytes) -> None:
    for f in (N.parse_host, N.parse_sni, N.parse_authority, N.authority_of_target):
        _only_named_errors(f, data)
    _only_named_errors(lambda d: N.request_name(d, [d]), data)
    _only_named_errors(lambda d: N.request_name(b"/", [d], authority=d, http2=True), data)


ALPHABET = "aAzZ09-_.:[]@/%*? \x00\t\u00e9" + DOMAIN


@given(st.text(alphabet=ALPHABET, max_size=120))
def test_parse_of_name_like_text_raises_only_the_named_error(text: str) -> None:
    for f in (N.parse_host, N.parse_authority, N.authority_of_target):
        _only_named_errors(f, text)
        _only_named_errors(f, text + "." + DOMAIN)
        _only_named_errors(f, "8080-" + text + "." + DOMAIN + ":443")


@given(st.one_of(st.text(alphabet="0123456789.:abcdefABCDEF%[]x", max_size=45), st.ip_addresses().map(str),
                 st.text(max_size=20)))
def test_is_ip_is_ipaddress(text: str) -> None:
    """The quick refusal of text that cannot be an address agrees with ipaddress on every string."""
    import ipaddress

    from gateway.names import _is_ip

    try:
        ipaddress.ip_address(text)
        want = True
    except ValueError:
        want = False
    assert _is_ip(text) is want


@given(st.lists(st.one_of(st.sampled_from([a for a, _ in AUTHORITIES_OK] + [a for a, _ in AUTHORITIES_REFUSED]),
                          st.text(alphabet=ALPHABET, max_size=40)), max_size=30), st.booleans())
def test_authorities_remembered_are_parsed_as_afresh(values: list[str], as_bytes: bool) -> None:
    """Names.parse_authority remembers what it accepted: asked again (as str or bytes), it answers as a
    Names that never saw the value would, refusals included, and it remembers a bounded number."""
    import gateway.names as names_module

    kept = names()
    for value in values + values:
        v: str | bytes = value.encode() if as_bytes and value.isascii() else value
        try:
            want: Name | str = names().parse_authority(v)
        except NameRefused as e:
            want = e.reason
        try:
            got: Name | str = kept.parse_authority(v)
        except NameRefused as e:
            got = e.reason
        assert got == want
    assert len(kept._known) <= names_module._KNOWN_MAX


def test_the_remembered_authorities_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.names as names_module

    monkeypatch.setattr(names_module, "_KNOWN_MAX", 8)
    n = names()
    for i in range(100):
        assert n.parse_authority(f"s{i}.{DOMAIN}") == Name(f"s{i}", None)
        assert len(n._known) <= 8
