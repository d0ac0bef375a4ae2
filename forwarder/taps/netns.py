"""Named network namespaces: check that one exists, and run a call inside it.

A TUN/TAP device is created in the namespace of the process that *opened* /dev/net/tun, and a socket
lives in the namespace it was created in. ``call_in_netns`` runs a function on a short-lived thread
that has ``setns(2)``-ed into the namespace (setns with CLONE_NEWNET changes only the calling thread),
so the caller's own thread never changes namespace and nothing has to be restored on failure.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from forwarder.taps.errors import NetnsNotFoundError
from forwarder.taps.spec import validate_netns_name

NETNS_RUN_DIR = "/run/netns"  # where `ip netns add` and pyroute2 bind-mount named namespaces
CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3): which kind of namespace an nsfs descriptor is

T = TypeVar("T")

_libc: ctypes.CDLL | None = None


def _setns(fd: int, nstype: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def netns_path(name: str) -> str:
    return os.path.join(NETNS_RUN_DIR, validate_netns_name(name))


def open_netns(name: str) -> int:
    """Open the named network namespace (O_RDONLY descriptor, caller closes it).

    Raises NetnsNotFoundError when /run/netns/NAME is missing (``netns_missing``) or is not a network
    namespace mount, e.g. a file left behind by a crashed `ip netns add` (``netns_not_a_namespace``).
    """
    path = netns_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetnsNotFoundError(
            "netns_missing",
            f"network namespace {name!r} does not exist ({path} is missing)",
            f"create it first (ip netns add {name}), or fix --netns; omit --netns for the host namespace",
        ) from None
    try:
        kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError as e:
        if e.errno not in (errno.ENOTTY, errno.EINVAL):
            os.close(fd)
            raise
        kind = -1
    if kind != CLONE_NEWNET:
        os.close(fd)
        raise NetnsNotFoundError(
            "netns_not_a_namespace",
            f"{path} exists but is not a network namespace (a leftover file, nothing mounted on it)",
            f"remove the leftover and recreate it (ip netns delete {name}; ip netns add {name})",
        )
    return fd


def check_netns(name: str) -> None:
    """Raise NetnsNotFoundError unless ``name`` is an existing named network namespace."""
    os.close(open_netns(name))


def call_in_netns(name: str | None, fn: Callable[[], T]) -> T:
    """Return ``fn()`` run inside network namespace ``name`` (``None``: call it here, unchanged).

    Exceptions from ``fn`` propagate. Descriptors ``fn`` opens (sockets, /dev/net/tun) keep the
    namespace they were opened in and are usable from any thread afterwards.
    """
    if name is None:
        return fn()
    nsfd = open_netns(name)
    result: list[T] = []
    failure: list[BaseException] = []

    def runner() -> None:
        try:
            _setns(nsfd, CLONE_NEWNET)
            result.append(fn())
        except BaseException as e:
            failure.append(e)

    try:
        t = threading.Thread(target=runner, name=f"netns:{name}", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(nsfd)
    if failure:
        raise failure[0]
    return result[0]
