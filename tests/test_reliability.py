"""Leases, heartbeats, cancellation, failure paths and peer death (docs/reliability.md).

The protocol logic runs in process on the loopback transport (wrapped in the ``faulty``
transport where a fault is needed); every failure path also runs for real: rank processes on
NIXL, killed with SIGKILL, cancelled before and after registration and during a WRITE.
"""

from __future__ import annotations

import time

import pytest
from cluster import Cluster, attempt_of, settle, wait_until
from rank_engines import Engines
from test_push_flow import assert_pushed

from kvpush.core import wire
from kvpush.core.errors import WaitTimeout
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)


def faulty(**options: object) -> dict[str, object]:
    return {"transport": "faulty", "transport_options": {"inner": "loopback", **options}}


def cancelled_reason(cluster: Cluster, rid: str, tp: int = 0, timeout_s: float = 10.0) -> str:
    receiver = cluster.receivers[tp]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = receiver.wait_finished(timeout_s)
        assert not got.done and not got.failed, (got.done, got.failed)
        if rid in got.cancelled:
            return got.cancelled[rid]
    raise AssertionError(f"{rid} was not reported cancelled within {timeout_s}s")


# ---------------------------------------------------------------------------- leases and heartbeats


def test_heartbeat_by_match_key_renews_the_lease_and_by_request_id_does_not() -> None:
    """Upstream #53095: heartbeats named the wrong id, so they never renewed P's lease. Here D's
    PUSH_REG is lost, so only D's heartbeats (by match key) keep the router-bound prefill."""
    with Cluster(
        lease_s=0.4, heartbeat_interval_s=0.05, **faulty(drop_notifs=1.0, drop_prefixes=["PUSH_REG:"])
    ) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[5]], "x-1")  # D heartbeats "x-1" (its match key), never "p-1"
        sender.request_finished("p-1", [[6]], match_key="x-1", decode_engine_id="D")
        sender.request_finished("p-2", [[7]], match_key="x-2", decode_engine_id="D")
        assert "lease of 0.4s expired" in cluster.wait_prefill("p-2", timeout_s=5)[P0]
        time.sleep(0.8)  # two more leases
        cluster.poll()
        assert "p-1" not in cluster.p_results[P0], "the lease expired although D sent heartbeats"
        assert sender.stats["heartbeat_renewals"] >= 5
        cluster.receivers[0].cancel("d-1")
        assert "no WRITE in flight" in cancelled_reason(cluster, "d-1")
        assert "cancelled by D rank 0 before the WRITE was posted" in cluster.wait_prefill("p-1")[P0]


def test_p_that_lost_a_request_fails_it_at_d_within_a_heartbeat() -> None:
    """Issue 11.3: P answers a heartbeat for a key it no longer holds with ``failed``, so D fails
    the request at once instead of on its watchdog."""
    with Cluster(
        lease_s=0.3,
        heartbeat_interval_s=0.05,
        request_timeout_s=60,
        **faulty(drop_notifs=1.0, drop_prefixes=["PUSH_REG:"]),
    ) as cluster:
        cluster.add("d-1", [[5]], "x-1")
        started = time.monotonic()
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "does not hold this request (its PUSH_REG was lost)" in reason
        assert time.monotonic() - started < 2.0


def test_heartbeats_renew_a_stashed_registration() -> None:
    with Cluster(registration_ttl_s=0.3, heartbeat_interval_s=0.05) as cluster:
        cluster.add("d-1", [[10, 11]], "x-1")
        time.sleep(1.0)  # three registration TTLs
        cluster.finish("p-1", [[3, 4]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [3, 4], [10, 11])


def test_decode_watchdog_fails_with_a_named_reason_and_releases_prefill() -> None:
    # D's watchdog fires (P's DONE is lost); D cancels at P, which acknowledges at once.
    with Cluster(request_timeout_s=0.3, **faulty(drop_notifs=1.0, drop_prefixes=["DONE:"])) as cluster:
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[2]], "x-1")
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "no completion within 0.3s" in reason and "(pp=0, tp=0)" in reason
        cluster.wait_released("d-1")


# ---------------------------------------------------------------------------- cancellation


def test_cancel_before_registration_reports_at_once_and_prefill_lets_go_at_the_cancel() -> None:
    with Cluster(lease_s=30.0) as cluster:
        cluster.add("d-1", [[1]], "x-1")
        cluster.receivers[0].cancel("d-1")  # the handshake with P is still running
        assert "before any PUSH_REG was sent" in cancelled_reason(cluster, "d-1")
        cluster.finish("p-1", [[2]], "x-1")
        # D never registered, but told P its CANCEL once the handshake was done: P lets go of
        # its blocks then, not at its lease (30 s).
        assert "cancelled by D rank 0 before it registered" in cluster.wait_prefill("p-1", timeout_s=10)[P0]
        assert cluster.senders[P0].stats["writes"] == 0


def test_cancel_after_registration_is_acknowledged_and_prefill_never_writes() -> None:
    with Cluster() as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[1, 2]], "x-1")
        wait_until(lambda: sender.core.state_sizes()["requests"] == 1, what="PUSH_REG at P")
        cluster.receivers[0].cancel("d-1")
        reason = cancelled_reason(cluster, "d-1")
        assert "no WRITE in flight" in reason
        cluster.finish("p-1", [[7, 8]], "x-1")
        assert "cancelled by D rank 0 before the prefill finished" in cluster.wait_prefill("p-1")[P0]
        assert sender.stats["writes"] == 0 and sender.stats["cancels"] == 1
        assert cluster.receivers[0].stats["cancel_acks"] == 1


def test_cancel_racing_an_in_flight_write_is_reported_only_after_it_settles() -> None:
    with Cluster(**faulty(slow_writes=1.0, write_delay_s=0.3)) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[20, 21]], "x-1")
        cluster.finish("p-1", [[5, 6]], "x-1")
        wait_until(lambda: sender.stats["writes"] == 1, what="the WRITE to be posted")
        started = time.monotonic()
        receiver.cancel("d-1")
        with pytest.raises(WaitTimeout):
            receiver.wait_finished(0.15)  # the WRITE is still in flight: nothing may be freed
        reason = cancelled_reason(cluster, "d-1")
        assert time.monotonic() - started >= 0.2
        assert "a WRITE was in flight and settled" in reason
        assert_pushed(cluster, [5, 6], [20, 21])  # the bytes landed before the report
        assert "cancelled by D rank 0 while a WRITE was in flight" in cluster.wait_prefill("p-1")[P0]
        assert sender.stats["cancels_during_write"] == 1
        assert sender.transport.outstanding_handles == 0


def test_lost_cancel_keeps_blocks_until_no_write_can_land_then_drops_p() -> None:
    """Issue 10.3: without an ack, the blocks are released only after the freshness window plus
    P's published WRITE deadline, and then only once P's connection was fenced (issue 12)."""
    with Cluster(
        heartbeat_interval_s=0.05,
        write_deadline_s=0.4,
        **faulty(drop_notifs=1.0, drop_prefixes=["CANCEL:"]),
    ) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[1]], "x-1")
        wait_until(lambda: sender.core.state_sizes()["requests"] == 1, what="PUSH_REG at P")
        receiver.cancel("d-1")
        started = time.monotonic()
        reason = cancelled_reason(cluster, "d-1")
        held = time.monotonic() - started
        assert held >= 0.4, f"released after {held:.2f}s, inside P's WRITE deadline"
        assert "no acknowledgement from P rank(s) (pp=0, tp=0)" in reason
        assert "released after P's connections were fenced" in reason
        assert receiver.stats["quarantine_expiries"] == 1 and receiver.stats["fences"] == 1
        assert receiver.transport.counters.peers_removed >= 1  # the connection was torn down ...
        cluster.add("d-2", [[2]], "x-2")  # ... and a fresh one serves the next request
        cluster.finish("p-2", [[3]], "x-2")
        assert cluster.wait_decode("d-2") == {0: None}


def test_cancel_of_a_finished_or_unknown_request_changes_nothing() -> None:
    with Cluster() as cluster:
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[2]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        receiver = cluster.receivers[0]
        receiver.cancel("d-1")
        receiver.cancel("never-added")
        settle(receiver)
        got = receiver.get_finished()
        assert got.cancelled == {} and got.failed == {} and got.released == ()


def test_failure_from_one_stage_releases_only_after_the_other_stage_settled() -> None:
    # Stage 1's WRITE stays in flight for a while; stage 0 reports a failure. D reports the failure
    # at once, but releases the blocks only after stage 1 has settled its WRITE and acknowledged.
    with Cluster(prefill_pp=2, **faulty(slow_writes=1.0, write_delay_s=0.3)) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[1, 2]], "x-1")
        cluster.senders[RankKey(1, 0)].request_finished("p-1", [[3, 4]], match_key="x-1")
        wait_until(lambda: cluster.senders[RankKey(1, 0)].stats["writes"] == 1, what="stage 1's WRITE")
        failure = wire.encode_failed(
            "d-1", RankKey(0, 0), "injected stage-0 failure", attempt=attempt_of(receiver, "d-1")
        )
        started = time.monotonic()
        receiver.transport.inner.inject("P-prefill-pp0-tp0", failure)
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "injected stage-0 failure" in reason
        assert time.monotonic() - started < 0.2  # reported at once
        cluster.wait_released("d-1")
        assert time.monotonic() - started >= 0.2  # ... released once stage 1 settled


# ---------------------------------------------------------------------------- idle engines


def test_idle_engines_are_evicted_but_not_while_a_request_is_active() -> None:
    with Cluster(engine_ttl_s=0.3) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[1]], "x-1")
        wait_until(lambda: sender.transport.counters.notifs_received >= 1, what="PUSH_REG at P")
        time.sleep(1.5)  # five TTLs with the request pending: D keeps P
        assert "P" in receiver.peers.engines
        cluster.finish("p-1", [[2]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        wait_until(lambda: not receiver.peers.engines and not sender.peers.engines, what="eviction")
        assert receiver.transport.counters.peers_removed >= 1
        assert sender.transport.counters.peers_removed >= 1
        cluster.add("d-2", [[3]], "x-2")  # evicted engines are loaded again on demand
        cluster.finish("p-2", [[4]], "x-2")
        assert cluster.wait_decode("d-2") == {0: None}
        assert_pushed(cluster, [4], [3])


# ---------------------------------------------------------------------------- real processes, NIXL


def _blocks(index: int, n: int = 2) -> list[int]:
    return [8 + n * index + i for i in range(n)]


def _kill_decode_mid_transfer(engines: Engines) -> None:
    engines.plan("warm", [0], [0])
    engines.add("warm")
    engines.finish("warm")
    engines.wait_decode(["warm"])
    engines.plan("stashed", [1, 2], [1, 2])
    engines.add("stashed")
    engines.wait(
        "P to stash the registration",
        lambda: engines.health(engines.p_ranks)[0]["stashed_registrations"] == 1,
        10,
    )
    rids = [f"b{i}" for i in range(40)]
    for i, rid in enumerate(rids):
        engines.plan(rid, _blocks(i), _blocks(i))
    for rid in rids:
        engines.add(rid)
        engines.finish(rid)
    engines.kill(engines.d_ranks[0])  # mid-stream: some pushed, some in flight, some not
    engines.finish("stashed")  # P now writes to a dead D
    took = engines.wait_prefill(["stashed", *rids], timeout_s=2.0 + 10)
    p_key = engines.p_ranks[0].key
    # Its registration is dropped with the dead engine: the lease releases its blocks.
    assert engines.p_results[p_key]["stashed"] is not None
    # (which requests were already pushed when D died depends on timing; none may be left hanging)
    assert all(
        reason is None or "failed" in reason or "ended in error" in reason or "lease" in reason
        for reason in engines.p_results[p_key].values()
    )
    health = engines.health(engines.p_ranks)[0]
    assert health["outstanding_handles"] == 0
    assert health["finished"] == health["inflight"] == 0
    assert health["state"]["requests"] == 0  # nothing held for the dead D
    assert took < 2.0 + 5


def test_sigkill_decode_mid_transfer_fails_requests_without_leaks() -> None:
    with Engines(prefill_pp=1, decode_tp=1, lease_s=2.0, heartbeat_interval_s=0.2) as engines:
        _kill_decode_mid_transfer(engines)


def test_restarted_decode_under_the_same_name_is_reloaded() -> None:
    """Issue 11.2: the restarted D has a new incarnation, so P drops the stale agents and loads
    the new ones at its HELLO (no longer a flake: see the 20-run figure in docs/reliability.md).
    P drops the dead start's agent only once its WRITEs settled, so a WRITE in flight at the
    kill holds the new start's HELLO for up to P's WRITE deadline: shorter here than D's HELLO
    timeout (5 s; with the default 10 s deadline the first request after the restart failed
    'P did not answer this rank's HELLO' whenever a WRITE was in flight, as under CI load)."""
    with Engines(
        prefill_pp=1, decode_tp=1, lease_s=2.0, heartbeat_interval_s=0.2, write_deadline_s=2.0
    ) as engines:
        _kill_decode_mid_transfer(engines)
        engines.restart_decode()  # same agent name: P must have removed the dead one
        engines.plan("after", [200, 201], [200, 201])
        engines.add("after")
        engines.finish("after")
        engines.wait_decode(["after"])
        kind, result = engines.decode_outcome("after")[RankKey(0, 0)]
        assert kind == "done" and result["ok"], result


def test_sigkill_prefill_stage_mid_transfer_fails_decode_requests_within_the_bound() -> None:
    with Engines(
        prefill_pp=2,
        decode_tp=2,
        request_timeout_s=30.0,
        heartbeat_interval_s=0.2,
        peer_silence_s=1.0,
        write_deadline_s=1.0,
    ) as engines:
        engines.plan("warm", [0], [0])
        engines.add("warm")
        engines.finish("warm")
        engines.wait_decode(["warm"])
        rids = [f"b{i}" for i in range(30)]
        for i, rid in enumerate(rids):
            engines.plan(rid, _blocks(i), _blocks(i))
        for i, rid in enumerate(rids):
            engines.add(rid)
            engines.finish(rid, stages=[0] if i < 20 else None)  # stage 1 still busy on 20
        engines.kill(engines.p_ranks[1])
        took = engines.wait_decode(rids, timeout_s=1.0 + 1.0 + 10)
        assert took < 1.0 + 0.2 + 1.0 + 3, (
            f"D took {took:.1f}s to notice the dead stage"
        )  # not the 30s watchdog
        for rid in rids[:20]:
            for kind, reason in engines.decode_outcome(rid).values():
                assert kind == "failed" and "prefill-0-prefill-pp1-tp0" in reason, reason
                # D saw the stage's process exit (its side channel still names it: nothing
                # was published afresh within peer_silence_s), or lost the connection first.
                whys = ("unreachable", "answered no heartbeat", "exited")
                assert any(why in reason for why in whys), reason
        # Released once the freshness window (0.4 s) and P's WRITE deadline (1 s) passed.
        engines.wait_released(rids[:20], timeout_s=0.4 + 1.0 + 1.0 + 5)
        for health in engines.health(engines.d_ranks):
            assert health["outstanding_handles"] == 0 and health["pending"] == 0
            assert health["stats"]["dead_peers"] >= 1


def test_cancel_before_and_after_registration_and_during_a_write_across_processes() -> None:
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 0.4}
    with Engines(transport="faulty", transport_options=options, decode_tp=2) as engines:
        d_keys = [rank.key for rank in engines.d_ranks]
        # before registration: the first request's handshake is usually still running (on a
        # loaded box it may have ended: then the cancel is one after registration, below)
        engines.plan("before", [1], [1])
        engines.add("before")
        engines.cancel("before")
        engines.wait_decode(["before"])
        reasons = [reason for _, reason in engines.decode_outcome("before").values()]
        assert {kind for kind, _ in engines.decode_outcome("before").values()} == {"cancelled"}
        assert all("before any PUSH_REG" in r or "no WRITE in flight" in r for r in reasons), reasons
        engines.finish("before")
        engines.wait_prefill(["before"])
        # No D rank registered (or one did): D's CANCEL ends P's prefill, not P's lease.
        assert "cancelled by D rank" in engines.p_results[RankKey(0, 0)]["before"]

        # after registration, before P finished
        engines.plan("after", [2, 3], [2, 3])
        engines.add("after")
        engines.wait(
            "P to stash", lambda: engines.health(engines.p_ranks)[0]["stashed_registrations"] == 1, 10
        )
        engines.cancel("after")
        engines.wait_decode(["after"])
        for kind, reason in engines.decode_outcome("after").values():
            assert kind == "cancelled" and "no WRITE in flight" in reason
        engines.finish("after")
        engines.wait_prefill(["after"])
        reason = engines.p_results[RankKey(0, 0)]["after"]
        assert "cancelled by D rank 0 before the prefill finished" in reason

        # during a WRITE (held in flight 0.4 s)
        engines.plan("during", [4, 5, 6], [4, 5, 6])
        engines.add("during")
        engines.wait(
            "P to stash", lambda: engines.health(engines.p_ranks)[0]["stashed_registrations"] == 1, 10
        )
        engines.finish("during")
        engines.wait(
            "the WRITEs to be in flight", lambda: engines.health(engines.p_ranks)[0]["inflight"] >= 1, 10
        )
        engines.cancel("during")
        engines.wait_decode(["during"])
        outcome = engines.decode_outcome("during")
        assert set(outcome) == set(d_keys)
        for kind, reason in outcome.values():
            assert kind == "cancelled" and "a WRITE was in flight and settled" in reason
        engines.wait_prefill(["during"])
        assert "while a WRITE was in flight" in engines.p_results[RankKey(0, 0)]["during"]
        time.sleep(0.5)  # nothing may land after D freed (and filled) the blocks
        for rank in engines.d_ranks:
            assert rank.call(("check_freed",)) == {}
        for health in engines.health([*engines.p_ranks, *engines.d_ranks]):
            assert health["outstanding_handles"] == 0
