"""The README's first command ends in `sbxnet demo`: the whole chain (scheduler, forwarder, gateway, sample
sandboxes) as processes on loopback. It must keep working and keep telling the truth."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_the_chain_and_reports_it() -> None:
    r = subprocess.run([sys.executable, "-m", "sbxnet.app.cli", "demo", "--mib", "8"], capture_output=True,
                       text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "demo: every step did what it should" in out
    for label, code in [("GET https://web.demo.test/ (HTTP/2)", "200 HTTP/2"),
                        ("GET https://web.demo.test/ (HTTP/1.1)", "200 HTTP/1.1"),
                        ("GET https://nobody.demo.test/ (unknown sandbox)", "404"),
                        ("SNI web, Host: vault.demo.test", "421"),
                        ("GET https://vault.demo.test/ without a token", "401"),
                        ("GET https://vault.demo.test/ with a wrong token", "403"),
                        ("GET https://vault.demo.test/?token=... (a browser)", "303"),
                        ("GET https://sleepy.demo.test/again (wakes it)", "200")]:
        assert re.search(re.escape(label) + r"\s+" + re.escape(code), out), label
    assert "download: 200, 8 MiB, sha256 matches" in out
    assert "upload:   200, 8 MiB, sha256 at the sandbox matches" in out
    assert "100 messages echoed" in out
    assert "server streaming delivered 1000 messages" in out
    assert "echoed back (routed by SNI alone, no ALPN)" in out
    assert re.search(r"stopped -> waking\s+\(wake\)", out) and re.search(r"waking -> active\s+\(driver\)", out)
    assert re.search(r"web\s+active", out)  # the status table
    assert "gateway exited 0, forwarder exited 0, scheduler exited 0" in out
