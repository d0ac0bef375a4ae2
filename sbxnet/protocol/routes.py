"""Routes: what the platform registers for a sandbox and what the gateway looks up (docs/scheduler-api.md).

Pure: JSON bytes in, a typed value or a ``RouteError`` out, and back. Both ends use it: the scheduler
decodes the platform's ``PUT /v1/sandboxes/{id}`` body (``pull_registration``) and encodes the route the
gateway asks for (``push_route``); the gateway decodes that answer (``pull_route``). Every field is
checked and unknown fields are refused, so a typo never silently means "default".

Reason tokens (``RouteError.reason``): ``not_json``, ``not_object``, ``unknown_field``, ``missing_field``,
``bad_type``, ``bad_sandbox``, ``bad_incarnation``, ``bad_address``, ``bad_pin``, ``bad_ip``, ``bad_port``,
``bad_protocol``, ``bad_auth``, ``bad_token_hash``, ``bad_number``, ``bad_activity``, ``bad_state``,
``no_token``, ``default_port_not_exposed``, ``too_long``.

A forwarder is pinned by a set of keys (``spki_pins``, 1..``MAX_PINS``): the key it has now, and during a
rotation the next one (docs/forwarder.md, "Rotating a forwarder's key"). The body gives either
``spki_pins`` (a list; duplicates count once) or ``spki_pin`` (one pin, the field as it was before the set);
the encoders always write ``spki_pins``, sorted.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from sbxnet.errors import LocalProtocolError, RemoteProtocolError

Protocol = Literal["http", "h2c", "tcp"]
Auth = Literal["public", "token", "client_cert"]
Activity = Literal["bytes", "connections"]
State = Literal["active", "idle", "stopping", "stopped", "waking"]

PROTOCOLS: tuple[str, ...] = ("http", "h2c", "tcp")
AUTHS: tuple[str, ...] = ("public", "token", "client_cert")
ACTIVITIES: tuple[str, ...] = ("bytes", "connections")
STATES: tuple[str, ...] = ("active", "idle", "stopping", "stopped", "waking")
MAX_BODY = 64 * 1024
MAX_PORTS = 64
MAX_PINS = 4  # the current key, the next, and room to spare: a rotation needs two
DEFAULT_CONNECT_DEADLINE_S = 10.0

# A sandbox ID must be reachable as a host name label: <sandbox>.<domain> and <port>-<sandbox>.<domain>.
# So: lower case (names are case-insensitive), no '.', at most 57 characters (a "65535-" prefix keeps the
# label within DNS's 63), and not itself "<digits>-..." (that would read as the port form).
_SANDBOX = re.compile(r"(?![0-9]+-)[a-z0-9_][a-z0-9_-]{0,56}")
_INCARNATION = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class RouteError(RemoteProtocolError):
    """A route or registration is refused; ``reason`` is one of the module docstring's tokens."""


@dataclass(frozen=True)
class PortSpec:
    protocol: Protocol
    auth: Auth


@dataclass(frozen=True)
class Forwarder:
    host: str  # an IP address literal
    port: int
    spki_pins: tuple[str, ...]  # base64 SHA-256 of each accepted SubjectPublicKeyInfo; sorted, no duplicates

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Route:
    """What the gateway needs to reach a sandbox (the lookup's answer)."""

    sandbox: str
    incarnation: str
    state: State
    forwarder: Forwarder
    target_ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    default_port: int
    ports: dict[int, PortSpec]
    token_sha256: str | None
    connect_deadline_s: float = DEFAULT_CONNECT_DEADLINE_S

    def port_spec(self, port: int | None) -> PortSpec | None:
        """The exposed port ``port`` (None: the default port), or None when it is not exposed."""
        return self.ports.get(self.default_port if port is None else port)


@dataclass(frozen=True)
class Registration:
    """What the platform registers (``PUT /v1/sandboxes/{sandbox}``): the route's parts plus the timer's."""

    incarnation: str
    forwarder: Forwarder
    target_ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    default_port: int
    ports: dict[int, PortSpec]
    token_sha256: str | None
    idle_period_s: float
    activity: Activity = "bytes"
    connect_deadline_s: float = DEFAULT_CONNECT_DEADLINE_S

    def route(self, sandbox: str, state: State) -> Route:
        return Route(
            sandbox=sandbox,
            incarnation=self.incarnation,
            state=state,
            forwarder=self.forwarder,
            target_ip=self.target_ip,
            default_port=self.default_port,
            ports=dict(self.ports),
            token_sha256=self.token_sha256,
            connect_deadline_s=self.connect_deadline_s,
        )


# -- checks -------------------------------------------------------------------------------------------


def check_sandbox_id(value: object) -> str:
    if not isinstance(value, str) or not _SANDBOX.fullmatch(value):
        raise RouteError("bad_sandbox", "1..57 of [a-z0-9_-], not starting with digits and '-'")
    return value


def _load(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_BODY:
        raise RouteError("too_long", f"{len(data)} bytes > {MAX_BODY}")
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_int=_small_int)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, _NonFinite) as e:
        raise RouteError("not_json", type(e).__name__) from None
    except _HugeNumber:
        raise RouteError("bad_number", f"an integer of more than {_MAX_INT_DIGITS} digits") from None
    if not isinstance(obj, dict):
        raise RouteError("not_object")
    return obj


class _NonFinite(ValueError):
    pass


class _HugeNumber(Exception):
    pass


# No field takes more than a port or a few seconds: a long digit string is refused before int() sees it
# (Python refuses over 4,300 digits with a ValueError, and a huge int overflows float checks).
_MAX_INT_DIGITS = 18


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise _HugeNumber
    return int(text)


def _no_constant(name: str) -> None:
    raise _NonFinite(name)  # NaN, Infinity: not JSON numbers


def _fields(obj: dict[str, Any], required: set[str], optional: set[str], where: str) -> None:
    unknown = set(obj) - required - optional
    if unknown:
        raise RouteError("unknown_field", f"{where}: {sorted(unknown)[0][:40]!r}")
    missing = required - set(obj)
    if missing:
        raise RouteError("missing_field", f"{where}: {sorted(missing)[0]}")


def _str(obj: dict[str, Any], key: str) -> str:
    v = obj[key]
    if not isinstance(v, str):
        raise RouteError("bad_type", f"{key} must be a string")
    return v


def _port(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
        raise RouteError("bad_port", f"{what} must be 1..65535")
    return v


def _port_key(k: str) -> int:
    if not k.isascii() or not k.isdigit() or len(k) > 5 or k != str(int(k)):
        raise RouteError("bad_port", f"port key {k[:8]!r}")
    return _port(int(k), "port")


def _positive(obj: dict[str, Any], key: str, default: float | None = None, *, cap: float = 86400 * 365) -> float:
    if key not in obj:
        assert default is not None
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 < v <= cap:
        raise RouteError("bad_number", f"{key} must be a number in (0, {cap}]")
    return float(v)


def _forwarder(v: object) -> Forwarder:
    if not isinstance(v, dict):
        raise RouteError("bad_type", "forwarder must be an object")
    _fields(v, {"address"}, {"spki_pin", "spki_pins"}, "forwarder")
    address = _str(v, "address")
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise RouteError("bad_address", "forwarder.address must be ip:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise RouteError("bad_address", "forwarder.address must be an IP literal and a port") from None
    if ":" in host and not address.startswith("["):
        raise RouteError("bad_address", "an IPv6 forwarder address is written [ip]:port")
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        raise RouteError("bad_address", "forwarder.address: no IPv6 zone (a route names a routable address)")
    port = _port_key(port_text) if port_text else _port(0, "forwarder port")
    return Forwarder(str(ip), port, _pins(v))


def _pins(v: dict[str, Any]) -> tuple[str, ...]:
    if "spki_pin" in v and "spki_pins" in v:
        raise RouteError("bad_pin", "forwarder: give spki_pins or spki_pin, not both")
    if "spki_pin" in v:
        return (_pin(_str(v, "spki_pin"), "spki_pin"),)
    if "spki_pins" not in v:
        raise RouteError("missing_field", "forwarder: spki_pins")
    pins = v["spki_pins"]
    if not isinstance(pins, list):
        raise RouteError("bad_type", "spki_pins must be a list of pins")
    if not pins:
        raise RouteError("bad_pin", f"spki_pins must hold 1 to {MAX_PINS} pins")
    if len(pins) > MAX_PINS:
        raise RouteError("too_long", f"more than {MAX_PINS} spki_pins")
    for pin in pins:
        if not isinstance(pin, str):
            raise RouteError("bad_type", "each of spki_pins must be a string")
        _pin(pin, "each of spki_pins")
    return tuple(sorted(set(pins)))


def _pin(pin: str, what: str) -> str:
    try:
        raw = base64.b64decode(pin, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32 or base64.b64encode(raw).decode() != pin:
        # Canonical form only: pins are compared as strings, so another spelling of the same digest
        # (stray bits in the last character) would never match.
        raise RouteError("bad_pin", f"{what} must be the canonical base64 of a SHA-256 digest")
    return pin


def _ip(v: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if not isinstance(v, str):
        raise RouteError("bad_type", "target_ip must be a string")
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        raise RouteError("bad_ip", "target_ip must be an IP address") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        raise RouteError("bad_ip", "target_ip: no IPv6 zone")
    return ip


def _ports(v: object) -> dict[int, PortSpec]:
    if not isinstance(v, dict) or not v:
        raise RouteError("bad_type", "ports must be a non-empty object")
    if len(v) > MAX_PORTS:
        raise RouteError("too_long", f"more than {MAX_PORTS} ports")
    out: dict[int, PortSpec] = {}
    for k, spec in v.items():
        port = _port_key(k)
        if not isinstance(spec, dict):
            raise RouteError("bad_type", f"ports.{port} must be an object")
        _fields(spec, {"protocol", "auth"}, set(), f"ports.{port}")
        protocol, auth = spec["protocol"], spec["auth"]
        if protocol not in PROTOCOLS:
            raise RouteError("bad_protocol", f"ports.{port}.protocol: one of {', '.join(PROTOCOLS)}")
        if auth not in AUTHS:
            raise RouteError("bad_auth", f"ports.{port}.auth: one of {', '.join(AUTHS)}")
        allowed = ("public", "client_cert") if protocol == "tcp" else ("public", "token")
        if auth not in allowed:
            raise RouteError("bad_auth", f"ports.{port}: {protocol} ports are {' or '.join(allowed)}")
        out[port] = PortSpec(protocol, auth)
    return out


def _common(obj: dict[str, Any]) -> dict[str, Any]:
    incarnation = obj["incarnation"]
    if not isinstance(incarnation, str) or not _INCARNATION.fullmatch(incarnation):
        raise RouteError("bad_incarnation", "1..64 of [A-Za-z0-9._-]")
    ports = _ports(obj["ports"])
    default_port = _port(obj["default_port"], "default_port")
    if default_port not in ports:
        raise RouteError("default_port_not_exposed", f"default_port {default_port} is not in ports")
    token = obj.get("token_sha256")
    if token is not None and (not isinstance(token, str) or not _HEX64.fullmatch(token)):
        raise RouteError("bad_token_hash", "token_sha256 must be 64 lower-case hex digits")
    if token is None and any(p.auth == "token" for p in ports.values()):
        raise RouteError("no_token", "a port with auth token needs token_sha256")
    return {
        "incarnation": incarnation,
        "forwarder": _forwarder(obj["forwarder"]),
        "target_ip": _ip(obj["target_ip"]),
        "default_port": default_port,
        "ports": ports,
        "token_sha256": token,
        "connect_deadline_s": _positive(obj, "connect_deadline_s", DEFAULT_CONNECT_DEADLINE_S, cap=300),
    }


_COMMON_REQUIRED = {"incarnation", "forwarder", "target_ip", "default_port", "ports"}
_COMMON_OPTIONAL = {"token_sha256", "connect_deadline_s"}


def pull_registration(data: bytes) -> Registration:
    """The platform's registration body; ``RouteError`` for anything the contract does not allow."""
    obj = _load(data)
    _fields(obj, _COMMON_REQUIRED | {"idle_period_s"}, _COMMON_OPTIONAL | {"activity"}, "registration")
    common = _common(obj)
    activity = obj.get("activity", "bytes")
    if activity not in ACTIVITIES:
        raise RouteError("bad_activity", f"activity: one of {', '.join(ACTIVITIES)}")
    return Registration(**common, idle_period_s=_positive(obj, "idle_period_s"), activity=activity)


def pull_route(data: bytes) -> Route:
    """The scheduler's answer to ``GET /v1/routes/{sandbox}``."""
    obj = _load(data)
    _fields(obj, _COMMON_REQUIRED | {"sandbox", "state"}, _COMMON_OPTIONAL, "route")
    sandbox = check_sandbox_id(obj["sandbox"])
    state = obj["state"]
    if state not in STATES:
        raise RouteError("bad_state", f"state: one of {', '.join(STATES)}")
    return Route(sandbox=sandbox, state=state, **_common(obj))


def _common_json(r: Route | Registration) -> dict[str, Any]:
    out: dict[str, Any] = {
        "incarnation": r.incarnation,
        "forwarder": {"address": r.forwarder.address, "spki_pins": list(r.forwarder.spki_pins)},
        "target_ip": str(r.target_ip),
        "default_port": r.default_port,
        "ports": {str(p): {"protocol": s.protocol, "auth": s.auth} for p, s in sorted(r.ports.items())},
        "connect_deadline_s": r.connect_deadline_s,
    }
    if r.token_sha256 is not None:
        out["token_sha256"] = r.token_sha256
    return out


def push_route(r: Route) -> bytes:
    """Encode ``r``; ``LocalProtocolError`` if it would not decode (the caller built it wrong)."""
    obj = {"sandbox": r.sandbox, "state": r.state, **_common_json(r)}
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    try:
        pull_route(data)
    except RouteError as e:
        raise LocalProtocolError(e.reason, e.detail) from None
    return data


def push_registration(r: Registration) -> bytes:
    obj = {**_common_json(r), "idle_period_s": r.idle_period_s, "activity": r.activity}
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    try:
        pull_registration(data)
    except RouteError as e:
        raise LocalProtocolError(e.reason, e.detail) from None
    return data
