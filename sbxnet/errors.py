"""Errors split by blame, under one base class.

Three branches, by whose fault it is:

- ``RemoteProtocolError``: the peer sent something we refuse (a gateway's preamble, a guest's frame).
- ``LocalProtocolError``: our own caller asked for something the protocol cannot carry.
- ``EnvironmentFault``: the host cannot do what was asked (no kernel TLS, a port taken, a tap the
  kernel refused, configuration that cannot start a component). Nobody's bytes were wrong; an
  operator fixes the machine or the settings.

``reason`` is a short, stable token that metrics count and logs print; it never contains
peer-controlled text. ``status_hint`` is the answer the error suggests on the link (as h11's errors
carry ``error_status_hint``): a class attribute, overridable per instance, so the forwarder and the
gateway map an error to an answer the same way instead of each keeping its own table.
"""

from __future__ import annotations

from sbxnet.protocol.codes import Status


class SbxnetError(Exception):
    """Base of every error this project raises on purpose."""

    status_hint: Status = Status.INTERNAL

    def __init__(self, reason: str, detail: str = "", *, status_hint: Status | None = None) -> None:
        self.reason = reason
        self.detail = detail
        if status_hint is not None:
            self.status_hint = status_hint
        super().__init__(f"{reason}: {detail}" if detail else reason)


class RemoteProtocolError(SbxnetError):
    """The peer's bytes break the protocol; ``reason`` names how. Never worth retrying as sent."""

    status_hint = Status.BAD_PREAMBLE


class LocalProtocolError(SbxnetError):
    """Our own caller asked for something the protocol cannot express (a bug on our side)."""

    status_hint = Status.INTERNAL


class EnvironmentFault(SbxnetError):
    """The host or its configuration cannot do what was asked; the message names the fix."""

    status_hint = Status.UNAVAILABLE


class ConfigError(EnvironmentFault):
    """Configuration that cannot start a component; the message names field, value and what is valid."""

    def __init__(self, message: str) -> None:
        super().__init__("config", message)
        self.message = message

    def __str__(self) -> str:
        return self.message
