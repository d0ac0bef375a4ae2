"""Errors split by blame, under one base class.

``RemoteProtocolError``: the peer sent something we refuse. ``LocalProtocolError``: we were asked to
produce something the protocol cannot carry. ``reason`` is a short, stable token that metrics count
and logs print; it never contains peer-controlled text.
"""


class SbxnetError(Exception):
    """Base of every error this project raises on purpose."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class RemoteProtocolError(SbxnetError):
    """The peer's bytes break the protocol; ``reason`` names how."""


class LocalProtocolError(SbxnetError):
    """Our own caller asked for something the protocol cannot express."""


class ConfigError(SbxnetError):
    """Configuration that cannot start a component; the message names field, value and what is valid."""

    def __init__(self, message: str) -> None:
        super().__init__("config", message)
        self.message = message

    def __str__(self) -> str:
        return self.message
