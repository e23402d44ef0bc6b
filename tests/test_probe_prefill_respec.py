"""Probe of P's core (``core/prefill_core.py``): the spec a destination posts with, when its
registration is replaced after a post was refused for a stale grant.

A destination's spec (local and remote block ids) is planned from its D rank's registration
and kept "as the destination's" once the first post is asked for. ``confirm_post`` refusing a
stale grant sends the destination back to wait for a fresh one with that spec kept; a
registration of that D rank arriving meanwhile (another D request under the key: D may hold
two on one rank) replaced the registration but not the spec: P wrote the first request's block
ids and sent the DONE naming the second, which D counted with its own blocks never written (and
the first one's blocks, which D may have released, written).
"""

from __future__ import annotations

from test_retry_after_abort import _core, _posts, _register, _reports, _write


def test_a_registration_replaced_after_a_stale_confirm_is_posted_with_its_own_blocks() -> None:
    core = _core()
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    (first,) = _posts(_register(core, 100.1, grant=100.0))  # d-1, blocks [3], fresh until 110
    assert first.spec.remote_block_ids == ((3,),)
    assert not core.confirm_post("x-1", 0, 110.5)  # the post ran late: stale, waits for a grant
    (post,) = _posts(_register(core, 110.6, request_id="d-2", block_ids=[[4]], grant=110.55))
    assert post.registration.request_id == "d-2"
    assert post.spec.remote_block_ids == ((4,),), "d-1's blocks written under d-2's DONE"
    assert _reports(_write(core, post, 110.7)) == [("p-1", "sent")]


def test_a_fresh_grant_for_the_same_registration_keeps_its_spec() -> None:
    """The control: the same registration renewed (its PUSH_REG sent again with a fresh grant:
    a heartbeat renews no grant) posts the spec planned for it."""
    from test_protocol_safety import _registration
    from test_retry_after_abort import _note

    from kvpush.core import notifications as wire

    core = _core()
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    _register(core, 100.1, grant=100.0)
    assert not core.confirm_post("x-1", 0, 110.5)
    renewal = _note(wire.encode_push_reg(_registration(grant=110.55)))
    (post,) = _posts(core.notification("D-agent", renewal, 110.6))
    assert post.registration.request_id == "d-1" and post.spec.remote_block_ids == ((3,),)


def test_a_registration_of_a_d_rank_this_p_rank_does_not_write_is_ignored_after_planning() -> None:
    """A D rank outside this P rank's plan (it counts other producers) registers after the plan
    was made: ignored, as one that registers before (``_plan_request``). It raised KeyError in
    ``_advance``, which the driver turns into an internal error failing the whole push."""
    from test_protocol_safety import _registration
    from test_retry_after_abort import _note

    from kvpush.core import notifications as wire
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import RankKey, ReadSpec

    def plan(blocks, reg):  # D TP 2, this P rank writes D rank 0 only
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    core = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=2), plan=plan
    )
    for rank in (0, 1):
        hello = _registration(decode_tp_rank=rank, decode_tp_size=2)
        core.notification(f"D{rank}", _note(wire.encode_hello(hello, rank)), 100.0)
        core.connected("D", rank, f"D{rank}", "d1", 2, "", 100.0)
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    reg0 = _registration(decode_tp_rank=0, decode_tp_size=2)
    (post,) = _posts(core.notification("D0", _note(wire.encode_push_reg(reg0)), 100.1))
    reg1 = _registration(decode_tp_rank=1, decode_tp_size=2, block_ids=[[9]])
    assert _posts(core.notification("D1", _note(wire.encode_push_reg(reg1)), 100.2)) == []
    assert _reports(_write(core, post, 100.3)) == [("p-1", "sent")]
