"""Refusals of the egress path, each with a stable ``reason`` token that metrics count.

All are the guest's or the exit's doing (``RemoteProtocolError``); our own misuse of an encoder raises
``LocalProtocolError`` from the module concerned.
"""

from sbxnet.errors import RemoteProtocolError


class FrameRefused(RemoteProtocolError):
    """A guest frame (virtio_net_hdr + IPv4 packet) or the stream framing around it is refused.

    ``reason`` ``bad_frame_length`` (raised by the stream decoder) is fatal for the stream; every other
    reason drops one frame and the stream goes on.
    """


class FramingLost(FrameRefused):
    """``bad_frame_length``: the stream's framing is lost for good. ``frames`` holds the whole frames the
    same ``feed`` call completed before the bad length, so what the guest sent before breaking the
    framing is handled the same whatever the chunking."""

    def __init__(self, detail: str, frames: list[memoryview | bytes]) -> None:
        super().__init__("bad_frame_length", detail)
        self.frames = frames


class HelloRefused(RemoteProtocolError):
    """The 12-byte stream hello is malformed or asks for something protocol v1 cannot carry."""


class FlowRefused(RemoteProtocolError):
    """A flow's first packet is refused: flow_cap, flow_rate, policy_denied, internal_address."""


class LimitRefused(RemoteProtocolError):
    """A claim's rate or quota is exhausted: byte_rate, packet_rate, quota."""


class InboundRefused(RemoteProtocolError):
    """A datagram from the exit side (VXLAN, Ethernet, ARP) is refused."""
