"""Probe of 2026-12-03: a D cancel before D's first registration, and owed acks of reused ids.

Findings:

(1) A D request cancelled (or failed) before it sent any PUSH_REG (its handshake with P still
    running, or waiting for a fresh stamp or an owed ack) was reported at once and nothing was
    sent: P, whose prefill of the key had finished, held its blocks until its lease
    (``lease_s``, 30 s) ran out. Now D sends the request's CANCEL to its producers (at once
    when its P engine is ready, else once its handshake is, bounded), and P ends the key at the
    CANCEL (or at the finish, when the CANCEL came first) as long as no registration of
    another D request of that engine is held for it, the key is not bound to another engine,
    and the CANCEL names no live attempt of another registration.
(2) The ack of an owed cancel whose D request id was live again (the engine gave it to a new
    request after ``ID_MEMORY`` ids) was taken as that request's result: rejected there (it
    names another attempt), so the owed entry was never settled and a request of its key
    waiting for that ack failed at ``hello_timeout_s``; with a P that echoes no attempts it
    settled the live request instead. Now an ack naming the owed attempt settles the owed entry,
    and one naming none (such a P) settles the owed entry first.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_protocol_safety import _registration
from test_retry_after_abort import _core, _note, _posts, _register, _reports

from kvpush.core import notifications as wire
from kvpush.core.actions import Release, Report, Send
from kvpush.core.types import NotificationKind, RankKey, ReadSpec


def _cancel(core: Any, now: float, agent: str = "D-agent", key: str = "x-1", **overrides: Any) -> list[Any]:
    message = wire.encode_cancel(key, _registration(**overrides), overrides.get("decode_tp_rank", 0))
    return core.notification(agent, _note(message), now)


def _acks(actions: list[Any]) -> list[Any]:
    return [
        note
        for a in actions
        if isinstance(a, Send) and (note := _note(a.message)).kind is NotificationKind.CANCEL_ACK
    ]


def _sent(actions: list[Any]) -> list[Any]:
    return [_note(a.message) for a in actions if isinstance(a, Send)]


# ---------------------------------------------------------------------------------------------
# (1) P: a cancel of a registration P never got
# ---------------------------------------------------------------------------------------------


def test_a_finished_prefill_is_released_at_the_cancel_of_a_d_that_never_registered() -> None:
    """P finished x-1 (no router binding); D's d-1 was cancelled before it registered. Its
    CANCEL ends the key at once: P reports the prefill failed (blocks back), never posts, and
    its lease does not have to run out."""
    core = _core()
    assert _posts(core.finished("x-1", "p-1", ((5,),), "", 100.0)) == []
    out = _cancel(core, 100.1, attempt=7)
    assert [a.attempt for a in _acks(out)] == [7]
    assert _reports(out) == [("p-1", "failed")], out
    (report,) = [a for a in out if isinstance(a, Report)]
    assert "cancelled by D rank 0" in report.reason and "before it registered" in report.reason
    assert core.state_sizes()["requests"] == 0
    assert core.handle_timer(100.0 + core.s.lease_s + 1) == []  # nothing left for the lease
    # A late PUSH_REG of the cancelled registration is never written; a second CANCEL (D
    # resent it, or another producer's copy was duplicated) is acknowledged, nothing more.
    assert _posts(_register(core, 100.2, grant=100.0)) == []
    again = _cancel(core, 100.3, attempt=7)
    assert len(_acks(again)) == 1 and _reports(again) == [], again


def test_a_cancel_of_a_rank_p_has_not_loaded_ends_the_finish_too() -> None:
    """P dropped (or never loaded) the D rank when its CANCEL came: P connects to it to send
    the ack, and its finish ends at once all the same."""
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    core = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1), plan=plan
    )
    out = _cancel(core, 100.0, attempt=7)
    assert _acks(out) == []  # owed until P loaded the rank
    out = core.finished("x-1", "p-1", ((5,),), "", 100.1)
    assert _reports(out) == [("p-1", "failed")] and _posts(out) == [], out
    out = core.connected("D", 0, "D-agent", "d1", 1, "", 100.2)
    assert [a.attempt for a in _acks(out)] == [7], out


def test_a_cancel_before_the_prefill_finished_ends_the_finish_at_once() -> None:
    """The CANCEL reaches P before P finished (and before any registration): the finish is
    reported failed at once, nothing is posted, and a duplicate CANCEL changes nothing."""
    core = _core()
    assert len(_acks(_cancel(core, 100.0, attempt=7))) == 1
    assert len(_acks(_cancel(core, 100.05, attempt=7))) == 1  # twice: acknowledged again
    out = core.finished("x-1", "p-1", ((5,),), "", 100.1)
    assert _reports(out) == [("p-1", "failed")] and _posts(out) == [], out
    assert core.state_sizes()["requests"] == 0
    assert _posts(_register(core, 100.2, grant=100.05)) == []


def test_a_cancel_before_the_finish_does_not_end_a_key_the_router_gave_another_engine() -> None:
    """D engine D cancels d-1 before registering; the router bound x-1 to engine E, whose
    registration P holds: E's push goes on."""
    core = _core()
    _cancel(core, 100.0)
    other = {"decode_engine_id": "E", "decode_port": 5602, "request_id": "e-1", "decode_incarnation": "e1"}
    core.notification("E-agent", _note(wire.encode_hello(_registration(**other), 0)), 100.0)
    core.connected("E", 0, "E-agent", "e1", 1, "", 100.0)
    core.notification("E-agent", _note(wire.encode_push_reg(_registration(**other, grant=100.0))), 100.05)
    out = core.finished("x-1", "p-1", ((5,),), "E", 100.1)
    assert [p.key for p in _posts(out)] == ["x-1"], out
    assert _reports(out) == []


def test_a_cancel_before_the_finish_ends_it_when_the_router_names_that_engine() -> None:
    """Another engine E registered first (tentatively the key's), D cancelled before it
    registered; the router's finish names D: D's cancel ends the key at once."""
    core = _core()
    other = {"decode_engine_id": "E", "decode_port": 5602, "request_id": "e-1", "decode_incarnation": "e1"}
    core.notification("E-agent", _note(wire.encode_hello(_registration(**other), 0)), 100.0)
    core.connected("E", 0, "E-agent", "e1", 1, "", 100.0)
    core.notification("E-agent", _note(wire.encode_push_reg(_registration(**other, grant=100.0))), 100.01)
    _cancel(core, 100.02)
    out = core.finished("x-1", "p-1", ((5,),), "D", 100.1)
    assert _reports(out) == [("p-1", "failed")] and _posts(out) == [], out


def test_a_late_cancel_does_not_end_a_new_request_of_the_rank() -> None:
    """d-1 was cancelled before it registered and the engine added d-1#1 under the same key;
    d-1#1's PUSH_REG reached P first (or P holds it when the CANCEL comes): the key is pushed
    to d-1#1, whether P finished before the CANCEL or after."""
    for finish_first in (True, False):
        core = _core()
        _register(core, 100.0, request_id="d-1#1", grant=100.0)
        out = core.finished("x-1", "p-1", ((5,),), "", 100.05) if finish_first else []
        out += _cancel(core, 100.1)
        if not finish_first:
            out += core.finished("x-1", "p-1", ((5,),), "", 100.15)
        assert [p.key for p in _posts(out)] == ["x-1"] and _reports(out) == [], (finish_first, out)


def test_a_cancel_recorded_before_the_finish_does_not_end_a_new_request_registered_after_it() -> None:
    """The CANCEL of d-1 (never registered) reaches P before anything of x-1; then d-1#1 of
    the same rank registers, then P finishes: d-1#1 is pushed."""
    core = _core()
    _cancel(core, 100.0)
    _register(core, 100.05, request_id="d-1#1", grant=100.02)
    out = core.finished("x-1", "p-1", ((5,),), "", 100.1)
    assert [p.key for p in _posts(out)] == ["x-1"] and _reports(out) == [], out


def test_a_cancel_naming_another_attempt_of_the_held_registration_does_not_end_it() -> None:
    """The rank holds d-1 of attempt 9 (the engine gave d-1 again after D forgot it); a late
    CANCEL of d-1's earlier attempt 3 (never registered) must not cancel it."""
    core = _core()
    _register(core, 100.0, grant=100.0, attempt=9)
    out = _cancel(core, 100.05, attempt=3)
    assert [a.attempt for a in _acks(out)] == [3]
    out += core.finished("x-1", "p-1", ((5,),), "", 100.1)
    assert [p.key for p in _posts(out)] == ["x-1"] and _reports(out) == [], out


def _two_rank_core() -> Any:
    """A P core (rank (0, 0)) writing into both ranks of a TP-2 D engine (MLA fan-out)."""
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [
            ReadSpec(dst_tp_rank=r, local_block_ids=blocks, remote_block_ids=reg.block_ids) for r in (0, 1)
        ]

    core = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1), plan=plan
    )
    for rank in (0, 1):
        reg = _registration(decode_tp_rank=rank, decode_tp_size=2, decode_incarnation=f"d1-{rank}")
        core.notification(f"D-agent-{rank}", _note(wire.encode_hello(reg, rank)), 100.0)
        core.connected("D", rank, f"D-agent-{rank}", f"d1-{rank}", 2, "", 100.0)
    return core


def _register_rank(core: Any, rank: int, now: float, **overrides: Any) -> list[Any]:
    fields = {"decode_tp_rank": rank, "decode_tp_size": 2, "decode_incarnation": f"d1-{rank}", **overrides}
    return core.notification(f"D-agent-{rank}", _note(wire.encode_push_reg(_registration(**fields))), now)


def _cancel_rank(core: Any, rank: int, now: float, **overrides: Any) -> list[Any]:
    fields = {"decode_tp_rank": rank, "decode_tp_size": 2, "decode_incarnation": f"d1-{rank}", **overrides}
    return _cancel(core, now, agent=f"D-agent-{rank}", **fields)


def test_a_cancel_of_one_rank_ends_the_key_and_tells_the_other_ranks_registration() -> None:
    """MLA fan-out: D rank 1 registered d-1, rank 0 had not when the engine cancelled; rank
    0's CANCEL ends the key (P holds blocks for both), rank 1's registration is told FAIL."""
    core = _two_rank_core()
    _register_rank(core, 1, 100.0, grant=100.0)
    core.finished("x-1", "p-1", ((5,),), "", 100.05)
    out = _cancel_rank(core, 0, 100.1)
    assert _reports(out) == [("p-1", "failed")], out
    fails = [n for n in _sent(out) if n.kind is NotificationKind.FAILED]
    assert [n.request_id for n in fails] == ["d-1"], out


def test_a_cancel_of_one_rank_leaves_another_d_request_of_the_other_rank_alone() -> None:
    """Rank 1 holds d-1#1 (the engine's new request under the key); rank 0's late CANCEL of
    d-1 (never registered there) must not end the key: rank 0's d-1#1 still comes."""
    core = _two_rank_core()
    _register_rank(core, 1, 100.0, request_id="d-1#1", grant=100.0)
    core.finished("x-1", "p-1", ((5,),), "", 100.05)
    out = _cancel_rank(core, 0, 100.1)
    assert _reports(out) == [] and not [n for n in _sent(out) if n.kind is NotificationKind.FAILED], out
    out = _register_rank(core, 0, 100.2, request_id="d-1#1", grant=100.15)
    assert sorted(p.dst for p in _posts(out)) == [0], out


# ---------------------------------------------------------------------------------------------
# (1) D: the cancel told
# ---------------------------------------------------------------------------------------------


def _d_core() -> Any:
    from test_handshake_refusal import _decode

    return _decode()


def _p_ready(core: Any, at: float) -> list[Any]:
    import attrs
    from test_handshake_refusal import P0, P_AGENT, _info

    info = attrs.evolve(
        _info(), echo_attempts=frozenset({P_AGENT}), unregistered_cancels=frozenset({P_AGENT})
    )
    out = core.connected("P", info, "", at)
    return out + core.notification(
        P_AGENT, _note(wire.encode_heartbeat_answer(P0, at + 0.01, "p1")), at + 0.01
    )


def test_d_tells_p_of_a_cancel_made_while_its_handshake_ran() -> None:
    """d-1 is cancelled while D's handshake with P runs: reported and released at once (P
    never had a registration), and its CANCEL goes to P once the handshake is done."""
    from test_handshake_refusal import P_AGENT, _request

    core = _d_core()
    core.add(_request("d-1", "x-1"), 0.0)
    out = core.cancel("d-1", 0.1)
    assert [a.request_id for a in out if isinstance(a, Release)] == ["d-1"]
    assert [(a.request_id, a.outcome) for a in out if isinstance(a, Report)] == [("d-1", "cancelled")]
    out = _p_ready(core, 0.2)
    cancels = [(a.agent, _note(a.message)) for a in out if isinstance(a, Send)]
    cancels = [(agent, n) for agent, n in cancels if n.kind is NotificationKind.CANCEL]
    assert [(agent, n.request_id, n.registration.request_id) for agent, n in cancels] == [
        (P_AGENT, "x-1", "d-1")
    ], out
    assert cancels[0][1].registration.attempt is not None
    assert core.pending == 0


def test_d_tells_p_at_once_of_a_cancel_made_while_waiting_for_a_fresh_stamp() -> None:
    """x-1 ended here before, so d-2 waits for a fresh stamp before registering; cancelled
    then, its CANCEL goes to P at once (the engine is ready)."""
    from test_handshake_refusal import P0, P_AGENT, _request

    core = _d_core()
    core.add(_request("d-1", "x-1"), 0.0)
    _p_ready(core, 0.1)
    core.cancel("d-1", 0.2)
    core.notification(P_AGENT, _note(wire.encode_cancel_ack("d-1", P0, False, incarnation="p1")), 0.25)
    core.add(_request("d-2", "x-1"), 0.3)  # asks for a fresh stamp first
    out = core.cancel("d-2", 0.35)
    cancels = [n for n in _sent(out) if n.kind is NotificationKind.CANCEL]
    assert [n.registration.request_id for n in cancels] == ["d-2"], out


def test_the_cancels_d_keeps_for_p_are_bounded() -> None:
    """Cancels made while the handshake runs are kept for P, at most MAX_UNTOLD_CANCELS."""
    from test_handshake_refusal import _request

    import kvpush.core.decode_core as decode_core

    core = _d_core()
    for i in range(decode_core.MAX_UNTOLD_CANCELS + 5):
        core.add(_request(f"d-{i}", f"x-{i}"), 0.0)
        core.cancel(f"d-{i}", 0.0)
    out = _p_ready(core, 0.2)
    cancels = [n for n in _sent(out) if n.kind is NotificationKind.CANCEL]
    assert len(cancels) == decode_core.MAX_UNTOLD_CANCELS
    assert cancels[-1].registration.request_id == f"d-{decode_core.MAX_UNTOLD_CANCELS + 4}"


# ---------------------------------------------------------------------------------------------
# (1) Over a real transport: P's blocks back at the cancel, not at the lease
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("finish_first", [True, False])
def test_ps_blocks_go_back_at_a_cancel_before_ds_first_registration(finish_first: bool) -> None:
    """Real workers (NIXL in one process), P's lease 30 s: d-1 is cancelled while D's first
    handshake with P runs. P's finished prefill is reported failed within seconds."""
    from cluster import Cluster

    with Cluster(transport="nixl", lease_s=30.0) as cluster:
        if finish_first:
            cluster.finish("p-1", [[2]], "x-1")
        cluster.add("d-1", [[1]], "x-1")
        cluster.receivers[0].cancel("d-1")  # the handshake with P is still running
        started = time.monotonic()
        if not finish_first:
            cluster.finish("p-1", [[2]], "x-1")
        reason = cluster.wait_prefill("p-1", timeout_s=10.0)[RankKey(0, 0)]
        assert reason is not None and "cancelled by D rank 0" in reason, reason
        assert time.monotonic() - started < 5.0
        assert cluster.senders[RankKey(0, 0)].stats["writes"] == 0


# ---------------------------------------------------------------------------------------------
# (2) The owed ack of a D request id live again
# ---------------------------------------------------------------------------------------------


def _owed_core(*, echoes: bool = True) -> tuple[Any, int]:
    """A D core where r (x-1) was registered, cancelled and, P silent, released on a fence:
    its cancel owed. Returns the core and the attempt the owed cancel names."""
    from test_probe_clock_identity import _attempt, _decode_registered

    from kvpush.core.actions import Fence

    core, out = _decode_registered("r", "x-1", 1.0, echoes=echoes)
    attempt = _attempt(out)
    core.cancel("r", 1.1)
    fences = [a for a in core.handle_timer(61.0) if isinstance(a, Fence)]
    assert fences, "the quarantine fences the silent producer"
    released = core.fenced(fences[0].fence_id, 61.1)
    assert any(isinstance(a, Release) and a.request_id == "r" for a in released), released
    assert core._unanswered
    return core, attempt


def _add_ready(core: Any, rid: str, key: str, at: float, *, echoes: bool = True) -> list[Any]:
    """Add ``rid`` (``key``) and let D's handshake afresh with P start "p1" complete (the
    fence dropped P's agents)."""
    import attrs
    from test_handshake_refusal import P0, P_AGENT, _info, _request

    out = core.add(_request(rid, key), at)
    info = attrs.evolve(_info(), echo_attempts=frozenset({P_AGENT} if echoes else ()))
    out += core.connected("P", info, "", at + 0.01)
    answer = wire.encode_heartbeat_answer(P0, at + 0.02, "p1")
    return out + core.notification(P_AGENT, _note(answer), at + 0.02)


def _live_attempt(out: list[Any]) -> int:
    (reg,) = [n for n in _sent(out) if n.kind is NotificationKind.PUSH_REG]
    return reg.registration.attempt


def _ack(rid: str, attempt: int | None) -> Any:
    from test_handshake_refusal import P0

    return _note(wire.encode_cancel_ack(rid, P0, False, unsettled=False, incarnation="p1", attempt=attempt))


def test_the_owed_ack_of_an_id_live_again_under_the_same_key_lets_it_register() -> None:
    """r (x-1) was released on a fence, its cancel owed. The engine gives r again (D forgot
    it) under x-1: the new r asks the owed cancel and waits for its ack. The ack (naming the
    owed attempt) used to be held as the new r's own early result: the new r never
    registered and failed at ``hello_timeout_s``."""
    from test_handshake_refusal import P_AGENT

    core, owed = _owed_core()
    asked = _add_ready(core, "r", "x-1", 70.0)
    assert [n.registration.attempt for n in _sent(asked) if n.kind is NotificationKind.CANCEL] == [owed]
    out = core.notification(P_AGENT, _ack("r", owed), 70.1)
    assert [n.kind for n in _sent(out)] == [NotificationKind.HEARTBEAT], out  # a fresh stamp, then PUSH_REG
    assert not core._unanswered, "the owed entry was not settled"
    out = core.handle_timer(70.0 + core.s.hello_timeout_s + 1)
    assert not [a for a in out if isinstance(a, Report)], out


def test_the_owed_ack_of_an_id_live_again_under_another_key_settles_only_the_owed_entry() -> None:
    """The new r registered x-2. n of x-1 asks r's owed cancel; the ack naming the owed
    attempt settles it (n registers) and neither completes nor releases the live r, whose own
    DONE then completes it."""
    from test_handshake_refusal import P0, P_AGENT, _request

    core, owed = _owed_core()
    live = _live_attempt(_add_ready(core, "r", "x-2", 70.0))
    asked = core.add(_request("n", "x-1"), 70.1)
    assert [n.registration.request_id for n in _sent(asked) if n.kind is NotificationKind.CANCEL] == ["r"]
    out = core.notification(P_AGENT, _ack("r", owed), 70.2)
    assert not [a for a in out if isinstance(a, (Report, Release))], out
    assert [n.kind for n in _sent(out)] == [NotificationKind.HEARTBEAT], out  # n goes on
    assert core.holds("r") and not core._unanswered
    done = wire.encode_done("r", P0, 1, incarnation="p1", attempt=live)
    out = core.notification(P_AGENT, _note(done), 70.3)
    assert [(a.request_id, a.outcome) for a in out if isinstance(a, Report)] == [("r", "done")]


def test_the_owed_ack_does_not_release_a_cancelled_live_request_of_the_id() -> None:
    """The new r (x-2) is cancelled and waits for its own ack; the owed ack of the earlier r
    (echoing the owed attempt, or, from a P that echoes none, naming none) settles the owed
    entry and releases nothing; r's own ack releases it."""
    from test_handshake_refusal import P_AGENT

    for echoes in (True, False):
        core, owed = _owed_core(echoes=echoes)
        live = _live_attempt(_add_ready(core, "r", "x-2", 70.0, echoes=echoes))
        core.cancel("r", 70.1)
        out = core.notification(P_AGENT, _ack("r", owed if echoes else None), 70.2)
        assert not [a for a in out if isinstance(a, Release)], (echoes, out)
        assert not core._unanswered, echoes
        out = core.notification(P_AGENT, _ack("r", live if echoes else None), 70.3)
        assert [a.request_id for a in out if isinstance(a, Release)] == ["r"], (echoes, out)


def test_an_ack_of_a_live_request_naming_its_own_attempt_is_not_taken_for_the_owed_one() -> None:
    """The live r's own ack (its attempt) settles r, not r's owed entry of x-1."""
    from test_handshake_refusal import P_AGENT

    core, _ = _owed_core()
    live = _live_attempt(_add_ready(core, "r", "x-2", 70.0))
    core.cancel("r", 70.1)
    out = core.notification(P_AGENT, _ack("r", live), 70.2)
    assert [a.request_id for a in out if isinstance(a, Release)] == ["r"], out
    assert core._unanswered, "the live request's ack settled the owed entry"


@pytest.fixture
def small_id_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpush.core.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "ID_MEMORY", 3)


def test_the_owed_ack_of_an_id_the_engine_gave_again_over_real_workers(small_id_memory: None) -> None:
    """Real workers (loopback transport behind the fault injector; D remembers 3 ids). r of
    x-1 is cancelled, its CANCEL lost: released on a fence, its cancel owed. Once D forgot r,
    the engine gives r again (x-2, registered as r), and n of x-1 asks r's owed cancel again.
    P's ack of it used to be taken as the live r's answer (rejected there): n failed at D's
    HELLO timeout. Now n registers and is pushed, and the live r is neither completed nor
    released by that ack: its own push completes it."""
    from cluster import Cluster, wait_until
    from test_reliability import cancelled_reason, faulty

    with Cluster(
        heartbeat_interval_s=0.05,
        write_deadline_s=0.4,
        request_timeout_s=60,
        **faulty(drop_notifs=1.0, drop_prefixes=["CANCEL:"]),
    ) as cluster:
        sender, receiver = cluster.senders[RankKey(0, 0)], cluster.receivers[0]
        cluster.add("r", [[1]], "x-1")
        wait_until(lambda: sender.call_on_writer(sender.core.state_sizes)["requests"] == 1, what="r at P")
        receiver.cancel("r")
        assert "fenced" in cancelled_reason(cluster, "r")
        sender.transport.rates["drop_notifs"] = 0.0  # P hears every CANCEL from now on
        for i in range(4):  # r leaves D's id memory
            cluster.add(f"c-{i}", [[10 + i]], f"c-{i}")
            cluster.finish(f"pc-{i}", [[10 + i]], f"c-{i}")
            assert cluster.wait_decode(f"c-{i}") == {0: None}
        cluster.add("r", [[2]], "x-2")  # the engine gives r again: registered as r itself
        cluster.add("n", [[3]], "x-1")  # asks r's owed cancel first
        wait_until(lambda: receiver.stats["push_regs_sent"] >= 7, timeout_s=10, what="n registered")
        cluster.poll()
        assert "n" not in cluster.d_results[0] and "r" not in cluster.d_results[0], cluster.d_results[0]
        # x-1 ended on P at the owed cancel before P finished it: its first finish is that
        # attempt's own prefill (refused); the next is n's.
        cluster.finish("p-old", [[4]], "x-1")
        assert "already ended" in (cluster.wait_prefill("p-old")[RankKey(0, 0)] or "")
        cluster.finish("p-n", [[5]], "x-1")
        assert cluster.wait_decode("n") == {0: None}
        cluster.poll()
        assert "r" not in cluster.d_results[0], "the owed ack ended the live r"
        cluster.finish("p-r", [[6]], "x-2")
        assert cluster.wait_decode("r") == {0: None}


def test_a_cancel_before_registering_of_a_tentative_engine_ends_the_finish_naming_it() -> None:
    """x-1 not bound yet: D's rank 1 registered d-1 first (the key's tentative engine), engine
    E registered too; D's rank 0 cancels d-1 before it registered: rank 1's d-1 is told FAIL at
    the cancel (each D rank its own process and incarnation). The router's finish naming D
    ends at once (E's e-1 told FAIL); one naming E pushes E."""
    for router, pushed in (("D", False), ("E", True)):
        core = _two_rank_core()
        _register_rank(core, 1, 100.0, grant=100.0)
        other = {
            "decode_engine_id": "E",
            "decode_port": 5602,
            "request_id": "e-1",
            "decode_incarnation": "e1",
        }
        core.notification("E-agent", _note(wire.encode_hello(_registration(**other), 0)), 100.0)
        core.connected("E", 0, "E-agent", "e1", 1, "", 100.0)
        core.notification("E-agent", _note(wire.encode_push_reg(_registration(**other, grant=100.0))), 100.01)
        cancel = _cancel_rank(core, 0, 100.02)
        assert len(_acks(cancel)) == 1
        assert [n.request_id for n in _sent(cancel) if n.kind is NotificationKind.FAILED] == ["d-1"]
        out = core.finished("x-1", "p-1", ((5,),), router, 100.1)
        if pushed:
            assert [p.registration.request_id for p in _posts(out)] == ["e-1"], out
        else:
            assert _reports(out) == [("p-1", "failed")] and _posts(out) == [], out
            fails = sorted(n.request_id for n in _sent(out) if n.kind is NotificationKind.FAILED)
            assert fails == ["e-1"], out  # E's too: the key is D's, never E's
