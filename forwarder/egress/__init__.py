"""Egress router packet core: guest stream protocol, frame validation, flows, limits, VXLAN and ARP.

Pure functions and small state machines over bytes, time passed in; no sockets here. The per-packet
transforms (checksums, rewrite, segmentation, GRO) are in ``fastpath``/``reference`` over ``native/``.
"""
