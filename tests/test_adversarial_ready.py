"""Adversarial review of ``PushSender.request_finished(..., ready=...)``: nothing of a prefill
may be posted before its ``ready`` says the KV is written, or D receives the KV as it was
before the prefill, silently. What if ``query()`` answers with something other than a bool,
the request is aborted or finished again meanwhile, or D's registration comes late?

P's blocks hold stale bytes at ``request_finished``; the final bytes land right before
``ready`` turns ready (as a kernel finishing before its event). P and D are real NIXL agents
(an in-process :class:`cluster.Cluster`).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from cluster import Cluster, kv_bytes, wait_until

from kvpush.core.errors import ConfigError
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)
CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600
"""What the driver's ``cuEventQuery`` returns (a ``CUresult``), e.g. through a ctypes wrapper."""


class Gate:
    """``query()`` answers ``pending`` until ``open()``, then ``done``; counts its queries."""

    def __init__(self, pending: object = False, done: object = True) -> None:
        self._open = threading.Event()
        self.pending, self.done = pending, done
        self.queries = 0

    def open(self) -> None:
        self._open.set()

    def query(self) -> object:
        self.queries += 1
        return self.done if self._open.is_set() else self.pending


def _stale_then_final(cluster: Cluster, block: int) -> dict[str, torch.Tensor]:
    """Zero P's ``block`` (the stale KV) and return what the prefill will write there."""
    final = {}
    for name, tensor in cluster.p_caches[P0].items():
        final[name] = kv_bytes(tensor)[:, block].clone()
        kv_bytes(tensor)[:, block] = 0
    return final


def _prefill_ends(cluster: Cluster, block: int, final: dict[str, torch.Tensor]) -> None:
    for name, tensor in cluster.p_caches[P0].items():
        kv_bytes(tensor)[:, block] = final[name]


def _d_holds(cluster: Cluster, block: int, final: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(kv_bytes(t)[:, block], final[n]) for n, t in cluster.d_caches[0].items())


# ------------------------------------------------------------------ finding: non-bool answers


@pytest.mark.parametrize(
    ("pending", "done"),
    [(CUDA_ERROR_NOT_READY, CUDA_SUCCESS), ("not ready", "ready"), (object(), None)],
    ids=["cuda-result-code", "string", "object"],
)
def test_a_ready_answering_other_than_true_or_false_posts_nothing_and_fails_named(
    pending: object, done: object
) -> None:
    """``query()`` is read as a bool. One answering a truthy non-bool while the KV is still
    being written (a raw ``cuEventQuery`` wrapper returns ``CUDA_ERROR_NOT_READY`` = 600, and
    ``CUDA_SUCCESS`` = 0 once done) was taken as ready at the first poll: P posted the stale
    KV and D reported the request done with it. P now refuses an answer that is not True or
    False: the request fails at once, naming the value, nothing is posted, and D is told."""
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        final = _stale_then_final(cluster, 3)
        cluster.add("d-1", [[5]], "x-1")
        gate = Gate(pending=pending, done=done)
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=gate)
        wait_until(lambda: gate.queries >= 1, 5, "the first poll of ready")
        time.sleep(0.1)  # the old code posts at that poll; let its WRITE land
        _prefill_ends(cluster, 3, final)
        gate.open()
        reason = cluster.wait_prefill("p-1")[P0]
        d_reason = cluster.wait_decode("d-1")[0]
        assert d_reason is not None, "D took the KV as done: " + (
            "and it is the stale KV" if not _d_holds(cluster, 5, final) else "(final by luck)"
        )
        assert reason is not None and "not True or False" in reason and repr(pending) in reason, reason
        assert sender.transport.counters.writes_posted == 0


# ------------------------------------------------------------------ probes found sound


def test_ready_turning_true_after_an_abort_posts_nothing_even_with_a_late_registration() -> None:
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        gate = Gate()
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=gate)
        sender.abort("p-1", match_key="x-1")
        gate.open()
        assert "aborted by the prefill engine" in (cluster.wait_prefill("p-1")[P0] or "")
        cluster.add("d-1", [[5]], "x-1")  # D's registration arrives after all that
        d_reason = cluster.wait_decode("d-1")[0]
        assert d_reason is not None and "aborted by the prefill engine" in d_reason
        assert sender.transport.counters.writes_posted == 0


def test_a_second_finish_with_another_ready_is_refused_and_the_first_ready_governs() -> None:
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        final = _stale_then_final(cluster, 3)
        cluster.add("d-1", [[5]], "x-1")
        first, second = Gate(), Gate()
        second.open()  # the second says ready at once: it must not be what posts the KV
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=first)
        with pytest.raises(ConfigError, match="already being pushed"):
            sender.request_finished("p-1b", [[3]], match_key="x-1", ready=second)
        wait_until(lambda: first.queries >= 10, 5, "polls of the first ready")
        assert second.queries == 0 and sender.transport.counters.writes_posted == 0
        _prefill_ends(cluster, 3, final)
        first.open()
        assert cluster.wait_decode("d-1") == {0: None} and _d_holds(cluster, 5, final)
        assert cluster.wait_prefill("p-1")[P0] is None  # P's report ends the key (it may trail D's)
        # The same prefill finished once more after it was pushed: refused (the key ended),
        # nothing posted. (Another prefill of the key would be a retry: tests/test_retry_after_abort.py.)
        posted = sender.transport.counters.writes_posted
        del cluster.p_results[P0]["p-1"]
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=second)
        assert "already ended" in (cluster.wait_prefill("p-1")[P0] or "")
        assert sender.transport.counters.writes_posted == posted


def test_ready_before_a_late_registration_is_pushed_within_the_lease() -> None:
    """The lease starts when the KV is ready (the prefill reaches the core then): D's
    registration arriving later, within ``lease_s``, is served; the KV is the final one."""
    with Cluster(transport="nixl", lease_s=2.0, request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        final = _stale_then_final(cluster, 3)
        gate = Gate()
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=gate)
        time.sleep(0.3)
        _prefill_ends(cluster, 3, final)
        gate.open()
        time.sleep(0.3)
        cluster.add("d-1", [[5]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None} and _d_holds(cluster, 5, final)
        assert cluster.wait_prefill("p-1") == {P0: None}


class _Exits:
    """A ``ready`` whose ``query()`` raises ``SystemExit`` (a ``BaseException``, as from a
    plugin that calls ``sys.exit``): not an ``Exception``, so a handler for those misses it."""

    def query(self) -> bool:
        raise SystemExit(3)


def test_a_ready_raising_a_base_exception_fails_its_request_and_the_writer_lives_on() -> None:
    """Before: the ``SystemExit`` escaped the ready check and ended P's writer thread, so this
    request and every later one of the rank hung (nothing posted, nothing reported). Now the
    request fails naming it, and the next request is pushed."""
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[5]], "x-1")
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=_Exits())
        reason = cluster.wait_prefill("p-1")[P0]
        assert reason is not None and "SystemExit" in reason, reason
        assert cluster.wait_decode("d-1")[0] is not None
        cluster.add("d-2", [[6]], "x-2")
        cluster.finish("p-2", [[4]], "x-2")
        assert cluster.wait_prefill("p-2")[P0] is None and cluster.wait_decode("d-2")[0] is None
        for name, tensor in cluster.p_caches[P0].items():
            assert torch.equal(kv_bytes(cluster.d_caches[0][name])[:, 6], kv_bytes(tensor)[:, 4])


class _Slow:
    """A ``ready`` whose ``query()`` blocks for 20 ms before answering True."""

    def query(self) -> bool:
        time.sleep(0.02)
        return True


def test_a_blocking_ready_is_counted_and_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A ``query()`` that blocks holds up the whole writer (every push of the rank waits), which
    kvpush cannot interrupt; it is counted and the first one logged with the fix, and the
    request itself is still pushed."""
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[5]], "x-1")
        with caplog.at_level("WARNING", logger="kvpush.core.sender"):
            sender.request_finished("p-1", [[3]], match_key="x-1", ready=_Slow())
            assert cluster.wait_prefill("p-1")[P0] is None and cluster.wait_decode("d-1")[0] is None
        assert sender.stats["slow_ready_queries"] >= 1
        assert any("must not block" in r.getMessage() for r in caplog.records)
