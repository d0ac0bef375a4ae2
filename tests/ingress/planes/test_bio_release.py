"""memory.release_bio_buffers: an empty memory BIO of a live TLS session gives its grown buffer back to
malloc, and the session goes on exactly as before (a real TLS 1.3 mutual handshake with the link's
profile, both ends over memory BIOs in this process)."""

from __future__ import annotations

import ctypes
import os
import ssl
import sys

import pytest
from fwd_support import Pki

from certs import loader
from forwarder.ingress.planes.memory import _openssl, release_bio_buffers

pytestmark = pytest.mark.skipif(_openssl() is None, reason="no CPython 3.11-3.13 _ssl whose OpenSSL can be reached")


class Session:
    """A forwarder-side SSLObject (``s``, BIOs ``si``/``so``) and a gateway-side one, handshake done."""

    def __init__(self, pki: Pki) -> None:
        cert, key = pki.paths["forwarder"]
        sctx = loader.server_context(cert_file=cert, key_file=key, ca_file=pki.ca_file)
        self.si, self.so, self.ci, self.co = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        self.s = sctx.wrap_bio(self.si, self.so, server_side=True)
        self.c = pki.client_ctx().wrap_bio(self.ci, self.co, server_hostname="localhost")
        for _ in range(8):
            done = 0
            for obj in (self.c, self.s):
                try:
                    obj.do_handshake()
                    done += 1
                except ssl.SSLWantReadError:
                    pass
            self.si.write(self.co.read())
            self.ci.write(self.so.read())
            if done == 2 and not self.si.pending and not self.ci.pending:
                break
        assert self.s.version() == "TLSv1.3" and self.s.getpeercert()

    def up(self, data: bytes) -> bytes:
        """``data`` gateway -> forwarder; what the forwarder decrypted."""
        self.c.write(data)
        self.si.write(self.co.read())
        out = b""
        while len(out) < len(data):
            out += self.s.read(len(data) - len(out))
        return out

    def down(self, data: bytes) -> bytes:
        self.s.write(data)
        self.ci.write(self.so.read())
        out = b""
        while len(out) < len(data):
            out += self.c.read(len(data) - len(out))
        return out


def in_use() -> int:
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def test_the_handshakes_buffers_go_back_and_the_session_goes_on(pki: Pki) -> None:
    t = Session(pki)
    released = release_bio_buffers(t.s, (t.si, t.so))
    assert released > 1024  # the client's and our flights grew both BIOs' buffers
    assert release_bio_buffers(t.s, (t.si, t.so)) == 0  # nothing grown since
    data = os.urandom(100_000)
    assert t.up(data) == data
    assert t.down(data[::-1]) == data[::-1]
    # close_notify still goes both ways over the new buffers
    t.c.write(b"last")
    t.si.write(t.co.read())
    assert t.s.read(10) == b"last"
    with pytest.raises(ssl.SSLWantReadError):
        t.s.unwrap()
    t.ci.write(t.so.read())
    try:
        end = t.c.read(10)
    except ssl.SSLZeroReturnError:
        end = b""
    assert end == b"" and t.c.get_channel_binding() is not None  # close_notify (no data: WantRead instead)


def test_a_bio_with_bytes_in_it_another_sessions_bio_and_a_small_buffer_are_left_alone(pki: Pki) -> None:
    t, other = Session(pki), Session(pki)
    assert release_bio_buffers(t.s, (other.si, other.so)) == 0  # not t's BIOs
    assert release_bio_buffers(t.s, (t.ci,)) == 0  # the gateway side's BIO, not one of t.s's
    assert release_bio_buffers(t.s, (t.si, t.so), above=1 << 20) == 0  # none that big
    t.c.write(b"split record")
    record = t.co.read()
    t.si.write(record[:7])  # half a record: pending bytes, never touched
    assert release_bio_buffers(t.s, (t.si,)) == 0
    t.si.write(record[7:])
    assert t.s.read(100) == b"split record"
    assert release_bio_buffers(t.s, (t.si, t.so)) > 0  # empty again: released now


def test_a_burst_grown_buffer_is_handed_back_to_malloc(pki: Pki) -> None:
    sessions = [Session(pki) for _ in range(20)]
    for t in sessions:
        release_bio_buffers(t.s, (t.si, t.so))
        blob = os.urandom(64 * 1024)
        assert t.down(blob) == blob  # 64 KiB enters the outgoing BIO at once: its buffer grows past it
    before = in_use()
    released = sum(release_bio_buffers(t.s, (t.so,), above=4096) for t in sessions)
    after = in_use()
    assert released >= 20 * 64 * 1024
    assert before - after >= released * 0.9, (before, after, released)
    for t in sessions:  # the sessions still work, each way
        assert t.down(b"x" * 70_000) == b"x" * 70_000
        assert t.up(b"y" * 5) == b"y" * 5


def test_nothing_is_released_on_an_interpreter_whose_layout_is_not_known(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    import forwarder.ingress.planes.memory as memory

    monkeypatch.setattr(memory, "_OPENSSL", False)  # looked up again, under another version
    monkeypatch.setattr(sys, "version_info", (3, 14, 0, "final", 0))
    t = Session(pki)
    assert release_bio_buffers(t.s, (t.si, t.so)) == 0
    assert t.up(b"still") == b"still"
