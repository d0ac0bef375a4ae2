"""Fuzz target for the gateway's name parser (atheris-style: ``one_input(data)``).

The first byte of ``data`` picks the entry point, the rest is its input:

    0 ``parse_host``   1 ``parse_sni``   2 ``parse_authority``   3 ``authority_of_target``
    4 ``request_name`` for HTTP/1.1: ``<target>\\n<Host>`` (no newline: no Host)
    5 ``request_name`` for HTTP/2: ``<:authority>\\n<Host>`` (no newline: no Host)

Invariant: each returns a ``Name`` (or None, or an authority string) or raises ``NameRefused``, nothing
else. A ``Name`` is canonical: the builder names it (``host_of``), that host parses back to it, and for
``parse_host`` / ``parse_authority`` it is the input itself lower-cased, without its trailing dot and
without an accepted port. ``classify(data)`` is ``"ok"`` or the refusal's reason (seed names are
``<expected>-<what>``).
"""

from __future__ import annotations

from gateway.names import Name, NameRefused, Names

DOMAIN = "sandbox.example.com"
LISTEN_PORT = 8443
NAMES = Names(DOMAIN, listen_port=LISTEN_PORT)
ENTRY_POINTS = 6


def _canonical(name: Name) -> str:
    if not isinstance(name, Name):
        raise AssertionError(f"not a Name: {name!r}")
    if name.port is not None and not 1 <= name.port <= 65535:
        raise AssertionError(f"port out of range: {name!r}")
    host = NAMES.host_of(name)  # raises LocalProtocolError (not caught: a failure) if it cannot be named
    if NAMES.parse_host(host) != name:
        raise AssertionError(f"{host!r} does not parse back to {name!r}")
    return host


def _spelled(text: str) -> str:
    """What the input should be once canonical: lower case, no trailing dot, no accepted port."""
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and int(port) in NAMES.accepted_ports:
        text = host
    text = text.lower()
    return text[:-1] if text.endswith(".") else text


def _run(data: bytes) -> object:
    which = data[0] % ENTRY_POINTS if data else 0
    buf = data[1:]
    if which == 0:
        name = NAMES.parse_host(buf)
        if _canonical(name) != _spelled(buf.decode("ascii")):
            raise AssertionError(f"{buf!r} parsed to {name!r}, which is not its own spelling")
        return name
    if which == 1:
        sni = NAMES.parse_sni(buf)
        if sni is not None:
            _canonical(sni)
        return sni
    if which == 2:
        name = NAMES.parse_authority(buf)
        if _canonical(name) != _spelled(buf.decode("ascii")):
            raise AssertionError(f"{buf!r} parsed to {name!r}, which is not its own spelling")
        return name
    if which == 3:
        authority = NAMES.authority_of_target(buf)
        if authority is not None and (not authority or authority not in buf.decode("ascii")):
            raise AssertionError(f"authority {authority!r} is not in {buf!r}")
        return authority
    first, sep, second = buf.partition(b"\n")
    hosts = [second] if sep else []
    if which == 4:
        got = NAMES.request_name(first, hosts)
    else:
        got = NAMES.request_name(b"/", hosts, authority=first, http2=True)
    if got is None:
        raise AssertionError("an HTTP/1.1 or HTTP/2 request without a name")
    _canonical(got)
    return got


def one_input(data: bytes) -> None:
    try:
        _run(data)
    except NameRefused as e:
        if not e.reason or not e.reason.isidentifier():
            raise AssertionError(f"reason {e.reason!r} is not a token") from None


def classify(data: bytes) -> str:
    try:
        _run(data)
    except NameRefused as e:
        return e.reason
    return "ok"


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
