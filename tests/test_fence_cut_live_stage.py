"""A live PP stage whose connection D's fence cut (phase probe finding 3).

D fences a P engine whole when one of its processes exited (``DecodeCore._agents_exited``):
over TCP the fence shuts every connection from the P host (``transports/tcp_fence.py`` tells a
peer's connections by address), so a *live* stage's connection goes too. That stage's next send
to D raises, and P used to fail the attempt it held a registration of (``PrefillCore._rank_gone``),
while D registered the request again with the restarted stage only; the request then failed
"P no longer holds this request" though both stages could serve it.

Now P, when a D rank's endpoint breaks, fails only the attempts that posted something to that
rank (bytes may have landed: D must fence and fail); a registration it holds with nothing
posted is dropped and waits for D to register again (bounded by P's lease, renewed by D's
heartbeats, as any registration P waits for). And D registers again every producer whose
connection its fence cut and that had not reported, live ones included (a live producer that
still holds the registration takes it as a renewal).

The cores are driven directly (no transport, an injected clock).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from test_reregister_after_layout_change import A0, A1, P0, P1, _note, _pp2, _registered, _sent

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Post, Report, Send
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.producers import destinations
from kvpush.core.types import PushRegistration, RankKey, ReadSpec

D_AGENT = "D-decode-pp0-tp0"


@pytest.mark.parametrize("abortable", [True, False], ids=["nixl", "kernel-copies"])
def test_d_registers_the_live_stage_its_fence_cut_again(abortable: bool) -> None:
    """PP2; stage 0's process exited and D fenced the engine whole (both connections). The
    handshake afresh shows stage 0 restarted and stage 1 the same process: both are registered
    again, stage 1 because its connection was cut with its registration's messages. Not where
    the fence does not stop stage 1's copies (kernel copies): its registration is not settled
    by the fence, so it waits for stage 1's own answer, as before."""
    d = _registered(abortable)  # r1 registered with both stages; stage 0 exited; fence confirmed
    out = d.connected("P", _pp2(abortable, stage1="b1", stage0="a2"), "", 1.2)
    out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, "a2")), 1.2)
    out += d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 1.2, "b1")), 1.2)
    regs = sorted(s for s in _sent(out) if s[1] == "push_reg")
    assert regs == ([(A0, "push_reg"), (A1, "push_reg")] if abortable else [(A0, "push_reg")]), out
    assert not [a for a in out if isinstance(a, Report)], out
    # Both stages write: the request is done once each reported.
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 1, None, "a2")), 1.3)
    out += d.notification(A1, _note(wire.encode_done("r1", P1, 1, None, "b1")), 1.3)
    assert [(r.request_id, r.outcome) for r in out if isinstance(r, Report)] == [("r1", "done")], out


def _p() -> PrefillCore:
    return PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1, lease_s=3.0),
        plan=lambda blocks, reg: [
            ReadSpec(dst_tp_rank=d, local_block_ids=blocks, remote_block_ids=reg.block_ids)
            for d in destinations(0, 1, reg.decode_tp_size)
        ],
    )


def _reg(grant: float) -> bytes:
    return wire.encode_push_reg(
        PushRegistration(
            request_id="r1",
            match_key="k1",
            decode_engine_id="D",
            decode_host="d.example",
            decode_port=5700,
            decode_tp_size=1,
            block_ids=((3,),),
            remote_engine_id="P",
            decode_tp_rank=0,
            decode_incarnation="d1",
            grant=grant,
            fresh_s=1.0,
        )
    )


def _hello_reg(incarnation: str) -> PushRegistration:
    """The registration coordinates a HELLO of D's rank 0 (in ``incarnation``) carries."""
    return PushRegistration(
        request_id="(hello)",
        match_key="(none)",
        decode_engine_id="D",
        decode_host="d.example",
        decode_port=5700,
        decode_tp_size=1,
        block_ids=(),
        remote_engine_id="(any)",
        decode_incarnation=incarnation,
        fresh_s=1.0,
    )


def _loaded_with_r1() -> PrefillCore:
    """P with D's rank loaded and r1's registration held (its prefill not finished)."""
    p = _p()
    assert [a for a in p.notification(D_AGENT, _note(_reg(0.0)), 0.0) if isinstance(a, Connect)]
    p.connected("D", 0, D_AGENT, "d1", 1, "", 0.0)
    return p


def _reconnect(p: PrefillCore, t: float) -> list[Any]:
    """D's registration again after its fence (P loads D's rank afresh)."""
    out = p.notification(D_AGENT, _note(_reg(t)), t)
    if any(isinstance(a, Connect) for a in out):
        out += p.connected("D", 0, D_AGENT, "d1", 1, "", t)
    return out


def test_p_keeps_a_registration_with_nothing_posted_when_d_cut_the_connection() -> None:
    p = _loaded_with_r1()
    out = p.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 0.5)  # D's fence cut it
    assert not [a for a in out if isinstance(a, Report)], out
    assert not [a for a in out if isinstance(a, Send)], out  # nothing to tell through it
    out = _reconnect(p, 0.6) + p.finished("k1", "p-k1", ((0,),), "D", 0.7)
    assert [a for a in out if isinstance(a, Post)], out
    assert not [a for a in out if isinstance(a, Report)], out


def test_p_keeps_a_finished_request_waiting_for_a_fresh_grant_when_d_cut_the_connection() -> None:
    p = _loaded_with_r1()
    out = p.finished("k1", "p-k1", ((0,),), "D", 2.0)  # r1's grant (0.0) is stale by now
    assert not [a for a in out if isinstance(a, Post)], out
    out = p.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 2.1)
    assert not [a for a in out if isinstance(a, Report)], out
    out = _reconnect(p, 2.2)
    assert [a for a in out if isinstance(a, Post)], out


def test_p_still_fails_an_attempt_whose_write_to_the_cut_rank_was_posted() -> None:
    p = _loaded_with_r1()
    out = _reconnect(p, 0.5) + p.finished("k1", "p-k1", ((0,),), "D", 0.5)
    assert [a for a in out if isinstance(a, Post)], out
    assert p.confirm_post("k1", 0, 0.5)
    p.posted("k1", 0, ["h0"], 1, 0.5, abortable=True)
    out = p.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 0.6)
    out += p.write_settled("k1", 0, "h0", False, 0.6)
    reports = [a for a in out if isinstance(a, Report)]
    assert [r.key for r in reports] == ["k1"] and reports[0].outcome == "failed", out


def test_p_lets_a_kept_registration_go_at_its_lease_when_d_never_registers_again() -> None:
    """The D rank really died: P's wait for a registration again is bounded by the lease (D's
    heartbeats would renew it)."""
    p = _loaded_with_r1()
    p.finished("k1", "p-k1", ((0,),), "D", 2.0)
    p.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 2.1)
    out: list[Any] = []
    t = 2.1
    while not [a for a in out if isinstance(a, Report)] and t < 10.0:
        t = round(t + 0.25, 6)
        out += p.handle_timer(t)
    reports = [a for a in out if isinstance(a, Report)]
    assert [r.key for r in reports] == ["k1"] and "lease" in str(reports[0]), (t, out)
    assert t <= 2.0 + 3.0 + 0.25


def test_p_asks_for_a_cut_registration_at_the_next_heartbeat_naming_its_key() -> None:
    """D may not know the registration was lost (a fence that reconnects without registering
    again, or a connection that broke by itself): once P loaded the rank again, the first
    heartbeat naming the key is answered with the key in ``want``, and D sends its PUSH_REG
    again (``DecodeCore._renew``)."""
    p = _loaded_with_r1()  # r1 registered, its prefill not finished
    p.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 0.3)
    hello = _hello_reg("d1")
    out = p.notification(D_AGENT, _note(wire.encode_hello(hello, 0)), 0.4)
    assert [a for a in out if isinstance(a, Connect)], out
    p.connected("D", 0, D_AGENT, "d1", 1, "", 0.4)  # D's rank loaded again
    beat = wire.encode_heartbeat(["k1"], attrs.evolve(hello, request_id="(heartbeat)", grant=0.5), 0)
    (answer,) = [a for a in p.notification(D_AGENT, _note(beat), 0.5) if isinstance(a, Send)]
    assert list(_note(answer.message).want) == ["k1"], answer
    out = _reconnect(p, 0.6) + p.finished("k1", "p-k1", ((0,),), "D", 0.7)
    assert [a for a in out if isinstance(a, Post)], out


def test_a_cut_registration_of_a_d_rank_that_then_restarted_fails_at_once() -> None:
    """The endpoint broke because D's rank restarted: the registration P kept for it belonged
    to the old start, gone with its request. When the new start shows itself (its HELLO, a
    new incarnation), the request fails at once (P's blocks go back), not at its lease."""
    p = _loaded_with_r1()
    p.finished("k1", "p-k1", ((0,),), "D", 2.0)  # stale grant: waits for a fresh one
    p.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 2.1)
    hello = _hello_reg("d2")  # the new start
    out = p.notification(D_AGENT, _note(wire.encode_hello(hello, 0)), 2.2)
    out += p.connected("D", 0, D_AGENT, "d2", 1, "", 2.2) if any(isinstance(a, Connect) for a in out) else []
    reports = [a for a in out if isinstance(a, Report)]
    assert [(r.key, r.outcome) for r in reports] == [("k1", "failed")], out
