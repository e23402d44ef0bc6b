"""P's results name the incarnation that sent them (notification format 2.5).

A P stage that restarted under the same agent name while its old process was not seen exiting
(stalled or partitioned, not dead) gets a request registered again with the new process. Its
old process, if it comes back, may still send what it had for its own registration: a DONE
(for a WRITE of the old layer split, or one the fence cut short), a FAIL, a CANCEL_ACK. D told
the two apart by agent name only, so such a DONE counted for the new registration: the request
could be reported done before the new process wrote its layers (wrong KV, silently), and a
FAIL or CANCEL_ACK settled a producer whose new process may still be writing.

Now P's DONE, FAIL and CANCEL_ACK carry ``inc``, the sending worker's incarnation, and D counts
them only for a request registered with that incarnation of the agent; one that does not say
(an older P) is judged by the agent name as before. The core is driven directly.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_reregister_after_layout_change import A0, A1, P0, P1, _note, _pp2, _registered, _sent

from kvpush.core import notifications as wire
from kvpush.core.actions import Release, Report
from kvpush.core.errors import WireError
from kvpush.core.types import NotificationKind, PackManifest


def _reports(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.request_id, a.outcome) for a in actions if isinstance(a, Report)]


def _released(actions: list[Any]) -> list[str]:
    return [a.request_id for a in actions if isinstance(a, Release)]


def _reregistered() -> Any:
    """r1 registered with stages a1/b1; stage 0 seen exiting, both restarted (a2/b2): D
    registers r1 again with the new processes."""
    d = _registered(abortable=True)
    out = d.connected("P", _pp2(True, stage1="b2", stage0="a2"), "", 1.2)
    out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, "a2")), 1.2)
    out += d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 1.2, "b2")), 1.2)
    assert sorted(s for s in _sent(out) if s[1] == "push_reg") == [(A0, "push_reg"), (A1, "push_reg")]
    return d


def test_a_done_from_the_old_process_of_a_restarted_stage_does_not_count() -> None:
    d = _reregistered()
    assert _reports(d.notification(A0, _note(wire.encode_done("r1", P0, 1, incarnation="a2")), 1.3)) == []
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1, incarnation="b1")), 1.4)
    assert _reports(out) == [], "the old stage 1 process completed the new registration"
    assert d.stats["rejected_notifications"] >= 1
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1, incarnation="b2")), 1.5)
    assert _reports(out) == [("r1", "done")], out


def test_a_packed_done_from_the_old_process_does_not_count_either() -> None:
    d = _reregistered()
    manifest = PackManifest(staging_offset=0, regions=(0,))
    note = _note(wire.encode_done("r1", P1, 1, manifest, incarnation="b1"))
    assert note.incarnation == "b1" and note.packing is not None
    assert _reports(d.notification(A1, note, 1.4)) == []
    assert d.stats["rejected_notifications"] >= 1


def test_a_fail_from_the_old_process_settles_nothing() -> None:
    d = _reregistered()
    out = d.notification(A1, _note(wire.encode_failed("r1", P1, "WRITE deadline", True, "b1")), 1.4)
    assert _reports(out) == [], "the old process's FAIL ended the new registration"
    assert d.stats["rejected_notifications"] >= 1
    d.notification(A0, _note(wire.encode_done("r1", P0, 1, incarnation="a2")), 1.5)
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1, incarnation="b2")), 1.5)
    assert _reports(out) == [("r1", "done")], out


def test_a_cancel_ack_from_the_old_process_does_not_release_what_the_new_one_may_write() -> None:
    d = _reregistered()
    out = d.cancel("r1", 1.3)
    assert sorted(s for s in _sent(out) if s[1] == "cancel") == [(A0, "cancel"), (A1, "cancel")], out
    out = d.notification(A0, _note(wire.encode_cancel_ack("r1", P0, False, False, "a2")), 1.35)
    out += d.notification(A1, _note(wire.encode_cancel_ack("r1", P1, False, False, "b1")), 1.4)
    assert not _released(out), "released on the old stage 1 process's ack"
    assert d.stats["rejected_notifications"] >= 1
    out = d.notification(A1, _note(wire.encode_cancel_ack("r1", P1, False, False, "b2")), 1.45)
    assert _released(out) == ["r1"], out


def test_a_result_that_names_no_incarnation_is_judged_by_the_agent_name() -> None:
    """An older P (format 2.4) states none: counted as before."""
    d = _reregistered()
    d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.3)
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 1.4)
    assert _reports(out) == [("r1", "done")], out


def test_results_carry_the_incarnation_on_the_wire() -> None:
    done = _note(wire.encode_done("r1", P0, 2, incarnation="inc-7"))
    assert (done.kind, done.incarnation, done.producer_tp_size) == (NotificationKind.DONE, "inc-7", 2)
    assert _note(wire.encode_done("r1", P0, 2)).incarnation == ""
    failed = _note(wire.encode_failed("r1", P0, "x", False, incarnation="inc-7"))
    assert (failed.incarnation, failed.unsettled) == ("inc-7", False)
    ack = _note(wire.encode_cancel_ack("r1", P0, True, False, incarnation="inc-7"))
    assert (ack.incarnation, ack.write_in_flight, ack.unsettled) == ("inc-7", True, False)
    body = wire.unpack(wire.encode_done("r1", P0, 1, incarnation="i")[len(wire.DONE_PREFIX) :], "DONE")
    for bad in (7, "x" * (wire.MAX_ID_CHARS + 1)):
        message = wire.DONE_PREFIX + wire.pack({**body, "inc": bad})
        with pytest.raises(WireError, match="'inc'"):
            wire.decode_notification(message)
