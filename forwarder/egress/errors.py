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


class HelloRefused(RemoteProtocolError):
    """The 12-byte stream hello is malformed or asks for something protocol v1 cannot carry."""


class FlowRefused(RemoteProtocolError):
    """A flow's first packet is refused: flow_cap, flow_rate, policy_denied, internal_address."""


class LimitRefused(RemoteProtocolError):
    """A claim's rate or quota is exhausted: byte_rate, packet_rate, quota."""


class InboundRefused(RemoteProtocolError):
    """A datagram from the exit side (VXLAN, Ethernet, ARP) is refused."""
