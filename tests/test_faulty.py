"""The ``faulty`` transport: its options, each fault on its own, and each fault injected into
real multi-process pushes over NIXL (what the request's result must say)."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.transport import TransferState, TransportConfig
from kvpush.demo.soak import SoakConfig, run_soak, soak_failures, soak_ok
from kvpush.transports.faulty import FaultyTransport


def make(name: str, **options: object) -> FaultyTransport:
    return FaultyTransport(TransportConfig(agent_name=name, options={"inner": "loopback", **options}))


@pytest.fixture
def pair():
    made: list[FaultyTransport] = []

    def build(**options: object) -> tuple[FaultyTransport, FaultyTransport, bytearray, bytearray]:
        src, dst = make(f"src-{len(made)}", **options), make(f"dst-{len(made)}")
        made.extend([src, dst])
        src.load_peer(dst.metadata())
        dst.load_peer(src.metadata())
        a, b = bytearray(b"x" * 64), bytearray(64)
        a_addr = ctypes.addressof((ctypes.c_char * 64).from_buffer(a))
        b_addr = ctypes.addressof((ctypes.c_char * 64).from_buffer(b))
        src.local = src.prepare_local(np.array([[a_addr, 64, 0]], dtype=np.uint64), "DRAM")
        src.remote = src.prepare_remote(dst.agent_name, np.array([[b_addr, 64, 0]], dtype=np.uint64), "DRAM")
        return src, dst, a, b

    yield build
    for transport in made:
        transport.close()


def write(src: FaultyTransport) -> object:
    ids = np.array([0], dtype=np.int64)
    return src.post_write(src.local, ids, src.remote, ids, b"DONE:x")


def test_registered_as_a_builtin_transport() -> None:
    assert "faulty" in get_plugin_manager(load_entrypoints=False).transports()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"drop_notif": 0.1}, "unknown faulty transport options ['drop_notif']"),
        ({"fail_posts": 1.5}, "'fail_posts' must be a rate in [0, 1]"),
        ({"inner": "faulty"}, "cannot wrap itself"),
        ({"drop_prefixes": "DONE:"}, "must be a list of prefixes"),
        ({"inner": "no-such"}, "no transport named 'no-such'"),
    ],
)
def test_bad_options_are_refused_with_a_clear_error(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make("bad", **options)


def test_without_faults_it_is_the_inner_transport(pair) -> None:
    src, dst, a, b = pair()
    handle = write(src)
    assert src.poll(handle) is TransferState.DONE
    src.release(handle)
    assert bytes(b) == bytes(a) and dst.drain_notifs() == [(src.agent_name, b"DONE:x")]
    assert src.outstanding_handles == 0 and src.counters.writes_posted == 1


def test_failed_posts_raise(pair) -> None:
    src, _, _, b = pair(fail_posts=1.0)
    with pytest.raises(TransferError, match="injected post failure"):
        write(src)
    assert bytes(b) == bytes(64) and src.injected["fail_post"] == 1


def test_failed_writes_poll_failed_and_land_nothing(pair) -> None:
    src, dst, _, b = pair(fail_writes=1.0)
    handle = write(src)
    assert src.poll(handle) is TransferState.FAILED
    assert src.outstanding_handles == 1  # until released, like any handle
    src.release(handle)
    assert src.outstanding_handles == 0
    assert bytes(b) == bytes(64) and dst.drain_notifs() == []


def test_slow_writes_stay_in_flight_then_land(pair) -> None:
    src, dst, a, b = pair(slow_writes=1.0, write_delay_s=0.2)
    handle = write(src)
    assert src.poll(handle) is TransferState.PENDING
    assert bytes(b) == bytes(64) and dst.drain_notifs() == []  # nothing landed yet
    time.sleep(0.25)
    assert src.poll(handle) is TransferState.DONE
    assert bytes(b) == bytes(a) and dst.drain_notifs() == [(src.agent_name, b"DONE:x")]
    src.release(handle)
    assert src.outstanding_handles == 0


def test_notifications_are_dropped_duplicated_and_delayed() -> None:
    src = make("n-src")
    try:
        for options, expect in (
            ({"drop_notifs": 1.0}, []),
            ({"dup_notifs": 1.0}, [b"HB:a", b"HB:a"]),
            ({"drop_notifs": 1.0, "drop_prefixes": ["DONE:"]}, [b"HB:a"]),
        ):
            dst = make(f"n-dst-{len(expect)}-{len(options)}", **options)
            src.load_peer(dst.metadata())
            src.send_notif(dst.agent_name, b"HB:a")
            assert [m for _, m in dst.drain_notifs()] == expect, options
            dst.close()
        dst = make("n-delay", delay_notifs=1.0, delay_s=0.1)
        src.load_peer(dst.metadata())
        src.send_notif(dst.agent_name, b"HB:a")
        assert dst.drain_notifs() == []
        time.sleep(0.15)
        assert dst.drain_notifs() == [(src.agent_name, b"HB:a")]
        assert dst.injected["delay"] == 1
        dst.close()
    finally:
        src.close()


def test_faults_are_reproducible_from_the_seed() -> None:
    def pattern(seed: int) -> list[bool]:
        transport = make("seeded", seed=seed, drop_notifs=0.5)
        try:
            return [transport._hit("drop_notifs") for _ in range(64)]
        finally:
            transport.close()

    assert pattern(7) == pattern(7)
    assert pattern(7) != pattern(8)


# ---------------------------------------------------------------------------- real processes, NIXL


@pytest.mark.parametrize(
    ("faults", "outcome", "reason"),
    [
        ({"fail_posts": 1.0}, "failed", "injected post failure"),
        ({"fail_writes": 1.0}, "failed", "WRITE ended in error"),
        ({"drop_notifs": 1.0, "drop_prefixes": ["DONE:"]}, "failed", "watchdog (no completion in time)"),
        ({"dup_notifs": 1.0}, "verified", None),
        ({"delay_notifs": 1.0, "delay_s": 0.05}, "verified", None),
        ({"slow_writes": 1.0, "write_delay_s": 0.05}, "verified", None),
    ],
    ids=["fail-posts", "fail-writes", "drop-done", "dup-notifs", "delay-notifs", "slow-writes"],
)
def test_each_fault_across_processes_ends_in_a_verified_push_or_a_named_failure(
    faults: dict[str, object], outcome: str, reason: str | None
) -> None:
    report = run_soak(
        SoakConfig(requests=8, abort_rate=0.0, faults=faults, request_timeout_s=2.0, write_deadline_s=1.0)
    )
    assert soak_ok(report), soak_failures(report)
    if outcome == "verified":
        assert report["verified"] == 8, report
    else:
        assert report["failed_with_reason"] == 8, report
        # A D rank that fails cancels the request at P, which fails it on the other D rank too:
        # that rank may name the cancel (and which D rank sent it) if it arrives first.
        reasons = set(report["failure_reasons"])
        assert reason in reasons, report["failure_reasons"]
        assert all(r == reason or "cancelled by D rank" in r for r in reasons), report["failure_reasons"]
    assert report["leaked_handles"] == 0 and report["leaked_blocks"] == 0
