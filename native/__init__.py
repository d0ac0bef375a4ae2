"""C for the hot paths, built with cffi at install time: one extension per ``build_*.py`` here.

Each extension is private (``native._<name>``), its binding generated from its header, typed by a
``.pyi`` stub, and wrapped by a Python module that re-exports it. What each is checked against (a
pure-Python reference for the egress core; the userspace plane's contract and OpenSSL itself for the
others) is in docs/architecture.md.
"""
