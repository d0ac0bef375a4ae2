"""The single node's release log: one line appended per released address, so that no address is handed
out again inside its reuse window across a restart.

A line is ``<address> <wall-clock seconds> <claim id>\\n``. ``ReleaseLog.open(path, window, now)`` reads
the file, keeps the releases still inside the window (a line it cannot read, a torn last line after a
crash say, is skipped and counted), rewrites the file with just those (a temporary file renamed over it:
the compaction) and keeps it open for appending. Allocating writes nothing; only a release (a disarm or
an export) appends, one ``write`` and ``fsync``.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from forwarder.egress.router.addresses import Released


def parse_line(line: str) -> Released | None:
    parts = line.split()
    if len(parts) != 3:
        return None
    try:
        addr = int(ipaddress.IPv4Address(parts[0]))
        at = float(parts[1])
    except ValueError:
        return None
    if at != at or at in (float("inf"), float("-inf")):
        return None
    return Released(addr, at, parts[2])


def format_line(r: Released) -> str:
    return f"{ipaddress.IPv4Address(r.address)} {r.at:.3f} {r.claim}\n"


class ReleaseLog:
    def __init__(self, path: Path, fd: int, released: list[Released], skipped: int) -> None:
        self.path = path
        self._fd = fd
        self.released = released  # what the file held inside the window when opened
        self.skipped = skipped

    @classmethod
    def open(cls, path: Path, window: float, now: float) -> ReleaseLog:
        kept: list[Released] = []
        skipped = 0
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            r = parse_line(line)
            if r is None:
                skipped += 1
            elif now - r.at < window:
                kept.append(r)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(map(format_line, kept)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return cls(path, fd, kept, skipped)

    def append(self, r: Released) -> None:
        os.write(self._fd, format_line(r).encode())
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
