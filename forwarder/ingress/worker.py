"""Entry point of one worker process: settings arrive as JSON on stdin from the supervisor, the worker's
index (its stream on the idle feed) as the one argument."""

from __future__ import annotations

import json
import sys

from forwarder.ingress.run import run_single
from forwarder.ingress.settings import ForwarderSettings
from sbxnet import jsonlog


def main() -> int:
    settings = ForwarderSettings(**json.loads(sys.stdin.read()))
    jsonlog.setup(settings.log_level)
    return run_single(settings, reuse_port=True, ops=False, stream=int(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
