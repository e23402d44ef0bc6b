"""Probe (probeP): ways in which D ends up with WRONG KV reported done, caused on P's side,
outside the demo's happy conditions: the engine API used as real engines use (and misuse) it,
P's source blocks handed back to the engine while a push still needs them.

Each finding is a test that fails on main, marked ``xfail(strict=True)`` with its cause.
The in-process clusters run on the loopback transport unless a test says otherwise.
"""

from __future__ import annotations

import time

import torch
from cluster import Cluster, kv_bytes

from kvpush.core.errors import ConfigError
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)

import pytest  # noqa: E402


def _snapshot(cluster: Cluster, ids: list[int]) -> dict[str, torch.Tensor]:
    return {layer: kv_bytes(t)[:, ids].clone() for layer, t in cluster.p_caches[P0].items()}


def _overwrite(cluster: Cluster, ids: list[int]) -> None:
    """P's engine reuses blocks ``ids`` for another prefill: their KV changes."""
    for tensor in cluster.p_caches[P0].values():
        view = kv_bytes(tensor)[:, ids]
        kv_bytes(tensor)[:, ids] = torch.randint(-30_000, 30_000, view.shape, dtype=torch.int16)


def _d_holds(cluster: Cluster, d_ids: list[int], want: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(kv_bytes(got)[:, d_ids], want[layer]) for layer, got in cluster.d_caches[0].items()
    )


@pytest.mark.xfail(
    strict=True,
    reason=(
        "finding 1: PushSender.request_finished refuses a second finish of a match key but "
        "accepts a P request id that is still being pushed under ANOTHER key; get_finished() "
        "reports by request id only, so the first push's outcome reads as the second's: an "
        "engine that frees the id's blocks on it hands back blocks the second push still reads, "
        "and D reports that request done with another prefill's KV (sender.py: _keys is keyed "
        "by match key alone)"
    ),
)
@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_a_p_request_id_pending_under_another_key_is_refused_or_never_reported_ambiguously(
    transport: str,
) -> None:
    """A P engine that reuses a request id (a client's retry keeping its X-Request-Id, given a
    fresh transfer_id by the router) while the first prefill of that id is still held by
    kvpush: the first push's lease expires (its D never registered) and ``p-1`` shows up in
    ``.failed``. The engine, keyed by request id like every engine's scheduler, frees "p-1's
    blocks" (the retry's, its current entry) and reuses them; the retry's D then registers and
    is pushed the reused blocks, reported done. kvpush must refuse the reused id at the call
    (as it refuses a second finish of a key), or D must never get the wrong bytes done."""
    with Cluster(transport=transport, lease_s=2.0, request_timeout_s=30.0) as cluster:
        sender = cluster.senders[P0]
        sender.request_finished("p-1", [[3, 4]], match_key="x-1")  # its D never registers
        time.sleep(1.0)  # the retry comes later: its lease ends a second after the first's
        try:
            sender.request_finished("p-1", [[7, 8]], match_key="x-2")  # the id, reused
        except ConfigError:
            return  # refused: the engine learns at the call, nothing is ambiguous
        retry_kv = _snapshot(cluster, [7, 8])
        outcome = cluster.wait_prefill("p-1", timeout_s=10.0)[P0]  # x-1's lease: failed
        assert outcome is not None and "lease" in outcome, outcome
        # The engine frees what its table holds for "p-1" (the retry's blocks) and reuses them.
        _overwrite(cluster, [7, 8])
        cluster.add("d-2", [[1, 2]], "x-2")
        result = cluster.wait_decode("d-2", timeout_s=10.0)[0]
        if result is None:  # reported done: it must hold the retry's KV
            assert _d_holds(cluster, [1, 2], retry_kv), "D reported d-2 done with blocks P's engine reused"


@pytest.mark.xfail(
    strict=True,
    reason=(
        "side finding 2 (liveness, named reason): request_finished(num_tokens=n, block_start=s) "
        "trims block_ids to their first ceil(n / block_size) ids as if they started at block 0 "
        "(sender._prompt_blocks ignores block_start): a one-group window tail (s > 0, holding "
        "ceil(n / bs) - s blocks) is refused with ConfigError 'needs 3 blocks; block_ids hold 2' "
        "(the vLLM adapter passes both for one-group models), and a tail holding a block past "
        "the prompt keeps it as if it were the prompt's"
    ),
)
def test_a_prompt_tail_stated_with_its_start_and_length_is_pushed() -> None:
    """A one-group sliding-window engine passes the prompt's last blocks (the window), states
    where they start and the prompt's length; D, with a prefix hit, registers the same blocks."""
    with Cluster() as cluster:  # block_size 4: a 10-token prompt is blocks 0 to 2
        want = _snapshot(cluster, [7, 8])
        cluster.senders[P0].request_finished("p-1", [[7, 8]], match_key="x-1", block_start=1, num_tokens=10)
        cluster.add("d-1", [[1, 2]], "x-1", block_start=1, num_tokens=10)
        assert cluster.wait_decode("d-1")[0] is None
        assert _d_holds(cluster, [1, 2], want)
