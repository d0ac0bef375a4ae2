"""The TLS front end: terminates client TLS, routes every request (SNI, then each Host / ``:authority``)
to a sandbox, asks the scheduler where it lives, and opens the mutual-TLS link to that host's forwarder.

Its own settings, cli, run, server, HTTP front, routes and upstream land here; today it holds
``link_client.py``, the blocking client of the link the demo and tests use. It imports only the shared
packages (``sbxnet``, ``certs``), never another component.
"""
