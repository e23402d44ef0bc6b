"""Probe of 2026-12-03 (noon): the merged cancel paths on P (``review2``: ``_saw_request``,
the unloaded rank's CANCEL recording the ranks that took part; ``ranks``: each rank judged by
its own loaded start, held cancels remembered, an earlier attempt's CANCEL left alone).

A late CANCEL of an earlier attempt of a D request id (the engine gave the id again once D
forgot it) was acknowledged and "left the later attempt's registration alone" while the key
was held for an engine (not bound) or came from a D rank P had not loaded: the registration
stayed, but its identity (D engine, incarnation, rank, request id: no attempt) was marked
refused and gone. Every later PUSH_REG of it was dropped as the cancelled one's, among them
the renewal P itself asks for (a grant older than the rank's load, or stale by the finish):
the live attempt was never written, and the key failed at its lease. A request failed by a
cancel it did not send.
"""

from __future__ import annotations

from typing import Any

from test_probe_rank_cancels import (
    X,
    _cancel,
    _core,
    _d,
    _load_d,
    _load_x,
    _posts,
    _register,
    _reports,
    _told,
)

from kvpush.core.types import NotificationKind


def _renew_and_post(core: Any, rank: int, now: float) -> list[tuple[str, int, str]]:
    """D answers P's want: rank ``rank`` sends attempt 9's PUSH_REG again with a fresh grant."""
    out = _register(core, f"D{rank}", now, **_d(rank, attempt=9, grant=now))
    return _posts(out)


def test_an_earlier_attempts_cancel_from_an_unloaded_rank_leaves_the_renewal_taken() -> None:
    """Attempt 9 of d-1 registered on both ranks before P loaded them; a late CANCEL of
    attempt 3 from rank 0 (not loaded yet). Once loaded, the grants are older than the load:
    P asks for fresh ones, and rank 0's renewal of attempt 9 is taken and written."""
    core = _core()
    for rank in (0, 1):
        _register(core, f"D{rank}", 100.1, **_d(rank, attempt=9))
    core.finished("x-1", "p-1", ((5,),), "", 100.15)
    assert _reports(_cancel(core, "D0", 100.2, **_d(0, attempt=3))) == []
    out = _load_d(core, 0, 100.25) + _load_d(core, 1, 100.25)
    assert _told(out, NotificationKind.CANCEL_ACK) == [("D0", "d-1")], out
    for rank in (0, 1):
        assert not core.confirm_post("x-1", rank, 100.3)  # granted before the load: stale
        core.refresh("x-1", rank, 100.3)
    assert _renew_and_post(core, 1, 100.35) == [("D", 1, "d-1")]
    assert _renew_and_post(core, 0, 100.35) == [("D", 0, "d-1")], "attempt 9's renewal was dropped"


def test_an_earlier_attempts_cancel_of_a_held_registration_leaves_the_renewal_taken() -> None:
    """x-1 not bound: X registered first, D's loaded ranks hold d-1 of attempt 9; a late CANCEL
    of attempt 3 from rank 0. The router's finish names D after the grants went stale: P asks
    for fresh ones, and rank 0's renewal of attempt 9 is taken and written."""
    core = _core()
    _load_x(core, 100.0)
    _register(core, "X-agent", 100.05, **X)
    for rank in (0, 1):
        _load_d(core, rank, 100.0)
        _register(core, f"D{rank}", 100.1, **_d(rank, attempt=9))
    out = _cancel(core, "D0", 100.2, **_d(0, attempt=3))
    assert _told(out, NotificationKind.CANCEL_ACK) == [("D0", "d-1")], out
    assert _posts(core.finished("x-1", "p-1", ((5,),), "D", 115.0)) == []  # grants of 100.1: stale
    assert _renew_and_post(core, 1, 115.1) == [("D", 1, "d-1")]
    assert _renew_and_post(core, 0, 115.1) == [("D", 0, "d-1")], "attempt 9's renewal was dropped"
