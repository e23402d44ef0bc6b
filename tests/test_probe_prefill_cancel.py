"""Probes of P's core (``core/prefill_core.py``): CANCELs that reach P after the attempt of the
key they name ended, or while a later attempt of the key (a retry under the same key) runs.

A CANCEL_ACK settles P for D: with ``unsettled`` False, D releases the cancelled request's
blocks without fencing P's connection. P's answer to the CANCEL of a D rank it has not loaded
states what its tombstone knows (a WRITE of the key ended unsettled); the CANCEL of a loaded D
rank, after the key ended, was acknowledged ``unsettled`` False whatever the ended WRITE did.
And a late (or resent) CANCEL of the ended attempt's registration was taken for a CANCEL of
the retry running under the same key: the retry failed, its D registration was never told.
"""

from __future__ import annotations

from typing import Any

from test_protocol_safety import _registration
from test_retry_after_abort import _core, _fails, _note, _posts, _register, _reports, _write

from kvpush.core import notifications as wire
from kvpush.core.actions import Send
from kvpush.core.types import NotificationKind


def _acks(actions: list[Any]) -> list[Any]:
    return [
        note
        for a in actions
        if isinstance(a, Send) and (note := _note(a.message)).kind is NotificationKind.CANCEL_ACK
    ]


def _cancel(core: Any, now: float, **overrides: Any) -> list[Any]:
    message = wire.encode_cancel("x-1", _registration(**overrides), 0)
    return core.notification("D-agent", _note(message), now)


def _unsettled_end(core: Any, *, deadline: bool) -> None:
    """x-1's WRITE to D rank 0 ends unsettled (in error, or aborted at its deadline) and D's
    FAIL saying so is lost; P's connection to D stays loaded (another WRITE of D in flight
    keeps a deadline's drop waiting)."""
    _register(core, 100.1, grant=100.0)
    (post,) = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.2))
    assert core.confirm_post(post.key, post.dst, 100.2)
    core.posted(post.key, post.dst, ["h"], 8, 100.2)
    if deadline:
        _register(core, 100.3, request_id="d-2", match_key="x-2", block_ids=[[4]], grant=100.0)
        (other,) = _posts(core.finished("x-2", "p-9", ((6,),), "", 100.3))
        assert core.confirm_post(other.key, other.dst, 100.3)
        core.posted(other.key, other.dst, ["h2"], 8, 100.3)
        ended = core.handle_timer(100.2 + core.s.write_deadline_s + 0.01)
    else:
        ended = core.write_settled(post.key, post.dst, "h", False, 100.4, "remote error")
    assert _reports(ended) == [("p-1", "failed")]
    assert _fails(ended) == ["d-1"]  # FAIL(unsettled): lost on the way in these tests
    assert "D" in core._engines and core._engines["D"].agents.get(0) == "D-agent"


def test_a_cancel_after_a_write_ended_in_error_is_acked_unsettled() -> None:
    core = _core()
    _unsettled_end(core, deadline=False)
    (ack,) = _acks(_cancel(core, 100.5))
    assert ack.request_id == "d-1"
    assert ack.unsettled, "D would release d-1's blocks without fencing the WRITE that ended in error"


def test_a_cancel_after_a_write_aborted_at_its_deadline_is_acked_unsettled() -> None:
    core = _core()
    _unsettled_end(core, deadline=True)
    (ack,) = _acks(_cancel(core, 100.2 + core.s.write_deadline_s + 0.1))
    assert ack.unsettled, "D would release d-1's blocks while the aborted WRITE may still land"


def test_a_late_cancel_of_the_ended_attempt_does_not_cancel_the_retry() -> None:
    """Attempt 1 of x-1 (D's d-1) was aborted by P's engine; D cancelled d-1 and retried as
    d-1#2 with a fresh grant; the retry finished on P. D's CANCEL of d-1 (resent, or
    duplicated on the way) reaches P now: it is acknowledged, and the retry is pushed."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    assert _reports(core.abort("x-1", 100.2)) == [("p-1", "failed")]
    (ack,) = _acks(_cancel(core, 100.3))  # the first copy: the attempt had ended
    assert ack.request_id == "d-1"
    assert _posts(core.finished("x-1", "p-2", ((6,),), "", 101.0)) == []
    (post,) = _posts(_register(core, 101.1, request_id="d-1#2", block_ids=[[4]], grant=101.05))
    late = _cancel(core, 101.15)  # the second copy of d-1's CANCEL
    assert [a.request_id for a in _acks(late)] == ["d-1"]
    assert _reports(late) == [] and _fails(late) == []
    assert _reports(_write(core, post, 101.2)) == [("p-2", "sent")]
