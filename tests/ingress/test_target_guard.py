"""Target guard: the forwarder is never an open relay. Pure judging, plus the host-address adapter
checked against a network namespace this test creates."""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.ingress.host_addrs import _from_socket, host_addresses
from forwarder.ingress.target_guard import TargetPolicy, TargetRefused, canonical, judge_target
from sbxnet.errors import RemoteProtocolError

ip = ipaddress.ip_address
net = ipaddress.ip_network
EVERYTHING = (net("0.0.0.0/0"), net("::/0"))
WIDE_OPEN = TargetPolicy(prefixes=EVERYTHING)
SANDBOXES = TargetPolicy(prefixes=(net("10.200.0.0/16"), net("fd00:5b::/48")))


def reason_of(addr: str, port: int = 8080, policy: TargetPolicy = WIDE_OPEN) -> str | None:
    try:
        judge_target(ip(addr), port, policy)
    except TargetRefused as e:
        assert isinstance(e, RemoteProtocolError)
        return e.reason
    return None


# Refused even when the prefixes cover the whole address space.
ALWAYS_REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("::1", "loopback"),
    ("::ffff:127.0.0.1", "loopback"),
    ("169.254.169.254", "link_local"),  # cloud metadata
    ("169.254.0.1", "link_local"),
    ("::ffff:169.254.169.254", "link_local"),
    ("fe80::1", "link_local"),
    ("febf::1", "link_local"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    ("ff05::2", "multicast"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("::", "unspecified"),
    ("::ffff:0.0.0.0", "unspecified"),
    ("255.255.255.255", "broadcast"),
    ("240.0.0.1", "reserved"),
    ("254.1.2.3", "reserved"),
    ("::127.0.0.1", "reserved"),  # deprecated IPv4-compatible form
    ("64:ff9b::7f00:1", "reserved"),  # NAT64 of 127.0.0.1
    ("2002:7f00:1::1", "reserved"),  # 6to4 of 127.0.0.1
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "reserved"),  # Teredo
    ("fec0::1", "reserved"),  # deprecated site-local
]


@pytest.mark.parametrize(("addr", "reason"), ALWAYS_REFUSED)
def test_always_refused_even_with_everything_in_prefix(addr: str, reason: str) -> None:
    assert reason_of(addr) == reason


@pytest.mark.parametrize(("addr", "reason"), ALWAYS_REFUSED)
def test_always_refused_inside_sandbox_prefixes_too(addr: str, reason: str) -> None:
    assert reason_of(addr, policy=SANDBOXES) == reason


@pytest.mark.parametrize(
    "addr", ["10.200.0.2", "10.200.255.254", "fd00:5b::2", "fd00:5b:0:ffff::1", "::ffff:10.200.3.4"]
)
def test_inside_prefixes_allowed(addr: str) -> None:
    assert reason_of(addr, policy=SANDBOXES) is None


@pytest.mark.parametrize(
    "addr", ["10.201.0.1", "10.199.255.255", "192.168.1.1", "8.8.8.8", "fd00:5c::1", "2001:db8::1"]
)
def test_outside_prefixes_refused(addr: str) -> None:
    assert reason_of(addr, policy=SANDBOXES) == "outside_prefixes"


@pytest.mark.parametrize("port", [0, -1, 65536, 1 << 20])
def test_bad_port(port: int) -> None:
    assert reason_of("10.200.0.2", port, SANDBOXES) == "bad_port"


@pytest.mark.parametrize("port", [1, 80, 65535])
def test_good_ports(port: int) -> None:
    assert reason_of("10.200.0.2", port, SANDBOXES) is None


def test_allow_lets_loopback_through() -> None:
    demo = TargetPolicy(prefixes=EVERYTHING, allow=(net("127.0.0.1/32"),))
    assert reason_of("127.0.0.1", policy=demo) is None
    assert reason_of("::ffff:127.0.0.1", policy=demo) is None  # judged as the IPv4 it maps
    assert reason_of("127.0.0.2", policy=demo) == "loopback"  # only what is allowed
    assert reason_of("::1", policy=demo) == "loopback"
    assert reason_of("169.254.169.254", policy=demo) == "link_local"


def test_allow_does_not_widen_the_prefixes() -> None:
    policy = TargetPolicy(prefixes=(net("10.200.0.0/16"),), allow=(net("127.0.0.1/32"),))
    assert reason_of("127.0.0.1", policy=policy) == "outside_prefixes"
    assert reason_of("10.200.0.9", policy=policy) is None


def test_demo_style_policy() -> None:
    demo = TargetPolicy(prefixes=(net("127.0.0.0/8"),), allow=(net("127.0.0.1/32"),))
    assert reason_of("127.0.0.1", policy=demo) is None
    assert reason_of("127.0.0.53", policy=demo) == "loopback"
    assert reason_of("10.0.0.1", policy=demo) == "outside_prefixes"


def test_host_addresses_refused_unless_allowed() -> None:
    hosts = frozenset({ip("10.200.0.1"), ip("fd00:5b::1"), ip("::ffff:10.200.0.254")})
    policy = TargetPolicy(prefixes=SANDBOXES.prefixes, host_addresses=hosts)
    assert reason_of("10.200.0.1", policy=policy) == "host_address"
    assert reason_of("::ffff:10.200.0.1", policy=policy) == "host_address"
    assert reason_of("fd00:5b::1", policy=policy) == "host_address"
    assert reason_of("10.200.0.254", policy=policy) == "host_address"  # listed in mapped form
    assert reason_of("10.200.0.2", policy=policy) is None
    allowed = TargetPolicy(prefixes=SANDBOXES.prefixes, allow=(net("10.200.0.1/32"),), host_addresses=hosts)
    assert reason_of("10.200.0.1", policy=allowed) is None


def test_this_hosts_own_addresses_refused() -> None:
    own = host_addresses()
    assert ip("127.0.0.1") in own
    policy = TargetPolicy(prefixes=EVERYTHING, host_addresses=own)
    routable = [a for a in own if not (a.is_loopback or a.is_link_local)]
    if not routable:
        pytest.skip("this host has no address besides loopback and link-local")
    for a in routable:
        assert reason_of(str(a), policy=policy) == "host_address", a
    # without the host list the same addresses would have passed: the refusal is the host rule
    assert all(reason_of(str(a)) is None for a in routable if not a.is_reserved and not a.is_multicast)


def test_canonical() -> None:
    assert canonical(ip("::ffff:10.1.2.3")) == ip("10.1.2.3")
    assert canonical(ipaddress.IPv6Address("fe80::1%eth0")) == ip("fe80::1")
    assert canonical(ip("fd00::1")) == ip("fd00::1")
    assert canonical(ip("10.0.0.1")) == ip("10.0.0.1")


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses(), st.integers(1, 65535))
def test_property_never_allows_a_refused_class(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> None:
    """Whatever passes with the whole address space as prefix is an ordinary unicast address, and what
    passes with the sandbox prefixes lies inside them."""
    try:
        judge_target(addr, port, WIDE_OPEN)
    except TargetRefused as e:
        assert e.reason in {"loopback", "link_local", "multicast", "unspecified", "reserved", "broadcast"}
    else:
        c = canonical(addr)
        assert not (c.is_loopback or c.is_link_local or c.is_multicast or c.is_unspecified or c.is_reserved)
    try:
        judge_target(addr, port, SANDBOXES)
    except TargetRefused:
        pass
    else:
        assert any(canonical(addr) in n for n in SANDBOXES.prefixes)


# --- the host-address adapter, for real, in a namespace of our own ----------------------------------


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.mark.netns
def test_host_addresses_lists_every_interface_in_a_namespace() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a network namespace")
    ns = f"sbxtg-{secrets.token_hex(4)}"
    try:
        _run("ip", "netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace: {e.stderr.decode().strip()}")
    try:
        _run("ip", "-n", ns, "link", "add", "tga0", "type", "veth", "peer", "name", "tga1")
        _run("ip", "-n", ns, "addr", "add", "10.77.0.1/24", "dev", "tga0")
        _run("ip", "-n", ns, "addr", "add", "fd77::1/64", "dev", "tga0", "nodad")
        # point-to-point: our side is IFA_LOCAL, the peer IFA_ADDRESS; both must be listed
        _run("ip", "-n", ns, "addr", "add", "10.78.0.1", "peer", "10.78.0.2/32", "dev", "tga1")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "link", "set", "tga0", "up")
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                "from forwarder.ingress.host_addrs import host_addresses\n"
                "print(' '.join(sorted(str(a) for a in host_addresses())))",
            ],
            check=True,
            capture_output=True,
            timeout=60,
            cwd=root,
            text=True,
        ).stdout.split()
        listed = {ip(a) for a in out}
        for want in ("127.0.0.1", "::1", "10.77.0.1", "fd77::1", "10.78.0.1", "10.78.0.2"):
            assert ip(want) in listed, (want, out)
        policy = TargetPolicy(prefixes=(net("10.77.0.0/16"), net("10.78.0.0/16")), host_addresses=frozenset(listed))
        assert reason_of("10.77.0.1", policy=policy) == "host_address"
        assert reason_of("10.78.0.1", policy=policy) == "host_address"
        assert reason_of("10.77.0.2", policy=policy) is None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def test_socket_fallback_lists_loopback() -> None:
    got = _from_socket()
    assert ip("127.0.0.1") in got and ip("::1") in got
