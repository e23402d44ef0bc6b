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
    another attempt: it settles nothing (the new request still waits); P's real ack, echoing
    the owed cancel's attempt, lets it register."""
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
