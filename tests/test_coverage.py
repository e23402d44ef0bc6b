"""The coverage property: the WRITEs of D's expected producers tile D's registered blocks.

For a topology (P PP x P TP -> D TP), a model (MHA/GQA, MLA, hybrid groups) and a layout
(uniform, token_major, hma), the test builds every rank's real regions (the layout's own
``allocate`` and ``describe`` over CPU tensors) and replays what the code does at handshake and
planning time: D's validators and the producer set it waits for
(:meth:`~kvpush.core.manager.KvpushPluginManager.expected_producers`, D's coverage check in
:mod:`kvpush.core.peers`), P's validators, region alignment and geometry check, P's plan
(``PushSender._plan``: the read-spec hook, checked against the expected producers) and the
descriptor lists and ids P posts (:mod:`kvpush.core.planning`). From the remote descriptors it
computes the bytes of each D rank every producer's WRITEs cover and asserts:

- every byte of every registered block is written by exactly one expected producer (for a
  replicated MLA latent with P TP > D TP, by exactly the ``k`` replicas that D counts: they
  hold the same bytes), and no byte outside the registered blocks is written;
- every producer that writes a D rank is one that rank waits for, and every producer it waits
  for writes it;
- local and remote descriptors pair with equal lengths.

A topology the code refuses must be refused with ``ConfigError``/``HandshakeError`` (or a
``PluginError``) whose message names the cause.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.core.errors import ConfigError, HandshakeError, PluginError
from kvpush.core.manager import KvpushPluginManager, get_plugin_manager
from kvpush.core.peers import check_geometry, check_producers
from kvpush.core.planning import descriptor_ids, region_descriptors
from kvpush.core.sender import PushSender
from kvpush.core.types import (
    AgentMetadata,
    HandshakeMode,
    ModelSpec,
    ParallelConfig,
    PushRegistration,
    RankKey,
    Role,
)

REFUSALS = (ConfigError, HandshakeError, PluginError)


@functools.cache
def builtin_pm() -> KvpushPluginManager:
    """The built-in plugins (hooks are pure functions of their arguments: one manager is enough)."""
    return get_plugin_manager(load_entrypoints=False, env={})


@attrs.define
class Engine:
    metas: dict[RankKey, AgentMetadata]
    caches: list[Any]
    """The tensors behind the regions (kept alive so addresses stay valid)."""


def rank_meta(
    pm: KvpushPluginManager,
    *,
    engine_id: str,
    role: Role,
    parallel: ParallelConfig,
    model: ModelSpec,
    layout: str,
    blocks: Sequence[int],
    keep: list[Any],
) -> AgentMetadata:
    """One rank's published metadata, built as a worker builds it (real regions, extensions)."""
    provider = pm.layout(layout)
    assert provider.allocate is not None
    caches = provider.allocate(model, parallel, list(blocks), "cpu")
    keep.append(caches)
    regions = provider.describe(caches, parallel, model)
    meta = AgentMetadata(
        engine_id=engine_id,
        role=role,
        parallel=parallel,
        model=model,
        layout=layout,
        transport="loopback",
        agent_name=f"{engine_id}-pp{parallel.pp_rank}-tp{parallel.tp_rank}",
        agent_blob=b"-",
        regions=regions,
    )
    return attrs.evolve(meta, extensions=pm.metadata_extensions(meta))


def build_prefill(
    pm: KvpushPluginManager,
    model: ModelSpec,
    layout: str,
    pp: int,
    tp: int,
    blocks: Sequence[int],
    parallel_of: Any = None,
) -> Engine:
    """Every P rank; ``parallel_of(pp_rank, tp_rank)`` may replace a rank's published config."""
    keep: list[Any] = []
    metas = {}
    for p in range(pp):
        for t in range(tp):
            parallel = ParallelConfig.for_stage(
                num_layers=model.num_layers, pp_size=pp, pp_rank=p, tp_size=tp, tp_rank=t
            )
            if parallel_of is not None:
                parallel = parallel_of(p, t) or parallel
            metas[RankKey(p, t)] = rank_meta(
                pm,
                engine_id="P",
                role=Role.PREFILL,
                parallel=parallel,
                model=model,
                layout=layout,
                blocks=blocks,
                keep=keep,
            )
    return Engine(metas, keep)


def build_decode(
    pm: KvpushPluginManager, model: ModelSpec, layout: str, tp: int, blocks: Sequence[int]
) -> Engine:
    keep: list[Any] = []
    metas = {}
    for t in range(tp):
        parallel = ParallelConfig(tp_size=tp, tp_rank=t, num_layers=model.num_layers)
        metas[RankKey(0, t)] = rank_meta(
            pm,
            engine_id="D",
            role=Role.DECODE,
            parallel=parallel,
            model=model,
            layout=layout,
            blocks=blocks,
            keep=keep,
        )
    return Engine(metas, keep)


@attrs.define
class Write:
    producer: RankKey
    dst: int
    addr: np.ndarray
    size: np.ndarray


def decode_handshake(
    pm: KvpushPluginManager, d_meta: AgentMetadata, prefill: Mapping[RankKey, AgentMetadata]
) -> frozenset[RankKey]:
    """What one D rank does at its notif-only handshake: the producers it waits for, checked."""
    first = prefill[RankKey(0, 0)]
    me = d_meta.parallel
    wanted = pm.expected_producers(first.parallel, me.tp_rank, me.tp_size)
    for rank in sorted(wanted):
        pm.check_peer(d_meta, prefill[rank], HandshakeMode.NOTIF_ONLY)
    problems = check_producers(pm, d_meta, {rank: prefill[rank] for rank in wanted})
    if problems:
        raise HandshakeError("\n".join(problems))
    return wanted


def plan_writes(
    pm: KvpushPluginManager,
    p_meta: AgentMetadata,
    decode: Mapping[RankKey, AgentMetadata],
    p_blocks: tuple[tuple[int, ...], ...],
    d_blocks: tuple[tuple[int, ...], ...],
) -> list[Write]:
    """What one P rank does: full handshakes with the D ranks, the plan, the descriptors."""
    decode_tp = next(iter(decode.values())).parallel.tp_size
    reg = PushRegistration(
        request_id="r",
        match_key="r",
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=1,
        decode_tp_size=decode_tp,
        block_ids=d_blocks,
        remote_engine_id="P",
        # D's blocks are P's last ones (a prefix hit on D), and D says where they start
        block_start=tuple(max(0, len(p) - len(d)) for p, d in zip(p_blocks, d_blocks)),
    )
    me = SimpleNamespace(metadata=p_meta, pm=pm, config=SimpleNamespace(parallel=p_meta.parallel))
    specs = PushSender._plan(me, p_blocks, reg)  # type: ignore[arg-type]  # the real planner
    groups = tuple(r.kv_group for r in p_meta.regions)
    writes = []
    for spec in specs:
        d_meta = decode[RankKey(0, spec.dst_tp_rank)]
        pm.check_peer(p_meta, d_meta, HandshakeMode.FULL)
        alignment = pm.align_regions(p_meta, d_meta)
        problems = check_geometry(p_meta, d_meta, alignment)
        if problems:
            raise HandshakeError("\n".join(problems))
        aligned = [d_meta.regions[j] for j in alignment.remote_indices]
        local = region_descriptors(p_meta.regions, spec.local_part)
        remote = region_descriptors(aligned, spec.remote_part)
        local_ids = descriptor_ids(p_meta.regions, groups, spec.local_block_ids)
        remote_ids = descriptor_ids(aligned, groups, spec.remote_block_ids)
        assert len(local_ids) == len(remote_ids)
        assert np.array_equal(local[local_ids, 1], remote[remote_ids, 1]), "descriptor lengths differ"
        rows = remote[remote_ids]
        writes.append(
            Write(p_meta.rank, spec.dst_tp_rank, rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64))
        )
    return writes


def coverage(
    d_meta: AgentMetadata, writes: Sequence[Write], d_blocks: tuple[tuple[int, ...], ...]
) -> tuple[np.ndarray, np.ndarray, dict[RankKey, np.ndarray]]:
    """Per byte of D's regions (concatenated, block_len per block): how many WRITEs cover it,
    and per producer its own count. Raises AssertionError for a write outside every region."""
    regions = d_meta.regions
    order = sorted(range(len(regions)), key=lambda i: regions[i].base_addr)
    bases = np.array([regions[i].base_addr for i in order], dtype=np.int64)
    sizes = [r.num_blocks * r.block_len for r in regions]
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    total = int(sum(sizes))
    per_producer: dict[RankKey, np.ndarray] = {}
    for write in writes:
        pos = np.searchsorted(bases, write.addr, side="right") - 1
        assert (pos >= 0).all(), f"{write.producer} writes below D's regions"
        index = np.array(order, dtype=np.int64)[pos]
        base = bases[pos]
        stride = np.array([regions[i].block_stride for i in index], dtype=np.int64)
        blen = np.array([regions[i].block_len for i in index], dtype=np.int64)
        nblk = np.array([regions[i].num_blocks for i in index], dtype=np.int64)
        block, within = np.divmod(write.addr - base, stride)
        outside = (block >= nblk) | (within + write.size > blen)
        assert not outside.any(), f"{write.producer} writes outside D rank {write.dst}'s blocks"
        start = offsets[index] + block * blen + within
        diff = np.zeros(total + 1, dtype=np.int64)
        np.add.at(diff, start, 1)
        np.add.at(diff, start + write.size, -1)
        counts = np.cumsum(diff[:-1])
        per_producer[write.producer] = per_producer.get(write.producer, 0) + counts
    covered = sum(per_producer.values(), np.zeros(total, dtype=np.int64))
    registered = np.zeros(total, dtype=bool)
    for i, region in enumerate(regions):
        for block in d_blocks[region.kv_group]:
            start = offsets[i] + block * region.block_len
            registered[start : start + region.block_len] = True
    return covered, registered, per_producer


def check_push(
    pm: KvpushPluginManager,
    prefill: Engine,
    decode: Engine,
    p_blocks: tuple[tuple[int, ...], ...],
    d_blocks: tuple[tuple[int, ...], ...],
) -> None:
    """Replay the handshakes and plans; assert the WRITEs tile every D rank's registered blocks."""
    waits = {d: decode_handshake(pm, meta, prefill.metas) for d, meta in decode.metas.items()}
    registered_with = set().union(*waits.values())  # D sends PUSH_REG to these ranks only
    writes = [
        w
        for rank, meta in prefill.metas.items()
        if rank in registered_with
        for w in plan_writes(pm, meta, decode.metas, p_blocks, d_blocks)
    ]
    for d, d_meta in decode.metas.items():
        mine = [w for w in writes if w.dst == d.tp_rank]
        writers = {w.producer for w in mine}
        assert writers == set(waits[d]), (
            f"D rank {d.tp_rank} waits for {sorted(waits[d])}, written by {sorted(writers)}"
        )
        covered, registered, per_producer = coverage(d_meta, mine, d_blocks)
        assert not covered[~registered].any(), (
            f"D rank {d.tp_rank}: bytes outside the registered blocks written"
        )
        for producer, counts in per_producer.items():
            assert counts.max(initial=0) <= 1, f"{producer} writes some byte of D rank {d.tp_rank} twice"
        replicas = replication(prefill, decode)
        want = np.where(registered, 1, 0)
        got = covered.copy()
        if replicas > 1:  # MLA, P TP > D TP: the k replicas D counts all write the same latent
            got = np.where(registered, covered // replicas, covered)
            assert np.array_equal(
                covered[registered] % replicas, np.zeros(int(registered.sum()), dtype=np.int64)
            )
        gaps = np.flatnonzero(registered & (got == 0))
        overlaps = np.flatnonzero(got > 1)
        assert not len(gaps), f"D rank {d.tp_rank}: {len(gaps)} registered bytes written by nobody"
        assert not len(overlaps), f"D rank {d.tp_rank}: {len(overlaps)} bytes written by two producers"
        assert np.array_equal(got, want)


def replication(prefill: Engine, decode: Engine) -> int:
    p = next(iter(prefill.metas.values()))
    d_tp = next(iter(decode.metas.values())).parallel.tp_size
    if all(r.replicate for r in p.regions) and p.parallel.tp_size > d_tp:
        return p.parallel.tp_size // d_tp
    return 1


# ------------------------------------------------------------------------------ the property


@st.composite
def topologies(draw: Any) -> dict[str, Any]:
    layout = draw(st.sampled_from(["uniform", "uniform_mla", "token_major", "hma", "vllm", "vllm_mla"]))
    mla = layout.endswith("_mla")
    pp = draw(st.integers(1, 4))
    if draw(st.integers(0, 9)) < 8:  # mostly sizes the hooks accept: TPs dividing one another
        base = draw(st.sampled_from([1, 1, 1, 3, 5, 7]))
        p_tp = base * 2 ** draw(st.integers(0, 3))
        d_tp = base * 2 ** draw(st.integers(0, 3))
        p_tp, d_tp = min(p_tp, 8 if base < 5 else base), min(d_tp, 8 if base < 5 else base)
        if base == 3:
            p_tp, d_tp = min(p_tp, 6), min(d_tp, 6)
        heads = math.lcm(p_tp, d_tp) * draw(st.sampled_from([1, 2]))
    else:
        p_tp = draw(st.integers(1, 8))
        d_tp = draw(st.integers(1, 8))
        heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
    num_layers = draw(st.integers(pp, 6))
    block_size = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    groups: tuple[int, ...] = ()
    if layout == "hma" or (layout in ("token_major", "vllm", "vllm_mla") and draw(st.booleans())):
        groups = tuple(draw(st.lists(st.integers(0, 1), min_size=num_layers, max_size=num_layers)))
        if 1 in groups and 0 not in groups:
            groups = tuple(0 if g else 1 for g in groups)
    model = ModelSpec(
        name="cov",
        num_layers=num_layers,
        attention="mla" if mla else "mha",
        num_kv_heads=1 if mla else heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=draw(st.sampled_from(["bfloat16", "float32", "int8"])),
        layer_groups=groups,
    )
    ngroups = model.num_groups
    p_count = [draw(st.integers(3, 6)) for _ in range(ngroups)]
    d_count = [draw(st.integers(3, 6)) for _ in range(ngroups)]
    if layout not in ("hma", "vllm", "vllm_mla"):  # uniform/token_major: every group like group 0
        p_count = [p_count[0]] * ngroups
        d_count = [d_count[0]] * ngroups
    p_blocks, d_blocks = [], []
    for g in range(ngroups):
        d_ids = draw(
            st.lists(st.integers(0, d_count[g] - 1), unique=True, min_size=0, max_size=min(3, d_count[g]))
        )
        extra = draw(st.integers(0, 1))
        n = min(len(d_ids) + extra, p_count[g])
        p_ids = draw(st.lists(st.integers(0, p_count[g] - 1), unique=True, min_size=n, max_size=n))
        p_blocks.append(tuple(p_ids))
        d_blocks.append(tuple(d_ids[: len(p_ids)]))
    return {
        "layout": layout.removesuffix("_mla"),
        "model": model,
        "pp": pp,
        "p_tp": p_tp,
        "d_tp": d_tp,
        "p_count": p_count,
        "d_count": d_count,
        "p_blocks": tuple(p_blocks),
        "d_blocks": tuple(d_blocks),
    }


def run_topology(t: Mapping[str, Any]) -> str:
    """``"pushed"`` when the push tiles D's blocks, else the refusal's message."""
    pm = builtin_pm()
    model, layout = t["model"], t["layout"]
    try:
        prefill = build_prefill(pm, model, layout, t["pp"], t["p_tp"], t["p_count"])
        decode = build_decode(pm, model, layout, t["d_tp"], t["d_count"])
        check_push(pm, prefill, decode, t["p_blocks"], t["d_blocks"])
    except REFUSALS as err:
        message = str(err)
        assert len(message) > 20, f"a refusal must say why: {err!r}"
        return message
    return "pushed"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies())
def test_expected_producers_writes_tile_the_registered_blocks(t: dict[str, Any]) -> None:
    outcome = run_topology(t)
    why = unsupported(t)
    if not why:
        assert outcome == "pushed", f"a supported topology was refused: {outcome}"
    else:
        assert any(w in outcome for w in why), f"expected a refusal naming one of {why}: {outcome}"


def unsupported(t: Mapping[str, Any]) -> list[str]:
    """Why the code must refuse a topology (phrases one of which its message holds); empty
    when it must push."""
    model, p_tp, d_tp = t["model"], t["p_tp"], t["d_tp"]
    why = []
    if model.attention == "mha" and any(model.num_kv_heads % tp for tp in (p_tp, d_tp)):
        why.append("num_kv_heads")
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        why.append("must divide one another")
    if t["layout"] == "token_major" and t["pp"] > 1 and model.num_groups > 1:
        why.append("cannot pipeline a hybrid")
    one_head = {model.num_kv_heads // tp == 1 for tp in (p_tp, d_tp)}
    if t["layout"] == "vllm" and model.attention == "mha" and model.block_size == 1 and len(one_head) > 1:
        # A one-head, one-token block is contiguous either way; the vllm layout resolves it to
        # tokens_outer while a many-head block is heads_outer, and the block-order rule refuses
        # the pair: a safe (if needless) refusal, never a wrong byte. vLLM blocks hold >= 16 tokens.
        why.append("block_order")
    return why


def test_supported_topologies_are_accepted_not_refused() -> None:
    """The grid the hooks accept: every PP 1..4 x P TP x D TP that divide with 8 KV heads."""
    refused = []
    for layout, attention in (("uniform", "mha"), ("uniform", "mla"), ("token_major", "mha"), ("hma", "mha")):
        for pp in (1, 2, 3, 4):
            for p_tp, d_tp in ((1, 1), (1, 8), (8, 1), (2, 4), (4, 2), (8, 8)):
                model = ModelSpec(
                    name="grid",
                    num_layers=5,
                    attention=attention,  # type: ignore[arg-type]
                    num_kv_heads=1 if attention == "mla" else 8,
                    head_dim=4,
                    block_size=2,
                    layer_groups=(0, 1, 0, 1, 1) if layout == "hma" else (),
                )
                t = {
                    "layout": layout,
                    "model": model,
                    "pp": pp,
                    "p_tp": p_tp,
                    "d_tp": d_tp,
                    "p_count": [4] * model.num_groups,
                    "d_count": [5] * model.num_groups,
                    "p_blocks": tuple((3, 0, 2) for _ in range(model.num_groups)),
                    "d_blocks": tuple((4, 1) for _ in range(model.num_groups)),
                }
                outcome = run_topology(t)
                if outcome != "pushed":
                    refused.append((layout, attention, pp, p_tp, d_tp, outcome[:200]))
    assert not refused, refused


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "words"),
    [
        (3, 2, 6, "divide"),  # TP sizes that do not divide one another
        (2, 3, 6, "divide"),
        (8, 1, 4, "num_kv_heads"),  # P TP larger than the KV heads (replicated GQA heads)
        (1, 8, 4, "num_kv_heads"),
    ],
)
def test_unsupported_topologies_are_refused_naming_why(p_tp: int, d_tp: int, heads: int, words: str) -> None:
    model = ModelSpec(name="x", num_layers=2, num_kv_heads=heads, head_dim=4, block_size=2)
    t = {
        "layout": "uniform",
        "model": model,
        "pp": 1,
        "p_tp": p_tp,
        "d_tp": d_tp,
        "p_count": [4],
        "d_count": [4],
        "p_blocks": ((0, 1),),
        "d_blocks": ((2, 3),),
    }
    outcome = run_topology(t)
    assert outcome != "pushed" and words in outcome, outcome


def test_vllm_one_token_blocks_push_across_tp_sizes() -> None:
    model = ModelSpec(name="x", num_layers=2, num_kv_heads=2, head_dim=2, block_size=1)
    t = {
        "layout": "vllm",
        "model": model,
        "pp": 1,
        "p_tp": 1,
        "d_tp": 2,
        "p_count": [3],
        "d_count": [3],
        "p_blocks": ((0, 2),),
        "d_blocks": ((1, 2),),
    }
    assert run_topology(t) == "pushed"
