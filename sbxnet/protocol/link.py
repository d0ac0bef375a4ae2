"""The link sequence after the TLS handshake, sans I/O, for both ends.

    gateway                                   forwarder
      preamble (PROXY v2, bounded)  ───────▶  read within max_len bytes and before the deadline
      [tenant bytes may follow at once]       (kept: they are delivered first, never lost)
                                    ◀───────  status record (OK, or why not)
      tenant bytes, only after OK   ◀──────▶  tenant bytes

``ForwarderSequence`` takes the gateway's application plaintext as it arrives and yields the preamble
plus the tenant bytes that arrived with it; ``GatewaySequence`` produces the preamble and takes the
forwarder's plaintext until the status is in, then yields it plus any tenant bytes that followed it.
Both compute their deadline from a ``now`` passed in at construction and judge every later input
against the ``now`` passed with it: they read no clock, own no socket, and an adapter drives them
with whatever clock its event loop uses (``asyncio.timeout_at(seq.deadline)``).

Refusals are ``PreambleError`` (forwarder side) and ``StatusError`` (gateway side), each with a stable
reason token; misuse by the caller (answering twice, sending before OK) is ``LocalProtocolError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.codes import Status
from sbxnet.protocol.preamble import DEFAULT_MAX_LEN, Preamble, PreambleError, pull_preamble, push_preamble
from sbxnet.protocol.status import StatusError, pull_status, push_status


@dataclass(frozen=True)
class Opened:
    """The forwarder has a whole preamble; ``leftover`` is tenant data that shared its records."""

    preamble: Preamble
    leftover: bytes


@dataclass(frozen=True)
class Answered:
    """The gateway has the forwarder's status; ``leftover`` is tenant data that followed it."""

    status: Status
    leftover: bytes


class ForwarderSequence:
    """The forwarder's side: read the preamble (bounded in bytes and time), then answer once."""

    def __init__(
        self, *, now: float, timeout: float, max_len: int = DEFAULT_MAX_LEN, idle_timeout: float | None = None
    ) -> None:
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.max_len = max_len
        # A gateway's warm pool opens links before it has a request for them: such a link may wait up
        # to ``idle_timeout`` for its first byte, and the preamble then has ``timeout`` from that byte.
        # Without one, ``timeout`` runs from now, as it always did.
        self.deadline = now + (timeout if idle_timeout is None else idle_timeout)
        self._started = False
        self._buf = bytearray()
        self._opened: Opened | None = None
        self._answered: Status | None = None

    @property
    def opened(self) -> Opened | None:
        return self._opened

    @property
    def started(self) -> bool:
        """Whether a byte of the preamble has come (a link that ends before it never began one)."""
        return self._started

    @property
    def answered(self) -> Status | None:
        return self._answered

    def receive_data(self, data: bytes, now: float) -> Opened | None:
        """Feed plaintext from the gateway. Returns ``Opened`` once the preamble is whole, None while
        it is still a valid prefix; raises ``PreambleError`` as soon as it cannot be one, or if
        ``now`` is past the deadline. Input after ``Opened`` is the data plane's, not ours."""
        if self._opened is not None:
            raise LocalProtocolError("preamble_done", "tenant bytes go to the data plane")
        if now > self.deadline:
            self.expire()
        if data and not self._started:
            self._started = True
            if self.idle_timeout is not None:
                self.deadline = now + self.timeout
        self._buf += data
        parsed = pull_preamble(self._buf, max_len=self.max_len)
        if parsed is None:
            return None
        preamble, used = parsed
        self._opened = Opened(preamble, bytes(self._buf[used:]))
        self._buf.clear()
        return self._opened

    def receive_eof(self) -> NoReturn:
        """The gateway ended the stream (or the link broke) before the preamble was whole: ``unused``
        before its first byte (a pooled link retired, or a gateway that refused our key), ``eof`` after."""
        if not self._started:
            raise PreambleError("unused", "closed before the preamble's first byte")
        raise PreambleError("eof", f"after {len(self._buf)} bytes")

    def expire(self) -> NoReturn:
        """The adapter's wait for more bytes ran past ``deadline``: ``idle`` when not one byte came
        within ``idle_timeout`` (a pooled link nobody used), ``timeout`` otherwise."""
        if not self._started and self.idle_timeout is not None:
            raise PreambleError("idle", f"no byte in {self.idle_timeout}s")
        raise PreambleError("timeout", f"{len(self._buf)} bytes in {self.timeout}s")

    def answer(self, status: Status) -> bytes:
        """The one status record to send: OK only after a whole preamble; a refusal at any point."""
        if self._answered is not None:
            raise LocalProtocolError("answered", f"already answered {self._answered.name}")
        if status is Status.OK and self._opened is None:
            raise LocalProtocolError("not_opened", "OK before a whole preamble")
        self._answered = status
        return push_status(status)


class GatewaySequence:
    """The gateway's side: send the preamble, then read the status before any tenant byte goes up.

    ``preamble`` is the encoded bytes (``push_preamble`` checks them; see ``for_preamble``), taken as
    given so that tests can send what a broken gateway would.
    """

    def __init__(self, preamble: bytes, *, now: float, timeout: float) -> None:
        self._preamble = preamble
        self.timeout = timeout
        self.deadline = now + timeout
        self._buf = bytearray()
        self._started = False
        self._answer: Answered | None = None

    @classmethod
    def for_preamble(cls, p: Preamble, *, now: float, timeout: float, crc32c: bool = False) -> GatewaySequence:
        return cls(push_preamble(p, crc32c=crc32c), now=now, timeout=timeout)

    @property
    def answer(self) -> Answered | None:
        return self._answer

    @property
    def may_send(self) -> bool:
        """Tenant bytes may go upstream only after OK: before it, a retry never repeats a request."""
        return self._answer is not None and self._answer.status is Status.OK

    def start(self) -> bytes:
        """The bytes to send first (once)."""
        if self._started:
            raise LocalProtocolError("started", "the preamble is sent once")
        self._started = True
        return self._preamble

    def receive_data(self, data: bytes, now: float) -> Answered | None:
        """Feed plaintext from the forwarder: ``Answered`` once the 4-byte status is in, None before;
        ``StatusError`` for a malformed record or past the deadline."""
        if not self._started:
            raise LocalProtocolError("not_started", "nothing was sent yet")
        if self._answer is not None:
            raise LocalProtocolError("answered", "bytes after the status belong to the data phase")
        if now > self.deadline:
            self.expire()
        self._buf += data
        parsed = pull_status(self._buf)
        if parsed is None:
            return None
        status, used = parsed
        self._answer = Answered(status, bytes(self._buf[used:]))
        self._buf.clear()
        return self._answer

    def receive_eof(self) -> NoReturn:
        raise StatusError("eof", f"after {len(self._buf)} status bytes")

    def expire(self) -> NoReturn:
        raise StatusError("timeout", f"no status in {self.timeout}s")
