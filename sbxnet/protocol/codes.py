"""The answer codes of the link: what the forwarder tells the gateway about a preamble.

A vocabulary, not a codec (the 4-byte record that carries a code is ``status.py``). It lives apart so
that ``sbxnet.errors`` can name the answer each error class hints at without importing a codec.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    OK = 0
    NOT_LISTENING = 1  # the sandbox refused or did not answer before the connect deadline: retry
    FORBIDDEN = 2  # target outside the sandbox prefixes or on the deny list: never retry
    BAD_PREAMBLE = 3  # malformed, too long or too slow: never retry (fix the gateway)
    INTERNAL = 4  # the forwarder failed: no retry on this connection
    UNAVAILABLE = 5  # draining or at its connection limit: retry elsewhere or later

    @property
    def retryable(self) -> bool:
        return self in (Status.NOT_LISTENING, Status.UNAVAILABLE)
