"""Probes of P's core (``core/prefill_core.py``): a CANCEL names one D registration (D engine,
incarnation, D rank, D request id), but P acted on it per (key, D rank).

P holds one registration per (match key, D rank). When a D rank registers the key again (a D
request re-added under the key, a retry, two D requests of one rank under one key), the new
registration replaces the old one on P. A CANCEL of the replaced registration then failed the
key's *current* registration on that rank, which P never told (the cancelling agent was in
``cancel_acks``): the push was lost and the current D request waited for its heartbeat. A
CANCEL from one D rank of a key not bound to a D engine dropped every held registration of that
engine, those of its other ranks too. And a duplicate of a replaced registration took the rank
back: P wrote blocks the D request it named no longer offered.
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


def _cancel(core: Any, now: float, agent: str = "D-agent", **overrides: Any) -> list[Any]:
    reg = _registration(**overrides)
    message = wire.encode_cancel(reg.match_key, reg, reg.decode_tp_rank)
    return core.notification(agent, _note(message), now)


def test_a_cancel_of_a_replaced_registration_leaves_the_current_one() -> None:
    """D rank 0 registered x-1 as d-1, then (d-1 cancelled, the request added again) as d-1#2:
    P holds d-1#2. d-1's CANCEL is acknowledged; d-1#2 is still pushed, at its own blocks."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    _register(core, 100.2, request_id="d-1#2", block_ids=[[4]], grant=100.15)
    out = _cancel(core, 100.3)
    assert [a.request_id for a in _acks(out)] == ["d-1"]
    assert not _acks(out)[0].unsettled  # nothing was ever posted to d-1
    assert _fails(out) == [], "the current registration (d-1#2) failed on the old one's cancel"
    (post,) = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.4))
    assert post.registration.request_id == "d-1#2" and post.spec.remote_block_ids == ((4,),)
    assert _reports(_write(core, post, 100.5)) == [("p-1", "sent")]


def test_a_cancel_that_overtook_its_registration_leaves_the_current_one() -> None:
    """d-1's CANCEL reaches P after d-1#2's registration but before d-1's own (late) one: the
    cancel is acknowledged, d-1's registration is never written, d-1#2 is pushed."""
    core = _core()
    _register(core, 100.2, request_id="d-1#2", block_ids=[[4]], grant=100.15)
    out = _cancel(core, 100.3)
    assert [a.request_id for a in _acks(out)] == ["d-1"] and _fails(out) == []
    assert _posts(_register(core, 100.35, grant=100.0)) == []  # d-1's late PUSH_REG
    (post,) = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.4))
    assert post.registration.request_id == "d-1#2" and post.spec.remote_block_ids == ((4,),)


def test_a_duplicate_of_a_replaced_registration_never_takes_the_rank_back() -> None:
    """d-1 was replaced by d-1#2 and its CANCEL acknowledged (D released d-1's blocks). A
    duplicate of d-1's PUSH_REG arrives: P must not write d-1's blocks (nor name d-1)."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    _register(core, 100.2, request_id="d-1#2", block_ids=[[4]], grant=100.15)
    assert [a.request_id for a in _acks(_cancel(core, 100.3))] == ["d-1"]
    _register(core, 100.35, grant=100.0)  # the duplicate
    posts = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.4))
    assert [(p.registration.request_id, p.spec.remote_block_ids) for p in posts] == [("d-1#2", ((4,),))]


def test_a_duplicate_of_a_replaced_registration_without_a_cancel_is_not_written() -> None:
    """Two D requests of rank 0 under x-1 (d-1, then d-1#2): P pushes one of them. A duplicate of
    d-1's PUSH_REG arriving later must not take the rank back from d-1#2 (two DONEs' worth of
    decisions for one rank), and the request P does not write is told at once, not left to
    D's watchdog."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    replaced = _register(core, 100.2, request_id="d-1#2", block_ids=[[4]], grant=100.15)
    assert _fails(replaced) == ["d-1"], "the replaced registration waits for D's watchdog"
    _register(core, 100.25, grant=100.0)  # the duplicate
    (post,) = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.4))
    assert post.registration.request_id == "d-1#2"


def test_a_registration_arriving_while_its_rank_is_written_is_told() -> None:
    """d-1's WRITE is in flight when d-1#2 registers x-1 on the same rank: P cannot write
    d-1#2 (one prefill, one WRITE per rank) and says so at once, with nothing unsettled."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    (post,) = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.2))
    assert core.confirm_post(post.key, post.dst, 100.2)
    core.posted(post.key, post.dst, ["h"], 8, 100.2)
    out = _register(core, 100.3, request_id="d-1#2", block_ids=[[4]], grant=100.25)
    notes = [_note(a.message) for a in out if isinstance(a, Send)]
    fails = [n for n in notes if n.kind is NotificationKind.FAILED]
    assert [(n.request_id, n.unsettled) for n in fails] == [("d-1#2", False)]
    assert _reports(core.write_settled("x-1", 0, "h", True, 100.4)) == [("p-1", "sent")]


def test_an_older_registration_arriving_late_does_not_replace_a_newer_one() -> None:
    """D sent d-1 (grant 100.0) and then d-1#2 (grant 100.15); they arrive the other way round.
    The older one does not replace the newer one: it is told, the newer one is pushed."""
    core = _core()
    _register(core, 100.2, request_id="d-1#2", block_ids=[[4]], grant=100.15)
    late = _register(core, 100.25, grant=100.0)
    assert _fails(late) == ["d-1"]
    (post,) = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.4))
    assert post.registration.request_id == "d-1#2"


def _two_ranks_held() -> Any:
    """x-1: engine X registered first (the key's tentative engine); engine D's ranks 0 and 1
    registered d-1 (held as candidates the router may name); P loaded both D ranks."""
    from test_probe_prefill_held import _core as _tp_core
    from test_probe_prefill_held import _register as _reg_held

    core = _tp_core()
    _reg_held(core, "X-agent", 100.0, decode_engine_id="X", decode_port=5700, request_id="x-req")
    for rank in (0, 1):
        _reg_held(core, f"D{rank}", 100.1, decode_tp_rank=rank, decode_tp_size=2, request_id="d-1")
        core.connected("D", rank, f"D{rank}", "d1", 2, "", 100.2)
    return core


def test_a_cancel_of_one_d_rank_drops_only_that_ranks_held_registration() -> None:
    """The key is not bound yet. D rank 0 cancels an earlier registration of its own (d-0,
    which P never held): D rank 1's held registration (and rank 0's current one) stay, and the
    router's finish naming D pushes both ranks."""
    core = _two_ranks_held()
    out = _cancel(core, 100.3, agent="D0", request_id="d-0", decode_tp_size=2)
    assert [a.request_id for a in _acks(out)] == ["d-0"]
    posts = _posts(core.finished("x-1", "p-1", ((5,),), "D", 100.4))
    assert sorted((p.dst, p.registration.request_id) for p in posts) == [(0, "d-1"), (1, "d-1")]


def test_a_cancel_of_one_d_rank_held_registration_tells_its_other_ranks() -> None:
    """D rank 0 cancels its held d-1 (D cancels a request on every rank): rank 1's held d-1 is
    not dropped silently but told, at once, that P will not write it (nothing was posted), as
    a cancel of a bound key tells every rank. A registration of rank 1 for another D request
    (d-2, the request added again) is left alone and pushed once the router names D."""
    core = _two_ranks_held()
    out = _cancel(core, 100.3, agent="D0", decode_tp_size=2)
    assert [a.request_id for a in _acks(out)] == ["d-1"]
    told = [
        (a.agent, n.request_id, n.unsettled)
        for a in out
        if isinstance(a, Send) and (n := _note(a.message)).kind is NotificationKind.FAILED
    ]
    assert told == [("D1", "d-1", False)], "D rank 1's held d-1 was dropped without a word"
    from test_probe_prefill_held import _register as _reg_held

    for rank in (0, 1):
        _reg_held(
            core,
            f"D{rank}",
            100.35,
            decode_tp_rank=rank,
            decode_tp_size=2,
            request_id="d-2",
            block_ids=[[6]],
            grant=100.3,
        )
    posts = _posts(core.finished("x-1", "p-1", ((5,),), "D", 100.4))
    assert sorted((p.dst, p.registration.request_id) for p in posts) == [(0, "d-2"), (1, "d-2")]


def test_a_cancel_of_the_keys_first_registrant_leaves_the_engine_the_router_names() -> None:
    """The key is not bound yet: engine X registered it first (the key's tentative engine) and
    engine D's ranks after it (held). X cancels its registration: that ends X's offer, not the
    key. The router's finish naming D pushes D's ranks (it failed: "already ended")."""
    core = _two_ranks_held()
    core.connected("X", 0, "X-agent", "d1", 1, "", 100.25)
    out = _cancel(core, 100.3, agent="X-agent", decode_engine_id="X", decode_port=5700, request_id="x-req")
    assert [a.request_id for a in _acks(out)] == ["x-req"]
    finish = core.finished("x-1", "p-1", ((5,),), "D", 100.4)
    assert _reports(finish) == [], f"the router's engine lost its push to X's cancel: {_reports(finish)}"
    posts = _posts(finish)
    assert sorted((p.dst, p.registration.request_id) for p in posts) == [(0, "d-1"), (1, "d-1")]


def test_registrations_of_engines_the_router_did_not_name_are_told_at_the_finish() -> None:
    """The key's first registrant X and engine D both registered before the finish; the
    router's finish names D. X's registration is never written: it is told so at once (FAIL,
    nothing unsettled), not left to its heartbeat or watchdog."""
    core = _two_ranks_held()
    core.connected("X", 0, "X-agent", "d1", 1, "", 100.25)
    finish = core.finished("x-1", "p-1", ((5,),), "D", 100.4)
    told = [
        (a.agent, n.request_id, n.unsettled)
        for a in finish
        if isinstance(a, Send) and (n := _note(a.message)).kind is NotificationKind.FAILED
    ]
    assert told == [("X-agent", "x-req", False)]
    assert sorted((p.dst, p.registration.request_id) for p in _posts(finish)) == [(0, "d-1"), (1, "d-1")]


def test_an_answer_owed_to_one_d_start_is_not_delivered_to_the_next() -> None:
    """P answers a registration of a D rank it has not loaded once it has loaded the rank (a
    FAIL of an ended key, held in ``owed``). D restarts meanwhile (new incarnation, same agent
    name) and registers another key under the same request id (a fresh process numbers its
    requests afresh). P loads the new start: the FAIL owed to the old start's d-1 must not
    reach it. It named d-1 with nothing unsettled, so the new start would fail its d-1 and
    release its blocks while P's WRITE to them, posted in the same step, lands."""
    from test_probe_prefill_held import _core as _tp_core

    core = _tp_core()
    # x-1 ended on P as a failure (an abandoned prefill), then the old start's late PUSH_REG
    core.abandoned("x-1", "aborted by the prefill engine", 100.0, request_id="p-0")
    from test_probe_prefill_held import _register as _reg_held

    _reg_held(core, "D-agent", 100.1, request_id="d-1", decode_incarnation="d1", grant=99.0)
    # the new start registers x-2 as d-1; P finished x-2
    core.finished("x-2", "p-2", ((5,),), "", 100.2)
    _reg_held(
        core, "D-agent", 100.3, request_id="d-1", match_key="x-2", decode_incarnation="d2", block_ids=[[6]]
    )
    out = core.connected("D", 0, "D-agent", "d2", 1, "", 100.4)
    notes = [(a.agent, _note(a.message)) for a in out if isinstance(a, Send)]
    failed = [n.request_id for agent, n in notes if n.kind is NotificationKind.FAILED]
    assert failed == [], "the old start's FAIL of d-1 reached the new start, which holds a d-1 P writes"
    assert [p.registration.request_id for p in _posts(out)] == ["d-1"]


def test_over_real_nixl_two_requests_of_one_rank_under_one_key() -> None:
    """Real NIXL workers in one process: D adds d-1 and then d-2 under x-1 (a router sending one
    request twice). P writes one registration per key and rank: d-2's, the later. d-1 is told
    at once (failed, naming d-2) and released with its block untouched; d-2 receives P's KV byte
    for byte."""
    import pytest
    from cluster import Cluster, kv_bytes, wait_until
    from test_push_flow import assert_pushed

    pytest.importorskip("nixl")
    with Cluster(transport="nixl") as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 1, what="d-1's PUSH_REG")
        cluster.add("d-2", [[4]], "x-1")
        reason = cluster.wait_decode("d-1")[0]
        assert reason is not None and "'d-2'" in reason, reason
        cluster.wait_released("d-1")
        cluster.finish("p-1", [[5]], "x-1")
        assert cluster.wait_decode("d-2") == {0: None}
        assert_pushed(cluster, [5], [4])
        for tensor in cluster.d_caches[0].values():
            assert not kv_bytes(tensor)[:, 3].any(), "d-1's block was written"


def test_a_registration_with_a_grant_p_never_issued_does_not_replace_the_rank() -> None:
    """A registration whose grant is later than P's clock (not a stamp P issued: a forged or
    corrupted value) is not written (no fresh window), and must not displace the registration
    P holds for the rank either (which would then be told FAIL and never written)."""
    core = _core()
    _register(core, 100.1, grant=100.0)
    out = _register(core, 100.2, request_id="d-9", block_ids=[[4]], grant=1.0e6)
    assert _fails(out) == ["d-9"]
    (post,) = _posts(core.finished("x-1", "p-1", ((5,),), "", 100.4))
    assert post.registration.request_id == "d-1"
