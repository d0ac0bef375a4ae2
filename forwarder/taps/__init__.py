"""VM taps: a fixed tap MAC and a permanent neighbour entry for the guest (``sbxnet tap``)."""
