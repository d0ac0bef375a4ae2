"""The control API's request bodies and claim ids: untrusted bytes in, a typed request or a ``ControlError``.

Pure (no sockets): ``control_api.py`` hands each body here before anything acts on it. A body is at most
``MAX_BODY`` bytes of UTF-8 JSON holding one object; JSON's non-standard constants (``NaN``,
``Infinity``), a number too large for a float and a key given twice are refused, so one body cannot
mean two things to two parsers.
Every field is checked and unknown fields are refused, so a typo never silently means "default".

- ``pull_arm(claim_id, body)``: ``{"uds", "exit", "policy"?, "limits"?}`` → ``ClaimRequest`` (no address:
  the allocator gives it).
- ``pull_exit(body)``: ``{"exit": label}`` → the label.
- ``pull_import(body)``: an exported claim (``ClaimState``: ``id``, ``address``, ``exit``, ``uds``,
  ``policy``, ``limits``, ``enabled``, ``quota_used``).
- ``check_claim_id(text)``: a claim id from the URL.

Reasons (``ControlError.reason``, each answered 400): ``too_long``, ``not_utf8``, ``not_json``,
``not_object``, ``unknown_field``, ``missing_field``, ``bad_field``, ``bad_claim_id``. The detail names
the field, never echoes more than a few characters of the input.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forwarder.egress.router.claims import ClaimRequest, ClaimState, LimitsSpec, PolicySpec
from sbxnet.errors import RemoteProtocolError

MAX_BODY = 64 * 1024
_CLAIM_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class ControlError(RemoteProtocolError):
    """A request the control API refuses; ``status`` is the HTTP answer (400 for every body fault)."""

    def __init__(self, reason: str, detail: str = "", status: int = 400) -> None:
        super().__init__(reason, detail)
        self.status = status


class _ArmBody(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uds: str
    exit: str
    policy: PolicySpec = Field(default_factory=PolicySpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)


class _ExitBody(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    exit: str = Field(min_length=1, max_length=64)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k[:32]!r} given twice")
        out[k] = v
    return out


def pull_json_object(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_BODY:
        raise ControlError("too_long", f"body of {len(body)} bytes, at most {MAX_BODY}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ControlError("not_utf8", "the body is not UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ControlError("not_json", "nested too deeply") from None
    except ValueError as e:
        raise ControlError("not_json", str(e).splitlines()[0][:120]) from None
    if not isinstance(value, dict):
        raise ControlError("not_object", "the body must be one JSON object")
    return value


def _field(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) if isinstance(p, int) else p[:32] for p in loc) or "(body)"


def _from_validation(e: ValidationError) -> ControlError:
    err = e.errors()[0]
    kind = err["type"]
    where = _field(tuple(err["loc"]))
    if kind == "extra_forbidden":
        return ControlError("unknown_field", f"{where}: no such field")
    if kind == "missing":
        return ControlError("missing_field", f"{where}: required")
    msg = str(err.get("msg", "")).splitlines()[0][:160]
    return ControlError("bad_field", f"{where}: {msg}")


M = TypeVar("M", bound=BaseModel)


def _strict(model: type[M], raw: dict[str, Any]) -> M:
    # Strict, from JSON: a string is never taken for a number or a bool ("1", "yes"), a float never for an
    # integer; addresses and paths come as JSON strings.
    return model.model_validate_json(json.dumps(raw), strict=True)


def check_claim_id(text: str) -> str:
    if not _CLAIM_ID.fullmatch(text):
        raise ControlError("bad_claim_id", "a claim id is 1-128 of A-Z a-z 0-9 . _ : -")
    return text


def pull_arm(claim_id: str, body: bytes) -> ClaimRequest:
    check_claim_id(claim_id)
    raw = pull_json_object(body)
    try:
        arm = _strict(_ArmBody, raw)
        return _strict(ClaimRequest, {"id": claim_id, **arm.model_dump(mode="json")})
    except ValidationError as e:
        raise _from_validation(e) from None


def pull_exit(body: bytes) -> str:
    raw = pull_json_object(body)
    try:
        return _strict(_ExitBody, raw).exit
    except ValidationError as e:
        raise _from_validation(e) from None


def pull_import(body: bytes) -> ClaimState:
    raw = pull_json_object(body)
    try:
        return _strict(ClaimState, raw)
    except ValidationError as e:
        raise _from_validation(e) from None


def push_state(state: ClaimState) -> bytes:
    """The export form, which ``pull_import`` reads back to an equal value."""
    return state.model_dump_json().encode()
