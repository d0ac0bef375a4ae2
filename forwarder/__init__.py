"""Everything on a sandbox host: the ingress forwarder (`ingress/`), the egress router (`egress/`), the taps
(`taps/`)."""
