"""A false-failure oracle for the protocol cores: only benign nondeterminism, and nothing may fail.

:class:`BenignCluster` drives the same P and D cores, through the same harness, as
``test_core_properties.CoreCluster``, but without faults: every notification is delivered
(in any order, each within ``MSG_MAX_S``), every handshake and post succeeds, every WRITE lands
(at any time up to ``WRITE_MAX_S``, well within P's WRITE deadline) and is polled within
``POLL_MAX_S``; each process runs its timers on its own schedule (at most ``TICK_MAX_S`` late);
the D ranks add a request and the P ranks finish its prefill at different times (all within
``REQ_SKEW_S`` of the first); the clock moves in small steps. No bound of either core (heartbeat
silence, HELLO, freshness, lease, WRITE deadline, watchdog) can legitimately expire, so the
oracle is strict: every request ends ``done`` on every D rank (with every (layer, P TP rank)
piece written whole, checked by the harness) and ``sent`` on every P rank that finished it.

One benign event may end requests: a P worker closing gracefully (``shutdown``, then, once
nothing of it is in flight, ``goodbye``; optionally re-created under its name, in its process or
a new one). A request the closing worker had not posted in full at its ``shutdown`` may fail,
and so may one created while a worker closes (until every D rank read its BYE) or is closed and
not replaced; nothing it had posted in full may.

Findings (each kept as a failing test below, with the machine's or a hand-made sequence and a
core-level one): a key used again after it was done is never pushed; a send to a closed
worker's agent before its BYE is read fails what it wrote; a stage finishing late after the
other stage's BYE cannot get a fresh grant; two producers answering one heartbeat round
"unknown" fail a request whose PUSH_REGs are on their way; a heartbeat answer naming a key
failed before its FAIL arrives fences the engine's connection, cutting another request's WRITE.

The safety checks of ``CoreCluster`` (bytes land only in offered blocks, done only once every
piece landed, one report per request, drain to empty state) run here too.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from test_core_properties import (
    IDX,
    POOL_BLOCKS,
    TOPOLOGIES,
    WRITE_DEADLINE_S,
    CoreCluster,
    DProc,
    PProc,
    Request,
    Violation,
    _machine_settings,
)
from test_goodbye_overtakes_done import A0, A1, P0, P1, _bye, _note, _registered, _released, _reports

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Fence, Post, Report, Send
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.prefill_core import PrefillCore, PrefillSettings, _Dest
from kvpush.core.types import Notification, RankKey, ReadSpec, RequestMetadata, TransferParams

MSG_MAX_S = 1.0
"""A notification is delivered at most this long after it was sent."""
HS_MAX_S = 1.0
"""A handshake ends (successfully) at most this long after it was asked for."""
POST_MAX_S = 0.5
"""P's driver runs a post at most this long after the core asked for it."""
WRITE_MAX_S = 6.0
"""A WRITE lands at most this long after it was posted ..."""
POLL_MAX_S = 1.0
"""... and P's driver sees it complete at most this long later."""
TICK_MAX_S = 0.5
"""A process runs its timers at most this late."""
REQ_SKEW_S = 12.0
"""Every D rank adds a request, and every P rank finishes it, within this of its creation: past
the freshness window (10 s; P asks D for a fresh grant), below P's lease (30 s) and D's silence
bound (20 s)."""
ACTIVE_S = 40.0
"""New requests are made only until then (the run stays far below every 120 s bound)."""
assert WRITE_MAX_S + POLL_MAX_S + POST_MAX_S + TICK_MAX_S < WRITE_DEADLINE_S
STEPS_S = [0.001, 0.05, 0.2, 0.5, 0.5, 2.0]
"""Clock steps. A step longer than a bound first delivers (lands, polls) what it would make overdue."""
TOPOLOGY = st.sampled_from(
    [(*t, mla) for t in [*TOPOLOGIES, (1, 1, 2)] for mla in (False, True) if not mla or t[1] != t[2]]
)
"""(P PP, P TP, D TP, MLA): MLA replicates the latent, so each P rank writes whole blocks."""
MAX_LIVE = 4
MAX_CLOSES = 1
MAX_FLUSH_ROUNDS = 500


class BenignCluster(CoreCluster):
    """P (PP x TP) and D (TP) cores with benign reordering, delays and staggered ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.mla = False
        self.born: dict[int, tuple[Any, float]] = {}
        """id(item) -> (item, when it appeared): messages, handshakes, posts, WRITEs."""
        self.landed_at: dict[str, float] = {}
        self.created: dict[str, float] = {}
        """Request id -> when it was made (its adds and finishes are due within REQ_SKEW_S)."""
        self.exempt: dict[str, str] = {}
        """Request id -> why it may fail (a graceful close rejected it)."""
        self.outcome: dict[tuple[str, str], str] = {}
        """(P incarnation, P request id) -> P's report."""
        self.closing: dict[str, tuple[PProc, str]] = {}
        """P incarnation -> (the worker shut down, how it is re-created: "", "same", "new")."""
        self.ticked: dict[int, float] = {}
        self.closes = 0
        self.byes: list[Any] = []
        """The BYEs the closed workers sent (a request created while one is unread may fail)."""

    # ------------------------------------------------------------------ inherited rules off
    # (plain methods shadow CoreCluster's rules; the harness helpers stay)

    def cancel(self, *a: Any, **k: Any) -> None:
        raise AssertionError("no cancels here")

    def fault(self, *a: Any, **k: Any) -> None:
        raise AssertionError("no faults here")

    def network(self, *a: Any, **k: Any) -> None:
        raise AssertionError("nothing is dropped or duplicated here")

    def new_request(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use make_request")

    def retry(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use retry_done")

    def add_on_another_rank(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use add_late")

    def prefill_finished(self, i: int, j: int, one_rank: bool, bind: bool, boom: bool = False) -> None:
        assert not boom
        super().prefill_finished(i=i, j=j, one_rank=one_rank, bind=bind, boom=False)

    def run_posts(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use post")

    def write_completes(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use land")

    def poll(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use poll_p")

    def delay_message(self, *a: Any, **k: Any) -> None:
        raise AssertionError("every message may be delayed: deliver picks any")

    def handshake(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use handshake_ok")

    def advance_clock(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use tick")

    def confirm_fence(self, *a: Any, **k: Any) -> None:
        raise AssertionError("no fence is expected; drained by the flush")

    def pump(self, *a: Any, **k: Any) -> None:
        raise AssertionError("use flush")

    def start(self, topology: tuple[int, int, int]) -> None:
        super().start(topology=topology)

    # ------------------------------------------------------------------ set-up

    @initialize(
        topology=TOPOLOGY,
        packed=st.booleans(),
        d_first=st.integers(0, 3),
        p_first=st.integers(0, 3),
        hb=st.sampled_from([5.0, 2.5]),
    )
    def begin(
        self, topology: tuple[int, int, int, bool], packed: bool, d_first: int, p_first: int, hb: float = 5.0
    ) -> None:
        """The engines start; the first request comes at once (D handshakes for it). ``hb``:
        D's heartbeat interval (2.5 s: stamps more often, still above twice ``MSG_MAX_S``)."""
        *sizes, self.mla = topology
        super().start(topology=tuple(sizes))  # type: ignore[arg-type]
        for d in self.d_procs:
            d.core.s = attrs.evolve(d.core.s, heartbeat_interval_s=hb)
        self._stamp()
        self.make_request(
            nblocks=1, packed=packed, sizes="right", d_first=d_first, p_first=p_first, bind=True
        )

    def _part(self, p: PProc) -> tuple[int, int]:
        return (0, 1) if self.mla else super()._part(p)

    # ------------------------------------------------------------------ bookkeeping

    def _items(self) -> list[Any]:
        posts = [post for p in self.p_procs for post in p.posts]
        pending = [w for w in self.writes.values() if w.state == "pending"]
        return [*self.net, *self.handshakes, *posts, *pending]

    def _stamp(self) -> None:
        for item in self._items():
            entry = self.born.get(id(item))
            if entry is None or entry[0] is not item:
                self.born[id(item)] = (item, self.t)

    def _age(self, item: Any, at: float) -> float:
        entry = self.born.get(id(item))
        if entry is None or entry[0] is not item:  # appeared during this step
            entry = self.born[id(item)] = (item, self.t)
        return at - entry[1]

    def _p_report(self, p: PProc, report: Report) -> None:
        super()._p_report(p, report)
        self.outcome[(p.inc, report.request_id)] = report.outcome

    def _land(self, w: Any, ok: bool) -> None:
        assert ok, "benign: every WRITE lands"
        super()._land(w, ok)
        self.landed_at[w.handle] = self.t

    def _serving(self) -> list[PProc]:
        """The live P workers not closing."""
        return [p for p in self.live_p() if p.inc not in self.closing]

    def _ranks_served(self) -> bool:
        ranks = {p.rank for p in self._serving()}
        return len(ranks) == self.p_pp * self.p_tp

    def _live_requests(self) -> list[Request]:
        return [r for r in self.requests if not self._ended(r)]

    def _ended(self, req: Request) -> bool:
        return all(req.rid in d.requests and d.requests[req.rid].outcomes for d in self.live_d())

    # ------------------------------------------------------------------ the engines

    @precondition(lambda self: self.ready and self.t < ACTIVE_S)
    @rule(
        nblocks=st.integers(1, 3),
        packed=st.booleans(),
        sizes=st.sampled_from(["absent", "right"]),
        d_first=st.integers(0, 3),
        p_first=st.integers(0, 3),
        bind=st.booleans(),
    )
    def make_request(
        self, nblocks: int, packed: bool, sizes: str, d_first: int, p_first: int, bind: bool
    ) -> None:
        """A request: added on some D ranks (d_first: none, one, all) and finished on some P
        ranks now; the others follow within REQ_SKEW_S."""
        n = next(self.seq)
        req = Request(key=f"k{n}", rid=f"r{n}", seq=n, nblocks=nblocks, sizes=sizes, packed=packed)
        self._new(req, d_first, p_first, bind)

    def _new(self, req: Request, d_first: int, p_first: int, bind: bool) -> None:
        if len(self._live_requests()) >= MAX_LIVE or not self._room(req):
            return
        self.requests.append(req)
        self.created[req.rid] = self.t
        if not self._ranks_served():
            self.exempt[req.rid] = "created while a P worker was closed and not replaced"
        if self.closing or any(m in self.net for m in self.byes):
            # D may register it with the closing worker before it reads the BYE: the brief
            # protects what that worker posted before the close, not requests it never had
            self.exempt[req.rid] = "created while a P worker closed, its BYE unread"
        i = len(self.requests) - 1
        ps, ds = self._serving(), self.live_d()
        for p in ps[: [0, 1, 1, len(ps)][p_first]] if p_first % 2 == 0 else ():
            self._finish(p, i, bind)
        for d in ds[: [0, 1, len(ds), len(ds)][d_first]]:
            self._add(d, req)
        for p in ps[: [0, 1, 1, len(ps)][p_first]] if p_first % 2 else ():
            self._finish(p, i, bind)
        self._stamp()

    def _room(self, req: Request) -> bool:
        for d in self.live_d():
            owed = sum(r.nblocks for r in self.requests if r.rid not in d.requests)
            if len(d.free) - owed < req.nblocks:
                return False
        return True

    def _finish(self, p: PProc, i: int, bind: bool) -> None:
        req = self.requests[i]
        if f"p-{req.rid}" in p.prefills or req.seq < p.born:
            return
        p.finished[req.key] = f"p-{req.rid}"
        p.prefills[f"p-{req.rid}"] = req.key
        blocks = (tuple(range(req.nblocks)),)
        self._run_p(p, p.core.finished(req.key, f"p-{req.rid}", blocks, "D" if bind else "", self.now(p)))

    @precondition(lambda self: self.requests)
    @rule(i=IDX, j=IDX, bind=st.booleans())
    def finish_late(self, i: int, j: int, bind: bool) -> None:
        """One more P rank finishes a request's prefill."""
        req = self.requests[i % len(self.requests)]
        ps = [p for p in self._serving() if f"p-{req.rid}" not in p.prefills and req.seq > p.born]
        if ps:
            self._finish(ps[j % len(ps)], self.requests.index(req), bind)
        self._stamp()

    @precondition(lambda self: self.requests)
    @rule(i=IDX, j=IDX)
    def add_late(self, i: int, j: int) -> None:
        """One more D rank adds a request."""
        req = self.requests[i % len(self.requests)]
        ds = [d for d in self.live_d() if req.rid not in d.requests]
        if ds:
            self._add(ds[j % len(ds)], req)
        self._stamp()

    def _add(self, d: DProc, req: Request) -> None:
        if len(d.free) < req.nblocks:
            raise Violation(f"harness: no room on {d.agent} for {req.rid}")
        super()._add(d, req)

    @precondition(lambda self: self.requests and self.t < ACTIVE_S)
    @rule(i=IDX, finish_first=st.booleans(), bind=st.booleans())
    def retry_done(self, i: int, finish_first: bool, bind: bool) -> None:
        """The engines use a match key again after its request was done everywhere: on every D
        rank, and every P rank's prefill of it reported (sent); one request of a key at a time."""
        old = self.requests[i % len(self.requests)]
        pid = f"p-{old.rid}"
        if (
            old is not [r for r in self.requests if r.key == old.key][-1]
            or not all(
                old.rid in d.requests and d.requests[old.rid].outcomes == ["done"] for d in self.live_d()
            )
            or any(self.outcome.get((p.inc, pid)) != "sent" for p in self._serving() if old.seq > p.born)
        ):
            return
        n = next(self.seq)
        req = attrs.evolve(old, rid=f"{old.rid.split('#')[0]}#{n}", seq=n)
        self._new(req, d_first=3, p_first=3 if finish_first else 2, bind=bind)

    # ------------------------------------------------------------------ drivers and network

    @precondition(lambda self: self.net)
    @rule(i=IDX)
    def deliver(self, i: int) -> None:
        """Any notification in flight arrives (any order)."""
        msg = self.net.pop(i % len(self.net))
        self._deliver(msg)
        self._stamp()

    @precondition(lambda self: self.handshakes)
    @rule(i=IDX)
    def handshake_ok(self, i: int) -> None:
        self._handshake(self.handshakes.pop(i % len(self.handshakes)), True)
        self._stamp()

    @precondition(lambda self: any(p.posts for p in self.live_p()))
    @rule(j=IDX, chunks=st.integers(1, 2))
    def post(self, j: int, chunks: int) -> None:
        ps = [p for p in self.live_p() if p.posts]
        p = ps[j % len(ps)]
        post = p.posts.pop(0)
        self._post(p, post, False, chunks)
        self._stamp()

    @precondition(lambda self: any(w.state == "pending" for w in self.writes.values()))
    @rule(i=IDX)
    def land(self, i: int) -> None:
        pending = [w for w in self.writes.values() if w.state == "pending"]
        self._land(pending[i % len(pending)], True)
        self._stamp()

    @precondition(lambda self: self.live_p())
    @rule(j=IDX)
    def poll_p(self, j: int) -> None:
        p = self.live_p()[j % len(self.live_p())]
        self._poll(p)
        self._stamp()

    @precondition(lambda self: self.ready and self.closes < MAX_CLOSES and self.writes)
    @rule(j=IDX, then=st.sampled_from(["same", "new", ""]), now=st.integers(0, 2))
    def close_worker(self, j: int, then: str, now: int) -> None:
        """A P worker that posted WRITEs closes gracefully: ``shutdown`` now, ``goodbye`` once
        nothing of it is in flight (its close() waits for that); then it is re-created (in the
        same process or a new one) or not."""
        ps = [p for p in self._serving() if any(w.p is p for w in self.writes.values())]
        if not ps or now:
            return
        p = ps[j % len(ps)]
        self.closes += 1
        # Not re-created, the engine lacks a rank for good: D cannot handshake with it again,
        # so a request the other ranks had not posted in full (a grant to renew) may fail too.
        for req in self.requests:
            for q in [p] if then else self._serving():
                if not self._posted(q, req):
                    why = f"{q.agent} had not posted it in full when {p.agent} closed"
                    self.exempt.setdefault(req.rid, why)
        self.closing[p.inc] = (p, then)
        self._run_p(p, p.core.shutdown("the prefill worker closed", self.now(p)))
        self._stamp()
        self._goodbyes()

    def _posted(self, p: PProc, req: Request) -> bool:
        """Has ``p`` posted every WRITE of ``req`` (or reported it sent)?"""
        pid = f"p-{req.rid}"
        if self.outcome.get((p.inc, pid)) == "sent":
            return True
        state = p.core._requests.get(req.key)
        dests = state.dests if state is not None and state.request_id == pid else None
        return bool(dests) and all(dst.state in (_Dest.INFLIGHT, _Dest.DONE) for dst in dests.values())

    def _goodbyes(self) -> None:
        for inc, (p, then) in list(self.closing.items()):
            if not p.alive or p.posts or p.core.inflight_handles():
                continue
            before = list(self.net)
            self._run_p(p, p.core.goodbye(self.now(p)))
            self.byes += [m for m in self.net if all(m is not b for b in before)]
            p.alive = False
            del self.closing[inc]
            if then:
                process = p.process or p.inc if then == "same" else ""
                self.p_procs.append(self._new_p(p.rank, offset=p.offset + 0.25, process=process))
            self._stamp()

    # ------------------------------------------------------------------ time

    @precondition(lambda self: self.ready)
    @rule(dt=st.sampled_from(STEPS_S), lazy=st.sets(st.integers(0, 7), max_size=3))
    def tick(self, dt: float, lazy: set[int]) -> None:
        """Time passes: first everything the step would make overdue happens (in age order),
        then each process runs its timers, except ``lazy`` ones that ran them lately."""
        self._overdue(self.t + dt)
        self.t += dt
        procs = [*self.live_p(), *self.live_d()]
        for n, proc in enumerate(procs):
            last = self.ticked.get(id(proc), 0.0)
            if n in lazy and self.t - last <= TICK_MAX_S:
                continue
            self.ticked[id(proc)] = self.t
            if isinstance(proc, PProc):
                self._run_p(proc, proc.core.handle_timer(self.now(proc)))
            else:
                self._run_d(proc, proc.core.handle_timer(self.now(proc)))
        self._stamp()
        self._goodbyes()

    def _overdue(self, at: float) -> None:
        """Do (now, before the clock moves to ``at``) whatever would exceed its bound by then."""
        for _ in range(MAX_FLUSH_ROUNDS):
            self._stamp()
            self._goodbyes()
            progressed = False
            for req in list(self.requests):
                if at - self.created[req.rid] > REQ_SKEW_S:
                    progressed |= self._complete(req)
            for item in [h for h in self.handshakes if self._age(h, at) > HS_MAX_S]:
                self.handshakes.remove(item)
                self._handshake(item, True)
                progressed = True
            for p in self.live_p():
                for post in [x for x in p.posts if self._age(x, at) > POST_MAX_S]:
                    p.posts.remove(post)
                    self._post(p, post, False, 1)
                    progressed = True
            for msg in sorted(
                (m for m in self.net if self._age(m, at) > MSG_MAX_S), key=lambda m: self._age(m, at)
            ):
                if msg in self.net:
                    self.net.remove(msg)
                    self._deliver(msg)
                    progressed = True
            for w in [
                w for w in self.writes.values() if w.state == "pending" and self._age(w, at) > WRITE_MAX_S
            ]:
                self._land(w, True)
                progressed = True
            for p in self.live_p():
                late = [h for h in p.core.inflight_handles() if at - self.landed_at.get(h, at) > POLL_MAX_S]
                if late:
                    progressed |= self._poll(p)
            if not progressed:
                return
        raise Violation(f"livelock: traffic did not stop at t={self.t:.3f}s")

    def _complete(self, req: Request) -> bool:
        """Every D rank adds ``req`` and every serving P rank finishes it (if not yet)."""
        progressed = False
        i = self.requests.index(req)
        for d in self.live_d():
            if req.rid not in d.requests:
                self._add(d, req)
                progressed = True
        for p in self._serving():
            if f"p-{req.rid}" not in p.prefills and req.seq > p.born:
                self._finish(p, i, bind=False)
                progressed = True
        return progressed

    # ------------------------------------------------------------------ the oracle

    def teardown(self) -> None:
        if not self.ready:
            return
        # Benign to the end: small steps, everything within its bound, until every request ended.
        for _ in range(400):
            if all(self._ended(r) for r in self.requests) and not self.closing:
                break
            self._overdue(self.t + 1000.0)  # everything that is in flight or due happens now
            self.t += 0.25
            for proc in [*self.live_p(), *self.live_d()]:
                core_actions = proc.core.handle_timer(self.now(proc))
                if isinstance(proc, PProc):
                    self._run_p(proc, core_actions)
                else:
                    self._run_d(proc, core_actions)
            self._stamp()
            self._goodbyes()
        self._check_outcomes()
        super().teardown()  # the reliable drain past every bound; state empty
        self._check_outcomes()
        if os.environ.get("KVPUSH_BENIGN_STATS"):
            done = sum(1 for r in self.requests if r.rid not in self.exempt)
            print(
                f"STATS topo={self.p_pp},{self.p_tp},{self.d_tp},{self.mla} t={self.t:.1f} "
                f"requests={len(self.requests)} checked={done} exempt={len(self.exempt)} "
                f"writes={len(self.writes)} closes={sum(1 for p in self.p_procs if not p.alive)}"
            )

    def _check_outcomes(self) -> None:
        for req in self.requests:
            why = self.exempt.get(req.rid)
            if why:
                continue
            for d in self.live_d():
                mine = d.requests.get(req.rid)
                if mine is None:
                    raise Violation(f"harness: {req.rid} never added on {d.agent}")
                if mine.outcomes and mine.outcomes != ["done"]:
                    raise Violation(
                        f"false failure: D {d.agent} ended {req.rid} ({req.key}) {mine.outcomes} at "
                        f"t={self.t:.3f}s under benign conditions only (created at "
                        f"{self.created[req.rid]:.3f}s); D stats {d.core.stats}"
                    )
            for p in self.p_procs:
                pid = f"p-{req.rid}"
                got = self.outcome.get((p.inc, pid))
                if got not in (None, "sent"):
                    raise Violation(
                        f"false failure: P {p.agent} ({p.inc}) reported {req.rid} ({req.key}) {got} "
                        f"at t={self.t:.3f}s: {p.reports.get(req.key)}"
                    )


EXAMPLES = int(os.environ.get("KVPUSH_CORE_EXAMPLES", "300"))
BenignCluster.TestCase.settings = _machine_settings(EXAMPLES)
TestBenignCluster = pytest.mark.timeout(600)(BenignCluster.TestCase)


def test_the_machine_has_only_benign_rules() -> None:
    state = BenignCluster.setup_state()
    assert [r.function.__name__ for r in state.initializers] == ["begin"]
    names = sorted(r.function.__name__ for r in state.rules)
    assert names == [
        "add_late",
        "close_worker",
        "deliver",
        "finish_late",
        "handshake_ok",
        "land",
        "make_request",
        "poll_p",
        "post",
        "retry_done",
        "tick",
    ], names
    assert POOL_BLOCKS >= MAX_LIVE * 3


# ------------------------------------------------------------------------------ findings
# Each found by the machine above (or by reading the cores along its paths), minimised to the
# cores alone: P and D wired by hand, one clock.

P_AGENT, D_AGENT = "P-agent", "D-agent"


def _pair() -> tuple[PrefillCore, DecodeCore]:
    p = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1),
        plan=lambda blocks, reg: [
            ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)
        ],
    )
    d = DecodeCore(DecodeSettings(engine_id="D", incarnation="d1", tp_rank=0, tp_size=1, host="d", port=5700))
    return p, d


def _meta(rid: str, key: str) -> RequestMetadata:
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(request_id=rid, block_ids=((3,),), params=TransferParams.from_dict(params))


def _sends(actions: list[Any]) -> list[Notification]:
    out = []
    for a in actions:
        if isinstance(a, Send):
            note = wire.decode_notification(a.message)
            assert note is not None
            out.append(note)
    return out


def _to_p(p: PrefillCore, actions: list[Any], now: float) -> list[Any]:
    return [x for note in _sends(actions) for x in p.notification(D_AGENT, note, now)]


def _to_d(d: DecodeCore, actions: list[Any], now: float) -> list[Any]:
    return [x for note in _sends(actions) for x in d.notification(P_AGENT, note, now)]


def _connected(p: PrefillCore, d: DecodeCore, rid: str, key: str, now: float) -> list[Any]:
    """D adds ``rid``, handshakes with P, P loads D's rank: returns D's PUSH_REG actions."""
    out = d.add(_meta(rid, key), now)
    assert any(isinstance(a, Connect) for a in out)
    info = ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={RankKey(0, 0): P_AGENT},
        incarnations={P_AGENT: "p1"},
        write_deadline_s=10.0,
    )
    hello = d.connected("P", info, "", now)
    assert any(isinstance(a, Connect) for a in _to_p(p, hello, now))  # P loads D's rank
    answer = p.connected("D", 0, D_AGENT, "d1", 1, "", now)  # ... and answers the HELLO (a stamp)
    return _to_d(d, answer, now)


def _posted(p: PrefillCore, key: str, pid: str, handle: str, now: float, bound: str = "D") -> None:
    (post,) = [a for a in p.finished(key, pid, ((5,),), bound, now) if isinstance(a, Post)]
    assert p.confirm_post(post.key, post.dst, now)
    p.posted(post.key, post.dst, [handle], 64, now)


@pytest.mark.parametrize("how", ["p-polls-late", "stamp-overtaken-by-done"])
def test_a_key_used_again_after_it_was_done_is_pushed(how: str) -> None:
    """Found reading P's tombstone, then by the machine on its own (with the D-side fixes in,
    5,000 random runs: ``test_machine_shrunk_a_key_used_again_in_pp2_ends_done``).

    D registers a key that ended here again only with a stamp that *arrived* after the end
    on D (``_ended_keys`` / ``stamp_seq``); P takes a registration whose grant is not newer than
    the end *on P* (``_Tomb.ended_at``: when its writer polled the last WRITE complete) for the
    ended attempt's, and drops it unanswered (the attempt was "sent"). Both orders are benign:

    - ``p-polls-late``: D reads the DONE, has a keepalive answered (P's stamp of 5.0), and P's
      writer polls the WRITE complete only at 5.5;
    - ``stamp-overtaken-by-done``: P answers D's heartbeat (stamp 5.0), then posts and polls at
      once (5.1, 5.2); the DONE reaches D before the heartbeat answer (0.4 s late).

    The retry registers with the stamp of 5.0, P never writes it, and D fails it at its 120 s
    watchdog (D's heartbeats keep P's new prefill leased meanwhile)."""
    p, d = _pair()
    reg = _connected(p, d, "r1", "k", 0.0)
    assert not _to_p(p, reg, 0.0)  # held: no prefill yet
    done = wire.decode_notification(wire.encode_done("r1", RankKey(0, 0), 1))
    if how == "p-polls-late":
        _posted(p, "k", "p-1", "h1", 0.0)
        out = d.notification(P_AGENT, done, 4.6)
        assert [(a.request_id, a.outcome) for a in out if isinstance(a, Report)] == [("r1", "done")]
        keepalive = d.handle_timer(5.0)  # D's heartbeat: the idle engine's stamp is renewed
        assert _to_d(d, _to_p(p, keepalive, 5.0), 5.1) == []  # P's stamp of 5.0 reaches D
        (sent,) = p.write_settled("k", 0, "h1", True, 5.5)  # P's writer polls 0.5 s late
    else:
        answer = _to_p(p, d.handle_timer(5.0), 5.0)  # D's heartbeat names k; P's answer: stamp 5.0
        _posted(p, "k", "p-1", "h1", 5.1)
        (sent,) = p.write_settled("k", 0, "h1", True, 5.2)
        out = d.notification(P_AGENT, done, 5.3)
        assert [(a.request_id, a.outcome) for a in out if isinstance(a, Report)] == [("r1", "done")]
        assert _to_d(d, answer, 5.4) == []  # the heartbeat answer, overtaken by the DONE
    assert isinstance(sent, Report) and sent.outcome == "sent"
    reg2 = d.add(_meta("r2", "k"), 5.6)  # the key again: registers at once, with the stamp of 5.0
    assert [n.kind.value for n in _sends(reg2)] == ["push_reg"]
    finish = p.finished("k", "p-2", ((6,),), "D", 5.7)
    actions = [*finish, *_to_p(p, reg2, 5.7)]
    for n in range(4):  # P may ask D for a fresh grant first (a want; D renews): a few rounds
        if any(isinstance(a, Post) for a in actions):
            break
        actions = _to_p(p, _to_d(d, actions, 5.8 + n / 10), 5.8 + n / 10)
    posts = [a for a in actions if isinstance(a, Post)]
    assert [a.registration.request_id for a in posts] == ["r2"], f"P never writes the retry: {actions}"


def test_machine_a_key_used_again_after_a_late_polled_write_ends_done() -> None:
    """The same, on the machine's harness and rules (every step within its bound): the WRITE
    lands 4.5 s after its post, D reads the DONE, its keepalive is answered at 5.0 while P's
    writer runs its timers late, P polls 0.5 s after the landing, and the key is used again."""
    m = BenignCluster()
    m.begin(topology=(1, 1, 1, False), packed=False, d_first=3, p_first=3)
    for _ in range(8):
        m._settle_once(land=False)  # handshakes, HELLO, PUSH_REG, P's post
    assert [w.state for w in m.writes.values()] == ["pending"]
    while m.t < 4.5 - 1e-9:
        m.tick(dt=0.5, lazy=set())
        while m.net:
            m.deliver(i=0)
    m.land(i=0)
    m.deliver(i=0)  # D reads the DONE: done
    m.tick(dt=0.5, lazy={0})  # t=5.0: D's keepalive; P's writer is busy (its timers run late)
    while m.net:
        m.deliver(i=0)  # P's stamp reaches D
    m.poll_p(j=0)  # P's writer sees the WRITE complete: 'sent'
    m.retry_done(i=0, finish_first=True, bind=True)
    assert len(m.requests) == 2
    m.teardown()  # before a fix: false failure, D fails r2#3 at its 120 s watchdog


@pytest.mark.parametrize("done_read", [True, False], ids=["done-read", "done-still-on-its-way"])
def test_a_send_to_a_closed_stage_before_its_goodbye_is_read_fails_nothing_it_wrote(done_read: bool) -> None:
    """Found by the machine (PP2 -> TP2: stage 0 posted r4 to both D ranks and closed; a new
    request's PUSH_REG went to stage 0's agent before D read its BYE). P closes its agent right
    after the BYE, so D's next send to it raises (``NIXL_ERR_REMOTE_DISCONNECT``), and
    ``DecodeCore.unreachable`` fails the whole engine (``_engine_failed``): every registered
    request fails, also one whose DONE from that worker was read (or, as the BYE says, is on
    its way) and that the other stage is still writing. The BYE path keeps those
    (``_engine_down(keep=...)``); the unreachable path, which a closing worker's BYE races,
    must not fail them either."""
    d = _registered("r1", stages=2)
    out: list[Any] = []
    if done_read:
        out += d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.0)
    out += d.unreachable(A0, "NIXL_ERR_REMOTE_DISCONNECT", 1.1)  # D's send to the closed worker
    assert _reports(out) == [], f"a request stage 0 wrote failed when its agent went away: {out}"
    out += d.notification(A0, _bye(P0, A0, delivered=["r1"]), 1.2)  # the BYE, read late
    if not done_read:
        out += d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.25)
    out += d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 1.3)  # stage 1 writes it
    assert _reports(out) == [("r1", "done")], out


def test_machine_a_stage_closing_after_it_posted_fails_no_request_it_wrote() -> None:
    """The machine's sequence for the finding above (as hypothesis printed it)."""
    state = BenignCluster()
    state.begin(topology=(2, 1, 2, False), packed=False, d_first=2, p_first=1)  # stage 0 finishes r4
    state.tick(dt=2.0, lazy=set())  # handshakes, PUSH_REGs, stage 0's WRITEs posted
    state.land(i=0)
    state.deliver(i=0)  # D rank 0 reads stage 0's DONE
    state.land(i=0)
    state.make_request(bind=False, d_first=0, nblocks=1, p_first=0, packed=False, sizes="absent")
    state.deliver(i=0)  # D rank 1 reads stage 0's DONE
    state.close_worker(j=0, now=0, then="same")  # stage 0 closes (re-created in its process)
    state.poll_p(j=0)
    state.finish_late(bind=False, i=0, j=0)  # stage 1 finishes r4
    state.teardown()  # before a fix: D adds r5, its PUSH_REG to stage 0 raises, r4 fails


def test_after_one_stage_said_goodbye_the_other_stage_still_gets_a_fresh_grant() -> None:
    """Found reading D's BYE path along the machine's close rule, reproduced on the machine
    below (PP2 -> TP1, stages finishing 11 s apart, below P's 30 s lease and D's 20 s bounds).
    Stage 0 wrote r1 and closed, a new worker took its place; D kept r1 at the BYE (its DONE
    was read) but ``_engine_down`` dropped the engine's agents and armed a new handshake only
    for requests *waiting* to register. Stage 1 finished after its
    grant's window, asked for a fresh one (``want``), and D dropped the answer ("an agent this
    rank did not load"); with no new request nothing handshakes again, and the restart timeout
    failed r1 20 s after the BYE, a new stage-0 worker serving all along."""
    d = _registered("r1", stages=2)  # both stages hold r1's registration, grant 0.0
    d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.0)
    out = d.notification(A0, _bye(P0, A0, delivered=["r1"]), 1.1)
    out += d.handle_timer(1.1)
    assert _reports(out) == []
    assert any(isinstance(a, Connect) for a in out), f"D does not handshake afresh for r1's stage 1: {out}"
    info = ProducerInfo(
        prefill_pp=2,
        prefill_tp=1,
        agents={P0: A0, P1: A1},
        incarnations={A0: f"inc-{A0}-2", A1: f"inc-{A1}"},  # stage 0's new worker
        write_deadline_s=1.0,
    )
    d.connected("P", info, "", 1.2)
    d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, f"inc-{A0}-2")), 1.2)
    d.notification(A1, _note(wire.encode_heartbeat_answer(P1, 1.2, f"inc-{A1}")), 1.2)
    want = _note(wire.encode_heartbeat_answer(P1, 11.0, f"inc-{A1}", ["k-r1"]))  # stage 1 finished
    renew = d.notification(A1, want, 11.0)
    assert [n.kind.value for n in _sends(renew)] == ["push_reg"], renew
    assert _reports(d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 11.5)) == [("r1", "done")]


def test_machine_a_stage_finishing_late_after_the_other_closed_ends_done() -> None:
    """The same on the machine: stage 0 writes r3 and closes (re-created in its process), the
    BYE is read, stage 1 finishes 11 s after the request (within REQ_SKEW_S)."""
    m = BenignCluster()
    m.begin(topology=(2, 1, 1, False), packed=False, d_first=3, p_first=1)  # only stage 0 finishes
    for _ in range(8):
        m._settle_once(land=True)  # stage 0's WRITE lands, D reads its DONE
    m.close_worker(j=0, now=0, then="same")
    while m.net:
        m.deliver(i=0)  # the BYE
    while m.t < 11.0 - 1e-9:
        m.tick(dt=0.5, lazy=set())
        while m.net:
            m.deliver(i=0)
    m.finish_late(i=0, j=0, bind=False)  # stage 1: its grant of t=0 is stale, it asks for one
    m.teardown()  # before a fix: r3 fails at D's restart timeout (t=20 s)


@pytest.mark.parametrize("then", ["same", "new", ""])
def test_machine_a_goodbye_overtaking_the_last_done_fails_nothing(then: str) -> None:
    """The bug b3a7ace fixed, on this machine (fails on a89b8ce): P's worker polls its last
    WRITE complete, closes and says goodbye; D reads the BYE before that WRITE's DONE."""
    m = BenignCluster()
    m.begin(topology=(1, 1, 1, False), packed=False, d_first=3, p_first=3)
    for _ in range(8):
        m._settle_once(land=False)  # registered, P's WRITE posted
    m.land(i=0)  # its DONE is on the way
    m.poll_p(j=0)  # P: sent
    m.close_worker(j=0, then=then, now=0)  # nothing in flight: shutdown and goodbye at once
    kinds = [wire.decode_notification(x.data).kind.value for x in m.net]  # type: ignore[union-attr]
    assert kinds == ["done", "goodbye"], kinds
    m.deliver(i=1)  # the BYE overtakes the DONE
    m.teardown()


def test_one_heartbeat_round_answered_unknown_by_two_producers_is_one_strike_each() -> None:
    """Found by the machine (PP2 x TP2 -> TP1, D heartbeat every 2.5 s; with 5 s it is rarer,
    not gone): a request registers just before D's heartbeat; its PUSH_REGs to two producers
    are still on their way when the heartbeat (which names its key) reaches them, and both
    answer "unknown". ``_on_unknown`` counts strikes per request, not per producer, so the two
    answers to one round are "twice" and D fails it at once ("its PUSH_REG was lost"), though
    each producer said so once and both PUSH_REGs arrive a moment later."""
    d = _registered("r1", stages=2)  # r1's PUSH_REGs are on their way to both stages
    out: list[Any] = []
    for rank, agent in [(P0, A0), (P1, A1)]:  # both answer D's heartbeat before the PUSH_REG
        answer = wire.encode_heartbeat_answer(rank, 0.3, f"inc-{agent}", [], [], ["k-r1"])
        out += d.notification(agent, _note(answer), 0.3)
    assert _reports(out) == [], f"one heartbeat round failed r1: {out}"
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 0.5)
    out += d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 0.6)
    assert _reports(out) == [("r1", "done")], out


def test_machine_shrunk_a_key_used_again_in_pp2_ends_done() -> None:
    """The machine's own shrunk sequence for the key-reuse finding (PP2 -> TP1, D heartbeat 2.5 s;
    on the code before a fix the retry fails at P's 30 s lease)."""
    state = BenignCluster()
    state.begin(topology=(2, 1, 1, False), packed=False, d_first=1, p_first=0, hb=2.5)
    state.finish_late(bind=False, i=0, j=0)
    state.tick(dt=2.0, lazy=set())
    state.land(i=0)
    state.deliver(i=0)
    state.poll_p(j=0)
    state.poll_p(j=0)
    state.finish_late(bind=False, i=0, j=0)
    state.post(chunks=1, j=0)
    state.land(i=0)
    state.tick(dt=0.5, lazy=set())
    state.tick(dt=2.0, lazy=set())
    state.retry_done(bind=False, finish_first=False, i=0)
    state.teardown()


def test_machine_shrunk_one_heartbeat_round_answered_unknown_twice() -> None:
    """The machine's own shrunk sequence for the strikes finding (PP2 x TP2 -> TP1)."""
    state = BenignCluster()
    state.begin(topology=(2, 2, 1, False), packed=False, d_first=1, p_first=0, hb=2.5)
    state.handshake_ok(i=0)
    state.deliver(i=0)
    state.tick(dt=2.0, lazy=set())
    state.poll_p(j=0)
    state.make_request(bind=False, d_first=1, nblocks=1, p_first=0, packed=False, sizes="absent")
    state.deliver(i=0)
    state.tick(dt=0.5, lazy=set())
    state.deliver(i=9)
    state.deliver(i=15)
    state.deliver(i=27)
    state.teardown()


def test_a_heartbeat_answer_saying_failed_before_the_fail_fences_no_write_of_another_request() -> None:
    """Found by the machine (PP2 -> TP2, 5,000 random runs with the fixes above): stage 0
    closes; its shutdown fails r7, which it never posted (FAIL, nothing unsettled), and its
    answer to D's heartbeat names k7 ``failed`` before that FAIL arrives. The answer does not
    say whether a WRITE ended unsettled, so D counts stage 0 unsettled and fences at once; the
    fence takes the engine's whole connection, and stage 1's WRITE of r5 in flight on it (r5,
    which stage 0 wrote before it closed) fails: r5 fails on that D rank. D could close r7 and
    let the CANCEL it sends anyway (or the FAIL on its way) say whether anything is unsettled,
    fencing only if neither comes by the quarantine's end; or P's answer can say it (main's
    85d2f68: ``settled``, which this test passes where the encoder has it)."""
    d = _registered("r5", "r7", stages=2)
    out = d.notification(A0, _note(wire.encode_done("r5", P0, 1)), 1.0)  # stage 0 wrote r5
    # k7 failed; P's shutdown posted nothing of it, and its answer says so (``fs``)
    answer = wire.encode_heartbeat_answer(P0, 1.1, f"inc-{A0}", [], ["k-r7"], [], ["k-r7"])
    out += d.notification(A0, _note(answer), 1.1)
    assert _reports(out) == [("r7", "failed")], out
    fences = [a for a in out if isinstance(a, Fence)]
    assert not fences, f"stage 1's WRITE of r5 in flight is cut by {fences}"
    out = d.notification(A0, _note(wire.encode_failed("r7", P0, "the prefill worker closed", False)), 1.2)
    out += d.notification(A1, _note(wire.encode_cancel_ack("r7", P1, False, unsettled=False)), 1.2)
    assert not [a for a in out if isinstance(a, Fence)] and _released(out) == ["r7"], out
    assert _reports(d.notification(A1, _note(wire.encode_done("r5", P1, 1)), 1.3)) == [("r5", "done")]


def test_machine_shrunk_a_fence_after_a_heartbeat_answer_cuts_another_requests_write() -> None:
    """The machine's own shrunk sequence for the finding above (PP2 -> TP2; r5 fails on D rank 1)."""
    state = BenignCluster()
    state.begin(topology=(2, 1, 2, False), hb=5.0, p_first=0, d_first=0, packed=False)
    state.make_request(bind=False, d_first=2, nblocks=1, p_first=1, packed=False, sizes="absent")
    state.tick(dt=2.0, lazy=set())
    state.poll_p(j=0)
    state.make_request(bind=False, d_first=0, nblocks=1, p_first=0, packed=False, sizes="absent")
    state.land(i=0)
    state.tick(dt=2.0, lazy=set())
    state.make_request(bind=False, d_first=2, nblocks=1, p_first=1, packed=False, sizes="absent")
    state.close_worker(j=0, now=0, then="same")
    state.deliver(i=0)
    state.deliver(i=2)
    state.tick(dt=0.5, lazy=set())
    state.deliver(i=0)
    state.tick(dt=0.5, lazy=set())
    state.deliver(i=28)
    state.deliver(i=0)
    state.deliver(i=0)
    state.deliver(i=0)
    state.deliver(i=0)
    state.deliver(i=0)
    state.deliver(i=0)
    state.deliver(i=0)
    state.deliver(i=0)
    state.teardown()


def test_machine_shrunk_a_failed_handshake_after_a_goodbye_fails_no_kept_request() -> None:
    """Found on main 85d2f68 (4,000 random runs): PP2 -> TP1, both stages posted r3, stage 0
    closes for good; D keeps r3 at the BYE and handshakes afresh; that handshake fails (stage 0
    is gone) and fails r3 while stage 1's WRITE of it is in flight. Kept requests should
    survive a failed handshake while a rank restarts (bounded by the restart timeout)."""
    state = BenignCluster()
    state.begin(topology=(2, 1, 1, False), packed=False, d_first=1, p_first=3, hb=5.0)
    state.handshake_ok(i=0)
    state.deliver(i=0)
    state.deliver(i=0)
    state.handshake_ok(i=0)
    state.tick(dt=2.0, lazy=set())
    state.land(i=0)
    state.poll_p(j=0)
    state.close_worker(j=0, now=0, then="")
    state.make_request(bind=False, d_first=1, nblocks=1, p_first=0, packed=False, sizes="absent")
    state.tick(dt=2.0, lazy=set())
    state.teardown()


def test_a_heartbeat_answer_of_an_older_p_saying_failed_is_still_fenced() -> None:
    """The safety side of the finding above: an answer that does not state the failed key
    settled (an older P, or a WRITE of it that did end unsettled) is fenced before the blocks
    go back, as before."""
    d = _registered("r7", stages=2)
    answer = wire.encode_heartbeat_answer(P0, 1.1, f"inc-{A0}", [], ["k-r7"], [])
    out = d.notification(A0, _note(answer), 1.1)
    assert _reports(out) == [("r7", "failed")], out
    out = d.notification(A1, _note(wire.encode_cancel_ack("r7", P1, False, unsettled=False)), 1.2)
    assert [a for a in out if isinstance(a, Fence)] and _released(out) == [], out  # fenced first
