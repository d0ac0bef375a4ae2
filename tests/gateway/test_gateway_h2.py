"""The gateway end to end over HTTP/2 (ALPN h2) with curl and a raw h2 client: gateway -> real forwarder -> app."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from gw_support import DOMAIN, EchoHttp, GatewayThread, front_cert, gateway_log

from certs.mint import mint_leaf, write_issued
from gateway.tls_front import CertPair

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support

CURL = shutil.which("curl")


def curl2(stack: dict[str, Any], *urls: str, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    if CURL is None:
        pytest.skip("curl is not installed (scripts/setup.sh installs it)")
    gw: GatewayThread = stack["gw"]
    cmd = [CURL, "-sS", "--http2", "--cacert", str(stack["pki"].ca_file)]
    for u in urls:
        host = u.split("/")[2]
        cmd += ["--resolve", f"{host}:{gw.port}:127.0.0.1"]
    cmd += list(args)
    for u in urls:
        host = u.split("/")[2]
        cmd.append(u.replace(host, f"{host}:{gw.port}", 1))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _has_h2_curl() -> bool:
    if CURL is None:
        return False
    return "HTTP2" in subprocess.run([CURL, "-V"], capture_output=True, text=True).stdout


needs_h2_curl = pytest.mark.skipif(not _has_h2_curl(), reason="curl without HTTP/2 support")


@needs_h2_curl
def test_curl_http2_get_reaches_its_sandbox(stack: dict[str, Any]) -> None:
    r = curl2(stack, f"https://alpha.{DOMAIN}/hello?x=1", args=("-w", "\n%{http_version}"))
    assert r.returncode == 0, r.stderr
    body, version = r.stdout.rsplit("\n", 1)
    assert version == "2"
    seen = json.loads(body)
    headers = dict(seen["headers"])
    assert seen["path"] == "/hello?x=1"
    assert headers["host"] == f"alpha.{DOMAIN}"
    assert headers["x-forwarded-proto"] == "https"
    assert not any(k.startswith(":") for k in headers)


@needs_h2_curl
def test_two_urls_share_one_http2_connection(stack: dict[str, Any]) -> None:
    r = curl2(stack, f"https://alpha.{DOMAIN}/one", f"https://alpha.{DOMAIN}/two",
              args=("-w", "\n%{http_version} %{num_connects}\n"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('"path"') == 2
    lines = [line for line in r.stdout.splitlines() if line.startswith("2 ")]
    assert lines == ["2 1", "2 0"], r.stdout  # the second request opened no connection


@needs_h2_curl
def test_a_post_body_of_a_few_mib_streams_exactly(stack: dict[str, Any], tmp_path: Path) -> None:
    body = hashlib.sha256(b"seed").digest() * (3 * 1024 * 1024 // 32 + 7)
    f = tmp_path / "body"
    f.write_bytes(body)
    r = curl2(stack, f"https://alpha.{DOMAIN}/upload", args=("--data-binary", f"@{f}", "-w", "\n%{http_version}"))
    assert r.returncode == 0, r.stderr
    out, version = r.stdout.rsplit("\n", 1)
    assert version == "2"
    seen = json.loads(out)
    assert seen["method"] == "POST"
    assert seen["body_len"] == len(body)
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()


@needs_h2_curl
def test_a_download_of_a_few_mib_over_http2(stack: dict[str, Any]) -> None:
    if CURL is None:
        pytest.skip("no curl")
    gw: GatewayThread = stack["gw"]
    n = 4 << 20
    r = subprocess.run([CURL, "-sS", "--http2", "--cacert", str(stack["pki"].ca_file), "--resolve",
                        f"alpha.{DOMAIN}:{gw.port}:127.0.0.1", f"https://alpha.{DOMAIN}:{gw.port}/bytes/{n}"],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"x" * n


@needs_h2_curl
def test_unknown_sandbox_is_404_over_http2(stack: dict[str, Any]) -> None:
    r = curl2(stack, f"https://nosuch.{DOMAIN}/", args=("-o", "/dev/null", "-w", "%{http_code} %{http_version}"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "404 2"


class RawH2:
    """A minimal blocking HTTP/2 client: the h2 library over a Python ssl socket. Unlike curl it sends
    any ``:authority`` on its connection, as a coalescing browser does. ``connection_window``: that much
    more connection window at the start, so a stream whose DATA is held (``wait(hold=...)``) does not
    stall the others."""

    def __init__(self, stack: dict[str, Any], sni: str, *, port: int | None = None, connection_window: int = 0) -> None:
        ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", port or stack["gw"].port), timeout=10)
        self.sock = ctx.wrap_socket(raw, server_hostname=sni)
        assert self.sock.selected_alpn_protocol() == "h2"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        if connection_window:
            self.conn.increment_flow_control_window(connection_window)
        self.sock.sendall(self.conn.data_to_send())
        self.responses: dict[int, dict[str, Any]] = {}

    def request(self, stream_id: int, authority: str, path: str = "/",
                headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.conn.send_headers(stream_id, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                                           (":path", path), *headers], end_stream=True)
        self.sock.sendall(self.conn.data_to_send())

    def wait(self, *stream_ids: int, hold: tuple[int, ...] = (), heads_only: bool = False) -> dict[int, dict[str, Any]]:
        """Read until each of ``stream_ids`` ended (or has its response head, ``heads_only``); the DATA of
        streams in ``hold`` is not acknowledged, so their window stays closed."""
        def done(s: int) -> bool:
            r = self.responses.get(s, {})
            return bool(r.get("ended") or (heads_only and "headers" in r))

        while not all(done(s) for s in stream_ids):
            data = self.sock.recv(65536)
            assert data, "the gateway closed the connection"
            for ev in self.conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    self.responses.setdefault(ev.stream_id, {"body": b""})["headers"] = dict(ev.headers)
                elif isinstance(ev, h2.events.DataReceived):
                    self.responses.setdefault(ev.stream_id, {"body": b""})["body"] += ev.data
                    if ev.stream_id not in hold:
                        self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    self.responses[ev.stream_id]["ended"] = True
                elif isinstance(ev, h2.events.StreamReset):
                    self.responses.setdefault(ev.stream_id, {"body": b""})["ended"] = True
                    self.responses[ev.stream_id]["reset"] = ev.error_code
            self.sock.sendall(self.conn.data_to_send())
        return self.responses

    def wait_data(self) -> None:
        """Read once more, and take what came (as ``wait`` does)."""
        for ev in self.conn.receive_data(self.sock.recv(65536)):
            if isinstance(ev, h2.events.DataReceived):
                self.responses.setdefault(ev.stream_id, {"body": b""})["body"] += ev.data
            elif isinstance(ev, h2.events.ResponseReceived):
                self.responses.setdefault(ev.stream_id, {"body": b""})["headers"] = dict(ev.headers)

    def close(self) -> None:
        self.sock.close()


def status(out: dict[int, dict[str, Any]], stream_id: int) -> str:
    return str(out[stream_id]["headers"][":status"])


def seen(out: dict[int, dict[str, Any]], stream_id: int) -> dict[str, Any]:
    """What the sandbox's app said it received (gw_support.EchoHttp's answer), its headers as a dict."""
    got = json.loads(out[stream_id]["body"])
    got["headers"] = dict(got["headers"])
    return dict(got)


def test_coalesced_streams_are_each_answered_by_their_own_sandbox_under_one_conn_id(stack: dict[str, Any]) -> None:
    alpha, beta = stack["app"], stack["beta"]
    before = (len(alpha.requests), len(beta.requests))
    with gateway_log(stack["gw"]) as log:
        c = RawH2(stack, f"alpha.{DOMAIN}")
        try:
            c.request(1, f"alpha.{DOMAIN}", "/first")
            c.request(3, f"beta.{DOMAIN}", "/coalesced")  # the wildcard certificate covers beta: routed to beta
            c.request(5, f"{beta.port}-beta.{DOMAIN}:{stack['gw'].port}", "/beta-by-port")
            c.request(7, f"{alpha.port}-alpha.{DOMAIN}", "/alpha-by-port")  # another spelling of alpha's port
            c.request(9, f"{stack['tcp'].port}-alpha.{DOMAIN}", "/raw-port")  # alpha's raw TCP port: not HTTP
            c.request(11, f"nosuch.{DOMAIN}", "/")
            out = c.wait(1, 3, 5, 7, 9, 11)
        finally:
            c.close()
    assert [status(out, i) for i in (1, 3, 5, 7, 9, 11)] == ["200", "200", "200", "200", "404", "404"]
    for i, sandbox, path in ((1, "alpha", "/first"), (3, "beta", "/coalesced"), (5, "beta", "/beta-by-port"),
                             (7, "alpha", "/alpha-by-port")):
        got = seen(out, i)
        assert (got["sandbox"], got["path"]) == (sandbox, path)
    host = seen(out, 3)["headers"]
    assert host["host"] == host["x-forwarded-host"] == f"beta.{DOMAIN}"
    assert seen(out, 5)["headers"]["host"] == f"{beta.port}-beta.{DOMAIN}"
    assert sorted(r["path"] for r in alpha.requests[before[0]:]) == ["/alpha-by-port", "/first"]
    assert sorted(r["path"] for r in beta.requests[before[1]:]) == ["/beta-by-port", "/coalesced"]
    # The gateway's log: links to both sandboxes, all under the one client connection. One per routed stream
    # at most: a stream may ride a link an earlier stream to the same sandbox port left whole (kept links).
    links = log.events("link_open")
    assert {line["sandbox_id"] for line in links} == {"alpha", "beta"}, links
    assert 2 <= len(links) <= 4, links
    assert len({line["conn_id"] for line in links}) == 1, links


def test_a_coalesced_token_route_authenticates_each_stream_on_its_own(stack: dict[str, Any]) -> None:
    from gw_support import TOKEN

    secure: EchoHttp = stack["secure"]
    before = len(secure.requests)
    c = RawH2(stack, f"alpha.{DOMAIN}")
    try:
        c.request(1, f"secure.{DOMAIN}", "/no-token")
        c.request(3, f"secure.{DOMAIN}", "/bearer", (("authorization", f"Bearer {TOKEN}"),))
        c.request(5, f"secure.{DOMAIN}", "/again-without")  # the stream before was let in: this one is not
        c.request(7, f"secure.{DOMAIN}", "/cookie", (("cookie", f"a=1; sbx_token={TOKEN}"),))
        c.request(9, f"secure.{DOMAIN}", "/wrong", (("x-sbx-token", "nope"),))
        c.request(11, f"secure.{DOMAIN}:{stack['gw'].port}", f"/?token={TOKEN}")
        c.request(13, f"alpha.{DOMAIN}", "/public")  # the connection's own sandbox is public
        out = c.wait(1, 3, 5, 7, 9, 11, 13)
    finally:
        c.close()
    assert [status(out, i) for i in (1, 3, 5, 7, 9, 11, 13)] == ["401", "200", "401", "200", "403", "303", "200"]
    assert seen(out, 3)["sandbox"] == seen(out, 7)["sandbox"] == "secure"
    assert seen(out, 13)["sandbox"] == "alpha"
    assert out[11]["headers"]["set-cookie"].startswith(f"sbx_token={TOKEN};")
    assert out[11]["headers"]["location"] == f"https://secure.{DOMAIN}:{stack['gw'].port}/"  # the port kept
    # Only those two reached the app; concurrent streams' links may reach it in either order.
    assert sorted(r["path"] for r in secure.requests[before:]) == ["/bearer", "/cookie"]
    assert all(TOKEN not in json.dumps(r) for r in secure.requests[before:])
    assert seen(out, 7)["headers"]["cookie"] == "a=1"


@pytest.fixture(scope="module")
def two_certs(stack: dict[str, Any], pki: Any) -> Iterator[GatewayThread]:
    """A gateway with two certificates: the wildcard, and one for beta's name alone (chosen for beta: an
    exact name wins)."""
    cert, key = write_issued(mint_leaf(pki.ca, "beta-only", dns=(f"beta.{DOMAIN}",)), pki.dir, "beta-only")
    gw = GatewayThread(pki, stack["routes"], certs=[front_cert(pki), CertPair(cert, key)])
    yield gw
    gw.stop()


def test_a_stream_for_a_name_the_connections_certificate_does_not_cover_is_421(
    stack: dict[str, Any], two_certs: GatewayThread
) -> None:
    alpha: EchoHttp = stack["app"]
    before = len(alpha.requests)
    c = RawH2(stack, f"beta.{DOMAIN}", port=two_certs.port)
    try:
        der = c.sock.getpeercert()
        assert der is not None and der["subjectAltName"] == (("DNS", f"beta.{DOMAIN}"),)
        c.request(1, f"beta.{DOMAIN}", "/own")
        c.request(3, f"alpha.{DOMAIN}", "/not-covered")
        c.request(5, f"{alpha.port}-beta.{DOMAIN}", "/other-port")  # beta's, but another name: not covered
        out = c.wait(1, 3, 5)
    finally:
        c.close()
    assert [status(out, i) for i in (1, 3, 5)] == ["200", "421", "421"]
    assert seen(out, 1)["sandbox"] == "beta"
    assert "/not-covered" not in [r["path"] for r in alpha.requests[before:]]
    assert two_certs.sample("sbxnet_gateway_refusals_total", {"reason": "misdirected"}) == 2
    # The wildcard's connection covers beta's name (whichever certificate beta's own connection gets).
    c = RawH2(stack, f"alpha.{DOMAIN}", port=two_certs.port)
    try:
        c.request(1, f"beta.{DOMAIN}", "/covered")
        out = c.wait(1)
    finally:
        c.close()
    assert status(out, 1) == "200" and seen(out, 1)["sandbox"] == "beta"


def test_a_coalesced_stream_takes_a_slot_of_its_own_sandboxs_limit(stack: dict[str, Any]) -> None:
    gw = GatewayThread(stack["pki"], stack["routes"], max_connections_per_sandbox=1)
    try:
        c = RawH2(stack, f"alpha.{DOMAIN}", port=gw.port, connection_window=32 << 20)
        try:
            # alpha's one slot, held: its DATA is not acknowledged, so the stream stays open at its window
            c.request(1, f"alpha.{DOMAIN}", f"/bytes/{4 << 20}")
            c.wait(1, hold=(1,), heads_only=True)
            attempts = gw.sample("sbxnet_gateway_upstream_attempts_total")
            c.request(3, f"alpha.{DOMAIN}", "/second")
            out = c.wait(3, hold=(1,))
            # Refused before any link: the slot is taken first, so a full sandbox costs its forwarder nothing.
            assert gw.sample("sbxnet_gateway_upstream_attempts_total") == attempts
            c.request(5, f"beta.{DOMAIN}", "/coalesced")
            out = c.wait(3, 5, hold=(1,))
            assert not out[1].get("ended")
            assert [status(out, 1), status(out, 3), status(out, 5)] == ["200", "503", "200"]
            assert seen(out, 5)["sandbox"] == "beta"
            assert gw.sample("sbxnet_gateway_refusals_total", {"reason": "sandbox_connection_limit"}) == 1
            assert gw.sample("sbxnet_gateway_upstream_attempts_total") == attempts + 1  # beta's link
        finally:
            c.close()
    finally:
        gw.stop()


def test_concurrent_streams_and_errors_on_one_connection(stack: dict[str, Any]) -> None:
    c = RawH2(stack, f"alpha.{DOMAIN}")
    try:
        c.request(1, f"alpha.{DOMAIN}", f"/bytes/{1 << 20}")
        c.request(3, f"alpha.{DOMAIN}:{stack['gw'].port}", "/second")
        c.request(5, f"1-alpha.{DOMAIN}", "/other-port")  # another port of the same sandbox, not exposed
        c.request(7, f"alpha.{DOMAIN}:9999", "/")  # a port the gateway does not listen on
        out = c.wait(1, 3, 5, 7)
    finally:
        c.close()
    assert status(out, 1) == "200"
    assert out[1]["body"] == b"x" * (1 << 20)
    assert seen(out, 3)["path"] == "/second"
    assert status(out, 5) == "404"
    assert status(out, 7) == "400"


def test_a_dead_forwarder_fails_its_stream_only(stack: dict[str, Any]) -> None:
    c = RawH2(stack, f"gone.{DOMAIN}")
    try:
        c.request(1, f"gone.{DOMAIN}", "/")
        c.request(3, f"alpha.{DOMAIN}", "/")  # coalesced: alpha's own link, unaffected
        out = c.wait(1, 3)
        assert status(out, 1) in ("502", "503", "504")
        assert status(out, 3) == "200" and seen(out, 3)["sandbox"] == "alpha"
    finally:
        c.close()


def test_a_stream_the_client_resets_leaves_the_others_alone(stack: dict[str, Any]) -> None:
    c = RawH2(stack, f"alpha.{DOMAIN}")
    try:
        c.request(1, f"alpha.{DOMAIN}", f"/bytes/{16 << 20}")
        while not c.responses.get(1, {}).get("body"):
            for ev in c.conn.receive_data(c.sock.recv(65536)):
                if isinstance(ev, h2.events.ResponseReceived):
                    c.responses[1] = {"body": b"", "headers": dict(ev.headers)}
                elif isinstance(ev, h2.events.DataReceived):
                    c.responses.setdefault(1, {"body": b""})["body"] += ev.data
        c.conn.reset_stream(1)
        c.sock.sendall(c.conn.data_to_send())
        c.request(3, f"alpha.{DOMAIN}", "/after-reset")
        out = c.wait(3)
    finally:
        c.close()
    assert json.loads(out[3]["body"])["path"] == "/after-reset"


def test_each_stream_gets_one_access_log_line_under_its_connections_conn_id(stack: dict[str, Any]) -> None:
    from gw_support import TOKEN

    port = stack["gw"].port
    with gateway_log(stack["gw"]) as log:
        c = RawH2(stack, f"alpha.{DOMAIN}")
        try:
            c.request(1, f"alpha.{DOMAIN}", f"/a?token={TOKEN}")
            c.request(3, f"beta.{DOMAIN}:{port}", "/coalesced")
            c.request(5, f"secure.{DOMAIN}", "/p", (("cookie", f"sbx_token={TOKEN}x"),))
            c.request(7, f"secure.{DOMAIN}", f"/p?token={TOKEN}")
            c.request(9, f"secure.{DOMAIN}", "/p", (("authorization", f"Bearer {TOKEN}"),))
            c.request(11, f"nosuch.{DOMAIN}", "/")
            c.request(13, f"{TOKEN}.{DOMAIN}:1", "/")  # a port the gateway does not listen on: 400
            out = c.wait(1, 3, 5, 7, 9, 11, 13)
            c.request(15, f"alpha.{DOMAIN}", f"/bytes/{16 << 20}")
            while not c.responses.get(15, {}).get("body"):  # some of its body has come: then reset it
                c.wait(15, heads_only=True)
                c.wait_data()
            c.conn.reset_stream(15)
            c.sock.sendall(c.conn.data_to_send())
            deadline = time.monotonic() + 10
            while len(log.events("request")) < 8 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            c.close()
    lines = log.events("request")
    said = sorted((line["status"], line.get("sandbox_id") or "", line.get("reason") or "") for line in lines)
    assert said == sorted([(200, "alpha", ""), (200, "beta", ""), (403, "secure", "wrong_token"), (303, "secure", ""),
                           (200, "secure", ""), (404, "nosuch", "unknown_sandbox"), (400, "", "wrong_port"),
                           (200, "alpha", "client_reset")]), lines
    assert len({line["conn_id"] for line in lines}) == 1
    assert not any(TOKEN in text for text in log.text), [t for t in log.text if TOKEN in t]
    for line in lines:
        assert line["proto"] == "h2" and line["method"] == "GET"
    beta = next(line for line in lines if line.get("sandbox_id") == "beta")
    assert beta["authority"] == f"beta.{DOMAIN}:{port}"
    assert beta["bytes"] == len(out[3]["body"])
    reset = next(line for line in lines if line.get("reason") == "client_reset")
    assert 0 < reset["bytes"] < 16 << 20
