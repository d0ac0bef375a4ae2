"""The reference scheduler: the route registry (sandbox -> forwarder address and SPKI pin, private
target, ports, auth, idle period), idle timers fed by the forwarders' byte reports, holds, and wake.

Its timer core will be pure (reports and ``now`` in, state changes out); storage is SQLite by default,
PostgreSQL when replicas share state. It imports only the shared packages (``sbxnet``, ``certs``).
"""
