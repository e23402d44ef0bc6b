"""D's core: a registered request whose P engine came back with another parallel layout.

P runs PP2. Stage 0's process exits; D fences the engine (both stages' connections) and
handshakes afresh to register the request again with the process that replaced stage 0. The
new P engine runs PP1: there is no stage 1 any more, and the request, which expects the
old two producers, can never complete. It used to be registered again with the new stage 0
while D replaced its record of every producer's agent by the new engine's, so stage 1's old
agent (silent, its process gone or stalled) was forgotten: at the watchdog D had no agent to
cancel, probe or fence for stage 1 and held the blocks for as long as D ran (the process
test: ``tests/test_probe_reconfig_restart.py::test_p_restarted_with_other_parallel_sizes``).

Now the request fails at the re-registration, naming both layouts, and settles stage 1
through its old agent: a fence (WRITEs a fence stops) or its process's exit (kernel copies).
A stage that restarted too but was not yet seen exiting is registered again as well, where a
fence stops its old process's WRITEs (not for kernel copies: that process may still copy).

The core is driven directly (no transport, an injected clock).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Fence, ProbeExit, Release, Report, Send
from kvpush.core.decode_core import ENGINE_PROBE, DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.types import Notification, RankKey, RequestMetadata, TransferParams

P0, P1 = RankKey(0, 0), RankKey(1, 0)
A0, A1 = "P-prefill-pp0-tp0", "P-prefill-pp1-tp0"


def _pp2(abortable: bool, stage1: str = "b1", stage0: str = "a1") -> ProducerInfo:
    return ProducerInfo(
        prefill_pp=2,
        prefill_tp=1,
        agents={P0: A0, P1: A1},
        incarnations={A0: stage0, A1: stage1},
        write_deadline_s=1.0,
        writes_abortable=abortable,
        processes={A0: {"host": "h", "pid": 10}, A1: {"host": "h", "pid": 11}},
    )


def _pp1(abortable: bool) -> ProducerInfo:
    return ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={P0: A0},
        incarnations={A0: "a2"},
        write_deadline_s=1.0,
        writes_abortable=abortable,
        processes={A0: {"host": "h", "pid": 20}},
    )


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _sent(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.agent, _note(a.message).kind.value) for a in actions if isinstance(a, Send)]


def _registered(abortable: bool) -> DecodeCore:
    """D with request r1 registered with both stages of P (PP2); stage 0's process then exits,
    its fence is confirmed and D handshakes afresh."""
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
            peer_silence_s=3.0,
            request_timeout_s=12.0,
        )
    )
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": "k1"}
    d.add(RequestMetadata(request_id="r1", block_ids=((1,),), params=TransferParams.from_dict(params)), 0.0)
    d.connected("P", _pp2(abortable), "", 0.0)
    d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 0.0, "a1")), 0.0)
    regs = d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 0.0, "b1")), 0.0)
    assert sorted(_sent(regs)) == [(A0, "push_reg"), (A1, "push_reg")]
    out = d.producers_exited(ENGINE_PROBE + "P", [A0], 1.0)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    assert set(fence.agents) == {A0, A1} and any(isinstance(a, Connect) for a in out)
    assert d.fenced(fence.fence_id, 1.1) == []
    return d


def _run_until_released(d: DecodeCore, t: float, exited: set[str]) -> float:
    """Drive D's timers, confirm its fences and answer its exit probes (``exited`` have
    exited) until r1's blocks are released; bounded."""
    fences: list[Fence] = []
    for _ in range(400):
        t += 0.25
        out = d.handle_timer(t)
        for action in list(out):
            if isinstance(action, ProbeExit):
                gone = [agent for agent, _ in action.processes if agent in exited]
                out += d.producers_exited(action.request_id, gone, t)
        fences += [a for a in out if isinstance(a, Fence)]
        while fences:
            out += d.fenced(fences.pop().fence_id, t)
            fences += [a for a in out if isinstance(a, Fence) and a not in fences]
            fences = [f for f in fences if f.fence_id in d._fences]
        if any(isinstance(a, Release) and a.request_id == "r1" for a in out):
            return t
    raise AssertionError(f"r1 not released by t={t}: {d.stats}")


@pytest.mark.parametrize("abortable", [True, False], ids=["nixl", "kernel-copies"])
def test_a_request_of_the_old_layout_fails_at_once_and_is_released(abortable: bool) -> None:
    d = _registered(abortable)
    out = d.connected("P", _pp1(abortable), "", 1.2)
    out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, "a2")), 1.2)
    reports = [(r.request_id, r.outcome, r.reason) for r in out if isinstance(r, Report)]
    assert [(rid, outcome) for rid, outcome, _ in reports] == [("r1", "failed")], out
    assert "pp_size" in reports[0][2] or "(pp=1, tp=0)" in reports[0][2], reports
    assert (A0, "push_reg") not in _sent(out), "registered with a P that cannot complete it"
    # Stage 1's old agent is still known: its WRITEs are fenced (nixl: the fence of stage 0's
    # exit cut its connection too, so the blocks go back at once) or its process's exit is
    # awaited (kernel copies), and the blocks go back well before D's own close.
    if abortable:
        assert any(isinstance(a, Release) and a.request_id == "r1" for a in out), out
    else:
        t = _run_until_released(d, 1.2, exited={A1})
        assert t < 12.0, t


def test_a_stage_restarted_but_not_yet_seen_exiting_is_registered_again() -> None:
    """Same layout; stage 1 restarted too (a new incarnation in the handshake) but D's probe
    saw only stage 0's exit: its registration died with its old process, so both stages are
    registered again."""
    d = _registered(abortable=True)
    out = d.connected("P", _pp2(True, stage1="b2", stage0="a2"), "", 1.2)
    out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, "a2")), 1.2)
    out += d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 1.2, "b2")), 1.2)
    assert sorted(s for s in _sent(out) if s[1] == "push_reg") == [(A0, "push_reg"), (A1, "push_reg")], out
    assert not [a for a in out if isinstance(a, Report)], out


def test_with_kernel_copies_a_stage_not_seen_exiting_is_not_registered_again() -> None:
    """The old stage 1 may still run a copy no fence stops: registering the request with the
    new stage 1 would let that copy land after D counted the new one's DONE. Only stage 0,
    seen exiting, is registered again; the request waits for stage 1's old process."""
    d = _registered(abortable=False)
    out = d.connected("P", _pp2(False, stage1="b2", stage0="a2"), "", 1.2)
    out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, "a2")), 1.2)
    out += d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 1.2, "b2")), 1.2)
    assert [s for s in _sent(out) if s[1] == "push_reg"] == [(A0, "push_reg")], out
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.5)  # the new stage 0 wrote
    assert not [a for a in out if isinstance(a, Report)], out
    # It fails (P goes silent here, or at its watchdog) and is held while stage 1's old
    # process runs, then released once it exited.
    with pytest.raises(AssertionError, match="not released"):
        _run_until_released(d, 1.5, exited=set())
    assert d.stats["held_for_kernel_copies"] == 1, d.stats
    _run_until_released(d, 101.5, exited={A1})
