"""Fixtures the gateway's end-to-end tests share: a test PKI per module, and the stack in front of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# gw_support puts tests/ingress on the path, so fwd_support's names come through it.
from gw_support import Pki, gateway_stack, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with gateway_stack(pki, tmp_path_factory.mktemp("routes")) as s:
        yield s
