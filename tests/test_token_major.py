"""The token-major layout (separate NHD K and V tensors per layer, as SGLang keeps them) under
heterogeneous TP and PP, byte for byte: in-process ranks over real NIXL agents, and separate
processes over NIXL (the demo runner, which verifies every pushed byte by its global head)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import cluster as cluster_module
import pytest
import torch
from cluster import MHA, Cluster, kv_bytes, settle, wait_until

from kvpush.core.errors import ConfigError
from kvpush.core.types import ModelSpec, ParallelConfig
from kvpush.layouts.token_major import (
    allocate_token_major_caches,
    describe_token_major,
    token_major_caches,
)
from kvpush.plugins.strategy import ForcedStrategy

P_BLOCKS = [[9, 3, 17, 40, 22, 5]]
D_BLOCKS = [[2, 50, 7, 33, 18, 61]]


@pytest.fixture
def token_major(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test cluster allocates token-major caches (``layers.N.k`` / ``layers.N.v``)."""
    monkeypatch.setattr(cluster_module, "allocate_kv_caches", allocate_token_major_caches)
    yield


def push(strategy: str, **shape: Any) -> Cluster:
    """Push one request over in-process NIXL agents with ``strategy`` forced; the cluster is
    returned closed, its caches intact."""
    torch.manual_seed(7)
    cluster = Cluster(MHA, num_blocks=64, transport="nixl", layout="token_major", **shape)
    try:
        cluster.pm.register(ForcedStrategy(strategy), "forced_strategy")
        cluster.add("d-1", D_BLOCKS, "x-1")
        wait_until(
            lambda: all(r.stats["push_regs_sent"] > 0 for r in cluster.receivers.values()),
            what="PUSH_REG from every D rank",
        )
        for sender in cluster.senders.values():  # every registration (and staging offset) seen
            settle(sender)
        cluster.finish("p-1", P_BLOCKS, "x-1")
        assert set(cluster.wait_decode("d-1", timeout_s=30).values()) == {None}
        assert set(cluster.wait_prefill("p-1", timeout_s=30).values()) == {None}
        return cluster
    finally:
        cluster.close()


def assert_heads_landed(cluster: Cluster) -> None:
    """Every D rank holds, in its blocks, exactly its heads of P's blocks (every token), and
    nothing else of its cache changed."""
    for tp, caches in cluster.d_caches.items():
        for name, got in caches.items():
            sources = [c[name] for key, c in sorted(cluster.p_caches.items()) if name in c]
            source = torch.cat([kv_bytes(s) for s in sources], dim=2)  # all heads, by P's TP rank
            heads = got.shape[2]
            want = source[P_BLOCKS[0]][:, :, tp * heads : (tp + 1) * heads]
            assert torch.equal(kv_bytes(got)[D_BLOCKS[0]], want), (tp, name)
            others = [b for b in range(got.shape[0]) if b not in D_BLOCKS[0]]
            assert not kv_bytes(got)[others].any(), (tp, name, "bytes outside D's blocks changed")


@pytest.mark.parametrize("strategy", ["direct", "packed"])
@pytest.mark.parametrize(
    "shape",
    [{"prefill_pp": 2, "decode_tp": 2}, {"prefill_tp": 2, "decode_tp": 1}, {"prefill_tp": 1, "decode_tp": 4}],
    ids=["pp2xtp1-to-tp2", "tp2-to-tp1", "tp1-to-tp4"],
)
def test_token_major_heterogeneous_tp_over_nixl_is_byte_exact(
    token_major: None, strategy: str, shape: dict
) -> None:
    cluster = push(strategy, **shape)
    assert_heads_landed(cluster)
    packed = sum(s.stats.get("packed_writes", 0) for s in cluster.senders.values())
    writes = sum(s.stats["writes"] for s in cluster.senders.values())
    assert packed == (writes if strategy == "packed" else 0) and writes > 0


@pytest.mark.parametrize(
    ("pp", "ptp", "dtp", "strategy"),
    [(2, 1, 2, "direct"), (2, 1, 2, "packed"), (1, 2, 1, "direct"), (1, 2, 1, "packed")],
    ids=["pp2xtp1-to-tp2-direct", "pp2xtp1-to-tp2-packed", "tp2-to-tp1-direct", "tp2-to-tp1-packed"],
)
def test_token_major_multiprocess_nixl_verifies_every_byte(
    pp: int, ptp: int, dtp: int, strategy: str
) -> None:
    from kvpush.demo.runner import RunConfig, run_config

    cfg = RunConfig(
        layout="token_major",
        prefill_pp=pp,
        prefill_tp=ptp,
        decode_tp=dtp,
        requests=4,
        max_blocks=6,
        strategy=strategy,
        timeout_s=60.0,
    )
    row = run_config(cfg)
    assert row["failures"] == {}
    assert row["verified_requests"] == cfg.requests
    if strategy == "packed":
        assert row["packed_destinations"] > 0
    else:
        assert row["packed_destinations"] == 0


# ---------------------------------------------------------------------------- the layout itself


def test_regions_declare_tokens_outer_and_pair_k_v_per_layer() -> None:
    model = MHA
    parallel = ParallelConfig.for_stage(num_layers=4, pp_size=2, pp_rank=1, tp_size=2, tp_rank=1)
    caches = allocate_token_major_caches(model, parallel, 8)
    assert sorted(caches) == ["layers.2.k", "layers.2.v", "layers.3.k", "layers.3.v"]
    regions = describe_token_major(caches, parallel, model)
    assert [(r.layer_names, r.component) for r in regions] == [
        (("layers.2",), "K"),
        (("layers.2",), "V"),
        (("layers.3",), "K"),
        (("layers.3",), "V"),
    ]
    heads = model.num_kv_heads // 2
    for region in regions:
        assert (region.block_order, region.block_tokens, region.num_heads) == ("tokens_outer", 4, heads)
        assert region.token_bytes == heads * model.head_dim * 2
        assert region.block_len == model.block_size * region.token_bytes


def test_token_major_caches_from_k_and_v_lists() -> None:
    parallel = ParallelConfig.for_stage(num_layers=4, pp_size=2, pp_rank=0, tp_size=1, tp_rank=0)
    k = [torch.zeros(3, 4, 4, 8, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros(3, 4, 4, 8, dtype=torch.bfloat16) for _ in range(2)]
    caches = token_major_caches(k, v, parallel)
    assert caches["layers.1.v"] is v[1]
    with pytest.raises(ConfigError, match="owns 2 layers and needs one of each"):
        token_major_caches(k, v[:1], parallel)


@pytest.mark.parametrize(
    ("caches", "match"),
    [
        ({"layers.0.k": (8, 4, 4, 8), "layers.0.x": (8, 4, 4, 8)}, "must be '<layer>.k' or '<layer>.v'"),
        ({"layers.0.k": (8, 4, 4, 8)}, "has no V tensor"),
        ({"layers.0.k": (8, 4, 4, 8), "layers.0.v": (8, 4, 8, 4)}, r"must be \(num_blocks, 4, 4, 8\)"),
    ],
    ids=["bad-suffix", "missing-v", "hnd-shape"],
)
def test_describe_names_what_is_wrong(caches: dict, match: str) -> None:
    parallel = ParallelConfig(tp_size=1, num_layers=1)
    model = ModelSpec(name="one", num_layers=1, num_kv_heads=4, head_dim=8, block_size=4)
    tensors = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in caches.items()}
    with pytest.raises(ConfigError, match=match):
        describe_token_major(tensors, parallel, model)


def test_follows_the_layout_rules_and_serves_the_demo(kvpush_pm: Any) -> None:
    provider = kvpush_pm.layout("token_major")
    model = provider.demo_model
    assert model is not None and provider.allocate is not None
    for pp_rank in range(2):
        parallel = ParallelConfig.for_stage(
            num_layers=model.num_layers, pp_size=2, pp_rank=pp_rank, tp_size=2, tp_rank=1
        )
        caches = provider.allocate(model, parallel, (6,), "cpu")
        assert len(provider.describe(caches, parallel, model)) == 2 * parallel.num_local_layers
