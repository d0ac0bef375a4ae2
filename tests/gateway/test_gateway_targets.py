"""Request targets, malformed HTTP/2 requests, a WebSocket's ?token= and clients without SNI, end to end:
real clients (the h2 library over ssl, raw HTTP/1.1 over ssl, the websockets library) -> the gateway -> a
real forwarder -> real apps.

For every refusal: the answer, one access-log line with its reason, no traceback, and nothing of the
request upstream: no link opened (no ``link_open`` line, ``upstream_attempts_total`` unchanged) and the app
saw nothing. A malformed HTTP/2 request is a stream error: the connection's other streams go on.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import hyperframe.frame
import pytest
from gw_support import DOMAIN, TOKEN, GatewayThread, JsonLines, front_cert, gateway_log, registration

from certs.mint import mint_leaf, write_issued
from gateway.tls_front import CertPair

ATTEMPTS = "sbxnet_gateway_upstream_attempts_total"


class H2Client:
    """A blocking HTTP/2 client (h2 over ssl) that sends what it is given, malformed included: its own
    header validation is off. ``sni`` None: no server name in the ClientHello."""

    def __init__(self, stack: dict[str, Any], sni: str | None, *, port: int | None = None) -> None:
        ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
        ctx.set_alpn_protocols(["h2"])
        if sni is None:
            ctx.check_hostname = False
        raw = socket.create_connection(("127.0.0.1", port or stack["gw"].port), timeout=10)
        self.sock = ctx.wrap_socket(raw, server_hostname=sni)
        assert self.sock.selected_alpn_protocol() == "h2"
        config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                           normalize_outbound_headers=False, validate_inbound_headers=False)
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.out: dict[int, dict[str, Any]] = {}
        self.goaway: int | None = None

    def send(self, stream_id: int, headers: list[tuple[bytes, bytes]], *, end: bool = True,
             data: bytes | None = None) -> None:
        """HEADERS (END_STREAM with ``end`` and no ``data``), then ``data`` ending the stream, in one write."""
        self.conn.send_headers(stream_id, headers, end_stream=end and data is None)
        if data is not None:
            self.conn.send_data(stream_id, data, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())

    def get(self, stream_id: int, authority: str, path: bytes, method: bytes = b"GET",
            extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.send(stream_id, [(b":method", method), (b":scheme", b"https"), (b":authority", authority.encode()),
                              (b":path", path), *extra])

    def wait(self, *stream_ids: int) -> dict[int, dict[str, Any]]:
        """Read until each stream ended or was reset, or the gateway sent GOAWAY and closed."""
        while not all(self.out.get(s, {}).get("ended") for s in stream_ids):
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                data = b""
            if not data:
                break
            for ev in self.conn.receive_data(data):
                r = self.out.setdefault(getattr(ev, "stream_id", 0), {"body": b""})
                if isinstance(ev, h2.events.ResponseReceived):
                    r["headers"] = dict(ev.headers)
                elif isinstance(ev, h2.events.DataReceived):
                    r["body"] += ev.data
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    r["ended"] = True
                elif isinstance(ev, h2.events.StreamReset):
                    r["ended"], r["reset"] = True, int(ev.error_code or 0)
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    self.goaway = int(ev.error_code or 0)
            self.sock.sendall(self.conn.data_to_send())
        return self.out

    def close(self) -> None:
        self.sock.close()


def status(out: dict[int, dict[str, Any]], stream_id: int) -> bytes:
    return bytes(out[stream_id]["headers"][b":status"])


def wait_events(log: JsonLines, event: str, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while len(log.events(event)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return log.events(event)


def no_traceback(log: JsonLines) -> None:
    assert not [t for t in log.text if "Traceback" in t or '"internal"' in t], log.text


def https_exchange(stack: dict[str, Any], data: bytes, *, sni: str | None = f"alpha.{DOMAIN}",
                   port: int | None = None) -> bytes:
    """``data`` on a fresh HTTP/1.1 connection; everything the gateway sends until it closes."""
    ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    if sni is None:
        ctx.check_hostname = False
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port or stack["gw"].port), timeout=10),
                        server_hostname=sni)
    s.sendall(data)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, ssl.SSLError, TimeoutError):
        pass
    s.close()
    return out


def responses(raw: bytes) -> list[tuple[int, bytes]]:
    """Each HTTP/1.1 response in ``raw`` (all with Content-Length): status and body."""
    got = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(v) for n, _, v in (line.partition(b":") for line in lines[1:])
                      if n.strip().lower() == b"content-length")
        got.append((int(lines[0].split()[1]), rest[:length]))
        raw = rest[length:]
    return got


# -- point 8: the request target ------------------------------------------------------------------------------


def base(path: bytes, authority: str = f"alpha.{DOMAIN}", method: bytes = b"GET") -> list[tuple[bytes, bytes]]:
    return [(b":method", method), (b":scheme", b"https"), (b":authority", authority.encode()), (b":path", path)]


H2_TARGETS = {
    "no-leading-slash": b"x",
    "absolute-form-naming-another-sandbox": f"https://beta.{DOMAIN}/x".encode(),
    "absolute-form-naming-its-own-sandbox": f"https://alpha.{DOMAIN}/x".encode(),
    "asterisk-on-get": b"*",
    "fragment": b"/x#frag",
}


@pytest.mark.parametrize("case", sorted(H2_TARGETS))
def test_an_http2_path_that_is_not_origin_form_is_400_before_any_link(stack: dict[str, Any], case: str) -> None:
    gw: GatewayThread = stack["gw"]
    alpha, beta = stack["app"], stack["beta"]
    before = (len(alpha.requests), len(beta.requests), gw.sample(ATTEMPTS))
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, base(H2_TARGETS[case]))
            c.get(3, f"alpha.{DOMAIN}", b"/after")  # the connection goes on
            out = c.wait(1, 3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert status(out, 1) == b"400" and status(out, 3) == b"200"
    assert json.loads(out[3]["body"])["path"] == "/after"
    assert [r["path"] for r in alpha.requests[before[0]:]] == ["/after"]
    assert len(beta.requests) == before[1]
    assert gw.sample(ATTEMPTS) <= before[2] + 1  # /after's link at most (it may ride a kept one)
    assert [line["sandbox_id"] for line in log.events("link_open")] in (["alpha"], [])
    refused = [line for line in lines if line["status"] == 400]
    assert len(refused) == 1 and refused[0]["reason"] == "bad_target", lines
    no_traceback(log)


def test_options_asterisk_reaches_the_app_on_both_fronts(stack: dict[str, Any]) -> None:
    gw: GatewayThread = stack["gw"]
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, base(b"*", method=b"OPTIONS"))
            out = c.wait(1)
        finally:
            c.close()
        raw = https_exchange(stack, b"OPTIONS * HTTP/1.1\r\nHost: alpha.sbx.test\r\nConnection: close\r\n\r\n")
        wait_events(log, "request", 2)
    # The app's own answer (http.server has no do_OPTIONS): the request got there, over a link.
    assert status(out, 1) == b"501"
    assert raw.startswith(b"HTTP/1.1 501"), raw[:100]
    assert [line["sandbox_id"] for line in log.events("link_open")] == ["alpha", "alpha"]


H1_TARGETS = {  # the request, and the reason it is refused under
    "asterisk-on-get": (b"GET * HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n", "bad_target"),
    "asterisk-on-post": (b"POST * HTTP/1.1\r\nHost: alpha.sbx.test\r\nContent-Length: 0\r\n\r\n", "bad_target"),
    "fragment": (b"GET /x#frag HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n", "bad_target"),
    "fragment-in-absolute-form": (b"GET https://alpha.sbx.test/x#frag HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n",
                                  "bad_target"),
    "other-scheme": (b"GET ftp://alpha.sbx.test/x HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n", "bad_target"),
    "no-leading-slash": (b"GET x HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n", "bad_request"),  # llhttp's own refusal
}


@pytest.mark.parametrize("case", sorted(H1_TARGETS))
def test_an_http11_target_that_is_not_origin_form_is_400_before_any_link(stack: dict[str, Any], case: str) -> None:
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = (len(alpha.requests), gw.sample(ATTEMPTS))
    with gateway_log(gw) as log:
        request, reason = H1_TARGETS[case]
        out = https_exchange(stack, request)
        lines = wait_events(log, "request", 1)
    assert out.startswith(b"HTTP/1.1 400"), out[:100]
    assert len(alpha.requests) == before[0]
    assert gw.sample(ATTEMPTS) == before[1]
    assert not log.events("link_open")
    assert len(lines) == 1 and lines[0]["reason"] == reason, lines
    no_traceback(log)


def test_an_http11_absolute_form_target_reaches_the_app_as_origin_form(stack: dict[str, Any]) -> None:
    alpha = stack["app"]
    before = len(alpha.requests)
    port = stack["gw"].port
    out = https_exchange(stack, b"GET https://alpha.sbx.test/x?y=1 HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n"
                                b"GET HTTPS://ALPHA.sbx.test:%d?q HTTP/1.1\r\nHost: beta.sbx.test\r\n"
                                b"Connection: close\r\n\r\n" % port)
    got = responses(out)
    assert [s for s, _ in got] == [200, 200], out[:300]
    assert [json.loads(b)["path"] for _, b in got] == ["/x?y=1", "/?q"]
    assert [r["path"] for r in alpha.requests[before:]] == ["/x?y=1", "/?q"]
    # The authority of an absolute-form target is checked like a Host: another name than the SNI is 421.
    out = https_exchange(stack, b"GET https://beta.sbx.test/x HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 421"), out[:100]


# -- point 9: malformed HTTP/2 requests ------------------------------------------------------------------------


def test_content_length_on_a_request_without_data_is_400_before_any_link(stack: dict[str, Any]) -> None:
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = (len(alpha.requests), gw.sample(ATTEMPTS))
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, [*base(b"/cl", method=b"POST"), (b"content-length", b"30")])
            c.send(3, [*base(b"/m"), (b"content-length", b"0")])  # zero is what it carries: fine
            out = c.wait(1, 3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert status(out, 1) == b"400" and status(out, 3) == b"200"
    assert [r["path"] for r in alpha.requests[before[0]:]] == ["/m"]
    assert gw.sample(ATTEMPTS) <= before[1] + 1
    assert sorted((line["status"], line.get("reason")) for line in lines) == [(200, None),
                                                                               (400, "content_length_mismatch")]
    no_traceback(log)


@pytest.mark.parametrize("method", [b"G T", b"GET\x7f", b"", b"(GET)", b"G" * 65])
def test_a_method_that_is_not_a_token_is_400_before_any_link(stack: dict[str, Any], method: bytes) -> None:
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = (len(alpha.requests), gw.sample(ATTEMPTS))
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, base(b"/m", method=method))
            out = c.wait(1)
        finally:
            c.close()
        lines = wait_events(log, "request", 1)
    assert status(out, 1) == b"400"
    assert len(alpha.requests) == before[0] and gw.sample(ATTEMPTS) == before[1]
    assert not log.events("link_open")
    assert [(line["status"], line["reason"]) for line in lines] == [(400, "bad_method")]
    no_traceback(log)


H2_MALFORMED = {  # the request (HEADERS, then DATA ending the stream, in one write): its answer, its reason
    "content-length-below-the-data": ([*base(b"/p", method=b"POST"), (b"content-length", b"3")], b"abcdef",
                                      "reset", "content_length_mismatch"),
    "content-length-above-the-data": ([*base(b"/p", method=b"POST"), (b"content-length", b"10")], b"abc",
                                      "reset", "content_length_mismatch"),
    "content-length-not-a-number": ([*base(b"/p", method=b"POST"), (b"content-length", b"3a")], b"abc",
                                    "400", "bad_content_length"),
    "content-lengths-that-differ": ([*base(b"/p", method=b"POST"), (b"content-length", b"3"),
                                     (b"content-length", b"4")], b"abc", "400", "bad_content_length"),
    "upper-case-name": ([*base(b"/p"), (b"X-Up", b"1")], None, "400", "bad_header"),
    "colon-inside-a-name": ([*base(b"/p"), (b"x:y", b"1")], None, "400", "bad_header"),
    "value-with-a-leading-space": ([*base(b"/p"), (b"x", b" 1")], None, "400", "bad_header"),
    "connection-header": ([*base(b"/p"), (b"connection", b"close")], None, "400", "bad_header"),
    "transfer-encoding": ([*base(b"/p"), (b"transfer-encoding", b"chunked")], None, "400", "bad_header"),
    "te-gzip": ([*base(b"/p"), (b"te", b"gzip")], None, "400", "bad_header"),
    "pseudo-header-after-a-regular-one": ([(b"x", b"1"), *base(b"/p")], None, "400", "bad_pseudo_header"),
    "pseudo-header-after-a-cookie": ([(b"cookie", b"a=1"), *base(b"/p")], None, "400", "bad_pseudo_header"),
    "unknown-pseudo-header": ([*base(b"/p"), (b":foo", b"1")], None, "400", "bad_pseudo_header"),
    "duplicated-path": ([*base(b"/p"), (b":path", b"/q")], None, "400", "bad_pseudo_header"),
    "status-in-a-request": ([*base(b"/p"), (b":status", b"200")], None, "400", "bad_pseudo_header"),
    "protocol-on-get": ([*base(b"/p"), (b":protocol", b"websocket")], None, "400", "bad_pseudo_header"),
    "no-path": (base(b"/p")[:3], None, "400", "bad_pseudo_header"),
    "empty-path": (base(b""), None, "400", "bad_target"),
    "host-against-authority": ([*base(b"/p"), (b"host", f"beta.{DOMAIN}".encode())], None, "400", "host_mismatch"),
    "two-hosts": ([*base(b"/p")[:2], (b":path", b"/p"), (b"host", f"alpha.{DOMAIN}".encode()),
                   (b"host", f"alpha.{DOMAIN}".encode())], None, "400", "duplicate_host"),
    "neither-authority-nor-host": ([*base(b"/p")[:2], (b":path", b"/p")], None, "400", "missing_host"),
}


@pytest.mark.parametrize("case", sorted(H2_MALFORMED))
def test_a_malformed_request_is_refused_on_its_stream_and_the_connection_goes_on(
    stack: dict[str, Any], case: str
) -> None:
    """RFC 9113 8.1.1: a malformed request is a stream error. A malformed head is answered 400 on its
    stream; DATA against content-length resets the stream PROTOCOL_ERROR. Either way one access-log line
    with its reason, counted, no GOAWAY: a good stream on the same connection, sent after it, gets its 200;
    nothing of the bad one reaches the app (no link for it), no traceback."""
    gw: GatewayThread = stack["gw"]
    alpha, beta = stack["app"], stack["beta"]
    headers, data, answer, reason = H2_MALFORMED[case]
    before = (len(alpha.requests), len(beta.requests), gw.sample("sbxnet_gateway_refusals_total", {"reason": reason}))
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, headers, data=data)
            c.get(3, f"alpha.{DOMAIN}", b"/after")
            out = c.wait(1, 3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert c.goaway is None
    if answer == "reset":
        assert out[1].get("reset") == 1 and "headers" not in out[1], out[1]  # PROTOCOL_ERROR, no answer
    else:
        assert status(out, 1) == b"400", out[1]
    assert status(out, 3) == b"200" and json.loads(out[3]["body"])["path"] == "/after"
    assert [r["path"] for r in alpha.requests[before[0]:]] == ["/after"]
    assert len(beta.requests) == before[1]
    assert [line["sandbox_id"] for line in log.events("link_open")] in (["alpha"], [])  # /after's, or a kept one
    refused_status = 0 if answer == "reset" else 400
    assert sorted((line["status"], line.get("reason") or "") for line in lines) == sorted(
        [(refused_status, reason), (200, "")]), lines
    assert gw.sample("sbxnet_gateway_refusals_total", {"reason": reason}) == before[2] + 1
    assert not log.events("h2_refused")
    no_traceback(log)


def test_a_malformed_head_whose_stream_is_still_open_gets_its_400_then_a_reset(stack: dict[str, Any]) -> None:
    """RFC 9113 8.1.1: a malformed request is a stream error of type PROTOCOL_ERROR, a response allowed
    first. A head refused while the client has not ended its stream: 400, then RST_STREAM PROTOCOL_ERROR
    (the client stops sending its body); one line; the next stream is served."""
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = (len(alpha.requests), gw.sample("sbxnet_gateway_refusals_total", {"reason": "bad_header"}))
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, [*base(b"/p", method=b"POST"), (b"X-Up", b"1")], end=False)
            c.wait(1)
            c.get(3, f"alpha.{DOMAIN}", b"/after")  # the reset of 1 went out before anything of 3
            out = c.wait(3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert status(out, 1) == b"400" and out[1].get("reset") == 1 and status(out, 3) == b"200"
    assert [r["path"] for r in alpha.requests[before[0]:]] == ["/after"]
    assert sorted((line["status"], line.get("reason") or "") for line in lines) == [(200, ""), (400, "bad_header")]
    assert gw.sample("sbxnet_gateway_refusals_total", {"reason": "bad_header"}) == before[1] + 1
    no_traceback(log)


def test_data_beyond_the_content_length_of_a_head_already_upstream_resets_its_stream_only(
    stack: dict[str, Any]
) -> None:
    """The head went up (its link is open) before the DATA that breaks its content-length came: the stream
    is reset PROTOCOL_ERROR, its link aborted (the app reads no request: it never got the body), its line
    says ``content_length_mismatch`` and no byte went up; the connection goes on."""
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = len(alpha.requests)
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, [*base(b"/p", method=b"POST"), (b"content-length", b"3")], end=False)
            assert [line["sandbox_id"] for line in wait_events(log, "link_open", 1)] == ["alpha"]
            c.conn.send_data(1, b"abcdef", end_stream=True)
            c.sock.sendall(c.conn.data_to_send())
            out = c.wait(1)
            c.get(3, f"alpha.{DOMAIN}", b"/after")
            out = c.wait(3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert c.goaway is None and out[1].get("reset") == 1 and status(out, 3) == b"200"
    assert [(line["status"], line.get("reason"), line["bytes_up"]) for line in lines] == [
        (0, "content_length_mismatch", 0), (200, None, 0)], lines
    assert [r["path"] for r in alpha.requests[before:]] == ["/after"]
    assert not log.events("h2_refused")
    no_traceback(log)


def test_the_data_that_completes_content_length_waits_for_the_end_of_the_stream(stack: dict[str, Any]) -> None:
    """content-length 3 and DATA "abc" without END_STREAM: the app does not get a whole request yet (the
    stream may still turn out malformed); one more byte resets the stream and the app never saw the
    request; an empty DATA with END_STREAM instead sends it on whole."""
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = len(alpha.requests)
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            for sid, path in ((1, b"/bad"), (3, b"/good")):
                c.send(sid, [*base(path, method=b"POST"), (b"content-length", b"3")], end=False)
                c.conn.send_data(sid, b"abc")
                c.sock.sendall(c.conn.data_to_send())
            wait_events(log, "link_open", 2)
            time.sleep(0.5)  # time for the app to have read a whole request, had one gone up
            assert len(alpha.requests) == before
            c.conn.send_data(1, b"d", end_stream=True)
            c.conn.end_stream(3)
            c.sock.sendall(c.conn.data_to_send())
            out = c.wait(1, 3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert out[1].get("reset") == 1 and status(out, 3) == b"200"
    seen = json.loads(out[3]["body"])
    assert (seen["path"], seen["body_len"]) == ("/good", 3)
    assert [r["path"] for r in alpha.requests[before:]] == ["/good"]
    assert sorted((line["status"], line.get("reason") or "") for line in lines) == [(0, "content_length_mismatch"),
                                                                                (200, "")]
    no_traceback(log)


def test_a_content_length_zero_head_goes_up_only_once_its_stream_ended(stack: dict[str, Any]) -> None:
    """content-length 0 on HEADERS without END_STREAM: as HTTP/1.1 that head alone is a whole request, so it
    waits for the stream's end. DATA then resets the stream and the app never saw the request; an empty
    DATA with END_STREAM sends it on."""
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = len(alpha.requests)
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            for sid, path in ((1, b"/bad"), (3, b"/good")):
                c.send(sid, [*base(path, method=b"POST"), (b"content-length", b"0")], end=False)
            time.sleep(0.5)  # time for the app to have answered, had a head gone up
            assert len(alpha.requests) == before
            assert not c.out
            c.conn.send_data(1, b"x", end_stream=True)
            c.conn.end_stream(3)
            c.sock.sendall(c.conn.data_to_send())
            out = c.wait(1, 3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert out[1].get("reset") == 1 and status(out, 3) == b"200"
    seen = json.loads(out[3]["body"])
    assert (seen["path"], seen["body_len"]) == ("/good", 0)
    assert [r["path"] for r in alpha.requests[before:]] == ["/good"]
    assert sorted((line["status"], line.get("reason") or "") for line in lines) == [(0, "content_length_mismatch"),
                                                                                (200, "")]
    no_traceback(log)


def test_a_stream_the_client_resets_in_the_read_that_opened_it_still_gets_its_line(stack: dict[str, Any]) -> None:
    """HEADERS then RST_STREAM in one write: the stream's task is told before it begins (a task cancelled
    before it starts never runs its ``finally``: no line, and the stream stayed open for the drain and the
    idle timer). Found beside point 9, whose stream errors take the same path."""
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = len(alpha.requests)
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.conn.send_headers(1, base(b"/r", method=b"POST"))
            c.conn.reset_stream(1)
            c.sock.sendall(c.conn.data_to_send())
            c.get(3, f"alpha.{DOMAIN}", b"/after")
            out = c.wait(3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert status(out, 3) == b"200"
    assert [r["path"] for r in alpha.requests[before:]] == ["/after"]
    assert sorted((line["status"], line.get("reason") or "") for line in lines) == [(0, "client_reset"), (200, "")]
    no_traceback(log)


def test_trailers_without_end_stream_reset_their_stream_only(stack: dict[str, Any]) -> None:
    """Trailers must end the stream (RFC 9113 8.1): a HEADERS frame after the head without END_STREAM resets
    that stream PROTOCOL_ERROR (h2 raised it as a connection error), its line says ``bad_trailers``, the app
    never gets the request whole, the connection goes on."""
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    before = len(alpha.requests)
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            c.send(1, [*base(b"/t", method=b"POST"), (b"content-length", b"3")], end=False)  # as above
            c.conn.send_data(1, b"abc")
            f = hyperframe.frame.HeadersFrame(1)  # h2's client would not write it
            f.data = c.conn.encoder.encode([(b"x-sum", b"1")])
            f.flags.add("END_HEADERS")
            c.sock.sendall(c.conn.data_to_send() + f.serialize())
            c.get(3, f"alpha.{DOMAIN}", b"/after")
            out = c.wait(1, 3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert c.goaway is None and out[1].get("reset") == 1 and status(out, 3) == b"200"
    assert [r["path"] for r in alpha.requests[before:]] == ["/after"]
    assert sorted((line["status"], line.get("reason") or "") for line in lines) == [(0, "bad_trailers"), (200, "")]
    no_traceback(log)


H2_BAD_TRAILERS = {
    "pseudo-header": ([(b":path", b"/x")], "bad_pseudo_header"),
    "upper-case-name": ([(b"X-Sum", b"1")], "bad_header"),
    "connection-header": ([(b"connection", b"close")], "bad_header"),
}


@pytest.mark.parametrize("case", sorted(H2_BAD_TRAILERS))
def test_malformed_trailers_reset_their_stream_only(stack: dict[str, Any], case: str) -> None:
    """Trailers are held to the field rules and carry no pseudo-header (RFC 9113 8.1): the stream is reset
    PROTOCOL_ERROR with its reason in its line, the app never gets the request whole, the connection goes
    on."""
    gw: GatewayThread = stack["gw"]
    alpha = stack["app"]
    trailers, reason = H2_BAD_TRAILERS[case]
    before = len(alpha.requests)
    with gateway_log(gw) as log:
        c = H2Client(stack, f"alpha.{DOMAIN}")
        try:
            # With a content-length, the app waits for the body, which the gateway holds until the stream's
            # end: the app cannot answer the head before the trailers are judged (a chunked body it need not
            # read first; the head goes up as it came).
            c.send(1, [*base(b"/t", method=b"POST"), (b"content-length", b"3")], end=False)
            c.conn.send_data(1, b"abc")
            c.conn.send_headers(1, trailers, end_stream=True)
            c.sock.sendall(c.conn.data_to_send())
            c.get(3, f"alpha.{DOMAIN}", b"/after")
            out = c.wait(1, 3)
        finally:
            c.close()
        lines = wait_events(log, "request", 2)
    assert c.goaway is None and out[1].get("reset") == 1 and status(out, 3) == b"200"
    assert [r["path"] for r in alpha.requests[before:]] == ["/after"]
    assert sorted((line["status"], line.get("reason") or "") for line in lines) == [(0, reason), (200, "")]
    no_traceback(log)


# -- point 11: a WebSocket's ?token= -------------------------------------------------------------------------


class WsApp:
    """A WebSocket app (the websockets library's server) that records each handshake's path and headers."""

    def __init__(self) -> None:
        from websockets.sync.server import serve

        self.seen: list[dict[str, Any]] = []

        def handler(conn: Any) -> None:
            self.seen.append({"path": conn.request.path, "headers": [[k.lower(), v] for k, v in
                                                                      conn.request.headers.raw_items()]})
            for message in conn:
                conn.send(message)

        self.server = serve(handler, "127.0.0.1", 0)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = int(self.server.socket.getsockname()[1])


@pytest.fixture(scope="module")
def ws_token(stack: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayThread, WsApp]]:
    app = WsApp()
    routes = tmp_path_factory.mktemp("ws-routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "wsec": registration(stack["pki"], stack["fwd"].port, {app.port: ("http", "token")}, default=app.port),
    }}))
    gw = GatewayThread(stack["pki"], routes, header_timeout=2.0, idle_timeout=5.0)
    yield gw, app
    gw.stop()
    app.server.shutdown()


def ws_connect(stack: dict[str, Any], gw: GatewayThread, path: str) -> Any:
    from websockets.sync.client import connect

    ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    return connect(f"wss://wsec.{DOMAIN}:{gw.port}{path}", sock=sock, ssl=ctx, server_hostname=f"wsec.{DOMAIN}",
                   proxy=None, open_timeout=10)


def test_a_websocket_authenticates_with_its_token_in_the_url(stack: dict[str, Any],
                                                              ws_token: tuple[GatewayThread, WsApp]) -> None:
    """What ``new WebSocket("wss://...?token=...")`` sends: a right token opens the session itself (a browser
    cannot follow a 303 here), and never reaches the app, in the target or anywhere else."""
    gw, app = ws_token
    before = len(app.seen)
    with ws_connect(stack, gw, f"/chat?a=1&token={TOKEN}&b=2") as ws:
        assert ws.response is not None and ws.response.status_code == 101
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
    seen = app.seen[before:]
    assert [s["path"] for s in seen] == ["/chat?a=1&b=2"]
    assert TOKEN not in json.dumps(seen)


@pytest.mark.parametrize(("path", "code"), [(f"/chat?token={TOKEN}x", 403), ("/chat?token=", 401), ("/chat", 401)])
def test_a_websocket_with_a_wrong_or_no_token_is_refused_before_any_link(
    stack: dict[str, Any], ws_token: tuple[GatewayThread, WsApp], path: str, code: int
) -> None:
    from websockets.exceptions import InvalidStatus

    gw, app = ws_token
    before = (len(app.seen), gw.sample(ATTEMPTS))
    with gateway_log(gw) as log:
        with pytest.raises(InvalidStatus) as e:
            ws_connect(stack, gw, path)
        lines = wait_events(log, "request", 1)
    assert e.value.response.status_code == code
    assert (len(app.seen), gw.sample(ATTEMPTS)) == before
    reason = "wrong_token" if code == 403 else "missing_token"
    assert [(line["status"], line["reason"], line["sandbox_id"]) for line in lines] == [(code, reason, "wsec")]
    assert not log.events("link_open")
    assert not any(TOKEN in t for t in log.text)
    no_traceback(log)


# -- point 18: clients without SNI ----------------------------------------------------------------------------


def test_an_http11_client_without_sni_is_routed_request_by_request(stack: dict[str, Any]) -> None:
    out = https_exchange(stack, b"GET /one HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n"
                                b"GET /two HTTP/1.1\r\nHost: beta.sbx.test\r\n\r\n"
                                b"GET /three HTTP/1.1\r\nHost: nosuch.sbx.test\r\n\r\n"
                                b"GET /four HTTP/1.0\r\n\r\n", sni=None)
    got = responses(out)
    assert [s for s, _ in got] == [200, 200, 404, 400], out[:400]
    assert [(json.loads(b)["sandbox"], json.loads(b)["path"]) for _, b in got[:2]] == [("alpha", "/one"),
                                                                                       ("beta", "/two")]


def test_an_http2_client_without_sni_is_routed_stream_by_stream(stack: dict[str, Any]) -> None:
    c = H2Client(stack, None)
    try:
        c.get(1, f"alpha.{DOMAIN}", b"/one")
        c.get(3, f"beta.{DOMAIN}", b"/two")
        c.get(5, f"nosuch.{DOMAIN}", b"/")
        out = c.wait(1, 3, 5)
    finally:
        c.close()
    assert [status(out, i) for i in (1, 3, 5)] == [b"200", b"200", b"404"]
    assert [json.loads(out[i]["body"])["sandbox"] for i in (1, 3)] == ["alpha", "beta"]


@pytest.mark.parametrize("version", ["--http1.1", "--http2"])
def test_curl_to_the_gateways_address_sends_no_sni_and_is_routed_by_host(stack: dict[str, Any], version: str) -> None:
    """curl sends no SNI for an IP address (RFC 6066 3): a real client without SNI, on each front. Its Host
    header (HTTP/2: its :authority) routes each URL; -k, since no certificate names the address."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed (scripts/setup.sh installs it)")
    port = stack["gw"].port
    out = []
    for host in (f"alpha.{DOMAIN}", f"beta.{DOMAIN}"):
        r = subprocess.run([curl, "-sS", "-k", version, "-H", f"Host: {host}", "-w", "\n%{http_version}",
                            f"https://127.0.0.1:{port}/by-host"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        body, got_version = r.stdout.rsplit("\n", 1)
        assert got_version == version.removeprefix("--http")
        out.append(json.loads(body)["sandbox"])
    assert out == ["alpha", "beta"]


@pytest.fixture(scope="module")
def beta_default(stack: dict[str, Any], pki: Any) -> Iterator[GatewayThread]:
    """A gateway whose first (default) certificate is for beta's name alone; the wildcard second."""
    cert, key = write_issued(mint_leaf(pki.ca, "beta-only", dns=(f"beta.{DOMAIN}",)), pki.dir, "beta-default")
    gw = GatewayThread(pki, stack["routes"], certs=[CertPair(cert, key), front_cert(pki)])
    yield gw
    gw.stop()


def test_without_sni_a_name_the_default_certificate_does_not_cover_is_421_on_both_fronts(
    stack: dict[str, Any], beta_default: GatewayThread
) -> None:
    gw = beta_default
    alpha = stack["app"]
    before = (len(alpha.requests), gw.sample(ATTEMPTS))
    out = https_exchange(stack, b"GET /h1 HTTP/1.1\r\nHost: alpha.sbx.test\r\n\r\n", sni=None, port=gw.port)
    assert out.startswith(b"HTTP/1.1 421"), out[:100]
    c = H2Client(stack, None, port=gw.port)
    try:
        c.get(1, f"alpha.{DOMAIN}", b"/h2")
        c.get(3, f"beta.{DOMAIN}", b"/covered")
        o2 = c.wait(1, 3)
    finally:
        c.close()
    assert [status(o2, 1), status(o2, 3)] == [b"421", b"200"]
    assert json.loads(o2[3]["body"])["sandbox"] == "beta"
    assert len(alpha.requests) == before[0]
    assert gw.sample(ATTEMPTS) == before[1] + 1  # beta's link only
    # With SNI the wildcard is chosen for alpha, and alpha is routed.
    out = https_exchange(stack, b"GET /sni HTTP/1.1\r\nHost: alpha.sbx.test\r\nConnection: close\r\n\r\n",
                         port=gw.port)
    assert out.startswith(b"HTTP/1.1 200"), out[:100]

