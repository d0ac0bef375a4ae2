"""Certificate tooling: a CA, forwarder server certificates, gateway client certificates, SPKI pins."""

from certs.mint import Issued, mint_ca, mint_leaf, spki_pin, write_issued

__all__ = ["Issued", "mint_ca", "mint_leaf", "spki_pin", "write_issued"]
