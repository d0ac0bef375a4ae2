"""gRPC through the gateway: a grpcio client over TLS -> gateway -> real forwarder -> a grpcio server (h2c).

The sandbox app is a real ``grpc.server`` (insecure, on loopback) with generic handlers over raw bytes, so no
codegen is needed; the client is a real ``grpc.secure_channel`` trusting the test CA, its SNI and
``:authority`` set to the sandbox's name while it connects to the gateway on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest
from gw_support import DOMAIN, TOKEN, GatewayThread, forwarder_settings, registration

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pyproject's test extras pin it)")

from fwd_support import ForwarderThread, Pki, free_port  # noqa: E402  (gw_support put it on the path)

SERVICE = "sbx.Test"
MAX_MESSAGE = 16 << 20
_SIZES = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


class App:
    """The sandbox's gRPC server; records every call's metadata and the peer (the forwarder's link) it came on."""

    def __init__(self, port: int = 0) -> None:
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=_SIZES)
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
            "Who": grpc.unary_unary_rpc_method_handler(self.who),
            "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
            "Count": grpc.unary_stream_rpc_method_handler(self.count),
            "Digest": grpc.stream_unary_rpc_method_handler(self.digest),
            "Echo": grpc.stream_stream_rpc_method_handler(self.echo),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.started_at = 0.0

    def start(self) -> App:
        self.server.start()
        self.started_at = time.monotonic()
        return self

    def _seen(self, context: Any, method: str) -> None:
        with self._lock:
            self.calls.append({"method": method, "metadata": [(k, v) for k, v in context.invocation_metadata()],
                               "peer": context.peer()})

    def unary(self, request: bytes, context: Any) -> bytes:
        self._seen(context, "Unary")
        return request

    def who(self, request: bytes, context: Any) -> bytes:
        self._seen(context, "Who")
        md = [(k, v if isinstance(v, str) else v.hex()) for k, v in context.invocation_metadata()]
        return json.dumps(md).encode()

    def fail(self, request: bytes, context: Any) -> bytes:
        self._seen(context, "Fail")
        context.set_trailing_metadata((("x-why", "because"), ("x-blob-bin", b"\x00\x01\xff")))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the details, with ünïcode and % signs")
        raise AssertionError("abort returns by raising")

    def count(self, request: bytes, context: Any) -> Iterator[bytes]:
        self._seen(context, "Count")
        n = int(request)
        for i in range(n):
            yield i.to_bytes(4, "big") + b"m" * 100

    def digest(self, requests: Iterator[bytes], context: Any) -> bytes:
        self._seen(context, "Digest")
        h = hashlib.sha256()
        n = 0
        for r in requests:
            h.update(r)
            n += 1
        return f"{n} {h.hexdigest()}".encode()

    def echo(self, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        self._seen(context, "Echo")
        for r in requests:
            yield b"re:" + r

    def stop(self) -> None:
        self.server.stop(0).wait(5)


@pytest.fixture(scope="module")
def grpc_stack(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    fwd = ForwarderThread(forwarder_settings(pki))
    app = App().start()
    late_port = free_port()
    dead_fwd = free_port()
    routes = tmp_path_factory.mktemp("grpc-routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "grpc": registration(pki, fwd.port, {app.port: ("h2c", "public")}, default=app.port),
        "grpc2": registration(pki, fwd.port, {app.port: ("h2c", "public")}, default=app.port),
        "grpcsec": registration(pki, fwd.port, {app.port: ("h2c", "token")}, default=app.port),
        "late": registration(pki, fwd.port, {late_port: ("h2c", "public")}, default=late_port, deadline=5.0),
        "gone": registration(pki, dead_fwd, {app.port: ("h2c", "public")}, default=app.port, deadline=0.5),
    }}))
    gw = GatewayThread(pki, routes, header_timeout=2.0, idle_timeout=10.0)
    yield {"gw": gw, "fwd": fwd, "app": app, "pki": pki, "late_port": late_port, "tasks": _gateway_tasks(gw)}
    gw.stop()
    fwd.stop()
    app.stop()


def channel(s: dict[str, Any], name: str) -> Any:
    """A gRPC channel to the gateway on 127.0.0.1 whose SNI, certificate check and :authority are ``name``."""
    creds = grpc.ssl_channel_credentials(root_certificates=s["pki"].ca_file.read_bytes())
    options = [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name), *_SIZES]
    return grpc.secure_channel(f"127.0.0.1:{s['gw'].port}", creds, options=options)


def method(ch: Any, kind: str, name: str) -> Any:
    return getattr(ch, kind)(f"/{SERVICE}/{name}")


def _gateway_tasks(gw: GatewayThread) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks()) - 1  # not this one

    return asyncio.run_coroutine_threadsafe(count(), gw.loop).result(10)


def _settle(s: dict[str, Any], timeout: float = 10.0) -> None:
    """No client connection, link or task left behind once the channels are closed (the gateway's task
    count back to what it was when it had just started)."""
    tasks_before = s["tasks"]
    gw: GatewayThread = s["gw"]
    deadline = time.monotonic() + timeout
    while gw.server.open_connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gw.server.open_connections == 0
    s["fwd"].wait_idle(timeout)
    while _gateway_tasks(gw) > tasks_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _gateway_tasks(gw) == tasks_before
    assert gw.server._per_sandbox == {}


def name_of(s: dict[str, Any], sandbox: str = "grpc") -> str:
    return f"{s['app'].port}-{sandbox}.{DOMAIN}"


def test_unary_calls_share_one_link_and_leave_nothing_behind(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    gw: GatewayThread = s["gw"]
    opened = gw.sample("sbxnet_gateway_upstream_seconds_count")
    before = len(s["app"].calls)
    with channel(s, name_of(s)) as ch:
        unary = method(ch, "unary_unary", "Unary")
        for i in range(20):
            assert unary(f"hello {i}".encode(), timeout=10) == f"hello {i}".encode()
        calls = s["app"].calls[before:]
    assert len(calls) == 20
    assert len({c["peer"] for c in calls}) == 1, "the calls of one channel came on one link"
    assert gw.sample("sbxnet_gateway_upstream_seconds_count") - opened == 1
    _settle(s)


def test_metadata_and_forwarded_headers_reach_the_app(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    with channel(s, name_of(s)) as ch:
        who = method(ch, "unary_unary", "Who")
        md = dict(json.loads(who(b"", metadata=(("x-custom", "v1"), ("x-forwarded-for", "6.6.6.6")), timeout=10)))
    assert md["x-custom"] == "v1"
    assert md["x-forwarded-for"] == "127.0.0.1"  # the gateway's, not the client's
    assert md["x-forwarded-proto"] == "https"
    assert md["x-forwarded-host"] == name_of(s)


def test_server_streaming_a_thousand_messages(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    with channel(s, name_of(s)) as ch:
        got = list(method(ch, "unary_stream", "Count")(b"1000", timeout=30))
    assert [int.from_bytes(m[:4], "big") for m in got] == list(range(1000))
    assert all(m[4:] == b"m" * 100 for m in got)


def test_client_streaming(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    msgs = [hashlib.sha256(str(i).encode()).digest() * 40 for i in range(500)]
    with channel(s, name_of(s)) as ch:
        out = method(ch, "stream_unary", "Digest")(iter(msgs), timeout=30)
    assert out == f"500 {hashlib.sha256(b''.join(msgs)).hexdigest()}".encode()


def test_bidi_ping_pong_streams_each_message_through(grpc_stack: dict[str, Any]) -> None:
    """Each request is sent only after the previous answer came back: this passes only if neither the
    request stream nor the response stream is held back by the gateway."""
    s = grpc_stack
    import queue

    q: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (m := q.get(timeout=10)) is not None:
            yield m

    with channel(s, name_of(s)) as ch:
        q.put(b"0")
        answers = method(ch, "stream_stream", "Echo")(requests(), timeout=30)
        got = []
        for a in answers:
            got.append(a)
            n = len(got)
            q.put(str(n).encode() if n < 100 else None)
    assert got == [b"re:" + str(i).encode() for i in range(100)]


def test_a_status_error_with_details_and_trailing_metadata_passes_through(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    with channel(s, name_of(s)) as ch, pytest.raises(grpc.RpcError) as info:
        method(ch, "unary_unary", "Fail")(b"", timeout=10)
    e = info.value
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert e.details() == "the details, with ünïcode and % signs"
    trailing = dict(e.trailing_metadata())
    assert trailing["x-why"] == "because"
    assert trailing["x-blob-bin"] == b"\x00\x01\xff"


def test_an_8_mib_message_each_way(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    import random

    big = random.Random(8).randbytes(8 << 20)
    with channel(s, name_of(s)) as ch:
        out = method(ch, "unary_unary", "Unary")(big, timeout=60)
    assert len(out) == len(big)
    assert hashlib.sha256(out).digest() == hashlib.sha256(big).digest()


def test_a_token_route_requires_the_token_and_never_passes_it_on(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    name = name_of(s, "grpcsec")
    before = len(s["app"].calls)
    with channel(s, name) as ch:
        unary = method(ch, "unary_unary", "Unary")
        with pytest.raises(grpc.RpcError) as none:
            unary(b"x", timeout=10)
        with pytest.raises(grpc.RpcError) as wrong:
            unary(b"x", metadata=(("authorization", "Bearer not-it"),), timeout=10)
        assert len(s["app"].calls) == before, "a refused call reached the app"
        assert unary(b"x", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10) == b"x"
        assert unary(b"y", metadata=(("x-sbx-token", TOKEN),), timeout=10) == b"y"
    assert none.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the gateway's 401, as gRPC reads it
    assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED  # 403
    calls = s["app"].calls[before:]
    assert len(calls) == 2
    for c in calls:
        keys = {k for k, _ in c["metadata"]}
        assert "authorization" not in keys and "x-sbx-token" not in keys
        assert not any(TOKEN in (v if isinstance(v, str) else v.decode("latin-1")) for _, v in c["metadata"])


def test_an_authority_for_another_sandbox_goes_to_that_sandbox(grpc_stack: dict[str, Any]) -> None:
    """SNI names sandbox grpc, :authority names grpc2 (a coalesced connection, which the wildcard certificate
    covers): the call is routed to grpc2 by its own route, never to the connection's first sandbox."""
    s = grpc_stack
    creds = grpc.ssl_channel_credentials(root_certificates=s["pki"].ca_file.read_bytes())
    options = [("grpc.ssl_target_name_override", name_of(s)), ("grpc.default_authority", name_of(s, "grpc2"))]
    with grpc.secure_channel(f"127.0.0.1:{s['gw'].port}", creds, options=options) as ch:
        seen = dict(json.loads(method(ch, "unary_unary", "Who")(b"", timeout=10)))
    assert seen["x-forwarded-host"] == name_of(s, "grpc2")


def test_a_sandbox_that_listens_late_is_answered(grpc_stack: dict[str, Any]) -> None:
    """Cold start through the chain: the app's server starts 400 ms after the call; the gateway retries the
    link (no request byte goes before the forwarder's OK) and the call is answered once it listens."""
    s = grpc_stack
    late = App(s["late_port"])
    timer = threading.Timer(0.4, late.start)
    started = time.monotonic()
    timer.start()
    try:
        with channel(s, f"late.{DOMAIN}") as ch:
            out = method(ch, "unary_unary", "Unary")(b"early bird", timeout=10, wait_for_ready=True)
        answered = time.monotonic()
    finally:
        timer.join()
        late.stop()
    assert out == b"early bird"
    assert len(late.calls) == 1
    assert late.started_at - started >= 0.35
    assert answered - late.started_at < 2.0  # generous: the machine is shared; the backoff cap is 50 ms


def test_an_unreachable_forwarder_is_unavailable(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    with channel(s, f"gone.{DOMAIN}") as ch, pytest.raises(grpc.RpcError) as info:
        method(ch, "unary_unary", "Unary")(b"x", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the gateway's 503, as gRPC reads it


def test_many_concurrent_calls_on_one_channel(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    with channel(s, name_of(s)) as ch:
        unary = method(ch, "unary_unary", "Unary")
        futs = [unary.future(f"c{i}".encode() * 1000, timeout=30) for i in range(64)]
        assert [f.result() for f in futs] == [f"c{i}".encode() * 1000 for i in range(64)]


def open_fds() -> set[int]:
    """This process's descriptors, without the one the listing itself used (gone once it is done)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            os.readlink(f"/proc/self/fd/{name}")
            out.add(int(name))
    return out


def test_grpc_leaves_no_descriptor_behind(grpc_stack: dict[str, Any]) -> None:
    """After a warm-up (gRPC keeps a few process-wide descriptors of its own), a channel's calls through
    the gateway leave no descriptor open in this process (gateway, forwarder and app all live here). The
    gateway's route source rereads its file every second, so a descriptor counts only if it stays."""
    s = grpc_stack
    with channel(s, name_of(s)) as ch:
        method(ch, "unary_unary", "Unary")(b"warm", timeout=10)
    _settle(s)
    before = open_fds()
    for _ in range(3):
        with channel(s, name_of(s)) as ch:
            list(method(ch, "unary_stream", "Count")(b"50", timeout=10))
    _settle(s)
    deadline = time.monotonic() + 5
    new = open_fds() - before
    while new and time.monotonic() < deadline:
        time.sleep(0.05)
        new &= open_fds() - before  # only what stays open across listings
    assert new == set()


def test_an_http11_request_to_an_h2c_port_is_505_and_reaches_nothing(grpc_stack: dict[str, Any]) -> None:
    s = grpc_stack
    name, port = name_of(s), s["gw"].port
    before = len(s["app"].calls)
    r = subprocess.run(["curl", "-sS", "--http1.1", "--cacert", str(s["pki"].ca_file), "--resolve",
                        f"{name}:{port}:127.0.0.1", "-w", "\n%{http_code}", f"https://{name}:{port}/"],
                       capture_output=True, text=True, timeout=30)
    body, _, code = r.stdout.rpartition("\n")
    assert code == "505" and "speaks HTTP/2 only" in body, r.stdout + r.stderr
    assert len(s["app"].calls) == before
