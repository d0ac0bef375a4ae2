"""A real browser through the gateway: headless Chromium (Debian's package) and HTTP/2 connection coalescing.

Chromium opens sandbox A's page with ``?token=``, follows the gateway's 303 (which sets the host-only
cookie and drops the parameter), and the page's script then fetches from A (same origin, the cookie) and
from sandbox B's name (public, CORS with credentials so the request keeps the page's connection pool).
``--host-resolver-rules`` maps every sandbox name to 127.0.0.1; the URLs carry the gateway's port (the
303 keeps it), and one wildcard certificate covers both names, so Chromium puts B's request on A's HTTP/2
connection (RFC 9113 9.1.1).

What must hold, from all three sides:

- the DOM: each answer came from its own sandbox program (each answers with its own ID);
- Chromium's NetLog: B's request was a stream of the HTTP/2 session Chromium opened for A's name, answered
  200 there, and B was asked for on no other session (so it was not a 421 and a retry elsewhere);
- the gateway's log: the ``link_open`` lines of A's requests and of B's carry one client ``conn_id``
  (the gateway routed B's stream to B's own route on A's connection), and nothing was refused as
  misdirected.

Chromium trusts the front certificate by its SPKI (``--ignore-certificate-errors-spki-list``, which clears
the certificate errors, so pooling is allowed).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gw_support import DOMAIN, TOKEN, GatewayThread, JsonLines, forwarder_settings, gateway_log, registration
from test_raw_routes import no_leaks
from test_real_clients import StreamApp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki

from certs.loader import spki_pin_of_der

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

PAGE = """<!doctype html>
<html><head><title>coalescing</title></head><body><pre id="result">pending</pre>
<script>
(async () => {
  const out = document.getElementById("result");
  try {
    const a = await (await fetch("/whoami", {credentials: "include", cache: "no-store"})).json();
    const b = await (await fetch("B_URL", {credentials: "include", mode: "cors", cache: "no-store"})).json();
    out.textContent = JSON.stringify({a: a, b: b});
  } catch (e) {
    out.textContent = "error: " + e;
  }
})();
</script></body></html>
"""


@dataclass
class Browser:
    pki: Pki
    fwd: ForwarderThread
    gw: GatewayThread
    alpha: StreamApp
    beta: StreamApp
    log: JsonLines


@pytest.fixture(scope="module")
def browser(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    fwd = ForwarderThread(forwarder_settings(pki))
    alpha = StreamApp("alpha")
    beta = StreamApp("beta")
    routes = tmp_path_factory.mktemp("browser-routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "alpha": registration(pki, fwd.port, {alpha.port: ("http", "token")}, default=alpha.port),
        "beta": registration(pki, fwd.port, {beta.port: ("http", "public")}, default=beta.port),
    }}))
    with gateway_log() as log:
        gw = GatewayThread(pki, routes)
        # The origins carry the gateway's port, known once it listens (before any request comes).
        alpha.page = PAGE.replace("B_URL", f"https://beta.{DOMAIN}:{gw.port}/whoami").encode()
        beta.cors_origin = f"https://alpha.{DOMAIN}:{gw.port}"
        yield Browser(pki, fwd, gw, alpha, beta, log)
        gw.stop()
    fwd.stop()
    alpha.close()
    beta.close()


def h2_streams(netlog: Path) -> list[tuple[str, str, str]]:
    """From a Chromium NetLog: (the host its HTTP/2 session was opened for, a stream's ``:authority``, the
    ``:status`` answered), for every request stream, in order."""
    log = json.loads(netlog.read_text())
    names = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    hosts: dict[int, str] = {}
    pending: dict[tuple[int, int], str] = {}
    out = []
    for e in log["events"]:
        kind, session, params = names.get(e["type"]), e["source"]["id"], e.get("params", {})
        if kind == "HTTP2_SESSION" and "host" in params:
            hosts[session] = params["host"].rsplit(":", 1)[0]
        elif kind == "HTTP2_SESSION_SEND_HEADERS":
            authority = next(h.split(": ", 1)[1] for h in params["headers"] if h.startswith(":authority: "))
            pending[(session, params["stream_id"])] = authority
        elif kind == "HTTP2_SESSION_RECV_HEADERS" and (session, params["stream_id"]) in pending:
            status = next(h.split(": ", 1)[1] for h in params["headers"] if h.startswith(":status: "))
            out.append((hosts[session], pending.pop((session, params["stream_id"])), status))
    return out


@pytest.fixture(autouse=True)
def leak_check(browser: Browser) -> Iterator[None]:
    with no_leaks([browser.gw], [browser.fwd]):
        yield


def front_spki(gw: GatewayThread) -> str:
    """Base64 SHA-256 of the SPKI of the certificate the gateway presents for the sandboxes' names (what
    Chromium is told to trust), read off a handshake."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock, \
            ctx.wrap_socket(sock, server_hostname=f"alpha.{DOMAIN}") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return spki_pin_of_der(der)


def test_chromium_coalesces_two_sandboxes_and_each_answer_comes_from_its_own(browser: Browser,
                                                                            tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian's chromium package; scripts/setup.sh installs it)")
    gw = browser.gw
    misdirected = gw.sample("sbxnet_gateway_refusals_total", {"reason": "misdirected"})
    redirects = gw.sample("sbxnet_gateway_requests_total", {"kind": "http2", "status": "303"})
    start = len(browser.log.lines)
    alpha_seen, beta_seen = len(browser.alpha.requests), len(browser.beta.requests)
    url = f"https://alpha.{DOMAIN}:{gw.port}/?token={TOKEN}"
    r = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-default-browser-check", f"--user-data-dir={tmp_path / 'profile'}",
         # Only the sandboxes' names: Chromium's own background requests (update checks, dictionaries,
         # accounts) would otherwise reach the gateway too.
         f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1,MAP * ~NOTFOUND",
         f"--ignore-certificate-errors-spki-list={front_spki(gw)}", f"--log-net-log={tmp_path / 'netlog.json'}",
         "--virtual-time-budget=15000", "--dump-dom", url],
        capture_output=True, text=True, timeout=90,
    )
    m = re.search(r'<pre id="result">(.*?)</pre>', r.stdout, re.S)
    assert m, f"no page came back: {r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    shown = html.unescape(m.group(1))
    assert shown.startswith("{"), f"the page's script failed: {shown}\n{r.stderr[-3000:]}"
    result = json.loads(shown)

    # Each answer from its own sandbox program; the token went nowhere but the gateway.
    assert result["a"]["sandbox"] == "alpha" and result["a"]["path"] == "/whoami"
    assert result["b"]["sandbox"] == "beta" and result["b"]["path"] == "/whoami"
    assert result["a"]["cookie"] is None and result["b"]["cookie"] is None
    assert gw.sample("sbxnet_gateway_requests_total", {"kind": "http2", "status": "303"}) == redirects + 1
    for app in (browser.alpha, browser.beta):
        assert all(TOKEN not in json.dumps(req) for req in app.requests)
    assert not [q for q in browser.alpha.requests[alpha_seen:] if q["headers"].get("host", "").startswith("beta.")]
    assert [q["path"] for q in browser.beta.requests[beta_seen:]] == ["/whoami"]

    # Chromium's side: B's request went out on the session it had opened for A's name, was answered there,
    # and was not sent again on another session.
    alpha, beta = f"alpha.{DOMAIN}", f"beta.{DOMAIN}"
    streams = h2_streams(tmp_path / "netlog.json")
    assert [(h, s) for h, a, s in streams if a == f"{beta}:{gw.port}"] == [(alpha, "200")], streams

    # The gateway's side: both sandboxes reached from one client connection (its JSON log), none refused.
    links = browser.log.events("link_open", since=start)
    conns = {sbx: {line["conn_id"] for line in links if line.get("sandbox_id") == sbx} for sbx in ("alpha", "beta")}
    assert len(conns["alpha"]) == 1, links  # the navigation, the page, its fetch, the favicon: one connection
    assert conns["beta"] == conns["alpha"], links
    assert len([line for line in links if line.get("sandbox_id") == "beta"]) == 1, links
    assert gw.sample("sbxnet_gateway_refusals_total", {"reason": "misdirected"}) == misdirected, links
