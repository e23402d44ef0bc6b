"""D's core: a closing P worker's ``BYE`` overtakes the DONE of its last WRITE.

UCX may carry a WRITE's completion notification and a later notification on different lanes,
so D can read P's ``BYE`` ("this incarnation posts nothing more and every WRITE it posted
ended") before the DONE of a WRITE that completed. D used to fail every request still
registered with that incarnation at the BYE, so a request whose bytes had all landed was
reported failed (a CI run of ``examples/engine_multiprocess.py`` saw it). Not wrong KV, but a
decode lost for nothing.

Now P's BYE names the D request ids whose DONE it sent to that D rank lately (``delivered``,
notification format 2.4). D keeps such a request registered and counts the DONE when it
arrives; the producer counts as settled (nothing of it is in flight), so if the DONE never
comes the request fails at its watchdog and its blocks go back at once, also where P's copies
are kernels no fence stops. A request the BYE does not name fails at once, as before, and so
does everything when an older P's BYE names nothing.

The core is driven directly (no transport, an injected clock); the P side of the record is
checked through P's core.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_close_tells_decode import _loaded_core
from test_protocol_safety import _registration

from kvpush.core import notifications as wire
from kvpush.core.actions import Post, Release, Report
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.types import Notification, NotificationKind, RankKey, RequestMetadata, TransferParams

P0, P1 = RankKey(0, 0), RankKey(1, 0)
A0, A1 = "P-prefill-pp0-tp0", "P-prefill-pp1-tp0"
TIMEOUT_S = 12.0


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _info(stages: int, abortable: bool) -> ProducerInfo:
    agents = {P0: A0, P1: A1}
    return ProducerInfo(
        prefill_pp=stages,
        prefill_tp=1,
        agents={r: a for r, a in agents.items() if r.pp_rank < stages},
        incarnations={a: f"inc-{a}" for r, a in agents.items() if r.pp_rank < stages},
        write_deadline_s=1.0,
        writes_abortable=abortable,
        processes={a: {"host": "h", "pid": 10 + r.pp_rank} for r, a in agents.items() if r.pp_rank < stages},
    )


def _registered(*rids: str, stages: int = 1, abortable: bool = True) -> DecodeCore:
    """D with each of ``rids`` registered with P's ``stages`` stages."""
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
            request_timeout_s=TIMEOUT_S,
        )
    )
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600}
    for n, rid in enumerate(rids):
        meta = RequestMetadata(
            request_id=rid,
            block_ids=((n + 1,),),
            params=TransferParams.from_dict({**params, "transfer_id": f"k-{rid}"}),
        )
        d.add(meta, 0.0)
    d.connected("P", _info(stages, abortable), "", 0.0)
    for rank, agent in [(P0, A0), (P1, A1)][:stages]:
        d.notification(agent, _note(wire.encode_heartbeat_answer(rank, 0.0, f"inc-{agent}")), 0.0)
    assert d.stats["push_regs_sent"] == len(rids) * stages
    return d


def _bye(rank: RankKey, agent: str, delivered: list[str], unsettled: bool = False) -> Notification:
    return _note(wire.encode_goodbye(rank, f"inc-{agent}", unsettled, delivered=delivered))


def _reports(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.request_id, a.outcome) for a in actions if isinstance(a, Report)]


def _released(actions: list[Any]) -> list[str]:
    return [a.request_id for a in actions if isinstance(a, Release)]


def test_a_goodbye_naming_a_delivered_request_does_not_fail_it() -> None:
    d = _registered("r1", "r2")
    out = d.notification(A0, _bye(P0, A0, delivered=["r1"]), 1.0)
    assert _reports(out) == [("r2", "failed")], out  # r2 was never written: it fails at once
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.001)  # the overtaken DONE
    assert _reports(out) == [("r1", "done")], out
    assert _released(out) == []  # done: the blocks are the engine's now


@pytest.mark.parametrize("abortable", [True, False], ids=["nixl", "kernel-copies"])
def test_a_delivered_request_whose_done_never_comes_fails_at_its_watchdog_and_is_released(
    abortable: bool,
) -> None:
    """The producer said nothing of it is in flight: no fence and no process exit is waited
    for, also where its copies are kernels."""
    d = _registered("r1", abortable=abortable)
    assert _reports(d.notification(A0, _bye(P0, A0, delivered=["r1"]), 1.0)) == []
    out: list[Any] = []
    t = 1.0
    while t < TIMEOUT_S + 1.0 and "r1" not in _released(out):
        t += 0.25
        out += d.handle_timer(t)
    assert _reports(out) == [("r1", "failed")], out
    assert _released(out) == ["r1"], (t, d.stats)
    assert d.stats["held_for_kernel_copies"] == 0


def test_one_stage_saying_goodbye_leaves_a_request_the_other_stage_still_writes() -> None:
    """P PP2 shuts down: stage 0 ended first (its DONE for r1 sent, and named in its BYE);
    stage 1 still writes r1's later layers. r1 completes when stage 1's DONE arrives."""
    d = _registered("r1", stages=2)
    out = d.notification(A0, _bye(P0, A0, delivered=["r1"]), 1.0)
    out += d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.001)
    assert _reports(out) == [], out
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 1.2)
    assert _reports(out) == [("r1", "done")], out


def test_a_goodbye_after_the_done_changes_nothing() -> None:
    d = _registered("r1", "r2")
    assert _reports(d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.0)) == [("r1", "done")]
    out = d.notification(A0, _bye(P0, A0, delivered=["r1", "r2"]), 1.001)
    assert _reports(out) == [], out  # r2's DONE is on its way too
    assert _reports(d.notification(A0, _note(wire.encode_done("r2", P0, 1)), 1.002)) == [("r2", "done")]


def test_an_older_p_whose_goodbye_names_nothing_fails_what_is_registered() -> None:
    """Format 2.3 had no ``delivered``: D cannot tell a DONE on its way from none."""
    d = _registered("r1")
    body = wire.decode_notification(wire.encode_goodbye(P0, f"inc-{A0}", False))
    assert body is not None and body.delivered == ()
    assert _reports(d.notification(A0, body, 1.0)) == [("r1", "failed")]


def test_a_goodbye_from_another_incarnation_keeps_nothing_registered_by_name() -> None:
    """A BYE is about the incarnation that sent it: naming r1 does not keep a request that
    registered with another one (here: none of this agent's, so nothing changes)."""
    d = _registered("r1")
    stale = _note(wire.encode_goodbye(P0, "inc-older", False, delivered=["r1"]))
    assert _reports(d.notification(A0, stale, 1.0)) == []
    assert _reports(d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.1)) == [("r1", "done")]


# ---------------------------------------------------------------------------- P's record


def _bye_of(actions: list[Any]) -> Notification:
    (bye,) = [n for a in actions if (n := _note(a.message)).kind is NotificationKind.GOODBYE]
    return bye


def test_p_names_in_its_goodbye_the_requests_whose_write_completed() -> None:
    core = _loaded_core()
    for n in (1, 2, 3):
        reg = _registration(request_id=f"d-{n}", match_key=f"x-{n}", block_ids=((n,),))
        core.notification("D-agent", _note(wire.encode_push_reg(reg)), 100.0)
        actions = core.finished(f"x-{n}", f"p-{n}", ((5 + n,),), "", 100.0)
        (post,) = [a for a in actions if isinstance(a, Post)]
        assert core.confirm_post(post.key, post.dst, 100.0)
        core.posted(post.key, post.dst, [f"h{n}"], 64, 100.0)
    core.write_settled("x-1", 0, "h1", True, 100.1)
    core.write_settled("x-2", 0, "h2", False, 100.1, "NIXL_ERR_BACKEND")  # failed: no DONE
    core.write_settled("x-3", 0, "h3", True, 100.1)
    core.shutdown("closing", 100.2)
    bye = _bye_of(core.goodbye(100.2))
    assert sorted(bye.delivered) == ["d-1", "d-3"] and bye.unsettled


def test_a_goodbye_names_the_newest_ids_within_its_size_bound() -> None:
    ids = [f"{n:04d}-" + "x" * 995 for n in range(200)]  # 1000 chars each: 200 kB in all
    bye = _note(wire.encode_goodbye(P0, "inc", False, delivered=ids))
    assert len(bye.delivered) == wire.MAX_GOODBYE_ID_CHARS // 1000
    assert list(bye.delivered) == ids[-len(bye.delivered) :]  # the newest, in order
