"""The scheduler's HTTP API end to end (docs/scheduler-api.md): a real ``SchedulerService`` and ``Api`` over
real TLS on loopback on a real SQLite file, called as the platform (bearer token), the gateway and a
forwarder (client certificates), with a real webhook receiver as the platform's driver."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from sched_support import (
    ADMIN,
    Client,
    Platform,
    SchedulerApp,
    mint_pki,
    registration,
    wait_for,
)

from sbxnet.protocol.routes import pull_route
from scheduler.sqlite_store import SqliteStore


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return mint_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def sched(pki: dict[str, Path], tmp_path: Path) -> AsyncIterator[tuple[SchedulerApp, Client]]:
    fds = len(os.listdir("/proc/self/fd"))
    app = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), pki).start()
    client = Client(app)
    yield app, client
    await client.close()
    await app.stop()
    await asyncio.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= fds, "descriptors leaked"
    assert len(asyncio.all_tasks()) == 1, asyncio.all_tasks()


# -- who may call what --------------------------------------------------------------------------


async def test_registry_needs_the_admin_token(sched: tuple[SchedulerApp, Client]) -> None:
    _, c = sched
    status, headers, _ = await c.call("PUT", "/v1/sandboxes/sbx-1", body=registration())
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    status, _, text = await c.call("PUT", "/v1/sandboxes/sbx-1", body=registration(),
                                   headers={"Authorization": "Bearer not-it"})
    assert status == 403 and "wrong token" in text
    # A gateway certificate is not an admin credential.
    status, _, _ = await c.call("GET", "/v1/sandboxes", as_="gateway")
    assert status == 401
    assert c.app.api is not None and c.app.api.refused == {"no_credentials": 2, "wrong_token": 1}


async def test_route_lookup_is_the_gateways(sched: tuple[SchedulerApp, Client]) -> None:
    _, c = sched
    assert (await c.admin("PUT", "/v1/sandboxes/sbx-1", registration()))[0] == 201
    status, headers, doc = await c.call("GET", "/v1/routes/sbx-1", as_="gateway")
    assert status == 200 and headers["Cache-Control"] == "max-age=2"
    route = pull_route(json.dumps(doc).encode())
    assert (route.sandbox, route.state, str(route.target_ip), route.forwarder.address) == (
        "sbx-1", "active", "10.200.1.5", "10.0.3.7:8443")
    assert "idle_period_s" not in doc and "activity" not in doc
    status, headers, doc = await c.call("GET", "/v1/routes/nope", as_="gateway")
    assert (status, doc, headers["Cache-Control"]) == (404, {"error": "unknown sandbox"}, "max-age=1")
    # A forwarder's certificate is from the right CA but not a gateway's.
    status, _, _ = await c.call("GET", "/v1/routes/sbx-1", as_="forwarder")
    assert status == 403
    status, _, _ = await c.call("GET", "/v1/routes/sbx-1")
    assert status == 401


async def test_a_certificate_from_another_ca_fails_the_handshake(sched: tuple[SchedulerApp, Client]) -> None:
    _, c = sched
    # TLS 1.3: the client finishes first, so the refusal shows as a failed handshake or a dropped connection.
    with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
        await c.call("GET", "/v1/routes/sbx-1", as_="foreign")


# -- the registry -------------------------------------------------------------------------------


async def test_register_replace_list_and_remove(sched: tuple[SchedulerApp, Client]) -> None:
    _, c = sched
    assert await c.admin("PUT", "/v1/sandboxes/sbx-1", registration()) == (
        201, {"sandbox": "sbx-1", "incarnation": "inc-1", "state": "active"})
    assert (await c.admin("PUT", "/v1/sandboxes/sbx-1", registration(idle_period_s=60)))[0] == 200
    assert (await c.admin("PUT", "/v1/sandboxes/sbx-2", registration()))[0] == 201
    status, doc = await c.admin("GET", "/v1/sandboxes")
    assert status == 200 and [r["sandbox"] for r in doc["sandboxes"]] == ["sbx-1", "sbx-2"]
    row = doc["sandboxes"][0]
    assert set(row) == {"sandbox", "incarnation", "state", "last_activity", "bytes_in", "bytes_out",
                        "open_connections", "hold_until", "idle_in_s", "idle_blocked"}
    assert row["idle_blocked"] is None  # its forwarder's feed is live (SchedulerApp's)
    assert 55 < row["idle_in_s"] <= 60  # the new period took effect
    assert await c.admin("DELETE", "/v1/sandboxes/sbx-2") == (200, {"sandbox": "sbx-2", "removed": True})
    assert (await c.admin("DELETE", "/v1/sandboxes/sbx-2"))[0] == 404
    assert (await c.call("GET", "/v1/routes/sbx-2", as_="gateway"))[0] == 404


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("/v1/sandboxes/sbx-1", {**registration(), "idle_period": 5}, "unknown_field"),
        ("/v1/sandboxes/sbx-1", {**registration(), "idle_period_s": -1}, "bad_number"),
        ("/v1/sandboxes/sbx-1", registration(auth="token", token_sha256="xyz"), "bad_token_hash"),
        ("/v1/sandboxes/8080-x", registration(), "bad sandbox id"),
        ("/v1/sandboxes/UPPER", registration(), "bad sandbox id"),
    ],
)
async def test_bad_registrations_are_refused_with_the_reason(
    sched: tuple[SchedulerApp, Client], path: str, body: object, reason: str
) -> None:
    _, c = sched
    status, doc = await c.admin("PUT", path, body)
    assert status == 400 and reason in doc["error"]
    assert (await c.admin("GET", "/v1/sandboxes"))[1] == {"sandboxes": []}


async def test_not_json_and_oversized_bodies(sched: tuple[SchedulerApp, Client]) -> None:
    _, c = sched
    status, _, doc = await c.call("PUT", "/v1/sandboxes/sbx-1", headers=ADMIN, raw=b"{not json")
    assert status == 400 and "not_json" in doc["error"]
    status, _, _ = await c.call("PUT", "/v1/sandboxes/sbx-1", headers=ADMIN, raw=b" " * (70 * 1024))
    assert status == 413


# -- holds --------------------------------------------------------------------------------------


async def test_hold_is_extend_only_and_keeps_the_sandbox_active(sched: tuple[SchedulerApp, Client]) -> None:
    app, c = sched
    await c.admin("PUT", "/v1/sandboxes/sbx-1", registration(idle_period_s=0.3))
    status, doc = await c.admin("POST", "/v1/sandboxes/sbx-1/hold", {"ttl_s": 1.0, "reason": "batch job"})
    assert status == 200
    until = doc["hold_until"]
    assert (await c.admin("POST", "/v1/sandboxes/sbx-1/hold", {"ttl_s": 0.1}))[1] == {"hold_until": until}
    await asyncio.sleep(0.9)  # past the idle period, inside the hold
    assert (await c.admin("GET", "/v1/sandboxes/sbx-1"))[1]["state"] == "active"
    assert app.service is not None
    await wait_for(lambda: app.state("sbx-1") == "idle", 5.0, "idle after the hold")
    assert app.store is not None
    idle = [e.event for e in app.store.events_after(0) if e.event.to_state == "idle"]
    # The period runs from the hold's end, so the idle event is no earlier than hold end + period.
    assert len(idle) == 1 and idle[0].at >= until + 0.3 - 1e-6
    for body, why in (({"ttl_s": 0}, "ttl_s"), ({"ttl_s": "5"}, "wrong type"), ({"ttl": 5}, "unknown field"),
                      ({}, "missing field")):
        status, doc = await c.admin("POST", "/v1/sandboxes/sbx-1/hold", body)
        assert status == 400 and why in doc["error"], (body, doc)
    assert (await c.admin("POST", "/v1/sandboxes/nope/hold", {"ttl_s": 5}))[0] == 404


# -- idle timers, events and the webhook ---------------------------------------------------------


async def test_idle_event_on_the_stream_and_the_webhook(pki: dict[str, Path], tmp_path: Path) -> None:
    platform = await Platform().start()
    secret = b"webhook-secret"
    app = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), pki, webhook_url=platform.url,
                             webhook_secret=secret).start()
    c = Client(app)
    try:
        await c.admin("PUT", "/v1/sandboxes/sbx-1", registration(idle_period_s=0.4))
        registered = time.time()
        seen: list[dict[str, object]] = []
        async with c.session().get(app.url + "/v1/events", headers=ADMIN) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            async for line in resp.content:
                if line.startswith(b"data: "):
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["to"] == "idle":
                        break
        assert [(e["from"], e["to"], e["why"]) for e in seen] == [(None, "active", "registered"),
                                                                  ("active", "idle", "idle_timer")]
        assert seen[1]["at"] >= registered + 0.4 - 0.05  # type: ignore[operator]
        await wait_for(lambda: len(platform.events) == 1, 5.0, "the idle webhook")
        ev = platform.events[0]
        assert (ev["sandbox"], ev["to"], ev["id"]) == ("sbx-1", "idle", seen[1]["id"])
        body = json.dumps(ev, separators=(",", ":"), sort_keys=True).encode()
        assert platform.signatures[0] == "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()
        # Resuming the stream after the last id gives nothing old.
        async with c.session().get(app.url + "/v1/events", headers={**ADMIN, "Last-Event-ID": str(ev["id"])},
                                   timeout=aiohttp.ClientTimeout(sock_read=0.5)) as resp:
            with pytest.raises(asyncio.TimeoutError):
                await resp.content.readline()
    finally:
        await c.close()
        await app.stop()
        await platform.stop()


async def test_webhook_retries_until_delivered_in_order(pki: dict[str, Path], tmp_path: Path) -> None:
    platform = await Platform().start()
    platform.fail_next = 3
    app = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), pki, webhook_url=platform.url).start()
    c = Client(app)
    try:
        for sid in ("sbx-1", "sbx-2"):
            await c.admin("PUT", f"/v1/sandboxes/{sid}", registration(idle_period_s=0.2))
        await wait_for(lambda: len(platform.events) == 2, 10.0, "both idle webhooks after the failures")
        assert [e["id"] for e in platform.events] == sorted(e["id"] for e in platform.events)
        assert app.webhook is not None and app.webhook.failures == {"status_500": 3}
        assert app.store is not None and app.store.undelivered_webhooks() == []
    finally:
        await c.close()
        await app.stop()
        await platform.stop()


# -- wake -----------------------------------------------------------------------------------------


async def _idle(app: SchedulerApp, c: Client, sid: str = "sbx-1") -> None:
    """The sandbox idle by its timer, then a long period (the state stays idle): with 0.2 s it would go
    idle again 0.2 s after any wake, and on loaded cores a test's next look could come after that."""
    await c.admin("PUT", f"/v1/sandboxes/{sid}", registration(idle_period_s=0.2))
    assert app.service is not None
    await wait_for(lambda: app.state(sid) == "idle", 5.0, "idle")
    assert (await c.admin("PUT", f"/v1/sandboxes/{sid}", registration(idle_period_s=60)))[0] == 200
    assert app.state(sid) == "idle"


async def test_fifty_wakes_one_driver_start_all_answered_when_ready(pki: dict[str, Path], tmp_path: Path) -> None:
    platform = await Platform().start()
    app = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), pki, webhook_url=platform.url).start()
    c = Client(app)
    starts: list[float] = []

    async def driver(ev: dict[str, object]) -> None:
        if ev["to"] == "waking":
            starts.append(time.monotonic())
            await asyncio.sleep(0.3)  # the sandbox boots
            assert await c.admin("POST", f"/v1/sandboxes/{ev['sandbox']}/driver", {"event": "ready"}) == (
                200, {"state": "active"})

    platform.on_event = driver
    try:
        await _idle(app, c)
        t0 = time.monotonic()
        answers = await asyncio.gather(*(c.call("POST", "/v1/sandboxes/sbx-1/wake?wait=10", as_="gateway")
                                         for _ in range(50)))
        assert {(s, json.dumps(d)) for s, _, d in answers} == {(200, '{"state": "active"}')}
        assert len(starts) == 1 and starts[0] - t0 < 2.0
        assert [e["to"] for e in platform.events] == ["idle", "waking"]
        assert app.service is not None and app.service.counters["driver_starts"] == 1
    finally:
        await c.close()
        await app.stop()
        await platform.stop()


async def test_wake_without_a_driver_is_active_at_once(sched: tuple[SchedulerApp, Client]) -> None:
    app, c = sched
    await _idle(app, c)
    status, _, doc = await c.call("POST", "/v1/sandboxes/sbx-1/wake", as_="gateway")
    assert (status, doc) == (200, {"state": "active"})
    assert [e.event.to_state for e in app.store.events_after(0)] == ["active", "idle", "waking", "active"]
    assert (await c.call("POST", "/v1/sandboxes/nope/wake", as_="gateway"))[0] == 404
    for bad in ("-1", "31", "nan", "soon"):
        assert (await c.call("POST", f"/v1/sandboxes/sbx-1/wake?wait={bad}", as_="gateway"))[0] == 400


async def test_wake_past_its_wait_is_202_and_a_failed_start_502(pki: dict[str, Path], tmp_path: Path) -> None:
    platform = await Platform().start()
    app = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), pki, webhook_url=platform.url).start()
    c = Client(app)
    try:
        await _idle(app, c)
        status, headers, doc = await c.call("POST", "/v1/sandboxes/sbx-1/wake?wait=0.3", as_="gateway")
        assert (status, doc, headers["Retry-After"]) == (202, {"state": "waking"}, "1")

        async def fail_soon() -> None:
            await asyncio.sleep(0.2)
            await c.admin("POST", "/v1/sandboxes/sbx-1/driver", {"event": "failed"})

        task = asyncio.create_task(fail_soon())
        status, _, doc = await c.call("POST", "/v1/sandboxes/sbx-1/wake?wait=5", as_="gateway")
        await task
        assert status == 502 and doc["state"] == "idle"
    finally:
        await c.close()
        await app.stop()
        await platform.stop()


async def test_the_stop_fence(sched: tuple[SchedulerApp, Client]) -> None:
    app, c = sched
    await _idle(app, c)
    assert await c.admin("POST", "/v1/sandboxes/sbx-1/driver", {"event": "stopping"}) == (
        200, {"state": "stopping", "proceed": True})
    # A wake while stopping cancels the stop: the driver, asking again, is told not to proceed.
    assert (await c.call("POST", "/v1/sandboxes/sbx-1/wake", as_="gateway"))[2] == {"state": "active"}
    assert await c.admin("POST", "/v1/sandboxes/sbx-1/driver", {"event": "stopping"}) == (
        200, {"state": "active", "proceed": False})
    status, doc = await c.admin("POST", "/v1/sandboxes/sbx-1/driver", {"event": "paused"})
    assert status == 400 and "one of" in doc["error"]


# -- state across restarts ----------------------------------------------------------------------


async def test_state_survives_a_restart(pki: dict[str, Path], tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    app = await SchedulerApp(lambda: SqliteStore(db), pki).start()
    c = Client(app)
    await c.admin("PUT", "/v1/sandboxes/sbx-1", registration(idle_period_s=0.2))
    await c.admin("PUT", "/v1/sandboxes/sbx-2", registration(idle_period_s=300))
    hold = (await c.admin("POST", "/v1/sandboxes/sbx-2/hold", {"ttl_s": 600}))[1]["hold_until"]
    assert app.service is not None
    await wait_for(lambda: app.state("sbx-1") == "idle", 5.0, "idle")
    await c.close()
    await app.stop()
    app = await SchedulerApp(lambda: SqliteStore(db), pki, port=app.port).start()
    c = Client(app)
    try:
        rows = {r["sandbox"]: r for r in (await c.admin("GET", "/v1/sandboxes"))[1]["sandboxes"]}
        assert rows["sbx-1"]["state"] == "idle" and rows["sbx-2"]["hold_until"] == hold
    finally:
        await c.close()
        await app.stop()
