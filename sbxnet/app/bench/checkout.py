"""The checkout ``sbxnet bench`` runs from: its ``bench/`` runners, whose set-ups and accounting the staged
benchmark uses as they are (the nginx and HAProxy peers, the forwarder-hop client and sink, the splice
pump's server), so the figures of those scripts and of this tool come from the same code."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from sbxnet.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
CONF = Path(__file__).resolve().parent / "nginx"


def runners() -> tuple[ModuleType, ModuleType, ModuleType]:
    """``bench.gateway_vs_nginx``, ``bench.forwarder_hop``, ``bench.splice_vs_haproxy``."""
    if not (ROOT / "bench" / "gateway_vs_nginx.py").is_file():
        raise ConfigError(f"sbxnet bench runs from a checkout: no bench/ under {ROOT}")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import forwarder_hop, gateway_vs_nginx, splice_vs_haproxy

    return gateway_vs_nginx, forwarder_hop, splice_vs_haproxy
