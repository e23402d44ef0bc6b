"""In-block order: where a head slice lies (heads-outer: one range; tokens-outer: one per token),
the descriptors and packed rows cut from it, and the handshake refusing a peer whose blocks
cannot be sliced alike (undeclared order under heterogeneous TP, or orders that disagree)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import attrs
import cluster as cluster_module
import numpy as np
import pytest
import torch
from cluster import MHA, Cluster, kv_bytes

from kvpush.core.block_order import RULE, check_peer_order, slice_rows
from kvpush.core.errors import ConfigError
from kvpush.core.markers import hookimpl
from kvpush.core.packing import Packer, StagingPool
from kvpush.core.planning import descriptor_id_grid, descriptor_ids, region_descriptors
from kvpush.core.types import KVRegion, LayoutProvider, ModelSpec, ParallelConfig
from kvpush.layouts.token_major import allocate_token_major_caches, describe_token_major
from kvpush.testing import make_agent_metadata

MODEL = ModelSpec(name="nhd", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)


def nhd(tp_size: int, tp_rank: int = 0, num_blocks: int = 16) -> tuple[dict[str, Any], list[KVRegion]]:
    """Random token-major caches of one rank and their regions."""
    parallel = ParallelConfig(tp_size=tp_size, tp_rank=tp_rank, num_layers=MODEL.num_layers)
    caches = allocate_token_major_caches(MODEL, parallel, num_blocks)
    for tensor in caches.values():
        kv_bytes(tensor).copy_(torch.randint(-30_000, 30_000, kv_bytes(tensor).shape, dtype=torch.int16))
    return caches, describe_token_major(caches, parallel, MODEL)


def copy_descriptors(local: np.ndarray, lids: np.ndarray, remote: np.ndarray, rids: np.ndarray) -> None:
    """What a WRITE does with two prepared lists and descriptor ids (same-process memory)."""
    assert len(lids) == len(rids)
    for i, j in zip(lids.tolist(), rids.tolist()):
        (src, n, _), (dst, m, _) = local[i].tolist(), remote[j].tolist()
        assert n == m, "paired descriptors differ in size"
        ctypes.memmove(dst, src, n)


# ---------------------------------------------------------------------------- geometry


def test_slice_rows_by_order() -> None:
    hnd = KVRegion(
        base_addr=0, block_len=512, block_stride=512, num_blocks=1, layer_names=["l"], num_heads=4,
        block_order="heads_outer",
    )  # fmt: skip
    nhd_region = attrs.evolve(hnd, block_order="tokens_outer", block_tokens=4)
    assert slice_rows(hnd, (1, 2)) == slice_rows(hnd, (1, 2), per_token=True)
    assert attrs.astuple(slice_rows(hnd, (1, 2))) == (1, 256, 256, 256)
    assert attrs.astuple(slice_rows(nhd_region, (1, 2))) == (4, 128, 64, 64)  # 4 tokens x 2 heads
    assert attrs.astuple(slice_rows(nhd_region, (0, 1))) == (1, 512, 512, 0)  # whole block
    assert attrs.astuple(slice_rows(nhd_region, (0, 1), per_token=True)) == (4, 128, 128, 0)
    with pytest.raises(ConfigError, match="cannot be cut into 3 equal head slices"):
        slice_rows(nhd_region, (0, 3))


def test_tokens_outer_needs_block_tokens() -> None:
    with pytest.raises(ConfigError, match="tokens_outer block needs block_tokens > 0"):
        KVRegion(
            base_addr=0, block_len=512, block_stride=512, num_blocks=1, layer_names=["l"],
            block_order="tokens_outer",
        )  # fmt: skip
    with pytest.raises(ConfigError, match="block_order 'nhd' is not one of"):
        KVRegion(
            base_addr=0, block_len=512, block_stride=512, num_blocks=1, layer_names=["l"], block_order="nhd"
        )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_direct_descriptors_move_each_ranks_heads(p_tp: int, d_tp: int) -> None:
    """The planner's lists and ids, applied as a WRITE would, put exactly D's heads of every
    token of P's blocks into D's blocks (the tp_mapping parts, both directions)."""
    from kvpush.plugins.tp_mapping import tp_ratio

    k = tp_ratio(p_tp, d_tp)
    p = [nhd(p_tp, r) for r in range(p_tp)]
    d = [nhd(d_tp, r) for r in range(d_tp)]
    for caches, _ in d:
        for tensor in caches.values():
            tensor.zero_()
    p_ids, d_ids = ((5, 0, 11),), ((3, 15, 8),)
    for rank, (_, p_regions) in enumerate(p):
        groups = [r.kv_group for r in p_regions]
        targets = [(rank * k + s, (s, k), (0, 1)) for s in range(k)] if p_tp < d_tp else []
        if p_tp >= d_tp:
            targets = [(rank // k, (0, 1), (rank % k, k) if k > 1 else (0, 1))]
        for dst, local_part, remote_part in targets:
            d_regions = d[dst][1]
            copy_descriptors(
                region_descriptors(p_regions, local_part),
                descriptor_ids(p_regions, groups, p_ids),
                region_descriptors(d_regions, remote_part),
                descriptor_ids(d_regions, groups, d_ids),
            )
    for name in d[0][0]:
        full = torch.cat([kv_bytes(c[name]) for c, _ in p], dim=2)  # every head, by P rank
        heads = MODEL.num_kv_heads // d_tp
        for rank, (caches, _) in enumerate(d):
            got = kv_bytes(caches[name])
            want = full[list(p_ids[0])][:, :, rank * heads : (rank + 1) * heads]
            assert torch.equal(got[list(d_ids[0])], want), (name, rank)
            assert not got[[b for b in range(16) if b not in d_ids[0]]].any()


def test_descriptor_ids_are_region_block_token_major() -> None:
    _, regions = nhd(1, num_blocks=8)
    ids = descriptor_ids(regions, [0] * len(regions), ((2, 5),))
    t = regions[0].block_tokens
    assert ids.tolist()[: 2 * t] == [2 * t + i for i in range(t)] + [5 * t + i for i in range(t)]
    assert ids.tolist()[2 * t] == 8 * t + 2 * t  # region 1 starts after region 0's 8 x t rows
    assert len(region_descriptors(regions, (1, 2))) == len(regions) * 8 * t


def test_id_grid_expands_to_descriptor_ids_or_is_none() -> None:
    """The factored ids (``IdGrid``) are the common layout's ids exactly; token-major rows and
    several KV groups have no grid; a block id past the capacity is refused as ids are."""
    _, regions = nhd(1, num_blocks=8)
    groups = [0] * len(regions)
    assert descriptor_id_grid(regions, groups, ((2, 5),)) is None  # a row per token: no grid
    grid = descriptor_id_grid(regions, groups, ((2, 5),), per_token=False)
    assert grid is not None and len(grid) == 2 * len(regions)
    assert np.array_equal(grid.ids(), descriptor_ids(regions, groups, ((2, 5),), per_token=False))
    assert descriptor_id_grid(regions, [0, 1] * (len(regions) // 2), ((2,), (5,)), per_token=False) is None
    long = tuple(range(7, -1, -1)) * 40  # > 256 ids: the numpy check
    assert np.array_equal(
        descriptor_id_grid(regions, groups, (long,), per_token=False).ids(),
        descriptor_ids(regions, groups, (long,), per_token=False),
    )
    for bad in ((8,), (-1,), (*long, 8)):
        with pytest.raises(ConfigError, match="outside the region"):
            descriptor_id_grid(regions, groups, (bad,), per_token=False)


def test_whole_block_lists_for_equal_tp() -> None:
    """``per_token=False``: one descriptor per tokens_outer block (equal TP needs no cut)."""
    (src, rs), (dst, rd) = nhd(2, 1), nhd(2, 1)
    for tensor in dst.values():
        tensor.zero_()
    groups = [0] * len(rs)
    local = region_descriptors(rs, per_token=False)
    assert len(local) == len(rs) * 16 and set(local[:, 1].tolist()) == {rs[0].block_len}
    ids_p, ids_d = ((4, 9),), ((12, 0),)
    copy_descriptors(
        local,
        descriptor_ids(rs, groups, ids_p, per_token=False),
        region_descriptors(rd, per_token=False),
        descriptor_ids(rd, groups, ids_d, per_token=False),
    )
    for name in src:
        assert torch.equal(kv_bytes(dst[name])[[12, 0]], kv_bytes(src[name])[[4, 9]])
    with pytest.raises(ConfigError, match="a descriptor per token; use per_token=True"):
        region_descriptors(rs, (1, 2), per_token=False)


def test_packed_rows_gather_and_scatter_head_slices() -> None:
    """P TP1 -> D TP2 packed: P gathers its (s, 2) token slices, D rank s scatters whole blocks."""
    src, rs = nhd(1)
    pool = StagingPool(1 << 16)
    ids_p, ids_d = ((5, 1, 14),), ((0, 15, 9),)
    for s in range(2):
        dst, rd = nhd(2, s)
        for tensor in dst.values():
            tensor.zero_()
        size = rs[0].block_len // 2 * 3
        offsets = [i * size for i in range(len(rs))]
        assert Packer(rs).copy(pool.tensor, offsets, rs, ids_p, (s, 2), gather=True) == size * len(rs)
        Packer(rd).copy(pool.tensor, offsets, rd, ids_d, (0, 1), gather=False)
        for name in src:
            want = kv_bytes(src[name])[list(ids_p[0])][:, :, 2 * s : 2 * s + 2]
            assert torch.equal(kv_bytes(dst[name])[list(ids_d[0])], want), (name, s)
    # ...and back: D's two ranks' whole blocks scattered into head slots of a TP1 block
    merged, rm = nhd(1)
    for tensor in merged.values():
        tensor.zero_()
    for s in range(2):
        part_src, rp = nhd(2, s)
        size = rp[0].block_len * 3
        offsets = [i * size for i in range(len(rp))]
        Packer(rp).copy(pool.tensor, offsets, rp, ids_d, (0, 1), gather=True)
        Packer(rm).copy(pool.tensor, offsets, rm, ids_p, (s, 2), gather=False)
        for name in part_src:
            got = kv_bytes(merged[name])[list(ids_p[0])][:, :, 2 * s : 2 * s + 2]
            assert torch.equal(got, kv_bytes(part_src[name])[list(ids_d[0])]), (name, s)


# ---------------------------------------------------------------------------- handshake rule


def _meta(role: str, tp_size: int, order: str, **region: Any) -> Any:
    meta = make_agent_metadata(role=role, tp_size=tp_size, num_layers=2, layout="custom")
    tokens = region.pop("block_tokens", 4 if order == "tokens_outer" else 0)
    regions = [attrs.evolve(r, block_order=order, block_tokens=tokens, **region) for r in meta.regions]
    return attrs.evolve(meta, regions=regions)


def test_rule_accepts_matching_orders(kvpush_pm: Any) -> None:
    for order in ("heads_outer", "tokens_outer"):
        assert check_peer_order(_meta("prefill", 1, order), _meta("decode", 2, order)) == []
        assert check_peer_order(_meta("decode", 1, order), _meta("prefill", 2, order)) == []
    # whole blocks need no declared order (a layout written before block_order existed)
    assert check_peer_order(_meta("prefill", 2, "unspecified"), _meta("decode", 2, "unspecified")) == []


def test_rule_refuses_mismatched_orders_at_any_tp() -> None:
    for p_tp, d_tp in [(2, 2), (1, 2)]:
        (problem,) = check_peer_order(
            _meta("prefill", p_tp, "tokens_outer"), _meta("decode", d_tp, "heads_outer")
        )
        assert (
            "layout 'custom'" in problem and "tokens_outer (4 tokens)" in problem and "heads_outer" in problem
        )
        assert RULE in problem
    (problem,) = check_peer_order(
        _meta("prefill", 1, "tokens_outer"), _meta("decode", 1, "tokens_outer", block_tokens=2)
    )
    assert "tokens_outer (4 tokens)" in problem and "tokens_outer (2 tokens)" in problem


def test_rule_refuses_an_undeclared_order_under_heterogeneous_tp() -> None:
    (problem,) = check_peer_order(_meta("prefill", 1, "unspecified"), _meta("decode", 2, "unspecified"))
    assert "P TP 1 -> D TP 2 moves head slices" in problem
    assert "layout 'custom'" in problem and "block_order='heads_outer'" in problem and RULE in problem
    # one side declared is not enough: D cannot be cut like an undeclared P
    (problem,) = check_peer_order(_meta("decode", 1, "heads_outer"), _meta("prefill", 2, "unspecified"))
    assert "'prefill-engine'" in problem and "P TP 2 -> D TP 1" in problem


def test_rule_refuses_heads_that_do_not_split() -> None:
    meta = make_agent_metadata(role="prefill", tp_size=1, num_layers=2, num_kv_heads=4)
    regions = [attrs.evolve(r, num_heads=3, block_len=3 * 256, block_stride=3 * 256) for r in meta.regions]
    (problem,) = check_peer_order(attrs.evolve(meta, regions=regions), _meta("decode", 2, "heads_outer"))
    assert "3 head(s), which do not split 2 ways" in problem


def test_rule_is_a_builtin_handshake_check(kvpush_pm: Any) -> None:
    from kvpush.core.types import HandshakeMode

    local, peer = _meta("prefill", 1, "tokens_outer"), _meta("decode", 2, "heads_outer")
    for mode in HandshakeMode:
        assert any(RULE in p for p in kvpush_pm.validate_peer(local, peer, mode))
    assert "block_order" in {info.name for info in kvpush_pm.list_plugins()}


# ---------------------------------------------------------------------------- end to end (loopback)


def _undeclared(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """An NHD cache described under the old region model: no in-block order."""
    return [
        attrs.evolve(r, block_order="unspecified", block_tokens=0)
        for r in describe_token_major(kv_caches, parallel, model)
    ]


def _lying(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """An NHD cache that claims heads-outer blocks (what the old model silently assumed)."""
    return [
        attrs.evolve(r, block_order="heads_outer", block_tokens=0)
        for r in describe_token_major(kv_caches, parallel, model)
    ]


def _by_tp(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """A layout whose declared order differs between engines (P TP1 vs D TP2)."""
    return (
        _lying(kv_caches, parallel, model)
        if parallel.tp_size > 1
        else describe_token_major(kv_caches, parallel, model)
    )


class TestLayouts:
    @hookimpl
    def kvpush_layouts(self) -> list[LayoutProvider]:
        return [
            LayoutProvider(name="nhd_undeclared", describe_regions=_undeclared),
            LayoutProvider(name="nhd_as_hnd", describe_regions=_lying),
            LayoutProvider(name="nhd_by_tp", describe_regions=_by_tp),
        ]


@pytest.fixture
def nhd_cluster(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A loopback cluster factory on token-major caches, with the test layouts registered."""
    real = cluster_module.get_plugin_manager

    def with_layouts(**kwargs: Any) -> Any:
        return real(**{**kwargs, "plugins": [*kwargs.get("plugins", ()), ("test_layouts", TestLayouts())]})

    monkeypatch.setattr(cluster_module, "get_plugin_manager", with_layouts)
    monkeypatch.setattr(cluster_module, "allocate_kv_caches", allocate_token_major_caches)
    return lambda layout, **shape: Cluster(MHA, num_blocks=16, layout=layout, **shape)


def _d_untouched(cluster: Cluster) -> bool:
    return not any(kv_bytes(t).any() for caches in cluster.d_caches.values() for t in caches.values())


def _push(cluster: Cluster) -> dict[int, str | None]:
    cluster.add("d-1", [[1, 2, 3]], "x-1")
    cluster.finish("p-1", [[4, 5, 6]], "x-1")
    return cluster.wait_decode("d-1", timeout_s=20)


@pytest.mark.parametrize(
    ("layout", "shape", "what"),
    [
        ("nhd_undeclared", {"decode_tp": 2}, "block_order='heads_outer'"),
        ("nhd_undeclared", {"prefill_tp": 2}, "block_order='heads_outer'"),
        ("nhd_by_tp", {"decode_tp": 2}, "heads_outer"),
    ],
    ids=["undeclared-tp1-to-tp2", "undeclared-tp2-to-tp1", "mismatched-orders"],
)
def test_unsliceable_nhd_is_refused_not_pushed(nhd_cluster: Any, layout: str, shape: dict, what: str) -> None:
    with nhd_cluster(layout, **shape) as cluster:
        outcome = _push(cluster)
        assert None not in outcome.values(), f"D reported done: {outcome}"
        for reason in outcome.values():
            assert f"layout {layout!r}" in reason and what in reason, reason
        assert _d_untouched(cluster)


def test_undeclared_order_still_moves_whole_blocks(nhd_cluster: Any) -> None:
    with nhd_cluster("nhd_undeclared", prefill_pp=2) as cluster:
        assert set(_push(cluster).values()) == {None}
        for name, got in cluster.d_caches[0].items():
            source = next(c[name] for c in cluster.p_caches.values() if name in c)
            assert torch.equal(kv_bytes(got)[[1, 2, 3]], kv_bytes(source)[[4, 5, 6]])


def test_a_layout_lying_about_its_order_delivers_wrong_heads(nhd_cluster: Any) -> None:
    """Why the order must be declared: an NHD cache sliced as HND (the old model) completes
    'done' with the wrong bytes. The same cache declared tokens_outer lands exactly."""
    for layout, exact in [("nhd_as_hnd", False), ("token_major", True)]:
        with nhd_cluster(layout, decode_tp=2) as cluster:
            assert set(_push(cluster).values()) == {None}
            source = cluster.p_caches[next(iter(cluster.p_caches))]
            ok = all(
                torch.equal(
                    kv_bytes(got)[[1, 2, 3]], kv_bytes(source[name])[[4, 5, 6]][:, :, 2 * tp : 2 * tp + 2]
                )
                for tp, caches in cluster.d_caches.items()
                for name, got in caches.items()
            )
            assert ok is exact, layout


def test_strategy_counts_a_descriptor_per_token_of_a_sliced_nhd_block() -> None:
    """Sliced NHD direct posts a descriptor per token (measured 2.5x slower than packed on the
    CPU box), so the strategy sees them and packs; HND slices stay one descriptor per block."""
    from kvpush.core.packing import STAGING_KEY
    from kvpush.core.types import PushJob, ReadSpec
    from kvpush.plugins.strategy import choose, merged_descriptors

    staging = {STAGING_KEY: {"addr": 0, "len": 1 << 20, "dev": 0}}
    ids = list(range(0, 128, 2))
    for order, want in [("tokens_outer", "packed"), ("heads_outer", "direct")]:
        meta = attrs.evolve(_meta("prefill", 1, order, block_tokens=16), extensions=staging)
        job = PushJob(local=meta, decode_tp_size=2, local_block_ids=[ids], remote_block_ids=[ids])
        spec = ReadSpec(dst_tp_rank=1, local_block_ids=[ids], remote_block_ids=[ids], local_part=(1, 2))
        rows = 16 if order == "tokens_outer" else 1
        assert merged_descriptors(spec, job)[0] == len(meta.regions) * len(ids) * rows
        assert choose(job, spec) == want, order
        whole = ReadSpec(dst_tp_rank=0, local_block_ids=[ids], remote_block_ids=[ids])
        assert merged_descriptors(whole, job)[0] == len(meta.regions) * len(ids)  # equal TP: runs
