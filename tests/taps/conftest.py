"""Fixtures for the tap tests: namespaces, host-namespace taps and descriptors, all cleaned up even when
a test fails (finalizers run in the right order: descriptors first, so no namespace stays pinned)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest
from tap_support import unique, why_no_netns


class TapEnv:
    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self.host_taps: list[str] = []
        self.fds: list[int] = []
        self.socks: list[socket.socket] = []
        self.files: list[str] = []

    def netns(self, prefix: str = "sbxtap") -> str:
        from pyroute2 import netns

        name = unique(prefix)
        netns.create(name)
        self.namespaces.append(name)
        return name

    def host_tap_name(self, prefix: str = "sbxt") -> str:
        name = unique(prefix)
        self.host_taps.append(name)
        return name

    def fd(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def sock(self, s: socket.socket) -> socket.socket:
        self.socks.append(s)
        return s

    def close_fd(self, fd: int) -> None:
        if fd in self.fds:
            self.fds.remove(fd)
        os.close(fd)

    def cleanup(self) -> None:
        from pyroute2 import IPRoute, netns

        for s in self.socks:
            s.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.host_taps:
            with IPRoute() as ipr:
                for name in self.host_taps:
                    for idx in ipr.link_lookup(ifname=name):
                        with contextlib.suppress(Exception):
                            ipr.link("del", index=idx)
        for name in self.namespaces:
            with contextlib.suppress(OSError):
                netns.remove(name)
        for path in self.files:
            with contextlib.suppress(OSError):
                os.unlink(path)


@pytest.fixture(scope="session")
def netns_ready() -> None:
    reason = why_no_netns()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def env(netns_ready: None) -> Iterator[TapEnv]:
    e = TapEnv()
    try:
        yield e
    finally:
        e.cleanup()
