"""The router's Prometheus metrics, read from its own counters when scraped.

The packet path counts in plain ints and ``Counter``s (a Prometheus child's ``inc`` per frame would cost
more than the frame); this collector turns them into metric families at scrape time, so a scrape costs
one pass over the armed claims and the hot path pays nothing. Labels are fixed tokens (reasons, the
direction) and the claim id. A claim's series go away when it is disarmed; its audit records and
usage events (``audit.py``) are what keeps account of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from forwarder.egress.router.daemon import Router

P = "sbxnet_egress_"


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r = self.router
        frames = CounterMetricFamily(P + "frames", "Guest frames accepted (out) and delivery frames written "
                                     "toward guests (in), per claim", labels=["claim", "direction"])
        packets = CounterMetricFamily(P + "packets", "Wire packets of those frames, per claim",
                                      labels=["claim", "direction"])
        nbytes = CounterMetricFamily(P + "bytes", "Inner IPv4 bytes on the wire, per claim",
                                     labels=["claim", "direction"])
        drops = CounterMetricFamily(P + "drops", "Frames dropped per claim, by reason (the validator's, the "
                                    "limits', the stream's, disabled, no_flow, resume_<reason>, ...)",
                                    labels=["claim", "reason"])
        refusals = CounterMetricFamily(P + "flow_refusals", "Flows' first packets refused, by reason",
                                       labels=["claim", "reason"])
        flows = GaugeMetricFamily(P + "flows", "Flows open now, per claim", labels=["claim"])
        opened = CounterMetricFamily(P + "flows_opened", "Flows opened, per claim (resumed: by an inbound "
                                     "segment after a re-arm)", labels=["claim", "how"])
        quota = GaugeMetricFamily(P + "quota_used_bytes", "Wire bytes charged to the claim's quota",
                                  labels=["claim"])
        enabled = GaugeMetricFamily(P + "claim_enabled", "1 while the claim's packet path is on", labels=["claim"])
        for cid, p in r.paths.items():
            for direction, c in (("out", p.sent), ("in", p.received)):
                frames.add_metric([cid, direction], c.frames)
                packets.add_metric([cid, direction], c.packets)
                nbytes.add_metric([cid, direction], c.bytes)
            for reason, n in sorted(p.drops.items()):
                drops.add_metric([cid, reason], n)
            for reason, n in sorted(p.flows.refusals.items()):
                refusals.add_metric([cid, reason], n)
            flows.add_metric([cid], len(p.flows))
            opened.add_metric([cid, "resumed"], p.resumed)
            opened.add_metric([cid, "outbound"], p.flows.opened - p.resumed)
            quota.add_metric([cid], p.limits.bytes_used)
            enabled.add_metric([cid], 1 if p.enabled else 0)
        yield from (frames, packets, nbytes, drops, refusals, flows, opened, quota, enabled)

        claims = GaugeMetricFamily(P + "claims", "Claims armed here")
        claims.add_metric([], len(r.paths))
        yield claims
        streams = GaugeMetricFamily(P + "guest_streams", "Guest streams connected now")
        streams.add_metric([], len(r.streams))
        yield streams
        sock = r.vx.counts if r.vx is not None else {}
        dgrams = CounterMetricFamily(P + "datagrams", "VXLAN datagrams received and sent", labels=["direction"])
        dgrams.add_metric(["in"], sock.get("datagrams_in", 0))
        dgrams.add_metric(["out"], sock.get("datagrams_out", 0))
        yield dgrams
        socket = CounterMetricFamily(P + "socket_events", "The VXLAN socket's other counters", labels=["event"])
        for event, n in sorted(sock.items()):
            if event not in ("datagrams_in", "datagrams_out"):
                socket.add_metric([event], n)
        yield socket
        inbound = CounterMetricFamily(P + "inbound_drops", "Datagrams from the exit side dropped before any "
                                      "claim's path, by reason", labels=["reason"])
        for reason, n in sorted(r.inbound.drops.items()):
            inbound.add_metric([reason], n)
        yield inbound
        arp = CounterMetricFamily(P + "arp", "ARP: requests answered, gratuitous announcements sent",
                                  labels=["kind"])
        arp.add_metric(["answered"], r.inbound.arp_answered)
        arp.add_metric(["gratuitous"], r.counts.get("garp_sent", 0))
        yield arp
        router = CounterMetricFamily(P + "router_events", "The daemon's other counters (streams opened and "
                                     "replaced, ...)", labels=["event"])
        for event, n in sorted(r.counts.items()):
            if event not in ("garp_sent", "arp_replies"):
                router.add_metric([event], n)
        yield router


def registry_for(router: Router) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(RouterCollector(router))
    return reg
