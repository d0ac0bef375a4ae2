"""The state file: every armed claim's state (address, switch, exit label, quota used), so that a daemon
restart re-arms them as they were.

``<state_dir>/claims.json``, the form ``{"version": 1, "claims": [ClaimState...]}`` (the export form of
each claim). ``save`` writes a temporary file in the same directory, fsyncs it and renames it over the
old one (then fsyncs the directory), so a crash leaves the old file or the new one, never a torn one.
A file that cannot be read refuses the start (``ConfigError``): starting without the claims would hand
their addresses to others.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from forwarder.egress.router.claims import ClaimState
from sbxnet.errors import ConfigError

VERSION = 1


class _StateFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    claims: list[ClaimState]


class StateFile:
    def __init__(self, directory: Path) -> None:
        self.path = directory / "claims.json"
        self.writes = 0

    def load(self) -> list[ClaimState]:
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            raise ConfigError(f"config: state file {str(self.path)!r}: {e.strerror}") from None
        try:
            data = _StateFile.model_validate_json(text)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"config: state file {str(self.path)!r}: {where}: {first['msg']}") from None
        if data.version != VERSION:
            raise ConfigError(f"config: state file {str(self.path)!r}: version {data.version}, want {VERSION}")
        return data.claims

    def save(self, claims: Iterable[ClaimState]) -> None:
        body = json.dumps({"version": VERSION, "claims": [c.model_dump(mode="json") for c in claims]}, indent=1)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.writes += 1
