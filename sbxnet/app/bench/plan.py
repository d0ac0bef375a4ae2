"""What the staged benchmark runs: its arms, its workloads, the two modes, and the interleaved order
(plain data, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArmSpec:
    key: str
    stage: str  # "1" L7 two hops, "2" L4 userspace, "3" L4 kTLS + splice, "ref" a reference
    family: str  # "http": a client speaking HTTPS to a front end; "stream": bytes client -> sandbox over one hop
    label: str


ARMS: dict[str, ArmSpec] = {a.key: a for a in (
    ArmSpec("l7-sbx", "1", "http", "L7 two hops: gateway -> sbxnet L7 hop (httptools, uvloop) -> app"),
    ArmSpec("l7-nginx", "1", "http", "L7 two hops, nginx: nginx front -> nginx L7 hop -> app"),
    ArmSpec("l4-user", "2", "http", "L4 userspace: gateway -> forwarder (userspace) -> app"),
    ArmSpec("l4-ktls", "3", "http", "L4 kTLS + splice: gateway -> forwarder (ktls) -> app"),
    ArmSpec("direct-tls", "ref", "http", "direct: TLS 1.3 straight to the app"),
    ArmSpec("hop-user", "ref", "stream", "forwarder hop alone, userspace (mTLS + preamble client -> sink)"),
    ArmSpec("hop-ktls", "ref", "stream", "forwarder hop alone, ktls, N pump threads"),
    ArmSpec("hop-ktls-1t", "ref", "stream", "forwarder hop alone, ktls, 1 pump thread"),
    ArmSpec("haproxy-tls", "ref", "stream", "HAProxy tcp mode terminating TLS 1.3 (mTLS), 256 KiB buffers"),
    ArmSpec("splice", "ref", "stream", "splice pump, plain TCP, N threads"),
    ArmSpec("splice-1t", "ref", "stream", "splice pump, plain TCP, 1 thread"),
    ArmSpec("haproxy-splice", "ref", "stream", "HAProxy tcp mode, plain TCP, splice forced both ways"),
    ArmSpec("direct-tcp", "ref", "stream", "direct: plain TCP client -> sink (the floor)"),
)}


@dataclass(frozen=True)
class Workload:
    key: str
    kind: str  # "bulk" or "small"
    conns: int
    direction: str = ""  # bulk: "down" (app -> client) or "up" (client -> app)
    close: bool = False  # small: a new connection per request
    label: str = ""


def workloads(conns: int, small_conns: int) -> list[Workload]:
    return [
        Workload("down-1", "bulk", 1, "down", label="bulk download, 1 connection"),
        Workload("up-1", "bulk", 1, "up", label="bulk upload, 1 connection"),
        Workload(f"down-{conns}", "bulk", conns, "down", label=f"bulk download, {conns} connections at once"),
        Workload(f"up-{conns}", "bulk", conns, "up", label=f"bulk upload, {conns} connections at once"),
        Workload("ka-1", "small", 1, label="small calls, keep-alive, 1 connection"),
        Workload(f"ka-{small_conns}", "small", small_conns,
                 label=f"small calls, keep-alive, {small_conns} connections"),
        Workload(f"new-{small_conns}", "small", small_conns, close=True,
                 label=f"small calls, a new connection per request, {small_conns} at a time"),
    ]


def supports(arm: ArmSpec, wl: Workload) -> str | None:
    """Why ``arm`` does not run ``wl`` (None: it does)."""
    if arm.family == "stream" and wl.kind == "small":
        return "a byte-stream reference carries no HTTP: small calls are measured on the HTTP arms"
    if arm.family == "stream" and wl.direction == "down":
        return ("the references move bytes client -> sandbox (as bench/forwarder_hop.py and "
                "bench/splice_vs_haproxy.py do); downloads are measured on the HTTP arms")
    return None


@dataclass(frozen=True)
class Mode:
    name: str
    repeats: int
    bulk_bytes: int  # per trial, split over the connections
    conns: int
    small_conns: int
    small_seconds: float  # keep-alive runs
    newconn_requests: int
    small_body: int = 128


QUICK = Mode("quick", repeats=1, bulk_bytes=16 << 20, conns=8, small_conns=8, small_seconds=1.0, newconn_requests=64)
FULL = Mode("full", repeats=3, bulk_bytes=256 << 20, conns=8, small_conns=8, small_seconds=4.0, newconn_requests=300)
MODES = {m.name: m for m in (QUICK, FULL)}


def schedule(arms: list[str], loads: list[Workload], repeats: int) -> list[tuple[int, Workload, str]]:
    """(repetition, workload, arm) in the order they run: every workload runs the arms in turn, the
    next one in reverse (A B C, C B A, A B C, ...), so drift on a shared machine falls on every arm."""
    out: list[tuple[int, Workload, str]] = []
    step = 0
    for rep in range(repeats):
        for wl in loads:
            order = arms if step % 2 == 0 else arms[::-1]
            step += 1
            out.extend((rep, wl, a) for a in order if supports(ARMS[a], wl) is None)
    return out
