"""Fuzz target: outbound frame validation + identity rewrite (``one_input(data)``, atheris-style).

``data[0]`` picks the claim address, the rest is a frame (virtio_net_hdr + IPv4). Invariants, for any
bytes: nothing but a refusal escapes the validator; the C rewrite and the reference agree on status
and bytes; a refusal writes nothing; after a rewrite the source is the claim address, the destination
is unchanged and only address and checksum fields changed (a guest cannot steer the checksum write at
the IPv4 header); a right IPv4 header checksum stays right; whatever the validator accepts the rewrite
accepts too. An ICMP error's quote, once rewritten, names only the claim and the error's own destination
(the sender of the packet quoted): for a frame the router would pass (validated, destination outside
the overlay, as the address guard insists) no address field of the quote is an overlay address other
than the claim's own, so a guest cannot make an error carry another claim's address to the exit.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

from forwarder.egress import core_types as ct
from forwarder.egress import reference as ref
from forwarder.egress.errors import FrameRefused
from forwarder.egress.fastpath import rewrite
from forwarder.egress.validate import ICMP_ERROR_TYPES, validate_outbound

CLAIMS = (0x64400A07, 0x0A000002, 0x00000000, 0xFFFFFFFF)
H = ct.VNET_HDR_LEN
OVERLAY_NET = IPv4Network("100.64.0.0/10")  # the claims' overlay (CLAIMS[0] is in it)


def allowed_changes(frame: bytes) -> set[int]:
    """Offsets a rewrite may change: IPv4 checksum and source, the L4 checksum, an ICMP error's
    checksum and its quoted header's checksum and destination."""
    ihl = (frame[H] & 15) * 4
    l4 = H + ihl
    ok = set(range(H + 10, H + 16))
    proto = frame[H + 9]
    if proto == 6:
        ok |= {l4 + 16, l4 + 17}
    elif proto == 17:
        ok |= {l4 + 6, l4 + 7}
    elif proto == 1:
        e = l4 + 8
        ok |= {l4 + 2, l4 + 3, e + 10, e + 11, *range(e + 16, e + 20)}
    return ok


def one_input(data: bytes) -> None:
    claim = CLAIMS[data[0] % len(CLAIMS)] if data else CLAIMS[0]
    frame = bytes(data[1:])
    try:
        validate_outbound(frame, 65535)
        accepted = True
    except FrameRefused:
        accepted = False
    c = bytearray(frame)
    r = bytearray(frame)
    status = rewrite(c, claim)
    if status != ref.rewrite(r, claim) or c != r:
        raise AssertionError(f"C and reference disagree (status {status})")
    if status != ct.OK:
        if c != frame:
            raise AssertionError("a refused frame was written to")
        if accepted:
            raise AssertionError(f"validated frame refused by the rewrite: {ct.REASONS.get(status)}")
        return
    if c[H + 12 : H + 16] != claim.to_bytes(4, "big"):
        raise AssertionError("source is not the claim address")
    if c[H + 16 : H + 20] != frame[H + 16 : H + 20]:
        raise AssertionError("destination changed")
    changed = {i for i in range(len(frame)) if c[i] != frame[i]}
    if not changed <= allowed_changes(frame):
        raise AssertionError(f"bytes changed outside address/checksum fields: {sorted(changed)}")
    ihl = (frame[H] & 15) * 4
    if ref.csum(frame[H : H + ihl]) == 0xFFFF and ref.csum(c[H : H + ihl]) != 0xFFFF:
        raise AssertionError("a right IPv4 header checksum became wrong")
    if accepted:
        _check_quote(bytes(c), claim)


def _check_quote(out: bytes, claim: int) -> None:
    """An accepted ICMP error's quote after the rewrite: no quoted address is an overlay address but the
    claim's (when the guard passes the outer destination, as the router requires first); the quoted
    source is the outer destination and the quoted destination the claim."""
    if out[H + 9] != 1 or out[H + 20] not in ICMP_ERROR_TYPES:
        return
    e = H + 20 + 8
    qsrc, qdst = int.from_bytes(out[e + 12 : e + 16], "big"), int.from_bytes(out[e + 16 : e + 20], "big")
    dst = int.from_bytes(out[H + 16 : H + 20], "big")
    if IPv4Address(dst) not in OVERLAY_NET:  # the guard refuses overlay destinations first
        for addr in (qsrc, qdst):
            if addr != claim and IPv4Address(addr) in OVERLAY_NET:
                raise AssertionError(f"the quote carries another overlay address {IPv4Address(addr)}")
    if qsrc != dst:
        raise AssertionError("the quoted source is not the error's destination")
    if qdst != claim:
        raise AssertionError("the quoted destination is not the claim address")

if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
