"""Probe of both cores: a rank restarted under the same name must not keep failing requests.

Liveness, not safety (nothing wrong is written either way; requests failed with a reason):

1. A P rank dies while D is idle towards it and comes back under the same agent name. D's
   keepalives to the dead process went unanswered, which triggered nothing (an idle agent's
   silence is no liveness check), so D kept the dead incarnation loaded and every request
   after the restart registered with the dead process and failed at ``peer_silence_s``.
2. A D rank restarts under the same name. P, seeing its new incarnation, failed every request
   bound to the D engine, also those the surviving D ranks and the new process registered
   after the restart ("D engine 'D' restarted").

The network here loses what is sent to a dead process (a UCX endpoint to a peer that died
does not always raise on send; the soak shows it does not), where the cluster model raises.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from rank_engines import Engines
from test_core_properties import CoreCluster, Proc, Violation

from kvpush.core.actions import DropPeer


class LossyCluster(CoreCluster):
    """Sends to a process that died are lost, not refused."""

    def _send(self, src: Proc, agent: str, data: bytes) -> None:
        inc = self._loaded_inc(src, agent)
        if inc is not None and self._proc(agent, inc) is None:
            return  # the loaded process is gone: the bytes go nowhere, the send does not raise
        super()._send(src, agent, data)


def _outcomes(machine: CoreCluster, tp_rank: int = 0) -> list[list[str]]:
    (d,) = [d for d in machine.live_d() if d.tp_rank == tp_rank]
    return [r.outcomes for r in d.requests.values()]


def _idle(machine: CoreCluster, seconds: float) -> None:
    for _ in range(int(seconds / 2.5)):
        machine.advance_clock(dt=2.5)
        machine.pump(rounds=8, stall_writes=False)


def test_requests_after_an_idle_p_rank_restarted_are_served_by_the_new_process() -> None:
    machine = LossyCluster()
    machine.start(topology=(1, 1, 1))
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    assert _outcomes(machine) == [["done"]]
    machine.fault(kind="prefill_rank_restarts", i=0, j=0)  # the same agent name, a new start
    _idle(machine, 30.0)  # D idle towards P: its keepalives to the dead process go nowhere
    d = machine.live_d()[0]
    assert d.core.stats["dead_peers"] == 0  # nothing failed (there was nothing to fail)
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    assert _outcomes(machine) == [["done"], ["done"]], d.requests
    machine.teardown()


def test_a_request_registered_with_a_p_rank_that_restarted_before_d_noticed_is_served() -> None:
    """A P rank killed under load and back (same agent name) before D noticed its silence:
    D registered the next request with the dead process and failed it at ``peer_silence_s``
    (the soak with P kills: up to 40 of 40 such requests), though the new process finished
    its prefill. D now checks, when an agent it asks about requests missed a heartbeat
    answer, whether that agent's process has exited (same host: /proc): the incarnation is
    gone, D fences its connections and handshakes afresh, and registers the request with the
    new process once nothing of the old one can land."""
    machine = LossyCluster()
    machine.start(topology=(1, 1, 1))
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    assert _outcomes(machine) == [["done"]]
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right")
    machine.pump(rounds=8, stall_writes=False)  # registered with P; its prefill still runs
    machine.fault(kind="prefill_rank_restarts", i=0, j=0)  # killed (its prefill lost), back at once
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right")
    machine.pump(rounds=8, stall_writes=False)  # registered with the dead process: lost
    machine.prefill_finished(i=2, j=0, one_rank=False, bind=True, boom=False)  # on the new process
    d = machine.live_d()[0]
    silence = d.core.s.peer_silence_s
    t0 = machine.t
    while machine.t - t0 < silence - 1.0 and not all(_outcomes(machine)):
        machine.advance_clock(dt=1.0)
        machine.pump(rounds=8, stall_writes=False)
    assert _outcomes(machine)[2] == ["done"], (machine.t - t0, d.requests)
    # Registered again too: D cannot tell whose prefill died with the old process. The new
    # process holds it until its prefill comes; it never does: it fails at its watchdog.
    assert _outcomes(machine)[1] == [] and d.core.stats["reregistered"] == 2
    machine.teardown()


def test_a_p_stage_that_restarted_after_writing_its_share_does_not_fail_the_request() -> None:
    """PP2: stage 0 wrote its share (DONE), then was killed and came back; stage 1 still
    prefills. D, handshaking afresh, failed the request ("P engine restarted while this rank
    reconnected": 18 requests in a CPU soak with P kills) though nothing was asked of the new
    stage 0 any more; now the request carries on and lands once stage 1 writes."""
    machine = LossyCluster()
    machine.start(topology=(2, 1, 1))
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right")
    machine.pump(rounds=8, stall_writes=False)
    machine.prefill_finished(i=1, j=0, one_rank=True, bind=True, boom=False)  # stage 0 only
    machine.pump(rounds=8, stall_writes=False)
    d = machine.live_d()[0]
    assert d.core._requests[machine.requests[1].rid].reported == {machine.p_procs[0].rank}
    machine.fault(kind="prefill_rank_restarts", i=0, j=0)  # stage 0 killed, back at once
    for _ in range(12):  # D finds stage 0's process gone and handshakes afresh
        machine.advance_clock(dt=1.0)
        machine.pump(rounds=8, stall_writes=False)
    assert d.core.stats["exited_producers"] == 1 and _outcomes(machine)[1] == []
    machine.prefill_finished(i=1, j=0, one_rank=False, bind=True, boom=False)  # stage 1 (alive)
    machine.pump(rounds=8, stall_writes=False)
    assert _outcomes(machine)[1] == ["done"], d.requests
    machine.teardown()


def test_rank_processes_a_p_rank_killed_and_back_before_d_noticed_serves_what_d_registered() -> None:
    """The same over real NIXL between rank processes, with D's silence bound (60 s) far longer
    than the restart: d-1 was registered with the process that is killed, d-2 is added after
    its replacement is published; the new process finishes both prefills and both land byte
    for byte. D used to register d-2 with the dead process and fail both at peer_silence_s."""
    with Engines(
        heartbeat_interval_s=0.25, peer_silence_s=60.0, request_timeout_s=60.0, lease_s=30.0
    ) as engines:
        engines.plan("warm", [0], [0])
        engines.add("warm")
        engines.finish("warm")
        engines.wait_decode(["warm"])
        engines.plan("d-1", [1, 2], [1, 2])
        engines.plan("d-2", [3, 4], [3, 4])
        engines.add("d-1")
        engines.wait(
            "P to hold d-1's registration",
            lambda: engines.health(engines.p_ranks)[0]["stashed_registrations"] == 1,
            10,
        )
        engines.restart_prefill(0)  # killed; its replacement starts (seconds) and is published
        engines.add("d-2")
        engines.finish("d-1")
        engines.finish("d-2")
        engines.wait_decode(["d-1", "d-2"], timeout_s=30)
        for rid in ("d-1", "d-2"):
            ((kind, result),) = engines.decode_outcome(rid).values()
            assert kind == "done" and result["ok"], (rid, kind, result)
        (health,) = engines.health(engines.d_ranks)
        assert health["stats"]["exited_producers"] >= 1 and health["stats"]["dead_peers"] == 0, health


def test_an_idle_p_that_is_alive_is_not_handshaken_again() -> None:
    """The rule above costs nothing while P answers its keepalives."""
    machine = LossyCluster()
    machine.start(topology=(1, 1, 1))
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    _idle(machine, 60.0)
    d = machine.live_d()[0]
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    assert not machine.handshakes, "a live, idle P was handshaken again"
    machine.pump(rounds=8, stall_writes=False)
    assert _outcomes(machine) == [["done"], ["done"]]
    assert d.core.stats["dead_peers"] == 0
    machine.teardown()


def _d_restarted(machine: CoreCluster) -> None:
    old = [d for d in machine.live_d() if d.tp_rank == 1]
    machine.fault(kind="decode_rank_restarts", i=0, j=machine.live_d().index(old[0]))


def test_requests_registered_after_a_d_rank_restarted_are_served() -> None:
    machine = LossyCluster()
    machine.start(topology=(1, 1, 2))
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    assert _outcomes(machine, 0) == _outcomes(machine, 1) == [["done"]]
    _d_restarted(machine)
    # A request P finished first: D rank 0 (alive all along) registers it before the new
    # process of rank 1 says hello; then the new process registers it too.
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    p = machine.live_p()[0]
    key = machine.requests[-1].key
    assert p.reports.get(key) == ["sent"], p.reports
    assert _outcomes(machine, 0) == [["done"], ["done"]]
    assert _outcomes(machine, 1) == [["done"]]
    machine.teardown()


def test_only_requests_holding_the_old_incarnations_registration_fail() -> None:
    """Three requests when D rank 1 restarts: one both old ranks registered (its WRITE to the
    old process in flight), one only rank 0 registered (rank 1's old process never did), and
    one P has not finished. The first fails (the old process is gone with its request); the
    old process's agent is dropped only once its WRITE settled, the new process's messages
    wait till then; the others are served once the new process registers them."""
    machine = LossyCluster()
    machine.start(topology=(1, 1, 2))
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=2, stall_writes=True)  # both WRITEs posted, none landed
    machine.new_request(nblocks=1, first_rank_only=True, packed=False, sizes="right")  # rank 0 only
    machine.pump(rounds=8, stall_writes=True)
    p = machine.live_p()[0]
    assert len(machine.writes) == 2
    _d_restarted(machine)
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right")
    # The new rank 1 says hello (P holds it: a WRITE to the old start is in flight).
    for _ in range(3):
        machine.pump(rounds=1, stall_writes=True)
    dropped = [w for w in machine.writes.values() if w.dst_rank == 1]
    assert all(w.state == "pending" for w in dropped)
    assert machine.requests[0].key not in p.reports  # its WRITE is in flight
    machine.pump(rounds=8, stall_writes=False)  # the WRITEs end (the old process's: nowhere)
    assert p.reports.get(machine.requests[0].key) == ["failed"], p.reports
    # The second request is not failed by the restart (the new start of rank 1 never had it,
    # so it ends at P's lease); the third, which both ranks add, is served.
    assert machine.requests[1].key not in p.reports
    assert (machine.requests[1].key, "p-" + machine.requests[1].rid) not in p.core.pending_requests()
    machine.prefill_finished(i=1, j=0, one_rank=False, bind=False, boom=False)
    machine.prefill_finished(i=2, j=0, one_rank=False, bind=False, boom=False)
    machine.pump(rounds=8, stall_writes=False)
    assert machine.requests[1].key not in p.reports
    assert p.reports.get(machine.requests[2].key) == ["sent"], p.reports
    assert _outcomes(machine, 0) == [["done"]] * 3  # rank 0's own WRITEs landed in each
    assert _outcomes(machine, 1) == [["done"]]
    machine.teardown()
    assert p.reports.get(machine.requests[1].key) == ["failed"]  # at P's lease


def test_the_restarted_rank_alone_is_dropped() -> None:
    """P forgets only the restarted D rank's agent (its old process), not the engine's others."""
    machine = LossyCluster()
    machine.start(topology=(1, 1, 2))
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right", prefill_first=True)
    machine.pump(rounds=8, stall_writes=False)
    p = machine.live_p()[0]
    drops: list[DropPeer] = []
    run = machine._run_p

    def spy(proc, actions):  # type: ignore[no-untyped-def]
        drops.extend(a for a in actions if isinstance(a, DropPeer))
        run(proc, actions)

    machine._run_p = spy  # type: ignore[method-assign]
    _d_restarted(machine)
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right")
    machine.pump(rounds=8, stall_writes=False)
    assert drops and all(d.ranks == (1,) for d in drops), drops
    assert p.registry["D"][0][1] == machine.d_procs[0].inc
    if p.core.stats["dead_engines"]:
        raise Violation("a D rank restart is not a dead engine")
    machine.teardown()


def test_a_side_channel_serving_the_dead_process_does_not_grow_the_backoff() -> None:
    """P killed under load: D fails its requests at peer_silence_s and backs off. While P's
    side channel still serves the dead process (the rank is starting again), each handshake
    loads it and its HELLO goes unanswered: the same dead process again does not double the
    backoff (it did, to 30 s, past the moment P was back). Requests that arrive during the
    backoff wait for the next attempt (they failed at once: a burst right after P's restart
    all failed); a handshake that loads a new incarnation starts the count afresh."""
    from test_adversarial_keepalive import P_AGENT, SILENCE_S, _answer, _decode, _meta, _reports
    from test_adversarial_keepalive import _info as _slow_info

    from kvpush.core.actions import Connect

    def _info(incarnation: str) -> Any:
        # P's WRITE deadline long enough that r1's fence (its last grant plus a freshness
        # window and two deadlines: P never acknowledged its cancel) falls after this test
        return attrs.evolve(_slow_info(incarnation), write_deadline_s=100.0)

    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0)
    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", _info("p1"), "", 0.0)
    d.notification(P_AGENT, _answer(0.0, "p1"), 0.0)  # r1 registered; P dies
    t, out = 0.0, []
    while not _reports(out):
        t += 5.0
        out = d.handle_timer(t)
    assert "answered no heartbeat" in _reports(out)[0].reason and t > SILENCE_S
    for n in range(4):  # the side channel serves the dead process: the HELLO times out
        early = d.add(_meta(f"e{n}", f"ke{n}"), t + 0.5)  # in the backoff: it waits
        assert not early, early
        t += 1.0
        assert d.next_deadline() == t  # the next attempt, at the backoff's end (1 s each time)
        assert [a for a in d.handle_timer(t) if isinstance(a, Connect)]
        assert not d.add(_meta(f"r{n + 2}", f"k{n + 2}"), t)  # joins the handshake
        d.connected("P", _info("p1"), "", t)
        t += 5.0
        timeouts = _reports(d.handle_timer(t))
        assert sorted(r.request_id for r in timeouts) == [f"e{n}", f"r{n + 2}"]
        assert all("did not answer this rank's HELLO" in r.reason for r in timeouts)
    d.add(_meta("e9", "ke9"), t + 0.5)  # P is back: its side channel serves the new process
    t += 1.0
    assert [a for a in d.handle_timer(t) if isinstance(a, Connect)]
    d.connected("P", _info("p2"), "", t)
    assert d._engines["P"].failures == 0
    registered = d.notification(P_AGENT, _answer(t, "p2"), t)
    assert registered and not _reports(registered)


# The whole state machine with sends to dead processes lost, not refused: P learns of a D
# rank's restart only from the new start's messages (the per-rank path above), D of a P
# rank's death only from silence.
LossyCluster.TestCase.settings = CoreCluster.TestCase.settings
TestLossyCluster = pytest.mark.timeout(600)(LossyCluster.TestCase)
