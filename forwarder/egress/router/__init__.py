"""The egress router daemon (``sbxnet egress``): guest streams in, VXLAN to the exits out, and back.

``settings`` and ``claims`` are what it is told; ``outbound`` and ``inbound`` judge and transform bytes
with no socket (the protocol layer and the C core of ``forwarder.egress``); ``vxlan_socket`` and
``guest_stream`` are the adapters; ``daemon`` wires them. Addresses: ``addresses`` (the single node's
choice, pure), ``release_log`` (its log), ``mesh_addresses`` (PostgreSQL), ``allocator`` (either, as the
daemon sees it). Control: ``control_body`` (the request parser, pure), ``control_api`` (the root-only
socket), ``control_client``; ``claim_state`` is the state file. See docs/egress.md, "The router daemon".
"""
