"""sbxnet: the network edge of a sandbox platform (command line, settings and shared protocol cores)."""

__version__ = "0.1.0"
