"""JSON lines logging. Context (sandbox_id, conn_id, peer, reason) travels as ``extra=``; secrets never do."""

from __future__ import annotations

import json
import logging
import sys
import time

_CONTEXT_KEYS = (
    "component", "sandbox_id", "conn_id", "gateway_conn_id", "peer", "reason", "target", "event", "plane",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        for key in _CONTEXT_KEYS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = value
        extra = record.__dict__.get("fields")
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "info", stream: object = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
