"""A hybrid model (full + sliding-window KV groups) whose groups cut their blocks into kernel blocks
of different widths, with PP on P: a stage that holds no layer of KV group 0 must still hash the
same ``ModelSpec`` as D and pass the layout rules, and the push must be byte-exact.

harness's workers give every group one kernel block size; the workers here give each group its own
(vLLM picks a kernel block size per group: ``prepare_kernel_block_sizes``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import harness
import pytest
from conftest import free_port
from harness import (
    LAYER,
    Engine,
    EngineSpec,
    PrefillModel,
    WorkerHandle,
    assert_scheduler_empty,
    make_request,
    prompt,
    run_until,
    suffix,
)


@dataclass
class HybridSpec(EngineSpec):
    kernel_block_sizes: tuple[int, ...] = ()
    """Kernel block size (tokens) of each KV-cache group, in vLLM's group order."""
    dist_port: int = 0
    """Non-zero: the workers set up vLLM's parallel state (gloo, TCP rendezvous on this port),
    as vLLM's workers do before they register their caches."""


class _HybridWorker(harness._Worker):
    """harness's worker with a kernel block size per KV-cache group."""

    def __init__(self, spec: HybridSpec, rank: int, kv_cache_config: Any) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        torch.set_num_threads(1)
        self.config = harness.vllm_config(spec, rank)
        self.tp = spec.tp
        self.tp_rank = rank % spec.tp
        if spec.dist_port:
            from vllm.config import set_current_vllm_config
            from vllm.distributed.parallel_state import (
                init_distributed_environment,
                initialize_model_parallel,
            )

            with set_current_vllm_config(self.config):
                init_distributed_environment(
                    world_size=spec.tp * spec.pp,
                    rank=rank,
                    distributed_init_method=f"tcp://127.0.0.1:{spec.dist_port}",
                    local_rank=rank,
                    backend="gloo",
                )
                initialize_model_parallel(spec.tp, spec.pp, backend="gloo")
        kernels = list(spec.kernel_block_sizes)
        assert len(kernels) == len(kv_cache_config.kv_cache_groups)
        self.caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), KVCacheLayout[kv_cache_config.kv_cache_layout], kernels
        )
        self.block_size = spec.block_size
        self.group_of = {
            name: gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.ratios = [spec.block_size // k for k in kernels]
        self.ratio = 0  # per group here: fill/holds/changed_blocks are not used
        self.sliding = {LAYER.format(i) for i in spec.sliding_layers}
        for tensor in self.caches.values():
            tensor.view(torch.int16).fill_(-1)
        self.connector = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.WORKER, kv_cache_config
        )
        self.connector.register_kv_caches(self.caches)
        self.handshake = self.connector.get_handshake_metadata()
        self._sentinels: dict[int, int] = {}

    def model_spec(self) -> dict[str, Any]:
        """What this rank's kvpush engine hashes (block_size) and its regions' groups."""
        engine = self.connector._worker.engine
        return {
            "block_size": engine.config.model.block_size,
            "groups": sorted({r.kv_group for r in engine.metadata.regions}),
        }

    def _slots(self, name: str, block_ids: list[list[int]], positions: Any) -> list[tuple[int, int, int]]:
        size = self.block_size
        gid = self.group_of[name]
        ratio = self.ratios[gid]
        kernel = size // ratio
        table = block_ids[gid]
        out = []
        for pos in positions:
            if pos // size >= len(table) or table[pos // size] == 0:
                continue
            block = table[pos // size]
            within = pos % size
            out.append((pos, block * ratio + within // kernel, within % kernel))
        return out


class _HybridHandle(WorkerHandle):
    worker_class = _HybridWorker
    wait_at_start = False  # vLLM's parallel state and the group-0 kernel exchange need every worker


@pytest.fixture
def hybrid(monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[Engine] = []

    def make(model_dir: str, role: str, **kwargs: Any) -> Engine:
        name = "prefill" if role == "kv_producer" else "decode"
        spec = HybridSpec(
            model_dir=model_dir, role=role, engine_id=f"{name}-{free_port()}", port=free_port(), **kwargs
        )
        with monkeypatch.context() as patch:
            patch.setattr(harness, "WorkerHandle", _HybridHandle)
            engine = Engine(spec)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


def _dispatch(p: Engine, d: Engine, base: str, tokens: list[int]) -> str:
    p_id, d_id = f"{base}-{suffix()}", f"{base}-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False}))
    d_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": p.spec.tp,
        "pp_size": p.spec.pp,
    }
    d.add(make_request(d_id, tokens, 3, d_params))
    return d_id


# Layers 2 and 3 slide: P's stage 0 holds only group 0 (full), stage 1 only group 1 (sliding).
SLIDING = (2, 3)


_UNKNOWABLE = pytest.mark.xfail(
    strict=True,
    reason="without vLLM's PP group a stage holding no layer of group 0 cannot learn group 0's "
    "kernel width: it hashes the scheduler block, and D refuses its handshakes (loudly)",
)


@pytest.mark.parametrize(
    ("kernels", "parallel_state", "pp"),
    [
        pytest.param((16, 8), True, (2, 1), id="g1-split"),
        pytest.param((8, 16), True, (2, 1), id="g0-split"),
        pytest.param((8, 8), True, (2, 1), id="both-split"),
        pytest.param((16, 8), False, (2, 1), id="g1-split-no-pp-group"),
        pytest.param((8, 16), False, (2, 1), id="g0-split-no-pp-group", marks=_UNKNOWABLE),
    ],
)
def test_pp_stage_without_group_0_pushes_byte_exact(
    hybrid: Any, llama_dir: str, kernels: tuple[int, int], parallel_state: bool, pp: tuple[int, int]
) -> None:
    """P (pp=2) and D (kvpush decodes without PP) of a hybrid model whose groups use kernel blocks of
    different widths (or the same width, split): every stage hashes the same ModelSpec (group 0's
    kernel block, from vLLM's PP group on a stage holding no layer of group 0), passes the layout
    rules, and D receives every token of every layer (sliding layers: the window) byte-exact."""
    common = {"sliding_layers": SLIDING, "kernel_block_sizes": kernels}
    p_dist = {"dist_port": free_port()} if parallel_state and pp[0] > 1 else {}
    d_dist = {"dist_port": free_port()} if parallel_state and pp[1] > 1 else {}
    p = hybrid(llama_dir, "kv_producer", pp=pp[0], **common, **p_dist)
    d = hybrid(llama_dir, "kv_consumer", pp=pp[1], **common, **d_dist)
    specs = {f"P{w.rank}": w.call("model_spec") for w in p.workers}
    specs.update({f"D{w.rank}": w.call("model_spec") for w in d.workers})
    staged = [name for name, spec in specs.items() if spec["groups"] == [1]]
    assert staged, f"no stage without group 0: {specs}"
    assert len({s["block_size"] for s in specs.values()}) == 1, f"ModelSpec.block_size differs: {specs}"
    model = PrefillModel()
    requests = [(prompt(70 + i, length), f"cmpl-hyb-{i}") for i, length in enumerate((40, 48, 77))]
    ids = [_dispatch(p, d, base, tokens) for tokens, base in requests]
    for (tokens, _), d_id in zip(requests, ids, strict=True):
        run_until(
            [p, d],
            lambda d_id=d_id: d_id in d.finished_recving or d_id in d.failed_recving,
            f"D to receive {d_id}",
            kv_producer=model,
        )
        assert d_id not in d.failed_recving, f"D's receive of {d_id} failed"
        blocks = d.block_ids(d_id)
        for worker in d.workers:
            problems = worker.call("verify", tokens=tokens, block_ids=blocks)
            assert not problems, problems[:3]
    run_until([p, d], lambda: not p.busy() and not d.busy(), "both engines idle", kv_producer=model)
    # Prefix hits on both engines (P and D cached the first prompt): D registers only the tail.
    tokens = prompt(79, 70, prefix=requests[2][0][:48])
    d_id = _dispatch(p, d, "cmpl-hyb-prefix", tokens)
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)
    assert d_id not in d.failed_recving, f"D's receive of {d_id} failed"
    for worker in d.workers:
        problems = worker.call("verify", tokens=tokens, block_ids=d.block_ids(d_id))
        assert not problems, problems[:3]
    run_until([p, d], lambda: not p.busy() and not d.busy(), "both engines idle", kv_producer=model)
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)
