"""gateway/auth.py: tokens from a bearer, the platform header, the cookie or ?token=, and what goes upstream."""

from __future__ import annotations

import hashlib
from urllib.parse import quote, unquote_to_bytes

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.auth import Allow, AuthConfig, Deny, Headers, Redirect, authorize, split_query, token_matches
from sbxnet.errors import ConfigError

TOKEN = b"s3cr3t-T0ken_value.x~"
HASH = hashlib.sha256(TOKEN).hexdigest()
HOST = "8080-a.sandbox.example.com"
CFG = AuthConfig()
FWD = [(b"x-forwarded-for", b"192.0.2.7"), (b"x-forwarded-proto", b"https"), (b"x-forwarded-host", HOST.encode())]


def run(headers: Headers, target: bytes = b"/p", *, auth: str = "token", token_sha256: str | None = HASH,
        config: AuthConfig = CFG) -> Allow | Deny | Redirect:
    return authorize(config, auth=auth, token_sha256=token_sha256, target=target, headers=headers,
                     client_ip="192.0.2.7", host=HOST)


def allowed(got: Allow | Deny | Redirect) -> Allow:
    assert isinstance(got, Allow), got
    return got


def denied(got: Allow | Deny | Redirect, status: int, reason: str) -> Deny:
    assert isinstance(got, Deny), got
    assert (got.status, got.reason) == (status, reason)
    assert "\n" not in got.message and TOKEN.decode() not in got.message
    return got


def test_constant_time_compare_of_digests() -> None:
    assert token_matches(TOKEN, HASH)
    assert not token_matches(TOKEN + b"x", HASH)
    assert not token_matches(b"", HASH)


# -- token routes: where the token comes from ------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "via"),
    [
        ([(b"authorization", b"Bearer " + TOKEN)], "bearer"),
        ([(b"authorization", b"bearer   " + TOKEN + b" ")], "bearer"),
        ([(b"Authorization", b"BEARER " + TOKEN)], "bearer"),
        ([(b"x-sbx-token", TOKEN)], "header"),
        ([(b"X-SBX-TOKEN", b" " + TOKEN)], "header"),
        ([(b"cookie", b"sbx_token=" + TOKEN)], "cookie"),
        ([(b"cookie", b'a=1; sbx_token="' + TOKEN + b'"; b=2')], "cookie"),
        ([(b"cookie", b"a=1"), (b"cookie", b"sbx_token=" + TOKEN)], "cookie"),  # HTTP/2 splits cookies
        ([(b"cookie", b"sbx_token=stale"), (b"x-sbx-token", TOKEN)], "header"),  # one right token allows
        ([(b"authorization", b"Bearer stale"), (b"cookie", b"sbx_token=" + TOKEN)], "cookie"),
        ([(b"x-sbx-token", b"stale"), (b"x-sbx-token", TOKEN)], "header"),
    ],
)
def test_a_right_token_is_allowed_and_removed(headers: Headers, via: str) -> None:
    got = allowed(run([(b"host", HOST.encode()), *headers, (b"accept", b"*/*")]))
    assert got.via == via
    assert got.target == b"/p"
    assert all(TOKEN not in v and b"stale" not in v for _, v in got.headers)
    assert got.headers[0] == (b"host", HOST.encode())
    assert got.headers[-3:] == FWD
    assert (b"accept", b"*/*") in got.headers


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"authorization", b"Bearer ")],
        [(b"authorization", b"Bearer")],
        [(b"x-sbx-token", b"")],
        [(b"cookie", b"sbx_token=")],
        [(b"cookie", b"other=" + TOKEN)],  # another cookie's value is not the platform's cookie
        [(b"authorization", b"Basic " + TOKEN)],  # another scheme is the app's
    ],
)
def test_no_token_is_401_with_a_challenge(headers: Headers) -> None:
    got = denied(run(headers), 401, "missing_token")
    assert (b"www-authenticate", b'Bearer realm="sbxnet"') in got.headers
    assert "X-Sbx-Token" in got.message and "sbx_token" in got.message


@pytest.mark.parametrize(
    "headers",
    [
        [(b"authorization", b"Bearer wrong")],
        [(b"x-sbx-token", b"wrong")],
        [(b"cookie", b"sbx_token=wrong")],
        [(b"x-sbx-token", TOKEN.upper())],
        [(b"x-sbx-token", TOKEN + b"\x00")],
        [(b"cookie", b"sbx_token=wrong"), (b"authorization", b"Bearer also-wrong")],
    ],
)
def test_a_wrong_token_is_403(headers: Headers) -> None:
    denied(run(headers), 403, "wrong_token")


def test_basic_authorization_passes_on_a_token_route_and_bearer_does_not() -> None:
    got = allowed(run([(b"authorization", b"Basic dTpw"), (b"x-sbx-token", TOKEN)]))
    assert (b"authorization", b"Basic dTpw") in got.headers
    got = allowed(run([(b"authorization", b"Bearer app-token"), (b"x-sbx-token", TOKEN)]))
    assert not any(n.lower() == b"authorization" for n, _ in got.headers)


def test_other_cookies_are_kept_in_order_in_one_header() -> None:
    sent = [(b"cookie", b"a=1;sbx_token=" + TOKEN + b";  b=2"), (b"x", b"y"), (b"Cookie", b"c=3; sbx_token=x")]
    got = allowed(run(sent))
    assert got.headers[:2] == [(b"cookie", b"a=1; b=2; c=3"), (b"x", b"y")]
    got = allowed(run([(b"cookie", b"sbx_token=" + TOKEN)]))
    assert not any(n == b"cookie" for n, _ in got.headers)


def test_client_forwarding_headers_are_replaced_whatever_their_spelling() -> None:
    sent = [
        (b"X-Forwarded-For", b"6.6.6.6"),
        (b"x-forwarded-proto", b"http"),
        (b"X-Forwarded-Host", b"evil.example"),
        (b"Forwarded", b"for=6.6.6.6;proto=http"),
        (b"x_forwarded_for", b"6.6.6.6"),
        (b"X_Forwarded-Host", b"evil.example"),
        (b"x_sbx_token", b"smuggled"),
        (b"x-sbx-token", TOKEN),
        (b"x-real-thing", b"kept"),
    ]
    got = allowed(run(sent))
    assert got.headers == [(b"x-real-thing", b"kept"), *FWD]
    public = allowed(run(sent, auth="public", token_sha256=None))
    assert public.headers == [(b"x-real-thing", b"kept"), *FWD]


def test_the_forwarded_headers_carry_ipv6_clients() -> None:
    got = authorize(CFG, auth="public", token_sha256=None, target=b"/", headers=[], client_ip="2001:db8::1",
                    host=HOST, proto="https")
    assert isinstance(got, Allow) and got.headers[0] == (b"x-forwarded-for", b"2001:db8::1")


# -- ?token=: exchanged for a cookie by a redirect -----------------------------------------------------

COOKIE = b"sbx_token=" + TOKEN + b"; HttpOnly; Secure; SameSite=Lax; Path=/"


@pytest.mark.parametrize(
    ("target", "location"),
    [
        (b"/p?token=" + TOKEN, b"/p"),
        (b"/?token=" + TOKEN, b"/"),
        (b"/p?a=1&token=" + TOKEN + b"&b=2", b"/p?a=1&b=2"),
        (b"/p?b=2&a=1&token=" + TOKEN, b"/p?b=2&a=1"),
        (b"/p?a=%20x&&b&token=" + TOKEN + b"&c=", b"/p?a=%20x&&b&c="),  # others byte for byte
        (b"/p?tok%65n=" + TOKEN + b"&a", b"/p?a"),  # the name as the app decodes it
        (b"/p?token=" + quote(TOKEN.decode(), safe="").encode() + b"&token=", b"/p"),
        (b"/p?token=wrong&token=" + TOKEN, b"/p"),
        (b"/p?Token=x&token=" + TOKEN, b"/p?Token=x"),
        (b"//evil.example/x?token=" + TOKEN, b"//evil.example/x"),  # stays on our host: Location is absolute
        (b"https://8080-a.sandbox.example.com/q?token=" + TOKEN + b"&z=1", b"/q?z=1"),
        (b"https://8080-a.sandbox.example.com?token=" + TOKEN, b"/"),
    ],
)
def test_query_token_redirects_without_it_and_sets_a_host_cookie(target: bytes, location: bytes) -> None:
    got = run([(b"cookie", b"sbx_token=stale")], target)
    assert isinstance(got, Redirect), got
    assert got.status == 303
    assert got.location == b"https://" + HOST.encode() + location
    assert TOKEN not in got.location
    assert got.set_cookie == COOKIE
    assert b"domain" not in got.set_cookie.lower()
    assert got.headers == [(b"location", got.location), (b"set-cookie", COOKIE), (b"cache-control", b"no-store")]
    # the browser follows with the cookie, and that authenticates
    follow = allowed(run([(b"cookie", b"x=1; " + COOKIE.split(b";")[0])], location))
    assert follow.via == "cookie" and follow.target == location and (b"cookie", b"x=1") in follow.headers


@pytest.mark.parametrize("target", [b"/p?a=1&token=" + TOKEN,
                                    b"https://8080-a.sandbox.example.com:8443/p?a=1&token=" + TOKEN])
def test_the_redirect_keeps_the_port_the_client_named(target: bytes) -> None:
    got = authorize(CFG, auth="token", token_sha256=HASH, target=target, headers=[], client_ip="192.0.2.7",
                    host=HOST, port=8443)
    assert isinstance(got, Redirect), got
    assert got.location == b"https://" + HOST.encode() + b":8443/p?a=1"
    # and X-Forwarded-Host stays the routed host name, as without a port
    follow = authorize(CFG, auth="token", token_sha256=HASH, target=b"/p", headers=[(b"x-sbx-token", TOKEN)],
                       client_ip="192.0.2.7", host=HOST, port=8443)
    assert isinstance(follow, Allow) and follow.headers[-3:] == FWD


def test_the_redirect_status_is_configurable() -> None:
    got = run([], b"/?token=" + TOKEN, config=AuthConfig(redirect_status=302))
    assert isinstance(got, Redirect) and got.status == 302


def test_a_wrong_query_token_is_403_whatever_else_came() -> None:
    denied(run([(b"x-sbx-token", TOKEN)], b"/p?token=wrong"), 403, "wrong_token")


def test_an_empty_query_token_is_dropped_and_other_credentials_count() -> None:
    got = allowed(run([(b"x-sbx-token", TOKEN)], b"/p?a=1&token=&token&b=2"))
    assert got.target == b"/p?a=1&b=2"
    denied(run([], b"/p?token="), 401, "missing_token")


def test_a_right_token_a_cookie_cannot_carry_is_refused() -> None:
    odd = b"a b;c"
    got = authorize(CFG, auth="token", token_sha256=hashlib.sha256(odd).hexdigest(), target=b"/?token=a+b%3Bc",
                    headers=[], client_ip="192.0.2.7", host=HOST)
    denied(got, 400, "token_not_cookie_safe")


def test_a_target_with_unprintable_bytes_is_refused() -> None:
    denied(run([], b"/p?token=x\r\nSet-Cookie: a=b"), 400, "bad_target")
    denied(run([], b"/p\x00"), 400, "bad_target")


# -- public routes, and what is not served -----------------------------------------------------------


def test_public_routes_keep_the_apps_credentials_and_query() -> None:
    got = allowed(run([(b"authorization", b"Bearer app"), (b"cookie", b"sbx_token=x; app=1"), (b"x-sbx-token", b"t")],
                      b"/p?token=app-param", auth="public", token_sha256=None))
    assert got.via == "public" and got.target == b"/p?token=app-param"
    assert got.headers == [(b"authorization", b"Bearer app"), (b"cookie", b"app=1"), *FWD]


def test_other_auth_modes_and_missing_hashes_fail_closed() -> None:
    denied(run([(b"x-sbx-token", TOKEN)], auth="client_cert"), 403, "auth_unsupported")
    denied(run([(b"x-sbx-token", TOKEN)], auth="nonsense"), 403, "auth_unsupported")
    denied(run([(b"x-sbx-token", TOKEN)], token_sha256=None), 403, "no_token_configured")
    denied(run([(b"x-sbx-token", TOKEN)], token_sha256=HASH.upper()), 403, "no_token_configured")
    denied(run([(b"x-sbx-token", TOKEN)], token_sha256="abc"), 403, "no_token_configured")


def test_configured_names_are_used() -> None:
    cfg = AuthConfig(header=b"X-Platform-Auth", cookie=b"__Host-plat", query_param=b"key")
    got = allowed(run([(b"x-platform-auth", TOKEN), (b"x-sbx-token", b"app's")], b"/?token=a", config=cfg))
    assert (b"x-sbx-token", b"app's") in got.headers and got.target == b"/?token=a"
    got = allowed(run([(b"cookie", b"__Host-plat=" + TOKEN + b"; sbx_token=a")], config=cfg))
    assert got.headers[0] == (b"cookie", b"sbx_token=a")
    r = run([], b"/?key=" + TOKEN, config=cfg)
    assert isinstance(r, Redirect) and r.set_cookie.startswith(b"__Host-plat=" + TOKEN + b";")


@pytest.mark.parametrize(
    "kw",
    [{"header": b"bad header"}, {"header": b"x-forwarded-for"}, {"header": b"Authorization"}, {"header": b"cookie"},
     {"header": b"X_Forwarded_Host"}, {"cookie": b"a=b"}, {"cookie": b""}, {"query_param": b"a&b"},
     {"query_param": b""}, {"redirect_status": 301}],
)
def test_bad_config_is_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AuthConfig(**kw)  # type: ignore[arg-type]


# -- properties ---------------------------------------------------------------------------------------

TOKENS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~", min_size=12,
                 max_size=40).map(str.encode)
NAMES = st.sampled_from([b"accept", b"user-agent", b"x-app", b"cookie", b"authorization", b"host", b"x-forwarded",
                         b"x-sbx", b"forwarded-by"]) | st.from_regex(rb"\A[a-z][a-z0-9_-]{0,15}\Z")
VALUES = st.from_regex(rb"\A[ -~]{0,30}\Z")
PARAMS = st.from_regex(rb"\A[a-z0-9%]{0,6}(=[a-z0-9%+]{0,6})?\Z")


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, Headers, bytes, str]:
    """A token, a random header list with the token placed in one or more of its forms, a target, and the
    form that should let it in."""
    token = draw(TOKENS)
    headers = [(n, v) for n, v in draw(st.lists(st.tuples(NAMES, VALUES), max_size=8))]
    params = draw(st.lists(PARAMS, max_size=5))
    assume(not any(token in v for _, v in headers) and not any(token in p for p in params))
    header_forms = st.sets(st.sampled_from(["bearer", "header", "cookie"]), min_size=1)
    query_forms = st.sets(st.sampled_from(["query", "query-encoded"]), min_size=1)
    # half the cases carry the token in the target (a redirect), half only in headers (forwarded)
    forms = draw(query_forms | st.tuples(header_forms, query_forms).map(lambda t: t[0] | t[1]) if draw(st.booleans())
                 else header_forms)

    def put(h: tuple[bytes, bytes]) -> None:
        headers.insert(draw(st.integers(0, len(headers))), h)

    if "bearer" in forms:
        put((draw(st.sampled_from([b"authorization", b"Authorization"])), b"Bearer " + token))
    if "header" in forms:
        put((draw(st.sampled_from([b"x-sbx-token", b"X-Sbx-Token", b"x_sbx_token", b"X_SBX-TOKEN"])), token))
    if "cookie" in forms:
        put((b"cookie", draw(st.sampled_from([b"", b"a=1; ", b"b=2;"])) + b"sbx_token=" + token))
    for form in ("query", "query-encoded"):
        if form in forms:
            name = b"token" if form == "query" else draw(st.sampled_from([b"tok%65n", b"%74oken", b"%74%6F%6B%65%6E"]))
            value = token if form == "query" else quote(token.decode(), safe="").encode()
            params.insert(draw(st.integers(0, len(params))), name + b"=" + value)
    target = b"/x" + (b"?" + b"&".join(params) if params else b"")
    return token, headers, target, "query" if forms & {"query", "query-encoded"} else "header"


@settings(max_examples=300)
@given(requests())
def test_the_token_never_goes_upstream_in_any_form(req: tuple[bytes, Headers, bytes, str]) -> None:
    token, headers, target, kind = req

    def decide(digest: str) -> Allow | Deny | Redirect:
        return authorize(CFG, auth="token", token_sha256=digest, target=target, headers=headers,
                         client_ip="192.0.2.7", host=HOST)

    wrong = decide(hashlib.sha256(token + b"!").hexdigest())
    assert isinstance(wrong, Deny) and wrong.status == 403
    got = decide(hashlib.sha256(token).hexdigest())
    if kind == "query":
        assert isinstance(got, Redirect)
        assert token not in got.location and quote(token.decode(), safe="").encode() not in got.location
        _, values = split_query(got.location.partition(b"?")[2] or None, b"token")
        assert values == []
        return
    assert isinstance(got, Allow)
    assert all(token not in v for _, v in got.headers)
    assert token not in got.target
    assert got.headers[-3:] == FWD
    assert not any(n.lower().replace(b"_", b"-") in (b"x-sbx-token", b"forwarded") for n, _ in got.headers)
    assert sum(n.lower() == b"cookie" for n, _ in got.headers) <= 1


@given(st.lists(PARAMS, max_size=6), st.lists(st.integers(0, 6), max_size=3))
def test_removing_the_token_keeps_every_other_parameter_in_order(params: list[bytes], at: list[int]) -> None:
    others = [p for p in params if p.partition(b"=")[0] not in (b"token",)]
    mixed = list(others)
    for i in at:
        mixed.insert(min(i, len(mixed)), b"token=" + TOKEN)
    query = b"&".join(mixed) if mixed else None
    kept, values = split_query(query, b"token")
    assert kept == [p for p in others if unquote_to_bytes(p.partition(b"=")[0].replace(b"+", b" ")) != b"token"]
    assert values.count(TOKEN) == len(at)


@given(st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=30)), max_size=8), st.binary(max_size=40))
def test_any_head_gets_a_decision_and_never_an_exception(headers: Headers, target: bytes) -> None:
    for auth in ("public", "token"):
        got = authorize(CFG, auth=auth, token_sha256=HASH, target=target, headers=headers, client_ip="192.0.2.7",
                        host=HOST)
        assert isinstance(got, Allow | Deny | Redirect)
        if isinstance(got, Allow):
            assert got.headers[-3:] == FWD


# -- an upgrade's ?token= (a browser's WebSocket cannot follow the redirect) ------------------------------------


def upgrade(headers: Headers, target: bytes) -> Allow | Deny | Redirect:
    return authorize(CFG, auth="token", token_sha256=HASH, target=target, headers=headers, client_ip="192.0.2.7",
                     host=HOST, upgrade=True)


def test_a_right_token_in_an_upgrades_target_lets_it_in_without_the_token() -> None:
    got = allowed(upgrade([(b"Upgrade", b"websocket"), (b"Cookie", b"a=1")], b"/ws?a=1&token=" + TOKEN + b"&b=2"))
    assert got.target == b"/ws?a=1&b=2"
    assert got.via == "query"
    assert got.headers == [(b"Upgrade", b"websocket"), (b"Cookie", b"a=1"), *FWD]
    # every token parameter goes, the encoded spelling too
    got = allowed(upgrade([], b"/ws?tok%65n=" + TOKEN + b"&token=" + TOKEN))
    assert got.target == b"/ws"


def test_an_upgrade_with_a_wrong_token_is_403_and_with_none_401() -> None:
    denied(upgrade([], b"/ws?token=" + TOKEN + b"x"), 403, "wrong_token")
    denied(upgrade([(b"Authorization", b"Bearer " + TOKEN)], b"/ws?token=nope"), 403, "wrong_token")
    denied(upgrade([], b"/ws"), 401, "missing_token")
    denied(upgrade([], b"/ws?token="), 401, "missing_token")


def test_a_right_token_on_a_request_that_is_not_an_upgrade_is_still_exchanged_by_redirect() -> None:
    assert isinstance(run([], b"/ws?token=" + TOKEN), Redirect)


@settings(max_examples=300)
@given(requests())
def test_an_upgrade_never_takes_the_token_upstream_in_any_form(req: tuple[bytes, Headers, bytes, str]) -> None:
    token, headers, target, _ = req
    got = authorize(CFG, auth="token", token_sha256=hashlib.sha256(token).hexdigest(), target=target,
                    headers=headers, client_ip="192.0.2.7", host=HOST, upgrade=True)
    assert isinstance(got, Allow)
    assert token not in got.target and quote(token.decode(), safe="").encode() not in got.target
    assert all(token not in v for _, v in got.headers)
    assert split_query(got.target.partition(b"?")[2] or None, b"token")[1] == []
