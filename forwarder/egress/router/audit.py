"""Audit records of ended flows and usage events, as JSON lines (docs/egress.md, "Audit and usage").

Each flow that ends (idle for ``flow_idle_timeout``, its claim disabled, disarmed, moved away, or the
daemon stopped cleanly, or a TCP flow ``CLOSE_LINGER`` after its RST or its FIN each way: ``flows.py``)
gives one ``flow`` record: the claim, the 5-tuple (source = the claim's
address), inner IPv4 bytes and wire packets each way, the verdict (``allowed``: opened by the claim's own
packet; ``resumed``: reopened by an inbound segment after a re-arm), start and end (wall clock, seconds)
and why it ended. A flow refused at its first packet (policy, the internal-address guard, the flow cap or
the new-flow rate) gives a ``flow`` record too, verdict ``refused``, with its ``reason``, how many of its
packets were refused in that round (``attempts``: a retransmitted SYN is one more), zero bytes, and
``start``/``end`` its first and last refused packet; past 64 refused tuples a claim in a round (a second)
only a ``refused_suppressed`` record with the count. ``usage`` events carry the egress bytes and packets a
flow sent since its last event: every ``usage_interval`` for each live flow that sent something, and at
its end, so a flow's usage events add up to its record's ``bytes_out``.

Where they go: ``audit_file`` when set, appended (``O_APPEND``, mode 0600) with one ``write`` per batch,
fsynced at a clean stop. A file rather than the log because these are accounting data, written at the
rate flows end, read by machines line by line: they must not depend on the log level or be interleaved
with operational lines, and they are kept for longer. Without ``audit_file`` each goes to the log as
an ``egress_flow`` / ``egress_usage`` line, so nothing is lost on a host that did not configure it.
Record building is pure (``flow_record``, ``usage_record``); ``AuditLog`` is the file adapter.
"""

from __future__ import annotations

import json
import logging
import os
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from forwarder.egress.flows import Flow, FlowKey

log = logging.getLogger("sbxnet.egress.audit")

PROTO_NAMES = {1: "icmp", 6: "tcp", 17: "udp"}


def _tuple(key: FlowKey) -> dict[str, Any]:
    return {"proto": PROTO_NAMES.get(key.proto, str(key.proto)), "src": str(IPv4Address(key.src)),
            "sport": key.sport, "dst": str(IPv4Address(key.dst)), "dport": key.dport}


def usage_record(claim: str, flow: Flow, at: float) -> dict[str, Any] | None:
    """The usage event of what ``flow`` sent since its last one (None if nothing); marks it reported."""
    nbytes, packets = flow.bytes_out - flow.reported_bytes, flow.packets_out - flow.reported_packets
    if nbytes == 0 and packets == 0:
        return None
    flow.reported_bytes, flow.reported_packets = flow.bytes_out, flow.packets_out
    return {"type": "usage", "claim": claim, **_tuple(flow.key), "bytes_out": nbytes, "packets_out": packets,
            "at": round(at, 6)}


def flow_record(claim: str, flow: Flow, why: str, wall_offset: float, now: float) -> dict[str, Any]:
    """The audit record of an ended flow; ``wall_offset`` turns the monotonic times into wall clock."""
    return {"type": "flow", "claim": claim, **_tuple(flow.key), "bytes_out": flow.bytes_out,
            "packets_out": flow.packets_out, "bytes_in": flow.bytes_in, "packets_in": flow.packets_in,
            "verdict": "resumed" if flow.resumed else "allowed", "start": round(flow.start + wall_offset, 6),
            "last": round(flow.last + wall_offset, 6),
            # a closed or reset flow ended with its last packet; the others when the table let them go
            "end": round((flow.last if why in ("closed", "reset") else now) + wall_offset, 6), "ended": why}


def refused_record(claim: str, key: FlowKey, reason: str, attempts: int, first: float, last: float,
                   wall_offset: float) -> dict[str, Any]:
    """The audit record of a flow refused at its first packet (``refusals.RefusalLog`` entry)."""
    return {"type": "flow", "claim": claim, **_tuple(key), "bytes_out": 0, "packets_out": 0, "bytes_in": 0,
            "packets_in": 0, "verdict": "refused", "reason": reason, "attempts": attempts,
            "start": round(first + wall_offset, 6), "last": round(last + wall_offset, 6),
            "end": round(last + wall_offset, 6), "ended": "refused"}


def suppressed_record(claim: str, packets: int, at: float) -> dict[str, Any]:
    """Refused first packets past a round's cap: counted, not listed."""
    return {"type": "refused_suppressed", "claim": claim, "packets": packets, "at": round(at, 6)}


class AuditLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600) if path else -1
        self.written = 0

    def write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        self.written += len(records)
        if self.fd < 0:
            for r in records:
                kind = r["type"]
                log.info("flow ended" if kind == "flow" else "flow usage" if kind == "usage" else "flows refused",
                         extra={"event": f"egress_{kind}", "fields": r})
            return
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
