"""Real multi-process pushes over NIXL (UCX on CPU memory), verified byte for byte."""

from __future__ import annotations

import pytest
from cluster import MHA, MLA, Cluster

from kvpush.core.types import RankKey
from kvpush.demo.runner import RunConfig, run_config


@pytest.mark.parametrize(
    ("layout", "prefill_pp", "prefill_tp", "decode_tp"),
    [
        ("mha", 2, 1, 2),
        ("mla", 2, 1, 2),
        ("mha", 1, 1, 2),
        ("mha", 1, 2, 1),
    ],
    ids=["mha-PP2-to-TP2", "mla-PP2-to-TP2", "mha-PP1-to-TP2", "mha-TP2-to-TP1"],
)
def test_multiprocess_push_is_verified_byte_for_byte(
    layout: str, prefill_pp: int, prefill_tp: int, decode_tp: int
) -> None:
    row = run_config(
        RunConfig(
            layout=layout,
            prefill_pp=prefill_pp,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            requests=6,
            max_blocks=6,
            prefix_hit_rate=0.5,
            timeout_s=60,
            num_layers=4,
        )
    )
    assert row["failures"] == {}
    assert row["verified_requests"] == 6
    assert row["bytes"] > 0
    assert row["remote_lists_prepared_by_decode"] == 0  # D's handshakes are notif-only
    # one WRITE per request per (P rank, D rank it writes)
    writes_per_request = prefill_pp * max(prefill_tp, decode_tp)
    assert row["writes"] == 6 * writes_per_request


def test_in_process_nixl_agents_push_pp2_to_tp2() -> None:
    with Cluster(MHA, prefill_pp=2, decode_tp=2, transport="nixl") as cluster:
        cluster.add("d-1", [[3, 4, 5]], "x-1")
        cluster.finish("p-1", [[10, 20, 30]], "x-1")
        assert cluster.wait_decode("d-1", timeout_s=30) == {0: None, 1: None}
        assert cluster.wait_prefill("p-1", timeout_s=30) == {RankKey(0, 0): None, RankKey(1, 0): None}
        from test_push_flow import assert_pushed

        assert_pushed(cluster, [10, 20, 30], [3, 4, 5])


def test_in_process_nixl_mla_fan_out() -> None:
    with Cluster(MLA, decode_tp=2, transport="nixl") as cluster:
        cluster.add("d-1", [[1, 2]], "x-1")
        cluster.finish("p-1", [[7, 8]], "x-1")
        assert cluster.wait_decode("d-1", timeout_s=30) == {0: None, 1: None}
        from test_push_flow import assert_pushed

        assert_pushed(cluster, [7, 8], [1, 2])
        assert cluster.senders[RankKey(0, 0)].transport.counters.writes_posted == 2
