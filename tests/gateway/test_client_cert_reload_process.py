"""The gateway's own client certificates on SIGHUP (issue 22 point 12): the link's (``upstream_*``, presented
to forwarders) and the scheduler client's (``scheduler_*``) are parts of the one all-or-nothing reload, as
docs/gateway.md says. The scheduler, a forwarder and the gateway as processes, certificates from ``sbxnet
certs``, routes registered through the scheduler's API (``test_key_rotation_process.Deployment``).

Each certificate is replaced in turn by one its peer refuses (a SAN not on the forwarder's
``client_san_allow``, or not on the scheduler's ``gateway_san_allow``), by a renewed good one, and by a broken
file: after each SIGHUP one outcome line, and new requests show which certificate the gateway now presents
(the peer's own refusal line names the refused one's SAN)."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_key_rotation_process import TRUST, Daemon, Deployment, certs

OUTCOMES = ("reloaded", "reload_failed")
INTRUDER = f"spiffe://{TRUST}/intruder"  # a SAN on no allowlist


def hup(gateway: Daemon, timeout: float = 30) -> dict[str, Any]:
    """SIGHUP, then its outcome line; and no second line for it."""
    seen = len(gateway.events("reloaded")) + len(gateway.events("reload_failed"))
    gateway.p.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while len(lines := sorted(gateway.events("reloaded") + gateway.events("reload_failed"),
                              key=lambda r: float(r["ts"]))) <= seen:
        assert gateway.p.poll() is None, "".join(gateway.lines)[-3000:]
        assert time.monotonic() < deadline, "".join(gateway.lines)[-3000:]
        time.sleep(0.02)
    time.sleep(0.2)
    assert len(gateway.events("reloaded")) + len(gateway.events("reload_failed")) == seen + 1
    return lines[-1]


def install(d: Path, source: str, target: str) -> None:
    """An operator's copy of a minted pair over the pair the gateway is configured with."""
    for ext in ("crt", "key"):
        shutil.copyfile(d / f"{source}.{ext}", d / f"{target}.{ext}")


@pytest.fixture
def link_dep(tmp_path: Path) -> Iterator[Deployment]:
    # With the warm pool: links handshaken before a reload must not be handed out after it.
    dep = Deployment(tmp_path, pool=2, scheduler_client="sched-client")
    try:
        yield dep
    finally:
        dep.stop()


@pytest.fixture
def sched_dep(tmp_path: Path) -> Iterator[Deployment]:
    dep = Deployment(tmp_path, scheduler_client="sched-client")
    # As browsers and curl do: a client that offers no ALPN gets a close when the route cannot be looked
    # up (the gateway cannot tell whether the name is a raw TCP route), an HTTP/1.1 client its 503.
    dep.client_ctx.set_alpn_protocols(["http/1.1"])
    try:
        yield dep
    finally:
        dep.stop()


def test_sighup_reloads_the_link_client_certificate(link_dep: Deployment) -> None:
    dep = link_dep
    d, gw, fwd = dep.d, dep.gateway, dep.forwarder
    pin = certs("pin", str(d / "forwarder.crt")).strip()
    dep.register("a", {"spki_pins": [pin]})
    assert dep.get("a")[0] == 200
    time.sleep(1.5)  # the warm pool filled (its tick is 1 s) with links made with the first certificate
    assert dep.get("a")[0] == 200

    # A certificate the forwarder's client_san_allow refuses: new links present it and are refused.
    certs("gateway", "--dir", str(d), "--name", "intruder", "--uri", INTRUDER)
    install(d, "intruder", "gateway")
    refused_before = len(fwd.events("handshake_refused"))
    line = hup(gw)
    assert line["event"] == "reloaded", line
    assert [dep.get("a")[0] for _ in range(3)] == [502] * 3  # none served on a pooled link of the old one
    refusals = fwd.events("handshake_refused")[refused_before:]
    assert refusals and all(r["reason"] == "san_not_allowed" and INTRUDER in r["peer_sans"] for r in refusals), \
        refusals
    assert "link client certificate" in line["what"], line
    assert {str(d / "gateway.crt"), str(d / "gateway.key"), str(d / "ca.crt")} <= set(line["files"]), line

    # The operator renews the gateway's certificate (a new key, the gateway's SAN): served again.
    certs("gateway", "--dir", str(d))
    line = hup(gw)
    assert line["event"] == "reloaded" and "link client certificate" in line["what"], line
    assert [dep.get("a")[0] for _ in range(3)] == [200] * 3

    # A half-written key: one reload_failed line naming it; the renewed certificate is still presented.
    (d / "gateway.key").write_text("")
    line = hup(gw)
    assert line["event"] == "reload_failed", line
    assert line["what"] == "link client certificate" and line["file"] == str(d / "gateway.key"), line
    assert line["error"] and str(d / "gateway.key") in str(line["msg"]), line
    refused_before = len(fwd.events("handshake_refused"))
    assert [dep.get("a")[0] for _ in range(3)] == [200] * 3
    assert len(fwd.events("handshake_refused")) == refused_before

    gw.stop()
    assert gw.p.returncode == 0
    statuses = [(r["status"], r.get("reason")) for r in gw.events("request") if r.get("sandbox_id") == "a"]
    assert statuses == [(200, None)] * 2 + [(502, "forwarder_forbidden")] * 3 + [(200, None)] * 6, statuses


def test_sighup_reloads_the_scheduler_client_certificate(sched_dep: Deployment) -> None:
    dep = sched_dep
    d, gw, sched = dep.d, dep.gateway, dep.scheduler
    pin = certs("pin", str(d / "forwarder.crt")).strip()
    for name in ("a", "b", "c"):  # each looked up for the first time at its step: no route cached
        dep.register(name, {"spki_pins": [pin]})
    assert dep.get("a")[0] == 200  # the lookup's connection to the scheduler is kept alive

    # A certificate the scheduler's gateway_san_allow refuses: new lookups present it and are refused.
    certs("gateway", "--dir", str(d), "--name", "intruder", "--uri", INTRUDER)
    install(d, "intruder", "sched-client")
    line = hup(gw)
    assert line["event"] == "reloaded", line
    refused_before = len(sched.events("refused"))
    assert dep.get("b")[0] == 503  # the route lookup failed (docs/scheduler-api.md: 403 is not a route)
    refusals = sched.events("refused")[refused_before:]
    assert refusals and all(r["reason"] == "san_not_allowed" and INTRUDER in r["sans"] for r in refusals), refusals
    assert "scheduler client certificate" in line["what"], line
    assert {str(d / "sched-client.crt"), str(d / "sched-client.key")} <= set(line["files"]), line

    # Renewed (a new key, the gateway's SAN): lookups are answered again.
    certs("gateway", "--dir", str(d), "--name", "sched-client")
    line = hup(gw)
    assert line["event"] == "reloaded" and "scheduler client certificate" in line["what"], line
    assert dep.get("b")[0] == 200

    # A truncated certificate: one reload_failed line naming it; the renewed one still presented.
    (d / "sched-client.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    line = hup(gw)
    assert line["event"] == "reload_failed", line
    assert line["what"] == "scheduler client certificate" and line["file"] == str(d / "sched-client.crt"), line
    refused_before = len(sched.events("refused"))
    assert dep.get("c")[0] == 200
    assert len(sched.events("refused")) == refused_before

    gw.stop()
    assert gw.p.returncode == 0
    statuses = [(r.get("sandbox_id"), r["status"]) for r in gw.events("request")]
    assert statuses == [("a", 200), ("b", 503), ("b", 200), ("c", 200)], statuses
