"""The data planes that move tenant bytes after the status: ``userspace`` (TLS in user space) and ``ktls``."""
