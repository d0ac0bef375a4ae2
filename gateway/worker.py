"""Entry point of one gateway worker process: settings arrive as JSON on stdin from the supervisor
(``sbxnet.supervisor``); the worker's index is the one argument (the gateway does not use it)."""

from __future__ import annotations

import json
import sys

from gateway.run import run_single
from gateway.settings import GatewaySettings
from sbxnet import jsonlog


def main() -> int:
    settings = GatewaySettings(**json.loads(sys.stdin.read()))
    jsonlog.setup(settings.log_level)
    return run_single(settings, reuse_port=True, ops=False)


if __name__ == "__main__":
    sys.exit(main())
