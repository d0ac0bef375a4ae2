"""gateway/request_rules.py: the target a sandbox receives (origin-form only), the method, and the HTTP/2 head
checks h2 leaves to us. Tables, then properties over arbitrary bytes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.request_rules import MAX_METHOD, RequestRefused, check_h2_head, check_method, upstream_target

ACCEPTED: list[tuple[bytes, bytes, bool, bytes]] = [
    # method, target, http2, what goes upstream
    (b"GET", b"/", False, b"/"),
    (b"GET", b"/a/b?c=d&e", True, b"/a/b?c=d&e"),
    (b"GET", b"//evil.example/x", False, b"//evil.example/x"),  # origin-form: a path whose first segment is empty
    (b"OPTIONS", b"*", False, b"*"),
    (b"OPTIONS", b"*", True, b"*"),
    (b"GET", b"https://a.sandbox.example.com/x?y", False, b"/x?y"),
    (b"GET", b"HTTPS://A.sandbox.example.com:443/x", False, b"/x"),
    (b"GET", b"https://a.sandbox.example.com", False, b"/"),
    (b"GET", b"https://a.sandbox.example.com?q=1", False, b"/?q=1"),
    (b"GET", b"https://a.sandbox.example.com/https://b.sandbox.example.com/", False, b"/https://b.sandbox.example.com/"),
]

REFUSED: list[tuple[bytes, bytes, bool]] = [
    (b"GET", b"*", False),
    (b"GET", b"*", True),
    (b"POST", b"*", True),
    (b"options", b"*", False),  # methods are case-sensitive
    (b"GET", b"x", True),
    (b"GET", b"x", False),
    (b"GET", b"", False),
    (b"GET", b"/x#frag", False),
    (b"GET", b"/x#", True),
    (b"GET", b"https://a.sandbox.example.com/x#f", False),
    (b"GET", b"https://b.sandbox.example.com/x", True),  # absolute-form is never an HTTP/2 :path
    (b"GET", b"https://a.sandbox.example.com/", True),
    (b"GET", b"http://a.sandbox.example.com/", False),  # not our scheme
    (b"GET", b"ftp://a.sandbox.example.com/", False),
    (b"GET", b"https:///x", False),  # no authority
    (b"GET", b"https://", False),
    (b"GET", b"https://?x", False),
    (b"CONNECT", b"a.sandbox.example.com:443", False),  # authority-form
    (b"GET", b"/a b", False),
    (b"GET", b"/a\x00", True),
    (b"GET", b"/\xc3\xa9", True),
    (b"GET", b"/a\r\nX-Injected: 1", True),
]


@pytest.mark.parametrize(("method", "target", "http2", "want"), ACCEPTED)
def test_accepted_targets_go_upstream_in_origin_form(method: bytes, target: bytes, http2: bool, want: bytes) -> None:
    assert upstream_target(method, target, http2=http2) == want


@pytest.mark.parametrize(("method", "target", "http2"), REFUSED)
def test_other_targets_are_refused(method: bytes, target: bytes, http2: bool) -> None:
    with pytest.raises(RequestRefused) as e:
        upstream_target(method, target, http2=http2)
    assert e.value.reason == "bad_target"
    assert len(target) < 4 or target.decode("latin-1") not in str(e.value)  # the peer's text is not repeated


def test_an_http_listener_takes_absolute_form_of_its_own_scheme_only() -> None:
    assert upstream_target(b"GET", b"http://a.sandbox.example.com/x", scheme="http") == b"/x"
    with pytest.raises(RequestRefused):
        upstream_target(b"GET", b"https://a.sandbox.example.com/x", scheme="http")


@pytest.mark.parametrize("method", [b"GET", b"PROPFIND", b"M-SEARCH", b"x!#$%&'*+.^_`|~", b"G" * MAX_METHOD])
def test_token_methods_pass(method: bytes) -> None:
    check_method(method)


@pytest.mark.parametrize("method", [b"", b"G T", b"GET\x7f", b"(GET)", b"GET\r\n", b"G\xc3\xa9T",
                                    b"G" * (MAX_METHOD + 1)])
def test_other_methods_are_bad_method(method: bytes) -> None:
    with pytest.raises(RequestRefused) as e:
        check_method(method)
    assert e.value.reason == "bad_method"


HEAD = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"a.sandbox.example.com"), (b":path", b"/")]


@pytest.mark.parametrize(("extra", "ended", "reason"), [
    ([(b"content-length", b"30")], True, "content_length_mismatch"),
    ([(b"content-length", b"1")], True, "content_length_mismatch"),
    ([(b"content-length", b"0")], True, None),
    ([(b"content-length", b"00")], True, None),
    ([(b"content-length", b"30")], False, None),  # h2 holds the DATA to it
    ([], True, None),
    ([], False, None),
])
def test_an_http2_head_that_ends_its_stream_carries_no_body(extra: list[tuple[bytes, bytes]], ended: bool,
                                                            reason: str | None) -> None:
    if reason is None:
        check_h2_head([*HEAD, *extra], ended=ended)
        return
    with pytest.raises(RequestRefused) as e:
        check_h2_head([*HEAD, *extra], ended=ended)
    assert e.value.reason == reason


def test_an_http2_head_with_a_method_that_is_not_a_token_is_refused() -> None:
    with pytest.raises(RequestRefused) as e:
        check_h2_head([(b":method", b"G T"), *HEAD[1:]], ended=True)
    assert e.value.reason == "bad_method"


# -- properties ---------------------------------------------------------------------------------------------------

TARGET_BYTES = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda a, b: a + b, st.sampled_from([b"/", b"*", b"https://", b"HTTPS://a.b", b"x", b"#", b"?"]),
              st.binary(max_size=30)),
    st.from_regex(rb"\A(https://[a-z0-9.:@-]{0,12})?[/?#*a-z0-9%]{0,16}\Z"),
)
_ORIGIN = re.compile(rb"/[\x21-\x7e]*")


@settings(max_examples=500)
@given(st.sampled_from([b"GET", b"OPTIONS", b"POST"]), TARGET_BYTES, st.booleans())
def test_what_goes_upstream_is_origin_form_or_an_options_asterisk(method: bytes, target: bytes, http2: bool) -> None:
    """Whatever comes, the answer is a refusal or origin-form (``*`` only for OPTIONS), printable, without a
    fragment; origin-form comes back unchanged; absolute-form only over HTTP/1.1, as its path and query."""
    try:
        out = upstream_target(method, target, http2=http2)
    except RequestRefused as e:
        assert e.reason == "bad_target"
        return
    assert b"#" not in out
    if out == b"*":
        assert method == b"OPTIONS" and target == b"*"
        return
    assert _ORIGIN.fullmatch(out), out
    if target.startswith(b"/"):
        assert out == target
    else:
        assert not http2 and target[:8].lower() == b"https://"
        assert target.endswith(out) or (out.startswith(b"/?") and target.endswith(out[1:])) or out == b"/"
        assert upstream_target(method, out, http2=True) == out  # idempotent: what went up passes again


@given(st.binary(max_size=80))
def test_check_method_accepts_exactly_the_tokens(method: bytes) -> None:
    token = re.fullmatch(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}", method) is not None
    try:
        check_method(method)
    except RequestRefused:
        assert not token
    else:
        assert token
