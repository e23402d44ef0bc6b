"""Adversarial review of the 2026-12-02 protocol changes (578c54a..fe0fdca), by review.

The cores are driven by hand (no transport, an injected clock) through a two-core harness,
:class:`_Pair`: one D rank (TP1) and one P rank (TP1), messages delivered in order, D's fences
confirmed at once. ``_Pair.cut`` models what the changes themselves assume (test_fence_cut_live_
stage.py): over TCP, D's fence of a P engine shuts every connection from P's host, so P's next
send to D raises (``PrefillCore.unreachable``) until P handshakes with D's rank afresh.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, DropPeer, Fence, Post, ProbeExit, Release, Report, Send
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.producers import destinations
from kvpush.core.types import Notification, RankKey, ReadSpec, RequestMetadata, TransferParams

P0 = RankKey(0, 0)
A0 = "P-prefill-pp0-tp0"
D_AGENT = "D-decode-pp0-tp0"
HB = 0.25
TIMEOUT = 12.0


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _meta(rid: str, key: str) -> RequestMetadata:
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(
        request_id=rid, block_ids=((int(rid[1:]),),), params=TransferParams.from_dict(params)
    )


def _info(abortable: bool = True, incarnation: str = "p1") -> ProducerInfo:
    return ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={P0: A0},
        incarnations={A0: incarnation},
        write_deadline_s=1.0,
        writes_abortable=abortable,
        processes={A0: {"host": "h", "pid": 10}},
    )


class _Pair:
    """D (TP1) and P (TP1) wired together. Messages go in order; a WRITE P posts completes (or
    fails, for keys in ``failing``) at once and its DONE follows."""

    def __init__(self, abortable: bool = True) -> None:
        self.abortable = abortable
        self.t = 0.0
        self.d = DecodeCore(
            DecodeSettings(
                engine_id="D",
                incarnation="d1",
                tp_rank=0,
                tp_size=1,
                host="d.example",
                port=5700,
                heartbeat_interval_s=HB,
                fresh_s=0.5,
                peer_silence_s=3.0,
                hello_timeout_s=1.0,
                request_timeout_s=TIMEOUT,
            )
        )
        self.p = PrefillCore(
            PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1, lease_s=3.0),
            plan=lambda blocks, reg: [
                ReadSpec(dst_tp_rank=r, local_block_ids=blocks, remote_block_ids=reg.block_ids)
                for r in destinations(0, 1, reg.decode_tp_size)
            ],
        )
        self.cut = False
        """D's fence shut P's connection: P's next send to D raises."""
        self.failing: set[str] = set()
        self.d_reports: list[Report] = []
        self.p_reports: list[Report] = []
        self.released: list[str] = []
        self.to_p: list[bytes] = []
        self.to_d: list[bytes] = []
        self.handle = 0
        self.fences = 0

    # D's side --------------------------------------------------------------------------
    def run_d(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                assert a.agent == A0
                self.to_p.append(a.message)
            elif isinstance(a, Connect):
                self.run_d(self.d.connected("P", _info(self.abortable), "", self.t))
            elif isinstance(a, Fence):
                self.fences += 1
                self.cut = True
                self.run_d(self.d.fenced(a.fence_id, self.t))
            elif isinstance(a, Report):
                self.d_reports.append(a)
            elif isinstance(a, Release):
                self.released.append(a.request_id)
            elif isinstance(a, ProbeExit):
                pass  # every process runs

    # P's side --------------------------------------------------------------------------
    def run_p(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                if self.cut:
                    self.run_p(self.p.unreachable(a.agent, "NIXL_ERR_REMOTE_DISCONNECT", self.t))
                else:
                    self.to_d.append(a.message)
            elif isinstance(a, Connect):
                self.cut = False  # P loads D's rank afresh: a new connection
                self.run_p(self.p.connected("D", 0, D_AGENT, "d1", 1, "", self.t))
            elif isinstance(a, Post):
                self.post(a)
            elif isinstance(a, Report):
                self.p_reports.append(a)

    def post(self, post: Post) -> None:
        if not self.p.confirm_post(post.key, post.dst, self.t):
            self.run_p(self.p.refresh(post.key, post.dst, self.t))
            return
        self.handle += 1
        h = f"h{self.handle}"
        self.p.posted(post.key, post.dst, [h], 1, self.t)
        ok = post.key not in self.failing
        if ok:
            self.to_d.append(wire.encode_done(post.registration.request_id, P0, 1, None, "p1"))
        self.run_p(self.p.write_settled(post.key, post.dst, h, ok, self.t))

    # both --------------------------------------------------------------------------------
    def deliver(self) -> None:
        for _ in range(100):
            if not self.to_p and not self.to_d:
                return
            to_p, self.to_p = self.to_p, []
            for m in to_p:
                self.run_p(self.p.notification(D_AGENT, _note(m), self.t))
            to_d, self.to_d = self.to_d, []
            for m in to_d:
                self.run_d(self.d.notification(A0, _note(m), self.t))
        raise AssertionError("messages did not settle")

    def tick(self, dt: float = HB / 5) -> None:
        self.t = round(self.t + dt, 6)
        self.run_d(self.d.handle_timer(self.t))
        self.run_p(self.p.handle_timer(self.t))
        self.deliver()

    def d_report(self, rid: str) -> Report | None:
        return next((r for r in self.d_reports if r.request_id == rid), None)


def _two_registered(abortable: bool = True) -> _Pair:
    """r1 (k1) and r2 (k2) registered with P; P finished k1's prefill, not k2's."""
    pair = _Pair(abortable)
    pair.run_d(pair.d.add(_meta("r1", "k1"), 0.0))
    pair.run_d(pair.d.add(_meta("r2", "k2"), 0.0))
    pair.deliver()
    assert pair.d.stats["push_regs_sent"] == 2, pair.d.stats
    return pair


# Finding 1 (on fe0fdca; fixed since in 4ddb0ef, P asks for a cut registration again): a
# whole-engine fence D issues for ANOTHER request (DecodeCore._await_fence; here r1's WRITE
# ended unsettled) cuts P's connection; P dropped r2's registration (_rank_gone keep_unposted,
# change 4) and waited for D to register it again, but only _agents_exited re-registers: D's
# heartbeats named k2 and renewed P's lease, P answered neither want nor unknown, and r2 hung
# until D's watchdog (on 578c54a P failed k2 and D's next heartbeat ended r2 at once).
@pytest.mark.parametrize("abortable", [True, False], ids=["nixl", "kernel-copies"])
def test_a_registration_cut_by_a_fence_for_another_request_is_not_left_to_the_watchdog(
    abortable: bool,
) -> None:
    pair = _two_registered(abortable)
    pair.failing.add("k1")  # k1's WRITE fails: P says FAIL unsettled, D fences the engine
    pair.t = 0.1
    pair.run_p(pair.p.finished("k1", "p-k1", ((0,),), "D", pair.t))
    pair.deliver()
    assert pair.d_report("r1") is not None and pair.fences == 1, (pair.d_reports, pair.fences)
    while pair.t < TIMEOUT / 2 and pair.d_report("r2") is None:
        pair.tick()
        if pair.t == 1.0:
            pair.run_p(pair.p.finished("k2", "p-k2", ((1,),), "D", pair.t))
            pair.deliver()
    assert pair.d_report("r2") is not None, (
        f"r2 still waits at t={pair.t} (watchdog {TIMEOUT}); P holds k2: "
        f"{pair.p.pending_requests()}, P stats {pair.p.stats['registrations_cut']} cut"
    )


A1 = "P-prefill-pp1-tp0"
P1 = RankKey(1, 0)


def _pp2(stage0: str) -> ProducerInfo:
    return ProducerInfo(
        prefill_pp=2,
        prefill_tp=1,
        agents={P0: A0, P1: A1},
        incarnations={A0: stage0, A1: "b1"},
        write_deadline_s=1.0,
        writes_abortable=False,
        processes={A0: {"host": "h", "pid": 10}, A1: {"host": "h", "pid": 11}},
    )


# Finding 1b (the same; fixed in 4ddb0ef), the commit's own scenario with kernel copies: stage
# 0 exits, D fences the engine whole (_agents_exited) and registers only stage 0 again (a live
# kernel-copy stage is not), while live stage 1 dropped r1's registration when the fence broke
# its endpoint: nobody registered stage 1 again and r1 waited for D's watchdog
# (test_fence_cut_live_stage's kernel-copies case hands D stage 1's DONE without asking
# whether stage 1 could still write it).
def test_a_live_kernel_copy_stage_whose_registration_the_fence_cut_is_asked_again() -> None:
    from kvpush.core.decode_core import ENGINE_PROBE

    d = DecodeCore(
        DecodeSettings(
            engine_id="D",
            incarnation="d1",
            tp_rank=0,
            tp_size=1,
            host="d.example",
            port=5700,
            heartbeat_interval_s=HB,
            fresh_s=0.5,
            peer_silence_s=3.0,
            request_timeout_s=TIMEOUT,
        )
    )
    p1 = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="b1", rank=P1, tp_size=1, lease_s=3.0),
        plan=lambda blocks, reg: [
            ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)
        ],
    )
    reports: list[Report] = []
    to_p1: list[bytes] = []
    stage0: list[bytes] = []

    def run_d(actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send) and a.agent == A1:
                to_p1.append(a.message)
            elif isinstance(a, Send) and _note(a.message).kind.value == "heartbeat":
                stage0.append(a.message)  # stage 0's new process answers its heartbeats
            elif isinstance(a, Report):
                reports.append(a)

    def run_p1(actions: list[Any], t: float) -> None:
        for a in actions:
            if isinstance(a, Connect):
                run_p1(p1.connected("D", 0, D_AGENT, "d1", 1, "", t), t)
            elif isinstance(a, Send):
                run_d(d.notification(A1, _note(a.message), t))
            elif isinstance(a, Post):
                assert p1.confirm_post(a.key, a.dst, t), a
                p1.posted(a.key, a.dst, ["h"], 1, t, abortable=False)
                run_d(
                    d.notification(
                        A1, _note(wire.encode_done(a.registration.request_id, P1, 1, None, "b1")), t
                    )
                )
                run_p1(p1.write_settled(a.key, a.dst, "h", True, t), t)

    def deliver(t: float) -> None:
        while to_p1:
            run_p1(p1.notification(D_AGENT, _note(to_p1.pop(0)), t), t)

    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", _pp2("a1"), "", 0.0)
    d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 0.0, "a1")), 0.0)
    run_d(d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 0.0, "b1")), 0.0))
    deliver(0.0)  # stage 1 holds r1's registration (its prefill not finished yet)
    assert p1.state_sizes()["requests"] == 1
    out = d.producers_exited(ENGINE_PROBE + "P", [A0], 1.0)  # stage 0 killed
    (fence,) = [a for a in out if isinstance(a, Fence)]
    d.fenced(fence.fence_id, 1.1)
    run_p1(p1.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 1.1), 1.1)  # the fence cut stage 1
    run_d(d.connected("P", _pp2("a2"), "", 1.2))  # HELLOs; stage 0's new process answers
    run_d(d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, "a2")), 1.2))
    deliver(1.2)
    assert d.stats["reregistered"] == 1, d.stats  # stage 0 only (kernel copies)
    run_d(d.notification(A0, _note(wire.encode_done("r1", P0, 1, None, "a2")), 1.25))
    run_p1(p1.finished("k1", "p-k1", ((0,),), "D", 1.3), 1.3)
    t = 1.3
    while t < TIMEOUT / 2 and not reports:
        t = round(t + HB / 5, 6)
        run_d(d.handle_timer(t))
        run_p1(p1.handle_timer(t), t)
        deliver(t)
        while stage0:
            stage0.pop()
            run_d(d.notification(A0, _note(wire.encode_heartbeat_answer(P0, t, "a2")), t))
    assert [(r.request_id, r.outcome) for r in reports] == [("r1", "done")], (
        t,
        reports,
        p1.pending_requests(),
    )


# ---------------------------------------------------------------- what held (no finding)


def _hello(rank: int = 0, incarnation: str = "d1") -> Notification:
    from kvpush.core.types import PushRegistration

    reg = PushRegistration(
        request_id="(hello)",
        match_key="(none)",
        decode_engine_id="D",
        decode_host="d.example",
        decode_port=5700,
        decode_tp_size=1,
        block_ids=(),
        remote_engine_id="(any)",
        decode_tp_rank=rank,
        decode_incarnation=incarnation,
    )
    return _note(wire.encode_hello(reg, rank))


def test_a_flood_of_hellos_at_a_failing_address_handshakes_at_most_once_per_backoff_step() -> None:
    """Change 3: a HELLO skips the address backoff at most once per ``retry_backoff_s``: D's
    HELLOs every 10 ms for 20 s at an address whose handshakes all fail start at most one
    handshake per second (plus the backoff's own), never one per HELLO."""
    p = PrefillCore(  # the default lease: the backoff grows to 7.5 s
        PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1),
        plan=lambda blocks, reg: [],
    )
    connects = 0
    t = 0.0
    while t < 20.0:
        t = round(t + 0.01, 6)
        p.handle_timer(t)
        for a in p.notification(D_AGENT, _hello(), t):
            if isinstance(a, Connect):
                connects += 1
                p.connected("D", 0, "", "", 0, "side channel unreachable: timed out", t)
    # One skip per second, plus the backoff's own expiries (1, 2, 4, 7.5, 7.5 s ...).
    assert 10 <= connects <= 20 / p.s.retry_backoff_s + 6, connects


def test_the_deferred_exit_verdict_leaves_an_engine_that_loaded_a_new_process_alone() -> None:
    """Change 2: a send to A0 raised and its process had exited; before the verdict (a
    heartbeat interval later) D handshook afresh and loaded A0's new process. The verdict does
    not fence the new connection nor register anything again."""
    from kvpush.core.decode_core import ENGINE_PROBE

    pair = _Pair()
    d = pair.d
    pair.run_d(d.add(_meta("r1", "k1"), 0.0))
    pair.deliver()
    out = d.unreachable(A0, "NIXL_ERR_REMOTE_DISCONNECT", 0.1)
    (probe,) = [a for a in out if isinstance(a, ProbeExit)]
    out = d.producers_exited(probe.request_id, [A0], 0.1)
    assert not [a for a in out if isinstance(a, Fence)], out  # deferred
    # Meanwhile a heartbeat's probe sees the exit: fenced and handshaken afresh at once.
    out = d.producers_exited(ENGINE_PROBE + "P", [A0], 0.15)
    fences = [a for a in out if isinstance(a, Fence)]
    assert len(fences) == 1, out
    d.fenced(fences[0].fence_id, 0.15)
    out = d.connected("P", _info(incarnation="p2"), "", 0.16)
    out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 0.16, "p2")), 0.16)
    later = d.handle_timer(0.1 + HB + 0.01)
    assert not [a for a in later if isinstance(a, (Fence, DropPeer, Connect))], later
    assert d.stats["reregistered"] == 1 and d.stats["fences"] == 1, d.stats


def test_a_kept_registration_registered_again_with_a_pre_cut_grant_is_not_written() -> None:
    """Change 4: P dropped r2's registration when D's fence cut its endpoint. The same PUSH_REG
    again (a duplicate, or D's renewal sent before P reloaded it), carrying a grant issued
    before P loaded D's rank afresh, is not posted: P asks for a fresh grant first."""
    from test_fence_cut_live_stage import _loaded_with_r1, _reg

    p2 = _loaded_with_r1()
    cut = p2.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 0.2)
    assert not [a for a in cut if isinstance(a, Report)] and p2.stats["registrations_cut"] == 1, cut
    out = p2.notification(D_AGENT, _note(_reg(0.1)), 0.3)  # grant 0.1: before the reload
    if any(isinstance(a, Connect) for a in out):
        out += p2.connected("D", 0, D_AGENT, "d1", 1, "", 0.3)
    out += p2.finished("k1", "p-k1", ((0,),), "D", 0.35)
    posts = [a for a in out if isinstance(a, Post)]
    assert posts and all(not p2.confirm_post(a.key, a.dst, 0.35) for a in posts), out


def test_a_kept_registration_whose_d_request_was_cancelled_meanwhile_is_never_written() -> None:
    """Change 4: P dropped r1's registration at the cut; D cancelled r1 while P had not loaded
    its rank again (the CANCEL reached P before anything else). A late copy of r1's PUSH_REG
    is refused, P never posts, and the key fails at its lease."""
    from test_fence_cut_live_stage import _loaded_with_r1, _reg

    from kvpush.core.types import PushRegistration

    p = _loaded_with_r1()
    p.unreachable(D_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 0.2)
    reg = wire.decode_notification(_reg(0.0)).registration  # type: ignore[union-attr]
    assert isinstance(reg, PushRegistration)
    cancel = wire.encode_cancel("k1", reg, 0)
    out = p.notification(D_AGENT, _note(cancel), 0.3)
    if any(isinstance(a, Connect) for a in out):
        out += p.connected("D", 0, D_AGENT, "d1", 1, "", 0.3)
    out += p.notification(D_AGENT, _note(_reg(0.3)), 0.4)  # late, even with a fresh grant
    out += p.finished("k1", "p-k1", ((0,),), "D", 0.5)
    t = 0.5
    while t < 5.0:
        t = round(t + 0.25, 6)
        out += p.handle_timer(t)
    assert not [a for a in out if isinstance(a, Post)], out
    reports = [a for a in out if isinstance(a, Report)]
    assert [(r.key, r.outcome) for r in reports] == [("k1", "failed")], reports


# ---------------------------------------------------------------- the restart oracle, with cuts


def _cut_cluster() -> Any:
    """The restart oracle with what the changes assume of a fence (over TCP; modelled on one
    host too): D's fence of a P engine breaks the connections of each of its live P processes
    into that D rank, so P's sends (and posts) there raise until P loads the rank afresh."""
    from test_core_properties import PProc
    from test_core_restart_liveness import RestartCluster

    class CutRestartCluster(RestartCluster):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.cuts: set[tuple[str, str, str, str]] = set()

        def _run_d(self, d: Any, actions: list[Any]) -> None:
            for a in actions:
                if isinstance(a, Fence):
                    for p in self.live_p():
                        if p.agent in a.agents:
                            self.cuts.add((p.agent, p.inc, d.agent, d.inc))
            super()._run_d(d, actions)

        def _cut(self, p: Any, agent: str) -> bool:
            inc = self._loaded_inc(p, agent)
            return inc is not None and (p.agent, p.inc, agent, inc) in self.cuts

        def _send(self, src: Any, agent: str, data: bytes) -> None:
            if isinstance(src, PProc) and self._cut(src, agent):
                self._run_p(src, src.core.unreachable(agent, "NIXL_ERR_REMOTE_DISCONNECT", self.now(src)))
                return
            super()._send(src, agent, data)

        def _post(self, p: Any, post: Post, refuse: bool, chunks: int) -> None:
            target = p.registry.get(post.engine_id, {}).get(post.dst)
            if target is not None and (p.agent, p.inc, *target) in self.cuts:
                now = self.now(p)
                if not p.core.confirm_post(post.key, post.dst, now):
                    self._run_p(p, p.core.refresh(post.key, post.dst, now))
                    return
                why = "NIXL_ERR_REMOTE_DISCONNECT"
                self._run_p(p, p.core.post_failed(post.key, post.dst, why, now, maybe_sent=False))
                self._run_p(p, p.core.unreachable(target[0], why, now))
                return
            super()._post(p, post, refuse, chunks)

        def _p_handshake(self, p: Any, action: Connect, ok: bool) -> None:
            for rank in action.ranks:  # loaded afresh: a new connection (before P sends on it)
                pub = self.published_d.get(rank.tp_rank)
                if ok and pub is not None and rank.tp_rank not in p.registry.get(action.engine_id, {}):
                    self.cuts.discard((p.agent, p.inc, pub.agent, pub.inc))
            super()._p_handshake(p, action, ok)

    return CutRestartCluster


def test_restart_oracle_with_fence_cuts() -> None:
    """A search (derandomized, KVPUSH_REVIEW_EXAMPLES runs, default 60) of the restart oracle
    with fence cuts modelled; KVPUSH_CORE_RANDOM=1 for fresh randomness."""
    import os

    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        _cut_cluster(),
        settings=settings(
            max_examples=int(os.environ.get("KVPUSH_REVIEW_EXAMPLES", "60")),
            stateful_step_count=80,
            deadline=None,
            derandomize=not os.environ.get("KVPUSH_CORE_RANDOM"),
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        ),
    )
