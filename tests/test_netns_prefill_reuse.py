"""A WRITE P gave up on must not read P's blocks after P handed them back to its engine.

P aborts a WRITE at its deadline (the link is down), reports the request failed and its engine
reuses the blocks at once (the rank overwrites them). If the transport still holds the WRITE,
the link's return sends it on, reading the blocks as they are *then*; D, still waiting (its
silence bound is longer than the outage), takes the DONE that follows the data before P's FAIL
and reports done with another prefill's bytes. Here every request must be verified byte for
byte or fail named; none may be reported done with wrong bytes.
"""

from __future__ import annotations

import time

import pytest
from netns_harness import MultiHost, quarantine_s, unavailable_reason
from test_multihost_netns import SLACK_S, _save, assert_outcomes, push_ok

REASON = unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(600)]

TIMERS = {
    "request_timeout_s": 30.0,
    "lease_s": 6.0,
    "heartbeat_interval_s": 0.5,
    "peer_silence_s": 20.0,
    "write_deadline_s": 2.0,
}
"""P gives up on a WRITE after 2 s; D waits 20 s for a silent P: an 8 s outage ends in between."""
OUTAGE_S = 8.0


@pytest.mark.multihost
def test_a_write_p_aborted_never_carries_the_blocks_p_handed_back() -> None:
    bound = TIMERS["request_timeout_s"] + quarantine_s(TIMERS) + SLACK_S
    with MultiHost(prefill_pp=1, decode_tp=1, timers=TIMERS, reuse_failed=True) as hosts:
        hosts.record["test"] = "write_p_aborted_never_carries_the_blocks_p_handed_back"
        try:
            push_ok(hosts, ["warm-0"], bound)
            rids = [f"stuck-{i}" for i in range(8)]
            hosts.plan(rids, num_blocks=96)
            hosts.dispatch(rids)
            hosts.link_down()
            ends = time.monotonic() + OUTAGE_S
            p_rank = hosts.p_ranks[0].key
            hosts.wait(
                "P to give up on every WRITE (its deadline) and report the requests failed",
                lambda: all(rid in hosts.p_results[p_rank] for rid in rids),
                OUTAGE_S,
            )
            time.sleep(max(0.0, ends - time.monotonic()))
            hosts.link_up()
            hosts.wait_decode(rids, bound)
            counts = assert_outcomes(hosts, rids, bound)
            hosts.record["outcomes"] = counts
        finally:
            _save(hosts.record)
