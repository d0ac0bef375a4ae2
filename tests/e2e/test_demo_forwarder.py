"""`sbxnet demo-forwarder`, the link-level demo: it must keep working and keep telling the truth."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_the_real_path_and_reports_it() -> None:
    r = subprocess.run([sys.executable, "-m", "sbxnet.app.cli", "demo-forwarder", "--mib", "4"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "status OK; the sandbox answered: 'hello from the sandbox'" in out
    assert "upload   sha256 at the sandbox matches" in out
    assert "download sha256 at the gateway matches" in out
    assert "target cloud metadata 169.254.169.254:80: status FORBIDDEN" in out
    assert "a sandbox that never listens: status NOT_LISTENING" in out
    assert "a client certificate off the allowlist: status FORBIDDEN" in out
    assert "HTTP instead of a preamble: status BAD_PREAMBLE" in out
    assert "a forwarder whose key is not the pinned one: the client hangs up before sending a byte" in out
    assert 'sbxnet_forwarder_connections_total{outcome="closed"} 3.0' in out
    assert "drained and exited with 0" in out
