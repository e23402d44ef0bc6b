"""Probes of P's engine API (``core/sender.py``) in odd orders: an engine call naming a prefill
that is no longer the one P holds under its match key.

``abort(request_id, match_key)`` aborted whatever prefill held the key: an engine's late abort
of a prefill already reported (sent or failed) killed the retry finished since under the same
key (an engine that retries with the router's ``transfer_id``): the retry was reported failed
and D's registration of it answered FAIL, though nothing about it had been aborted. Real NIXL
in one process.
"""

from __future__ import annotations

import torch
from cluster import Cluster, kv_bytes

from kvpush.core.types import RankKey

P0 = RankKey(0, 0)


def _pushed(cluster: Cluster, p_ids: list[int], d_ids: list[int]) -> None:
    for layer, got in cluster.d_caches[0].items():
        want = kv_bytes(cluster.p_caches[P0][layer])[:, p_ids]
        assert torch.equal(kv_bytes(got)[:, d_ids], want), layer


def test_a_late_abort_of_a_reported_prefill_leaves_the_keys_retry_alone() -> None:
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[1, 2]], "x-1")
        cluster.finish("p-1", [[3, 4]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert cluster.wait_prefill("p-1")[P0] is None  # p-1 reported sent
        cluster.finish("p-2", [[7, 8]], "x-1")  # the engine retries under the same key
        sender.abort("p-1", match_key="x-1")  # its late abort of p-1 (reported already)
        cluster.add("d-2", [[5, 6]], "x-1")
        assert cluster.wait_prefill("p-2")[P0] is None
        assert cluster.wait_decode("d-2", timeout_s=10) == {0: None}
        _pushed(cluster, [7, 8], [5, 6])


def test_an_abort_of_the_prefill_p_holds_still_aborts_it() -> None:
    """The control: an abort naming the prefill P holds under the key fails it, D is told."""
    with Cluster(transport="nixl", request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]
        cluster.finish("p-1", [[3, 4]], "x-1")
        sender.abort("p-1", match_key="x-1")
        assert "aborted" in (cluster.wait_prefill("p-1")[P0] or "")
        cluster.add("d-1", [[1, 2]], "x-1")
        assert "aborted" in (cluster.wait_decode("d-1")[0] or "")


def test_a_transport_whose_abortable_raises_still_has_its_posted_write_tracked() -> None:
    """``abortable(handle)`` (optional in a transport) is asked after the WRITE was posted. When
    it raised, the driver took the post for failed: the handle was never polled nor released,
    and D was told FAIL with ``unsettled`` False (D releases at once) while the WRITE was on
    its way. A raising answer now counts as "cannot be taken back": the WRITE is polled and
    waited for like any other."""
    with Cluster(request_timeout_s=60) as cluster:
        sender = cluster.senders[P0]

        def abortable(handle: object) -> bool:
            raise RuntimeError("abortable() broke the transport contract")

        sender.transport.abortable = abortable  # type: ignore[union-attr]
        cluster.add("d-1", [[1, 2]], "x-1")
        cluster.finish("p-1", [[3, 4]], "x-1")
        assert cluster.wait_prefill("p-1")[P0] is None
        assert cluster.wait_decode("d-1") == {0: None}
        _pushed(cluster, [3, 4], [1, 2])
        assert sender.call_on_writer(lambda: sender.transport.outstanding_handles) == 0
