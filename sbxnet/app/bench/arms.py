"""Starting the staged benchmark's arms on loopback, every party its own process, and stopping them.

One sandbox app for every HTTP arm (``http_app``), one sink for every byte-stream reference (the
forwarder-hop runner's), one set of certificates (``Bench.mint``: the CA, the forwarder's, the
gateway's client certificate, the front's). An arm that cannot start here is kept with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sbxnet.app.bench.checkout import CONF, runners
from sbxnet.app.bench.plan import ARMS


@dataclass
class Roles:
    """The processes of one arm, by role: CPU is read per role (``Bench.snap``)."""

    front: list[Any] = field(default_factory=list)
    hop: list[Any] = field(default_factory=list)


def ktls_state() -> tuple[bool, str]:
    from forwarder.ingress.planes.ktls_keys import probe

    r = probe()
    return r.ok, f"{r.cause}: {r.detail}"


def has_pump_threads() -> bool:
    from forwarder.ingress.settings import ForwarderSettings

    return "pump_threads" in ForwarderSettings.model_fields


class Lab:
    """The running arms: ``http`` (Bench arms: a port, front, hop and app processes), ``stream`` (hops
    in front of the sink), ``skipped`` (arm -> why it did not run)."""

    def __init__(self, work: Path, bulk_bytes: int, part_bytes: int, small_bytes: int) -> None:
        self.gvn: Any
        self.fh: Any
        self.svh: Any
        self.gvn, self.fh, self.svh = runners()
        self.work = work
        self.bench = self.gvn.Bench(work, small_bytes, bulk_bytes)
        self.part_bytes = part_bytes
        self.http: dict[str, Any] = {}
        self.stream: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self.ciphers: dict[str, str] = {}
        self.hops: list[Any] = []
        self.sink: Any = None
        self.ktls_ok, self.ktls_why = ktls_state()
        self.pump_threads = has_pump_threads()
        self.threads = os.cpu_count() or 1

    # -- set-up ---------------------------------------------------------------------------------------

    def start(self, keys: list[str]) -> None:
        b = self.bench
        b.mint()
        b.content()
        with (self.work / "www" / "large").open("rb") as src, (self.work / "www" / "part").open("wb") as dst:
            dst.write(src.read(self.part_bytes))
        self.app_port, self.app_tls = self.gvn.free_port(), self.gvn.free_port()
        b.app_port = self.app_port
        b.app = self._process("app", [sys.executable, "-m", "sbxnet.app.bench.http_app", "--dir", str(self.work),
                                      "--port", str(self.app_port), "--tls-port", str(self.app_tls)], self.app_port)
        self.gvn.wait_port(self.app_tls, b.app.proc, b.app.log)
        for key in keys:
            why = self._why_not(key)
            if why:
                self.skipped[key] = why
                continue
            try:
                if ARMS[key].family == "http":
                    arm = self._start_http(key)
                    self.ciphers[key] = b.cipher(arm.port)
                    b.check(arm)
                    self.http[key] = arm
                else:
                    self.stream[key] = self._start_stream(key)
            except (RuntimeError, OSError, subprocess.SubprocessError, AssertionError) as e:
                self.skipped[key] = f"could not start: {str(e)[-600:]}"

    def _why_not(self, key: str) -> str | None:
        if "ktls" in key and not self.ktls_ok:
            return f"this kernel has no TLS (forwarder.ingress.planes.ktls_keys.probe: {self.ktls_why})"
        if key == "hop-ktls-1t" and not self.pump_threads:
            return "the forwarder has no pump_threads setting (one pump thread count only: see hop-ktls)"
        if key in ("l7-nginx",) and not Path(self.gvn.NGINX).exists():
            return f"needs nginx ({self.gvn.NGINX}; Debian: nginx)"
        if key.startswith("haproxy") and not Path(self.fh.HAPROXY).exists():
            return f"needs HAProxy ({self.fh.HAPROXY}; Debian: haproxy)"
        return None

    def _process(self, name: str, cmd: list[str], port: int) -> Any:
        log = self.work / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.work)
        server = self.gvn.Server(name, proc, log)
        self.bench.servers.append(server)
        self.gvn.wait_port(port, proc, log)
        return server

    def _nginx(self, name: str, values: dict[str, str | int], port: int) -> Any:
        return self.bench.nginx(name, values, port, conf_dir=CONF)  # our templates, Bench.nginx's filling

    def _forwarder(self, key: str) -> Any:
        settings: dict[str, Any] = {"data_plane": "ktls" if "ktls" in key else "userspace"}
        if "ktls" in key and self.pump_threads:
            settings["pump_threads"] = 1 if key.endswith("-1t") else self.threads
        hop = self.fh.start_forwarder(key, self.work, self.work, 1,
                                      client_san_allow=[f"spiffe://{self.gvn.TRUST}/gateway"], **settings)
        self.hops.append(hop)
        return hop

    def _gateway(self, key: str, upstream_port: int) -> Any:
        w, gvn = self.work, self.gvn
        routes = w / f"routes-{key}.json"
        routes.write_text(json.dumps({"sandboxes": {gvn.SANDBOX: {
            "incarnation": "i1",
            "forwarder": {"address": f"127.0.0.1:{upstream_port}", "spki_pin": self.bench.pin},
            "target_ip": "127.0.0.1", "default_port": self.app_port,
            "ports": {str(self.app_port): {"protocol": "http", "auth": "public"}},
            "idle_period_s": 3600, "connect_deadline_s": 5}}}))
        port = gvn.free_port()
        proc = self.fh.start_sbxnet("gateway", key, w, {
            "listen_host": "127.0.0.1", "listen_port": port, "metrics_port": 0, "domain": gvn.DOMAIN,
            "cert_files": [w / "front.crt"], "key_files": [w / "front.key"], "routes_file": routes,
            "upstream_cert_file": w / "gateway.crt", "upstream_key_file": w / "gateway.key",
            "upstream_ca_file": w / "ca.crt", "log_level": "warning"}, port)
        server = gvn.Server(f"gateway-{key}", proc, w / f"gateway-{key}.log")
        self.bench.servers.append(server)
        return port, server

    def _start_http(self, key: str) -> Any:
        gvn, app = self.gvn, self.bench.app
        if key == "direct-tls":
            return gvn.Arm(key, self.app_tls, [], [], [app], "the app's own TLS listener")
        if key == "l7-nginx":
            hop_port, front_port = gvn.free_port(), gvn.free_port()
            hop = self._nginx("l7_hop", {"HOP_PORT": hop_port, "APP_PORT": self.app_port}, hop_port)
            front = self._nginx("l7_front", {"FRONT_PORT": front_port, "HOP_PORT": hop_port}, front_port)
            return gvn.Arm(key, front_port, [front], [hop], [app], "nginx http (1 worker) -> nginx http (1 worker)")
        if key == "l7-sbx":
            hop_port = gvn.free_port()
            hop = self._process(f"l7hop-{key}", [sys.executable, "-m", "sbxnet.app.bench.l7_hop", "--certs",
                                                 str(self.work), "--port", str(hop_port)], hop_port)
            port, gw = self._gateway(key, hop_port)
            return gvn.Arm(key, port, [gw], [hop], [app], "gateway -> sbxnet.app.bench.l7_hop")
        fwd = self._forwarder(key)
        port, gw = self._gateway(key, fwd.port)
        server = gvn.Server(f"forwarder-{key}", fwd.proc, self.work / f"forwarder-{key}.log")
        return gvn.Arm(key, port, [gw], [server], [app], f"forwarder {fwd.note}")

    def _start_stream(self, key: str) -> Any:
        fh = self.fh
        if self.sink is None:
            self.sink = fh.start_sink(1 << 20)
        sink_port = self.sink.port
        if key.startswith("hop-"):
            return self._forwarder(key)
        if key == "direct-tcp":
            return fh.Hop(key, sink_port, None, "plain", "no hop")
        if key == "haproxy-tls":
            hop = fh.start_haproxy(key, self.work, self.work, sink_port, 1, 256 << 10, tls=True)
        elif key == "haproxy-splice":
            hop = fh.start_haproxy(key, self.work, self.work, sink_port, 1, 0, tls=False, splice=True)
        else:  # the splice pump, as bench/splice_vs_haproxy.py serves it
            threads = 1 if key.endswith("-1t") else self.threads
            port = fh.free_port()
            proc = subprocess.Popen([sys.executable, str(self.svh.__file__), "--serve-pump", str(port), str(sink_port),
                                     str(threads)])
            fh.wait_port(port, proc)
            hop = fh.Hop(key, port, proc, "plain", f"threads={threads}")
        self.hops.append(hop)
        return hop

    def stop(self) -> None:
        for hop in self.hops:
            hop.stop()
        self.bench.stop()
        if self.sink is not None:
            self.sink.proc.kill()
            self.sink.proc.wait()
