"""Probe of the D core: a heartbeat answer's ``failed`` settles a producer only as far as P says.

P answers a heartbeat naming a key it ended ``failed``. D took that as "P's producer settled,
nothing of it in flight" and released the blocks at once. But P ends a key failed also when it
aborted a WRITE at its deadline: the bytes P's kernel queued may still arrive (a partitioned TCP
link delivers them later; docs/reliability.md, issue 12), which is why P's own FAIL states
``unsettled`` and D fences before releasing. When that FAIL is lost, the heartbeat answer was
D's only word, and it carries no ``unsettled``.
"""

from __future__ import annotations

from test_core_properties import WRITE_DEADLINE_S, CoreCluster, Violation

from kvpush.core import notifications as wire


def _kinds(machine: CoreCluster) -> list[str]:
    return [wire.decode_notification(m.data).kind.value for m in machine.net]


def test_a_heartbeat_answer_failed_after_an_aborted_write_does_not_release_without_a_fence() -> None:
    machine = CoreCluster()
    machine.start(topology=(1, 1, 1))
    d = machine.d_procs[0]
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right")
    machine.pump(rounds=8, stall_writes=True)
    machine.prefill_finished(i=0, j=0, one_rank=False, bind=True, boom=False)
    machine.pump(rounds=8, stall_writes=True)  # the first request's WRITE is posted and stalls
    (stalled,) = machine.writes.values()
    machine.advance_clock(dt=4.0)
    machine.pump(rounds=8, stall_writes=True)
    # A second request keeps a WRITE in flight to the same D rank, so P keeps D loaded.
    machine.new_request(nblocks=1, first_rank_only=False, packed=False, sizes="right")
    machine.pump(rounds=8, stall_writes=True)
    machine.prefill_finished(i=1, j=0, one_rank=False, bind=True, boom=False)
    machine.pump(rounds=8, stall_writes=True)
    assert len(machine.writes) == 2
    machine.t += WRITE_DEADLINE_S - 4.0 + 0.5  # P aborts the first WRITE; its bytes may still land
    machine._tick()
    assert stalled.aborted and stalled.state == "pending"
    first = d.requests[machine.requests[0].rid]
    # P's FAIL (unsettled) is lost
    machine.net = [m for m in machine.net if wire.decode_notification(m.data).kind.value != "failed"]
    for _ in range(3):  # D's heartbeat names the key; P answers failed=[key]
        machine.t += 1.5
        machine._tick()
        machine.pump(rounds=8, stall_writes=True)
        if first.outcomes:
            break
    assert first.outcomes == ["failed"], first.outcomes
    try:
        machine._land(stalled, True)  # TCP delivers the bytes P's kernel had queued
    except Violation as err:
        raise AssertionError(f"released without a fence: {err}") from None
    machine.teardown()


def test_a_fence_while_handling_a_heartbeat_answer_does_not_break_the_rest_of_it() -> None:
    """Found by the kernel-copy machine once the answer's ``failed`` fenced: the fence reset
    the engine (its agents forgotten, a handshake afresh) in the middle of the answer, and
    reading the rest of it (``unknown``) raised on the forgotten agents."""
    from test_core_properties import KernelCopyCluster

    state = KernelCopyCluster()
    state.start(topology=(1, 2, 2))
    state.poll(j=0)
    state.new_request(first_rank_only=False, nblocks=1, packed=False, prefill_first=True, sizes="absent")
    state.poll(j=0)
    state.new_request(first_rank_only=False, nblocks=1, packed=False, prefill_first=False, sizes="absent")
    state.handshake(i=11, ok=False, refused=False)
    state.pump(rounds=3, stall_writes=False)
    state.advance_clock(dt=1.0, late=None)
    state.new_request(first_rank_only=False, nblocks=1, packed=False, prefill_first=False, sizes="absent")
    state.new_request(first_rank_only=False, nblocks=1, packed=False, prefill_first=False, sizes="wrong")
    state.handshake(i=0, ok=True, refused=False)
    state.pump(rounds=8, stall_writes=False)
    state.add_on_another_rank(i=0, j=0)
    state.retry(finish_first=False, i=55)
    state.new_request(first_rank_only=True, nblocks=1, packed=False, prefill_first=False, sizes="absent")
    state.prefill_finished(bind=False, boom=True, i=14, j=0, one_rank=True)
    state.delay_message(i=0)
    state.advance_clock(dt=4.0, late=None)
    state.delay_message(i=0)
    state.pump(rounds=8, stall_writes=False)
    state.teardown()
