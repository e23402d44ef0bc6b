"""The HMA layout plugin: semantic region matching for hybrid models under PP.

Unit tests go through the real plugin manager (every built-in plugin registered, so a second
claimant such as offset PP slicing would surface as a ``PluginError``). The last test pushes
real KV bytes with NIXL from a PP=2 prefill engine (one process per stage) into a TP=2 decode
engine (one process per rank) and compares every pushed block byte for byte.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
import traceback
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpush.core.errors import ConfigError, HandshakeError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.peers import check_geometry
from kvpush.core.planning import descriptor_ids, pair_blocks, region_descriptors
from kvpush.core.types import (
    AgentMetadata,
    HandshakeMode,
    KVRegion,
    ModelSpec,
    ParallelConfig,
    RankKey,
    RequestMetadata,
    Role,
    TransferParams,
)
from kvpush.layouts.hma import allocate_hma_caches, describe_hma
from kvpush.layouts.uniform import allocate_kv_caches

# Six layers, sliding-window / full interleaved (Gemma-like): group 0 = full, group 1 = sliding.
KINDS = ("sliding_window", "sliding_window", "full", "sliding_window", "sliding_window", "full")
GROUPS = tuple(0 if kind == "full" else 1 for kind in KINDS)


def hybrid_model(num_layers: int = 6) -> ModelSpec:
    kinds = (KINDS * ((num_layers + 5) // 6))[:num_layers]
    return ModelSpec(
        name="hybrid-test",
        num_layers=num_layers,
        num_kv_heads=4,
        head_dim=8,
        block_size=4,
        dtype="bfloat16",
        layer_groups=tuple(0 if kind == "full" else 1 for kind in kinds),
        layer_kinds=kinds,
    )


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager(load_entrypoints=False)


def build_meta(
    pm,
    role: Role,
    parallel: ParallelConfig,
    model: ModelSpec,
    blocks: tuple[int, ...],
    *,
    layout: str = "hma",
    regions: tuple[KVRegion, ...] | None = None,
    keep: list | None = None,
) -> AgentMetadata:
    """Hand-built metadata over regions described from real tensors (kept alive in ``keep``)."""
    if regions is None:
        caches = allocate_hma_caches(model, parallel, blocks)
        if keep is not None:
            keep.append(caches)
        regions = tuple(pm.layout(layout).describe_regions(caches, parallel, model))
    meta = AgentMetadata(
        engine_id="P" if role is Role.PREFILL else "D",
        role=role,
        parallel=parallel,
        model=model,
        layout=layout,
        transport="nixl",
        agent_name=f"{role.value}-{parallel.pp_rank}-{parallel.tp_rank}",
        agent_blob=b"",
        regions=regions,
    )
    return attrs.evolve(meta, extensions=pm.metadata_extensions(meta))


def stage(pp_rank: int, pp_size: int = 2, tp_size: int = 1, tp_rank: int = 0, num_layers: int = 6):
    return ParallelConfig.for_stage(
        num_layers=num_layers, pp_size=pp_size, pp_rank=pp_rank, tp_size=tp_size, tp_rank=tp_rank
    )


def assert_pairs_by_meaning(local: AgentMetadata, peer: AgentMetadata, alignment) -> None:
    assert len(alignment.remote_indices) == len(local.regions)
    for mine, j in zip(local.regions, alignment.remote_indices):
        theirs = peer.regions[j]
        assert theirs.semantic_key == mine.semantic_key
        assert theirs.attention_kind == mine.attention_kind


# ------------------------------------------------------------------------------ layout


def test_layout_is_offered_and_describes_regions_in_layer_order(pm):
    provider = pm.layouts()["hma"]
    assert provider.allocate is not None  # layouts offer allocation for the demo and test cluster
    model = hybrid_model(12)
    parallel = ParallelConfig(tp_size=2, tp_rank=1, num_layers=12)
    caches = allocate_hma_caches(model, parallel, (10, 7))
    regions = provider.describe_regions(caches, parallel, model)
    names = [r.layer_names[0] for r in regions]
    assert names[::2] == [f"layers.{i}" for i in range(12)]  # layers.10 after layers.2
    assert names[1::2] == names[::2]
    for i, region in enumerate(regions):
        layer = i // 2
        tensor = caches[f"layers.{layer}"]
        assert region.component == ("K", "V")[i % 2]
        assert region.kv_group == model.group_of(layer)
        assert region.attention_kind == model.kind_of(layer)
        assert region.num_blocks == (10, 7)[region.kv_group]
        assert region.replicate is False and region.num_heads == 2
        assert region.base_addr == tensor[i % 2].data_ptr()
        assert region.block_len == 2 * 4 * 8 * 2  # heads × block_size × head_dim × bf16
    assert pm.metadata_extensions(build_meta(pm, Role.PREFILL, parallel, model, (10, 7))) == {
        "region_matching": "semantic"
    }


def test_layout_rejects_bad_tensors(pm):
    model = hybrid_model()
    parallel = ParallelConfig(tp_size=1, num_layers=6)
    with pytest.raises(ConfigError, match="2 KV-cache group"):
        allocate_hma_caches(model, parallel, (8,))
    caches = allocate_hma_caches(model, parallel, (8, 4))
    caches["layers.1"] = torch.zeros(2, 5, 4, 4, 8, dtype=torch.bfloat16)  # group 1 holds 4
    with pytest.raises(ConfigError, match=r"layers\.0 and layers\.1 .* KV group 1"):
        describe_hma(caches, parallel, model)
    caches["layers.1"] = torch.zeros(2, 4, 3, 4, 8, dtype=torch.bfloat16)  # wrong head count
    with pytest.raises(ConfigError, match=r"HMA layer layers\.1 must be"):
        describe_hma(caches, parallel, model)


def test_uniform_layout_refuses_pp_for_hybrid_models(pm):
    model = hybrid_model()
    parallel = stage(1)
    caches = allocate_kv_caches(model, parallel, 8)
    with pytest.raises(ConfigError, match="hma"):
        pm.layout("uniform").describe_regions(caches, parallel, model)


def test_uniform_layout_publishes_no_semantic_matching(pm):
    model = ModelSpec(name="dense", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    parallel = ParallelConfig(tp_size=1, num_layers=2)
    keep = [allocate_kv_caches(model, parallel, 4)]
    regions = tuple(pm.layout("uniform").describe_regions(keep[0], parallel, model))
    meta = build_meta(pm, Role.PREFILL, parallel, model, (4,), layout="uniform", regions=regions)
    assert "region_matching" not in meta.extensions


# ------------------------------------------------------------------------------ alignment


def test_reordered_remote_regions_pair_by_meaning(pm):
    model = hybrid_model()
    keep: list = []
    local = build_meta(pm, Role.PREFILL, ParallelConfig(tp_size=1, num_layers=6), model, (40, 24), keep=keep)
    decode = build_meta(pm, Role.DECODE, ParallelConfig(tp_size=2, num_layers=6), model, (32, 48), keep=keep)
    shuffled = list(decode.regions)
    random.Random(7).shuffle(shuffled)
    assert shuffled != list(decode.regions)
    peer = attrs.evolve(decode, regions=tuple(shuffled))
    alignment = pm.align_regions(local, peer)
    assert alignment.source == "hma"
    assert_pairs_by_meaning(local, peer, alignment)
    assert alignment.remote_indices != tuple(range(len(local.regions)))
    assert check_geometry(local, peer, alignment) == []


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_pp_stage_aligns_into_decode_full_list(pm, pp_rank):
    model = hybrid_model()
    keep: list = []
    local = build_meta(pm, Role.PREFILL, stage(pp_rank), model, (40, 24), keep=keep)
    peer = build_meta(pm, Role.DECODE, ParallelConfig(tp_size=2, num_layers=6), model, (32, 48), keep=keep)
    assert len(peer.regions) == 2 * len(local.regions)  # the other stage's layers are remote-only
    assert pm.validate_peer(local, peer, HandshakeMode.FULL) == []
    alignment = pm.align_regions(local, peer)  # PP slicing stands aside: no double claim
    assert alignment.source == "hma"
    assert_pairs_by_meaning(local, peer, alignment)
    first = 3 * pp_rank
    assert [peer.regions[j].layer_names[0] for j in alignment.remote_indices] == [
        f"layers.{first + i // 2}" for i in range(6)
    ]
    # each pair keeps its own side's per-group capacity
    assert [peer.regions[j].num_blocks for j in alignment.remote_indices] == [
        (32, 48)[model.group_of(first + i // 2)] for i in range(6)
    ]
    assert check_geometry(local, peer, alignment) == []


def test_remote_only_layers_are_ignored(pm):
    model = hybrid_model()
    keep: list = []
    local = build_meta(pm, Role.PREFILL, stage(0), model, (8, 8), keep=keep)
    full = build_meta(pm, Role.DECODE, ParallelConfig(tp_size=1, num_layers=6), model, (8, 8), keep=keep)
    # the peer lists the other stage's layers first and ours last, interleaved by component
    mine = {r.layer_names[0] for r in local.regions}
    others = [r for r in full.regions if r.layer_names[0] not in mine]
    ours = [r for r in full.regions if r.layer_names[0] in mine]
    peer = attrs.evolve(full, regions=(*others, *reversed(ours)))
    alignment = pm.align_regions(local, peer)
    assert_pairs_by_meaning(local, peer, alignment)
    assert min(alignment.remote_indices) >= len(others)


def test_missing_local_layer_fails_naming_it(pm):
    model = hybrid_model()
    keep: list = []
    local = build_meta(pm, Role.PREFILL, stage(1), model, (8, 8), keep=keep)
    full = build_meta(pm, Role.DECODE, ParallelConfig(tp_size=1, num_layers=6), model, (8, 8), keep=keep)
    peer = attrs.evolve(full, regions=tuple(r for r in full.regions if r.layer_names != ("layers.4",)))
    with pytest.raises(HandshakeError, match=r"layers\.4") as info:
        pm.align_regions(local, peer)
    assert "no region for that layer" in str(info.value)


def test_layer_in_another_group_on_the_peer_fails_naming_it(pm):
    model = hybrid_model()
    keep: list = []
    local = build_meta(pm, Role.PREFILL, stage(0), model, (8, 8), keep=keep)
    full = build_meta(pm, Role.DECODE, ParallelConfig(tp_size=1, num_layers=6), model, (8, 8), keep=keep)
    regrouped = tuple(
        attrs.evolve(r, kv_group=0) if r.layer_names == ("layers.1",) else r for r in full.regions
    )
    with pytest.raises(HandshakeError, match=r"layers\.1 \(KV group 1, K\).*KV group 0"):
        pm.align_regions(local, attrs.evolve(full, regions=regrouped))


def test_duplicate_remote_key_fails_naming_the_layer(pm):
    model = hybrid_model()
    keep: list = []
    local = build_meta(pm, Role.PREFILL, stage(0), model, (8, 8), keep=keep)
    full = build_meta(pm, Role.DECODE, ParallelConfig(tp_size=1, num_layers=6), model, (8, 8), keep=keep)
    duplicate = next(r for r in full.regions if r.layer_names == ("layers.2",) and r.component == "V")
    peer = attrs.evolve(full, regions=(*full.regions, attrs.evolve(duplicate, base_addr=duplicate.end_addr)))
    with pytest.raises(HandshakeError, match=r"layers\.2 \(KV group 0, V\) twice"):
        pm.align_regions(local, peer)


def test_validate_peer_requires_semantic_hma_peer(pm):
    model = hybrid_model()
    keep: list = []
    local = build_meta(pm, Role.PREFILL, stage(0), model, (8, 8), keep=keep)
    hma_peer = build_meta(pm, Role.DECODE, ParallelConfig(tp_size=1, num_layers=6), model, (8, 8), keep=keep)
    assert pm.validate_peer(local, hma_peer, HandshakeMode.FULL) == []

    uniform_peer = attrs.evolve(hma_peer, layout="uniform", extensions={})
    problems = pm.validate_peer(local, uniform_peer, HandshakeMode.FULL)
    assert any("'uniform'" in p and "--layout hma" in p for p in problems)

    silent_peer = attrs.evolve(hma_peer, extensions={})
    problems = pm.validate_peer(local, silent_peer, HandshakeMode.NOTIF_ONLY)
    assert any("region_matching" in p for p in problems)
    with pytest.raises(HandshakeError, match="region_matching"):
        pm.check_peer(local, silent_peer, HandshakeMode.FULL)


def test_non_hma_ranks_are_not_claimed(pm):
    model = ModelSpec(name="dense", num_layers=4, num_kv_heads=2, head_dim=8, block_size=4)
    keep = []
    metas = []
    for role, parallel in (
        (Role.PREFILL, stage(1, num_layers=4)),
        (Role.DECODE, ParallelConfig(tp_size=1, num_layers=4)),
    ):
        keep.append(allocate_kv_caches(model, parallel, 4))
        regions = tuple(pm.layout("uniform").describe_regions(keep[-1], parallel, model))
        metas.append(build_meta(pm, role, parallel, model, (4,), layout="uniform", regions=regions))
    alignment = pm.align_regions(*metas)
    assert alignment.source == "pp_slicing"
    assert alignment.remote_indices == tuple(range(4, 8))


# ------------------------------------------------------------------------------ descriptor ids


def test_descriptor_ids_for_two_groups_with_different_capacities(pm):
    model = hybrid_model()
    parallel = stage(0)
    caches = allocate_hma_caches(model, parallel, (40, 24))
    regions = describe_hma(caches, parallel, model)
    groups = [r.kv_group for r in regions]
    assert groups == [1, 1, 1, 1, 0, 0]  # layers 0, 1 sliding; layer 2 full
    block_ids = ((3, 39, 0), (23, 5))
    ids = descriptor_ids(regions, groups, block_ids)
    # region-major, each region's capacity is its own group's count: offsets 0, 24, 48, 72, 96, 136
    expected = []
    offset = 0
    for region in regions:
        expected.extend(offset + b for b in block_ids[region.kv_group])
        offset += region.num_blocks
    assert offset == 4 * 24 + 2 * 40
    assert ids.tolist() == expected
    assert ids.tolist() == [23, 5, 47, 29, 71, 53, 95, 77, 99, 135, 96, 139, 175, 136]
    # every id points at exactly that block's bytes
    table = region_descriptors(regions)
    at = 0
    for region in regions:
        tensor = caches[region.layer_names[0]][("K", "V").index(region.component)]
        for block in block_ids[region.kv_group]:
            addr, size, _ = table[ids[at]]
            assert int(addr) == tensor[block].data_ptr()
            assert int(size) == tensor[block].numel() * tensor.element_size()
            at += 1
    # 39 fits group 0 (40 blocks) but not group 1 (24 blocks)
    with pytest.raises(ConfigError, match="group 1"):
        descriptor_ids(regions, groups, ((0,), (39,)))


@given(
    data=st.data(),
    groups=st.lists(st.integers(0, 2), min_size=1, max_size=8),
)
def test_descriptor_ids_across_groups_match_the_region_by_region_rule(pm, data, groups) -> None:
    """The vectorised several-group path emits, region by region, ``offset + block`` for the
    region's own group, and refuses the first region (in order) whose capacity a block id of
    its group exceeds, naming that group and the id, as a per-region loop does."""
    model = hybrid_model()
    caches = allocate_hma_caches(model, stage(0), (40, 24))
    base = describe_hma(caches, stage(0), model)[0]
    capacities = data.draw(st.lists(st.integers(1, 30), min_size=len(groups), max_size=len(groups)))
    regions = tuple(attrs.evolve(base, num_blocks=cap, kv_group=g) for cap, g in zip(capacities, groups))
    block_ids = tuple(
        tuple(data.draw(st.lists(st.integers(-1, 32), max_size=6))) for _ in range(max(groups) + 1)
    )
    expected: list[int] = []
    problem = None
    offset = 0
    for region in regions:
        ids = block_ids[region.kv_group]
        if problem is None and ids and (max(ids) >= region.num_blocks or min(ids) < 0):
            problem = f"block id {max(ids)} of group {region.kv_group} is outside the region's "
        expected.extend(offset + b for b in ids)
        offset += region.num_blocks
    if problem is not None:
        with pytest.raises(ConfigError) as err:
            descriptor_ids(regions, tuple(groups), block_ids)
        assert str(err.value).startswith(problem), (str(err.value), problem)
    else:
        got = descriptor_ids(regions, tuple(groups), block_ids)
        assert got.dtype == np.int32 and got.tolist() == expected


# ------------------------------------------------------------------------------ real push
#
# Prefill engine "P": PP=2, TP=1, one process per stage. Decode engine "D": TP=2, one process
# per rank. The test process runs both engines' side channels and tells the ranks what to do.

NUM_LAYERS = 6
P_BLOCKS = (40, 24)
D_BLOCKS = (32, 48)
# (P request id, transfer id, P block ids per group, D request id, D block ids per group,
#  where D's blocks start per group: D's block_start)
REQUESTS = (
    ("p0", "t0", ((1, 2, 3), (4, 5)), "d0", ((7, 8, 9), (30, 31)), (0, 0)),
    ("p1", "t1", ((10, 39), (0,)), "d1", ((0, 31), (47,)), (0, 0)),
    # prefix hit on D: it registers only the uncached suffix and states where it starts
    ("p2", "t2", ((12, 13, 14), (6, 23)), "d2", ((20, 21), (40,)), (1, 1)),
    # a hit in one group only, and P passing a block past the prompt in group 0 (a lookahead):
    # paired by D's starts, P's extra block moves nowhere
    ("p3", "t3", ((15, 16, 17, 18), (7, 8)), "d3", ((22, 23, 24), (41,)), (0, 1)),
)
STEP_S = 60.0


def _fill_random(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(caches):
        tensor = caches[name]
        bits = torch.randint(-32768, 32768, tensor.shape, dtype=torch.int16, generator=gen)
        tensor.view(torch.int16).copy_(bits)


def _as_int16(caches: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: t.view(torch.int16).numpy().copy() for name, t in caches.items()}


def _prefill_stage(pp_rank: int, p_port: int, commands: Any, results: Any) -> None:
    from kvpush.core.sender import PushSender
    from kvpush.core.worker import WorkerConfig

    who = ("P", pp_rank)
    try:
        model = hybrid_model(NUM_LAYERS)
        parallel = stage(pp_rank, num_layers=NUM_LAYERS)
        caches = allocate_hma_caches(model, parallel, P_BLOCKS)
        _fill_random(caches, seed=1000 + pp_rank)
        config = WorkerConfig(
            engine_id="P", parallel=parallel, model=model, layout="hma", side_channel_port=p_port
        )
        sender = PushSender(config, caches)
        sender.start()
        try:
            results.put(("ready", who, sender.handshake_payload()))
            requests = commands.get(timeout=STEP_S)
            for request_id, key, block_ids in requests:
                sender.request_finished(request_id, block_ids, match_key=key)
            sent: set[str] = set()
            failed: dict[str, str] = {}
            deadline = time.monotonic() + STEP_S
            while len(sent) + len(failed) < len(requests) and time.monotonic() < deadline:
                finished = sender.get_finished()
                sent.update(finished.sent)
                failed.update(finished.failed)
                time.sleep(0.005)
            results.put(("done", who, {"sent": sorted(sent), "failed": failed, "caches": _as_int16(caches)}))
            commands.get(timeout=STEP_S)  # stay up until every rank has reported
        finally:
            sender.close()
    except BaseException:
        results.put(("error", who, traceback.format_exc()))


def _decode_rank(tp_rank: int, p_port: int, d_port: int, commands: Any, results: Any) -> None:
    from kvpush.core.errors import WaitTimeout
    from kvpush.core.receiver import PushReceiver
    from kvpush.core.worker import WorkerConfig

    who = ("D", tp_rank)
    try:
        model = hybrid_model(NUM_LAYERS)
        parallel = ParallelConfig(tp_size=2, tp_rank=tp_rank, num_layers=NUM_LAYERS)
        caches = allocate_hma_caches(model, parallel, D_BLOCKS)
        config = WorkerConfig(
            engine_id="D", parallel=parallel, model=model, layout="hma", side_channel_port=d_port
        )
        receiver = PushReceiver(config, caches)
        receiver.start()
        try:
            results.put(("ready", who, receiver.handshake_payload()))
            requests = commands.get(timeout=STEP_S)
            for request_id, key, block_ids, block_start in requests:
                params = TransferParams(
                    remote_engine_id="P",
                    remote_host="127.0.0.1",
                    remote_port=p_port,
                    tp_size=1,
                    pp_size=2,
                    transfer_id=key,
                )
                receiver.add_request(
                    RequestMetadata(
                        request_id=request_id, block_ids=block_ids, params=params, block_start=block_start
                    )
                )
            done: set[str] = set()
            failed: dict[str, str] = {}
            deadline = time.monotonic() + STEP_S
            while len(done) + len(failed) < len(requests) and time.monotonic() < deadline:
                try:
                    finished = receiver.wait_finished(min(1.0, max(0.01, deadline - time.monotonic())))
                except WaitTimeout:
                    continue
                done.update(finished.done)
                failed.update(finished.failed)
            results.put(("done", who, {"done": sorted(done), "failed": failed, "caches": _as_int16(caches)}))
            commands.get(timeout=STEP_S)
        finally:
            receiver.close()
    except BaseException:
        results.put(("error", who, traceback.format_exc()))


def _collect(results: Any, kind: str, procs: dict, timeout_s: float) -> dict:
    """One ``kind`` message from every process, failing fast on an error or a dead process."""
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        if time.monotonic() > deadline:
            missing = sorted(set(procs) - set(got))
            pytest.fail(f"no {kind!r} from {missing} within {timeout_s}s")
        try:
            message, who, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = {who: p.exitcode for who, p in procs.items() if p.exitcode is not None and who not in got}
            if dead:
                pytest.fail(f"rank processes exited before sending {kind!r}: {dead}")
            continue
        if message == "error":
            pytest.fail(f"rank {who} failed:\n{payload}")
        assert message == kind, (message, who)
        got[who] = payload
    return got


def test_pp2_prefill_pushes_hybrid_kv_into_tp2_decode_byte_for_byte():
    from kvpush.core.sidechannel import SideChannelServer

    ctx = mp.get_context("spawn")
    p_server = SideChannelServer("P")
    d_server = SideChannelServer("D")
    results = ctx.Queue()
    commands = {who: ctx.Queue() for who in (("P", 0), ("P", 1), ("D", 0), ("D", 1))}
    procs = {
        ("P", pp): ctx.Process(
            target=_prefill_stage, args=(pp, p_server.port, commands["P", pp], results), daemon=True
        )
        for pp in (0, 1)
    }
    procs.update(
        {
            ("D", tp): ctx.Process(
                target=_decode_rank,
                args=(tp, p_server.port, d_server.port, commands["D", tp], results),
                daemon=True,
            )
            for tp in (0, 1)
        }
    )
    try:
        for proc in procs.values():
            proc.start()
        payloads = _collect(results, "ready", procs, timeout_s=120)
        for (engine, rank), payload in payloads.items():
            if engine == "P":
                p_server.publish(RankKey(rank, 0), payload)
            else:
                d_server.publish(RankKey(0, rank), payload)

        for pp in (0, 1):
            commands["P", pp].put([(p_id, key, p_ids) for p_id, key, p_ids, *_ in REQUESTS])
        for tp in (0, 1):
            commands["D", tp].put([(d_id, key, d_ids, start) for _, key, _, d_id, d_ids, start in REQUESTS])
        reports = _collect(results, "done", procs, timeout_s=2 * STEP_S)
        for q in commands.values():
            q.put("exit")
        for proc in procs.values():
            proc.join(timeout=30)
        assert all(proc.exitcode == 0 for proc in procs.values()), {w: p.exitcode for w, p in procs.items()}
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        for q in (results, *commands.values()):
            q.close()
            q.join_thread()
        p_server.close()
        d_server.close()

    for pp in (0, 1):
        assert reports["P", pp]["failed"] == {}
        assert reports["P", pp]["sent"] == sorted(r[0] for r in REQUESTS)
    for tp in (0, 1):
        assert reports["D", tp]["failed"] == {}
        assert reports["D", tp]["done"] == sorted(r[3] for r in REQUESTS)

    model = hybrid_model(NUM_LAYERS)
    prefill = {**reports["P", 0]["caches"], **reports["P", 1]["caches"]}
    assert sorted(prefill) == sorted(f"layers.{i}" for i in range(NUM_LAYERS))
    heads = model.num_kv_heads // 2
    compared = 0
    for tp in (0, 1):
        decode = reports["D", tp]["caches"]
        assert sorted(decode) == sorted(prefill)
        for layer in range(NUM_LAYERS):
            name = f"layers.{layer}"
            group = model.group_of(layer)
            src, dst = prefill[name], decode[name]
            assert src.shape == (2, P_BLOCKS[group], 4, 4, 8)
            assert dst.shape == (2, D_BLOCKS[group], heads, 4, 8)
            written = set()
            for p_id, _, p_ids, _, d_ids, start in REQUESTS:
                sent_ids = pair_blocks(p_ids, d_ids, p_id, decode_start=start)[group]
                for p_block, d_block in zip(sent_ids, d_ids[group], strict=True):
                    expected = src[:, p_block, tp * heads : (tp + 1) * heads]
                    assert expected.any()
                    assert np.array_equal(dst[:, d_block], expected), (tp, name, p_id, p_block, d_block)
                    written.add(d_block)
                    compared += 1
            untouched = [b for b in range(D_BLOCKS[group]) if b not in written]
            assert not dst[:, untouched].any(), f"stray bytes in {name} on D rank {tp}"
    assert compared == 2 * sum(
        len(d_ids[model.group_of(layer)]) for *_, d_ids, _ in REQUESTS for layer in range(NUM_LAYERS)
    )
