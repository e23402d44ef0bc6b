"""A retry of an aborted request under the same match key.

P keeps a tombstone for every key that ended (``registration_ttl_s``), so that a late or
duplicated message of the ended attempt is answered (FAIL, or dropped for a key pushed) and
never re-triggers a push into blocks D may have freed. It used to answer *every* later message
of the key, so a genuine retry under the same key within the TTL failed: P refused the second
``request_finished`` ("already ended on this rank") and answered D's new registration FAIL.

The rule now (docs/reliability.md, "A retry under the same key"): a finish by another prefill
than the ones the ended attempts accounted for starts a new attempt; a registration is the
ended attempt's when P saw its D request id there, or when its grant is not newer than the end
(nor than the last time P told that D rank the key had ended); only a registration proven
newer is held or paired. D proves it: a D rank registering a key it saw end asks each producer
for a fresh stamp first, and a heartbeat answer's ``failed`` ends only registrations older than
that answer.
"""

from __future__ import annotations

from typing import Any

import torch
from cluster import Cluster, kv_bytes, wait_until
from test_protocol_safety import _registration

from kvpush.core import notifications as wire
from kvpush.core.actions import Post, Report, Send
from kvpush.core.types import NotificationKind, RankKey

P0 = RankKey(0, 0)


# ------------------------------------------------------------------------------ P's core


def _note(message: bytes) -> Any:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _core() -> Any:
    """A P core that loaded D rank 0 (agent ``D-agent``)."""
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import ReadSpec

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    core = PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)
    core.notification("D-agent", _note(wire.encode_hello(_registration(), 0)), 100.0)
    core.connected("D", 0, "D-agent", "d1", 1, "", 100.0)
    return core


def _register(core: Any, now: float, **overrides: Any) -> list[Any]:
    return core.notification("D-agent", _note(wire.encode_push_reg(_registration(**overrides))), now)


def _posts(actions: list[Any]) -> list[Post]:
    return [a for a in actions if isinstance(a, Post)]


def _fails(actions: list[Any]) -> list[str]:
    return [
        note.request_id
        for a in actions
        if isinstance(a, Send) and (note := _note(a.message)).kind is NotificationKind.FAILED
    ]


def _reports(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.request_id, a.outcome) for a in actions if isinstance(a, Report)]


def _write(core: Any, post: Post, now: float) -> list[Any]:
    assert core.confirm_post(post.key, post.dst, now)
    core.posted(post.key, post.dst, ["h"], 8, now)
    return core.write_settled(post.key, post.dst, "h", True, now)


def _aborted(core: Any) -> None:
    """Attempt 1 of x-1: P finished p-1, D registered d-1, P's engine aborted it (no WRITE)."""
    _register(core, 100.1, grant=100.0)
    core.finished("x-1", "p-1", ((5,),), "", 100.0)  # posted once the grant is checked
    assert _reports(core.abort("x-1", 100.2)) == [("p-1", "failed")]


def test_a_new_finish_and_a_new_registration_push_the_retry_finish_first() -> None:
    core = _core()
    _aborted(core)
    assert _posts(core.finished("x-1", "p-2", ((6,),), "", 101.0)) == []  # a new attempt: waits
    actions = _register(core, 101.1, request_id="d-1#2", block_ids=[[4]], grant=101.05)
    (post,) = _posts(actions)
    assert post.registration.request_id == "d-1#2" and post.spec.remote_block_ids == ((4,),)
    assert _reports(_write(core, post, 101.2)) == [("p-2", "sent")]


def test_a_new_registration_before_the_new_finish_is_held_for_it() -> None:
    core = _core()
    _aborted(core)
    held = _register(core, 101.1, request_id="d-1#2", block_ids=[[4]], grant=101.05)
    assert _fails(held) == [] and _posts(held) == []
    (post,) = _posts(core.finished("x-1", "p-2", ((6,),), "", 101.2))
    assert post.registration.request_id == "d-1#2"


def test_a_late_duplicate_of_the_old_registration_never_triggers_a_push() -> None:
    """The ended attempt's registration (d-1, blocks [3]) arrives again: before the retry,
    while it is held, and while it pushes. It is answered FAIL each time and never written;
    the retry's registration is untouched."""
    core = _core()
    _aborted(core)
    late = _register(core, 100.9, grant=100.0)
    assert _fails(late) == ["d-1"] and _posts(late) == []
    _register(core, 101.1, request_id="d-1#2", block_ids=[[4]], grant=101.05)
    late = _register(core, 101.15, grant=100.0)  # the retry's registration is held
    assert _fails(late) == ["d-1"] and _posts(late) == []
    (post,) = _posts(core.finished("x-1", "p-2", ((6,),), "", 101.2))
    late = _register(core, 101.25, grant=100.0)  # and while the retry pushes
    assert _fails(late) == ["d-1"] and _posts(late) == []
    assert post.registration.request_id == "d-1#2"
    assert core.confirm_post(post.key, post.dst, 101.3)
    # Even with a fresh grant (a duplicated message P answers by its id, not by its grant).
    assert _posts(_register(core, 101.35, grant=101.3)) == []


def test_a_registration_not_proven_newer_than_the_end_is_answered_as_before() -> None:
    """A new D request id whose grant is not newer than the end may be the ended attempt's
    (from a D rank P had not heard from): the tombstone answers it FAIL, as before."""
    core = _core()
    _aborted(core)
    actions = _register(core, 101.0, request_id="d-7", grant=100.1)
    assert _fails(actions) == ["d-7"] and _posts(actions) == []
    assert _posts(core.finished("x-1", "p-2", ((6,),), "", 101.1)) == []


def test_a_second_finish_of_the_same_prefill_is_still_refused() -> None:
    core = _core()
    _aborted(core)
    again = core.finished("x-1", "p-1", ((5,),), "", 101.0)
    assert _reports(again) == [("p-1", "failed")] and "already ended" in again[0].reason


def test_a_key_that_ended_before_p_finished_refuses_its_first_finish() -> None:
    """D cancelled (or its registration expired) before P finished: the first finish is that
    attempt's and is refused naming why; a finish by another prefill after it is a retry."""
    core = _core()
    _register(core, 100.1)
    cancel = wire.encode_cancel("x-1", _registration(), 0)
    core.notification("D-agent", _note(cancel), 100.2)
    first = core.finished("x-1", "p-1", ((5,),), "", 100.3)
    assert _reports(first) == [("p-1", "failed")] and "cancelled by D" in first[0].reason
    assert _reports(core.finished("x-1", "p-2", ((6,),), "", 100.4)) == []  # a retry: held
    (post,) = _posts(_register(core, 100.5, request_id="d-1#2", block_ids=[[4]], grant=100.45))
    assert post.registration.request_id == "d-1#2"


def test_an_ended_keys_heartbeat_failure_covers_only_older_registrations() -> None:
    """P told D rank 0 that x-1 ended (a heartbeat answer, stamp 101.0): a registration with a
    grant older than that is the ended attempt's (D ended it on that answer) and is refused; one
    granted at or after it is the retry's."""
    core = _core()
    _aborted(core)
    beat = wire.encode_heartbeat(["x-1"], _registration(request_id="(heartbeat)", grant=100.9), 0)
    answer = _note(next(a.message for a in core.notification("D-agent", _note(beat), 101.0)))
    assert answer.failed_keys == ("x-1",)
    refused = _register(core, 101.1, request_id="d-9", grant=100.95)
    assert _fails(refused) == ["d-9"] and _posts(refused) == []
    held = _register(core, 101.2, request_id="d-10", grant=101.0)
    assert _fails(held) == []
    assert [p.registration.request_id for p in _posts(core.finished("x-1", "p-2", ((6,),), "", 101.3))] == [
        "d-10"
    ]


# ------------------------------------------------------------------------------ D's core


def _decode() -> Any:
    from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo

    core = DecodeCore(
        DecodeSettings(engine_id="D", incarnation="d1", tp_rank=0, tp_size=1, host="127.0.0.1", port=5601)
    )
    info = ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={P0: "P-agent"},
        incarnations={"P-agent": "p1"},
        write_deadline_s=1.0,
    )
    core.add(_request("d-1", "x-1"), 0.0)
    core.connected("P", info, "", 0.0)
    core.notification("P-agent", _note(wire.encode_heartbeat_answer(P0, 10.0, "p1")), 0.1)  # ready
    return core


def _request(rid: str, key: str) -> Any:
    from kvpush.core.types import RequestMetadata, TransferParams

    params = {"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(request_id=rid, block_ids=((1,),), params=TransferParams.from_dict(params))


def _push_regs(actions: list[Any]) -> list[Any]:
    return [
        note.registration
        for a in actions
        if isinstance(a, Send) and (note := _note(a.message)).kind is NotificationKind.PUSH_REG
    ]


def test_d_registers_a_key_it_saw_end_with_a_fresh_stamp() -> None:
    core = _decode()
    failed = _note(wire.encode_failed("d-1", P0, "aborted by the prefill engine", unsettled=False))
    assert ("d-1", "failed") in _reports(core.notification("P-agent", failed, 0.2))
    asked = core.add(_request("d-1#2", "x-1"), 0.3)
    assert _push_regs(asked) == []  # first a fresh stamp: P's stamp 10.0 predates the end
    assert [_note(a.message).kind for a in asked if isinstance(a, Send)] == [NotificationKind.HEARTBEAT]
    regs = _push_regs(core.notification("P-agent", _note(wire.encode_heartbeat_answer(P0, 12.0, "p1")), 0.4))
    assert [(r.request_id, r.grant) for r in regs] == [("d-1#2", 12.0)]
    other = core.add(_request("d-2", "x-2"), 0.5)  # a key that never ended here: at once
    assert [r.request_id for r in _push_regs(other)] == ["d-2"]


def test_d_registers_anyway_when_no_fresh_stamp_comes() -> None:
    core = _decode()
    failed = _note(wire.encode_failed("d-1", P0, "aborted", unsettled=False))
    core.notification("P-agent", failed, 0.2)
    core.add(_request("d-1#2", "x-1"), 0.3)
    later = core.handle_timer(0.3 + core.s.hello_timeout_s + 0.01)
    assert [r.request_id for r in _push_regs(later)] == ["d-1#2"]  # P decides (as before)


def test_d_does_not_end_a_registration_newer_than_ps_failed_answer() -> None:
    core = _decode()
    core.notification("P-agent", _note(wire.encode_heartbeat_answer(P0, 11.0, "p1")), 0.2)
    core.add(_request("d-2", "x-1"), 0.3)  # registered with grant 11.0
    stale = _note(wire.encode_heartbeat_answer(P0, 10.5, "p1", failed=["x-1"]))  # reordered
    reports = _reports(core.notification("P-agent", stale, 0.4))
    assert ("d-1", "failed") in reports and ("d-2", "failed") not in reports
    assert core.holds("d-2")


# ------------------------------------------------------------------------------ real NIXL


def _pushed(cluster: Cluster, p_ids: list[int], d_ids: list[int]) -> None:
    for layer, got in cluster.d_caches[0].items():
        want = kv_bytes(cluster.p_caches[P0][layer])[:, p_ids]
        assert torch.equal(kv_bytes(got)[:, d_ids], want), layer


def test_a_retry_after_d_cancelled_is_pushed_under_the_same_key() -> None:
    """D cancels its request before P finished; the engines retry it under the same key and
    request id (D registers it as d-1#n): P's old prefill is refused, the retry is pushed."""
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[1, 2]], "x-1")
        wait_until(lambda: sender.call_on_writer(sender.core.state_sizes)["stashed"] == 1, what="stash")
        cluster.receivers[0].cancel("d-1")
        cluster.wait_released("d-1", timeout_s=10)
        cluster.finish("p-1", [[3, 4]], "x-1")  # the cancelled attempt's prefill
        assert "cancelled by D" in (cluster.wait_prefill("p-1")[P0] or "")
        cluster.d_results[0].pop("d-1")
        cluster.add("d-1", [[5, 6]], "x-1")  # the retry, registered first
        cluster.finish("p-2", [[7, 8]], "x-1")
        assert cluster.wait_decode("d-1", timeout_s=10) == {0: None}
        assert cluster.wait_prefill("p-2")[P0] is None
        _pushed(cluster, [7, 8], [5, 6])


def test_a_retry_after_p_aborted_is_pushed_under_the_same_key() -> None:
    """P's engine aborts the prefill (D is told it failed); the retry under the same key is
    pushed, finish first this time, and the ended attempt's blocks are never written."""
    with Cluster(transport="nixl", request_timeout_s=60, heartbeat_interval_s=0.2) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[1, 2]], "x-1")
        wait_until(lambda: sender.call_on_writer(sender.core.state_sizes)["stashed"] == 1, what="stash")
        sender.request_abandoned("p-1", match_key="x-1", reason="client went away")
        assert "client went away" in (cluster.wait_decode("d-1", timeout_s=5)[0] or "")
        cluster.wait_released("d-1", timeout_s=10)
        before = {layer: kv_bytes(t)[:, [1, 2]].clone() for layer, t in cluster.d_caches[0].items()}
        cluster.d_results[0].pop("d-1")
        cluster.finish("p-2", [[7, 8]], "x-1")  # the retry, finished first
        cluster.add("d-1", [[5, 6]], "x-1")
        assert cluster.wait_decode("d-1", timeout_s=10) == {0: None}
        _pushed(cluster, [7, 8], [5, 6])
        for layer, t in cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(t)[:, [1, 2]], before[layer]), layer


def test_abandoning_the_ended_attempts_prefill_leaves_a_held_retry_alone() -> None:
    """D cancelled attempt 1 before P finished; D's retry registration is held; P's engine then
    abandons attempt 1's prefill (p-1): that accounts for the ended attempt and fails nothing of
    the retry, whose prefill (p-2) is pushed."""
    core = _core()
    _register(core, 100.1)
    core.notification("D-agent", _note(wire.encode_cancel("x-1", _registration(), 0)), 100.2)
    held = _register(core, 100.5, request_id="d-1#2", block_ids=[[4]], grant=100.45)
    assert _fails(held) == [] and _posts(held) == []
    assert _fails(core.abandoned("x-1", "aborted", 100.6, request_id="p-1")) == []
    (post,) = _posts(core.finished("x-1", "p-2", ((6,),), "", 100.7))
    assert post.registration.request_id == "d-1#2"
