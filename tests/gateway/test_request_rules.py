"""gateway/request_rules.py: the target a sandbox receives (origin-form only), the method, and the HTTP/2 head
checks h2 leaves to us. Tables, then properties over arbitrary bytes."""

from __future__ import annotations

import re

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.stream
import hpack
import hyperframe.frame
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.http2 import server_connection
from gateway.request_rules import (
    MAX_METHOD,
    RequestRefused,
    check_h2_head,
    check_h2_trailers,
    check_method,
    h2_content_length,
    h2_data,
    upstream_target,
)

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


GET = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.sandbox.example.com"), (b":path", b"/")]

# Every check h2 4.4 did on an inbound request (utilities.validate_headers and H2Stream's content-length),
# each with a head that breaks it: the function of h2 it comes from, the head, our reason.
H2_CHECKS: list[tuple[str, list[tuple[bytes, bytes]], str]] = [
    ("_reject_illegal_characters", [*GET, (b"X-Up", b"1")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a b", b"1")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a\x00", b"1")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a\x7f", b"1")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"\xc3\xa9", b"1")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a:b", b"1")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a", b"1\x00")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a", b"1\r2")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a", b"1\n2")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a", b" 1")], "bad_header"),
    ("_reject_illegal_characters", [*GET, (b"a", b"1\t")], "bad_header"),
    ("_reject_empty_header_names", [*GET, (b"", b"1")], "bad_header"),
    ("_reject_te", [*GET, (b"te", b"gzip")], "bad_header"),
    ("_reject_te", [*GET, (b"te", b"trailers, gzip")], "bad_header"),
    ("_reject_connection_header", [*GET, (b"connection", b"close")], "bad_header"),
    ("_reject_connection_header", [*GET, (b"keep-alive", b"1")], "bad_header"),
    ("_reject_connection_header", [*GET, (b"proxy-connection", b"x")], "bad_header"),
    ("_reject_connection_header", [*GET, (b"transfer-encoding", b"chunked")], "bad_header"),
    ("_reject_connection_header", [*GET, (b"upgrade", b"h2c")], "bad_header"),
    ("_reject_pseudo_header_fields", [*GET, (b":path", b"/x")], "bad_pseudo_header"),
    ("_reject_pseudo_header_fields", [(b"x", b"1"), *GET], "bad_pseudo_header"),
    ("_reject_pseudo_header_fields", [(b"cookie", b"a=1"), *GET], "bad_pseudo_header"),
    ("_reject_pseudo_header_fields", [*GET, (b":foo", b"1")], "bad_pseudo_header"),
    ("_check_pseudo_header_field_acceptability", GET[1:], "bad_pseudo_header"),
    ("_check_pseudo_header_field_acceptability", [g for g in GET if g[0] != b":scheme"], "bad_pseudo_header"),
    ("_check_pseudo_header_field_acceptability", [g for g in GET if g[0] != b":path"], "bad_pseudo_header"),
    ("_check_pseudo_header_field_acceptability", [(b":method", b"CONNECT"), *GET[1:]], "bad_pseudo_header"),
    ("_check_pseudo_header_field_acceptability", [(b":method", b"CONNECT"), (b":authority", b"a:443"),
                                                  (b":protocol", b"websocket")], "bad_pseudo_header"),
    ("_check_pseudo_header_field_acceptability", [*GET, (b":status", b"200")], "bad_pseudo_header"),
    ("_check_pseudo_header_field_acceptability", [*GET, (b":protocol", b"websocket")], "bad_pseudo_header"),
    ("_validate_host_authority_header", [*GET[:2], GET[3], (b"host", b"a"), (b"host", b"a")], "duplicate_host"),
    ("_validate_host_authority_header", [*GET[:2], GET[3]], "missing_host"),
    ("_validate_host_authority_header", [*GET, (b"host", b"b.sandbox.example.com")], "host_mismatch"),
    ("_validate_host_authority_header", [*GET, (b"host", b"A.sandbox.example.com")], "host_mismatch"),
    ("_check_path_header", [*GET[:3], (b":path", b"")], "bad_target"),
    ("_initialize_content_length", [*GET, (b"content-length", b"3a")], "bad_content_length"),
    ("_initialize_content_length", [*GET, (b"content-length", b"-1")], "bad_content_length"),
    ("_initialize_content_length", [*GET, (b"content-length", b"")], "bad_content_length"),
    ("_initialize_content_length", [*GET, (b"content-length", b"3"), (b"content-length", b"4")],
     "bad_content_length"),
]

# What h2 let through and is right (RFC 9113): each passes ours too.
H2_ACCEPTS: list[list[tuple[bytes, bytes]]] = [
    GET,
    [*GET, (b"te", b"trailers")],
    [*GET, (b"te", b"TRAILERS")],
    [*GET, (b"a", b"")],  # an empty value
    [*GET, (b"a", b"1 \t 2")],  # whitespace inside a value
    [*GET, (b"host", b"a.sandbox.example.com")],  # the same bytes as :authority
    [*GET[:2], GET[3], (b"host", b"a.sandbox.example.com")],  # Host alone
    [*GET, (b"cookie", b"a=1"), (b"x", b"2"), (b"cookie", b"b=2")],  # cookies anywhere after the pseudo-headers
    [*GET, (b"content-length", b"3"), (b"content-length", b"3")],  # equal ones
    [(b":method", b"CONNECT"), (b":authority", b"a:443")],  # plain CONNECT
    [(b":method", b"CONNECT"), (b":protocol", b"websocket"), *GET[1:]],  # extended CONNECT (RFC 8441)
    [(b":method", b"OPTIONS"), *GET[1:3], (b":path", b"*")],
]


@pytest.mark.parametrize(("check", "headers", "reason"), H2_CHECKS, ids=[f"{c}-{i}" for i, (c, _, _) in
                                                                          enumerate(H2_CHECKS)])
def test_every_check_h2_did_on_a_request_head_is_ours(check: str, headers: list[tuple[bytes, bytes]],
                                                      reason: str) -> None:
    """Each row breaks one of h2's checks: h2 itself refuses it (a connection error), and so does
    ``check_h2_head``, under the reason the module docstring gives."""
    assert _h2_refuses(headers, ended=False)
    with pytest.raises(RequestRefused) as e:
        check_h2_head(headers, ended=False)
    assert e.value.reason == reason
    assert b"\xc3" not in str(e.value).encode() and "X-Up" not in str(e.value)  # never the peer's text


@pytest.mark.parametrize("headers", H2_ACCEPTS)
def test_what_h2_accepted_and_rfc_9113_allows_passes(headers: list[tuple[bytes, bytes]]) -> None:
    assert not _h2_refuses(headers, ended=False)
    check_h2_head(headers, ended=False)


def test_the_functions_h2_checked_with_are_the_ones_the_table_names() -> None:
    """An h2 upgrade that renames or drops what the table and ``http2._RequestStream`` rely on fails here."""
    assert h2.__version__ == "4.4.1"
    import h2.utilities as u

    for name in {c for c, _, _ in H2_CHECKS} - {"_initialize_content_length"}:
        assert callable(getattr(u, name)), name
    for name in ("_initialize_content_length", "_track_content_length", "receive_headers", "reset_stream"):
        assert callable(getattr(h2.stream.H2Stream, name)), name
    assert callable(h2.connection.H2Connection._begin_new_stream)
    assert callable(u.is_informational_response)
    # the stream-error path _RequestStream raises into: a StreamClosedError for a stream reset by us
    assert hasattr(h2.exceptions.StreamClosedError(1), "_events")
    assert callable(h2.connection.H2Connection._stream_is_closed_by_reset)


def test_content_length_is_read_from_its_fields() -> None:
    assert h2_content_length(GET) is None
    assert h2_content_length([*GET, (b"content-length", b"0")]) == 0
    assert h2_content_length([*GET, (b"content-length", b"012"), (b"content-length", b"12")]) == 12
    for bad in ([(b"content-length", b"1e3")], [(b"content-length", b"+1")], [(b"content-length", b"1 ")],
                [(b"content-length", b"1"), (b"content-length", b"2")], [(b"content-length", b"\xd9\xa1")]):
        with pytest.raises(RequestRefused) as e:
            h2_content_length([*GET, *bad])
        assert e.value.reason == "bad_content_length"


def test_the_gateways_h2_connection_takes_what_h2_refused_as_a_stream_and_data_against_content_length_too() -> None:
    """h2 4.4 raised these as connection errors; the gateway's connection hands each to us as a stream (the
    content-length checks included: ``http2._RequestStream``)."""
    enc = hpack.Encoder()
    frames = _headers_frame(enc, [*GET, (b"X-Up", b"1")], end=True)
    f = hyperframe.frame.HeadersFrame(3)
    f.data = enc.encode([(b":method", b"POST"), *GET[1:], (b"content-length", b"3")])
    f.flags.add("END_HEADERS")
    d = hyperframe.frame.DataFrame(3)
    d.data = b"abcdef"
    d.flags.add("END_STREAM")
    wire = _PREFACE + frames + bytes(f.serialize()) + bytes(d.serialize())
    with pytest.raises(h2.exceptions.ProtocolError):
        _h2_server(validate=True).receive_data(wire)
    events = _h2_server(validate=False).receive_data(wire)
    assert [type(ev).__name__ for ev in events if getattr(ev, "stream_id", 0)] == [
        "RequestReceived", "StreamEnded", "RequestReceived", "DataReceived", "StreamEnded"]


def test_the_gateways_h2_connection_takes_a_1xx_status_in_a_request_as_a_request_with_its_fields() -> None:
    """h2 takes a block whose :status starts with 1 for an informational response (a state error, raised as
    a connection error); the gateway's connection hands it over as a request, fields as they came, which
    ``check_h2_head`` refuses."""
    head = [(b":status", b"100"), *GET]
    wire = _PREFACE + _headers_frame(hpack.Encoder(), head, end=True)
    with pytest.raises(h2.exceptions.ProtocolError):
        _h2_server(validate=True).receive_data(wire)
    events = _h2_server(validate=False).receive_data(wire)
    received = [ev for ev in events if isinstance(ev, h2.events.RequestReceived)]
    assert len(received) == 1 and received[0].headers == head
    with pytest.raises(RequestRefused) as e:
        check_h2_head(received[0].headers, ended=True)
    assert e.value.reason == "bad_pseudo_header"


def test_the_gateways_h2_connection_resets_trailers_without_end_stream_and_goes_on() -> None:
    """Trailers must end the stream (RFC 9113 8.1): h2 raised a connection error; the gateway's connection
    resets that stream PROTOCOL_ERROR, tells the session, and takes the next stream."""
    from gateway.http2 import _TrailersWithoutEnd

    enc = hpack.Encoder()
    head = _headers_frame(enc, [(b":method", b"POST"), *GET[1:]], end=False)
    trailers = _headers_frame(enc, [(b"x-sum", b"1")], end=False)
    f = hyperframe.frame.HeadersFrame(3)
    f.data = enc.encode(GET)
    f.flags.add("END_HEADERS")
    f.flags.add("END_STREAM")
    wire = _PREFACE + head + trailers + bytes(f.serialize())
    with pytest.raises(h2.exceptions.ProtocolError):
        _h2_server(validate=True).receive_data(wire)
    conn = _h2_server(validate=False)
    conn.data_to_send()
    events = conn.receive_data(wire)
    assert [type(ev).__name__ for ev in events if getattr(ev, "stream_id", 0)] == [
        "RequestReceived", "_TrailersWithoutEnd", "RequestReceived", "StreamEnded"]
    assert [ev.stream_id for ev in events if isinstance(ev, _TrailersWithoutEnd)] == [1]
    sent = conn.data_to_send()
    rst = [fr for fr in _frames(sent) if isinstance(fr, hyperframe.frame.RstStreamFrame)]
    assert [(fr.stream_id, fr.error_code) for fr in rst] == [(1, 1)]  # PROTOCOL_ERROR
    assert not [fr for fr in _frames(sent) if isinstance(fr, hyperframe.frame.GoAwayFrame)]


def _frames(data: bytes) -> list[hyperframe.frame.Frame]:
    out = []
    while len(data) >= 9:
        frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        out.append(frame)
        data = data[9 + length :]
    return out


@pytest.mark.parametrize(("length", "frames", "held", "refused"), [
    (None, [(3, False), (0, True)], [False, False], False),
    (3, [(3, True)], [False], False),
    (3, [(1, False), (2, True)], [False, False], False),
    (3, [(3, False), (0, True)], [True, False], False),  # the DATA that completes it waits for the end
    (3, [(3, False), (0, False), (0, True)], [True, False, False], False),
    (0, [(0, True)], [False], False),
    (3, [(4, True)], [], True),
    (3, [(3, False), (1, True)], [True], True),
    (3, [(2, True)], [], True),
    (0, [(1, False)], [], True),
])
def test_data_is_held_to_content_length(length: int | None, frames: list[tuple[int, bool]], held: list[bool],
                                        refused: bool) -> None:
    received = 0
    got = []
    try:
        for size, end in frames:
            received += size
            got.append(h2_data(length, received, size, end=end))
    except RequestRefused as e:
        assert refused and e.reason == "content_length_mismatch"
    else:
        assert not refused
    assert got == held


@given(st.one_of(st.none(), st.integers(0, 20)), st.lists(st.integers(0, 8), max_size=6), st.booleans())
def test_an_app_never_has_a_whole_body_before_the_stream_ends_well_formed(
    length: int | None, sizes: list[int], ended: bool
) -> None:
    """DATA frames of ``sizes`` (the last with END_STREAM when ``ended``), passed on as ``http2`` does
    (what ``h2_data`` holds waits for the end): what went up never reaches a content-length before the end;
    at a well-formed end it is exactly the content-length; a refusal comes as soon as the DATA cannot fit."""
    received = sent = held = 0
    for i, size in enumerate(sizes):
        end = ended and i == len(sizes) - 1
        received += size
        try:
            hold = h2_data(length, received, size, end=end)
        except RequestRefused:
            assert length is not None and (received > length or (end and received != length))
            return
        if hold:
            held += size
            continue
        sent += size + (held if end else 0)
        held = 0 if end else held
        if length and not end:
            assert sent < length
    if ended and sizes and length is not None:
        assert sent == length == received


@pytest.mark.parametrize(("trailers", "reason"), [
    ([(b"x-sum", b"1")], None),
    ([], None),
    ([(b":path", b"/")], "bad_pseudo_header"),
    ([(b":status", b"200")], "bad_pseudo_header"),
    ([(b"X-Sum", b"1")], "bad_header"),
    ([(b"x-sum", b"1\r\n")], "bad_header"),
    ([(b"connection", b"close")], "bad_header"),
    ([(b"te", b"gzip")], "bad_header"),
    ([(b"", b"1")], "bad_header"),
])
def test_trailers_are_held_to_the_field_rules_and_carry_no_pseudo_header(trailers: list[tuple[bytes, bytes]],
                                                                         reason: str | None) -> None:
    assert _h2_refuses_trailers(trailers) == (reason is not None)
    if reason is None:
        check_h2_trailers(trailers)
        return
    with pytest.raises(RequestRefused) as e:
        check_h2_trailers(trailers)
    assert e.value.reason == reason


# -- h2 as the oracle ---------------------------------------------------------------------------------------------

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + hyperframe.frame.SettingsFrame(0).serialize()


def _headers_frame(encoder: hpack.Encoder, headers: list[tuple[bytes, bytes]], *, end: bool) -> bytes:
    f = hyperframe.frame.HeadersFrame(1)
    f.data = encoder.encode(headers)
    f.flags.add("END_HEADERS")
    if end:
        f.flags.add("END_STREAM")
    return bytes(f.serialize())


def _h2_server(*, validate: bool) -> h2.connection.H2Connection:
    """An h2 server with its inbound validation as the gateway ran it before (``validate``; no cookie
    joining, so h2 judges the fields in the order they came: with it, h2 judged cookies moved last), or the
    gateway's connection now (``http2.server_connection``)."""
    if validate:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=True,
                                           normalize_inbound_headers=False)
        conn = h2.connection.H2Connection(config)
    else:
        conn = server_connection()
    conn.initiate_connection()
    return conn


def _h2_refuses(headers: list[tuple[bytes, bytes]], *, ended: bool) -> bool:
    """h2 4.4 with its inbound validation, receiving this head on a real connection: does it refuse it?"""
    try:
        _h2_server(validate=True).receive_data(_PREFACE + _headers_frame(hpack.Encoder(), headers, end=ended))
    except h2.exceptions.ProtocolError:
        return True
    return False


def _h2_refuses_trailers(trailers: list[tuple[bytes, bytes]]) -> bool:
    enc = hpack.Encoder()
    head = _headers_frame(enc, [(b":method", b"POST"), *GET[1:]], end=False)
    try:
        _h2_server(validate=True).receive_data(_PREFACE + head + _headers_frame(enc, trailers, end=True))
    except h2.exceptions.ProtocolError:
        return True
    return False


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


_NAMES = st.sampled_from([b":method", b":scheme", b":authority", b":path", b":status", b":protocol", b":foo", b"host",
                          b"content-length", b"te", b"connection", b"transfer-encoding", b"cookie", b"x-a", b"X-Up",
                          b"a:b", b"", b"a b", b"\x7f", b"\xc3\xa9"])
_VALUES = st.sampled_from([b"GET", b"POST", b"CONNECT", b"G T", b"https", b"/", b"", b"*", b"a.example", b"A.example",
                           b" x", b"x\t", b"a\r", b"a\x00b", b"trailers", b"TRAILERS", b"gzip", b"0", b"3", b"3a",
                           b"100", b"websocket", b"close"])
_FIELD = st.tuples(st.one_of(_NAMES, st.binary(max_size=4)), st.one_of(_VALUES, st.binary(max_size=4)))
_GOOD_FIELD = st.tuples(st.sampled_from([b"host", b"content-length", b"te", b"cookie", b"x-a", b"accept"]),
                        st.sampled_from([b"a.example", b"a.sandbox.example.com", b"", b"0", b"3", b"trailers",
                                         b"x y", b"*/*"]))
_PSEUDO = st.tuples(st.sampled_from([b":method", b":scheme", b":authority", b":path", b":protocol"]),
                    st.sampled_from([b"GET", b"CONNECT", b"https", b"a.sandbox.example.com", b"/", b"", b"*"]))
HEADS = st.one_of(
    st.lists(_FIELD, max_size=8),
    st.builds(lambda pseudo, extra: [*pseudo, *extra], st.permutations(GET), st.lists(_FIELD, max_size=3)),
    st.builds(lambda extra, at: [*GET[:at], *extra, *GET[at:]], st.lists(_FIELD, max_size=2),
              st.integers(0, len(GET))),
    # near-valid heads: a subset of GET's pseudo-headers, maybe one more, then ordinary fields
    st.builds(lambda pseudo, more, extra: [*pseudo, *more, *extra],
              st.lists(st.sampled_from(GET), unique=True, min_size=2), st.lists(_PSEUDO, max_size=1),
              st.lists(_GOOD_FIELD, max_size=3)),
)


def _informational(headers: list[tuple[bytes, bytes]]) -> bool:
    """A head h2 takes for a 1xx response (a :status starting with 1 before any regular field): a state
    error in h2 whatever its validation, outside these rules."""
    for n, v in headers:
        if not n.startswith(b":"):
            return False
        if n == b":status":
            return v.startswith(b"1")
    return False


@settings(max_examples=600, deadline=None)
@given(HEADS, st.booleans())
def test_our_verdict_on_a_request_head_is_h2s(headers: list[tuple[bytes, bytes]], ended: bool) -> None:
    """Any head: the gateway's h2 connection (validation off) takes it as a stream, with the fields exactly
    as they came, and ``check_h2_head`` on them refuses what h2 with its validation refused and passes what
    it passed, but for what we add (a method that is not a token, content-length on a head with END_STREAM)."""
    assume(not _informational(headers))
    h2_refused = _h2_refuses(headers, ended=ended)
    events = _h2_server(validate=False).receive_data(_PREFACE + _headers_frame(hpack.Encoder(), headers, end=ended))
    received = [ev for ev in events if isinstance(ev, h2.events.RequestReceived)]
    assert len(received) == 1 and list(received[0].headers) == headers  # never a connection error
    try:
        check_h2_head(received[0].headers, ended=ended)
    except RequestRefused as e:
        if not h2_refused:
            method = dict(headers)[b":method"]
            assert (e.reason == "bad_method" and not re.fullmatch(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}", method)) or (
                e.reason == "content_length_mismatch" and ended and h2_content_length(headers)), e.reason
    else:
        assert not h2_refused
