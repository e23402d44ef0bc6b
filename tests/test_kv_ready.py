"""A prefill's KV may still be in flight on the engine's GPU stream when the engine calls
``request_finished`` (CUDA work is asynchronous): P must not post before the engine's ``ready``
says the KV is written, or D receives the KV as it was before the prefill, silently.

Here the "GPU" is the test: P's blocks hold stale bytes at ``request_finished``, and the final
bytes land only later, right before ``ready`` turns True (as a kernel finishing before its
event). P and D are real NIXL agents (an in-process :class:`cluster.Cluster`).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from cluster import Cluster, kv_bytes

from kvpush.core import kernels
from kvpush.core.errors import ConfigError
from kvpush.core.types import RankKey


class Gate:
    """A ``ready`` object: ``query()`` is False until ``open()``; counts its queries."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.queries = 0

    def open(self) -> None:
        self._open.set()

    def query(self) -> bool:
        self.queries += 1
        return self._open.is_set()


class Raising:
    def query(self) -> bool:
        raise ZeroDivisionError("the device is gone")


def _stale_then_final(cluster: Cluster, block: int) -> dict[str, torch.Tensor]:
    """Zero P's ``block`` (the stale KV) and return what the prefill will write there."""
    final = {}
    for name, tensor in cluster.p_caches[RankKey(0, 0)].items():
        final[name] = kv_bytes(tensor)[:, block].clone()
        kv_bytes(tensor)[:, block] = 0
    return final


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s}s")
        time.sleep(0.005)


def test_nothing_is_posted_before_the_kv_is_ready() -> None:
    with Cluster(transport="nixl") as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        final = _stale_then_final(cluster, 3)
        cluster.add("d-1", [[5]], "x-1")
        gate = Gate()
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=gate)
        _wait_for(lambda: gate.queries >= 20, 10, "polls of the ready gate")
        cluster.poll()
        assert "d-1" not in cluster.d_results[0] and "p-1" not in cluster.p_results[RankKey(0, 0)]
        assert sender.transport.counters.writes_posted == 0
        for name, tensor in cluster.p_caches[RankKey(0, 0)].items():  # the prefill's kernel ends
            kv_bytes(tensor)[:, 3] = final[name]
        gate.open()
        assert cluster.wait_decode("d-1") == {0: None}
        assert cluster.wait_prefill("p-1") == {RankKey(0, 0): None}
        for name, tensor in cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(tensor)[:, 5], final[name]), name


def test_kv_never_ready_fails_on_both_sides_without_a_write() -> None:
    with Cluster(transport="nixl", lease_s=0.5, request_timeout_s=60) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        cluster.add("d-1", [[5]], "x-1")
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=Gate())
        reason = cluster.wait_prefill("p-1", timeout_s=10)[RankKey(0, 0)]
        assert reason is not None and "not ready within lease_s=0.5s" in reason
        d_reason = cluster.wait_decode("d-1", timeout_s=10)[0]
        assert d_reason is not None and "not ready" in d_reason
        assert sender.transport.counters.writes_posted == 0


def test_a_raising_ready_fails_the_request_with_its_error() -> None:
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        cluster.add("d-1", [[5]], "x-1")
        cluster.senders[RankKey(0, 0)].request_finished("p-1", [[3]], match_key="x-1", ready=Raising())
        reason = cluster.wait_prefill("p-1")[RankKey(0, 0)]
        assert reason is not None and "ZeroDivisionError: the device is gone" in reason
        assert cluster.wait_decode("d-1")[0] is not None


def test_abort_before_the_kv_is_ready_posts_nothing_and_tells_d() -> None:
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        cluster.add("d-1", [[5]], "x-1")
        gate = Gate()
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=gate)
        sender.abort("p-1", match_key="x-1")
        gate.open()
        assert "aborted by the prefill engine" in cluster.wait_prefill("p-1")[RankKey(0, 0)]
        d_reason = cluster.wait_decode("d-1")[0]
        assert d_reason is not None and "aborted by the prefill engine" in d_reason
        assert sender.transport.counters.writes_posted == 0


def test_ready_without_query_is_refused() -> None:
    with Cluster() as cluster, pytest.raises(ConfigError, match="ready must have a query"):
        cluster.senders[RankKey(0, 0)].request_finished("p-1", [[3]], ready=threading.Event())


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("transport", ["nixl", "cuda_ipc"])
def test_a_prefill_still_running_on_the_gpu_is_pushed_once_its_event_fired(transport: str) -> None:
    """The engine's stream is still writing the KV (behind a 1 s spin) when it calls
    ``request_finished``; D's registration is already at P and the path is warm (a first push
    compiled the kernel and mapped the peer, which would otherwise outlast the spin). With the
    stream's event as ``ready``, D receives the final bytes (without it: the stale ones)."""
    with Cluster(transport=transport, device="cuda:0", request_timeout_s=60) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        cluster.add("d-warm", [[2]], "x-warm")
        cluster.finish("p-warm", [[1]], "x-warm")
        assert cluster.wait_decode("d-warm", timeout_s=60) == {0: None}
        cluster.add("d-1", [[5]], "x-1")
        _wait_for(lambda: sender.core.state_sizes()["stashed"] >= 1, 10, "D's registration at P")
        caches = cluster.p_caches[RankKey(0, 0)]
        final = {name: torch.randint_like(kv_bytes(t)[:, 3], -30_000, 30_000) for name, t in caches.items()}
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock: the prefill is still running
            for name, tensor in caches.items():
                kv_bytes(tensor)[:, 3].copy_(final[name])
            event = torch.cuda.Event()
            event.record(stream)
        sender.request_finished("p-1", [[3]], match_key="x-1", ready=event)
        assert cluster.wait_decode("d-1", timeout_s=20) == {0: None}
        for name, tensor in cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(tensor)[:, 5], final[name]), name


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
def test_a_cuda_ipc_copy_is_not_held_behind_a_stalled_engine_stream() -> None:
    """The KV is complete (synchronised) but the device's default stream is busy for ~1 s (a
    stalled engine stream, e.g. a hung collective). The copy must not queue behind it: a copy
    held there past P's WRITE deadline would land after D fenced P and released the blocks."""
    with Cluster(transport="cuda_ipc", device="cuda:0", request_timeout_s=60) as cluster:
        cluster.add("d-warm", [[2]], "x-warm")
        cluster.finish("p-warm", [[1]], "x-warm")
        assert cluster.wait_decode("d-warm", timeout_s=60) == {0: None}
        cluster.add("d-1", [[5]], "x-1")
        torch.cuda.synchronize()
        default = torch.cuda.default_stream()
        with torch.cuda.stream(default):
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock on the default stream
            stalled = torch.cuda.Event()
            stalled.record(default)
        cluster.finish("p-1", [[3]], "x-1")
        assert cluster.wait_decode("d-1", timeout_s=20) == {0: None}
        assert not stalled.query(), "the push waited for the stalled default stream"
        stalled.synchronize()
        for name, tensor in cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(tensor)[:, 5], kv_bytes(cluster.p_caches[RankKey(0, 0)][name])[:, 3])
