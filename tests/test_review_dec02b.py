"""review2 (2026-12-02 b): adversarial review of 289ffa4 (same host = boot id) and fa6854b
(WorkerConfig number checks, start() waits for the writer, IPv6 side channel, canonical
remote_host). Three findings (an IPv4-mapped host and a host name's case split one P engine;
the side channel's DNS lookup outside its timeout) failed before their fixes; the rest pin what held."""

from __future__ import annotations

import threading
import time

import pytest

import kvpush.core.addresses as addresses
import kvpush.core.process_identity as pid_mod
import kvpush.core.worker as worker_mod
import kvpush.transports.loopback
from kvpush.core.addresses import canonical_host, side_channel_advertise
from kvpush.core.errors import ConfigError
from kvpush.core.sidechannel import SideChannelUnanswered, fetch_metadata
from kvpush.core.types import ParallelConfig, RankKey, TransferParams
from kvpush.core.worker import WorkerConfig


def _params(host: str) -> TransferParams:
    return TransferParams.from_dict({"remote_engine_id": "P", "remote_host": host, "remote_port": 5600})


# ------------------------------------------------------------------ finding 1: IPv4-mapped IPv6


def test_ipv4_mapped_remote_host_is_one_engine() -> None:
    assert _params("::ffff:10.0.0.1").remote_host == _params("10.0.0.1").remote_host


def test_ipv4_mapped_loopback_peer_may_get_loopback_advertise() -> None:
    peer = _params("::ffff:127.0.0.1").remote_host
    assert side_channel_advertise("127.0.0.1", peer) == "127.0.0.1"


# ------------------------------------------------------------------ finding 2: host-name case


def test_host_name_case_is_one_engine() -> None:
    assert _params("P-Host.Example").remote_host == _params("p-host.example").remote_host


# ------------------------------------------------------------------ what held: canonical forms


@pytest.mark.parametrize(
    "a, b",
    [("[FD00:0::1]", "fd00::1"), ("FD00::1", "fd00:0:0::1"), ("fe80::1%eth0", "[FE80::1%eth0]")],
)
def test_ipv6_spellings_canonical(a: str, b: str) -> None:
    assert canonical_host(a) == canonical_host(b)


def test_zone_ids_stay_apart() -> None:
    # one link-local address on two links is two hosts: never merged
    assert canonical_host("fe80::1%eth0") != canonical_host("fe80::1%eth1")


@pytest.mark.parametrize("bad", ["10.0.0.1:5600", "[10.0.0.1]", " p", "", "tcp://p", "p/x", "[fd00::1"])
def test_bad_remote_host_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="remote_host"):
        _params(bad)


# ------------------------------------------------------------------ finding 3: DNS outside the bound


def test_fetch_metadata_bounded_with_slow_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(host: str) -> list[str]:
        time.sleep(2.0)
        return []

    monkeypatch.setattr(addresses, "resolve", slow)
    started = time.monotonic()
    with pytest.raises(SideChannelUnanswered):
        fetch_metadata("p-engine.invalid", 9, RankKey(0, 0), timeout_s=0.3, engine_id="P")
    assert time.monotonic() - started < 1.5


# ------------------------------------------------------------------ what held: failed start()


def _sender():
    from cluster import MHA

    from kvpush.core.manager import get_plugin_manager
    from kvpush.core.sender import PushSender
    from kvpush.layouts.uniform import allocate_kv_caches

    pm = get_plugin_manager(load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback)])
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MHA.num_layers)
    caches = allocate_kv_caches(MHA, parallel, 8, device="cpu")
    config = WorkerConfig(
        engine_id="P", parallel=parallel, model=MHA, transport="loopback", side_channel_port=0
    )
    return PushSender(config, caches, pm=pm)


def test_failed_writer_setup_leaves_nothing_and_close_is_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(ns: int) -> bool:
        raise RuntimeError("no slack here")

    monkeypatch.setattr(worker_mod, "set_timer_slack", boom)
    before = {t.ident for t in threading.enumerate()}
    sender = _sender()
    with pytest.raises(ConfigError, match=r"could not start.*no slack here"):
        sender.start()
    assert sender.transport is not None and sender._transport_closed
    sender._thread.join(2.0)
    assert not sender._thread.is_alive()
    with pytest.raises(ConfigError, match="already started"):
        sender.start()
    sender.close()
    sender.close()
    time.sleep(0.2)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvpush")]
    assert not left, left


def test_writer_setup_timeout_raises_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hang(ns: int) -> bool:
        release.wait(5.0)
        return False

    monkeypatch.setattr(worker_mod, "set_timer_slack", hang)
    monkeypatch.setattr(worker_mod, "WRITER_START_S", 0.3)
    sender = _sender()
    try:
        with pytest.raises(ConfigError, match="did not start within"):
            sender.start()
    finally:
        release.set()
        sender._thread.join(2.0)
    assert not sender._thread.is_alive()  # set-up ended, saw the stop, never ran a step
    sender.close()


# ------------------------------------------------------------------ what held: boot-id identity


def test_same_kernel_and_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pid_mod, "host_identity", lambda: "d-host/boot-a")
    assert pid_mod.may_be_this_host("p-container/boot-a")  # same kernel, own UTS: held
    assert not pid_mod.may_be_this_host("d-host/boot-b")  # rebooted host: not this kernel
    assert pid_mod.may_be_this_host("d-host/?")  # unknown boot id: never "another host"
    assert not pid_mod.may_be_this_host("other/?")
    assert pid_mod.same_kernel("d-host/") is None
    assert pid_mod.same_kernel(None) is None
    monkeypatch.setattr(pid_mod, "host_identity", lambda: "d-host/?")
    assert pid_mod.may_be_this_host("d-host/boot-b")
    assert pid_mod.has_exited({"host": "d-host/boot-b", "pid": 1, "start": 1, "pidns": "x"}) is None
