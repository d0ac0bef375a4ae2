"""Gateway names: which sandbox and port a TLS server name, a Host or an ``:authority`` asks for.

Pure: text in, a ``Name`` or a ``NameRefused`` out. No sockets, no clocks.

Under the configured domain (say ``sandbox.example.com``) a sandbox's exposed ports are::

    <port>-<sandbox>.<domain>    that port
    <sandbox>.<domain>           the sandbox's default port (``Name.port`` is None)

What a name may look like, and why:

- Letter case does not matter (DNS names are case-insensitive): the name is lower-cased, so the
  sandbox in a ``Name`` is always lower case. A sandbox whose ID has upper-case letters cannot be named
  (``host_of`` refuses it).
- One trailing dot (the absolute DNS form, ``a.sandbox.example.com.``) is accepted and dropped; two are not.
- Exactly one label under the domain: ``a.b.<domain>`` is refused (``nested_label``), which is also
  what a ``*.<domain>`` certificate covers.
- A label that starts with digits and a hyphen is always the port form; the digits must be a port
  (1..65535, no leading zero) or the name is refused (``bad_port``). That keeps the two forms apart:
  a sandbox whose ID itself starts with ``<digits>-`` is named by the port form only
  (``8080-8080-web`` is port 8080 of ``8080-web``).
- The sandbox is 1..64 of ``[A-Za-z0-9_-]`` (the route contract's rule: the preamble's alphabet
  without ``.``).
- IP literals (``[::1]``, ``127.0.0.1``) name no sandbox (``ip_literal``).
- A Host or ``:authority`` may carry a port: the listener's own port or the scheme's default (443 for
  https) is ignored, any other is refused (``wrong_port``); an empty port, a leading zero or userinfo
  (``user@host``) is malformed (``bad_authority``).
- An HTTP/1.1 absolute-form target (``https://host/path``) names the authority; the Host header is
  then ignored, as RFC 9112 section 3.2.2 requires (the front must send the target's host upstream).

Reason tokens (``NameRefused.reason``; stable, counted by metrics):

    empty           nothing to parse
    too_long        longer than a DNS name can be (253 characters, 254 with the trailing dot)
    bad_char        a character no host name has (not ASCII, space, control, anything outside [A-Za-z0-9._-])
    empty_label     two dots in a row, a leading dot, or more than one trailing dot
    ip_literal      an IPv4 or IPv6 address, bracketed or bare
    outside_domain  not under the configured domain (the domain itself included)
    nested_label    more than one label under the domain
    bad_port        the port label is not 1..65535 written without a leading zero
    bad_sandbox     the sandbox part is empty or longer than 64 characters
    bad_authority   userinfo, an empty or malformed port
    wrong_port      a port in Host / :authority that is neither the listener's nor the scheme's default
    bad_target      a request target that is neither origin-form, ``*``, nor an absolute URI of our scheme
    missing_host    an HTTP/1.1 request without Host, or an HTTP/2 request without :authority and Host
    duplicate_host  more than one Host header
    host_mismatch   an HTTP/2 request whose Host names something else than its :authority
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sbxnet.errors import ConfigError, LocalProtocolError, RemoteProtocolError

MAX_HOST = 253  # a DNS name without its trailing dot
_SANDBOX = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_HOST_CHARS = re.compile(r"[a-z0-9._-]*")
_V4_CHARS = re.compile(r"[0-9.]*")
_PORT_LABEL = re.compile(r"([0-9]+)-(.*)", re.S)
_DOMAIN_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_SCHEME_DEFAULT_PORT = {"https": 443, "http": 80}
_KNOWN_MAX = 1024  # authorities remembered by Names.parse_authority


class NameRefused(RemoteProtocolError):
    """A server name, Host, ``:authority`` or request target the gateway refuses; ``reason`` is one of
    the module docstring's tokens. ``detail`` never repeats the peer's text."""


@dataclass(frozen=True)
class Name:
    sandbox: str  # lower case, 1..64 of [a-z0-9_-]
    port: int | None  # None: the sandbox's default port


def _ascii(value: str | bytes, limit: int) -> str:
    if len(value) > limit:
        raise NameRefused("too_long", f"{len(value)} characters")
    if isinstance(value, bytes):
        if not value.isascii():
            raise NameRefused("bad_char", "not ASCII")
        return value.decode("ascii")
    if not value.isascii():
        raise NameRefused("bad_char", "not ASCII")
    return value


def _is_ip(text: str) -> bool:
    # An IPv4 address is digits and dots only and an IPv6 one has a colon, so any other text is no
    # address: known without ipaddress's two failed parses (an exception each), which every request's
    # Host paid twice.
    if ":" not in text and not _V4_CHARS.fullmatch(text):
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class Names:
    """The naming scheme under one domain, for a listener on ``listen_port`` serving ``scheme``.

    ``ConfigError`` at construction for a domain that is not a plain DNS name (LDH labels, its last
    label not numeric, so no name under it can read as an IPv4 address) or a port out of range.
    """

    def __init__(self, domain: str, *, listen_port: int = 443, scheme: str = "https") -> None:
        d = domain.lower()
        d = d[:-1] if d.endswith(".") else d
        labels = d.split(".")
        if (
            not d.isascii()
            or len(d) > 180
            or not all(_DOMAIN_LABEL.fullmatch(label) for label in labels)
            or labels[-1].isdigit()
        ):
            raise ConfigError(
                f"gateway.domain = {domain!r}: a DNS name of letters, digits and inner hyphens per label, "
                "at most 180 characters, its last label not all digits"
            )
        if isinstance(listen_port, bool) or not isinstance(listen_port, int) or not 1 <= listen_port <= 65535:
            raise ConfigError(f"gateway.listen_port = {listen_port!r}: 1..65535")
        if scheme not in _SCHEME_DEFAULT_PORT:
            raise ConfigError(f"gateway scheme = {scheme!r}: https or http")
        self.domain = d
        self.scheme = scheme
        self.listen_port = listen_port
        self.accepted_ports = frozenset({listen_port, _SCHEME_DEFAULT_PORT[scheme]})
        self._suffix = "." + d
        # Authorities parsed before, and what they named: a client sends the same Host on every request,
        # and each request's was parsed twice (request_target, requested_port). Only accepted ones are
        # kept (a refusal is raised afresh), at most _KNOWN_MAX, forgotten all at once when full.
        self._known: dict[str | bytes, Name] = {}

    # -- pull ------------------------------------------------------------------------------------

    def parse_host(self, host: str | bytes) -> Name:
        """A host name without a port (a TLS server name, or the host part of an authority)."""
        text = _ascii(host, MAX_HOST + 1)
        if not text:
            raise NameRefused("empty")
        if text.startswith("["):
            raise NameRefused("ip_literal", "bracketed IPv6")
        if text.endswith("."):
            text = text[:-1]
        if _is_ip(text):
            raise NameRefused("ip_literal")
        if len(text) > MAX_HOST:
            raise NameRefused("too_long", f"{len(text)} characters")
        text = text.lower()
        if not _HOST_CHARS.fullmatch(text):
            raise NameRefused("bad_char")
        if not text or text.startswith(".") or ".." in text or text.endswith("."):
            raise NameRefused("empty_label")
        if not text.endswith(self._suffix):
            raise NameRefused("outside_domain")
        label = text[: -len(self._suffix)]
        if "." in label:
            raise NameRefused("nested_label")
        m = _PORT_LABEL.fullmatch(label)
        port: int | None = None
        if m is not None:
            digits, label = m.group(1), m.group(2)
            if not _PORT.fullmatch(digits) or int(digits) > 65535:
                raise NameRefused("bad_port", f"{len(digits)} digits")
            port = int(digits)
        if not _SANDBOX.fullmatch(label):
            raise NameRefused("bad_sandbox", f"{len(label)} characters")
        return Name(label, port)

    def parse_sni(self, server_name: str | bytes | None) -> Name | None:
        """The TLS server name; None when the client sent none (then each request's authority routes)."""
        if server_name is None:
            return None
        return self.parse_host(server_name)

    def parse_authority(self, authority: str | bytes) -> Name:
        """A Host header value or an HTTP/2 ``:authority``: ``host`` or ``host:port``."""
        known = self._known.get(authority)
        if known is not None:
            return known
        name = self._parse_authority(authority)
        if len(self._known) >= _KNOWN_MAX:
            self._known.clear()
        self._known[authority] = name
        return name

    def _parse_authority(self, authority: str | bytes) -> Name:
        text = _ascii(authority, MAX_HOST + 1 + 6)
        if "@" in text:
            raise NameRefused("bad_authority", "userinfo")
        if text.startswith("["):
            raise NameRefused("ip_literal", "bracketed IPv6")
        host, sep, port_text = text.rpartition(":")
        if not sep:
            return self.parse_host(text)
        if ":" in host:
            raise NameRefused("ip_literal", "bare IPv6") if _is_ip(text) else NameRefused("bad_authority", "colons")
        if not _PORT.fullmatch(port_text) or int(port_text) > 65535:
            raise NameRefused("bad_authority", "port")
        if int(port_text) not in self.accepted_ports:
            raise NameRefused("wrong_port", port_text)
        return self.parse_host(host)

    def authority_of_target(self, target: str | bytes) -> str | None:
        """The authority of an absolute-form target (``https://host:port/path?q``); None for origin-form
        (``/path``) and ``*``; ``bad_target`` for anything else (authority-form, another scheme)."""
        if target[:1] in ("/", b"/") or target in ("*", b"*"):
            return None
        text = _ascii(target, 1 << 16)
        prefix = self.scheme + "://"
        if text[: len(prefix)].lower() != prefix:
            raise NameRefused("bad_target", "not origin-form or absolute-form of our scheme")
        rest = text[len(prefix) :]
        end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        authority = rest[:end]
        if not authority:
            raise NameRefused("bad_target", "no authority")
        return authority

    def request_name(
        self,
        target: str | bytes,
        hosts: Sequence[str | bytes],
        *,
        authority: str | bytes | None = None,
        http2: bool = False,
        http10: bool = False,
    ) -> Name | None:
        """The name one request asks for.

        HTTP/1.x (``http2`` false): an absolute-form ``target`` names it (Host ignored, RFC 9112 3.2.2);
        otherwise the one Host header. More than one Host is refused; none is refused for HTTP/1.1 and
        gives None for HTTP/1.0 (``http10``: the caller routes by the server name).
        HTTP/2: ``authority`` (the pseudo-header) or else the one Host header; when both are present they
        must name the same thing (RFC 9113 8.3.1).
        """
        if len(hosts) > 1:
            raise NameRefused("duplicate_host", f"{len(hosts)} Host headers")
        if http2:
            from_host = self.parse_authority(hosts[0]) if hosts else None
            if authority is None:
                if from_host is None:
                    raise NameRefused("missing_host")
                return from_host
            name = self.parse_authority(authority)
            if from_host is not None and from_host != name:
                raise NameRefused("host_mismatch")
            return name
        absolute = self.authority_of_target(target)
        if absolute is not None:
            return self.parse_authority(absolute)
        if not hosts:
            if http10:
                return None
            raise NameRefused("missing_host")
        return self.parse_authority(hosts[0])

    # -- push ------------------------------------------------------------------------------------

    def host_of(self, name: Name) -> str:
        """The canonical host name for ``name`` (what ``parse_host`` reads back as ``name``).

        ``LocalProtocolError`` for a name no host name can carry: a sandbox outside the alphabet or with
        upper-case letters, a port out of range, or a default-port name whose sandbox starts with
        ``<digits>-`` (it would read as the port form)."""
        sandbox, port = name.sandbox, name.port
        if not isinstance(sandbox, str) or not _SANDBOX.fullmatch(sandbox) or sandbox != sandbox.lower():
            raise LocalProtocolError("bad_sandbox", f"{sandbox!r} cannot be named")
        if port is None:
            if _PORT_LABEL.fullmatch(sandbox):
                raise LocalProtocolError("ambiguous_name", f"{sandbox!r} needs its port in the name")
            return f"{sandbox}{self._suffix}"
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise LocalProtocolError("bad_port", f"{port!r}")
        return f"{port}-{sandbox}{self._suffix}"
