"""The forwarder's Prometheus metrics. One instance per server; labels are fixed, countable tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CONNECT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ForwarderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.connections = Counter(
            "sbxnet_forwarder_connections", "Connections by final outcome", ["outcome"], registry=r
        )
        self.open_connections = Gauge(
            "sbxnet_forwarder_open_connections",
            "Connections being served now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.bytes = Counter(
            "sbxnet_forwarder_bytes", "Tenant bytes moved (up: gateway to sandbox)", ["direction"], registry=r
        )
        self.handshake_rejects = Counter(
            "sbxnet_forwarder_handshake_rejects", "TLS handshakes refused, by reason", ["reason"], registry=r
        )
        self.preamble_rejects = Counter(
            "sbxnet_forwarder_preamble_rejects", "Preambles refused, by reason", ["reason"], registry=r
        )
        self.target_rejects = Counter(
            "sbxnet_forwarder_target_rejects", "Preamble targets refused, by reason", ["reason"], registry=r
        )
        self.connect_attempts = Counter(
            "sbxnet_forwarder_connect_attempts", "TCP connect attempts to sandboxes", registry=r
        )
        self.connect_latency = Histogram(
            "sbxnet_forwarder_connect_seconds",
            "Time to connect to the sandbox, retries included",
            ["result"],
            buckets=CONNECT_BUCKETS,
            registry=r,
        )
        self.data_plane = Gauge(
            "sbxnet_forwarder_data_plane",
            "Data plane serving (1 = in use)",
            ["plane"],
            registry=r,
            multiprocess_mode="max",
        )
        self.plane_ends = Counter(
            "sbxnet_forwarder_plane_ends",
            "Why the data plane ended connections (kTLS: close_notify, tls_key_update, tls_decrypt_error, ...)",
            ["plane", "reason"],
            registry=r,
        )
        self.plane_refusals = Counter(
            "sbxnet_forwarder_plane_refusals",
            "Connections the data plane refused to take over (kTLS key installation), by reason",
            ["plane", "reason"],
            registry=r,
        )
        self.truncated = Counter(
            "sbxnet_forwarder_truncated",
            "Connections whose gateway direction ended without close_notify, so the sandbox was reset rather "
            "than shown a clean end of stream: by plane and how the gateway side ended (fin: a TCP FIN, or one "
            "inside a record; reset)",
            ["plane", "end"],
            registry=r,
        )
        self.reloads = Counter("sbxnet_forwarder_cert_reloads", "Certificate reloads by result", ["result"], registry=r)
        # The idle feed (feed_reporter.py). Each worker reports on its own stream; the gauges sum (or take
        # the largest) over the live workers.
        self.feed_posts = Counter(
            "sbxnet_forwarder_feed_posts",
            "Feed POSTs by result: ok, replay, gap, stale_epoch, mismatch, or why it failed (timeout, connect, "
            "tls, http_<status>, bad_answer_<reason>, stopped)",
            ["result"],
            registry=r,
        )
        self.feed_resends = Counter(
            "sbxnet_forwarder_feed_resends",
            "Feed POSTs that resent a batch already sent (after a failure: the same epoch, seq and body)",
            registry=r,
        )
        self.feed_lag = Gauge(
            "sbxnet_forwarder_feed_lag_seconds",
            "Age of the oldest delta the scheduler has not acknowledged (0: all acknowledged)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.feed_pending = Gauge(
            "sbxnet_forwarder_feed_pending_sandboxes",
            "Sandboxes with deltas waiting for the next batch (the outbox)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.feed_in_flight = Gauge(
            "sbxnet_forwarder_feed_in_flight_sandboxes",
            "Sandboxes in the batch sent and not yet acknowledged",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.feed_epochs = Counter(
            "sbxnet_forwarder_feed_epochs", "Feed epochs started (one at each start, one after each 409)", registry=r
        )
