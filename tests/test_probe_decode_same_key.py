"""Probes of the D core: two registrations of one D rank under one match key.

P keeps one registration per (match key, D rank) and renews it by key: a heartbeat naming
the key (or a ``want`` answered for it) extends whatever registration P holds for it, whichever
D request that is. D's quarantine of a failed or cancelled request assumed that nothing renews
its grant once it closed, which holds only while no other request of this rank registered the
same key with the same P engine.
"""

from __future__ import annotations

from typing import Any

from test_core_properties import CoreCluster, Request, Violation

from kvpush.core import notifications as wire


def _kinds(machine: CoreCluster) -> list[str]:
    return [wire.decode_notification(m.data).kind.value for m in machine.net]


def _add(machine: CoreCluster, req: Request) -> None:
    machine.requests.append(req)
    machine._add(machine.d_procs[0], req)


def _drop_first(machine: CoreCluster, kind: str) -> None:
    for msg in machine.net:
        if wire.decode_notification(msg.data).kind.value == kind:
            machine.net.remove(msg)
            return
    raise AssertionError(f"no {kind} in flight: {_kinds(machine)}")


def _two_requests_one_key() -> tuple[CoreCluster, Request, Request]:
    """P1 -> D TP1. The engine adds ``first`` then ``second`` under the same match key (a router
    sending one request twice, or a retry while the first is still in progress): both are
    registered, and P holds the latest registration of the key on D's rank, ``second``'s."""
    machine = CoreCluster()
    machine.start(topology=(1, 1, 1))
    first = Request(key="K", rid="r-first", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    second = Request(key="K", rid="r-second", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, first)
    machine.pump(rounds=8, stall_writes=True)  # handshakes, HELLO, first's PUSH_REG at P
    _add(machine, second)
    machine.pump(rounds=8, stall_writes=True)  # second's PUSH_REG at P: P holds it for the key
    assert not machine.net and not machine.writes
    return machine, first, second


def test_a_sibling_s_heartbeats_do_not_let_p_write_into_a_released_request() -> None:
    """The engine cancels ``second`` (the registration P holds) and the CANCEL is lost. D keeps
    heartbeating the key for ``first``, and P renews ``second``'s registration with each of
    them. ``second``'s quarantine ended at its own last grant plus the bounds: D fenced and
    released its blocks while P still held a registration D kept fresh. P's prefill then
    finished and P wrote ``second``'s blocks after D gave them back."""
    machine, first, second = _two_requests_one_key()
    d = machine.d_procs[0]
    d.requests[second.rid].cancel_calls += 1
    machine._run_d(d, d.core.cancel(second.rid, machine.now(d)))
    _drop_first(machine, "cancel")  # lost
    for _ in range(8):  # 40 s: past the quarantine bound (grant + fresh_s + 2 x WRITE deadline)
        machine.advance_clock(dt=5.0)
        machine.pump(rounds=8, stall_writes=True)
    dsecond = d.requests[second.rid]
    machine.prefill_finished(i=machine.requests.index(first), j=0, one_rank=False, bind=False, boom=False)
    try:
        machine.pump(rounds=8, stall_writes=False)  # P posts to what it holds; the WRITE lands
    except Violation as err:
        raise AssertionError(f"a WRITE landed in a released request's blocks: {err}") from None
    # second's blocks were still offered when P's WRITE landed: its DONE settles and releases it
    assert dsecond.released and dsecond.outcomes == ["cancelled"]
    machine.teardown()


def _flow(machine: CoreCluster, rounds: int = 8) -> None:
    """Handshakes and notifications go through (held ones stay held); no WRITE lands and no
    fence is confirmed."""
    for _ in range(rounds):
        handshakes, machine.handshakes = machine.handshakes, []
        for item in handshakes:
            machine._handshake(item, True)
        messages = [m for m in machine.net if not m.held]
        machine.net = [m for m in machine.net if m.held]
        for msg in messages:
            machine._deliver(msg)
        if not handshakes and not messages:
            return


def test_a_grant_sent_after_the_fence_was_issued_is_not_covered_by_it() -> None:
    """``second`` is cancelled (the CANCEL lost) and its quarantine ends: D fences P's
    connection, which the transport has not confirmed yet. Meanwhile the engine adds
    ``first`` under the same key; its PUSH_REG is delayed, its heartbeats are not, and each
    renews the registration P holds for the key: ``second``'s. A fence issued before those
    grants does not cover what P posts on them (on a new connection), so the fence's
    confirmation must not release ``second``."""
    machine = CoreCluster()
    machine.start(topology=(1, 1, 1))
    d = machine.d_procs[0]
    second = Request(key="K", rid="r-second", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, second)
    machine.pump(rounds=8, stall_writes=True)
    assert not machine.net
    d.requests[second.rid].cancel_calls += 1
    machine._run_d(d, d.core.cancel(second.rid, machine.now(d)))
    _drop_first(machine, "cancel")  # lost
    machine.t += 31.0  # past grant + fresh_s + 2 x WRITE deadline
    machine._run_d(d, d.core.handle_timer(machine.now(d)))
    assert machine.fences and not d.requests[second.rid].released  # waiting for the fence
    _flow(machine)  # D handshakes with P afresh (the fence dropped its agents)
    first = Request(key="K", rid="r-first", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, first)
    assert _kinds(machine) == ["push_reg"]
    machine.net[0].held = True  # first's PUSH_REG is delayed
    for _ in range(3):  # D's heartbeats name the key; P renews second's registration
        machine.t += 5.0
        machine._tick()
        _flow(machine)
    machine.pump(rounds=8, stall_writes=True)  # the transport confirms the fence now
    machine.prefill_finished(i=machine.requests.index(first), j=0, one_rank=False, bind=False, boom=False)
    try:
        machine.pump(rounds=8, stall_writes=False)  # P posts what it holds; the WRITE lands
    except Violation as err:
        raise AssertionError(f"a WRITE landed in a released request's blocks: {err}") from None
    machine.teardown()


def test_a_late_copy_of_a_released_request_s_push_reg_is_not_revived_by_a_retry() -> None:
    """``old`` registers (a copy of its PUSH_REG is delayed in the network), is cancelled with
    the CANCEL lost, and is released after its quarantine and a fence; P never learned that it
    ended. The engine retries under the same key (``retry``, other blocks): its PUSH_REG
    reaches P, then the late copy of ``old``'s replaces it there (P keeps one registration per
    key and D rank). P finishes; the copy's grant is stale, so P asks D for a fresh one; D
    answers for the key, which it still waits for (``retry``)."""
    machine = CoreCluster()
    machine.start(topology=(1, 1, 1))
    d = machine.d_procs[0]
    old = Request(key="K", rid="r-old", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, old)
    for _ in range(8):  # handshakes, HELLO, until D sends old's PUSH_REG
        if "push_reg" in _kinds(machine):
            break
        _flow(machine, rounds=1)
    assert "push_reg" in _kinds(machine)
    for msg in list(machine.net):
        if wire.decode_notification(msg.data).kind.value == "push_reg":
            late = type(msg)(msg.src, msg.dst, msg.dst_inc, msg.data, held=True)
            machine.net.append(late)  # a duplicate, delayed
    _flow(machine)  # P holds old's registration
    _cancel_lost_until_released(machine, d, old)
    retry = Request(key="K", rid="r-retry", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, retry)
    for _ in range(10):  # one message round at a time, the clock moving between them
        _flow(machine, rounds=1)
        machine.t += 0.01
    for msg in machine.net:
        msg.held = False  # the late copy of old's PUSH_REG arrives
    _flow(machine)
    # P's engine finishes the key's prefill: old's first (P ended that attempt), then the retry's
    machine.prefill_finished(i=machine.requests.index(old), j=0, one_rank=False, bind=False, boom=False)
    machine.prefill_finished(i=machine.requests.index(retry), j=0, one_rank=False, bind=False, boom=False)
    try:
        for _ in range(6):
            machine.pump(rounds=8, stall_writes=False)
            machine.advance_clock(dt=0.06)
    except Violation as err:
        raise AssertionError(f"a WRITE landed in a released request's blocks: {err}") from None
    assert d.requests[retry.rid].outcomes == ["done"]  # D asked P to drop old's first
    machine.teardown()


def _cancel_lost_until_released(machine: CoreCluster, d: Any, old: Request) -> None:
    """D cancels ``old``, its CANCEL is lost, and D releases it after its quarantine and a fence."""
    d.requests[old.rid].cancel_calls += 1
    machine._run_d(d, d.core.cancel(old.rid, machine.now(d)))
    _drop_first(machine, "cancel")  # lost
    for _ in range(8):
        machine.advance_clock(dt=5.0)
        machine.pump(rounds=8, stall_writes=True)
    assert d.requests[old.rid].released


def _released_unacknowledged(machine: CoreCluster) -> Request:
    """``old`` registered, was cancelled with the CANCEL lost, and was released after its
    quarantine and a fence; P still holds its registration (it never learned it ended)."""
    machine.start(topology=(1, 1, 1))
    d = machine.d_procs[0]
    old = Request(key="K", rid="r-old", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, old)
    machine.pump(rounds=8, stall_writes=True)
    _cancel_lost_until_released(machine, d, old)
    return old


def test_a_retry_whose_push_reg_is_lost_does_not_revive_a_released_request() -> None:
    """As above without the late copy: the retry's own PUSH_REG is lost, so P still holds
    ``old``'s registration, and the retry's heartbeats (naming the key) renewed it."""
    machine = CoreCluster()
    old = _released_unacknowledged(machine)
    d = machine.d_procs[0]
    retry = Request(key="K", rid="r-retry", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, retry)
    for _ in range(10):
        if "push_reg" in _kinds(machine):
            _drop_first(machine, "push_reg")  # lost
            break
        _flow(machine, rounds=1)
        machine.t += 0.01
    for _ in range(2):  # D's heartbeats name the key
        machine.advance_clock(dt=5.0)
        _flow(machine)
    machine.prefill_finished(i=machine.requests.index(old), j=0, one_rank=False, bind=False, boom=False)
    try:
        for _ in range(6):
            machine.pump(rounds=8, stall_writes=False)
            machine.advance_clock(dt=0.06)
    except Violation as err:
        raise AssertionError(f"a WRITE landed in a released request's blocks: {err}") from None
    assert d.requests[retry.rid].outcomes in ([], ["failed"])  # never done: nothing wrote it
    machine.teardown()


def test_a_retry_fails_when_p_never_acknowledges_the_earlier_cancel() -> None:
    """The CANCEL D asks again before the retry registers is lost too: the retry fails at
    the bound (HELLO timeout) naming why, and nothing was registered, so it is released."""
    machine = CoreCluster()
    _released_unacknowledged(machine)
    d = machine.d_procs[0]
    retry = Request(key="K", rid="r-retry", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, retry)
    assert _kinds(machine) == ["cancel"]
    _drop_first(machine, "cancel")
    machine.advance_clock(dt=6.0)
    mine = d.requests[retry.rid]
    assert mine.outcomes == ["failed"] and mine.released
    assert d.core.stats["push_regs_sent"] == 1  # old's only
    machine.teardown()


def test_a_failed_engine_handshaken_afresh_keeps_its_closing_requests() -> None:
    """P's answers stop reaching D for longer than ``peer_silence_s``: D fails the engine,
    ``second`` closes (its CANCEL lost) and D forgets P's agents. A new request of the key
    (``first``) handshakes afresh; the engine's new record knew nothing of ``second``, so the
    grants ``first``'s heartbeats gave the key (its PUSH_REG delayed: P still holds
    ``second``'s registration) did not move ``second``'s quarantine, and D released it while
    P held a registration D kept fresh."""
    machine = CoreCluster()
    machine.start(topology=(1, 1, 1))
    d = machine.d_procs[0]
    second = Request(key="K", rid="r-second", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, second)
    machine.pump(rounds=8, stall_writes=True)  # P holds second's registration
    for _ in range(6):  # P's answers are lost (D's CANCEL too): P's agent is dead to D at 20 s
        machine.advance_clock(dt=5.0)
        machine.net = [m for m in machine.net if m.src == d.agent]
        while "cancel" in _kinds(machine):
            _drop_first(machine, "cancel")
        for msg in list(machine.net):
            machine.net.remove(msg)
            machine._deliver(msg)
        machine.net = [m for m in machine.net if m.src == d.agent]
    assert d.requests[second.rid].outcomes == ["failed"] and not d.requests[second.rid].released
    machine.advance_clock(dt=2.0)  # past the engine's backoff
    first = Request(key="K", rid="r-first", seq=next(machine.seq), nblocks=1, sizes="right", packed=False)
    _add(machine, first)
    for _ in range(10):  # handshake afresh, HELLO; first's PUSH_REG is delayed
        for msg in machine.net:
            if wire.decode_notification(msg.data).kind.value == "push_reg":
                msg.held = True
        _flow(machine, rounds=1)
        machine.t += 0.01
    for _ in range(8):  # first's heartbeats renew what P holds for the key: second's
        machine.advance_clock(dt=5.0)
        _flow(machine)
    machine.prefill_finished(i=machine.requests.index(first), j=0, one_rank=False, bind=False, boom=False)
    try:
        machine.pump(rounds=8, stall_writes=False)
    except Violation as err:
        raise AssertionError(f"a WRITE landed in a released request's blocks: {err}") from None
    machine.teardown()
