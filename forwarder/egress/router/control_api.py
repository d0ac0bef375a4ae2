"""The control API: HTTP (aiohttp) on a Unix socket only root can reach.

The socket (``control_socket``) is created mode 0600 in a directory the operator chose, and every request
is also checked by the peer's credentials (``SO_PEERCRED``): uid 0 only, whatever the file's mode became.
Bodies go through ``control_body.py`` (the untrusted-input parser) before the router acts.

| method and path | body | does | answers |
|---|---|---|---|
| ``GET /v1/claims`` | | every armed claim's state and counters | 200 |
| ``GET /v1/claims/{id}`` | | one claim | 200, 404 |
| ``PUT /v1/claims/{id}`` | ``{"uds", "exit", "policy"?, "limits"?}`` | arm (address allocated) | 201, 400, 409, 503 |
| ``DELETE /v1/claims/{id}`` | | disarm; the address is released | 200, 404 |
| ``POST /v1/claims/{id}/disable`` | | revoke the packet path at once | 200, 404 |
| ``POST /v1/claims/{id}/enable`` | | reopen it | 200, 404 |
| ``PUT /v1/claims/{id}/exit`` | ``{"exit": label}`` | send through another exit (announced to it) | 200, 400, 404 |
| ``POST /v1/claims/{id}/export`` | | the claim's state for an import elsewhere; disarmed here | 200, 404 |
| ``POST /v1/import`` | an exported claim | arm it as it was; gratuitous ARP | 201, 400, 409, 503 |
| ``POST /v1/announce`` | | a gratuitous ARP for every claim now (after exits reload) | 200 |
| ``POST /v1/exits/{label}/announce`` | | the same for the claims sent through that exit | 200, 400 |

Every refusal is one line of JSON, ``{"error": reason, "detail": text}``: 400 for a bad body or claim id,
403 for a peer that is not root, 404 for no such claim or route, 405 for a method, 409 for a conflict
(claim armed, socket or address in use, pool exhausted), 503 when the mesh's database is down.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from forwarder.egress.router.addresses import AllocationError
from forwarder.egress.router.control_body import (
    MAX_BODY,
    ControlError,
    check_claim_id,
    pull_arm,
    pull_exit,
    pull_import,
)

if TYPE_CHECKING:
    from forwarder.egress.router.daemon import Router
    from forwarder.egress.router.outbound import ClaimPath

_UCRED = struct.Struct("3i")  # pid, uid, gid
_ALLOCATION_STATUS = {"allocator_unavailable": 503, "outside_pool": 400}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def peer_uid(request: web.Request) -> int | None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(uid)


def _error(status: int, reason: str, detail: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": reason, "detail": detail}) + "\n",
                        content_type="application/json")


def _ok(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(value) + "\n", content_type="application/json")


class ControlServer:
    def __init__(self, router: Router, path: Path) -> None:
        self.router = router
        self.path = Path(path)
        self.refused = 0  # requests from a peer that is not root
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY + 1)
        app.add_routes([
            web.get("/v1/claims", self._list),
            web.get("/v1/claims/{id}", self._get),
            web.put("/v1/claims/{id}", self._arm),
            web.delete("/v1/claims/{id}", self._disarm),
            web.post("/v1/claims/{id}/disable", self._disable),
            web.post("/v1/claims/{id}/enable", self._enable),
            web.put("/v1/claims/{id}/exit", self._exit),
            web.post("/v1/claims/{id}/export", self._export),
            web.post("/v1/import", self._import),
            web.post("/v1/announce", self._announce),
            web.post("/v1/exits/{label}/announce", self._announce),
        ])
        return app

    async def start(self) -> None:
        _remove_stale_socket(self.path)
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        old = os.umask(0o177)  # created 0600: no moment at which another user could connect
        try:
            await web.UnixSite(self._runner, str(self.path)).start()
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # ---------------------------------------------------------------- every request
    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        uid = peer_uid(request)
        if uid != 0:
            self.refused += 1
            return _error(403, "forbidden", "the control API answers root only")
        try:
            return await handler(request)
        except ControlError as e:
            return _error(e.status, e.reason, e.detail)
        except AllocationError as e:
            return _error(_ALLOCATION_STATUS.get(e.reason, 409), e.reason, e.detail)
        except web.HTTPException as e:
            reason = {404: "no_such_route", 405: "method_not_allowed", 413: "too_long"}.get(e.status, "bad_request")
            return _error(e.status, reason, f"{request.method} {request.path[:64]}")
        except OSError as e:  # a claim's socket could not be made (its directory missing, say)
            return _error(409, "socket_failed", e.strerror or str(e))

    @staticmethod
    async def _body(request: web.Request) -> bytes:
        return await request.content.read(MAX_BODY + 1)

    def _claim(self, request: web.Request) -> ClaimPath:
        return self.router.path(check_claim_id(request.match_info["id"]))

    def _view(self, path: ClaimPath) -> dict[str, Any]:
        state = self.router.claim_state(path).model_dump(mode="json")
        state["stats"] = self.router.stats()["claims"][path.id]
        return state

    # ---------------------------------------------------------------- handlers
    async def _list(self, request: web.Request) -> web.Response:
        return _ok({"claims": [self._view(p) for p in self.router.paths.values()]})

    async def _get(self, request: web.Request) -> web.Response:
        return _ok(self._view(self._claim(request)))

    async def _arm(self, request: web.Request) -> web.Response:
        req = pull_arm(request.match_info["id"], await self._body(request))
        return _ok(self._view(await self.router.arm_request(req)), 201)

    async def _disarm(self, request: web.Request) -> web.Response:
        st = await self.router.disarm(self._claim(request).id)
        return _ok(st.model_dump(mode="json"))

    async def _disable(self, request: web.Request) -> web.Response:
        return _ok(self._view(self.router.set_enabled(self._claim(request).id, False)))

    async def _enable(self, request: web.Request) -> web.Response:
        return _ok(self._view(self.router.set_enabled(self._claim(request).id, True)))

    async def _exit(self, request: web.Request) -> web.Response:
        path = self._claim(request)
        label = pull_exit(await self._body(request))
        return _ok(self._view(self.router.set_exit(path.id, label)))

    async def _export(self, request: web.Request) -> web.Response:
        st = await self.router.export(self._claim(request).id)
        return _ok(st.model_dump(mode="json"))

    async def _announce(self, request: web.Request) -> web.Response:
        label = request.match_info.get("label")
        return _ok({"exit": label, "announced": self.router.announce(label)})

    async def _import(self, request: web.Request) -> web.Response:
        st = pull_import(await self._body(request))
        return _ok(self._view(await self.router.import_state(st)), 201)


def _remove_stale_socket(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    os.unlink(path)
