"""A rank that dies and comes back under the same name (a supervisor restarting it) while D is
idle towards it: the requests that arrive after it is back must be served by the new process.

P rank: D's keepalives to the dead process went unanswered the whole time P was down, but an
idle agent's silence failed nothing and triggered nothing, so D kept the dead incarnation
loaded: every request after the restart registered with the dead process and failed at
``peer_silence_s``. Now an idle engine not heard from for ``peer_silence_s`` is handshaken
afresh at its next request. D rank: P failed every request of the D engine, also those of the
surviving rank and of the new process; now only those holding the old start's registration.
Core-level probes: tests/test_probe_restart_liveness.py.
"""

from __future__ import annotations

from kvpush.demo.soak import SoakConfig, run_soak, soak_failures, soak_ok


def test_requests_after_a_p_rank_restart_are_served_by_the_new_process() -> None:
    # Soak timers: heartbeat 0.25 s, peer silence 3 heartbeats + the 5 s handshake timeout. P's
    # rank is killed once D has resolved every request so far and stays down 8 s (longer than
    # that): D's keepalives to it go unanswered for 8 s.
    cfg = SoakConfig(
        requests=60, abort_rate=0.0, fault_rate=0.0, seed=2, p_kills=1, kill_when_idle=True, p_down_s=8.0
    )
    report = run_soak(cfg)
    assert soak_ok(report), soak_failures(report)
    after = report["after_restart"]
    assert after is not None and after["requests"] == 30
    assert after["verified"] == after["requests"], report["failure_reasons"]


def test_requests_after_a_d_rank_restart_are_served() -> None:
    # D rank 1 is killed once idle and started again under the same name at once. P, seeing its
    # new incarnation at the first registration, dropped every key bound to the D engine, also
    # the new requests D rank 0 (alive all along) and the new process registered after the
    # restart: they failed "P no longer holds ...: D engine 'decode-0' restarted".
    cfg = SoakConfig(requests=60, abort_rate=0.0, fault_rate=0.0, seed=2, d_kills=1, kill_when_idle=True)
    report = run_soak(cfg)
    assert soak_ok(report), soak_failures(report)
    after = report["after_restart"]
    assert after is not None and after["requests"] == 30
    assert after["verified"] == after["requests"], report["failure_reasons"]


def test_requests_after_a_p_rank_killed_mid_traffic_are_served() -> None:
    # P's rank is killed right after 20 requests were dispatched, while D's ranks are still in
    # their first handshake with it (greeting it, or fetching its metadata, which P's side
    # channel serves until the new process is published). D took that for P failing: in 1 run
    # of about 8 every request failed, also the 20 dispatched after the restart
    # (tests/test_restart_during_handshake.py). The requests in flight at the kill may fail
    # (with a reason); every one dispatched after the new process was published is served.
    cfg = SoakConfig(requests=40, abort_rate=0.0, fault_rate=0.0, seed=5, p_kills=1)
    report = run_soak(cfg)
    assert soak_ok(report), soak_failures(report)
    after = report["after_restart"]
    assert after is not None and after["requests"] == 20
    assert after["verified"] == after["requests"], report["failure_reasons"]
