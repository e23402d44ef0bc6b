"""Geometry probes, end to end: P writes exactly the bytes D registered, and nothing else.

An adversarial look at the geometry path (layouts, read specs, planning, packing) with real
pushes: P and D ranks of any layout run in this process over loopback (bytes really copied,
the sender's real planner, descriptor lists, ids and packer). P's blocks hold a hash of each
byte's *logical* coordinate (layer, K/V, position of the block in the request, global KV head,
token, byte of the head's row), read from the tensors' documented shapes rather than from the
regions the layout describes; D's caches start as random noise. After a push every byte of
every D tensor must be the hash of the logical byte that belongs there (registered blocks,
prefix hits trimmed from the end) or its old noise (everything else: nothing is written
outside the registered blocks).

Probed here (and in a 1,500-configuration seeded sweep of the same generator on CPU, and over
``cuda_ipc`` with the factored-id kernel and the CUDA packer on an H200): GQA with P TP above
and below D TP; token-major (NHD) head slices, direct and packed, chunked; MLA fan-out and
fan-in with both TPs above 1; PP with layer counts that do not divide; hybrid groups (hma, and
vllm kernel blocks of another width per group, HND and NHD); prefix hits per group, a group
with nothing registered; block ids at the end of the cache; several requests sharing the
staging areas; D registering more blocks than P holds.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from cluster import settle, wait_until

import kvpush.transports.loopback
from kvpush.core import packing
from kvpush.core.errors import ConfigError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ModelSpec, ParallelConfig, RankKey, RequestMetadata, TransferParams
from kvpush.core.worker import WorkerConfig
from kvpush.layouts.vllm import LAYER_NAME
from kvpush.plugins.strategy import ForcedStrategy

M1, M2, M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + M1
        z = (z ^ (z >> np.uint64(30))) * M2
        z = (z ^ (z >> np.uint64(27))) * M3
        return (z ^ (z >> np.uint64(31))).astype(np.uint64)


def _layer_index(name: str) -> int:
    return int(re.findall(r"\d+", name)[0])


def logical_views(
    layout: str, caches: dict[str, Any], model: ModelSpec
) -> list[tuple[int, int, torch.Tensor]]:
    """``(layer, component, view)`` with ``view`` a ``(blocks, heads, tokens, row_bytes)`` uint8
    view of the tensor, from the layout's documented tensor shapes (independent of its regions)."""
    out = []
    for name, value in caches.items():
        tensor = getattr(value, "tensor", value)  # a VllmLayerCache holds its view
        layer = _layer_index(name)
        if layout in ("uniform", "hma"):
            if model.attention == "mla":
                out.append((layer, 0, tensor.unsqueeze(1)))
            else:
                out += [(layer, c, tensor[c]) for c in (0, 1)]
        elif layout == "token_major":
            comp = 0 if name.endswith(".k") else 1
            out.append((layer, comp, tensor.permute(0, 2, 1, 3)))
        elif layout == "vllm":
            if model.attention == "mla":
                out.append((layer, 0, tensor))
            else:
                d = model.head_dim
                out += [(layer, 0, tensor[..., :d]), (layer, 1, tensor[..., d:])]
        else:
            raise AssertionError(layout)
    assert all(view.stride(-1) == 1 for _, _, view in out), "a head's row must be contiguous"
    return [(layer, comp, view.view(torch.uint8)) for layer, comp, view in out]


def pattern(
    seed: int, layer: int, comp: int, positions: np.ndarray, heads: np.ndarray, tokens: int, row: int
) -> np.ndarray:
    """uint8 ``(len(positions), len(heads), tokens, row)``: the hash of each logical byte."""
    key = (np.uint64(seed) * np.uint64(1_000_003) + np.uint64(layer * 2 + comp)) * np.uint64(1 << 20)
    p = positions.astype(np.uint64)[:, None, None, None] << np.uint64(44)
    h = heads.astype(np.uint64)[None, :, None, None] << np.uint64(32)
    t = np.arange(tokens, dtype=np.uint64)[None, None, :, None] << np.uint64(16)
    r = np.arange(row, dtype=np.uint64)[None, None, None, :]
    return (_mix(_mix(key + p + h + t + r)) >> np.uint64(56)).astype(np.uint8)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _noise(value: Any, gen: torch.Generator) -> None:
    tensor = getattr(value, "tensor", value)
    flat = storage_bytes(tensor)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), generator=gen, dtype=torch.uint8))


Request = tuple[str, Sequence[Sequence[int]], Sequence[Sequence[int]]]
"""``(request id, P's block ids per group, D's block ids per group)``."""


def _seed(rid: str) -> int:
    return sum(ord(c) * 31**i for i, c in enumerate(rid)) % 100_003


class ProbeCluster:
    """P (pp x tp) and D (tp) ranks of any layout in this process, over loopback."""

    def __init__(
        self,
        layout: str,
        model: ModelSpec,
        *,
        prefill_pp: int = 1,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        p_blocks: Sequence[int] = (16,),
        d_blocks: Sequence[int] = (16,),
        strategy: str | None = None,
        allocate: Any = None,
        device: str = "cpu",
        transport: str = "loopback",
        plugins: Sequence[tuple[str, Any]] = (),
        shapes: str | None = None,
        layer_groups: Sequence[int] = (),
        **config: Any,
    ) -> None:
        self.layout, self.model, self.device = layout, model, device
        self.shapes = shapes or layout
        """Whose documented tensor shapes :func:`logical_views` reads (a test layout's base)."""
        self.layer_groups = tuple(layer_groups)
        """Each layer's KV group when the ModelSpec does not list them (the engine's own)."""
        self.prefill_pp, self.prefill_tp, self.decode_tp = prefill_pp, prefill_tp, decode_tp
        self.pm = get_plugin_manager(
            load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback), *plugins]
        )
        if strategy is not None:
            self.pm.register(ForcedStrategy(strategy), "forced_strategy")
        allocate = allocate or self.pm.layout(layout).allocate
        self.p_server, self.d_server = SideChannelServer("P"), SideChannelServer("D")
        self.senders: dict[RankKey, PushSender] = {}
        self.receivers: dict[int, PushReceiver] = {}
        self.p_caches: dict[RankKey, dict[str, Any]] = {}
        self.d_caches: dict[int, dict[str, Any]] = {}
        config.setdefault("staging_bytes", 1 << 20)
        if device.startswith("cuda"):
            config.setdefault("cuda_device", torch.device(device).index or 0)
        gen = torch.Generator().manual_seed(7)

        def worker(engine: str, parallel: ParallelConfig) -> WorkerConfig:
            port = self.p_server.port if engine == "P" else self.d_server.port
            return WorkerConfig(
                engine_id=engine,
                parallel=parallel,
                model=model,
                layout=layout,
                transport=transport,
                side_channel_port=port,
                **config,
            )

        try:
            for pp in range(prefill_pp):
                for tp in range(prefill_tp):
                    parallel = ParallelConfig.for_stage(
                        num_layers=model.num_layers,
                        pp_size=prefill_pp,
                        pp_rank=pp,
                        tp_size=prefill_tp,
                        tp_rank=tp,
                    )
                    caches = allocate(model, parallel, list(p_blocks), device)
                    for tensor in caches.values():
                        _noise(tensor, gen)
                    sender = PushSender(worker("P", parallel), caches, pm=self.pm)
                    self.senders[parallel.rank] = sender
                    sender.start()
                    self.p_server.publish(parallel.rank, sender.handshake_payload())
                    self.p_caches[parallel.rank] = caches
            for tp in range(decode_tp):
                parallel = ParallelConfig(tp_size=decode_tp, tp_rank=tp, num_layers=model.num_layers)
                caches = allocate(model, parallel, list(d_blocks), device)
                for tensor in caches.values():
                    _noise(tensor, gen)
                receiver = PushReceiver(worker("D", parallel), caches, pm=self.pm)
                self.receivers[tp] = receiver
                receiver.start()
                self.d_server.publish(parallel.rank, receiver.handshake_payload())
                self.d_caches[tp] = caches
        except BaseException:
            self.close()
            raise
        self.d_before = {
            tp: {k: storage_bytes(getattr(t, "tensor", t)).clone() for k, t in c.items()}
            for tp, c in self.d_caches.items()
        }

    def _write(self, views: Any, rank_tp: int, seed: int, p_ids: Sequence[Sequence[int]], ids: Any) -> None:
        """Write the pattern of positions ``offset ..`` into blocks ``ids(group)`` of ``views``."""
        for layer, comp, view in views:
            group = self.layer_groups[layer] if self.layer_groups else self.model.group_of(layer)
            blocks = list(ids(group))
            if not blocks:
                continue
            offset = len(p_ids[group]) - len(blocks)  # a prefix hit: D holds P's last blocks
            heads = view.shape[1]
            first = 0 if self.model.attention == "mla" else rank_tp * heads
            data = pattern(
                seed,
                layer,
                comp,
                np.arange(offset, offset + len(blocks)),
                np.arange(first, first + heads),
                view.shape[2],
                view.shape[3],
            )
            for i, block in enumerate(blocks):
                view[block].copy_(torch.from_numpy(data[i]))

    def fill_prefill(self, rid: str, p_ids: Sequence[Sequence[int]]) -> None:
        for rank, caches in self.p_caches.items():
            views = logical_views(self.shapes, caches, self.model)
            self._write(views, rank.tp_rank, _seed(rid), p_ids, lambda g: p_ids[g])
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def push(self, requests: Sequence[Request], timeout_s: float = 30.0) -> dict[tuple[int, str], str | None]:
        """Fill P, register every request on D, finish them on P; each D rank's outcome per
        request (None: done, else the reason)."""
        for rid, p_ids, _ in requests:
            self.fill_prefill(rid, p_ids)
        for rid, p_ids, d_ids in requests:
            # D holds the prompt's first blocks (a prefix hit): its blocks are P's last ones
            start = [max(0, len(p) - len(d)) for p, d in zip(p_ids, d_ids)]
            params = TransferParams.from_dict(
                {
                    "remote_engine_id": "P",
                    "remote_host": "127.0.0.1",
                    "remote_port": self.p_server.port,
                    "tp_size": self.prefill_tp,
                    "pp_size": self.prefill_pp,
                    "transfer_id": rid,
                }
            )
            for receiver in self.receivers.values():
                receiver.add_request(
                    RequestMetadata(
                        request_id=rid, block_ids=[list(g) for g in d_ids], params=params, block_start=start
                    )
                )
        wait_until(
            lambda: all(r.stats["push_regs_sent"] >= len(requests) for r in self.receivers.values()),
            timeout_s,
            what="PUSH_REG from every D rank",
        )
        for sender in self.senders.values():
            settle(sender)
        for rid, p_ids, _ in requests:
            for sender in self.senders.values():
                sender.request_finished(rid, [list(g) for g in p_ids], match_key=rid)
        results: dict[tuple[int, str], str | None] = {}

        def ready() -> bool:
            for tp, receiver in self.receivers.items():
                got = receiver.get_finished()
                results.update({(tp, rid): None for rid in got.done})
                results.update({(tp, rid): why for rid, why in got.failed.items()})
                results.update({(tp, rid): why for rid, why in got.cancelled.items()})
            return len(results) == len(requests) * len(self.receivers)

        wait_until(ready, timeout_s, what="every D rank to finish every request")
        return results

    def mismatches(self, requests: Sequence[Request], done: dict[tuple[int, str], str | None]) -> list[str]:
        """D tensors whose bytes are not what they must be: the pattern in the registered blocks
        of requests reported done, the old noise everywhere else."""
        bad = []
        for tp, caches in self.d_caches.items():
            for name, value in caches.items():
                tensor = getattr(value, "tensor", value)
                want = self.d_before[tp][name].clone()
                mirror = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
                    want.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
                )
                views = logical_views(self.shapes, {name: mirror}, self.model)
                for rid, p_ids, d_ids in requests:
                    if done.get((tp, rid), "") is None:
                        self._write(views, tp, _seed(rid), p_ids, lambda g, d_ids=d_ids: d_ids[g])
                got = storage_bytes(tensor)
                if not torch.equal(got, want):
                    where = (got != want).nonzero().flatten()
                    bad.append(
                        f"D rank {tp} {name}: {len(where)} wrong bytes, the first at byte {int(where[0])}"
                    )
        return bad

    def close(self) -> None:
        for worker in [*self.senders.values(), *self.receivers.values()]:
            worker.close()
        self.p_server.close()
        self.d_server.close()

    def __enter__(self) -> ProbeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ layouts


def vllm_widths(widths: Sequence[int], nhd: bool = False) -> Any:
    """An ``allocate`` for the vllm layout whose group ``g`` holds kernel blocks of
    ``widths[g] x block_size`` tokens (a hybrid engine's groups may cut blocks their own
    way), physically HND or NHD, viewed as vLLM's ``[blocks, heads, tokens, content]``."""

    def allocate(
        model: ModelSpec, parallel: ParallelConfig, blocks: Sequence[int], device: str
    ) -> dict[str, Any]:
        heads = 1 if model.attention == "mla" else model.num_kv_heads // parallel.tp_size
        content = model.head_dim if model.attention == "mla" else 2 * model.head_dim
        dtype = getattr(torch, model.dtype)
        out = {}
        for layer in range(parallel.start_layer, parallel.end_layer):
            group = model.group_of(layer)
            tokens = model.block_size * widths[group]
            if nhd:
                shape = (blocks[group], tokens, heads, content)
                tensor = torch.zeros(shape, dtype=dtype, device=device).permute(0, 2, 1, 3)
            else:
                tensor = torch.zeros((blocks[group], heads, tokens, content), dtype=dtype, device=device)
            out[LAYER_NAME.format(layer)] = tensor
        return out

    return allocate


GQA = ModelSpec(name="gqa", num_layers=5, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16")
MLA = ModelSpec(name="mla", num_layers=5, attention="mla", head_dim=16, block_size=4, dtype="bfloat16")
HYBRID = ModelSpec(
    name="hybrid",
    num_layers=5,
    num_kv_heads=4,
    head_dim=8,
    block_size=4,
    dtype="float32",
    layer_groups=(0, 1, 1, 0, 1),
)
INT8 = ModelSpec(name="int8", num_layers=3, num_kv_heads=8, head_dim=2, block_size=1, dtype="int8")

# (layout, model, P PP, P TP, D TP, requests, extra ProbeCluster arguments); P and D hold 12
# blocks per group, so block 11 is the last of the cache.
TWO = (("a", [[3, 11, 0, 7]], [[11, 2, 9, 5]]), ("b", [[1, 5, 8]], [[0, 10]]))
HYBRID_TWO = (
    ("a", [[3, 11, 0, 7], [6, 2]], [[11, 2, 9, 5], [0, 4]]),
    ("b", [[1, 5, 8], [11, 0, 9]], [[0, 10], [11]]),
    ("c", [[4], [5]], [[6], []]),
)
CASES = {
    "gqa-pp2-tp1-to-tp4": ("uniform", GQA, 2, 1, 4, TWO, {}),
    "gqa-pp3-tp4-to-tp1": ("uniform", GQA, 3, 4, 1, TWO, {}),
    "gqa-tp2-to-tp4": ("uniform", GQA, 1, 2, 4, TWO, {}),
    "int8-one-token-tp8-to-tp2": ("uniform", INT8, 1, 8, 2, TWO, {}),
    "int8-one-token-tp1-to-tp8": ("token_major", INT8, 1, 1, 8, TWO, {}),
    "nhd-pp2-tp1-to-tp4": ("token_major", GQA, 2, 1, 4, TWO, {}),
    "nhd-pp3-tp4-to-tp2": ("token_major", GQA, 3, 4, 2, TWO, {}),
    "nhd-hybrid-tp2-to-tp1": ("token_major", HYBRID, 1, 2, 1, HYBRID_TWO, {}),
    "mla-pp2-tp2-to-tp4": ("uniform", MLA, 2, 2, 4, TWO, {}),
    "mla-pp2-tp4-to-tp2": ("uniform", MLA, 2, 4, 2, TWO, {}),
    "hma-pp2-tp4-to-tp2": ("hma", HYBRID, 2, 4, 2, HYBRID_TWO, {}),
    "vllm-hybrid-pp2-tp1-to-tp2": ("vllm", HYBRID, 2, 1, 2, HYBRID_TWO, {}),
    "vllm-widths-hnd-pp2-tp2-to-tp4": (
        "vllm",
        HYBRID,
        2,
        2,
        4,
        HYBRID_TWO,
        {"allocate": vllm_widths((1, 4))},
    ),
    "vllm-widths-nhd-tp4-to-tp1": (
        "vllm",
        HYBRID,
        1,
        4,
        1,
        HYBRID_TWO,
        {"allocate": vllm_widths((2, 1), nhd=True)},
    ),
    "vllm-mla-pp2-tp4-to-tp2": ("vllm", MLA, 2, 4, 2, TWO, {}),
}


def _check(
    layout: str, model: ModelSpec, pp: int, ptp: int, dtp: int, requests: Any, extra: dict[str, Any]
) -> None:
    groups = model.num_groups
    with ProbeCluster(
        layout,
        model,
        prefill_pp=pp,
        prefill_tp=ptp,
        decode_tp=dtp,
        p_blocks=[12] * groups,
        d_blocks=[12] * groups,
        **extra,
    ) as cluster:
        done = cluster.push(requests)
        assert set(done.values()) == {None}, done
        assert cluster.mismatches(requests, done) == []
        if extra.get("strategy") == "packed":
            assert sum(s.stats.get("packed_writes", 0) for s in cluster.senders.values()) > 0


@pytest.mark.parametrize("strategy", ["direct", "packed"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_registered_byte_is_pushed_and_nothing_else(case: str, strategy: str, monkeypatch: Any) -> None:
    layout, model, pp, ptp, dtp, requests, extra = CASES[case]
    monkeypatch.setattr(packing, "CHUNK_BYTES", 512)  # several chunks per destination
    _check(layout, model, pp, ptp, dtp, requests, {**extra, "strategy": strategy})


def _topology(rng: random.Random) -> tuple[Any, ...]:
    """A random supported topology and requests (the generator of the 1,500-configuration sweep)."""
    kind = rng.choice(
        ["uniform", "uniform_mla", "token_major", "token_major_h", "hma", "vllm", "vllm_mla", "vllm_h"]
    )
    layout = kind.removesuffix("_mla").removesuffix("_h")
    hybrid = kind.endswith("_h") or kind == "hma"
    pp = 1 if kind == "token_major_h" else rng.choice([1, 1, 2, 3])
    layers = rng.randint(max(pp, 2 if hybrid else 1), 5)
    ptp, dtp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
    groups: tuple[int, ...] = ()
    if hybrid:
        order = [0, 1, *(rng.randint(0, 1) for _ in range(layers - 2))]
        rng.shuffle(order)
        groups = tuple(order)
        stages = [
            ParallelConfig.for_stage(num_layers=layers, pp_size=pp, pp_rank=r, tp_size=1, tp_rank=0)
            for r in range(pp)
        ]
        if any(len(set(groups[s.start_layer : s.end_layer])) < 2 for s in stages):
            pp = 1  # a stage holding one group only: see the xfail test below
    model = ModelSpec(
        name="sweep",
        num_layers=layers,
        attention="mla" if kind.endswith("mla") else "mha",
        num_kv_heads=1 if kind.endswith("mla") else max(ptp, dtp) * rng.choice([1, 2]),
        head_dim=rng.choice([2, 4, 8]),
        block_size=rng.choice([1, 2, 4, 16]),
        dtype=rng.choice(["float32", "bfloat16", "int8"]),
        layer_groups=groups,
    )
    count = model.num_groups
    p_blocks = [rng.randint(10, 14) for _ in range(count)]  # room for two requests
    d_blocks = [rng.randint(6, 12) for _ in range(count)]
    if layout == "uniform":  # every group allocated like group 0
        p_blocks, d_blocks = [p_blocks[0]] * count, [d_blocks[0]] * count
    requests = []
    free_p = [rng.sample(range(n), n) for n in p_blocks]
    free_d = [rng.sample(range(n), n) for n in d_blocks]
    for r in range(rng.randint(1, 2)):
        p_ids, d_ids = [], []
        for g in range(count):
            n = rng.randint(1 if g == 0 else 0, min(len(free_p[g]), len(free_d[g]), 3))
            d = [free_d[g].pop() for _ in range(n)]
            m = min(len(free_p[g]), n + rng.choice([0, 0, 1, 2]))  # P may hold more: a prefix hit
            p_ids.append([free_p[g].pop() for _ in range(m)])
            d_ids.append(d)
        requests.append((f"r{r}", p_ids, d_ids))
    extra = {"strategy": rng.choice([None, "direct", "packed"])}
    return layout, model, pp, ptp, dtp, p_blocks, d_blocks, requests, extra


@pytest.mark.parametrize("seed", range(16))
def test_random_topologies_push_exact_bytes(seed: int, monkeypatch: Any) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(packing, "CHUNK_BYTES", rng.choice([64, 1000, 4 << 20]))
    for _ in range(3):
        layout, model, pp, ptp, dtp, p_blocks, d_blocks, requests, extra = _topology(rng)
        with ProbeCluster(
            layout,
            model,
            prefill_pp=pp,
            prefill_tp=ptp,
            decode_tp=dtp,
            p_blocks=p_blocks,
            d_blocks=d_blocks,
            **extra,
        ) as cluster:
            done = cluster.push(requests)
            what = (layout, model, pp, ptp, dtp, requests, extra)
            assert set(done.values()) == {None}, (what, done)
            assert cluster.mismatches(requests, done) == [], what


@pytest.mark.parametrize("strategy", ["direct", "packed"])
def test_decode_registering_more_blocks_than_prefill_in_one_group_fails_and_writes_nothing(
    strategy: str,
) -> None:
    """D registers more blocks of group 1 than P computed: the request fails on every D rank
    with P's reason and none of its bytes land; a request beside it is pushed exactly."""
    requests = [
        ("more", [[1, 2], [3]], [[4, 5], [6, 7]]),  # group 1: D 2 blocks, P 1
        ("fine", [[5, 6], [8]], [[0, 1], [2]]),
    ]
    with ProbeCluster(
        "hma",
        HYBRID,
        prefill_pp=2,
        prefill_tp=2,
        decode_tp=1,
        p_blocks=[12, 12],
        d_blocks=[12, 12],
        strategy=strategy,
    ) as cluster:
        done = cluster.push(requests)
        assert done[(0, "fine")] is None
        why = "D registered blocks 0 to 1 of KV group 1 (2 blocks from block_start=0), but P holds"
        assert why in (done[(0, "more")] or ""), done
        assert cluster.mismatches(requests, done) == []


SPLIT = ModelSpec(
    name="split",
    num_layers=4,
    num_kv_heads=4,
    head_dim=8,
    block_size=4,
    dtype="bfloat16",
    layer_groups=(0, 0, 1, 1),
)


@pytest.mark.parametrize("layout", ["hma", "vllm"])
def test_a_pp_stage_holding_layers_of_one_kv_group_only_pushes_its_layers(layout: str) -> None:
    """Layers (0, 0, 1, 1) over PP=2: stage 0 holds only group 0, stage 1 only group 1. The
    handshakes accept it (the layer windows tile D's regions), and the engine hands every
    stage the request's block ids of every group. P refused those of the group it held no
    layer of (``request_finished`` raised ``ConfigError``): every request failed instead of
    being pushed (fixed in core/worker.py, ee8c4f3)."""
    requests = [("r", [[1, 2, 3], [4, 5]], [[7, 6], [0, 3]])]
    with ProbeCluster(layout, SPLIT, prefill_pp=2, decode_tp=2, p_blocks=[8, 8], d_blocks=[8, 8]) as cluster:
        done = cluster.push(requests)
        assert set(done.values()) == {None}
        assert cluster.mismatches(requests, done) == []


ENGINE_MODEL = ModelSpec(
    name="engine", num_layers=4, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16"
)
"""The ModelSpec ``kvpush.engines.vllm`` builds for a hybrid model: it lists no layer groups
(the groups come from vLLM's ``KVCacheConfig``, through :class:`VllmLayerCache`)."""


def engine_caches(groups: Sequence[int]) -> Any:
    """An ``allocate`` giving each layer a :class:`VllmLayerCache` of group ``groups[layer]``,
    as :func:`kvpush.layouts.vllm.layer_caches` does from vLLM's ``KVCacheConfig``."""
    from kvpush.layouts.vllm import VllmLayerCache

    def allocate(
        model: ModelSpec, parallel: ParallelConfig, blocks: Sequence[int], device: str
    ) -> dict[str, Any]:
        heads = model.num_kv_heads // parallel.tp_size
        out = {}
        for layer in range(parallel.start_layer, parallel.end_layer):
            shape = (blocks[groups[layer]], heads, model.block_size, 2 * model.head_dim)
            tensor = torch.zeros(shape, dtype=getattr(torch, model.dtype), device=device)
            out[LAYER_NAME.format(layer)] = VllmLayerCache(tensor=tensor, group=groups[layer])
        return out

    return allocate


def test_a_vllm_engine_pp_stage_without_the_last_kv_group_pushes_its_layers() -> None:
    """The same split as above with the ModelSpec the vLLM engine builds (no layer_groups, so
    ``num_groups`` is 1; the layout takes each layer's group from vLLM's KVCacheConfig):
    stage 0 holds only group 0 and gets group 1's block ids, which P refused as a group beyond
    the model's: every request of that stage failed instead of being pushed (fixed in
    core/worker.py, 0a0d77f)."""
    groups = (0, 0, 1, 1)
    requests = [("r", [[1, 2, 3], [4, 5]], [[7, 6], [0, 3]])]
    with ProbeCluster(
        "vllm",
        ENGINE_MODEL,
        prefill_pp=2,
        decode_tp=2,
        p_blocks=[8, 8],
        d_blocks=[8, 8],
        allocate=engine_caches(groups),
        layer_groups=groups,
    ) as cluster:
        done = cluster.push(requests)
        assert set(done.values()) == {None}
        assert cluster.mismatches(requests, done) == []


# ------------------------------------------------------------------------------ KV-group numbering


FULL_SECOND = ModelSpec(
    name="full-second",
    num_layers=4,
    num_kv_heads=4,
    head_dim=8,
    block_size=4,
    dtype="bfloat16",
    layer_groups=(1, 0, 0, 1),
)
"""A hybrid model whose ModelSpec numbers the group of layer 0 as group 1."""


def describe_pool_order(kv_caches: Any, parallel: ParallelConfig, model: ModelSpec) -> list[Any]:
    """The hma regions with KV groups numbered in the order the rank meets them (layer 0's
    group first), as a layout numbering an engine's pools would, not as the ModelSpec does."""
    import attrs

    from kvpush.layouts.hma import describe_hma

    regions = describe_hma(kv_caches, parallel, model)
    order: list[int] = []
    for region in regions:
        if region.kv_group not in order:
            order.append(region.kv_group)
    return [attrs.evolve(r, kv_group=order.index(r.kv_group)) for r in regions]


class PoolOrderLayout:
    @kvpush.hookimpl
    def kvpush_layouts(self) -> list[Any]:
        from kvpush.core.types import LayoutProvider
        from kvpush.layouts.hma import allocate_hma_caches

        return [
            LayoutProvider(
                name="pool_order", describe_regions=describe_pool_order, allocate=allocate_hma_caches
            )
        ]


def test_a_layout_numbering_kv_groups_against_the_model_spec_is_refused_at_start() -> None:
    """Both engines run the same layout, which numbers the KV groups otherwise than the
    ModelSpec both hash (layer 0's group is 0 for the layout, 1 for the ModelSpec); the
    engines hand block ids in the ModelSpec's group order. P and D agree with each other, so
    no handshake check saw it: P read every layer at the block ids of the other group and
    wrote them there on D, and D reported the request done. The layout rules now refuse such
    regions when the rank starts, naming the layer, both groups and the fix."""
    requests = [("r", [[1, 2, 3], [4, 5, 6]], [[7, 6, 5], [0, 3, 2]])]
    refused = r"kv_group rule.*layer 'layers\.0'.*kv_group 0.*group_of\(0\) is 1"
    layout = [("pool_order", PoolOrderLayout())]
    blocks = {"p_blocks": [8, 8], "d_blocks": [8, 8]}
    with (
        pytest.raises(ConfigError, match=refused),
        ProbeCluster(
            "pool_order", FULL_SECOND, decode_tp=2, plugins=layout, shapes="hma", **blocks
        ) as cluster,
    ):
        done = cluster.push(requests)
        pytest.fail(f"pushed: D reported {done}, wrong bytes: {cluster.mismatches(requests, done)[:2]}")
