"""Bind vs advertised side-channel addresses (kvpush.core.addresses): pure functions."""

from __future__ import annotations

import socket

import pytest

from kvpush.core.addresses import (
    advertise_for_config,
    advertised_host,
    check_reachable_from,
    interface_address,
    is_loopback,
    is_wildcard,
    side_channel_advertise,
)
from kvpush.core.errors import ConfigError
from kvpush.core.types import ModelSpec, ParallelConfig
from kvpush.core.worker import WorkerConfig


def no_names(_host: str) -> list[str]:
    return []


def lookup(name: str) -> str:
    table = {"eth1": "10.213.0.2"}
    if name not in table:
        raise ConfigError(f"network_interface {name!r} has no IPv4 address here")
    return table[name]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*", "", " 0.0.0.0 "])
def test_wildcards(host: str) -> None:
    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "::1", "decode-1"])
def test_not_wildcards(host: str) -> None:
    assert not is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback(host: str) -> None:
    assert is_loopback(host, no_names)


@pytest.mark.parametrize("host", ["10.213.0.1", "192.168.1.5", "fe80::1", "decode-1"])
def test_not_loopback(host: str) -> None:
    assert not is_loopback(host, no_names)


def test_a_name_that_resolves_only_to_loopback_is_loopback() -> None:
    # Debian's /etc/hosts maps the machine's own name to 127.0.1.1.
    assert is_loopback("myhost", lambda _h: ["127.0.1.1"])
    assert not is_loopback("myhost", lambda _h: ["127.0.1.1", "10.0.0.4"])


def test_default_advertises_the_bind_address() -> None:
    assert advertised_host("10.213.0.2") == "10.213.0.2"
    assert advertised_host("127.0.0.1") == "127.0.0.1"


def test_explicit_advertise_address_wins() -> None:
    assert advertised_host("0.0.0.0", advertise_host="10.1.2.3", interface="eth1") == "10.1.2.3"


def test_wildcard_bind_advertises_the_named_interface() -> None:
    assert advertised_host("0.0.0.0", interface="eth1", interface_lookup=lookup) == "10.213.0.2"


def test_wildcard_bind_without_an_advertised_address_is_refused() -> None:
    with pytest.raises(ConfigError, match="side_channel_advertise_host") as err:
        advertised_host("0.0.0.0")
    assert "network_interface" in str(err.value)


def test_a_wildcard_advertise_address_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"side_channel_advertise_host is '0\.0\.0\.0'"):
        advertised_host("10.0.0.1", advertise_host="0.0.0.0")


def test_an_unknown_interface_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="network_interface 'nope0'"):
        interface_address("nope0")
    with pytest.raises(ConfigError, match="not an interface name"):
        interface_address("a" * 20)


def test_the_loopback_interface_has_its_address() -> None:
    names = [name for _, name in socket.if_nameindex()]
    if "lo" not in names:
        pytest.skip("no 'lo' interface here")
    assert interface_address("lo") == "127.0.0.1"


def test_loopback_to_loopback_is_fine() -> None:
    check_reachable_from("127.0.0.1", "127.0.0.1", resolver=no_names)
    check_reachable_from("127.0.0.1", "localhost", resolver=no_names)


def test_routable_to_anyone_is_fine() -> None:
    check_reachable_from("10.213.0.2", "10.213.0.1", resolver=no_names)
    check_reachable_from("10.213.0.2", "127.0.0.1", resolver=no_names)


def test_loopback_to_a_remote_peer_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError) as err:
        check_reachable_from("127.0.0.1", "10.213.0.1", resolver=no_names)
    message = str(err.value)
    assert "127.0.0.1" in message and "10.213.0.1" in message
    assert "side_channel_advertise_host" in message and "side_channel_host" in message


def test_wildcard_to_any_peer_is_refused() -> None:
    with pytest.raises(ConfigError, match="wildcard"):
        check_reachable_from("0.0.0.0", "127.0.0.1", resolver=no_names)


def test_side_channel_advertise_names_the_setting_in_use() -> None:
    assert side_channel_advertise("10.213.0.2", "10.213.0.1", resolver=no_names) == "10.213.0.2"
    with pytest.raises(ConfigError, match="set side_channel_host"):
        side_channel_advertise("127.0.0.1", "10.213.0.1", resolver=no_names)
    with pytest.raises(ConfigError, match="set side_channel_advertise_host"):
        side_channel_advertise("0.0.0.0", "10.0.0.1", advertise_host="127.0.0.1", resolver=no_names)
    with pytest.raises(ConfigError, match="set network_interface"):
        side_channel_advertise(
            "0.0.0.0", "10.0.0.1", interface="lo", interface_lookup=lambda _n: "127.0.0.1", resolver=no_names
        )


def _config(**fields: object) -> WorkerConfig:
    return WorkerConfig(
        engine_id="decode-0",
        parallel=ParallelConfig(tp_size=1, num_layers=2),
        model=ModelSpec(name="m", num_layers=2, num_kv_heads=1, head_dim=8),
        **fields,  # type: ignore[arg-type]
    )


def test_worker_config_default_is_loopback_only() -> None:
    config = _config()
    assert advertise_for_config(config, "127.0.0.1") == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"10\.9\.9\.9"):
        advertise_for_config(config, "10.9.9.9")


def test_worker_config_advertise_fields() -> None:
    assert advertise_for_config(_config(side_channel_host="10.213.0.2"), "10.213.0.1") == "10.213.0.2"
    config = _config(side_channel_host="0.0.0.0", side_channel_advertise_host="10.213.0.2")
    assert advertise_for_config(config, "10.213.0.1") == "10.213.0.2"
    config = _config(side_channel_host="0.0.0.0", network_interface="lo")
    with pytest.raises(ConfigError, match="network_interface"):
        advertise_for_config(config, "10.213.0.1")


def test_a_decode_rank_refuses_to_advertise_loopback_to_a_remote_prefill() -> None:
    from cluster import Cluster

    with Cluster(decode_tp=1) as cluster:
        with pytest.raises(ConfigError, match="side_channel_host") as err:
            cluster.add("req-remote", [[0, 1]], "xfer-remote", remote_host="10.213.0.1")
        assert "127.0.0.1" in str(err.value) and "10.213.0.1" in str(err.value)
