"""Probes of who renews a registration's grant (``core/prefill_core.py``, ``core/decode_core.py``).

P may write a D registration only until its grant plus D's window. A heartbeat names match keys
only, and P renewed by key whatever registration of the key it held for the D rank: another D
request of the rank under the key (a request added again, a retry while the first closes), one
whose CANCEL was lost, was kept fresh by the live one's heartbeats. D worked around it by letting
every grant for a key reach every request of the key (a closing one's quarantine moved out with
its sibling's heartbeats, its blocks held as long as the sibling lived).

The fix at the source: a registration's grant is renewed only by a message naming it, its own
PUSH_REG sent again (same D engine, incarnation, rank and request id) with a newer grant. A
heartbeat keeps P's leases by key (no safety rests on them) and gets P's ``want`` answered: D
then sends the PUSH_REG of each of its registered requests of the wanted keys again.
"""

from __future__ import annotations

from typing import Any

from test_protocol_safety import _registration
from test_retry_after_abort import P0, _core, _decode, _fails, _note, _posts, _push_regs, _register, _request

from kvpush.core import notifications as wire
from kvpush.core.actions import Fence, Send
from kvpush.core.types import NotificationKind


def _heartbeat(core: Any, now: float, keys: list[str], grant: float) -> list[Any]:
    return core.notification(
        "D-agent", _note(wire.encode_heartbeat(keys, _registration(grant=grant), 0)), now
    )


def _wants(actions: list[Any]) -> list[str]:
    return [
        key
        for a in actions
        if isinstance(a, Send) and (note := _note(a.message)).kind is NotificationKind.HEARTBEAT
        for key in note.want
    ]


# ------------------------------------------------------------------------------ P's core


def test_a_heartbeat_naming_the_key_does_not_renew_another_requests_registration() -> None:
    """P holds d-1's registration of x-1 (grant 100.0). D cancelled d-1 (the CANCEL lost) and
    registered the key again as d-1#2 (that PUSH_REG is late). D's heartbeat for x-1, sent on
    d-1#2's behalf, must not make d-1 fresh: d-1's grant window ended at 110.0."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    hb = _heartbeat(core, 112.5, ["x-1"], 112.0)
    finish = core.finished("x-1", "p-1", ((5,),), "", 112.6)
    posted = [p.registration.request_id for p in _posts(hb + finish)]
    assert posted == [], "d-1 written on a grant D gave for another request of the key"
    assert _wants(finish) == ["x-1"]  # P asks; D answers with its live registration (d-1#2)
    out = _register(core, 112.7, request_id="d-1#2", block_ids=[[4]], grant=112.0)
    (post,) = _posts(out)
    assert post.registration.request_id == "d-1#2" and post.spec.remote_block_ids == ((4,),)
    assert _fails(out) == ["d-1"]


def test_a_registration_is_renewed_by_its_own_push_reg_sent_again() -> None:
    """The control: d-1's grant ran out before P finished; D sends d-1's PUSH_REG again with a
    fresh grant, and P writes d-1 with the spec it planned (renewed, not replaced)."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    finish = core.finished("x-1", "p-1", ((5,),), "", 111.0)
    assert _posts(finish) == [] and _wants(finish) == ["x-1"]
    out = _register(core, 111.1, grant=111.0)
    (post,) = _posts(out)
    assert post.registration.request_id == "d-1" and post.spec.remote_block_ids == ((3,),)
    assert _fails(out) == []


# ------------------------------------------------------------------------------ D's core


def test_d_answers_a_want_with_the_requests_own_push_reg() -> None:
    """P asks for a fresh grant of x-1: D sends d-1's PUSH_REG again, carrying P's newest stamp
    (a heartbeat naming the key would renew nothing)."""
    core = _decode()
    answer = _note(wire.encode_heartbeat_answer(P0, 20.0, "p1", want=["x-1"]))
    regs = _push_regs(core.notification("P-agent", answer, 0.5))
    assert [(r.request_id, r.match_key, r.grant) for r in regs] == [("d-1", "x-1", 20.0)]


def test_a_siblings_heartbeats_do_not_hold_a_closing_request() -> None:
    """d-1 (registered at 0.0 with grant 10.0) is cancelled and its CANCEL lost; d-2 is added
    under the same key and keeps heartbeating it. Nothing renews d-1 on P any more, so d-1 is
    fenced and released at its own bound (last grant + fresh_s + P's WRITE deadline + margin),
    not held for as long as d-2 lives."""
    core = _decode()
    core.cancel("d-1", 0.2)  # the CANCEL is lost
    assert [r.request_id for r in _push_regs(core.add(_request("d-2", "x-1"), 0.3))] == ["d-2"]
    bound = 0.0 + core.s.fresh_s + 1.0 + max(core.s.quarantine_margin_s, 1.0)
    out: list[Any] = []
    now = 0.3
    while now < bound + 0.5:
        now = min(now + core.s.heartbeat_interval_s / 2, bound + 0.5)
        out += core.handle_timer(now)
        core.notification("P-agent", _note(wire.encode_heartbeat_answer(P0, 10.0 + now, "p1")), now)
    fences = [a for a in out if isinstance(a, Fence)]
    assert fences, "d-1's quarantine moved out with d-2's heartbeats: its blocks are held while d-2 lives"
    assert core.holds("d-2")


def test_a_key_p_never_heard_of_fails_every_request_of_it_on_the_rank() -> None:
    """Two requests of this rank are registered under x-1 and both PUSH_REGs were lost: P
    answers twice that it never heard of x-1. Both fail at once; one used to be left to its
    watchdog (the answer was mapped to one request per key)."""
    core = _decode()
    core.add(_request("d-2", "x-1"), 0.2)
    reports: list[Any] = []
    for t in (0.3, 5.3):
        unknown = _note(wire.encode_heartbeat_answer(P0, 10.0 + t, "p1", unknown=["x-1"]))
        reports += [a for a in core.notification("P-agent", unknown, t) if type(a).__name__ == "Report"]
    assert sorted((r.request_id, r.outcome) for r in reports) == [("d-1", "failed"), ("d-2", "failed")]
