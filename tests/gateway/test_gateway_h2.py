"""The gateway end to end over HTTP/2 (ALPN h2) with curl and a raw h2 client: gateway -> real forwarder -> app."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from gw_support import DOMAIN, EchoHttp, GatewayThread

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
    """A minimal blocking HTTP/2 client: the h2 library over a Python ssl socket."""

    def __init__(self, stack: dict[str, Any], sni: str) -> None:
        ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", stack["gw"].port), timeout=10)
        self.sock = ctx.wrap_socket(raw, server_hostname=sni)
        assert self.sock.selected_alpn_protocol() == "h2"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.responses: dict[int, dict[str, Any]] = {}

    def request(self, stream_id: int, authority: str, path: str = "/") -> None:
        self.conn.send_headers(stream_id, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                                           (":path", path)], end_stream=True)
        self.sock.sendall(self.conn.data_to_send())

    def wait(self, *stream_ids: int) -> dict[int, dict[str, Any]]:
        while not all(self.responses.get(s, {}).get("ended") for s in stream_ids):
            data = self.sock.recv(65536)
            assert data, "the gateway closed the connection"
            for ev in self.conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    self.responses.setdefault(ev.stream_id, {"body": b""})["headers"] = dict(ev.headers)
                elif isinstance(ev, h2.events.DataReceived):
                    self.responses.setdefault(ev.stream_id, {"body": b""})["body"] += ev.data
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    self.responses[ev.stream_id]["ended"] = True
                elif isinstance(ev, h2.events.StreamReset):
                    self.responses.setdefault(ev.stream_id, {"body": b""})["ended"] = True
                    self.responses[ev.stream_id]["reset"] = ev.error_code
            self.sock.sendall(self.conn.data_to_send())
        return self.responses

    def close(self) -> None:
        self.sock.close()


def test_a_coalesced_stream_for_another_sandbox_is_421_and_never_forwarded(stack: dict[str, Any]) -> None:
    app: EchoHttp = stack["app"]  # alpha and beta are the same app: count what it received
    before = len(app.requests)
    c = RawH2(stack, f"alpha.{DOMAIN}")
    try:
        c.request(1, f"alpha.{DOMAIN}", "/first")
        c.request(3, f"beta.{DOMAIN}", "/coalesced")
        out = c.wait(1, 3)
    finally:
        c.close()
    assert out[1]["headers"][":status"] == "200"
    assert json.loads(out[1]["body"])["path"] == "/first"
    assert out[3]["headers"][":status"] == "421"
    paths = [r["path"] for r in app.requests[before:]]
    assert paths == ["/first"]


def test_concurrent_streams_and_errors_on_one_connection(stack: dict[str, Any]) -> None:
    c = RawH2(stack, f"alpha.{DOMAIN}")
    try:
        c.request(1, f"alpha.{DOMAIN}", f"/bytes/{1 << 20}")
        c.request(3, f"alpha.{DOMAIN}:{stack['gw'].port}", "/second")
        c.request(5, f"1-alpha.{DOMAIN}", "/other-port")  # another port of the same sandbox: 421
        out = c.wait(1, 3, 5)
    finally:
        c.close()
    assert out[1]["headers"][":status"] == "200"
    assert out[1]["body"] == b"x" * (1 << 20)
    assert json.loads(out[3]["body"])["path"] == "/second"
    assert out[5]["headers"][":status"] == "421"


def test_a_dead_forwarder_fails_its_stream_only(stack: dict[str, Any]) -> None:
    c = RawH2(stack, f"gone.{DOMAIN}")
    try:
        c.request(1, f"gone.{DOMAIN}", "/")
        c.request(3, f"alpha.{DOMAIN}", "/")  # misdirected, answered on the same connection
        out = c.wait(1, 3)
        assert out[1]["headers"][":status"] in ("502", "503", "504")
        assert out[3]["headers"][":status"] == "421"
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
