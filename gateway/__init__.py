"""The TLS front end (gateway). Built on the forwarder core; see docs/architecture.md."""
