"""Fuzz target for the gateway's name parser (atheris-style: ``one_input(data)``).

The first byte of ``data`` picks the entry point, the rest is its input:

    0 ``parse_host``   1 ``parse_sni``   2 ``parse_authority``   3 ``authority_of_target``
    4 ``request_name`` for HTTP/1.1: ``<target>\\n<Host>`` (no newline: no Host)
    5 ``request_name`` for HTTP/2: ``<:authority>\\n<Host>`` (no newline: no Host)
    6 ``request_rules.upstream_target`` for HTTP/1.1: ``<method> <target>`` (no space: method GET)
    7 ``request_rules.upstream_target`` for HTTP/2 (``:path``): ``<method> <target>`` likewise

Invariant: each returns a ``Name`` (or None, an authority string, a target) or raises ``NameRefused``
(``RequestRefused`` for 6 and 7), nothing else. A ``Name`` is canonical: the builder names it
(``host_of``), that host parses back to it, and for ``parse_host`` / ``parse_authority`` it is the input
itself lower-cased, without its trailing dot and
without an accepted port. What ``upstream_target`` lets through to the sandbox (nothing of a refused
target does) is origin-form, printable, with no fragment, or ``*`` for OPTIONS: an origin-form target
unchanged, an absolute-form one (HTTP/1.1 only) as what follows its authority, the authority being the
one ``authority_of_target`` gives (what the request is routed by). ``classify(data)`` is ``"ok"`` or
the refusal's reason (seed names are ``<expected>-<what>``).
"""

from __future__ import annotations

from gateway.names import Name, NameRefused, Names
from gateway.request_rules import RequestRefused, upstream_target

DOMAIN = "sandbox.example.com"
LISTEN_PORT = 8443
NAMES = Names(DOMAIN, listen_port=LISTEN_PORT)
ENTRY_POINTS = 8


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
    if which in (6, 7):
        return _target(buf, http2=which == 7)
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


def _target(buf: bytes, *, http2: bool) -> bytes:
    method, sep, target = buf.partition(b" ")
    if not sep:
        method, target = b"GET", buf
    out = upstream_target(method, target, scheme=NAMES.scheme, http2=http2)
    if b"#" in out or not out.isascii() or not all(0x21 <= b <= 0x7E for b in out):
        raise AssertionError(f"{target!r} went upstream as {out!r}")
    if out == b"*":
        if (method, target) != (b"OPTIONS", b"*"):
            raise AssertionError(f"* went upstream for {method!r} {target!r}")
        return out
    if not out.startswith(b"/"):
        raise AssertionError(f"{target!r} went upstream as {out!r}, not origin-form")
    if target.startswith(b"/"):
        if out != target:
            raise AssertionError(f"origin-form {target!r} went upstream as {out!r}")
        return out
    if http2:
        raise AssertionError(f"an HTTP/2 :path {target!r} that is not origin-form went upstream")
    authority = NAMES.authority_of_target(target)  # what routes it; raises for what upstream_target let by
    if authority is None:
        raise AssertionError(f"{target!r} went upstream with no authority")
    prefix = len(NAMES.scheme) + 3 + len(authority)
    rest = target[prefix:]
    if out != (rest if rest.startswith(b"/") else b"/" + rest):
        raise AssertionError(f"{target!r} went upstream as {out!r}, not what follows its authority")
    return out


def one_input(data: bytes) -> None:
    try:
        _run(data)
    except (NameRefused, RequestRefused) as e:
        if not e.reason or not e.reason.isidentifier():
            raise AssertionError(f"reason {e.reason!r} is not a token") from None


def classify(data: bytes) -> str:
    try:
        _run(data)
    except (NameRefused, RequestRefused) as e:
        return e.reason
    return "ok"


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
