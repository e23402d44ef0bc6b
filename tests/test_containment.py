"""Issue 11.1: every per-request step has one exit. An exception that is not a KvpushError —
from a third-party plugin, torch, numpy or a transport breaking its contract — fails that
request (D told, blocks released) and nothing else: the rest of the batch still flows."""

from __future__ import annotations

import pytest
from cluster import Cluster
from test_push_flow import assert_pushed

from kvpush import hookimpl
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)


class ExplodingPlan:
    """A read-spec plugin that raises ZeroDivisionError for one request's blocks."""

    @staticmethod
    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(job):
        if job.remote_block_ids and 13 in job.remote_block_ids[0]:
            return 1 // 0
        return None


def test_a_plugin_raising_zero_division_fails_that_request_only() -> None:
    with Cluster(request_timeout_s=60) as cluster:
        cluster.pm.register(ExplodingPlan(), "exploding_plan")
        cluster.add("bad", [[13]], "x-bad")
        cluster.add("good", [[20, 21]], "x-good")
        cluster.finish("p-bad", [[1]], "x-bad")
        cluster.finish("p-good", [[2, 3]], "x-good")
        assert cluster.wait_decode("good") == {0: None}
        assert_pushed(cluster, [2, 3], [20, 21])
        reason = cluster.wait_decode("bad", timeout_s=5)[0]
        assert reason is not None and "ZeroDivisionError" in reason
        assert "ZeroDivisionError" in cluster.wait_prefill("p-bad")[P0]
        cluster.wait_released("bad")
        assert cluster.senders[P0].core.state_sizes()["requests"] == 0


@pytest.mark.parametrize("decode_first", [True, False])
def test_a_finish_that_raises_before_the_core_recorded_it_is_still_reported(decode_first: bool) -> None:
    """The core's finish raising before it recorded the key left nothing for ``core.fail`` to
    fail: P's engine never heard of its prefill (its blocks held for ever) and D waited for
    its timeout. Now the prefill is reported failed and the key ends as a failure, so D's
    registration (sent before or after) is answered with FAIL."""
    with Cluster(request_timeout_s=60) as cluster:
        core = cluster.senders[P0].core
        finished = core.finished

        def raising(key, *args, **kwargs):  # type: ignore[no-untyped-def]
            if key == "x-bad":
                raise ZeroDivisionError("division by zero")
            return finished(key, *args, **kwargs)

        core.finished = raising
        if decode_first:
            cluster.add("bad", [[13]], "x-bad")
        cluster.finish("p-bad", [[1]], "x-bad")
        assert "ZeroDivisionError" in cluster.wait_prefill("p-bad")[P0]
        if not decode_first:
            cluster.add("bad", [[13]], "x-bad")
        reason = cluster.wait_decode("bad", timeout_s=5)[0]
        assert reason is not None and "ZeroDivisionError" in reason
        cluster.wait_released("bad")
        cluster.add("good", [[20, 21]], "x-good")
        cluster.finish("p-good", [[2, 3]], "x-good")
        assert cluster.wait_decode("good") == {0: None}
        assert_pushed(cluster, [2, 3], [20, 21])


def test_an_add_that_raises_before_the_core_recorded_it_is_reported_and_its_blocks_released() -> None:
    """The same on D: the core's add raising before it recorded the request left the engine
    without a report and the blocks claimed for ever (a later request naming them refused)."""
    with Cluster(request_timeout_s=60) as cluster:
        core = cluster.receivers[0].core
        add = core.add

        def raising(request, now):  # type: ignore[no-untyped-def]
            if request.request_id == "bad":
                raise ZeroDivisionError("division by zero")
            return add(request, now)

        core.add = raising
        cluster.add("bad", [[20, 21]], "x-bad")
        reason = cluster.wait_decode("bad", timeout_s=5)[0]
        assert reason is not None and "ZeroDivisionError" in reason
        cluster.wait_released("bad")
        cluster.add("good", [[20, 21]], "x-good")  # the same blocks: no longer claimed
        cluster.finish("p-good", [[2, 3]], "x-good")
        assert cluster.wait_decode("good") == {0: None}
        assert_pushed(cluster, [2, 3], [20, 21])


def test_planning_failure_and_a_good_request_to_the_same_unconnected_decode() -> None:
    """The concrete trigger on the old main: a planning failure's notif-only handshake merged
    with a good request's full handshake, and the good request was lost."""
    with Cluster(request_timeout_s=60) as cluster:
        cluster.finish("p-bad", [[1, 2]], "x-bad")  # D will register more blocks than P computed
        cluster.finish("p-good", [[5, 6]], "x-good")
        cluster.add("bad", [[7, 8, 9]], "x-bad")
        cluster.add("good", [[10, 11]], "x-good")
        assert cluster.wait_decode("good") == {0: None}
        assert_pushed(cluster, [5, 6], [10, 11])
        reason = cluster.wait_decode("bad")[0]
        assert reason is not None and "D registered 3 blocks" in reason


@pytest.mark.parametrize("where", ["post", "poll"])
def test_a_transport_raising_a_non_kvpush_error_fails_the_request_with_a_reason(where: str) -> None:
    options = {"transport": "faulty", "transport_options": {"inner": "loopback", "raise_errors": 1.0}}
    with Cluster(request_timeout_s=60, **options) as cluster:
        sender = cluster.senders[P0]
        sender.transport._rng.random = (lambda: 0.0) if where == "post" else (lambda: 0.9)  # type: ignore[method-assign]
        sender.transport.rates["raise_errors"] = 1.0
        cluster.add("d-1", [[4]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        p_reason = cluster.wait_prefill("p-1")[P0]
        assert p_reason is not None and "RuntimeError" in p_reason and "injected non-kvpush error" in p_reason
        d_reason = cluster.wait_decode("d-1", timeout_s=10)[0]
        if where == "post":
            assert d_reason is not None and "injected non-kvpush error" in d_reason
        else:  # the WRITE itself ran: D may have counted its DONE (the bytes landed) or P's FAIL
            assert d_reason is None or "injected non-kvpush error" in d_reason
        sender.transport.rates["raise_errors"] = 0.0  # the writer keeps going
        cluster.add("d-2", [[6]], "x-2")
        cluster.finish("p-2", [[7]], "x-2")
        assert cluster.wait_decode("d-2") == {0: None}
        assert sender.transport.outstanding_handles == 0
