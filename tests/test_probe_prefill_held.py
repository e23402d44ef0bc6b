"""Probes of P's core (``core/prefill_core.py``): registrations held for a D engine the router
may still name (``_Request.others``, a key not bound yet) and what P loaded for that D rank.

P writes to a D rank only on a registration that came from the agent (and incarnation) P loaded
for that rank. ``connected`` drops the key's registrations that came from another agent or
incarnation, but only those in ``regs``: one held in ``others`` (a second D engine registered the
key before the finish) was kept, moved into ``regs`` when the router's finish named its engine,
and written through the agent P had loaded meanwhile: a late PUSH_REG of a D that restarted
under the same engine id (or any agent claiming that D rank before P loaded it) put the prompt's
KV into block ids the new D incarnation never offered, and P reported the push sent.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_protocol_safety import _note, _registration

from kvpush.core import notifications as wire
from kvpush.core.actions import Post, Report
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)


def _core() -> Any:
    """A P core whose plan writes every D rank of the registration's TP size."""
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import ReadSpec

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [
            ReadSpec(dst_tp_rank=rank, local_block_ids=blocks, remote_block_ids=reg.block_ids)
            for rank in range(reg.decode_tp_size)
        ]

    return PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)


def _register(core: Any, agent: str, now: float, **overrides: Any) -> list[Any]:
    return core.notification(agent, _note(wire.encode_push_reg(_registration(**overrides))), now)


def _posts(actions: list[Any]) -> list[Post]:
    return [a for a in actions if isinstance(a, Post)]


def _held_then_bound(
    stale_rank: int, d_tp: int, stale_grant: float | None = 100.0, old_agent: str = "D-old"
) -> tuple[Any, list[Any]]:
    """Key x-1: engine X registers first (the key's tentative engine), then engine D's ranks,
    held as candidates; D rank ``stale_rank``'s registration is a late one of D's previous
    start (incarnation d1; agent ``old_agent``: a restarted D keeps its agent names, any other
    agent claims the rank). P then loads D's ranks (incarnation d2) and the
    router's finish names D."""
    core = _core()
    _register(core, "X-agent", 100.0, decode_engine_id="X", decode_port=5700, request_id="x-req")
    _register(
        core,
        old_agent,
        100.1,
        decode_tp_rank=stale_rank,
        decode_tp_size=d_tp,
        decode_incarnation="d1",
        request_id="old-req",
        block_ids=[[7]],
        grant=stale_grant,
    )
    for rank in range(d_tp):
        if rank != stale_rank:
            _register(
                core,
                f"D{rank}",
                100.2,
                decode_tp_rank=rank,
                decode_tp_size=d_tp,
                decode_incarnation="d2",
                request_id="new-req",
                block_ids=[[3]],
            )
    for rank in range(d_tp):
        core.connected("D", rank, f"D{rank}", "d2", d_tp, "", 100.3)
    for rank in range(d_tp):
        if rank != stale_rank:  # the new start's PUSH_REG again, with the stamp of the load's HELLO answer
            _register(
                core,
                f"D{rank}",
                100.35,
                decode_tp_rank=rank,
                decode_tp_size=d_tp,
                decode_incarnation="d2",
                request_id="new-req",
                block_ids=[[3]],
                grant=100.3,
            )
    actions = core.finished("x-1", "p-1", ((5,),), "D", 100.4)
    return core, actions


@pytest.mark.parametrize("old_agent", ["D1", "D-old"])
def test_a_held_registration_of_a_replaced_d_start_is_never_written(old_agent: str) -> None:
    """D TP 2: rank 0's registration is the new start's, rank 1's a late one of the old start.
    P must not write rank 1 (the new start never offered block 7 for this key)."""
    core, actions = _held_then_bound(stale_rank=1, d_tp=2, old_agent=old_agent)
    posts = _posts(actions)
    assert [p.dst for p in posts] == [0], [(p.dst, p.registration.request_id) for p in posts]
    assert posts[0].registration.request_id == "new-req"
    assert core.confirm_post("x-1", 0, 100.5)
    assert not core.confirm_post("x-1", 1, 100.5)


@pytest.mark.parametrize("old_agent", ["D1", "D-old"])
def test_a_heartbeat_of_the_new_start_does_not_renew_the_old_starts_registration(old_agent: str) -> None:
    """The old start's registration carries no grant P could check (it waits for a fresh one):
    the new start's heartbeat for the key must not renew it by key and get it written."""
    core, actions = _held_then_bound(stale_rank=1, d_tp=2, stale_grant=None, old_agent=old_agent)
    assert [p.dst for p in _posts(actions)] == [0]
    hb = _registration(decode_tp_rank=1, decode_tp_size=2, decode_incarnation="d2", grant=100.4)
    answer = core.notification("D1", _note(wire.encode_heartbeat(["x-1"], hb, 1)), 100.5)
    assert _posts(answer) == [], [p.registration.request_id for p in _posts(answer)]
    # The new start's own registration of rank 1 arrives: that one is written, at its blocks.
    new = dict(decode_tp_rank=1, decode_tp_size=2, decode_incarnation="d2", request_id="new-req", grant=100.4)
    (post,) = _posts(_register(core, "D1", 100.6, **new))
    assert post.registration.request_id == "new-req" and post.spec.remote_block_ids == ((3,),)
    for rank in (0, 1):
        assert core.confirm_post("x-1", rank, 100.7)
        core.posted("x-1", rank, [f"h{rank}"], 8, 100.7)
    core.write_settled("x-1", 0, "h0", True, 100.8)
    reports = [a for a in core.write_settled("x-1", 1, "h1", True, 100.8) if isinstance(a, Report)]
    assert [(r.request_id, r.outcome) for r in reports] == [("p-1", "sent")]


def test_messages_of_a_restarted_d_held_behind_a_stuck_copy_are_bounded() -> None:
    """D restarts while a kernel copy to its old start cannot end: P holds the new start's
    messages until the copy settles. A D that keeps sending (HELLO resends, heartbeats) must
    not grow that hold without bound: past MAX_DEFERRED the oldest is dropped (as a lost
    message, which D resends) and counted; the newest are handled once the copy settled."""
    from test_protocol_safety import _prefill_core, _registration

    from kvpush.core import notifications as wire
    from kvpush.core.actions import DropPeer, Post
    from kvpush.core.prefill_core import MAX_DEFERRED

    core = _prefill_core()
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    core.notification("D-agent", _note(wire.encode_hello(_registration(), 0)), 100.0)
    core.connected("D", 0, "D-agent", "d1", 1, "", 100.0)
    post = next(
        a
        for a in core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.0)
        if isinstance(a, Post)
    )
    assert core.confirm_post(post.key, post.dst, 100.0)
    core.posted(post.key, post.dst, ["copy"], 64, 100.0, abortable=False)  # a kernel copy
    restarted = _registration(decode_incarnation="d2")
    rejected = core.stats["rejected_notifications"]
    for i in range(MAX_DEFERRED + 50):
        core.notification("D-agent", _note(wire.encode_hello(restarted, 0)), 100.1 + i * 1e-4)
        if i == 0:  # P asks D's side channel first (AskStart): it serves "d2", a restart
            core.start_served("D", 0, "d2", "", 100.1)
    engine = core._engines["D"]
    assert len(engine.deferred) == MAX_DEFERRED
    assert core.stats["rejected_notifications"] - rejected == 50
    out = core.write_settled("x-1", 0, "copy", True, 101.0)
    assert any(isinstance(a, DropPeer) for a in out), "the old start is dropped once the copy ended"
