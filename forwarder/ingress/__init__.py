"""The ingress forwarder: accept, mutual TLS, preamble, target guard, connect, status, data plane, meters."""
