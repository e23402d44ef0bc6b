"""Probe of 2026-12-03: registration attempt ids (notification format 2.7) and D restarts asked
about at D's side channel (``AskStart``).

Findings:

(1) An owed CANCEL_ACK was not bound to the attempt. D re-asks a CANCEL that a silent producer
    never acknowledged (the request was released on a fence) before a new request of the key
    registers, and registers once it is acknowledged. That acknowledgement was matched by D
    request id and agent only: a recorded CANCEL_ACK of an earlier request of the same id (any
    key), replayed, settled the owed cancel although it names another attempt.
"""

from __future__ import annotations

from typing import Any


def _decoded(message: bytes) -> Any:
    from kvpush.core import notifications as wire

    note = wire.decode_notification(message)
    assert note is not None
    return note


def _sent(actions: list[Any]) -> list[Any]:
    from kvpush.core.actions import Send

    return [_decoded(a.message) for a in actions if isinstance(a, Send)]


def _kinds(actions: list[Any]) -> list[Any]:
    return [n.kind for n in _sent(actions)]


def _registered(core: Any, rid: str, key: str, at: float) -> tuple[Any, int]:
    """``rid`` (``key``) added to D core ``core`` (None: a new one, start "d1") and registered
    with P start "p1", which echoes attempts; returns the core and the attempt D stated."""
    from test_probe_clock_identity import _attempt, _decode_registered

    core, out = _decode_registered(rid, key, at, core)
    return core, _attempt(out)


# ---------------------------------------------------------------------------------------------
# (1) The owed CANCEL_ACK
# ---------------------------------------------------------------------------------------------


def _released_unanswered(core: Any, rid: str, key: str, at: float) -> tuple[Any, int]:
    """``rid`` (``key``) registered, cancelled, P silent: released on a fence after the
    quarantine, its cancel owed. Returns the core and the attempt the owed cancel names."""
    from kvpush.core.actions import Fence, Release

    core, attempt = _registered(core, rid, key, at)
    core.cancel(rid, at + 0.1)
    fences = [a for a in core.handle_timer(at + 60.0) if isinstance(a, Fence)]
    assert fences, "the quarantine fences the silent producer"
    released = core.fenced(fences[0].fence_id, at + 60.1)
    assert any(isinstance(a, Release) and a.request_id == rid for a in released), released
    return core, attempt


def test_an_owed_cancel_ack_of_another_attempt_does_not_let_the_next_request_register() -> None:
    """r (x-0) is cancelled and acknowledged (recorded). r comes back (x-1), is cancelled, P
    silent: released on a fence, its cancel owed. A new request of x-1 asks that cancel again
    and waits for its ack before registering. The recorded ack of the first r, replayed, names
    another attempt: it settles nothing (the new request still waits), nor does an ack naming
    no attempt (P echoes attempts) or one of another P start; P's real ack, echoing the owed
    cancel's attempt, lets it register."""
    from test_handshake_refusal import P0, P_AGENT

    from kvpush.core import notifications as wire
    from kvpush.core.types import NotificationKind

    core, first = _registered(None, "r", "x-0", 0.0)
    core.cancel("r", 0.1)
    recorded = wire.encode_cancel_ack("r", P0, False, unsettled=False, incarnation="p1", attempt=first)
    core.notification(P_AGENT, _decoded(recorded), 0.15)
    core, owed_attempt = _released_unanswered(core, "r", "x-1", 1.0)
    assert owed_attempt != first
    asked = _add_connected(core, "n", "x-1", 70.0)
    cancels = [n for n in _sent(asked) if n.kind is NotificationKind.CANCEL]
    assert [n.registration.attempt for n in cancels] == [owed_attempt], asked
    replayed = core.notification(P_AGENT, _decoded(recorded), 70.1)
    # Registering goes on (a fresh stamp asked for: the key ended here) only on the owed ack.
    assert _sent(replayed) == [], "a replayed ack of another attempt settled the owed cancel"
    for wrong in (
        wire.encode_cancel_ack("r", P0, False, unsettled=False, incarnation="p1"),  # names none
        wire.encode_cancel_ack("r", P0, False, unsettled=False, incarnation="p0", attempt=owed_attempt),
    ):
        assert _sent(core.notification(P_AGENT, _decoded(wrong), 70.15)) == [], wrong
    ack = wire.encode_cancel_ack("r", P0, False, unsettled=False, incarnation="p1", attempt=owed_attempt)
    out = core.notification(P_AGENT, _decoded(ack), 70.2)
    assert _kinds(out) == [NotificationKind.HEARTBEAT], out


def _add_connected(core: Any, rid: str, key: str, at: float) -> list[Any]:
    """Add ``rid`` (``key``) to ``core`` and let its handshake with P start "p1" (which echoes
    attempts) complete; the actions it took."""
    import attrs
    from test_handshake_refusal import P0, P_AGENT, _info

    from kvpush.core import notifications as wire

    out = core.add(_request(rid, key), at)
    info = attrs.evolve(_info(), echo_attempts=frozenset({P_AGENT}))
    out += core.connected("P", info, "", at + 0.01)
    answer = wire.encode_heartbeat_answer(P0, at + 0.02, "p1")
    return out + core.notification(P_AGENT, _decoded(answer), at + 0.02)


def _request(rid: str, key: str) -> Any:
    from test_handshake_refusal import _request as request

    return request(rid, key)


# ---------------------------------------------------------------------------------------------
# (2) The side channel's answer, remembered
# ---------------------------------------------------------------------------------------------


def _hello(incarnation: str) -> Any:
    from test_handshake_refusal import _hello as hello

    return hello(incarnation)


def _push_reg(**overrides: Any) -> Any:
    from test_handshake_refusal import _note
    from test_probe_reconfig_restart import wire_push_reg

    return _note(wire_push_reg(**overrides))


def test_a_start_the_side_channel_named_once_is_asked_about_again_once_another_was_loaded() -> None:
    """P serves d1. d2 says HELLO; the side channel names d2 (a restart): P drops d1 and
    handshakes again, but by then D restarted once more, on a clock behind: the side channel
    serves d0, which P loads and serves. A late HELLO of d2 (sent before it died; it sorts after
    d0) arrives once d2's backoff is over. P remembered the side channel's answer "d2" and took
    the late HELLO for a restart unasked: d0's live request failed and the rank was reloaded.
    Fixed: a handshake that loads a start forgets the earlier answer; d2 is asked about again."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import AskStart, Connect, DropPeer, Post, Report

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    assert any(isinstance(a, AskStart) for a in core.notification(D_AGENT, _hello("d2"), 101.0))
    restarted = core.start_served("D", 0, "d2", "", 101.1)  # d2 runs: a restart
    assert any(isinstance(a, Connect) for a in restarted), restarted
    core.connected("D", 0, D_AGENT, "d0", 1, "", 101.2)  # D restarted again, on a clock behind
    core.notification(D_AGENT, _hello("d0"), 101.3)  # the live start handshakes
    core.finished("x-3", "p-3", ((6,),), "", 101.4)
    reg = _push_reg(decode_incarnation="d0", request_id="d-3", match_key="x-3", grant=101.35)
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, reg, 101.5))
    late = core.notification(D_AGENT, _hello("d2"), 140.0)  # any backoff of d2's is over
    assert not [a for a in late if isinstance(a, Report | DropPeer | Connect)], late
    assert [a for a in late if isinstance(a, AskStart)], "d2 is asked about again"


def test_an_answer_naming_a_start_newer_than_both_drops_the_asked_one_and_serves_the_named_one() -> None:
    """Held: P serves d1; d2 speaks, and by the time D's side channel answers, D restarted
    again: it names d3. d2's message is dropped (its start is dead) and d1's request goes on;
    d3's HELLO is then a restart at once (no second question), and d1's request fails."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import AskStart, Post, Report

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    core.finished("x-2", "p-2", ((6,),), "", 100.2)
    reg = _push_reg(decode_incarnation="d1", request_id="d-2", match_key="x-2", grant=100.15)
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, reg, 100.3))
    assert any(isinstance(a, AskStart) for a in core.notification(D_AGENT, _hello("d2"), 101.0))
    assert not [a for a in core.start_served("D", 0, "d3", "", 101.1) if isinstance(a, Report)]
    restarted = core.notification(D_AGENT, _hello("d3"), 101.2)
    assert not [a for a in restarted if isinstance(a, AskStart)], restarted
    assert [a.outcome for a in restarted if isinstance(a, Report)] == ["failed"], restarted


def test_an_answer_arriving_after_p_began_closing_sends_nothing_to_the_asked_start() -> None:
    """Held: the question is out when P begins closing; the late answer (naming the start
    asked about) writes nothing and loads nothing (a closing P connects to no D rank)."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import AskStart, Connect, Post

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    reg = _push_reg(decode_incarnation="d2", request_id="d-3", match_key="x-3", grant=100.9)
    assert any(isinstance(a, AskStart) for a in core.notification(D_AGENT, reg, 101.0))
    core.shutdown("closing", 101.05)
    late = core.start_served("D", 0, "d2", "", 101.1)
    assert not [a for a in late if isinstance(a, Post | Connect)], late


# ---------------------------------------------------------------------------------------------
# P's answers: each echoes the attempt of the registration or CANCEL it answers
# ---------------------------------------------------------------------------------------------


def _answers(actions: list[Any]) -> list[tuple[Any, str, Any]]:
    from kvpush.core.types import NotificationKind

    results = (NotificationKind.DONE, NotificationKind.FAILED, NotificationKind.CANCEL_ACK)
    return [(n.kind, n.request_id, n.attempt) for n in _sent(actions) if n.kind in results]


def test_a_registration_held_before_the_handshake_is_refused_naming_its_attempt() -> None:
    """Held: a PUSH_REG of a D rank P has not loaded waits for the handshake; P refuses the
    rank's metadata (its agent loaded notify-only): the FAIL echoes the registration's attempt."""
    from test_handshake_refusal import D_AGENT, WHY, _prefill

    from kvpush.core.types import NotificationKind

    core = _prefill()
    reg = _push_reg(request_id="d-1", match_key="x-1", attempt=77, grant=None)
    core.notification(D_AGENT, reg, 100.0)
    refused = core.connected("D", 0, D_AGENT, "d1", 0, WHY, 100.1)
    assert (NotificationKind.FAILED, "d-1", 77) in _answers(refused), refused


def test_a_cancel_of_an_unloaded_rank_is_acknowledged_naming_its_attempt_once_loaded() -> None:
    """Held: the ack of a CANCEL from a D rank P has not loaded goes out once P loaded it, and
    echoes the attempt the CANCEL named."""
    from test_handshake_refusal import D_AGENT, _coordinates, _note, _prefill

    from kvpush.core import notifications as wire
    from kvpush.core.types import NotificationKind

    core = _prefill()
    cancel = _note(wire.encode_cancel("x-1", _coordinates(request_id="d-1", match_key="x-1", attempt=78), 0))
    core.notification(D_AGENT, cancel, 100.0)
    loaded = core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    assert (NotificationKind.CANCEL_ACK, "d-1", 78) in _answers(loaded), loaded


def test_a_registration_of_a_failed_key_is_refused_naming_its_own_attempt() -> None:
    """Held: a key P failed (its prefill failed) keeps a tombstone; a later registration of it
    (another D request, another attempt, its grant not newer than the key's end) is answered
    FAIL naming that registration's attempt, not the first one's."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.types import NotificationKind

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    first = _push_reg(request_id="d-1", match_key="x-1", attempt=80, grant=100.05)
    core.notification(D_AGENT, first, 100.2)
    failed = core.abandoned("x-1", "prefill failed", 100.3, request_id="p-1")
    assert (NotificationKind.FAILED, "d-1", 80) in _answers(failed), failed
    later = _push_reg(request_id="d-2", match_key="x-1", attempt=81, grant=100.25)
    answered = core.notification(D_AGENT, later, 100.4)
    assert _answers(answered) == [(NotificationKind.FAILED, "d-2", 81)], answered


def test_a_restart_while_the_side_channel_is_unreachable_is_asked_about_within_a_quarter_lease() -> None:
    """Held: D restarts (d2) while P cannot read its side channel. Each question fails; d2's
    messages are dropped (D resends its HELLO) and asked about again after a backoff that
    doubles but never exceeds a quarter of the lease; once the side channel answers d2, it
    is a restart."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import AskStart, Connect, Report

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    cap = core.s.lease_s / 4
    at, asked = 101.0, 0
    while at < 101.0 + 8 * cap:
        out = core.notification(D_AGENT, _hello("d2"), at)  # D resends its HELLO
        assert not [a for a in out if isinstance(a, Report | Connect)], out
        if [a for a in out if isinstance(a, AskStart)]:
            asked += 1
            assert not core.start_served("D", 0, "", "TimeoutError: partitioned", at + 0.1)
        at += 0.5
    assert asked >= 8, f"asked {asked} times in {8 * cap:g} s"
    out = core.notification(D_AGENT, _hello("d2"), at + cap)
    assert [a for a in out if isinstance(a, AskStart)], "asked again within a quarter lease"
    restarted = core.start_served("D", 0, "d2", "", at + cap + 0.1)
    assert [a for a in restarted if isinstance(a, Connect)], restarted
