"""The ingress forwarder and everything else that runs on a sandbox host."""
