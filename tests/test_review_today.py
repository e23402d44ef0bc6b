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
    return RequestMetadata(request_id=rid, block_ids=((int(rid[1:]),),), params=TransferParams.from_dict(params))


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


@pytest.mark.xfail(
    strict=True,
    reason=(
        "finding 1: a whole-engine fence D issues for ANOTHER request (DecodeCore._await_fence, "
        "here r1's WRITE ended unsettled) cuts P's connection; P now drops r2's registration "
        "(_rank_gone keep_unposted, change 4) and waits for D to register it again, but only "
        "_agents_exited re-registers: D's heartbeats name k2 and renew P's lease, P answers "
        "neither want nor unknown, and r2 hangs until D's watchdog (on 578c54a P failed k2 and "
        "D's next heartbeat ended r2)"
    ),
)
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
