"""Errors raised while setting up a VM tap.

Every error carries a short stable ``reason`` (metrics count it), a ``detail`` saying what was found,
and a ``fix`` naming what the operator does about it; ``str(e)`` prints all three. One class per kind
of trouble, so callers can catch exactly what they can handle:

- ``TapSpecError`` and its subclasses: the requested spec itself is invalid (nothing was touched).
- ``NetnsNotFoundError``: the named network namespace does not exist.
- ``NotATapError``: an interface of that name exists and is not a TAP device.
- ``TapNotPersistentError``: a non-persistent tap of that name exists; it lives only as long as the
  process that holds its file descriptor, so that process owns it.
- ``TapOwnerMismatchError``: a persistent tap exists but belongs to another uid/gid.
- ``TapInUseError``: the tap is attached (a process holds a queue: a running VMM) or enslaved to a bridge.
- ``TapNetlinkError``: the kernel refused a request for a reason none of the above explains.
"""

from __future__ import annotations

from sbxnet.errors import EnvironmentFault


class TapError(EnvironmentFault):
    """Base of every tap set-up error; ``fix`` names what to do."""

    def __init__(self, reason: str, problem: str, fix: str) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(reason, f"{problem}; fix: {fix}")


class TapSpecError(TapError):
    """The spec is invalid; raised before any device is touched."""


class InvalidTapNameError(TapSpecError):
    """Interface name empty, longer than 15 bytes, or containing characters Linux refuses."""


class InvalidMacError(TapSpecError):
    """MAC address unparsable, all-zero, or multicast/broadcast (cannot be a unicast station address)."""


class NetnsNotFoundError(TapError):
    """The named network namespace is missing (or the name is not a network namespace mount)."""


class NotATapError(TapError):
    """An interface with the tap's name exists but is not a TAP device (a veth, a tun, a bridge...)."""


class TapNotPersistentError(TapError):
    """A non-persistent tap exists: another process created it and owns it through its open descriptor."""


class TapOwnerMismatchError(TapError):
    """A persistent tap exists with a different owner uid or group gid than the spec asks for."""


class TapInUseError(TapError):
    """The tap is attached to a running process (a VMM) or enslaved to a bridge/bond."""


class TapNetlinkError(TapError):
    """The kernel refused a netlink or ioctl request; ``detail`` carries the errno text."""
