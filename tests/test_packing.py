"""Packed transfers: bytes equal to the direct path (loopback cluster and real multi-process
NIXL), PP, MLA fan-out, heterogeneous TP, pool exhaustion falling back without deadlock."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from cluster import MHA, MLA, Cluster, kv_bytes, settle, wait_until

from kvpush.core.packing import Packer, StagingPool, block_addresses, merge_pairs, staging_layout
from kvpush.core.types import ModelSpec, ParallelConfig, PushJob, ReadSpec
from kvpush.layouts.uniform import allocate_kv_caches, describe_uniform
from kvpush.plugins.strategy import ForcedStrategy, choose

P_BLOCKS = [[9, 3, 17, 40, 22, 5, 31, 12]]
D_BLOCKS = [[2, 50, 7, 33, 18, 61, 4, 27]]


def push(strategy: str, model: ModelSpec = MHA, **shape: object) -> tuple[Cluster, dict]:
    """Push one request with ``strategy`` forced; return the cluster (closed) and D's caches."""
    torch.manual_seed(1234)  # the same P content for every strategy
    config = shape.pop("config", {})
    cluster = Cluster(model, num_blocks=64, **shape, **config)
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
        assert set(cluster.wait_decode("d-1").values()) == {None}
        assert set(cluster.wait_prefill("p-1").values()) == {None}
        caches = {tp: {k: kv_bytes(v).clone() for k, v in c.items()} for tp, c in cluster.d_caches.items()}
        return cluster, caches
    finally:
        cluster.close()


def _stat(cluster: Cluster, name: str) -> int:
    return sum(s.stats.get(name, 0) for s in cluster.senders.values())


@pytest.mark.parametrize(
    ("model", "shape"),
    [
        (MHA, {}),
        (MHA, {"prefill_pp": 2}),
        (MHA, {"prefill_tp": 1, "decode_tp": 2}),
        (MHA, {"prefill_tp": 2, "decode_tp": 1}),
        (MHA, {"prefill_pp": 2, "prefill_tp": 2, "decode_tp": 4}),
        (MLA, {"decode_tp": 2}),
        (MLA, {"prefill_pp": 2, "decode_tp": 2}),
    ],
    ids=["tp1", "pp2", "tp1-to-tp2", "tp2-to-tp1", "pp2xtp2-to-tp4", "mla-fanout", "mla-pp2-fanout"],
)
def test_packed_bytes_equal_direct(model: ModelSpec, shape: dict) -> None:
    direct, want = push("direct", model, **dict(shape))
    packed, got = push("packed", model, **dict(shape))
    assert _stat(direct, "packed_writes") == 0
    writes = sum(len(s._packed) for s in packed.senders.values())
    assert writes == 0  # every packed WRITE released its staging
    assert _stat(packed, "packed_writes") == _stat(packed, "writes") > 0  # every destination packed
    assert _stat(packed, "packed_fallbacks") == 0
    for tp in want:
        for layer in want[tp]:
            assert torch.equal(got[tp][layer], want[tp][layer]), (tp, layer)
            assert got[tp][layer].any(), "nothing was pushed"
    for worker in [*packed.senders.values(), *packed.receivers.values()]:
        assert worker.staging.bytes_in_use == 0


def test_pool_exhaustion_falls_back_to_direct_without_deadlock() -> None:
    _, want = push("direct")
    tiny = {"config": {"staging_bytes": 4096}}  # far smaller than the request's bytes
    cluster, got = push("packed", **tiny)
    assert _stat(cluster, "packed_writes") == 0
    for layer in want[0]:
        assert torch.equal(got[0][layer], want[0][layer])


def test_p_pool_full_falls_back_per_destination() -> None:
    torch.manual_seed(1234)
    with Cluster(MHA, num_blocks=64) as cluster:
        cluster.pm.register(ForcedStrategy("packed"), "forced_strategy")
        sender = cluster.senders[next(iter(cluster.senders))]
        held = sender.staging.alloc(sender.staging.size)  # P's pool is full; D's is not
        assert held is not None
        cluster.add("d-1", D_BLOCKS, "x-1")
        wait_until(lambda: sender.core.state_sizes()["stashed"] == 1, what="D's PUSH_REG at P")
        cluster.finish("p-1", P_BLOCKS, "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert sender.stats.get("packed_fallbacks") == 1 and sender.stats.get("packed_writes", 0) == 0
        receiver = cluster.receivers[0]
        wait_until(lambda: receiver.staging.bytes_in_use == 0, what="D's reservation freed")


def test_staging_pool_first_fit_merge_and_quarantine() -> None:
    pool = StagingPool(4096 * 4)
    a, b, c = pool.alloc(4096), pool.alloc(4096), pool.alloc(8192)
    assert (a, b, c) == (0, 4096, 8192)
    assert pool.alloc(1) is None and pool.failed_allocs == 1
    pool.free(a)
    pool.free(b)
    assert pool.alloc(8192) == 0  # neighbours merged
    pool.free_later(c, 60.0)
    assert pool.alloc(4096) is None  # quarantined
    pool.free_later(0, 0.0)
    assert pool.alloc(8192) == 0


def test_gather_scatter_round_trip_with_head_slices() -> None:
    model = ModelSpec(name="g", num_layers=3, num_kv_heads=4, head_dim=8, block_size=4)
    par = ParallelConfig(tp_size=1, num_layers=3)
    src, dst = allocate_kv_caches(model, par, 32), allocate_kv_caches(model, par, 32)
    for tensor in src.values():
        kv_bytes(tensor).copy_(torch.randint(-30_000, 30_000, kv_bytes(tensor).shape, dtype=torch.int16))
    rs, rd = describe_uniform(src, par, model), describe_uniform(dst, par, model)
    pool = StagingPool(1 << 16)
    ids_p, ids_d = ((5, 1, 30, 17),), ((0, 31, 9, 2),)
    for part in [(0, 1), (1, 2), (3, 4)]:
        size = rs[0].block_len // part[1] * 4
        offsets = [i * size for i in range(len(rs))]
        assert Packer(rs).copy(pool.tensor, offsets, rs, ids_p, part, gather=True) == size * len(rs)
        Packer(rd).copy(pool.tensor, offsets, rd, ids_d, part, gather=False)
        for name in src:
            width = kv_bytes(src[name]).shape[2] // part[1]
            cols = slice(part[0] * width, (part[0] + 1) * width)
            s = kv_bytes(src[name]).flatten(2)[:, list(ids_p[0]), cols]
            d = kv_bytes(dst[name]).flatten(2)[:, list(ids_d[0]), cols]
            assert torch.equal(s, d), (name, part)


def test_layout_helpers() -> None:
    model = ModelSpec(name="g", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    par = ParallelConfig(tp_size=1, num_layers=2)
    regions = describe_uniform(allocate_kv_caches(model, par, 8), par, model)
    addrs, sizes = block_addresses(regions, ((3, 1),), (1, 2))
    half = regions[0].block_len // 2
    assert addrs[0] == regions[0].base_addr + 3 * regions[0].block_stride + half
    assert set(sizes.tolist()) == {half}
    offsets, total = staging_layout(regions, ((3, 1),))
    assert total == 2 * regions[0].block_len * len(regions)
    assert offsets.tolist() == [i * 2 * regions[0].block_len for i in range(len(regions))]
    merged = merge_pairs(np.array([0, 10, 30]), np.array([100, 110, 200]), np.array([10, 20, 5]))
    assert merged == [(0, 100, 30), (30, 200, 5)]


def test_strategy_rule_prefers_direct_for_adjacent_or_few_blocks(monkeypatch) -> None:
    from kvpush.plugins import strategy

    with Cluster(MHA, num_blocks=64) as cluster:
        meta = next(iter(cluster.senders.values())).metadata
        assert meta is not None

        def spec(ids: list[int]) -> tuple[PushJob, ReadSpec]:
            job = PushJob(local=meta, decode_tp_size=1, local_block_ids=[ids], remote_block_ids=[ids])
            return job, ReadSpec(dst_tp_rank=0, local_block_ids=[ids], remote_block_ids=[ids])

        assert choose(*spec(list(range(60)))) == "direct"  # adjacent: merges into one per region
        assert choose(*spec([1, 5, 9])) == "direct"  # few descriptors
        scattered = list(range(0, 64, 2))
        assert choose(*spec(scattered)) == "direct"  # 8 regions x 32 = 256 descriptors: too few
        monkeypatch.setattr(strategy, "DRAM_PACK_MIN_DESCRIPTORS", 256)
        assert choose(*spec(scattered)) == "packed"  # many small scattered descriptors


@pytest.mark.parametrize(
    "shape", [{}, {"prefill_pp": 2, "prefill_tp": 2, "decode_tp": 1}], ids=["tp1", "pp2xtp2"]
)
def test_chunked_packed_writes_complete_once_every_chunk_landed(monkeypatch, shape: dict) -> None:
    from kvpush.core import packing

    _, want = push("direct", MHA, **dict(shape))
    monkeypatch.setattr(packing, "CHUNK_BYTES", 1024)  # several chunks per destination
    cluster, got = push("packed", MHA, **dict(shape))
    assert _stat(cluster, "writes") > _stat(cluster, "packed_writes") > 0
    for layer in want[0]:
        assert torch.equal(got[0][layer], want[0][layer])
    receiver = cluster.receivers[0]
    assert receiver.core.state_sizes()["requests"] == 0 and receiver.staging.bytes_in_use == 0


# ---------------------------------------------------------------------------- real NIXL


@pytest.mark.parametrize(
    ("layout", "pp", "ptp", "dtp"),
    [("mha", 2, 1, 2), ("mha", 1, 2, 1), ("mla", 2, 1, 2), ("hma", 2, 1, 1)],
    ids=["mha-pp2-tp1-to-tp2", "mha-tp2-to-tp1", "mla-pp2-fanout", "hma-pp2"],
)
def test_packed_multiprocess_nixl_verifies_every_byte(layout: str, pp: int, ptp: int, dtp: int) -> None:
    from kvpush.demo.runner import RunConfig, run_config

    cfg = RunConfig(
        layout=layout,
        prefill_pp=pp,
        prefill_tp=ptp,
        decode_tp=dtp,
        requests=6,
        max_blocks=8,
        strategy="packed",
        timeout_s=60.0,
    )
    row = run_config(cfg)
    assert row["failures"] == {}
    assert row["verified_requests"] == cfg.requests
    # Issue 10.2: every D rank's own PUSH_REG carries its own staging reservation, so packed works
    # for every destination whatever order the registrations arrive in.
    assert row["packed_fallbacks"] == 0
    assert row["packed_destinations"] == cfg.requests * pp * max(ptp, dtp)


class _RaisingPollTransport:
    """Pure logic: a transport whose poll of one handle raises (as a plugin transport's may;
    the ``faulty`` transport injects it), recording what was released."""

    def __init__(self, raising: set[int], release_raises: bool = False) -> None:
        self.raising, self.release_raises = raising, release_raises
        self.released: list[int] = []
        self.lists_released: list[int] = []

    def poll(self, handle: int) -> Any:
        from kvpush.core.transport import TransferState

        if handle in self.raising:
            raise RuntimeError(f"poll of {handle} raised")
        return TransferState.DONE

    def release(self, handle: int) -> None:
        self.released.append(handle)
        if self.release_raises:
            raise RuntimeError(f"release of {handle} raised")

    def release_list(self, handle: int) -> None:
        self.lists_released.append(handle)


@pytest.mark.parametrize("release_raises", [False, True])
def test_settling_chunks_after_a_failed_chunk_releases_every_one_even_when_a_poll_raises(
    release_raises: bool,
) -> None:
    """A packed push whose later chunk could not be posted settles the chunks posted before it,
    then releases them and its staging. A poll raising there (a transport's own error) ended the
    settling: the chunks after it were never released and the staging never freed (a leaked
    handle, found by the packed soak in CI: ``leaked_handles=1``). Every chunk is released now,
    and a chunk whose poll raised counts as not complete (its bytes may still land: D fences)."""
    from kvpush.core.packing import PackedGroup, PackedWrite, _settle_quietly

    group = PackedGroup(offset=0, remaining=3)
    posted = [PackedWrite(h, 10 + h, 20 + h, group) for h in (1, 2, 3)]
    transport = _RaisingPollTransport({2}, release_raises)
    assert _settle_quietly(transport, posted, 0.05) is False
    assert transport.released == [1, 2, 3]
    assert sorted(transport.lists_released) == [11, 12, 13, 21, 22, 23]
    transport = _RaisingPollTransport(set(), release_raises)
    assert _settle_quietly(transport, posted, 0.05) is True
