"""``kvpush demo --soak N``: many concurrent requests with random aborts and injected faults.

P runs as ``prefill_pp`` stage processes, D as ``decode_tp`` rank processes, all on the
``faulty`` transport wrapping NIXL (notifications dropped, duplicated and delayed, posts and
WRITEs failing, each at ``fault_rate``; WRITEs held in flight for 30 ms at 10× that rate, so
aborts race in-flight WRITEs). Every request is dispatched to both legs at once; a share
``abort_rate`` of them is cancelled on D at a random moment (before P finishes, right after, or a
few milliseconds later). When D reports a request cancelled or failed, its blocks are filled with
a sentinel (the engine would reuse them); after the run every sentinel must be intact, and
every D block no request named must still be zero.

``p_kills`` / ``d_kills`` SIGKILL rank processes mid-run and start them again under the same
engine id and rank (the same agent name, a new incarnation); ``p_pauses`` stops P rank
processes (SIGSTOP) for ``pause_s``. ``device`` and ``transport_inner`` (``cuda_ipc``) run it
on a GPU over kernel copies.

The report: ``requests``, ``verified`` (every D rank done, every byte checked), ``failed_with_reason``,
``aborted`` (reported cancelled), ``writes_into_freed_blocks``, ``leaked_handles`` (transfer
handles still held), ``leaked_blocks`` (requests a P or D rank still holds, or never reported),
``max_wait_s`` (dispatch to the last rank's report), ``settled_after_s`` (how long the ranks took
to release what they still held after the last report; leaks and writes into freed blocks are
counted after it, at most the lease plus two WRITE deadlines plus 2 s) and ``failure_reasons``
(counts by kind).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvpush.core.errors import WaitTimeout
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ModelSpec, ParallelConfig, RankKey
from kvpush.demo.rank import RankSpec
from kvpush.demo.runner import _Rank, _start_ranks, _stop

SOAK_MODEL = ModelSpec(name="soak-gqa", num_layers=4, num_kv_heads=2, head_dim=32, block_size=8)


@attrs.frozen(kw_only=True)
class SoakConfig:
    requests: int = 1000
    abort_rate: float = 0.1
    fault_rate: float = 0.01
    seed: int = 0
    prefill_pp: int = 2
    decode_tp: int = 2
    max_blocks: int = 4
    request_timeout_s: float = 6.0
    lease_s: float = 3.0
    heartbeat_interval_s: float = 0.25
    write_deadline_s: float = 1.5
    """P's WRITE deadline (D's quarantine of an unacknowledged cancel adds it to the freshness window)."""
    late_abort_ms: float = 30.0
    """Late aborts land uniformly within this many ms after dispatch."""
    transport_inner: str = "nixl"
    """The transport under ``faulty``: ``nixl``, or ``cuda_ipc`` on a GPU (kernel copies)."""
    device: str = "cpu"
    """Where every rank's caches live (``cuda[:N]`` for the GPU soak)."""
    faults: dict[str, Any] | None = attrs.field(default=None, hash=False)
    """Faulty-transport options replacing the ones derived from ``fault_rate`` (tests)."""
    timeout_s: float = 240.0
    """Bound on the whole run after dispatch."""
    p_kills: int = 0
    """P rank processes killed (SIGKILL) during dispatch and restarted under the same engine id
    and rank (so the same agent name): a new incarnation while D still holds the old one's
    requests. Spread evenly over the dispatch, P ranks in turn."""
    d_kills: int = 0
    """D rank processes killed (SIGKILL) during dispatch and restarted under the same engine id
    and rank: P holds registrations of the dead incarnation while the new one registers."""
    p_pauses: int = 0
    """P rank processes stopped (SIGSTOP) for ``pause_s`` during dispatch, then continued: the
    whole process stalls (writer, heartbeat answers, engine calls), not one thread."""
    pause_s: float = 2.0
    kill_when_idle: bool = False
    """Kill a P or D rank only once every request dispatched so far is resolved (idle)."""
    p_down_s: float = 0.0
    """How long a killed P rank stays down before its restart (dispatch waits meanwhile, as a
    router would for an unhealthy prefill engine)."""
    scribble_freed: int = 0
    """Negative control for the checker: D overwrites this many released requests' blocks (as a
    late WRITE would) before the freed-block check, which must then report them."""


def _fault_options(cfg: SoakConfig) -> dict[str, Any]:
    if cfg.faults is not None:
        return {"inner": cfg.transport_inner, "seed": cfg.seed, **cfg.faults}
    rate = cfg.fault_rate
    return {
        "inner": cfg.transport_inner,
        "seed": cfg.seed,
        "drop_notifs": rate,
        "dup_notifs": rate,
        "delay_notifs": rate,
        "delay_s": 0.05,
        "fail_posts": rate,
        "fail_writes": rate,
        "slow_writes": min(1.0, 10 * rate),
        "write_delay_s": 0.03,
        "raise_errors": rate,
        "stall_writer": rate / 500,  # a busy writer drains ~5000 times a second: a few stalls
        "stall_s": 0.2,
    }


def _specs(cfg: SoakConfig, p_port: int, d_port: int, log_dir: str) -> tuple[list[RankSpec], list[RankSpec]]:
    blocks = (cfg.requests * cfg.max_blocks + 8,)
    common = {
        "model": SOAK_MODEL,
        "layout": "uniform",
        "blocks_per_group": blocks,
        "device": cfg.device,
        "request_timeout_s": cfg.request_timeout_s,
        "lease_s": cfg.lease_s,
        "transport": "faulty",
        "log_level": "INFO",  # into log_dir: the slowest request's trail in the report
        "transport_options": _fault_options(cfg),
        "worker_options": {
            "heartbeat_interval_s": cfg.heartbeat_interval_s,
            "write_deadline_s": cfg.write_deadline_s,
            "registration_ttl_s": max(cfg.request_timeout_s * 2, 10.0),
        },
    }
    p_specs = [
        RankSpec(
            role="prefill",
            engine_id="prefill-0",
            parallel=ParallelConfig.for_stage(
                num_layers=SOAK_MODEL.num_layers, pp_size=cfg.prefill_pp, pp_rank=pp, tp_size=1, tp_rank=0
            ),
            side_channel_port=p_port,
            log_file=os.path.join(log_dir, f"prefill-pp{pp}.log"),
            **common,
        )
        for pp in range(cfg.prefill_pp)
    ]
    d_specs = [
        RankSpec(
            role="decode",
            engine_id="decode-0",
            parallel=ParallelConfig(tp_size=cfg.decode_tp, tp_rank=tp, num_layers=SOAK_MODEL.num_layers),
            side_channel_port=d_port,
            log_file=os.path.join(log_dir, f"decode-tp{tp}.log"),
            **common,
        )
        for tp in range(cfg.decode_tp)
    ]
    return p_specs, d_specs


def _reason_kind(reason: str) -> str:
    """A short kind for a failure reason (for the counts in the report)."""
    for pattern, kind in (
        (r"injected post failure", "injected post failure"),
        (r"injected non-kvpush error", "injected non-kvpush error (contained)"),
        (r"cancelled by D rank", "cancelled by D rank (another D rank failed first)"),
        (r"ended in error", "WRITE ended in error"),
        (r"no completion within", "watchdog (no completion in time)"),
        (r"unreachable", "P unreachable"),
        (r"handshake", "handshake failed"),
        (r"D rank killed", "D rank killed (soak)"),
    ):
        if re.search(pattern, reason):
            return kind
    return reason[:60]


_PAUSED: list[threading.Timer] = []
"""Pending SIGCONTs of paused P ranks (sent at once if the soak ends first)."""


def _disruption_schedule(cfg: SoakConfig) -> dict[int, str]:
    """Dispatch index -> ``"kill"`` / ``"pause"`` (a P rank) or ``"dkill"`` (a D rank), spread
    evenly over the run."""
    kinds = ["kill"] * cfg.p_kills + ["pause"] * cfg.p_pauses + ["dkill"] * cfg.d_kills
    random.Random(cfg.seed + 7).shuffle(kinds)
    step = cfg.requests / (len(kinds) + 1)
    return {max(1, round(step * (i + 1))): kind for i, kind in enumerate(kinds)}


def _disrupt(
    kind: str,
    index: int,
    cfg: SoakConfig,
    plans: list[dict[str, Any]],
    p_specs: list[RankSpec],
    p_server: SideChannelServer,
    d_specs: list[RankSpec],
    d_server: SideChannelServer,
    tracker: _Tracker,
    ranks: list[_Rank],
    say: Callable[[str], None],
) -> None:
    """Kill and restart, or pause, the P rank whose turn it is (``index`` picks it); or kill and
    restart a D rank."""
    if cfg.kill_when_idle and kind != "pause":
        idle_by = time.monotonic() + cfg.timeout_s
        while len(tracker.resolved_at) < index and time.monotonic() < idle_by:
            tracker.poll()
            time.sleep(0.05)
    if kind == "dkill":
        _restart_decode_rank(index, d_specs, d_server, tracker, ranks, say)
        return
    slot = index % len(tracker.p_ranks)
    victim = tracker.p_ranks[slot]
    if kind == "pause":
        say(f"[soak] request {index}: P rank {victim.key} stopped for {cfg.pause_s}s")
        os.kill(victim.process.pid, signal.SIGSTOP)
        pid = victim.process.pid

        def resume() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

        timer = threading.Timer(cfg.pause_s, resume)
        _PAUSED.append(timer)
        timer.start()
        return
    say(f"[soak] request {index}: P rank {victim.key} killed, restarting under the same name")
    victim.process.kill()
    victim.process.join(timeout=10)
    tracker.rank_killed(victim.key)
    tracker.p_ranks.pop(slot)
    down_until = time.monotonic() + cfg.p_down_s
    while time.monotonic() < down_until:
        tracker.poll()
        time.sleep(0.05)
    spec = next(spec for spec in p_specs if spec.parallel.rank == victim.key)
    (fresh,), payloads = _start_ranks([spec], timeout_s=120)
    ranks.append(fresh)
    tracker.p_ranks.insert(slot, fresh)
    fresh.call(("prepare", [(p["rid"], p["seed"], p["p_ids"]) for p in plans[index:]]), timeout_s=300)
    p_server.publish_all(payloads)
    tracker.restarted_at[index] = time.monotonic()


def _restart_decode_rank(
    index: int,
    d_specs: list[RankSpec],
    d_server: SideChannelServer,
    tracker: _Tracker,
    ranks: list[_Rank],
    say: Callable[[str], None],
) -> None:
    """SIGKILL a D rank and start it again under the same name; the requests it had end with it
    (its blocks went with its memory), the ones dispatched from now on go to the new process."""
    slot = index % len(tracker.d_ranks)
    victim = tracker.d_ranks[slot]
    say(f"[soak] request {index}: D rank {victim.key} killed, restarting under the same name")
    victim.process.kill()
    victim.process.join(timeout=10)
    for rid in tracker.dispatched:
        per_rank = tracker.d_outcome.setdefault(rid, {})
        if victim.key not in per_rank:
            per_rank[victim.key] = ("failed", "D rank killed")
        if per_rank[victim.key][0] != "done":  # reported failed or cancelled, maybe not released:
            tracker.released.setdefault(rid, set()).add(victim.key)  # its memory is gone with it
    spec = next(spec for spec in d_specs if spec.parallel.rank == victim.key)
    (fresh,), payloads = _start_ranks([spec], timeout_s=120)
    ranks.append(fresh)
    tracker.d_ranks[slot] = fresh
    d_server.publish_all(payloads)
    tracker.restarted_at[index] = time.monotonic()


def run_soak(cfg: SoakConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the soak and return its report (see the module docstring)."""
    say = progress or (lambda _msg: None)
    rng = random.Random(cfg.seed)
    p_server, d_server = SideChannelServer("prefill-0"), SideChannelServer("decode-0")
    ranks: list[_Rank] = []
    log_dir = tempfile.TemporaryDirectory(prefix="kvpush-soak-")
    try:
        p_specs, d_specs = _specs(cfg, p_server.port, d_server.port, log_dir.name)
        say(
            f"[soak] starting {len(p_specs)} prefill and {len(d_specs)} decode processes "
            f"(faulty/{cfg.transport_inner}, {cfg.device})"
        )
        p_ranks, p_payloads = _start_ranks(p_specs, timeout_s=120)
        ranks += p_ranks
        d_ranks, d_payloads = _start_ranks(d_specs, timeout_s=120)
        ranks += d_ranks
        p_server.publish_all(p_payloads)
        d_server.publish_all(d_payloads)

        plans = []
        p_free = rng.sample(range(cfg.requests * cfg.max_blocks), cfg.requests * cfg.max_blocks)
        d_free = rng.sample(range(cfg.requests * cfg.max_blocks), cfg.requests * cfg.max_blocks)
        for index in range(cfg.requests):
            length = rng.randint(1, cfg.max_blocks)
            abort = rng.random() < cfg.abort_rate
            plans.append(
                {
                    "rid": f"soak-{index}",
                    "seed": cfg.seed * 100_003 + index + 1,
                    "p_ids": [[p_free.pop() for _ in range(length)]],
                    "d_ids": [[d_free.pop() for _ in range(length)]],
                    "abort": rng.choice(("before_finish", "after_finish", "late")) if abort else None,
                    "abort_after_s": rng.uniform(0, cfg.late_abort_ms / 1e3),
                }
            )
        for rank in p_ranks:
            rank.call(("prepare", [(p["rid"], p["seed"], p["p_ids"]) for p in plans]), timeout_s=300)
        params = {
            "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1",
            "remote_port": p_server.port,
            "tp_size": 1,
            "pp_size": cfg.prefill_pp,
        }
        say(f"[soak] dispatching {cfg.requests} requests (abort {cfg.abort_rate}, faults {cfg.fault_rate})")
        tracker = _Tracker([p["rid"] for p in plans], p_ranks, d_ranks, log_dir.name)
        dispatched, late = tracker.dispatched, tracker.late
        disruptions = _disruption_schedule(cfg)
        for index, plan in enumerate(plans):
            if index % 25 == 0:
                tracker.poll()
            if index in disruptions:
                engines = (p_specs, p_server, d_specs, d_server)
                _disrupt(disruptions[index], index, cfg, plans, *engines, tracker, ranks, say)
            rid = plan["rid"]
            request_params = {**params, "transfer_id": f"xfer-{rid}", "remote_request_id": rid}
            dispatched[rid] = time.monotonic()
            for rank in d_ranks:
                rank.call(("add", rid, plan["d_ids"], request_params, plan["seed"], [0]))
            if plan["abort"] == "before_finish":
                for rank in d_ranks:
                    rank.call(("cancel", rid))
            for rank in p_ranks:
                rank.call(("finish", rid, plan["p_ids"], f"xfer-{rid}"))
            if plan["abort"] == "after_finish":
                for rank in d_ranks:
                    rank.call(("cancel", rid))
            elif plan["abort"] == "late":
                late.append((dispatched[rid] + plan["abort_after_s"], rid))
        return _collect(cfg, tracker, say, {p["rid"]: p["abort"] for p in plans})
    finally:
        for timer in _PAUSED:
            timer.cancel()
            timer.function()  # SIGCONT every paused rank before stopping it
        _PAUSED.clear()
        _stop(ranks)
        p_server.close()
        d_server.close()
        log_dir.cleanup()


@attrs.define
class _Tracker:
    """Outcomes per request and rank, polled from the rank processes (also during dispatch, so
    a request's wait is measured from its own dispatch)."""

    rids: list[str]
    p_ranks: list[_Rank]
    d_ranks: list[_Rank]
    log_dir: str
    """The rank processes' logs (INFO), one file per rank."""
    late: list[tuple[float, str]] = attrs.field(factory=list)
    dispatched: dict[str, float] = attrs.field(factory=dict)
    d_outcome: dict[str, dict[RankKey, tuple[str, Any]]] = attrs.field(factory=dict)
    p_outcome: dict[str, dict[RankKey, str | None]] = attrs.field(factory=dict)
    resolved_at: dict[str, float] = attrs.field(factory=dict)
    reported_at: dict[str, float] = attrs.field(factory=dict)
    """When every D rank had reported the request (its blocks may be released later)."""
    released: dict[str, set[RankKey]] = attrs.field(factory=dict)
    """D ranks that released a failed or cancelled request's blocks."""
    restarted_at: dict[int, float] = attrs.field(factory=dict)
    """Dispatch index -> when a killed rank's new process was published."""

    def rank_killed(self, key: RankKey) -> None:
        """A P rank process died: it reports nothing more for the requests dispatched so far."""
        for rid in self.dispatched:
            self.p_outcome.setdefault(rid, {}).setdefault(key, "killed")

    def poll(self) -> None:
        now = time.monotonic()
        self.late.sort()
        while self.late and self.late[0][0] <= now:
            _, rid = self.late.pop(0)
            for rank in self.d_ranks:
                rank.call(("cancel", rid))
        for rank in self.d_ranks:
            polled = rank.call(("poll",))
            for kind in ("done", "failed", "cancelled"):
                for rid, value in polled[kind].items():
                    self.d_outcome.setdefault(rid, {})[rank.key] = (kind, value)
            for rid in polled["released"]:
                self.released.setdefault(rid, set()).add(rank.key)
        for rank in self.p_ranks:
            polled = rank.call(("poll",))
            for rid in polled["sent"]:
                self.p_outcome.setdefault(rid, {})[rank.key] = None
            for rid, reason in polled["failed"].items():
                self.p_outcome.setdefault(rid, {})[rank.key] = reason
        now = time.monotonic()
        for rid, per_rank in self.d_outcome.items():
            if rid not in self.resolved_at and len(per_rank) == len(self.d_ranks):
                self.reported_at.setdefault(rid, now)
                freed = self.released.get(rid, set())
                if all(kind == "done" or key in freed for key, (kind, _) in per_rank.items()):
                    self.resolved_at[rid] = now  # reported, and any blocks to free released


def _collect(
    cfg: SoakConfig, tracker: _Tracker, say: Callable[[str], None], plans_abort: dict[str, str | None]
) -> dict[str, Any]:
    rids, late, dispatched, resolved_at = tracker.rids, tracker.late, tracker.dispatched, tracker.resolved_at
    p_ranks, d_ranks = tracker.p_ranks, tracker.d_ranks
    for rid in rids:
        tracker.d_outcome.setdefault(rid, {})
        tracker.p_outcome.setdefault(rid, {})
    d_outcome, p_outcome = tracker.d_outcome, tracker.p_outcome
    deadline = time.monotonic() + cfg.timeout_s
    reported = -1
    while True:
        tracker.poll()
        now = time.monotonic()
        p_done = sum(1 for rid in rids if len(p_outcome[rid]) == len(p_ranks))
        if len(resolved_at) != reported:
            reported = len(resolved_at)
            say(f"[soak] D resolved {reported}/{len(rids)}, P reported {p_done}/{len(rids)}")
        if (len(resolved_at) == len(rids) and p_done == len(rids) and not late) or now > deadline:
            break
        time.sleep(0.02)

    verified = failed = aborted = unresolved = 0
    verified_rids: set[str] = set()
    reasons: collections.Counter[str] = collections.Counter()
    bad_outcomes: dict[str, str] = {}
    for rid in rids:
        per_rank = d_outcome[rid]
        if len(per_rank) != len(d_ranks):
            unresolved += 1
            continue
        kinds = {kind for kind, _ in per_rank.values()}
        if "cancelled" in kinds:
            aborted += 1
        elif kinds == {"done"}:
            misses = [r["miss"] for _, r in per_rank.values() if not r["ok"]]
            if misses:
                bad_outcomes[rid] = misses[0]
            else:
                verified += 1
                verified_rids.add(rid)
        else:
            failed += 1
            for kind, reason in per_rank.values():
                if kind == "failed":
                    if not reason:
                        bad_outcomes[rid] = "failed without a reason"
                    reasons[_reason_kind(reason)] += 1
    # Settle first: a WRITE still running when the ranks reported must land (or not) before the
    # freed and unnamed blocks are checked.
    health, settled_after_s = _settled_health(cfg, [*p_ranks, *d_ranks], p_ranks)
    freed_bad: dict[str, str] = {}
    if cfg.scribble_freed:
        d_ranks[0].call(("scribble", cfg.scribble_freed))
    untouched_bad: list[str] = []
    for rank in d_ranks:
        freed_bad.update(rank.call(("check_freed",), timeout_s=120))
        untouched = rank.call(("check_untouched",), timeout_s=120)
        untouched_bad += [f"D rank {rank.key}: {what}" for what in untouched]
    leaked_handles = sum(h["outstanding_handles"] for h in health.values())
    held = sum(_held(h) for h in health.values())
    p_unreported = sum(1 for rid in rids if len(p_outcome[rid]) != len(p_ranks))
    waits = [resolved_at[rid] - dispatched[rid] for rid in resolved_at]
    return {
        "requests": len(rids),
        "verified": verified,
        "failed_with_reason": failed,
        "aborted": aborted,
        "writes_into_freed_blocks": len(freed_bad),
        "writes_into_unnamed_blocks": len(untouched_bad),
        "leaked_handles": leaked_handles,
        "leaked_blocks": held + p_unreported + unresolved,
        "max_wait_s": round(max(waits), 3) if waits else None,
        "settled_after_s": settled_after_s,
        "slowest": _slowest(tracker, plans_abort),
        "cancels_racing_a_write": sum(h["stats"].get("cancels_during_write", 0) for h in health.values()),
        "unresolved": unresolved,
        "after_restart": _after_restart(tracker, verified_rids),
        "p_kills": cfg.p_kills,
        "p_pauses": cfg.p_pauses,
        "d_kills": cfg.d_kills,
        "wrong_bytes_or_no_reason": len(bad_outcomes),
        "failure_reasons": dict(reasons.most_common()),
        "examples": {
            **dict(list(bad_outcomes.items())[:5]),
            **dict(list(freed_bad.items())[:5]),
            **{f"unnamed-{i}": what for i, what in enumerate(untouched_bad[:5])},
        },
        "health": health,
        "config": attrs.asdict(cfg),
    }


def _held(health: dict[str, Any]) -> int:
    """Requests, blocks and transfer handles a rank's health report says it still holds."""
    return sum(health.get(key, 0) for key in ("finished", "inflight", "pending", "outstanding_handles"))


def _settled_health(cfg: SoakConfig, ranks: list[Any], p_ranks: list[Any]) -> tuple[dict[str, Any], float]:
    """Every rank's health once none holds anything, or at the settle bound: a rank that
    reported a request's end may still be releasing it (an aborted WRITE's handle, a failed
    request's blocks held until its last WRITE ended), so a leak is what is still held after
    every deadline that frees it (the lease, a WRITE deadline, a second WRITE deadline for the
    fence) has passed. Returns the health and the seconds the settling took."""
    bound_s = cfg.lease_s + 2 * cfg.write_deadline_s + 2.0
    start = time.monotonic()
    while True:
        health = {str(rank.key) + ("P" if rank in p_ranks else "D"): rank.call(("health",)) for rank in ranks}
        waited = time.monotonic() - start
        if not any(_held(h) for h in health.values()) or waited > bound_s:
            return health, round(waited, 3)
        time.sleep(0.05)


def _slowest(tracker: _Tracker, aborts: dict[str, str | None]) -> dict[str, Any] | None:
    """The request that waited longest: when D reported it and released its blocks, and what
    each rank said (the liveness bound's diagnosis)."""
    if not tracker.resolved_at:
        return None
    rid = max(tracker.resolved_at, key=lambda r: tracker.resolved_at[r] - tracker.dispatched[r])
    start = tracker.dispatched[rid]
    return {
        "rid": rid,
        "abort": aborts.get(rid),
        "reported_after_s": round(tracker.reported_at.get(rid, float("nan")) - start, 3),
        "resolved_after_s": round(tracker.resolved_at[rid] - start, 3),
        "decode": {
            str(key): kind if kind != "failed" else f"failed: {value}"
            for key, (kind, value) in tracker.d_outcome.get(rid, {}).items()
        },
        "prefill": {str(key): reason or "sent" for key, reason in tracker.p_outcome.get(rid, {}).items()},
        "trail": _trail(tracker.log_dir, rid, start, tracker.resolved_at[rid]),
    }


TRAIL_LINES = 60


def _trail(log_dir: str, rid: str, start: float, end: float) -> list[str]:
    """The ranks' log lines about ``rid``, and those about no request at all (handshakes,
    fences), from its dispatch to its release: at most ``TRAIL_LINES``, times in seconds since
    its dispatch."""
    wall = time.time() - time.monotonic()  # the logs stamp wall-clock time
    about_rid = re.compile(rf"\b{re.escape(rid)}\b")
    lines: list[tuple[float, str]] = []
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), errors="replace") as log:
            for line in log:
                stamp, _, text = line.rstrip("\n").partition(" ")
                try:
                    at = float(stamp) - wall
                except ValueError:
                    continue  # a traceback's continuation line
                if start - 0.1 <= at <= end + 0.1 and (about_rid.search(text) or "soak-" not in text):
                    lines.append((at, f"+{at - start:.3f} {text[:300]}"))
    lines.sort()
    if len(lines) > TRAIL_LINES:
        half = TRAIL_LINES // 2
        skipped = len(lines) - 2 * half
        lines = [*lines[:half], (0.0, f"... {skipped} lines ..."), *lines[-half:]]
    return [text for _, text in lines]


def _after_restart(tracker: _Tracker, verified_rids: set[str]) -> dict[str, int] | None:
    """Requests dispatched after the last restart: how many, and how many were verified."""
    if not tracker.restarted_at:
        return None
    later = tracker.rids[max(tracker.restarted_at) :]
    return {"requests": len(later), "verified": sum(rid in verified_rids for rid in later)}


def soak_ok(report: dict[str, Any]) -> bool:
    """No write into a freed block, no leak, and every request accounted for with a reason."""
    return not soak_failures(report)


def soak_failures(report: dict[str, Any]) -> str:
    """Which of ``soak_ok``'s checks failed, with their counts and the report's evidence (the
    examples, the health of every rank), as one string for an assertion message; empty when
    none failed."""
    counted = report["verified"] + report["failed_with_reason"] + report["aborted"]
    failed = [
        f"{key}={report.get(key, 0)}"
        for key in (
            "writes_into_freed_blocks",
            "writes_into_unnamed_blocks",
            "leaked_handles",
            "leaked_blocks",
            "wrong_bytes_or_no_reason",
        )
        if report.get(key, 0)
    ]
    if counted != report["requests"]:
        failed.append(f"accounted for {counted} of {report['requests']} requests")
    if not failed:
        return ""
    evidence = {k: report.get(k) for k in ("unresolved", "examples", "health", "failure_reasons")}
    return "soak failed: " + ", ".join(failed) + "\n" + json.dumps(evidence, default=str, indent=1)


KEYS = (
    "requests",
    "verified",
    "failed_with_reason",
    "aborted",
    "writes_into_freed_blocks",
    "writes_into_unnamed_blocks",
    "leaked_handles",
    "leaked_blocks",
    "max_wait_s",
    "settled_after_s",
)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``kvpush demo --soak N`` (flags: --abort-rate, --fault-rate, --seed, --json)."""
    cfg = SoakConfig(
        requests=args.soak,
        abort_rate=args.abort_rate,
        fault_rate=args.fault_rate,
        seed=args.seed,
        prefill_pp=args.prefill_pp,
        decode_tp=args.decode_tp,
        p_kills=args.p_kills,
        p_pauses=args.p_pauses,
        d_kills=args.d_kills,
        device=args.device,
        transport_inner=getattr(args, "transport", "nixl"),
    )
    started = time.monotonic()
    try:
        report = run_soak(cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (WaitTimeout, RuntimeError) as err:
        print(f"soak failed: {err}", file=sys.stderr)
        return 2
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    ok = soak_ok(report)
    if args.json:
        print(json.dumps({"ok": ok, **{k: report[k] for k in KEYS}, "details": report}, indent=2))
    else:
        for key in (*KEYS, "slowest", "cancels_racing_a_write", "failure_reasons", "elapsed_s"):
            print(f"{key:>26}: {report[key]}")
        for rid, what in report["examples"].items():
            print(f"  {rid}: {what}")
        print(
            "soak OK" if ok else "SOAK FAILED: a write into a freed block, a leak or an unexplained request"
        )
    return 0 if ok else 1
