"""256 MiB each way through the router daemon, real kernels on both ends (the namespaces of
test_router_e2e.py), SHA-256 checked on both transfers.

Up: the guest's client streams the seeded bytes and hashes what it sent; the internet's server hashes
what it received and answers the digest, which the client compares. Down: the server streams the seeded
bytes; the guest hashes what it received and compares it with the digest of the stream it asked for.
The daemon's own counters must account for every byte: its bytes out (inner IPv4, wire packets) cover
the upload's payload and its bytes in the download's. The durations are printed (``-s``), measured by
each client's monotonic clock; no bound is put on them, since other jobs share the cores.
"""

from __future__ import annotations

import pytest
from test_router_e2e import CLAIM, HERE, SERVER, Net, _readline, net  # noqa: F401
from test_router_e2e_control import _claim, _daemon, _relay, _stop

from forwarder.egress.router.control_client import call

pytestmark = pytest.mark.netns

SIZE = 256 << 20


def test_256_mib_each_way_with_sha256_checked(net: Net) -> None:  # noqa: F811
    d, ctl = _daemon(net, "h1", "10.77.0.2")
    st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(net.tmp / "vm1.vsock"), "exit": "a"})
    assert st == 201 and body["address"] == CLAIM, body
    server = net.ns_python(net.inet, str(HERE / "e2e_peer.py"), "server", SERVER)
    _readline(server, "ready")
    _relay(net, net.tmp / "vm1.vsock")

    up = net.client("tcp-up", SERVER, str(SIZE), timeout=280)
    assert up["match"] is True, up
    after_up = _claim(ctl)["stats"]
    assert after_up["bytes_out"] > SIZE, after_up
    down = net.client("tcp-down", SERVER, str(SIZE), "31", timeout=280)
    assert down["match"] is True and down["got"] == SIZE, down
    stats = _stop(d)["claims"]["c1"]
    assert stats["bytes_in"] - after_up["bytes_in"] > SIZE, stats
    mbit, t_up, t_down = SIZE * 8 / 1e6, float(str(up["s"])), float(str(down["s"]))
    print(f"\n256 MiB up {t_up:.1f} s ({mbit / t_up:.0f} Mbit/s), down {t_down:.1f} s "
          f"({mbit / t_down:.0f} Mbit/s); drops {stats['drops']}")
