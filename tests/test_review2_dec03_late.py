"""Review of 2026-12-03 (late morning): the attempt-bound answers and the early cancels.

Findings (each test failed first):

(1) A D request that ended before it registered is cancelled by every D rank (each rank's
    core sends its own CANCEL). The first to reach P ends the finished prefill; another rank's
    CANCEL of the same D request, arriving after that attempt ended (the normal order with
    D TP >= 2, or one rank's handshake running later), was remembered against the key and
    ended the *next* attempt under the key (a retry) at its finish: a request failed by a
    cancel it did not send.
(2) D (2.8) sent the CANCEL of a request that never registered to every P, also to one of an
    earlier release (2.7), which never held that registration and judged it as the cancel of
    the key: with another D request of the key held on another rank (a new request under the
    key), that P failed the key and the new request with it. D now sends such a CANCEL only to
    a P that states ``unregistered_cancels`` in its handshake (every P of this release); an
    older P keeps its lease, as before.
"""

from __future__ import annotations

from typing import Any

from test_probe_early_cancel import _acks, _cancel_rank, _register_rank, _two_rank_core
from test_retry_after_abort import _posts, _reports

from kvpush.core.actions import Release, Send


def test_another_ranks_late_cancel_of_an_ended_attempt_does_not_end_the_retry() -> None:
    """D TP-2: d-1 ended before registering; rank 0's CANCEL ends p-1 (x-1, bound to D).
    Rank 1's CANCEL of d-1 arrives after that: acknowledged, nothing more. The retry under
    x-1 (p-2, for D's new request d-2) is then pushed, not ended at its finish."""
    core = _two_rank_core()
    core.finished("x-1", "p-1", ((5,),), "D", 100.0)
    assert _reports(_cancel_rank(core, 0, 100.1, attempt=3)) == [("p-1", "failed")]
    late = _cancel_rank(core, 1, 100.15, attempt=3)
    assert len(_acks(late)) == 1 and _reports(late) == [], late
    out: list[Any] = core.finished("x-1", "p-2", ((6,),), "D", 101.0)
    assert _reports(out) == [], out
    for rank in (0, 1):
        out += _register_rank(core, rank, 101.1, request_id="d-2", grant=100.9, attempt=4)
    assert sorted(p.dst for p in _posts(out)) == [0, 1] and _reports(out) == [], out


def test_another_ranks_late_cancel_reaching_the_retry_does_not_end_it() -> None:
    """As above, but rank 1's CANCEL of d-1 arrives once the retry p-2 finished (d-2 not
    registered yet): the retry goes on."""
    core = _two_rank_core()
    core.finished("x-1", "p-1", ((5,),), "D", 100.0)
    assert _reports(_cancel_rank(core, 0, 100.1, attempt=3)) == [("p-1", "failed")]
    out: list[Any] = core.finished("x-1", "p-2", ((6,),), "D", 101.0)
    late = _cancel_rank(core, 1, 101.05, attempt=3)
    assert len(_acks(late)) == 1 and _reports(late) == [], late
    for rank in (0, 1):
        out += _register_rank(core, rank, 101.1, request_id="d-2", grant=100.9, attempt=4)
    assert sorted(p.dst for p in _posts(out)) == [0, 1] and _reports(out) == [], out


def test_a_late_cancel_from_a_rank_p_has_not_loaded_does_not_end_the_retry() -> None:
    """As above, with rank 1 not loaded by P when its CANCEL of d-1 comes (after the retry
    finished): the retry goes on, and the ack goes out once P loads rank 1."""
    from test_protocol_safety import _registration
    from test_retry_after_abort import _note

    from kvpush.core import notifications as wire
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import RankKey, ReadSpec

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [
            ReadSpec(dst_tp_rank=r, local_block_ids=blocks, remote_block_ids=reg.block_ids) for r in (0, 1)
        ]

    core = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1), plan=plan
    )
    reg0 = _registration(decode_tp_rank=0, decode_tp_size=2, decode_incarnation="d1-0")
    core.notification("D-agent-0", _note(wire.encode_hello(reg0, 0)), 100.0)
    core.connected("D", 0, "D-agent-0", "d1-0", 2, "", 100.0)
    core.finished("x-1", "p-1", ((5,),), "D", 100.0)
    assert _reports(_cancel_rank(core, 0, 100.1, attempt=3)) == [("p-1", "failed")]
    out: list[Any] = core.finished("x-1", "p-2", ((6,),), "D", 101.0)
    late = _cancel_rank(core, 1, 101.05, attempt=3)
    assert _acks(late) == [] and _reports(late) == [], late
    connected = core.connected("D", 1, "D-agent-1", "d1-1", 2, "", 101.06)
    assert [a.request_id for a in _acks(connected)] == ["d-1"] and _reports(connected) == [], connected
    for rank in (0, 1):
        out += _register_rank(core, rank, 101.1, request_id="d-2", grant=100.9, attempt=4)
    assert sorted(p.dst for p in _posts(out)) == [0, 1] and _reports(out) == [], out


def _untold_cancels(*, states: bool) -> list[Any]:
    """d-1 is cancelled while D's handshake with P runs; the CANCELs D sends once it is done,
    to a P that states ``unregistered_cancels`` or not."""
    import attrs
    from test_handshake_refusal import P0, P_AGENT, _decode, _info, _request
    from test_retry_after_abort import _note

    from kvpush.core import notifications as wire
    from kvpush.core.types import NotificationKind

    core = _decode()
    core.add(_request("d-1", "x-1"), 0.0)
    core.cancel("d-1", 0.1)
    info = attrs.evolve(
        _info(),
        echo_attempts=frozenset({P_AGENT}),
        unregistered_cancels=frozenset({P_AGENT}) if states else frozenset(),
    )
    out = core.connected("P", info, "", 0.2)
    out += core.notification(P_AGENT, _note(wire.encode_heartbeat_answer(P0, 0.21, "p1")), 0.21)
    notes = [_note(a.message) for a in out if isinstance(a, Send)]
    # Once ready: x-2 ended here (d-2 registered, cancelled, acknowledged), so d-3 waits for a
    # fresh stamp before registering; its cancel then is told at once, or not at all.
    (reg,) = [
        _note(a.message).registration for a in core.add(_request("d-2", "x-2"), 0.3) if isinstance(a, Send)
    ]
    core.cancel("d-2", 0.31)
    ack = wire.encode_cancel_ack("d-2", P0, False, False, "p1", attempt=reg.attempt)
    assert [a.request_id for a in core.notification(P_AGENT, _note(ack), 0.32) if isinstance(a, Release)] == [
        "d-2"
    ]
    waits = [_note(a.message).kind for a in core.add(_request("d-3", "x-2"), 0.4) if isinstance(a, Send)]
    assert waits == [NotificationKind.HEARTBEAT], waits  # asks for a fresh stamp, not registered
    notes += [_note(a.message) for a in core.cancel("d-3", 0.41) if isinstance(a, Send)]
    return [n.registration.request_id for n in notes if n.kind is NotificationKind.CANCEL]


def test_d_tells_a_cancel_before_registering_only_to_a_p_that_states_it_handles_one() -> None:
    assert _untold_cancels(states=True) == ["d-1", "d-3"]
    assert _untold_cancels(states=False) == []


def test_an_unsettled_ack_taken_for_the_owed_one_still_fences_the_live_request() -> None:
    """A P that echoes no attempts (2.6 and earlier): r (x-1) was released on a fence, its
    cancel owed; the engine gave r again (x-2), which P wrote, and cancelled it. P's ack of the
    live cancel says a WRITE to this rank ended unsettled (bytes may still land) and comes
    first; naming no attempt, D takes it for the owed cancel's. The owed cancel's ack (nothing
    unsettled) then settles the live r: D must fence before giving back r's blocks, not
    release them at once."""
    from test_handshake_refusal import P0, P_AGENT
    from test_probe_early_cancel import _add_ready, _owed_core
    from test_retry_after_abort import _note

    from kvpush.core import notifications as wire
    from kvpush.core.actions import Fence

    core, _ = _owed_core(echoes=False)
    _add_ready(core, "r", "x-2", 70.0, echoes=False)
    core.cancel("r", 70.1)
    unsettled = wire.encode_cancel_ack("r", P0, False, True, "p1")
    out = core.notification(P_AGENT, _note(unsettled), 70.2)
    assert not [a for a in out if isinstance(a, Release)], out
    settled = wire.encode_cancel_ack("r", P0, False, False, "p1")
    out = core.notification(P_AGENT, _note(settled), 70.3)
    assert not [a for a in out if isinstance(a, Release)], out
    assert [a for a in out if isinstance(a, Fence)], out


def test_a_duplicate_cancel_from_a_rank_p_has_not_loaded_does_not_end_the_retry() -> None:
    """D TP-1, rank 0 not loaded by P: its CANCEL of d-1 (never registered) ends p-1; a copy
    of that CANCEL (the network duplicated it) arriving after p-1 ended is acknowledged and
    does not end the retry p-2 at its finish."""
    from test_probe_early_cancel import _cancel

    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import RankKey, ReadSpec

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    core = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1), plan=plan
    )
    core.finished("x-1", "p-1", ((5,),), "D", 100.0)
    assert _reports(_cancel(core, 100.1, attempt=3)) == [("p-1", "failed")]
    assert _reports(_cancel(core, 100.2, attempt=3)) == []
    assert _reports(core.finished("x-1", "p-2", ((6,),), "D", 101.0)) == []
