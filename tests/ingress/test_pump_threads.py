"""``pump_threads``: how many splice threads each worker's ktls plane runs (issue 11 point 5).

The plane itself needs a kernel with TLS (its tests run in the emulated kernel, tests/ingress/planes); the
number it is given is decided here, from the settings and the cores."""

from __future__ import annotations

from typing import Any

import pytest
from fwd_support import Pki
from pydantic import ValidationError

from forwarder.ingress.server import pump_thread_count
from forwarder.ingress.settings import ForwarderSettings


def settings_for(pki: Pki, **over: Any) -> ForwarderSettings:
    cert, key = pki.paths["forwarder"]
    values: dict[str, Any] = dict(cert_file=cert, key_file=key, ca_file=pki.ca_file,
                                  client_san_allow=["spiffe://x/gw"], sandbox_prefixes=["10.0.0.0/8"])
    return ForwarderSettings(**{**values, **over})


@pytest.mark.parametrize(
    ("workers", "pump_threads", "cores", "expected"),
    [
        (1, 0, 16, 16),  # one worker: one thread per core
        (4, 0, 16, 4),  # the cores shared among the workers: one per core in all
        (0, 0, 16, 1),  # a worker per core: one thread each
        (3, 0, 2, 1),  # more workers than cores: still one each
        (1, 0, 1, 1),
        (1, 2, 16, 2),  # set: taken as given, per worker
        (4, 8, 2, 8),
    ],
)
def test_the_thread_count_per_worker(pki: Pki, workers: int, pump_threads: int, cores: int, expected: int) -> None:
    s = settings_for(pki, workers=workers, pump_threads=pump_threads)
    assert pump_thread_count(s, cores) == expected


@pytest.mark.parametrize("bad", [-1, 257])
def test_a_bad_count_is_named(pki: Pki, bad: int) -> None:
    with pytest.raises(ValidationError, match="pump_threads"):
        settings_for(pki, pump_threads=bad)
