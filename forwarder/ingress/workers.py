"""Several forwarder processes on one port (SO_REUSEPORT), under one supervisor (``sbxnet.supervisor``:
the port check, the workers, summed metrics, SIGHUP forwarded, SIGTERM a drain of every worker, restarts).

Worker ``i`` (0..workers-1) reports on the idle feed's stream ``i``; a worker started in place of one that
died takes its index, so the stream goes on under a new epoch (docs/scheduler-api.md, "The idle feed").
"""

from __future__ import annotations

import json

from forwarder.ingress.settings import ForwarderSettings
from sbxnet.supervisor import WorkerPlan
from sbxnet.supervisor import supervise as run_workers


def supervise(settings: ForwarderSettings, workers: int) -> int:
    s = settings
    return run_workers(WorkerPlan(
        component="forwarder",
        worker_module="forwarder.ingress.worker",
        settings_json=json.dumps(s.model_dump(mode="json")),
        workers=workers,
        listen_host=str(s.listen_host),
        listen_port=s.listen_port,
        port_setting="listen_port / SBXNET_FORWARDER_LISTEN_PORT",
        metrics_host=str(s.metrics_host),
        metrics_port=s.metrics_port,
        # A worker drains, then makes its last feed report (bounded by feed_request_timeout).
        stop_grace=s.drain_timeout + (s.feed_request_timeout if s.feed_url else 0) + 5,
    ))
