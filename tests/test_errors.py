"""The error tree: every error we raise sits on exactly one branch of blame and hints at one answer."""

from __future__ import annotations

import pytest

from forwarder.egress.errors import FrameRefused
from forwarder.ingress.planes.ktls import KtlsUnavailable
from forwarder.ingress.target_guard import TargetRefused
from forwarder.taps.errors import InvalidMacError, TapError, TapNetlinkError
from sbxnet.errors import ConfigError, EnvironmentFault, LocalProtocolError, RemoteProtocolError, SbxnetError
from sbxnet.listen import ListenError
from sbxnet.protocol.preamble import PreambleError
from sbxnet.protocol.status import Status, StatusError

BRANCHES = (RemoteProtocolError, LocalProtocolError, EnvironmentFault)


@pytest.mark.parametrize(
    ("cls", "branch", "hint"),
    [
        (PreambleError, RemoteProtocolError, Status.BAD_PREAMBLE),
        (StatusError, RemoteProtocolError, Status.BAD_PREAMBLE),
        (TargetRefused, RemoteProtocolError, Status.FORBIDDEN),
        (FrameRefused, RemoteProtocolError, Status.BAD_PREAMBLE),
        (LocalProtocolError, LocalProtocolError, Status.INTERNAL),
        (ConfigError, EnvironmentFault, Status.UNAVAILABLE),
        (ListenError, EnvironmentFault, Status.UNAVAILABLE),
        (TapError, EnvironmentFault, Status.UNAVAILABLE),
        (InvalidMacError, EnvironmentFault, Status.UNAVAILABLE),
        (TapNetlinkError, EnvironmentFault, Status.UNAVAILABLE),
        (KtlsUnavailable, EnvironmentFault, Status.UNAVAILABLE),
    ],
)
def test_each_error_has_one_branch_and_a_hint(cls: type[SbxnetError], branch: type, hint: Status) -> None:
    assert issubclass(cls, SbxnetError)
    assert [b for b in BRANCHES if issubclass(cls, b)] == [branch]
    assert cls.status_hint is hint


def test_a_hint_can_be_given_per_instance_without_changing_the_class() -> None:
    e = RemoteProtocolError("x", status_hint=Status.FORBIDDEN)
    assert e.status_hint is Status.FORBIDDEN
    assert RemoteProtocolError("y").status_hint is Status.BAD_PREAMBLE
    assert str(e) == "x" and str(RemoteProtocolError("r", "d")) == "r: d"


def test_config_error_prints_its_message_alone() -> None:
    assert str(ConfigError("forwarder.listen_port = 70000: too big")) == "forwarder.listen_port = 70000: too big"
