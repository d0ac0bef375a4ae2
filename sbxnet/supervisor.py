"""Several processes of one component on one port (SO_REUSEPORT), under one supervisor.

The supervisor checks that nobody else holds the port (a bind without SO_REUSEPORT: another program
using SO_REUSEPORT could otherwise silently take a share of our connections), starts the workers,
serves the ops endpoints with metrics summed over the workers (prometheus_client's multiprocess mode),
forwards SIGHUP, turns SIGTERM into a drain of every worker, and restarts a worker that dies: at most
``MAX_RESTARTS_PER_WINDOW`` in ``RESTART_WINDOW_S``, and none for a worker that could not even start.
A supervisor that is killed outright takes its workers with it: each gets SIGTERM from the kernel
(``PR_SET_PDEATHSIG``, Linux) and drains.

A worker is ``python -m <worker_module> <index>`` with its settings as JSON on stdin; it binds the port
itself with SO_REUSEPORT and serves no ops endpoints of its own. Worker ``i`` is 0..workers-1, and one
started in place of a worker that died takes its index. Its metrics reach the supervisor through the
directory in ``PROMETHEUS_MULTIPROC_DIR``, which it inherits; a gauge of its must say how it sums over
processes (``multiprocess_mode``), counters and histograms sum by themselves.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

RESTART_WINDOW_S = 60.0
MAX_RESTARTS_PER_WINDOW = 5
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class WorkerPlan:
    """What the supervisor needs to know of a component."""

    component: str  # names its messages ("<component>: cannot listen ...") and its logger (sbxnet.<component>)
    worker_module: str  # each worker runs ``python -m <worker_module> <index>``
    settings_json: str  # written to each worker's stdin
    workers: int
    listen_host: str
    listen_port: int
    port_setting: str  # where the port is set, for the refusal: "listen_port / SBXNET_X_LISTEN_PORT"
    metrics_host: str
    metrics_port: int  # 0: no ops endpoints
    stop_grace: float  # after SIGTERM, how long the workers get to exit before SIGKILL


def port_is_free(host: str, port: int) -> str | None:
    """None if (host, port) can be bound exclusively now, else the reason."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def supervise(plan: WorkerPlan) -> int:
    """Run the workers until SIGTERM or SIGINT, then drain them; 0, or 1 when the port is taken, the ops
    port cannot be had, a worker could not start, or workers kept dying."""
    log = logging.getLogger(f"sbxnet.{plan.component}")
    why = port_is_free(plan.listen_host, plan.listen_port)
    if why:
        print(
            f"{plan.component}: cannot listen on {plan.listen_host}:{plan.listen_port}: {why} (another process "
            f"holds it; stop it, or choose another port with {plan.port_setting})",
            file=sys.stderr,
        )
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="sbxnet-metrics-")
    # prometheus_client picks its value store when first imported: each worker is a new interpreter that
    # finds the directory in its environment before that. The supervisor makes no metric of its own (it
    # reads the workers' files), so whether it imported prometheus_client already does not matter.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        import uvloop

        return uvloop.run(_Supervisor(plan, metrics_dir, log).run())
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _Supervisor:
    def __init__(self, plan: WorkerPlan, metrics_dir: str, log: logging.Logger) -> None:
        self.plan = plan
        self.n = plan.workers
        self.metrics_dir = metrics_dir
        self.log = log
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.index: dict[int, int] = {}  # pid -> the worker's index
        self.restarts: list[float] = []
        self.stopping = False
        self._pid = os.getpid()
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def _spawn(self, index: int) -> None:
        proc = subprocess.Popen([sys.executable, "-m", self.plan.worker_module, str(index)], stdin=subprocess.PIPE,
                                preexec_fn=self._die_with_supervisor)
        assert proc.stdin is not None
        proc.stdin.write(self.plan.settings_json.encode())
        proc.stdin.close()
        self.procs[proc.pid] = proc
        self.index[proc.pid] = index
        self.log.info("worker started",
                      extra={"event": "worker_started", "fields": {"index": index, "worker_pid": proc.pid}})

    def _die_with_supervisor(self) -> None:
        # In the child, between fork and exec: a supervisor killed outright (SIGKILL, the OOM killer) sends
        # its workers no SIGTERM, and orphans would go on holding the port. The kernel sends it instead.
        if self._prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != self._pid:
            os._exit(1)  # no such guard, or the supervisor is already gone

    def _signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(sig)

    def _ready(self) -> bool:
        return not self.stopping and len(self.procs) == self.n and all(p.poll() is None for p in self.procs.values())

    async def run(self) -> int:
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        from sbxnet.ops_http import OpsServer

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.metrics_dir)
        for index in range(self.n):
            self._spawn(index)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: self._signal_all(signal.SIGHUP))
        ops = None
        p = self.plan
        if p.metrics_port:
            ops = OpsServer(lambda: generate_latest(registry), self._ready)
            try:
                await ops.start(p.metrics_host, p.metrics_port)
            except OSError as e:
                print(f"{p.component}: cannot serve /metrics on {p.metrics_host}:{p.metrics_port}: {e.strerror}",
                      file=sys.stderr)
                self._signal_all(signal.SIGTERM)
                return 1
        rc = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except TimeoutError:
                pass
            for pid, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del self.procs[pid]
                index = self.index.pop(pid)
                multiprocess.mark_process_dead(pid, self.metrics_dir)
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
                self.log.error("worker exited", extra={"event": "worker_exited",
                                                       "fields": {"index": index, "worker_pid": pid, "code": code}})
                if code == 1 and not self.restarts[:-1]:
                    # A worker that cannot even start (port taken, bad material) will not do better
                    # on a restart: stop everything and say so.
                    stop.set()
                    rc = 1
                elif len(self.restarts) > MAX_RESTARTS_PER_WINDOW:
                    self.log.error("workers keep dying; giving up", extra={"event": "supervisor_giving_up"})
                    stop.set()
                    rc = 1
                else:
                    self._spawn(index)
        self.stopping = True
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + p.stop_grace
        while any(proc.poll() is None for proc in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        if ops:
            await ops.close()
        return rc
