"""The gateway end to end over HTTP/1.1 with curl and raw TLS clients: gateway -> real forwarder -> app."""

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

import pytest
from gw_support import DOMAIN, TOKEN, EchoHttp, GatewayThread, JsonLines, gateway_log, non_ascii_hello, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import SandboxApp

CURL = shutil.which("curl")


def curl(stack: dict[str, Any], *urls: str, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    if CURL is None:
        pytest.skip("curl is not installed (scripts/setup.sh installs it)")
    gw: GatewayThread = stack["gw"]
    resolve = []
    for u in urls:
        host = u.split("/")[2]
        resolve += ["--resolve", f"{host}:{gw.port}:127.0.0.1"]
    cmd = [CURL, "-sS", "--http1.1", "--cacert", str(stack["pki"].ca_file), *resolve, *args]
    for u in urls:
        cmd.append(u.replace(f"{u.split('/')[2]}", f"{u.split('/')[2]}:{gw.port}", 1))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_request_reaches_its_sandbox_with_forwarded_headers(stack: dict[str, Any]) -> None:
    r = curl(stack, f"https://alpha.{DOMAIN}/hello?x=1", args=("-H", "X-Forwarded-For: 6.6.6.6"))
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    headers = dict(seen["headers"])
    assert seen["path"] == "/hello?x=1"
    assert headers["x-forwarded-for"] == "127.0.0.1"  # the client's claim replaced
    assert headers["x-forwarded-proto"] == "https"
    assert headers["x-forwarded-host"] == f"alpha.{DOMAIN}"
    assert headers["host"] == f"alpha.{DOMAIN}"


def test_keep_alive_reuses_the_connection(stack: dict[str, Any]) -> None:
    r = curl(stack, f"https://alpha.{DOMAIN}/one", f"https://alpha.{DOMAIN}/two", args=("-v",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('"path"') == 2
    assert "Re-using existing connection" in r.stderr or "Reusing existing" in r.stderr


@pytest.mark.parametrize(
    ("url", "extra", "status"),
    [
        (f"https://nobody.{DOMAIN}/", (), "404"),
        (f"https://alpha.{DOMAIN}/", ("-H", f"Host: beta.{DOMAIN}"), "421"),
        (f"https://9999-alpha.{DOMAIN}/", (), "404"),
        (f"https://gone.{DOMAIN}/", (), "503"),
    ],
)
def test_honest_errors(stack: dict[str, Any], url: str, extra: tuple[str, ...], status: str) -> None:
    r = curl(stack, url, args=("-o", "/dev/null", "-w", "%{http_code}", *extra))
    assert r.stdout == status, r.stderr


def test_token_routes(stack: dict[str, Any]) -> None:
    base = f"https://secure.{DOMAIN}/page"
    fmt = ("-o", "/dev/null", "-w", "%{http_code}")
    assert curl(stack, base, args=fmt).stdout == "401"
    assert curl(stack, base, args=(*fmt, "-H", "Authorization: Bearer nope")).stdout == "403"
    r = curl(stack, base, args=("-H", f"Authorization: Bearer {TOKEN}"))
    seen = json.loads(r.stdout)
    assert "authorization" not in dict(seen["headers"])
    r = curl(stack, f"{base}?a=1&token={TOKEN}&b=2", args=("-D", "-", "-o", "/dev/null"))
    head = r.stdout.lower()
    assert head.startswith("http/1.1 303")
    assert f"location: https://secure.{DOMAIN}:{stack['gw'].port}/page?a=1&b=2\n" in head  # the port kept
    assert "set-cookie: sbx_token=" in head and "httponly" in head and "secure" in head
    r = curl(stack, base, args=("-H", f"Cookie: other=1; sbx_token={TOKEN}"))
    seen = json.loads(r.stdout)
    assert dict(seen["headers"]).get("cookie") == "other=1"
    assert all(TOKEN not in v for _, v in seen["headers"])


@pytest.mark.parametrize("version", ["--http1.1", "--http2"])
def test_a_token_link_on_a_non_default_port_is_followed_to_the_page(stack: dict[str, Any], tmp_path: Path,
                                                                    version: str) -> None:
    """What a browser does with https://x.<domain>:<port>/?token=...: the 303 keeps the port, so the cookie
    it set goes back to the same origin and the page is served (curl follows, with a cookie jar)."""
    if CURL is None:
        pytest.skip("curl is not installed (scripts/setup.sh installs it)")
    port = stack["gw"].port
    jar = tmp_path / "jar"
    r = subprocess.run([CURL, "-sS", version, "--cacert", str(stack["pki"].ca_file), "--resolve",
                        f"secure.{DOMAIN}:{port}:127.0.0.1", "-L", "-c", str(jar), "-b", str(jar),
                        "-w", "\n%{url_effective} %{num_redirects}",
                        f"https://secure.{DOMAIN}:{port}/page?token={TOKEN}&x=1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    body, last = r.stdout.rsplit("\n", 1)
    assert last == f"https://secure.{DOMAIN}:{port}/page?x=1 1"
    seen = json.loads(body)
    assert (seen["sandbox"], seen["path"]) == ("secure", "/page?x=1")
    assert TOKEN not in json.dumps(seen)


def test_upload_and_download_stream_exactly(stack: dict[str, Any], tmp_path: Path) -> None:
    body = tmp_path / "up.bin"
    body.write_bytes(b"y" * (8 << 20))
    r = curl(stack, f"https://alpha.{DOMAIN}/upload", args=("--data-binary", f"@{body}"))
    seen = json.loads(r.stdout)
    assert seen["body_len"] == 8 << 20 and seen["body_sha256"] == hashlib.sha256(body.read_bytes()).hexdigest()
    down = subprocess.run([CURL or "curl", "-sS", "--http1.1", "--cacert", str(stack["pki"].ca_file), "--resolve",
                           f"alpha.{DOMAIN}:{stack['gw'].port}:127.0.0.1",
                           f"https://alpha.{DOMAIN}:{stack['gw'].port}/bytes/{8 << 20}"], capture_output=True,
                          timeout=60)
    assert hashlib.sha256(down.stdout).hexdigest() == hashlib.sha256(b"x" * (8 << 20)).hexdigest()


def raw_tls(stack: dict[str, Any], sni: str) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    s = socket.create_connection(("127.0.0.1", stack["gw"].port), timeout=10)
    return ctx.wrap_socket(s, server_hostname=sni)


def exchange(stack: dict[str, Any], data: bytes) -> bytes:
    s = raw_tls(stack, f"alpha.{DOMAIN}")
    s.sendall(data)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, ssl.SSLError, TimeoutError):
        pass
    s.close()
    return out


SMUGGLING = {
    "cl_te": b"POST / HTTP/1.1\r\nHost: alpha.sbx.test\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"0\r\n\r\n",
    "cl_cl": b"POST / HTTP/1.1\r\nHost: alpha.sbx.test\r\nContent-Length: 4\r\nContent-Length: 4\r\n\r\nabcd",
    "cl_list": b"POST / HTTP/1.1\r\nHost: alpha.sbx.test\r\nContent-Length: 4, 5\r\n\r\nabcd",
    "te_obfuscated": b"POST / HTTP/1.1\r\nHost: alpha.sbx.test\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "te_space": b"POST / HTTP/1.1\r\nHost: alpha.sbx.test\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "obs_fold": b"GET / HTTP/1.1\r\nHost: alpha.sbx.test\r\nX-A: 1\r\n  folded\r\n\r\n",
    "nul": b"GET / HTTP/1.1\r\nHost: alpha.sbx.test\r\nX-A: a\x00b\r\n\r\n",
    "ctl_name": b"GET / HTTP/1.1\r\nHost: alpha.sbx.test\r\nX\x01A: b\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(SMUGGLING))
def test_smuggling_corpus_is_400_and_nothing_is_forwarded(stack: dict[str, Any], case: str) -> None:
    app: EchoHttp = stack["app"]
    before = len(app.requests)
    out = exchange(stack, SMUGGLING[case])
    assert out.startswith(b"HTTP/1.1 400"), out[:80]
    assert len(app.requests) == before


def test_a_head_over_the_limit_is_431(stack: dict[str, Any]) -> None:
    out = exchange(stack, b"GET / HTTP/1.1\r\nHost: alpha.sbx.test\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431"), out[:80]


def test_slowloris_is_cut_at_the_header_timeout(stack: dict[str, Any]) -> None:
    s = raw_tls(stack, f"alpha.{DOMAIN}")
    s.settimeout(0.2)
    s.sendall(b"GET / HTTP/1.1\r\nHost: alpha.sbx.test\r\n")
    t0 = time.monotonic()
    closed = False
    while time.monotonic() - t0 < 5 and not closed:
        try:
            s.sendall(b"X-Drip: 1\r\n")
            closed = s.recv(1) == b""
        except TimeoutError:
            continue
        except OSError:  # ssl.SSLError included: the gateway hung up
            closed = True
    took = time.monotonic() - t0
    s.close()
    assert closed, "a head dripped for 5 s was never cut"
    assert 0.8 < took < 3.5, took  # header_timeout is 1 s here


def test_raw_tcp_route_by_sni_alone(stack: dict[str, Any]) -> None:
    tcp: SandboxApp = stack["tcp"]
    ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
    s = socket.create_connection(("127.0.0.1", stack["gw"].port), timeout=10)
    t = ctx.wrap_socket(s, server_hostname=f"{tcp.port}-alpha.{DOMAIN}")  # no ALPN, like openssl s_client
    t.sendall(b"ping over raw tls")
    assert t.recv(100) == b"ping over raw tls"
    t.close()


def test_openssl_s_client_reaches_a_raw_route(stack: dict[str, Any]) -> None:
    # How SSH reaches a sandbox: ProxyCommand openssl s_client -quiet -servername <port>-<sandbox>.<domain> ...
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    tcp: SandboxApp = stack["tcp"]
    proc = subprocess.Popen(
        [openssl, "s_client", "-quiet", "-servername", f"{tcp.port}-alpha.{DOMAIN}", "-CAfile",
         str(stack["pki"].ca_file), "-verify_return_error", "-connect", f"127.0.0.1:{stack['gw'].port}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"hello from s_client\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"hello from s_client\n"
    finally:
        proc.kill()
        proc.wait(10)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def test_a_websocket_session_through_the_gateway(stack: dict[str, Any]) -> None:
    from websockets.sync.client import connect

    gw: GatewayThread = stack["gw"]
    ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    with connect(f"wss://ws.{DOMAIN}:{gw.port}/chat", sock=sock, ssl=ctx, server_hostname=f"ws.{DOMAIN}",
                 proxy=None, open_timeout=10) as ws:
        for msg in ("hello", "x" * 100_000, b"\x00\x01binary"):
            ws.send(msg)
            assert ws.recv(timeout=10) == msg
    assert gw.sample("sbxnet_gateway_requests_total", {"kind": "upgrade", "status": "101"}) >= 1


def wait_lines(log: JsonLines, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The first ``n`` access-log lines, once written (a line is written as its request ends, which may be
    just after the client has read the answer)."""
    deadline = time.monotonic() + timeout
    while len(log.events("request")) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = log.events("request")
    assert len(lines) == n, lines
    return lines


def test_one_access_log_line_per_request_refusals_included_and_never_the_token(stack: dict[str, Any]) -> None:
    port = stack["gw"].port
    fmt = ("-o", "/dev/null", "-w", "%{http_code} %{size_download}")
    gw: GatewayThread = stack["gw"]
    # (URL, curl arguments, status, reason, the sandbox asked for, the authority logged)
    cases: list[tuple[str, tuple[str, ...], int, str | None, str | None, str | None]] = [
        (f"https://alpha.{DOMAIN}/a?token={TOKEN}", (), 200, None, "alpha", f"alpha.{DOMAIN}:{port}"),
        (f"https://alpha.{DOMAIN}/", ("-H", f"Host: Beta.{DOMAIN}"), 421, "misdirected", "beta", f"beta.{DOMAIN}"),
        (f"https://secure.{DOMAIN}/p", (), 401, "missing_token", "secure", f"secure.{DOMAIN}:{port}"),
        (f"https://secure.{DOMAIN}/p", ("-H", f"X-Sbx-Token: {TOKEN}x"), 403, "wrong_token", "secure",
         f"secure.{DOMAIN}:{port}"),
        (f"https://secure.{DOMAIN}/p?token={TOKEN}", (), 303, None, "secure", f"secure.{DOMAIN}:{port}"),
        (f"https://secure.{DOMAIN}/p", ("-H", f"Authorization: Bearer {TOKEN}", "-H", f"Cookie: sbx_token={TOKEN}"),
         200, None, "secure", f"secure.{DOMAIN}:{port}"),
        (f"https://nobody.{DOMAIN}/", (), 404, "unknown_sandbox", "nobody", f"nobody.{DOMAIN}:{port}"),
        (f"https://gone.{DOMAIN}/", (), 503, "*", "gone", f"gone.{DOMAIN}:{port}"),  # the last failure's reason
        (f"https://alpha.{DOMAIN}/", ("-H", f"Host: {TOKEN}@alpha.{DOMAIN}"), 400, "bad_authority", None, None),
        (f"https://alpha.{DOMAIN}/", ("-H", "X-Big: " + "a" * 20000), 431, "header_too_large", None, None),
    ]
    with gateway_log(gw) as log:
        sizes = []
        for url, args, status, *_ in cases:
            r = curl(stack, url, args=(*fmt, *args))
            code, downloaded = r.stdout.split()
            assert int(code) == status, (url, r.stdout, r.stderr)
            sizes.append(int(downloaded))
        smuggled = exchange(stack, SMUGGLING["cl_te"])
        assert smuggled.startswith(b"HTTP/1.1 400")
        lines = wait_lines(log, len(cases) + 1)
        assert not any(TOKEN in text for text in log.text), [t for t in log.text if TOKEN in t]

    def find(status: int, reason: str | None, sandbox: str | None) -> dict[str, Any]:
        found = [line for line in lines if (line["status"], line.get("sandbox_id")) == (status, sandbox)
                 and (line.get("reason") == reason or (reason == "*" and line.get("reason")))]
        assert len(found) == 1, (status, reason, sandbox, lines)
        return found[0]

    for (url, _, status, reason, sandbox, authority), size in zip(cases, sizes, strict=True):
        line = find(status, reason, sandbox)
        assert line["authority"] == authority, (url, line)
        assert line["method"] == "GET" and line["proto"] == "http/1.1" and line["bytes"] == size, (url, line)
        assert 0 <= line["duration"] < 30 and len(line["conn_id"]) == 16, line
    assert find(503, "*", "gone")["duration"] >= 0.4  # the route's 0.5 s connect deadline
    smuggling = find(400, "content_length_with_transfer_encoding", None)
    assert smuggling["method"] == "POST" and smuggling["bytes_up"] == 0
    assert len({line["conn_id"] for line in lines}) == len(lines)  # a connection each


def test_a_request_body_is_counted_in_its_line(stack: dict[str, Any], tmp_path: Path) -> None:
    body = tmp_path / "up.bin"
    body.write_bytes(b"z" * 300_000)
    with gateway_log(stack["gw"]) as log:
        r = curl(stack, f"https://alpha.{DOMAIN}/upload", args=("--data-binary", f"@{body}"))
        assert json.loads(r.stdout)["body_len"] == 300_000
        (post,) = wait_lines(log, 1)
    assert (post["method"], post["status"], post["bytes_up"], post["sandbox_id"]) == ("POST", 200, 300_000, "alpha")
    assert post["bytes"] == len(r.stdout.encode())  # an upgrade's line: the WebSocket tests below


# -- after a 101: the raw routes' ending rule -----------------------------------------------------------


def ws_endings_app(conn: socket.socket) -> str:
    """A sandbox's WebSocket program (websockets' server protocol over a plain socket, so the test sees how
    TCP ended): echoes text, answers a close frame and closes its side; returns how the connection ended
    at the socket: ``eof`` (a FIN), ``reset``."""
    from websockets.frames import Frame, Opcode
    from websockets.http11 import Request
    from websockets.server import ServerProtocol

    proto = ServerProtocol()
    while True:
        try:
            data = conn.recv(65536)
        except ConnectionResetError:
            return "reset"
        if not data:
            return "eof"
        proto.receive_data(data)
        for ev in proto.events_received():
            if isinstance(ev, Request):
                proto.send_response(proto.accept(ev))
            elif isinstance(ev, Frame) and ev.opcode is Opcode.TEXT:
                proto.send_text(ev.data)
        for out in proto.data_to_send():
            if out:
                conn.sendall(out)
            else:
                conn.shutdown(socket.SHUT_WR)  # the protocol's "close the TCP connection now"


class WsClient:
    """A WebSocket client (websockets' client protocol) over a TLS socket the test controls, so it can end
    TLS with close_notify or without."""

    def __init__(self, stack: dict[str, Any], port: int, name: str) -> None:
        from websockets.client import ClientProtocol
        from websockets.http11 import Response
        from websockets.uri import parse_uri

        ctx = ssl.create_default_context(cafile=str(stack["pki"].ca_file))
        ctx.set_alpn_protocols(["http/1.1"])
        self.tls = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname=name)
        self.proto = ClientProtocol(parse_uri(f"wss://{name}:{port}/"))
        self.proto.send_request(self.proto.connect())
        self.flush()
        while not any(isinstance(ev, Response) for ev in self.read_events()):
            pass

    def flush(self) -> None:
        for out in self.proto.data_to_send():
            if out:
                self.tls.sendall(out)

    def read_events(self) -> list[Any]:
        data = self.tls.recv(65536)
        if data:
            self.proto.receive_data(data)
        else:
            self.proto.receive_eof()
        return list(self.proto.events_received())

    def echo(self, text: str) -> str:
        from websockets.frames import Frame, Opcode

        self.proto.send_text(text.encode())
        self.flush()
        while True:
            for ev in self.read_events():
                if isinstance(ev, Frame) and ev.opcode is Opcode.TEXT:
                    return bytes(ev.data).decode()


@pytest.fixture(scope="module")
def ws_endings(stack: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayThread, Any]]:
    app = SandboxApp(lambda conn: app.results.append(ws_endings_app(conn)))
    routes = tmp_path_factory.mktemp("ws-routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {"wsend": registration(
        stack["pki"], stack["fwd"].port, {app.port: ("http", "public")}, default=app.port)}}))
    gw = GatewayThread(stack["pki"], routes)
    yield gw, app
    gw.stop()
    app.close()


def wait_result(app: Any, n: int, timeout: float = 10.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while len(app.results) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(app.results) == n, app.results
    return list(app.results)


def test_a_websocket_whose_client_drops_tcp_without_close_notify_is_reset_at_the_app(
    stack: dict[str, Any], ws_endings: tuple[GatewayThread, Any]
) -> None:
    gw, app = ws_endings
    before = len(app.results)
    with gateway_log(stack["gw"], gw) as log:
        c = WsClient(stack, gw.port, f"wsend.{DOMAIN}")
        assert c.echo("before the cut") == "before the cut"
        c.tls.shutdown(socket.SHUT_WR)  # ssl's shutdown: a bare TCP FIN, no close_notify
        assert wait_result(app, before + 1)[-1] == "reset"  # a truncation is never passed on as an end
        with pytest.raises(OSError):  # the gateway reset the client's side too
            while c.tls.recv(65536):
                pass
        c.tls.close()
        lines = wait_lines(log, 1)
    assert (lines[0]["status"], lines[0]["reason"], lines[0]["sandbox_id"]) == (101, "truncated", "wsend")


def test_a_websocket_closed_cleanly_ends_cleanly_at_the_app(stack: dict[str, Any],
                                                             ws_endings: tuple[GatewayThread, Any]) -> None:
    from websockets.frames import Close

    gw, app = ws_endings
    before = len(app.results)
    with gateway_log(stack["gw"], gw) as log:
        c = WsClient(stack, gw.port, f"wsend.{DOMAIN}")
        assert c.echo("hello") == "hello"
        c.proto.send_close(1000)
        c.flush()
        while data := c.tls.recv(65536):  # the app's close frame, then its FIN, passed on as close_notify
            c.proto.receive_data(data)
        assert isinstance(c.proto.close_rcvd, Close) and c.proto.close_rcvd.code == 1000
        c.tls.unwrap()  # our close_notify (the peer's came already), then the FIN
        c.tls.close()
        assert wait_result(app, before + 1)[-1] == "eof"
        lines = wait_lines(log, 1)
    assert (lines[0]["status"], lines[0].get("reason"), lines[0]["sandbox_id"]) == (101, None, "wsend")
    assert lines[0]["bytes_up"] > 0 and lines[0]["bytes"] > 0


def test_a_client_hello_with_a_non_ascii_server_name_is_refused_and_counted(stack: dict[str, Any]) -> None:
    from gateway import tls_front

    gw: GatewayThread = stack["gw"]
    failures = gw.sample("sbxnet_gateway_handshake_failures_total")
    refused = tls_front.refused_server_names["sni_not_ascii"]
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(non_ascii_hello())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer[:1] == b"\x15" and answer[-2:] == b"\x02\x50", answer  # one fatal alert, then the close
    deadline = time.monotonic() + 10
    while gw.sample("sbxnet_gateway_handshake_failures_total") == failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gw.sample("sbxnet_gateway_handshake_failures_total") == failures + 1
    assert tls_front.refused_server_names["sni_not_ascii"] == refused + 1
