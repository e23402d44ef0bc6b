"""D ranks and P ranks that act at different times, over real NIXL agents.

A D engine's TP ranks add a request when each of them gets to it, and a P engine's PP stages and
TP ranks finish their prefill when each of them does: a rank may be seconds behind the others.
No rank may be reported done before its own producers wrote it, a late rank must still get every
byte, and P may report a request sent (its blocks back to the engine) only once every D rank that
counts it was written.
"""

from __future__ import annotations

import time

import pytest
import torch
from cluster import MLA, Cluster, kv_bytes, wait_until
from test_push_flow import assert_pushed

LATE_S = 1.5


@pytest.mark.parametrize("late_rank", [0, 1])
def test_mla_fan_out_to_a_d_rank_that_adds_the_request_late(late_rank: int) -> None:
    """P TP1 writes every D rank (MLA): one D rank adds the request 1.5 s after P finished and
    the other rank is done; P holds its blocks until that rank was written too."""
    with Cluster(MLA, decode_tp=2, transport="nixl") as cluster:
        early = 1 - late_rank
        cluster.add("d-1", [[1, 2, 3]], "x-1", ranks=[early])
        cluster.finish("p-1", [[7, 8, 9]], "x-1")
        assert cluster.wait_decode("d-1", ranks=[early]) == {early: None}
        time.sleep(LATE_S)
        cluster.poll()
        assert "p-1" not in next(iter(cluster.p_results.values())), (
            f"P reported the request sent (blocks back to the engine) before D rank {late_rank} registered"
        )
        cluster.add("d-1", [[4, 5, 6]], "x-1", ranks=[late_rank])
        assert cluster.wait_decode("d-1", ranks=[late_rank]) == {late_rank: None}
        assert set(cluster.wait_prefill("p-1").values()) == {None}
        (source,) = cluster.p_caches.values()
        for tp, blocks in ((early, [1, 2, 3]), (late_rank, [4, 5, 6])):
            for layer, tensor in cluster.d_caches[tp].items():
                assert torch.equal(kv_bytes(tensor)[blocks], kv_bytes(source[layer])[[7, 8, 9]]), (tp, layer)


def test_a_p_tp_rank_that_finishes_late_holds_d_until_it_wrote() -> None:
    """P TP2 -> D TP1 (each P rank writes half the heads): P rank 1 finishes 1.5 s after rank 0;
    D is not done before, and every head is right after."""
    with Cluster(prefill_tp=2, decode_tp=1, transport="nixl") as cluster:
        cluster.add("d-1", [[1, 2]], "x-1")
        senders = sorted(cluster.senders.items(), key=lambda kv: kv[0].tp_rank)
        senders[0][1].request_finished("p-1", [[5, 6]], match_key="x-1")
        wait_until(lambda: senders[0][1].stats["pushes"] == 1, what="P rank 0's push")
        time.sleep(LATE_S)
        cluster.poll()
        assert "d-1" not in cluster.d_results[0], "D done with half the heads written"
        senders[1][1].request_finished("p-1", [[5, 6]], match_key="x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [5, 6], [1, 2])


def test_a_pp_stage_that_finishes_late_holds_d_until_it_wrote() -> None:
    """P PP2 x TP2 -> D TP2: stage 1 finishes 1.5 s after stage 0, and one D rank adds the
    request only after stage 0 pushed to the other."""
    with Cluster(prefill_pp=2, prefill_tp=2, decode_tp=2, transport="nixl") as cluster:
        cluster.add("d-1", [[1, 2]], "x-1", ranks=[0])
        stage0 = [s for k, s in cluster.senders.items() if k.pp_rank == 0]
        stage1 = [s for k, s in cluster.senders.items() if k.pp_rank == 1]
        for sender in stage0:
            sender.request_finished("p-1", [[5, 6]], match_key="x-1")
        time.sleep(LATE_S / 2)
        cluster.add("d-1", [[1, 2]], "x-1", ranks=[1])
        time.sleep(LATE_S / 2)
        cluster.poll()
        assert all("d-1" not in cluster.d_results[tp] for tp in (0, 1)), "done with stage 1 missing"
        for sender in stage1:
            sender.request_finished("p-1", [[5, 6]], match_key="x-1")
        assert cluster.wait_decode("d-1") == {0: None, 1: None}
        assert_pushed(cluster, [5, 6], [1, 2])
