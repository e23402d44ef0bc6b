"""Probes of D's request-id aliases (``core/receiver.py``) over real NIXL in one process.

D registers a reused engine request id under a fresh alias (``rid#n``) and remembers the last
``ID_MEMORY`` ids and aliases. Both memories were trimmed oldest-first whatever was still in
progress: a request outliving ``ID_MEMORY`` later registrations (one held for a P's kernel
copies, a long prefill) lost its alias mapping, or its own id, while it was live. The bound is
shrunk here (a module setting, read at each add) so the tests need a handful of requests, not
65,536.
"""

from __future__ import annotations

import pytest
import torch
from cluster import Cluster, kv_bytes, wait_until

import kvpush.core.receiver as receiver_module
from kvpush.core.types import RankKey


@pytest.fixture
def small_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(receiver_module, "ID_MEMORY", 3)


def _churn(cluster: Cluster, n: int, first_block: int) -> None:
    """``n`` requests under reused ids (each added twice), pushed and done."""
    for i in range(n):
        for attempt in range(2):
            block = first_block + 2 * i + attempt
            key = f"churn-{i}-{attempt}"
            cluster.add(f"c-{i}", [[block]], key)
            cluster.finish(f"pc-{i}-{attempt}", [[block]], key)
            assert cluster.wait_decode(f"c-{i}") == {0: None}
            cluster.d_results[0].pop(f"c-{i}")


def test_a_live_alias_is_not_forgotten_while_its_request_is_in_progress(small_memory: None) -> None:
    """``d-1`` (reused, so registered as ``d-1#1``) waits while more aliases are made than D
    remembers. Its done was reported under the alias, which the engine never gave: the engine
    never heard of ``d-1`` again, and its blocks stayed claimed (every later add naming them
    refused) for the life of the worker."""
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[1]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        cluster.d_results[0].clear()
        cluster.add("d-1", [[2]], "x-2")  # registered as d-1#1; P has not finished x-2
        _churn(cluster, 5, first_block=10)
        cluster.finish("p-2", [[6]], "x-2")
        assert cluster.wait_decode("d-1", timeout_s=10) == {0: None}
        wait_until(lambda: receiver.pending_requests == 0, what="d-1 no longer pending")
        for name, tensor in cluster.d_caches[0].items():
            dst, src = kv_bytes(tensor), kv_bytes(cluster.p_caches[RankKey(0, 0)][name])
            assert torch.equal(dst[:, 2], src[:, 6]), name
        cluster.add("d-9", [[2]], "x-9")  # d-1's block is the engine's again, not claimed


def test_an_alias_never_takes_the_id_of_a_request_in_progress(small_memory: None) -> None:
    """The engine's own id ``e#4`` is in progress and drops out of D's memory; then ``e`` is
    reused and its alias, the next serial (three aliases were made before), is ``e#4`` too.
    Two requests shared one id in the core: the second replaced the first, and the first's
    DONE (P wrote block 1) reported the second done, whose block 3 nobody wrote."""
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        cluster.add("e#4", [[1]], "x-a")  # P finishes it later
        _churn(cluster, 3, first_block=20)  # aliases c-0#1 .. c-2#3; e#4 leaves the memory
        cluster.add("e", [[2]], "x-b")
        cluster.finish("p-b", [[2]], "x-b")
        assert cluster.wait_decode("e") == {0: None}
        cluster.d_results[0].clear()
        cluster.add("e", [[3]], "x-c")  # reused: alias e#4
        cluster.finish("p-a", [[11]], "x-a")  # P writes e#4's block
        assert cluster.wait_decode("e#4") == {0: None}
        cluster.poll()
        assert "e" not in cluster.d_results[0], "e reported done with its block unwritten"
        cluster.finish("p-c", [[13]], "x-c")
        assert cluster.wait_decode("e") == {0: None}
        for name, tensor in cluster.d_caches[0].items():
            dst, src = kv_bytes(tensor), kv_bytes(cluster.p_caches[RankKey(0, 0)][name])
            assert torch.equal(dst[:, 1], src[:, 11]) and torch.equal(dst[:, 3], src[:, 13]), name
