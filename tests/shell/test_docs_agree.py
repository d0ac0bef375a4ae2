"""What docs/gateway.md says the gateway counts is what it counts (issue 22 point 19): the request kinds of
``sbxnet_gateway_requests_total`` in the code (every ``count_request("<kind>", ...)`` and
``requests.labels("<kind>", ...)`` in gateway/) are the ones the Metrics section lists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kinds_in_code() -> set[str]:
    kinds = set()
    for path in (ROOT / "gateway").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            f = node.func
            counted = f.attr == "count_request" or (
                f.attr == "labels" and isinstance(f.value, ast.Attribute) and f.value.attr == "requests")
            first = node.args[0]
            if counted and isinstance(first, ast.Constant) and isinstance(first.value, str):
                kinds.add(first.value)
    return kinds


def kinds_in_docs() -> set[str]:
    text = (ROOT / "docs/gateway.md").read_text()
    metrics = text[text.index("## Metrics"):]
    listed = re.search(r"`sbxnet_gateway_requests_total\{kind,status\}` \((.*?)\),\n`", metrics, re.S)
    assert listed is not None, "the Metrics section no longer lists the request kinds"
    return set(re.findall(r"`([a-z0-9]+)`", listed.group(1)))


def test_the_request_kinds_documented_are_the_ones_counted() -> None:
    code = kinds_in_code()
    assert {"http", "http2", "upgrade", "tcp"} <= code  # the reading of the code finds them
    assert kinds_in_docs() == code
