"""Pure protocol cores shared by the gateway and the forwarder: bytes in, typed values or typed errors out."""
