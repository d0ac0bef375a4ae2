"""``sbxnet bench`` (issue 13): the quick mode runs every arm for real and writes well-formed results; the
plan interleaves; the L7 hop's re-framing. Speeds are never asserted: only that the tool works."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from sbxnet.app.bench import report
from sbxnet.app.bench.http_peer import LAST_CHUNK, chunk, reframe
from sbxnet.app.bench.plan import ARMS, QUICK, schedule, supports, workloads

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("/usr/bin/curl", "/usr/bin/h2load")


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR, after checking the signature and the chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:29]
    (crc,) = struct.unpack(">I", data[29:33])
    assert zlib.crc32(kind + body) == crc
    assert data.endswith(b"IEND\xaeB`\x82")
    w, h = struct.unpack(">II", body[:8])
    return w, h


@pytest.mark.timeout(170)
def test_quick_mode_writes_every_arm(tmp_path: Path) -> None:
    missing = [t for t in TOOLS if not Path(t).exists()]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian: curl, nghttp2-client)")
    out = tmp_path / "out"
    t0 = time.monotonic()
    # its own process group: if it overruns, its servers (nginx, HAProxy, the hops) go with it
    proc = subprocess.Popen([sys.executable, "-m", "sbxnet.app.cli", "bench", "--quick", "--out", str(out)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"quick mode ran over 150 s: {stdout[-2000:]} {stderr[-2000:]}")
    took = time.monotonic() - t0
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["mode"] == "quick"
    assert result["seconds"] < took
    assert result["functional_only"] == (os.environ.get("SBXNET_IN_VM") == "1")
    for key in ("nproc", "cpu_model", "kernel", "openssl", "haproxy", "nginx"):
        assert result["machine"][key], key
    loads = workloads(QUICK.conns, QUICK.small_conns)
    assert list(result["workloads"]) == [w.key for w in loads]
    assert list(result["arms"]) == list(ARMS)
    running = []
    for key, spec in ARMS.items():
        info = result["arms"][key]
        if "skipped" in info:
            assert info["skipped"].strip(), key
            assert key not in result["summary"]
            continue
        running.append(key)
        for wl in loads:
            figures = result["summary"].get(key, {}).get(wl.key)
            if supports(spec, wl):
                assert figures is None, (key, wl.key)
                continue
            main = "gbps" if wl.kind == "bulk" else "rps"
            assert figures and figures[main]["n"] == QUICK.repeats and figures[main]["median"] > 0, (key, wl.key)
    # the run is the plan: every running arm, every workload it supports, in the interleaved order
    plan = schedule(running, loads, QUICK.repeats)
    assert [(t["rep"], t["workload"], t["arm"]) for t in result["trials"]] == [(r, w.key, a) for r, w, a in plan]
    assert not [t for t in result["trials"] if "error" in t]
    # the kTLS arms run exactly where the probe says the kernel has TLS
    ktls_ok = result["ktls"] == "available"
    assert ("skipped" not in result["arms"]["l4-ktls"]) == ktls_ok
    md = (out / "bench.md").read_text()
    for key in ARMS:
        assert f"`{key}`" in md
    lines = md.splitlines()
    for head, kind in (("| arm | workload | n | GB/s", "bulk"), ("| arm | workload | n | requests/s", "small")):
        header = next(line for line in lines if line.startswith(head))
        keys = {w.key for w in loads if w.kind == kind}
        rows = [line for line in lines if line.startswith("| ") and line.split(" | ")[1] in keys]
        assert len(rows) == sum(1 for a in running for w in loads if w.key in keys and not supports(ARMS[a], w))
        assert all(row.count("|") == header.count("|") for row in rows)
    w, h = png_size((out / "bench.png").read_bytes())
    assert w > 400 and h > 200
    # inside the emulated kernel every figure is marked: the same results rendered as if from there
    result["functional_only"] = True
    marked = report.markdown(result)
    assert report.FUNCTIONAL in marked and marked.count("(functional only) |") == 2
    assert report.FUNCTIONAL not in md or os.environ.get("SBXNET_IN_VM") == "1"


def test_schedule_interleaves_and_leaves_out_what_an_arm_cannot_run() -> None:
    loads = workloads(8, 8)
    plan = schedule(["l7-sbx", "hop-user", "direct-tls"], loads, 2)
    steps: dict[tuple[int, str], list[str]] = {}
    for rep, wl, arm in plan:
        steps.setdefault((rep, wl.key), []).append(arm)
    orders = list(steps.values())
    # one step forwards, the next backwards (over the arms that run that workload)
    for i, order in enumerate(orders):
        full = [a for a in ("l7-sbx", "hop-user", "direct-tls") if a in order]
        assert order == (full if i % 2 == 0 else full[::-1]) or len(order) == 1
    assert all(supports(ARMS[a], wl) is None for _, wl, a in plan)
    assert ("hop-user" in [a for _, wl, a in plan if wl.key == "up-1"])
    assert "hop-user" not in [a for _, wl, a in plan if wl.kind == "small" or wl.direction == "down"]
    assert len(plan) == 2 * (len(loads) * 2 + sum(1 for w in loads if w.direction == "up"))


def test_reframe_drops_hop_by_hop_and_rechunks() -> None:
    head, chunked = reframe(b"PUT /upload HTTP/1.1", [
        (b"Host", b"app"), (b"Connection", b"keep-alive"), (b"Transfer-Encoding", b"chunked"),
        (b"X-Keep", b"1"), (b"keep-alive", b"timeout=5")], [(b"X-Forwarded-For", b"203.0.113.7")])
    assert chunked
    lines = head.split(b"\r\n")
    assert lines[0] == b"PUT /upload HTTP/1.1" and head.endswith(b"\r\n\r\n")
    names = [line.split(b":")[0].lower() for line in lines[1:] if line]
    assert names == [b"host", b"x-keep", b"x-forwarded-for", b"transfer-encoding"]
    head, chunked = reframe(b"HTTP/1.1 200 OK", [(b"Content-Length", b"5")], [])
    assert not chunked and b"Content-Length: 5" in head and b"chunked" not in head
    assert chunk(b"hello") + LAST_CHUNK == b"5\r\nhello\r\n0\r\n\r\n"


@pytest.mark.timeout(60)
def test_l7_hop_streams_a_chunked_upload_and_answers(tmp_path: Path) -> None:
    """A link like the gateway's (mutual TLS, preamble, status) through our L7 hop to the benchmark's app:
    a chunked PUT arrives whole (the app counts it) and the answer comes back on the same link."""
    import ipaddress
    import socket
    import ssl

    from certs.mint import mint_ca, mint_leaf, write_issued
    from sbxnet.protocol.preamble import Preamble, push_preamble

    ca = mint_ca("test CA")
    write_issued(ca, tmp_path, "ca")
    write_issued(mint_leaf(ca, "forwarder", dns=("localhost",), server=True), tmp_path, "forwarder")
    write_issued(mint_leaf(ca, "gateway", uris=("spiffe://t/gateway",), server=False, client=True), tmp_path,
                 "gateway")
    (tmp_path / "www").mkdir()
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    app_port, hop_port = ports
    procs = [subprocess.Popen([sys.executable, "-m", "sbxnet.app.bench.http_app", "--dir", str(tmp_path),
                               "--port", str(app_port)], cwd=ROOT),
             subprocess.Popen([sys.executable, "-m", "sbxnet.app.bench.l7_hop", "--certs", str(tmp_path),
                               "--port", str(hop_port)], cwd=ROOT)]
    try:
        deadline = time.monotonic() + 30
        for port in (app_port, hop_port):
            while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
                assert time.monotonic() < deadline, f"nothing on {port}"
                time.sleep(0.05)
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        ctx.load_cert_chain(str(tmp_path / "gateway.crt"), str(tmp_path / "gateway.key"))
        with socket.create_connection(("127.0.0.1", hop_port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(push_preamble(Preamble(src=ipaddress.ip_address("203.0.113.7"), src_port=4000,
                                               dst=ipaddress.ip_address("127.0.0.1"), dst_port=app_port,
                                               sandbox_id="t")))
            assert tls.recv(4) == b"SX\x01\x00"
            pieces = [os.urandom(n) for n in (1, 70000, 3, 1 << 18)]
            tls.sendall(b"PUT /upload HTTP/1.1\r\nHost: app\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + b"".join(chunk(p) for p in pieces) + LAST_CHUNK)
            got = b""
            while b"\r\n\r\n" not in got or not got.endswith(str(sum(map(len, pieces))).encode()):
                data = tls.recv(65536)
                assert data, got
                got += data
            assert got.startswith(b"HTTP/1.1 200 ")
            assert got.split(b"\r\n\r\n", 1)[1] == str(sum(map(len, pieces))).encode()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_goals_are_ratios_of_the_medians() -> None:
    def cell(median: float) -> dict[str, float]:
        return {"median": median, "min": median / 2, "max": median * 2, "n": 3}

    summary = {
        "l4-user": {"down-1": {"gbps": cell(0.3), "cpu.chain": cell(1.0)}},
        "l7-sbx": {"down-1": {"gbps": cell(0.1), "cpu.chain": cell(2.5)}},
        "hop-user": {"up-1": {"cpu.hop": cell(1.2)}, "up-8": {"cpu.hop": cell(2.0)}},
        "haproxy-tls": {"up-1": {"cpu.hop": cell(1.5)}, "up-8": {"cpu.hop": cell(1.6)}},
    }
    got = {(g["goal"], g["workload"]): g for g in report.goals(summary, 8)}
    speed = got[("L4 userspace / l7-sbx throughput >= 2x", "down-1")]
    assert speed["ratio"] == pytest.approx(3.0) and speed["met"] is True
    cpu = got[("L4 userspace / l7-sbx chain CPU-s/GB <= 0.5x", "down-1")]
    assert cpu["ratio"] == pytest.approx(0.4) and cpu["met"] is True
    per_core = "forwarder hop GB per CPU-s >= HAProxy's (tcp + TLS)"
    assert got[(per_core, "up-1")]["ratio"] == pytest.approx(1.25) and got[(per_core, "up-1")]["met"] is True
    assert got[(per_core, "up-8")]["ratio"] == pytest.approx(0.8) and got[(per_core, "up-8")]["met"] is False
    for key in (("L4 userspace / l7-nginx throughput >= 2x", "down-1"),
                ("L4 kTLS / L4 userspace throughput >= 1.2x", "down-1"),
                ("forwarder hop (ktls) < 0.49 CPU-s/GB", "up-1")):
        assert got[key]["met"] is None and got[key]["why"]


def test_profile_summary_puts_each_sample_in_one_category_per_process() -> None:
    from sbxnet.app.bench import profile

    gw = 'process 1:"python -m sbxnet.app.cli bench";process 7:"python sbxnet gateway --config g.toml"'
    hop = 'process 1:"python -m sbxnet.app.cli bench";process 9:"python -m sbxnet.app.bench.l7_hop --port 1"'
    raw = [
        f"{gw};run (asyncio/runners.py:118);TlsStream._send_pending (sbxnet/tls_stream.py:280);send (libc.so.6) 30",
        f"{gw};SSLObject.read (ssl.py:921);0x7f01 (libcrypto.so.3) 20",
        f"{gw};ReceiveBuffer._extract (h11/_receivebuffer.py:60);0x7f02 (libc.so.6) 10",
        f"{gw};TlsStream._fill (sbxnet/tls_stream.py:170);0x7f03 (libc.so.6) 15",
        f"{gw};H1Session._exchange (gateway/http1.py:584) 25",
        f"{hop};run (asyncio/runners.py:118);epoll_pwait (libc.so.6) 4",
        f"{hop};run (asyncio/runners.py:118);read (libc.so.6) 6",
        'process 1:"python -m sbxnet.app.cli bench";main (sbxnet/app/bench/run.py:90) 99',
        "not a stack line",
    ]
    s = profile.summarize(raw)
    assert set(s) == {"gateway", "l7 hop"}
    c = profile.CATEGORIES
    assert s["gateway"] == {c[0]: 30, c[1]: 20, c[2]: 10, c[4]: 15, c[5]: 25}
    assert s["l7 hop"] == {c[3]: 4, c[0]: 6}
    rows = profile.table(s).splitlines()
    assert rows[0] == "| category | gateway | l7 hop |"
    assert f"| {c[0]} | 30.0% | 60.0% |" in rows and rows[-1] == "| samples | 100 | 10 |"
