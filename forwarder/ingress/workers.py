"""Several forwarder processes on one port (SO_REUSEPORT), under one supervisor.

The supervisor checks that nobody else holds the port (a bind without SO_REUSEPORT: another program
using SO_REUSEPORT could otherwise silently take a share of our connections), starts the workers,
serves the ops endpoints with metrics summed over the workers (prometheus_client's multiprocess mode),
forwards SIGHUP, turns SIGTERM into a drain of every worker, and restarts a worker that dies.

Worker ``i`` (0..workers-1) reports on the idle feed's stream ``i``; a worker started in place of one that
died takes its index, so the stream goes on under a new epoch (docs/scheduler-api.md, "The idle feed").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from forwarder.ingress.settings import ForwarderSettings

log = logging.getLogger("sbxnet.forwarder")
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_PER_WINDOW = 5


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


def supervise(settings: ForwarderSettings, workers: int) -> int:
    host = str(settings.listen_host)
    why = port_is_free(host, settings.listen_port)
    if why:
        print(
            f"forwarder: cannot listen on {host}:{settings.listen_port}: {why} (another process holds it; "
            f"stop it, or choose another port with listen_port / SBXNET_FORWARDER_LISTEN_PORT)",
            file=sys.stderr,
        )
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="sbxnet-metrics-")
    # prometheus_client picks its value store when first imported: set the directory before that,
    # here and (inherited) in every worker.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    if "prometheus_client" in sys.modules:
        log.warning("prometheus_client imported before the supervisor; worker metrics may not be summed")
    try:
        import uvloop

        return uvloop.run(_Supervisor(settings, workers, metrics_dir).run())
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _Supervisor:
    def __init__(self, settings: ForwarderSettings, n: int, metrics_dir: str) -> None:
        self.settings = settings
        self.n = n
        self.metrics_dir = metrics_dir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.index: dict[int, int] = {}  # pid -> the worker's index (its feed stream)
        self.restarts: list[float] = []
        self.stopping = False

    def _spawn(self, index: int) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forwarder.ingress.worker", str(index)], stdin=subprocess.PIPE
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(self.settings.model_dump(mode="json")).encode())
        proc.stdin.close()
        self.procs[proc.pid] = proc
        self.index[proc.pid] = index
        log.info("worker started", extra={"event": "worker_started", "pid": proc.pid, "fields": {"index": index}})

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
        s = self.settings
        if s.metrics_port:
            ops = OpsServer(lambda: generate_latest(registry), self._ready)
            try:
                await ops.start(str(s.metrics_host), s.metrics_port)
            except OSError as e:
                print(
                    f"forwarder: cannot serve /metrics on {s.metrics_host}:{s.metrics_port}: {e.strerror}",
                    file=sys.stderr,
                )
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
                log.error("worker exited", extra={"event": "worker_exited", "pid": pid, "fields": {"code": code}})
                if code == 1 and not self.restarts[:-1]:
                    # A worker that cannot even start (port taken, bad material) will not do better
                    # on a restart: stop everything and say so.
                    stop.set()
                    rc = 1
                elif len(self.restarts) > MAX_RESTARTS_PER_WINDOW:
                    log.error("workers keep dying; giving up", extra={"event": "supervisor_giving_up"})
                    stop.set()
                    rc = 1
                else:
                    self._spawn(index)
        self.stopping = True
        self._signal_all(signal.SIGTERM)
        # A worker drains, then makes its last feed report (bounded by feed_request_timeout).
        deadline = time.monotonic() + s.drain_timeout + (s.feed_request_timeout if s.feed_url else 0) + 5
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        if ops:
            await ops.close()
        return rc
