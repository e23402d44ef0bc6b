"""Copies no fence stops, across real processes. A ``cuda_ipc`` WRITE is a kernel in P's
process: P cannot abort it at its deadline and D's fence does not stop it, so D must hold a
failed request's blocks until P says the copy ended or P's process has exited. On the CPU the
``faulty`` transport's ``kernel_copies`` publishes exactly that over real NIXL, and
``slow_writes`` stalls every copy (a device stuck in a kernel)."""

from __future__ import annotations

import time
from typing import Any

from rank_engines import Engines

TIMINGS: dict[str, Any] = {
    "request_timeout_s": 1.0,
    "heartbeat_interval_s": 0.2,
    "peer_silence_s": 1.0,
    "write_deadline_s": 1.0,
}


def _stalled(stall_s: float) -> dict[str, Any]:
    options = {"inner": "nixl", "kernel_copies": True, "slow_writes": 1.0, "write_delay_s": stall_s}
    return {"transport": "faulty", "transport_options": options, **TIMINGS}


def _push(engines: Engines) -> float:
    engines.plan("a", [1, 2], [3, 4])
    engines.add("a")
    started = time.monotonic()
    engines.finish("a")
    engines.wait_decode(["a"], timeout_s=10)
    ((kind, reason),) = engines.decode_outcome("a").values()
    assert kind == "failed", (kind, reason)
    return started


def test_a_stalled_copy_keeps_d_blocks_until_p_says_it_ended() -> None:
    """The copy outlasts P's WRITE deadline, D's watchdog and D's quarantine: D fails the
    request for its engine at once but releases the blocks only after the copy landed."""
    stall_s = 6.0
    with Engines(**_stalled(stall_s)) as engines:
        started = _push(engines)
        engines.wait_released(["a"], timeout_s=stall_s + 10)
        released_after = time.monotonic() - started
        assert released_after >= stall_s, f"released {released_after:.1f}s in, before the copy landed"
        (d_health,) = engines.health(engines.d_ranks)
        (p_health,) = engines.health(engines.p_ranks)
        assert d_health["stats"]["held_for_kernel_copies"] == 1
        assert p_health["stats"]["overdue_kernel_writes"] >= 1
        assert p_health["stats"]["write_deadline_expiries"] == 0
        assert d_health["outstanding_handles"] == 0 and p_health["outstanding_handles"] == 0


def test_a_held_request_goes_back_once_p_exited_and_not_before() -> None:
    """P's copy would run for a minute; P is killed while D holds the blocks. The copy ended
    with the process: D sees the exit in /proc and releases (after a fence)."""
    with Engines(**_stalled(60.0)) as engines:
        _push(engines)
        engines.wait(
            "D to hold the request",
            lambda: engines.health(engines.d_ranks)[0]["stats"]["held_for_kernel_copies"] == 1,
            timeout_s=15,
        )
        time.sleep(1.0)  # five more hold rounds: the probe finds P running, the cancel goes unanswered
        engines.poll()
        assert not engines.released, "released while P's copy may still run"
        engines.kill(engines.p_ranks[0])
        took = engines.wait_released(["a"], timeout_s=10)
        assert took < 3.0, f"D took {took:.1f}s to see P's exit"
        (d_health,) = engines.health(engines.d_ranks)
        assert d_health["stats"]["fences"] >= 1 and d_health["outstanding_handles"] == 0
