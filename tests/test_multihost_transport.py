"""The NIXL transport's UCX options (transports, devices, TCP ports) for P and D on different hosts.

Validation is pure; one test creates a real agent and reads its TCP listeners from /proc to show
``ucx_net_devices`` and ``ucx_tcp_port_range`` reach UCX. Cross-host pushes over these options
are in ``tests/test_multihost_netns.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpush.core.errors import ConfigError
from kvpush.core.transport import TransportConfig
from kvpush.transports.nixl import _parse_options, ucx_settings


def test_no_ucx_options_set_nothing() -> None:
    assert ucx_settings({}) == {}


def test_ucx_options_become_ucx_variables() -> None:
    env = ucx_settings(
        {
            "ucx_tls": ["tcp", "cma"],
            "ucx_net_devices": "eth1, eth2",
            "ucx_tcp_port_range": "41000-41999",
            "ucx_env": {"UCX_TCP_KEEPIDLE": "2"},
        }
    )
    assert env == {
        "UCX_TLS": "tcp,cma",
        "UCX_NET_DEVICES": "eth1,eth2",
        "UCX_TCP_PORT_RANGE": "41000-41999",
        "UCX_TCP_KEEPIDLE": "2",
    }


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"ucx_tls": ""}, "'ucx_tls' must be"),
        ({"ucx_tls": 5}, "'ucx_tls' must be"),
        ({"ucx_tls": ["tcp", ""]}, "'ucx_tls' must be"),
        ({"ucx_net_devices": []}, "'ucx_net_devices' must be"),
        ({"ucx_tcp_port_range": "41000"}, "'ucx_tcp_port_range' must be 'LOW-HIGH'"),
        ({"ucx_tcp_port_range": "5-2"}, "'ucx_tcp_port_range' must be 'LOW-HIGH'"),
        ({"ucx_tcp_port_range": "1-70000"}, "'ucx_tcp_port_range' must be 'LOW-HIGH'"),
        ({"ucx_env": {"TLS": "tcp"}}, "'ucx_env' must map UCX_"),
        ({"ucx_env": {"UCX_TLS": 1}}, "'ucx_env' must map UCX_"),
        ({"ucx_devices": "eth0"}, "unknown nixl transport options"),
    ],
)
def test_bad_ucx_options_are_refused_naming_the_option(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _parse_options(options)


def _listeners() -> list[tuple[str, int]]:
    """``(address, port)`` of this process's listening IPv4 TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            address, port = fields[1].split(":")
            found.append((".".join(str(b) for b in bytes.fromhex(address)[::-1]), int(port, 16)))
    return found


def test_net_devices_and_port_range_restrict_the_ucx_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nixl")
    from kvpush.transports.nixl import NixlTransport

    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    before = set(_listeners())
    transport = NixlTransport(
        TransportConfig(
            agent_name="multihost-listener-probe",
            options={"ucx_tls": "tcp", "ucx_net_devices": "lo", "ucx_tcp_port_range": "41700-41760"},
        )
    )
    try:
        new = sorted(set(_listeners()) - before)
        assert new, "UCX opened no TCP listener"
        assert all(address == "127.0.0.1" and 41700 <= port <= 41760 for address, port in new), new
        # The settings applied to this agent only: the environment is as it was.
        assert "UCX_TLS" not in os.environ and "UCX_NET_DEVICES" not in os.environ
        assert "UCX_TCP_PORT_RANGE" not in os.environ
    finally:
        transport.close()
