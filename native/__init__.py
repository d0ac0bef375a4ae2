"""C for the hot paths, built with cffi at install time: one extension per ``build_*.py`` here.

Each extension is private (``native._<name>``) and wrapped by a typed Python module that re-exports it;
every C function has a slow pure-Python reference that the tests compare it against.
"""
