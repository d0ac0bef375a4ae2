"""The shell's signals, the same in every daemon (docs/architecture.md, "Every daemon's shell"): SIGTERM and
SIGINT stop it (each daemon drains as its page says), SIGHUP reloads what can change safely.

A reload is all or nothing, with one outcome logged per SIGHUP: every part (certificates, a token file,
a routes file) is loaded first; if one fails, nothing is swapped and one ``reload_failed`` line names the
part, the file and why (the daemon keeps what it had); otherwise every part is swapped in and one
``reloaded`` line lists them. A part's ``load`` raises ``ReloadError`` naming the file; anything else it
raises is a bug, logged as a failure with its type (the daemon lives on, keeping what it had).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class ReloadError(Exception):
    """A part could not be loaded: ``file`` is the one at fault, ``why`` says how (no secret in either)."""

    def __init__(self, file: str, why: str, *, kind: str = "") -> None:
        super().__init__(f"{file}: {why}")
        self.file = file
        self.why = why
        self.kind = kind or "load_error"


@dataclass(frozen=True)
class Part:
    """One thing SIGHUP reloads: ``load`` makes the new value (raises ``ReloadError``), ``use`` swaps it in
    (must not fail). ``files`` are named in the ``reloaded`` line."""

    what: str
    load: Callable[[], Any]
    use: Callable[[Any], None]
    files: Sequence[str] = ()


def reload(log: logging.Logger, parts: Sequence[Part]) -> ReloadError | None:
    """Load every part, then swap them all in; or, if one fails, swap none. Logs exactly one line."""
    loaded: list[tuple[Part, Any]] = []
    for part in parts:
        try:
            loaded.append((part, part.load()))
        except ReloadError as e:
            failure = e
        except Exception as e:  # a bug: still one outcome, and the daemon keeps serving what it had
            failure = ReloadError(", ".join(part.files) or part.what, f"{type(e).__name__}: {e}",
                                  kind=type(e).__name__)
        else:
            continue
        log.error(f"reload failed: {part.what} from {failure.file}: {failure.why}; keeping everything as it was",
                  extra={"event": "reload_failed", "reason": failure.kind,
                         "fields": {"what": part.what, "file": failure.file, "error": failure.why}})
        return failure
    for part, value in loaded:
        part.use(value)
    whats = [p.what for p in parts]
    log.info("reloaded " + (", ".join(whats) or "nothing (no file to reload)"), extra={
        "event": "reloaded", "fields": {"what": whats, "files": [f for p in parts for f in p.files]}})
    return None


def wire_signals(stop: asyncio.Event, on_hup: Callable[[], object]) -> None:
    """On the running loop: SIGTERM and SIGINT set ``stop``; SIGHUP calls ``on_hup`` (a reload)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
