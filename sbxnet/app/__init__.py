"""The ``sbxnet`` command and the demo: the only code that imports components."""
