"""Fuzz target for the inbound flow key (``forwarder.egress.reply``; ``one_input(data)``, data = a delivery frame).

Invariant: ``pull_reply`` gives a ``Reply`` or raises ``InboundRefused`` (``bad_reply``), nothing else; an
accepted key is the claim's side: its source is the frame's IPv4 destination (for an ICMP error, the
quoted packet's source too), TCP and UDP ports are the frame's swapped, only a TCP segment with neither
SYN nor RST is resumable; ``wire_size`` never raises and counts at least one packet and never fewer bytes
than the frame's IPv4 packet claims for itself.
"""

from __future__ import annotations

import struct

from forwarder.egress.errors import InboundRefused
from forwarder.egress.reply import ICMP_ERROR_TYPES, IP_OFF, TCP_RST, TCP_SYN, pull_reply, wire_size


def classify(data: bytes) -> str:
    nbytes, packets = wire_size(data)
    assert packets >= 1 and nbytes >= 0
    try:
        key, resumable = pull_reply(data)
    except InboundRefused as exc:
        assert exc.reason == "bad_reply", exc.reason
        return exc.reason
    ip = data[IP_OFF:]
    src, dst = struct.unpack_from("!II", ip, 12)
    l4 = (ip[0] & 15) * 4
    assert key.src == dst and key.proto in (1, 6, 17)
    if ip[9] in (6, 17):
        assert (key.proto, key.sport, key.dst, key.dport) == (ip[9], *struct.unpack_from("!H", ip, l4 + 2), src,
                                                             *struct.unpack_from("!H", ip, l4))
        assert resumable == (ip[9] == 6 and not ip[l4 + 13] & (TCP_SYN | TCP_RST))
    else:
        assert ip[9] == 1 and not resumable
        if ip[l4] in ICMP_ERROR_TYPES:
            q = ip[l4 + 8 :]
            assert struct.unpack_from("!I", q, 12)[0] == dst == key.src and key.proto == q[9]
            assert key.dst == struct.unpack_from("!I", q, 16)[0]
        else:
            assert key.dst == src and key.dport == 0
    return "ok"


def one_input(data: bytes) -> None:
    classify(data)


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
