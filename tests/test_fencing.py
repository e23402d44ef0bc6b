"""Issue 16, item 1: a paused P must not write into blocks D has freed.

P and D are rank processes over real NIXL (:class:`engines.Engines`). D registers requests, then
the P stage is stopped (SIGSTOP) for longer than D's ``peer_silence_s`` while its prefills finish
(the finish messages wait in the stopped rank's pipe). D declares the stage dead, fails the
requests at once and releases their blocks once no WRITE can land any more (freshness window +
P's WRITE deadline, connection dropped); the test fills the released blocks with a sentinel. Then
the stage resumes (SIGCONT) and handles the finishes: its registrations are stale, so it must
post nothing. Checked: every released block still holds the sentinel, P reports every request
failed (none "sent"), and P posted no WRITE for them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from engines import Engines
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)
REQUESTS = 10
HEARTBEAT_S, SILENCE_S, WRITE_DEADLINE_S = 0.2, 1.0, 1.0
PAUSE_S = SILENCE_S + 1.0
"""The stop lasts at least this long, and until D has released every request's blocks."""


def _engines(prefill_pp: int) -> Engines:
    return Engines(
        prefill_pp=prefill_pp,
        decode_tp=1,
        blocks=512,
        request_timeout_s=30.0,
        lease_s=1.5,
        heartbeat_interval_s=HEARTBEAT_S,
        peer_silence_s=SILENCE_S,
        write_deadline_s=WRITE_DEADLINE_S,
    )


def _poll_decode(engines: Engines) -> None:
    """Engines.poll for D only (a stopped P rank would not answer)."""
    for rank in engines.d_ranks:
        polled = rank.call(("poll",))
        for kind in ("done", "failed", "cancelled"):
            for rid, value in polled[kind].items():
                engines.d_results[rank.key][rid] = (kind, value)
        engines.released.update((rank.key, rid) for rid in polled["released"])


def _wait_decode_only(engines: Engines, what: str, predicate: Any, timeout_s: float) -> float:
    started = time.monotonic()
    while True:
        _poll_decode(engines)
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; D: {engines.d_results}")
        time.sleep(0.02)


def _p_writes(engines: Engines, rank: Any) -> int:
    return int(engines.health([rank])[0]["stats"]["writes"])


def sigstop_run(engines: Engines, run: int) -> dict[str, Any]:
    """One SIGSTOP scenario (the last P stage is stopped; any other stage runs on and pushes its
    part); returns what happened (the caller asserts)."""
    rids = [f"r{run}-{i}" for i in range(REQUESTS)]
    for i, rid in enumerate(rids):
        d_base = 16 + (run * REQUESTS + i) * 2
        engines.plan(rid, [2 + 2 * i, 3 + 2 * i], [d_base, d_base + 1])
    for rid in rids:
        engines.add(rid)
    engines.wait(
        "every P stage to hold every registration",
        lambda: all(h["stashed_registrations"] == REQUESTS for h in engines.health(engines.p_ranks)),
        15,
    )
    p_rank = engines.p_ranks[-1]
    writes = _p_writes(engines, p_rank)
    os.kill(p_rank.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        for rid in rids:  # the prefills finish while the stage is stopped
            p_rank.send(("finish", rid, engines.plans[rid]["p_ids"], f"xfer-{rid}"))
            engines.finish(rid, stages=range(p_rank.key.pp_rank))  # the running stages
        failed_after = _wait_decode_only(
            engines,
            "D to fail every request of the stopped stage",
            lambda: all(rid in engines.d_results[P0] for rid in rids),
            SILENCE_S + 10,
        )
        _wait_decode_only(
            engines,
            "D to release every request's blocks",
            lambda: all((P0, rid) in engines.released for rid in rids),
            SILENCE_S + WRITE_DEADLINE_S + 15,
        )
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - stopped)))
    finally:
        paused = time.monotonic() - stopped
        os.kill(p_rank.process.pid, signal.SIGCONT)
    for _ in rids:
        p_rank.reply(("finish",), timeout_s=30)
    engines.wait_prefill(rids, timeout_s=15)
    time.sleep(WRITE_DEADLINE_S / 2)  # a WRITE posted on resume would have landed by now
    return {
        "paused_s": paused,
        "failed_after_s": failed_after,
        "decode": {rid: engines.d_results[P0][rid][0] for rid in rids},
        "sent": sorted(rid for rid in rids if engines.p_results[p_rank.key][rid] is None),
        "late_writes": engines.d_ranks[0].call(("check_freed",)),
        "writes_posted": _p_writes(engines, p_rank) - writes,
    }


def _check(result: dict[str, Any]) -> None:
    assert result["paused_s"] > SILENCE_S
    assert set(result["decode"].values()) == {"failed"}, result["decode"]
    assert result["late_writes"] == {}, f"WRITEs landed in freed blocks: {result['late_writes']}"
    assert result["sent"] == [], f"P reported pushed into freed blocks: {result['sent']}"
    assert result["writes_posted"] == 0, result


def _sigstop_runs(runs: int, prefill_pp: int = 1) -> list[dict[str, Any]]:
    results = []
    with _engines(prefill_pp) as engines:
        engines.plan("warm", [0], [0])
        engines.add("warm")
        engines.finish("warm")
        engines.wait_decode(["warm"])
        for run in range(runs):
            result = sigstop_run(engines, run)
            results.append(result)
            print(  # the 20-run figure for the report (pytest -s)
                f"run {run}: paused {result['paused_s']:.1f}s, D failed after "
                f"{result['failed_after_s']:.1f}s, late writes {len(result['late_writes'])}, "
                f"writes posted {result['writes_posted']}, sent {len(result['sent'])}"
            )
            _check(result)
        # negative control: a late WRITE, simulated, is what check_freed reports
        engines.d_ranks[0].call(("scribble", 1))
        assert len(engines.d_ranks[0].call(("check_freed",))) == 1
    return results


@pytest.mark.parametrize("prefill_pp", [1, 2], ids=["PP1", "PP2-last-stage-paused"])
def test_paused_prefill_never_writes_into_freed_blocks(prefill_pp: int) -> None:
    _sigstop_runs(3, prefill_pp)


@pytest.mark.slow
@pytest.mark.parametrize("prefill_pp", [1, 2], ids=["PP1", "PP2-last-stage-paused"])
def test_paused_prefill_never_writes_into_freed_blocks_20_runs_in_a_row(prefill_pp: int) -> None:
    results = _sigstop_runs(20, prefill_pp)
    assert len(results) == 20
