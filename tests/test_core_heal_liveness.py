"""A heal liveness oracle for the protocol cores: faults for a while, then a heal; every
request must end, and every failed one's blocks go back, within a bound of the protocol's own
timeouts after the heal (never a backoff grown during the faults).

:class:`HealCluster` drives the same P and D cores through ``test_core_properties``'s harness,
with P's WRITEs as kernel copies (``writes_abortable`` false: same-host NIXL, CMA copies by
P's process, as in CI's soak), so a failed request's blocks are *held* until P acknowledges its
CANCEL or P's process exited. Timing as the soak's (``SoakConfig``): heartbeat 0.25 s, freshness
0.5 s, P's WRITE deadline 1.5 s, watchdog 6 s, peer silence 5.75 s, HELLO timeout 5 s, retry
backoff 1 s doubling up to 30 s.

The fault phase is ``CoreCluster``'s rules (drops, duplicates, delays, failed and refused
handshakes, failed posts, late P timers, cancels, driver errors) plus :meth:`HealCluster.outage`:
a stretch of heartbeat-sized steps in which notifications are lost, D's or P's handshakes fail,
and P's processes stall (SIGSTOP), as the soak's faults cluster. Then the heal
(:meth:`HealCluster._heal`): every P process runs (a dead rank is started again under its name),
every handshake succeeds, every message is delivered and every WRITE lands at once, and the
clock moves to the next deadline. The oracle, per D rank and request:

- reported by its watchdog at the latest (``added + request_timeout_s``; a cancelled one is
  reported with its release);
- if failed or cancelled, released by ``max(heal, end) + QUARANTINE + RECONNECT`` where ``end``
  is when it failed or was cancelled on D, ``QUARANTINE`` (freshness + 2 x WRITE deadline) is
  how long P may still post after that, and ``RECONNECT`` is one hold round, one base backoff,
  one HELLO timeout and a heartbeat's slack: what a handshake afresh with a reachable P costs
  (with the fix, the machine's worst case is 1.5 s past ``max(heal, end + QUARANTINE)``);
- (``ResumeCluster``) then a new request, added on every D rank and finished on every P rank,
  must be done.

Findings (each kept as a test below; both fixed in e246dd0: a failed engine's retry backoff is at
most a quarter of ``request_timeout_s``, and ``retry_backoff_s`` alone while it holds a request
for P's answer):

1. A held request waits out a backoff grown during the faults. While P cannot be reached, each
   handshake afresh fails and doubles the engine's backoff (1, 2, 4, 8, 16, 30 s; ``failures``
   resets only once the engine is ready). A request held for P's answer asks for the engine
   (``_hold`` -> ``_engine_wanted``) only once that backoff ended, so after the heal its blocks
   stay up to ``retry_backoff_max_s`` longer than a handshake with the reachable P needs: the
   soak's release at 38.7 s of a request failed at 7.1 s. Tests:
   ``test_a_held_request_waits_out_a_backoff_grown_during_the_faults`` (core alone),
   ``test_shrunk_held_request_waits_out_the_backoff_after_the_heal`` (the machine's),
   ``test_deep_heal_search`` (slow), ``TestHealCluster``.
2. After the heal, D keeps failing new requests to the reachable P for up to
   ``retry_backoff_max_s`` (30 s): a request added then waits for the engine's next attempt,
   beyond its watchdog (6 s) and P's lease (3 s; a cap of half the watchdog, 3 s, still lost
   requests to it). Tests:
   ``test_a_request_added_after_the_heal_is_pushed`` (core alone), ``TestResumeCluster``.
3. The same on P's side (found by ``ResumeCluster`` after e246dd0, random runs): P's address
   backoff for a D rank whose side channel P could not reach grows to 30 s, and P loads that
   rank again (to answer its HELLO) only once it ended. Fixed: at most a quarter of P's lease
   (first reverted: the soak with one P kill lost requests with it, but that was D greeting a
   killed process, tests/test_restart_during_handshake.py, which lost them without it too).
   Test: ``test_p_answers_a_hello_soon_after_the_heal_whatever_its_address_backoff``.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test
from test_core_properties import (
    IDX,
    LAYERS,
    MAX_BUSY_ROUNDS,
    DProc,
    KernelCopyCluster,
    PProc,
    Request,
    Violation,
    _machine_settings,
)
from test_goodbye_overtakes_done import _note

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, ProbeExit, Release, Report, Send
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.types import PushRegistration, RankKey, RequestMetadata, TransferParams

HB_S = 0.25
FRESH_S = 0.5
WRITE_S = 1.5
TIMEOUT_S = 6.0
SILENCE_S = 3 * HB_S + 5.0
HELLO_S = 5.0
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
MARGIN_S = 1.0
QUARANTINE_S = FRESH_S + WRITE_S + max(MARGIN_S, WRITE_S)
"""After a request ends on D, how long P may still post into it (D's quarantine bound)."""
RECONNECT_S = HB_S + BACKOFF_S + HELLO_S + 2 * HB_S + 0.5
"""After the heal (or the quarantine), what D needs to reach a reachable P and hear its answer:
the next hold round, one base backoff, one HELLO timeout (a HELLO that got no answer at the
heal), a heartbeat to resend the cancel, slack. Far below ``BACKOFF_MAX_S``."""
HEAL_LIMIT_S = 120.0
"""How long after the heal the oracle lets the clock run before it gives up waiting."""
STEPS_S = [0.001, 0.05, 0.25, 0.25, 0.5, 1.0, 2.0, 6.0, 12.0]
OUTAGES_S = [1.0, 3.0, 6.0, 12.0, 20.0, 35.0]


def d_settings(**over: Any) -> DecodeSettings:
    """The soak's D timing."""
    base = DecodeSettings(
        engine_id="D",
        incarnation="d1",
        tp_rank=0,
        tp_size=1,
        host="d.example",
        port=5700,
        request_timeout_s=TIMEOUT_S,
        heartbeat_interval_s=HB_S,
        peer_silence_s=SILENCE_S,
        fresh_s=FRESH_S,
        hello_timeout_s=HELLO_S,
        quarantine_margin_s=MARGIN_S,
        retry_backoff_s=BACKOFF_S,
        retry_backoff_max_s=BACKOFF_MAX_S,
        keepalive_s=4 * TIMEOUT_S,  # (the drain after the oracle steps through it in heartbeats)
    )
    return attrs.evolve(base, **over)


class HealCluster(KernelCopyCluster):
    """Faults, then a heal: every request reported and released within a bound after it."""

    kernel_copies = True

    def __init__(self) -> None:
        super().__init__()
        self.added_at: dict[tuple[str, str], float] = {}
        self.ended_at: dict[tuple[str, str], float] = {}
        """(D incarnation, request id) -> when D failed it (its report) or the engine cancelled it."""
        self.freed_at: dict[tuple[str, str], float] = {}
        self.healed_at: float | None = None
        self.restarted = False
        """The heal started a dead P rank again."""

    # ------------------------------------------------------------------ the soak's timing

    def _new_p(self, rank: RankKey, offset: float, process: str = "") -> PProc:
        proc = super()._new_p(rank, offset, process)
        proc.core.s = attrs.evolve(
            proc.core.s, write_deadline_s=WRITE_S, lease_s=3.0, registration_ttl_s=2 * TIMEOUT_S
        )
        return proc

    def _new_d(self, tp_rank: int, offset: float) -> DProc:
        proc = super()._new_d(tp_rank, offset)
        s = proc.core.s
        proc.core.s = d_settings(
            engine_id=s.engine_id, incarnation=s.incarnation, tp_rank=s.tp_rank, tp_size=s.tp_size
        )
        connected = proc.core.connected

        def with_deadline(engine_id: str, info: ProducerInfo | None, error: str, now: float) -> list[Any]:
            # The harness publishes its own WRITE deadline: P's is the soak's here.
            info = attrs.evolve(info, write_deadline_s=WRITE_S) if info is not None else None
            return connected(engine_id, info, error, now)

        proc.core.connected = with_deadline
        return proc

    # ------------------------------------------------------------------ bookkeeping

    def _add(self, d: DProc, req: Request) -> None:
        super()._add(d, req)
        if req.rid in d.requests:
            self.added_at.setdefault((d.inc, req.rid), self.t)

    def _d_report(self, d: DProc, report: Report) -> None:
        super()._d_report(d, report)
        if report.outcome != "done":
            self.ended_at.setdefault((d.inc, report.request_id), self.t)

    @precondition(lambda self: self.requests and self.live_d())
    @rule(i=IDX, j=IDX)
    def cancel(self, i: int, j: int) -> None:
        req = self.requests[i % len(self.requests)] if self.requests else None
        d = self.live_d()[j % len(self.live_d())] if self.live_d() else None
        if req is not None and d is not None and req.rid in d.requests:
            self.ended_at.setdefault((d.inc, req.rid), self.t)
        super().cancel(i=i, j=j)

    def _free_blocks(self, d: DProc, req: Any) -> None:
        if not req.freed:
            self.freed_at[(d.inc, req.rid)] = self.t
        super()._free_blocks(d, req)

    # ------------------------------------------------------------------ faults

    @precondition(lambda self: self.ready)
    @rule(dt=st.sampled_from(STEPS_S), late=st.sampled_from([None, 0, 1, 2, 3]))
    def advance_clock(self, dt: float, late: int | None = None) -> None:
        """Time passes in the soak's scale (see ``CoreCluster.advance_clock``)."""
        super().advance_clock(dt=dt, late=late)

    @precondition(lambda self: self.ready)
    @rule(
        seconds=st.sampled_from(OUTAGES_S),
        partition=st.booleans(),
        d_handshakes=st.booleans(),
        p_handshakes=st.booleans(),
        stall=st.booleans(),
    )
    def outage(
        self, seconds: float, partition: bool, d_handshakes: bool, p_handshakes: bool, stall: bool
    ) -> None:
        """A stretch of faults, in heartbeat steps: every notification lost (``partition``;
        else delivered), D's or P's handshakes failing (else succeeding), P's processes
        stopped (``stall``: no timer, no message read, its copies stuck). Then it ends
        (P continues); nothing else is healed."""
        stopped = [p for p in self.live_p() if not p.hung] if stall else []
        for p in stopped:
            p.hung = True
        end = self.t + seconds
        while self.t < end - 1e-9:
            self.t = min(end, self.t + HB_S)
            handshakes, self.handshakes = self.handshakes, []
            for item in handshakes:
                fail = d_handshakes if isinstance(item[0], DProc) else p_handshakes
                self._handshake(item, not fail)
            for p in self.live_p():
                if p.posts and not p.hung:
                    posts, p.posts = p.posts, []
                    for post in posts:
                        self._post(p, post, False, 1)
            messages = [m for m in self.net if not m.held]
            self.net = [m for m in self.net if m.held]
            for msg in messages if not partition else ():
                self._deliver(msg)
            if not partition and not stall:
                for w in list(self.writes.values()):
                    if w.state == "pending":
                        self._land(w, True)
            for p in self.live_p():
                if not p.hung:
                    self._poll(p)
            self._tick()
        for p in stopped:
            p.hung = False

    # ------------------------------------------------------------------ the heal and the oracle

    probe = False
    """After the heal check: a new request must be pushed (:meth:`_check_probe`)."""

    def teardown(self) -> None:
        if self.ready:
            self._heal()
            self._check_heal()
            if self.probe:
                self._check_probe()
        super().teardown()  # the reliable drain; every state empty

    def _check_probe(self) -> None:
        """Healed, a new request (every D rank adds it, every P rank finishes its prefill at
        once) must be done on every D rank: D may not keep failing requests to a reachable P
        for a backoff grown during the faults. Not where P cannot serve it for good (a worker
        closed and not replaced; stages restarted with layer windows that overlap; a P rank that
        refused D's metadata, as the harness's refused handshake says). A P rank
        restarted while D was idle (or by the heal) D may learn of only at its first send,
        which fails that request: then a second one, added when the first ended, must be done."""
        if any(p.core._closing or p.core._refusals for p in self.live_p()) or not self._tiled():
            return
        for _ in range(2):
            outcomes, added = self._probe()
            if all(o == ["done"] for o in outcomes.values()):
                return
        raise Violation(
            f"a request added {added - (self.healed_at or 0):.2f}s after the heal was not pushed: "
            f"{outcomes} (engines: {[_engine_state(d.core) for d in self.live_d()]})"
        )

    def _probe(self) -> tuple[dict[str, list[str]], float]:
        n = next(self.seq)
        req = Request(key=f"k{n}", rid=f"probe{n}", seq=n, nblocks=1, sizes="absent", packed=False)
        self.requests.append(req)
        added = self.t
        for d in self.live_d():
            self._add(d, req)
        self.prefill_finished(i=len(self.requests) - 1, j=0, one_rank=False, bind=False, boom=False)
        while self.t < added + TIMEOUT_S + 1.0:
            for _ in range(MAX_BUSY_ROUNDS):
                if not self._settle_once(land=True, deliver_held=True):
                    break
            if all(req.rid not in d.requests or d.requests[req.rid].outcomes for d in self.live_d()):
                break
            self.t += HB_S / 5
            self._tick()
        return {d.agent: d.requests[req.rid].outcomes for d in self.live_d() if req.rid in d.requests}, added

    def _tiled(self) -> bool:
        """Whether the live P stages' layer windows tile the layers (as D's handshake checks)."""
        live = self.live_p()
        return all(
            sorted(layer for p in live if p.rank.tp_rank == tp for layer in range(*p.layers))
            == list(range(LAYERS))
            for tp in {p.rank.tp_rank for p in live}
        )

    def _heal(self) -> None:
        """Every P process runs and is reachable, everything is delivered at once; the clock
        moves from deadline to deadline until every request ended and was released."""
        for p in self.p_procs:
            p.hung = False
        alive = {p.rank for p in self.live_p()}
        for p in list(self.p_procs):  # an operator starts a dead P rank again under its name
            if not p.alive and p.rank not in alive and p.rank.pp_rank < self.p_pp:
                self.p_procs.append(self._new_p(p.rank, offset=p.offset + 11.0))
                self.restarted = True
                alive.add(p.rank)
        for m in self.net:
            m.held = False
        self.healed_at = self.t
        while True:
            for _ in range(MAX_BUSY_ROUNDS):
                if not self._settle_once(land=True, deliver_held=True):
                    break
            else:
                raise Violation(f"livelock after the heal (t={self.t:.3f}s)")
            if self._all_ended() or self.t > self.healed_at + HEAL_LIMIT_S:
                return
            if not self._to_next_deadline():
                return

    def _all_ended(self) -> bool:
        return all(
            req.outcomes and (req.outcomes[0] == "done" or req.released)
            for d in self.live_d()
            for req in d.requests.values()
        )

    def _check_heal(self) -> None:
        assert self.healed_at is not None
        late: list[str] = []
        for d in self.live_d():
            for rid, req in d.requests.items():
                key = (d.inc, rid)
                added = self.added_at.get(key, self.healed_at)
                if not req.outcomes:
                    late.append(f"{d.agent} {rid}: never reported (added at {added:.2f}s)")
                    continue
                if req.outcomes[0] == "done":
                    continue
                ended = self.ended_at.get(key, added)
                due = max(self.healed_at, ended) + QUARANTINE_S + RECONNECT_S
                freed = self.freed_at.get(key)
                if freed is None or freed > due + 1e-6:
                    when = "never" if freed is None else f"at {freed:.2f}s"
                    late.append(
                        f"{d.agent} {rid} {req.outcomes}: ended at {ended:.2f}s, healed at "
                        f"{self.healed_at:.2f}s, released {when}, due by {due:.2f}s "
                        f"(engine: {_engine_state(d.core)})"
                    )
        if late:
            raise Violation("liveness after the heal:\n  " + "\n  ".join(late))


def _engine_state(core: DecodeCore) -> str:
    return ", ".join(
        f"{e.engine_id} {e.state.value} failures={e.failures} failed_at={e.failed_at:.2f}"
        for e in core._engines.values()
    )


# ------------------------------------------------------------------------------ regressions


def test_shrunk_held_request_waits_out_the_backoff_after_the_heal() -> None:
    """The machine's minimal sequence (hypothesis, derandomized, 300 runs of 80 steps): P
    stops (SIGSTOP) for 12 s, r2 fails at its watchdog and is held; D finds P silent and its
    handshakes afresh fail for 15 s (the backoff grows to 16 s). Healed at 28 s, r2 was
    released at 44.25 s (before e246dd0), due by 38.75 s."""
    state = HealCluster()
    state.start(topology=(1, 1, 1))
    state.new_request(first_rank_only=False, nblocks=1, packed=False, prefill_first=False, sizes="absent")
    state.outage(d_handshakes=False, p_handshakes=False, partition=False, seconds=1.0, stall=False)
    state.outage(d_handshakes=False, p_handshakes=False, partition=False, seconds=12.0, stall=True)
    state.outage(d_handshakes=True, p_handshakes=False, partition=False, seconds=3.0, stall=False)
    state.outage(d_handshakes=True, p_handshakes=False, partition=False, seconds=12.0, stall=False)
    state.teardown()


# ------------------------------------------------------------------------------ the core alone
# The machine's finding, by hand: D's core driven directly, P played over the wire.

P0 = RankKey(0, 0)
A0 = "P-prefill-pp0-tp0"
P_INC = "inc-P0"
STEP_S = 0.05


def _info() -> ProducerInfo:
    """One P rank on D's host: its copies (CMA, CUDA IPC) are not abortable."""
    return ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={P0: A0},
        incarnations={A0: P_INC},
        write_deadline_s=WRITE_S,
        writes_abortable=False,
        processes={A0: {"host": "h", "pid": 10}},
    )


@attrs.define
class _Run:
    """D's core and a P that answers every handshake, HELLO, heartbeat and CANCEL at once,
    except from ``cut_at`` until ``heal_at``: then it answers nothing (partitioned, its side
    channel unreachable), though its process runs."""

    cut_at: float
    heal_at: float
    d: DecodeCore = attrs.field(factory=lambda: DecodeCore(d_settings()))
    reports: dict[str, tuple[str, float]] = attrs.field(factory=dict)
    released: dict[str, float] = attrs.field(factory=dict)
    connects: list[float] = attrs.field(factory=list)

    def run(self, actions: list[Any], t: float) -> None:
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            reachable = not self.cut_at <= t < self.heal_at
            if isinstance(action, Report):
                self.reports.setdefault(action.request_id, (action.outcome, t))
            elif isinstance(action, Release):
                self.released[action.request_id] = t
            elif isinstance(action, Connect):
                self.connects.append(t)
                info, error = (_info(), "") if reachable else (None, "side channel unreachable: timed out")
                queue += self.d.connected(action.engine_id, info, error, t)
            elif isinstance(action, Send) and reachable:
                note = _note(action.message)
                if note.kind.value in ("hello", "heartbeat"):
                    answer = wire.encode_heartbeat_answer(P0, t, P_INC)
                elif note.kind.value == "cancel":  # P's copy ended long ago: nothing in flight
                    assert note.registration is not None
                    rid = note.registration.request_id
                    answer = wire.encode_cancel_ack(rid, P0, False, unsettled=False, incarnation=P_INC)
                elif note.kind.value == "push_reg" and note.registration.request_id.startswith("new"):
                    answer = wire.encode_done(note.registration.request_id, P0, 1)  # P pushes at once
                else:
                    continue
                queue += self.d.notification(A0, _note(answer), t)
            else:  # a lost message; an exit probe (P's process runs); dropped agents
                assert isinstance(action, (Send, ProbeExit)) or type(action).__name__ == "DropPeer", action

    def until(self, end: float, t: float) -> float:
        while t < end - 1e-9:
            t = round(t + STEP_S, 6)
            self.run(self.d.handle_timer(t), t)
        return t


def _meta(rid: str, key: str) -> RequestMetadata:
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(request_id=rid, block_ids=((1,),), params=TransferParams.from_dict(params))


def _registered_then_partitioned(heal_at: float) -> tuple[_Run, float]:
    """r1 registered with P at t=0 (its grant fresh); from then P is unreachable until ``heal_at``."""
    run = _Run(cut_at=0.001, heal_at=heal_at)
    meta = RequestMetadata(
        request_id="r1",
        block_ids=((1,),),
        params=TransferParams.from_dict(
            {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": "k1"}
        ),
    )
    run.run(run.d.add(meta, 0.0), 0.0)  # handshake, HELLO, P's stamp: PUSH_REG
    assert run.d.stats["push_regs_sent"] == 1
    return run, 0.0


def _heal_bound(run: _Run) -> float:
    outcome, ended = run.reports["r1"]
    assert outcome == "failed"
    return max(run.heal_at, ended) + QUARANTINE_S + RECONNECT_S


def test_control_a_held_request_goes_back_soon_after_a_short_partition() -> None:
    """The partition outlasts the watchdog and one failed handshake afresh: r1 fails at its
    watchdog, is held (P's copy may run), and goes back within the bound once P answers."""
    run, t = _registered_then_partitioned(heal_at=16.0)
    t = run.until(run.heal_at, t)
    assert run.reports["r1"][0] == "failed" and "r1" not in run.released  # held while P is silent
    run.until(run.heal_at + 60.0, t)
    assert run.released.get("r1", float("inf")) <= _heal_bound(run), (run.released, run.connects)


def test_a_held_request_waits_out_a_backoff_grown_during_the_faults() -> None:
    """The soak's slow release (CI: failed at 7.1 s, released at 38.7 s). r1 fails at its
    watchdog (6 s) with P partitioned, and is held: P's copies are not abortable and P's process
    runs. At 11.75 s D declares P's agent silent (peer silence) and handshakes afresh, after
    its backoff; each attempt fails while P's side channel is unreachable, and each failure
    doubles the backoff (1, 2, 4, 8, 16, 30 s). At 45 s P is reachable again, but the next
    attempt came (before e246dd0) only at the end of the 30 s backoff (72.75 s): r1's blocks stayed held ~28 s
    longer than a handshake afresh with a reachable P needs."""
    run, t = _registered_then_partitioned(heal_at=45.0)
    t = run.until(run.heal_at, t)
    assert run.reports["r1"] == ("failed", 6.0) and "r1" not in run.released
    engine = run.d._engines["P"]
    assert engine.failures >= 6, engine  # the backoff grew to its maximum during the partition
    run.until(run.heal_at + 60.0, t)
    assert run.released.get("r1", float("inf")) <= _heal_bound(run), (
        f"released at {run.released.get('r1')}, due by {_heal_bound(run):.2f}; handshakes at {run.connects}"
    )


def test_a_request_added_after_the_heal_is_pushed() -> None:
    """Second finding (the machine, with the held fix applied): P's side channel unreachable
    from t=0 to 45 s while a request comes every second; each handshake afresh fails and the
    backoff grows to 30 s (requests fail meanwhile, as they should). At 45.5 s, P reachable
    again, a new request waits for the engine's next attempt (at ~61 s), beyond its watchdog
    (6 s) and P's lease (3 s in the soak): it fails, and so does every request for up to
    ``retry_backoff_max_s`` after the faults ended."""
    run = _Run(cut_at=0.0, heal_at=45.0)
    t = 0.0
    for n in range(45):
        run.run(run.d.add(_meta(f"out{n}", f"k-out{n}"), t), t)
        t = run.until(t + 1.0, t)
    assert all(run.reports[f"out{n}"][0] == "failed" for n in range(38))  # (watchdog: 6 s)
    t = run.until(45.5, t)
    run.run(run.d.add(_meta("new1", "k-new1"), t), t)
    run.until(t + TIMEOUT_S + 1.0, t)
    assert run.reports["new1"][0] == "done", (run.reports["new1"], run.connects[-4:])


def _p_core(lease_s: float = 3.0) -> PrefillCore:
    return PrefillCore(
        PrefillSettings(
            engine_id="P",
            incarnation="p1",
            rank=P0,
            tp_size=1,
            lease_s=lease_s,
            registration_ttl_s=2 * TIMEOUT_S,
            write_deadline_s=WRITE_S,
            retry_backoff_s=BACKOFF_S,
            retry_backoff_max_s=BACKOFF_MAX_S,
        ),
        plan=lambda blocks, reg: [],
    )


@pytest.mark.parametrize("lease_s", [3.0, 30.0], ids=["lease-3s", "lease-default-30s"])
def test_p_answers_a_hello_soon_after_the_heal_whatever_its_address_backoff(lease_s: float) -> None:
    """Third finding (``ResumeCluster`` on main after e246dd0, 4,500 random runs): during the
    outage P's handshakes with D's rank fail (D's side channel unreachable from P) and P's
    address backoff (a negative cache per address) doubles up to 30 s (attempts at 0, 1, 3, 7,
    15, 31 s). Healed at 33 s, D's HELLOs reach P, but P loads D's rank only once its backoff
    ended (61 s): each HELLO times out (5 s) and every request fails meanwhile (P's lease, 3 s,
    expires). A HELLO is D asking to be loaded: P should try again within a base backoff of it.
    Capping the backoff at a quarter of P's lease did that for this lease only: with the
    default lease (30 s) the cap is 7.5 s, longer than D's HELLO bound (5 s), and a D rank
    restarted (or healed) in the window failed its first requests "P did not answer this
    rank's HELLO"."""
    p = _p_core(lease_s)
    reg = PushRegistration(
        request_id="(hello)",
        match_key="(none)",
        decode_engine_id="D",
        decode_host="d.example",
        decode_port=5700,
        decode_tp_size=1,
        block_ids=(),
        remote_engine_id="(any)",
        decode_incarnation="d1",
        fresh_s=FRESH_S,
    )
    hello = _note(wire.encode_hello(reg, 0))
    connects: list[float] = []
    t, heal_at = 0.0, 33.0
    while t < heal_at + 20.0:
        for action in p.notification("D-decode-pp0-tp0", hello, t):  # D resends its HELLO
            if isinstance(action, Connect):
                connects.append(t)
                if t < heal_at:
                    p.connected("D", 0, "", "", 0, "side channel unreachable: timed out", t)
                else:
                    p.connected("D", 0, "D-decode-pp0-tp0", "d1", 1, "", t)
        if connects and connects[-1] >= heal_at:
            break
        t = round(t + 0.25, 6)
        p.handle_timer(t)
    after = [c for c in connects if c >= heal_at]
    assert after and after[0] <= heal_at + BACKOFF_S + HB_S, connects  # main: [0, 1, 3, 7, 15, 31]


EXAMPLES = int(os.environ.get("KVPUSH_CORE_EXAMPLES", "400"))
UNSHRUNK = [Phase.explicit, Phase.generate]
"""A failing run is printed as found: shrinking one takes many minutes (the regressions above are
minimal; add ``Phase.shrink`` locally)."""
HealCluster.TestCase.settings = settings(
    _machine_settings(max(25, EXAMPLES // 2)), stateful_step_count=60, phases=UNSHRUNK
)
TestHealCluster = pytest.mark.timeout(600)(HealCluster.TestCase)


class ResumeCluster(HealCluster):
    """The heal oracle, and then a new request must be pushed (:meth:`HealCluster._check_probe`)."""

    probe = True


ResumeCluster.TestCase.settings = settings(
    _machine_settings(max(25, EXAMPLES // 2)), stateful_step_count=80, phases=UNSHRUNK
)
TestResumeCluster = pytest.mark.timeout(600)(ResumeCluster.TestCase)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deep_heal_search() -> None:
    """300 derandomized runs of 80 steps, not shrunk (shrinking takes many minutes): before
    e246dd0 it found held requests released up to ~28 s after their bound."""
    run_state_machine_as_test(
        HealCluster,
        settings=settings(
            max_examples=300,
            stateful_step_count=80,
            deadline=None,
            derandomize=True,
            database=None,
            phases=UNSHRUNK,
            suppress_health_check=list(HealthCheck),
        ),
    )
