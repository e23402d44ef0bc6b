"""The soak (``kvpush demo --soak N``): concurrent requests PP2 -> TP2 over NIXL processes with
random aborts and injected faults. The full 1000-request run and its output are in
docs/reliability.md; here a smaller N keeps the suite fast."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpush.demo.soak import KEYS, SoakConfig, run_soak, soak_ok

PYTHON_CLI = (sys.executable, "-m", "kvpush.cli")


def test_soak_with_aborts_and_faults_writes_nothing_into_freed_blocks_and_leaks_nothing() -> None:
    report = run_soak(SoakConfig(requests=300, abort_rate=0.2, fault_rate=0.02, seed=11))
    assert soak_ok(report), report
    assert report["requests"] == 300
    assert report["verified"] + report["failed_with_reason"] + report["aborted"] == 300
    assert report["writes_into_freed_blocks"] == 0
    assert report["leaked_handles"] == 0 and report["leaked_blocks"] == 0
    assert report["aborted"] > 0 and report["failed_with_reason"] > 0 and report["verified"] > 0
    # bounded: the watchdog (6 s) plus the cancel-ack timeout (1.5 s) plus slack
    assert report["max_wait_s"] < 6.0 + 1.5 + 3.0


def test_the_freed_block_check_catches_a_protocol_without_the_cancel_handshake() -> None:
    # Negative control: CANCEL is lost and D frees at once (no ack wait), while PUSH_REGs are
    # slow to reach P: P then writes into freed blocks, and the soak must say so.
    broken = run_soak(
        SoakConfig(
            requests=20,
            abort_rate=1.0,
            seed=3,
            cancel_ack_timeout_s=0.0,
            faults={
                "drop_notifs": 1.0,
                "drop_prefixes": ["CANCEL:"],
                "delay_notifs": 1.0,
                "delay_prefixes": ["PUSH_REG:"],
                "delay_s": 0.4,
            },
        )
    )
    assert broken["writes_into_freed_blocks"] > 0
    assert not soak_ok(broken)
    # The same delays with the handshake in place: nothing is written into freed blocks.
    safe = run_soak(
        SoakConfig(
            requests=20,
            abort_rate=1.0,
            seed=3,
            faults={"delay_notifs": 1.0, "delay_prefixes": ["PUSH_REG:"], "delay_s": 0.4},
        )
    )
    assert safe["writes_into_freed_blocks"] == 0 and soak_ok(safe), safe


def test_cli_soak_prints_the_report_as_json_and_exits_zero() -> None:
    done = subprocess.run(
        [*PYTHON_CLI, "demo", "--soak", "40", "--abort-rate", "0.25", "--fault-rate", "0.02", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert set(KEYS) <= set(report)
    assert report["requests"] == 40
