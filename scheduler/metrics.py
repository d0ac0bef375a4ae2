"""The scheduler's Prometheus metrics, read from the service's counters at scrape time (a collector, so
the hot paths only bump plain integers). A scrape reads no store and no core: the counts by state are
the ones the timer loop took last on the store thread (``SchedulerService.state_counts``, at most a
second or so old)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.api_http import Api
from scheduler.timers import State
from scheduler.webhook import WebhookSender


class SchedulerCollector(Collector):
    def __init__(self, api: Api, webhook: WebhookSender | None) -> None:
        self.api = api
        self.webhook = webhook

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        service = self.api.service
        feed = service.feed
        states = GaugeMetricFamily("sbxnet_scheduler_sandboxes", "Registered sandboxes by state", labels=["state"])
        counts = {s.value: 0 for s in State}
        counts.update(service.state_counts)
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states
        c = CounterMetricFamily("sbxnet_scheduler_operations", "Service operations by kind", labels=["kind"])
        for kind, n in service.counters.items():
            c.add_metric([kind], n)
        yield c
        f = CounterMetricFamily("sbxnet_scheduler_feed_batches", "Feed batches answered by verdict",
                                labels=["verdict"])
        for verdict, n in feed.answered.items():
            f.add_metric([verdict], n)
        yield f
        r = CounterMetricFamily("sbxnet_scheduler_refused", "Requests refused by reason", labels=["reason"])
        for reason, n in {**{f"feed_{k}": v for k, v in feed.forbidden.items()},
                          **{f"feed_{k}": v for k, v in feed.refused.items()},
                          **self.api.refused}.items():
            r.add_metric([reason], n)
        yield r
        core = CounterMetricFamily("sbxnet_scheduler_reports_dropped", "Feed entries dropped", labels=["reason"])
        for reason, n in service.core.counters.items():
            core.add_metric([reason], n)
        yield core
        if self.webhook is not None:
            w = CounterMetricFamily("sbxnet_scheduler_webhook", "Webhook deliveries", labels=["result"])
            w.add_metric(["delivered"], self.webhook.delivered)
            for reason, n in self.webhook.failures.items():
                w.add_metric([f"failed_{reason}"], n)
            yield w


def registry_for(api: Api, webhook: WebhookSender | None) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(SchedulerCollector(api, webhook))
    return reg
