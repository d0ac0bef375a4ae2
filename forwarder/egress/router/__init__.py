"""The egress router daemon (``sbxnet egress``): guest streams in, VXLAN to the exits out, and back.

``settings`` and ``claims`` are what it is told; ``outbound`` and ``inbound`` judge and transform bytes
with no socket (the protocol layer and the C core of ``forwarder.egress``); ``vxlan_socket`` and
``guest_stream`` are the adapters; ``daemon`` wires them. See docs/egress.md, "The router daemon".
"""
