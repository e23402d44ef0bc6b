"""A P engine and a D engine built from vLLM 0.33's real pieces, for the connector tests.

Each engine is vLLM's real ``Scheduler`` (in the test process) with ``KvpushConnector`` loaded by
module path, plus one worker process per rank holding vLLM-allocated CPU KV caches
(``allocate_kv_cache`` with the layout the engine core resolves) and the connector's worker half.
A step does what vLLM's engine core and model runner do around the connector: schedule, send the
``SchedulerOutput`` to every worker, bind / start_load_kv / wait_for_save / get_transfer_results,
aggregate the workers' outputs with ``KVOutputAggregator`` and feed them back to the scheduler.

There is no model: on P a step writes, for every token it computes, a value derived from the
token's prefix (:func:`token_values`) into the token's slot of every layer, so D can check byte
for byte that the KV it received is what P computed for those tokens.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import multiprocessing
import os
import re
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "head_dim": 16,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
}
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
LAYER = "model.layers.{}.self_attn.attn"
BLOCK_SIZE = 16
WAIT_S = 60.0


def write_model_dir(root: Path, config: dict[str, Any]) -> str:
    """A local model directory holding only a config.json (the hub is not reachable)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


# ------------------------------------------------------------------ vLLM objects


@dataclass
class EngineSpec:
    """How one engine is set up (picklable: worker processes rebuild their config from it)."""

    model_dir: str
    role: str
    engine_id: str
    tp: int = 1
    pp: int = 1
    port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    policy: str = "fail"
    num_blocks: int = 128
    block_size: int = BLOCK_SIZE
    """The scheduler's block size (``kernel_block_size`` may split it for the attention backend)."""
    max_tokens_per_step: int = 64
    kernel_block_size: int | None = None
    max_model_len: int = 1024
    sliding_layers: tuple[int, ...] = ()
    """Layers given a sliding window of ``SLIDING_WINDOW`` tokens (a hybrid model: HMA groups)."""
    layouts: tuple[str, ...] = ("LBNHC", "LBHNC")
    """KV cache layouts the attention backend supports, most preferred first."""
    excluded_group: bool = False
    """Add a KV-cache group vLLM excludes from transfer (``enable_kv_transfer=False``) and that
    holds no layer of its own, as a device replica of a transferred group does: the scheduler
    allocates its blocks, the connector transfers none of them."""


SLIDING_WINDOW = 32


def vllm_config(spec: EngineSpec, rank: int = 0) -> Any:
    """vLLM's ``VllmConfig`` for one engine (``rank``: this worker's global rank)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=spec.model_dir, seed=42, skip_tokenizer_init=True, max_model_len=spec.max_model_len
    )
    parallel = ParallelConfig(tensor_parallel_size=spec.tp, pipeline_parallel_size=spec.pp)
    parallel.rank = rank
    extra = {"side_channel_port": spec.port, **spec.extra}
    config = VllmConfig(
        model_config=model,
        parallel_config=parallel,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=spec.max_tokens_per_step,
            max_model_len=spec.max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=spec.block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvpushConnector",
            kv_connector_module_path="kvpush.engines.vllm",
            kv_role=spec.role,
            engine_id=spec.engine_id,
            kv_connector_extra_config=extra,
            kv_load_failure_policy=spec.policy,
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks_override = spec.num_blocks
    if spec.sliding_layers:
        # vLLM turns the hybrid allocator off on the CPU platform only; a GPU engine of a hybrid
        # model runs with it, and so do these tests (the scheduler needs no GPU).
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def layer_specs(config: Any, pp_rank: int, sliding_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """The KV cache spec of every attention layer one PP stage owns, as the model would report."""
    import torch
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    model = config.model_config
    layers = model.get_total_num_hidden_layers()
    start, end = get_pp_indices(layers, pp_rank, config.parallel_config.pipeline_parallel_size)
    dtype = model.dtype if isinstance(model.dtype, torch.dtype) else getattr(torch, str(model.dtype))
    block_size = config.cache_config.block_size
    specs = {}
    for layer in range(start, end):
        if model.use_mla:
            spec: Any = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=model.get_head_size(), dtype=dtype
            )
        else:
            heads = model.get_total_num_kv_heads() // config.parallel_config.tensor_parallel_size
            shape = {"block_size": block_size, "num_kv_heads": heads, "head_size": model.get_head_size()}
            if layer in sliding_layers:
                spec = SlidingWindowSpec(**shape, dtype=dtype, sliding_window=SLIDING_WINDOW)
            else:
                spec = FullAttentionSpec(**shape, dtype=dtype)
        specs[LAYER.format(layer)] = spec
    return specs


def kv_cache_configs(
    config: Any, sliding_layers: tuple[int, ...] = (), layouts: tuple[str, ...] = ("LBNHC", "LBHNC")
) -> tuple[Any, list[Any]]:
    """``(scheduler's KVCacheConfig, [each worker's])`` from vLLM's own planner; ``layouts``: what
    the attention backend supports, most preferred first (the connector's preference wins)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    parallel = config.parallel_config
    tp = parallel.tensor_parallel_size
    specs = [layer_specs(config, rank // tp, sliding_layers) for rank in range(parallel.world_size)]
    # What the engine core does first: one layout for the model (a backend supporting both, as
    # FlashAttention does, lets the connector's HND win), then the groups.
    every = [spec for worker in specs for spec in worker.values()]
    layout = resolve_kv_cache_layout(config, [list(layouts)] * parallel.world_size, every)
    groups = get_global_kv_cache_groups(config, specs)
    memory = [1 << 30] * parallel.world_size
    workers = get_kv_cache_configs(config, specs, memory, groups)
    for worker in workers:
        worker.kv_cache_layout = layout.name
    return generate_scheduler_kv_cache_config(workers), workers


def with_excluded_group(kv_cache_config: Any) -> Any:
    """``kv_cache_config`` plus a group excluded from transfer holding no layer (a replica)."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    first = kv_cache_config.kv_cache_groups[0]
    replica = KVCacheGroupSpec([], first.kv_cache_spec, enable_kv_transfer=False)
    return dataclasses.replace(kv_cache_config, kv_cache_groups=[*kv_cache_config.kv_cache_groups, replica])


# ------------------------------------------------------------------ KV content


def prefix_hashes(tokens: list[int]) -> np.ndarray:
    """A 31-bit hash of each token's prefix (its KV depends on every token up to it)."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = hashlib.sha256()
    for i, token in enumerate(tokens):
        h.update(int(token).to_bytes(4, "little"))
        out[i] = int.from_bytes(h.digest()[:4], "little") & 0x7FFFFFFF
    return out


def token_values(hashes: np.ndarray, layer: int, heads: range, width: int) -> np.ndarray:
    """int16 ``[tokens, heads, width]``: what a token's slot holds in one layer (global heads)."""
    h = hashes[:, None, None]
    head = np.asarray(list(heads), dtype=np.int64)[None, :, None]
    lane = np.arange(width, dtype=np.int64)[None, None, :]
    mixed = (h * 2654435761 + layer * 97531 + head * 7919 + lane * 131) % 65521
    return (mixed - 32760).astype(np.int16)


def layer_index(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))  # type: ignore[union-attr]


# ------------------------------------------------------------------ worker processes


def _serve(spec: EngineSpec, rank: int, kv_cache_config: Any, conn: Any, worker_class: Any = None) -> None:
    """A worker process: vLLM-allocated caches and the connector's worker half
    (``worker_class``: a ``_Worker`` subclass to run instead)."""
    try:
        worker = (worker_class or _Worker)(spec, rank, kv_cache_config)
        conn.send((True, worker.handshake))
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    while True:
        name, kwargs = conn.recv()
        if name == "stop":
            worker.close()
            conn.send((True, None))
            return
        try:
            conn.send((True, getattr(worker, name)(**kwargs)))
        except BaseException:
            conn.send((False, traceback.format_exc()))


class _Warnings(logging.Handler):
    """kvpush's latest warnings and errors of a worker process, for tests to read the reasons."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: collections.deque[str] = collections.deque(maxlen=256)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Worker:
    def __init__(self, spec: EngineSpec, rank: int, kv_cache_config: Any) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        torch.set_num_threads(1)
        self.config = vllm_config(spec, rank)
        self.tp = spec.tp
        self.tp_rank = rank % spec.tp
        groups = len(kv_cache_config.kv_cache_groups)
        kernel = [spec.kernel_block_size] * groups if spec.kernel_block_size else None
        self.caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), KVCacheLayout[kv_cache_config.kv_cache_layout], kernel
        )
        self.block_size = spec.block_size
        self.ratio = spec.block_size // (spec.kernel_block_size or spec.block_size)
        self.group_of = {
            name: gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.sliding = {LAYER.format(i) for i in spec.sliding_layers}
        for tensor in self.caches.values():
            tensor.view(torch.int16).fill_(-1)
        self.connector = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.WORKER, kv_cache_config
        )
        self._warnings = _Warnings()
        logging.getLogger("kvpush").addHandler(self._warnings)
        self.connector.register_kv_caches(self.caches)
        self.handshake = self.connector.get_handshake_metadata()
        self._sentinels: dict[int, int] = {}

    def warnings(self, containing: str = "") -> list[str]:
        """kvpush's latest warnings and errors in this worker (at most 256) that contain ``containing``."""
        return [message for message in self._warnings.messages if containing in message]

    def step(self, scheduler_output: Any) -> Any:
        """What vLLM's model runner does with the connector around one forward."""
        from vllm.v1.outputs import KVConnectorOutput

        connector = self.connector
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(scheduler_output.finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_stats=connector.get_kv_connector_stats(),
        )
        connector.clear_connector_metadata()
        return output

    def _slots(
        self, name: str, block_ids: list[list[int]], positions: Iterable[int]
    ) -> list[tuple[int, int, int]]:
        """``(position, kernel block, slot)`` of token positions in layer ``name``'s group, through
        the request's block table; positions in a null block (out of a sliding window) are left out."""
        size = self.block_size
        kernel = size // self.ratio
        table = block_ids[self.group_of[name]]
        out = []
        for pos in positions:
            if pos // size >= len(table) or table[pos // size] == 0:
                continue
            block = table[pos // size]
            within = pos % size
            out.append((pos, block * self.ratio + within // kernel, within % kernel))
        return out

    def _expected(self, name: str, tensor: Any, hashes: np.ndarray) -> np.ndarray:
        heads = tensor.shape[1]
        global_heads = range(self.tp_rank * heads, (self.tp_rank + 1) * heads)
        if self.config.model_config.use_mla:
            global_heads = range(1)
        width = tensor.shape[3] * tensor.element_size() // 2
        return token_values(hashes, layer_index(name), global_heads, width)

    def compute(self, tokens: list[int], block_ids: list[list[int]], start: int, end: int) -> int:
        """P's "forward": write the KV of tokens [start, end) into their slots."""
        import torch

        hashes = prefix_hashes(tokens[:end])
        written = 0
        for name, tensor in self.caches.items():
            values = torch.from_numpy(self._expected(name, tensor, hashes))
            raw = tensor.view(torch.int16)
            for pos, block, slot in self._slots(name, block_ids, range(start, end)):
                raw[block, :, slot, :] = values[pos]
                written += 1
        return written

    def verify(self, tokens: list[int], block_ids: list[list[int]], whole_blocks: bool = False) -> list[str]:
        """D: every token slot of the request holds what P computed (sliding-window layers: the
        tokens in the window; with ``whole_blocks`` also every other prompt token whose block the
        request still holds, as vLLM caches those blocks under the prompt's hash); mismatches,
        described."""
        import torch

        hashes = prefix_hashes(tokens)
        problems = []
        for name, tensor in self.caches.items():
            # The next token attends to the last SLIDING_WINDOW - 1 prompt tokens (and itself).
            first = max(0, len(tokens) - SLIDING_WINDOW + 1) if name in self.sliding else 0
            expected = self._expected(name, tensor, hashes)
            raw = tensor.view(torch.int16)
            slots = self._slots(name, block_ids, range(first, len(tokens)))
            if len(slots) != len(tokens) - first:
                problems.append(f"{name}: only {len(slots)} of tokens {first}-{len(tokens) - 1} have blocks")
            if whole_blocks:
                slots += self._slots(name, block_ids, range(first))
            for pos, block, slot in slots:
                if not np.array_equal(raw[block, :, slot, :].numpy(), expected[pos]):
                    problems.append(f"{name} token {pos} (block {block} slot {slot}) differs")
                    break
        return problems

    def fill(self, block_ids: list[int], value: int) -> None:
        """Write ``value`` into every byte pair of the given scheduler blocks (all layers)."""
        import torch

        for tensor in self.caches.values():
            raw = tensor.view(torch.int16)
            for block in block_ids:
                raw[block * self.ratio : (block + 1) * self.ratio] = value

    def holds(self, block_ids: list[int], value: int) -> bool:
        import torch

        return all(
            bool((tensor.view(torch.int16)[b * self.ratio : (b + 1) * self.ratio] == value).all())
            for tensor in self.caches.values()
            for b in block_ids
        )

    def snapshot(self) -> dict[str, bytes]:
        return {name: tensor.view(-1).clone().numpy().tobytes() for name, tensor in self.caches.items()}

    def changed_blocks(self, before: dict[str, bytes]) -> set[int]:
        """Scheduler blocks whose bytes differ from ``before`` (in any layer)."""
        import torch

        changed = set()
        for name, tensor in self.caches.items():
            old = torch.frombuffer(bytearray(before[name]), dtype=tensor.dtype).view(tensor.shape)
            flat_old = old.reshape(tensor.shape[0], -1)
            flat_new = tensor.contiguous().reshape(tensor.shape[0], -1)
            diff = (flat_old.view(torch.int16) != flat_new.view(torch.int16)).any(dim=1)
            changed.update(int(k) // self.ratio for k in torch.nonzero(diff).flatten())
        return changed

    def leftovers(self) -> dict[str, list[str]]:
        """The connector worker's per-request bookkeeping that is not empty (all of it should be
        once every request ended)."""
        side = self.connector._worker
        state = {
            "inflight": side._inflight,
            "failing": side._failing,
            "released": side._released,
            "failed_now": side._failed_now,
            "load_errors": side._load_errors,
        }
        return {name: sorted(map(str, value))[:5] for name, value in state.items() if value}

    def close(self) -> None:
        self.connector.shutdown()


_CONTEXT: Any = None


def context() -> Any:
    """A forkserver that imported vLLM once; workers fork from it in milliseconds."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["harness", "torch", "vllm.config", "kvpush.engines.vllm"])
    return _CONTEXT


class WorkerHandle:
    worker_class: Any = None
    """The worker class its process runs (None: ``_Worker``)."""
    wait_at_start = True
    """Wait for the worker's start here; False: at the first read of ``handshake`` (so every
    worker of an engine starts before any is waited for)."""

    def __init__(self, spec: EngineSpec, rank: int, kv_cache_config: Any) -> None:
        ctx = context()
        self.conn, child = ctx.Pipe()
        args = (spec, rank, kv_cache_config, child, self.worker_class)
        self.process = ctx.Process(target=_serve, args=args, daemon=True)
        self.process.start()
        self.rank = rank
        self._handshake: Any = None
        if self.wait_at_start:
            _ = self.handshake

    @property
    def handshake(self) -> Any:
        if self._handshake is None:
            self._handshake = self._reply(f"start of worker {self.rank}", 180.0)
        return self._handshake

    def _reply(self, what: str, timeout_s: float = WAIT_S) -> Any:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"worker {self.rank} did not answer {what} within {timeout_s}s")
        ok, value = self.conn.recv()
        if not ok:
            raise AssertionError(f"worker {self.rank} failed in {what}:\n{value}")
        return value

    def send(self, name: str, **kwargs: Any) -> None:
        self.conn.send((name, kwargs))

    def call(self, name: str, **kwargs: Any) -> Any:
        self.send(name, **kwargs)
        return self._reply(name)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.send("stop")
                self._reply("stop", 10.0)
            except (AssertionError, OSError, EOFError):
                pass
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()


# ------------------------------------------------------------------ engines


class Engine:
    """vLLM's scheduler with the connector's scheduler half, and the worker processes."""

    def __init__(self, spec: EngineSpec) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.spec = spec
        self.config = vllm_config(spec)
        scheduler_config, worker_configs = kv_cache_configs(self.config, spec.sliding_layers, spec.layouts)
        if spec.excluded_group:
            scheduler_config, *worker_configs = (
                with_excluded_group(c) for c in (scheduler_config, *worker_configs)
            )
        self.config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=scheduler_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=spec.block_size,
            log_stats=True,
        )
        self.connector = self.scheduler.get_kv_connector()
        self.workers: list[WorkerHandle] = []
        try:
            for rank, worker_config in enumerate(worker_configs):
                self.workers.append(WorkerHandle(spec, rank, worker_config))
            # What EngineCore._set_kv_connector_handshake_metadata does.
            tp = spec.tp
            metadata = {(w.rank // tp, w.rank % tp): w.handshake for w in self.workers}
            self.connector.set_xfer_handshake_metadata_pp_aware(metadata)
        except BaseException:
            self.close()
            raise
        self.aggregator = KVOutputAggregator(len(self.workers))
        self.outputs: list[Any] = []
        """Every EngineCoreOutput the scheduler produced (finished requests among them)."""
        self.finished_recving: set[str] = set()
        self.finished_sending: set[str] = set()
        self.failed_recving: set[str] = set()
        self.stats: dict[str, float] = {}
        """kvpush's counters as vLLM's stats logger would sum them (get_kv_connector_stats)."""
        self.steps = 0
        self.reported: dict[tuple[int, str], set[str]] = {}
        """Request ids each worker reported in finished_sending / finished_recving."""
        self.failed_by_rank: dict[int, set[str]] = {}
        """Request ids each worker reported in failed_recving (vLLM's aggregator unites them)."""

    @property
    def port(self) -> int:
        return self.connector.settings.side_channel_port

    def add(self, request: Any) -> None:
        if self.spec.block_size != BLOCK_SIZE:  # prefix-cache hashes per this engine's blocks
            from vllm.utils.hashing import sha256
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher

            request._block_hasher = get_request_block_hasher(self.spec.block_size, sha256)
            request.block_hashes = []
            request.update_block_hashes()
        self.scheduler.add_request(request)

    def step(
        self,
        on_scheduled: Callable[[Engine, Any], None] | None = None,
        before_update: Callable[[Engine, Any], None] | None = None,
    ) -> Any:
        """One engine step: schedule, workers, aggregate, update. ``before_update(engine, kv)``
        runs between the workers' (aggregated) output and the scheduler's update, where vLLM's
        engine core may process aborts under async scheduling."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        self.steps += 1
        if on_scheduled is not None:
            on_scheduled(self, out)
        for worker in self.workers:
            worker.send("step", scheduler_output=out)
        kv_outputs = [worker._reply("step") for worker in self.workers]
        for worker, kv in zip(self.workers, kv_outputs, strict=True):
            # vLLM's aggregator counts reports, not workers: a second report of one request by one
            # worker would stand for another worker's (P: blocks freed while another rank WRITEs).
            for kind, ids in (("sending", kv.finished_sending), ("recving", kv.finished_recving)):
                seen = self.reported.setdefault((worker.rank, kind), set())
                again = seen & set(ids or ())
                assert not again, f"worker {worker.rank} reported finished_{kind} twice: {sorted(again)}"
                seen.update(ids or ())
            self.failed_by_rank.setdefault(worker.rank, set()).update(kv.failed_recving or ())
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests.get(rid)
            done = request is not None and request.num_computed_tokens >= request.num_tokens
            sampled.append([7] if done else [])
        runner_outputs = [
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
                kv_connector_output=kv,
            )
            for kv in kv_outputs
        ]
        merged = self.aggregator.aggregate(runner_outputs, 0)
        kv = merged.kv_connector_output
        if before_update is not None:
            before_update(self, kv)
        self.finished_recving |= set(kv.finished_recving or ())
        self.finished_sending |= set(kv.finished_sending or ())
        self.failed_recving |= set(kv.failed_recving or ())
        if kv.kv_connector_stats is not None:
            for key, value in kv.kv_connector_stats.reduce().items():
                self.stats[key] = self.stats.get(key, 0) + value
        engine_outputs = self.scheduler.update_from_output(out, merged)
        for outputs in engine_outputs.values():
            self.outputs.extend(outputs.outputs)
        return out

    def finish_reason(self, rid: str) -> str | None:
        for output in self.outputs:
            if output.request_id == rid and output.finish_reason is not None:
                return str(output.finish_reason)
        return None

    def kv_transfer_params(self, rid: str) -> dict[str, Any] | None:
        for output in self.outputs:
            if output.request_id == rid and output.kv_transfer_params is not None:
                return output.kv_transfer_params
        return None

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(rid)]

    def busy(self) -> bool:
        return self.scheduler.has_requests()

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        if getattr(self, "connector", None) is not None:
            self.connector.shutdown()


def run_until(
    engines: list[Engine], predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S, **step: Any
) -> None:
    """Step every engine until ``predicate()``; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        for engine in engines:
            engine.step(step.get(engine.spec.role))
        time.sleep(0.002)


class PrefillModel:
    """P's stand-in for a forward: writes the KV of every token a step computes."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def __call__(self, engine: Engine, out: Any) -> None:
        for rid, count in out.num_scheduled_tokens.items():
            request = engine.scheduler.requests[rid]
            end = request.num_computed_tokens  # already advanced by schedule()
            start = end - count
            tokens = list(request.all_token_ids)
            end = min(end, len(request.prompt_token_ids))
            if start >= end:
                continue
            blocks = engine.block_ids(rid)
            for worker in engine.workers:
                worker.send("compute", tokens=tokens, block_ids=blocks, start=start, end=end)
            for worker in engine.workers:
                worker._reply("compute")


_counter = iter(range(1, 1 << 30))


def make_request(request_id: str, tokens: list[int], max_tokens: int, params: dict[str, Any] | None) -> Any:
    """A vLLM ``Request`` with prefix-cache block hashing, as the input processor builds it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampling.update_from_generation_config({}, 0)
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    request.kv_transfer_params = params
    return request


def prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    head = list(prefix or [])
    return head + [int(t) for t in rng.integers(1, 999, size=length - len(head))]


def suffix() -> str:
    return os.urandom(4).hex()


def assert_scheduler_empty(engine: Engine) -> None:
    """No request, queue entry or block is left behind (what vLLM's own tests check)."""
    scheduler = engine.scheduler
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 0
    assert not scheduler.finished_req_ids
    assert not scheduler.finished_recving_kv_req_ids and not scheduler.failed_recving_kv_req_ids
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1, "blocks leaked"
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not manager.req_to_blocks and not manager.num_cached_block
    connector = engine.connector
    assert not connector.has_pending_push_work(), "the connector still reports push work"
    side = connector._scheduler
    left = {"receiving": side.receiving, "recv_keys": side._recv_keys, "send_keys": side._send_keys}
    assert not any(left.values()), f"the connector's scheduler half still tracks ended requests: {left}"
    for worker in engine.workers:
        left = worker.call("leftovers")
        assert not left, f"worker {worker.rank}'s connector still tracks ended requests: {left}"
