"""D's core: a request held for a live producer while P's side channel names no producer set.

PP2, copies no fence stops (same host). Stage 0's process exits and a new one comes back
under its name with another layer split; stage 1 still runs the process the request
registered with. D fences the exited stage, handshakes afresh to register the request again,
and every handshake is refused (the new stage 0 and the old stage 1 publish overlapping
windows). At the restart bound the request fails and, its stage-1 copy unfenceable, is held
until stage 1 acknowledges or exits. Its CANCEL needed a ready engine, which the mix never
gives: the blocks stayed held for as long as stage 1 ran (the process test:
``tests/test_probe_reconfig_restart.py::test_p_stages_restarted_one_by_one_with_another_layer_split``).
Now the refused handshake's loaded agents carry the CANCEL to stage 1's process (the one the
request registered with), whose answer settles it; nothing is registered with the mix.

The core is driven directly (no transport, an injected clock).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Fence, Release, Report, Send
from kvpush.core.decode_core import ENGINE_PROBE, DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.types import Notification, RankKey, RequestMetadata, TransferParams

P0, P1 = RankKey(0, 0), RankKey(1, 0)
A0, A1 = "P-prefill-pp0-tp0", "P-prefill-pp1-tp0"
SILENCE_S = 3.0
REFUSAL = (
    "the producers of engine 'P' that (pp=0, tp=0) waits for would not write each byte of its "
    "blocks exactly once:\n  - P ranks (pp=0, tp=0) and (pp=1, tp=0) publish layer windows that overlap"
)


def _info(stage0: str = "a1") -> ProducerInfo:
    return ProducerInfo(
        prefill_pp=2,
        prefill_tp=1,
        agents={P0: A0, P1: A1},
        incarnations={A0: stage0, A1: "b1"},
        write_deadline_s=1.0,
        writes_abortable=False,
        processes={A0: {"host": "h", "pid": 10}, A1: {"host": "h", "pid": 11}},
    )


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _sent(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.agent, _note(a.message).kind.value) for a in actions if isinstance(a, Send)]


def _until(d: DecodeCore, t: float, until: float, want: type) -> tuple[float, list[Any]]:
    """Run D's timers every 0.25 s until an action of type ``want`` comes (bounded)."""
    while t < until:
        t += 0.25
        out = d.handle_timer(t)
        if any(isinstance(a, want) for a in out):
            return t, out
    raise AssertionError(f"no {want.__name__} by t={until}")


def _refused_until_report(d: DecodeCore, t: float, until: float) -> tuple[float, list[Any]]:
    """Run D's timers every 0.25 s, each handshake refused with the published mix, until a
    ``Report`` comes (bounded): the restart bound and its last attempt."""
    while t < until:
        t += 0.25
        out = d.handle_timer(t)
        if any(isinstance(a, Connect) for a in out):
            out += d.connected("P", _info(stage0="a2"), REFUSAL, t)
        if any(isinstance(a, Report) for a in out):
            return t, out
    raise AssertionError(f"no Report by t={until}")


def test_a_held_request_is_cancelled_through_a_refused_handshake_and_released() -> None:
    d = DecodeCore(
        DecodeSettings(
            engine_id="D",
            incarnation="d1",
            tp_rank=0,
            tp_size=1,
            host="d.example",
            port=5700,
            heartbeat_interval_s=0.25,
            fresh_s=0.5,
            peer_silence_s=SILENCE_S,
        )
    )
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": "k1"}
    d.add(RequestMetadata(request_id="r1", block_ids=((1,),), params=TransferParams.from_dict(params)), 0.0)
    assert sorted(_sent(d.connected("P", _info(), "", 0.0))) == [(A0, "hello"), (A1, "hello")]
    d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 0.0, "a1")), 0.0)
    regs = d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 0.0, "b1")), 0.0)
    assert sorted(_sent(regs)) == [(A0, "push_reg"), (A1, "push_reg")]

    # Stage 0's process exited: fenced, handshaken afresh, the request to be registered again.
    out = d.producers_exited(ENGINE_PROBE + "P", [A0], 1.0)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    assert any(isinstance(a, Connect) for a in out)
    assert d.fenced(fence.fence_id, 1.1) == []
    # The side channel names the new stage 0 and the old stage 1: refused, nothing fails yet.
    out = d.connected("P", _info(stage0="a2"), REFUSAL, 1.2)
    assert not [a for a in out if isinstance(a, Report)] and not _sent(out), out

    # Each handshake afresh is refused the same way; at the restart bound one last one, then
    # the request fails; stage 1 may still copy: held.
    t, out = _refused_until_report(d, 1.2, 1.0 + SILENCE_S + 1.0)
    assert [(r.request_id, r.outcome) for r in out if isinstance(r, Report)] == [("r1", "failed")]
    t, out = _until(d, t, t + 40.0, Connect)  # the hold handshakes afresh for the CANCEL
    assert d.stats["held_for_kernel_copies"] == 1 and not any(isinstance(a, Release) for a in out)

    # Refused again (the mix is still published): its loaded stage 1 is the process the
    # request registered with, and is asked; the new stage 0 (another process) is not.
    out = d.connected("P", _info(stage0="a2"), REFUSAL, t)
    assert _sent(out) == [(A1, "cancel")], out
    assert not any(isinstance(a, Release) for a in out)
    # Stage 1's answer settles it; stage 0's old connections are fenced again, then release.
    ack = _note(wire.encode_cancel_ack("r1", P1, False, unsettled=False))
    out = d.notification(A1, ack, t + 0.01)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    assert A0 in fence.agents
    out = d.fenced(fence.fence_id, t + 0.02)
    assert [a.request_id for a in out if isinstance(a, Release)] == ["r1"], out


def test_an_answer_from_another_process_under_the_live_stage_name_does_not_release() -> None:
    """The refused handshake loaded a new process under stage 1's name too: it never had the
    request, so it is not asked, and an answer under that name does not settle the hold."""
    d = DecodeCore(
        DecodeSettings(
            engine_id="D",
            incarnation="d1",
            tp_rank=0,
            tp_size=1,
            host="d.example",
            port=5700,
            heartbeat_interval_s=0.25,
            fresh_s=0.5,
            peer_silence_s=SILENCE_S,
        )
    )
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": "k1"}
    d.add(RequestMetadata(request_id="r1", block_ids=((1,),), params=TransferParams.from_dict(params)), 0.0)
    d.connected("P", _info(), "", 0.0)
    d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 0.0, "a1")), 0.0)
    d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 0.0, "b1")), 0.0)
    out = d.producers_exited(ENGINE_PROBE + "P", [A0], 1.0)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    d.fenced(fence.fence_id, 1.1)
    d.connected("P", _info(stage0="a2"), REFUSAL, 1.2)
    t, _ = _refused_until_report(d, 1.2, 1.0 + SILENCE_S + 1.0)
    t, _ = _until(d, t, t + 40.0, Connect)
    other = _info(stage0="a2")
    other = attrs.evolve(other, incarnations={**other.incarnations, A1: "b2"})  # stage 1 restarted too
    assert _sent(d.connected("P", other, REFUSAL, t)) == []
    ack = _note(wire.encode_cancel_ack("r1", P1, False, unsettled=False))
    out = d.notification(A1, ack, t + 0.01)
    assert not any(isinstance(a, (Fence, Release)) for a in out), out
