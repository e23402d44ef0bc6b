"""Probe: P and D that disagree about what the bytes of a block mean.

Each case is two engines whose blocks have the same length (so every WRITE lands in bounds)
but whose bytes stand for other numbers, tokens, heads or layers on the other side: another
dtype of the same element size, tokens and head_dim or heads and head_dim traded against each
other, another layer grouping, MLA on one side, heads-outer blocks on one side and tokens-outer
on the other, and a layout whose ``kv_caches`` are not plain tensors. Each must be refused
before a byte lands (at a rank's start or at the handshake, naming what differs), never end
with D reporting a request done.

One P rank and one D rank in this process on real NIXL agents (``test_plugin_author_probe``'s
``Pair``: each side its own plugin manager, caches and ``ModelSpec``); pure layout checks run
in-process. The vLLM connector's case runs vLLM 0.33's real schedulers and worker processes
(``tests_vllm/harness.py``) in the vLLM venv, as a subprocess (skipped where that venv is absent).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from test_plugin_author_probe import Pair, untouched

import kvpush.transports.loopback
from kvpush import hookimpl
from kvpush.core.errors import ConfigError
from kvpush.core.manager import KvpushPluginManager, get_plugin_manager
from kvpush.core.types import KVRegion, LayoutProvider, ModelSpec, ParallelConfig
from kvpush.layouts.regions import local_heads, natural_key, tensor_region
from kvpush.layouts.uniform import allocate_kv_caches
from kvpush.layouts.vllm import LAYER_NAME

BLOCKS = 8
P_IDS, D_IDS = ((3, 1),), ((0, 2),)
"""One request: P's blocks 3 and 1 go to D's blocks 0 and 2."""


def manager(*plugins: tuple[str, object], disable: str = "") -> KvpushPluginManager:
    env = {"KVPUSH_DISABLE_PLUGINS": disable} if disable else {}
    return get_plugin_manager(
        load_entrypoints=False, env=env, plugins=[("loopback", kvpush.transports.loopback), *plugins]
    )


def noise(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    flat = tensor.view(torch.int8)
    flat.copy_(torch.randint(-100, 100, flat.shape, dtype=torch.int8, generator=gen))
    return tensor


def run_pair(groups: int = 1, **kwargs: Any) -> tuple[Pair, str | None]:
    """Start the pair and push one request; ``(pair, D's outcome)`` (None: done)."""
    pair = Pair(**kwargs)
    try:
        return pair, pair.push(P_IDS * groups, D_IDS * groups, timeout_s=30)
    except BaseException:
        pair.close()
        raise


# ------------------------------------------------------------------------------ ModelSpecs


BASE = ModelSpec(name="geom", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
"""2 layers, 4 KV heads of 8 x bf16, 4-token blocks: 256 B per K (or V) block."""

SAME_BYTES = {
    # each changes what a block's bytes mean, never its length
    "fp16_vs_bf16": ({"dtype": "float16"}, "model.dtype"),
    "e4m3_vs_e5m2": ({"dtype": "float8_e5m2"}, "model.dtype"),
    "block_size_x_head_dim": ({"block_size": 8, "head_dim": 4}, "model.block_size"),
    "heads_x_head_dim": ({"num_kv_heads": 2, "head_dim": 16}, "model.num_kv_heads"),
    "layer_groups": ({"layer_groups": (1, 0)}, "model.layer_groups"),
    "window_layer": ({"layer_kinds": ("full", "sliding_window")}, "model.layer_kinds"),
    "model_name": ({"name": "geom-v2"}, "model.name"),
}


@pytest.mark.parametrize("case", sorted(SAME_BYTES))
def test_model_specs_with_equal_block_bytes_are_refused_naming_the_field(case: str) -> None:
    """D's ModelSpec differs from P's in one way that keeps every block the same length: D's
    handshake refuses P (the compatibility hash, its diff naming the field) and no byte lands."""
    change, field = SAME_BYTES[case]
    base = BASE
    if case == "e4m3_vs_e5m2":
        base = ModelSpec(**{**_fields(BASE), "dtype": "float8_e4m3fn"})
    if case == "layer_groups":
        base = ModelSpec(**{**_fields(BASE), "layer_groups": (0, 1)})
    d_model = ModelSpec(**{**_fields(base), **change})
    parallel = ParallelConfig(tp_size=1, num_layers=2)
    p_caches = {k: noise(v, 1) for k, v in allocate_kv_caches(base, parallel, BLOCKS).items()}
    d_caches = allocate_kv_caches(d_model, parallel, BLOCKS)
    assert {k: v.nbytes for k, v in p_caches.items()} == {k: v.nbytes for k, v in d_caches.items()}
    pair, outcome = run_pair(
        groups=base.num_groups,
        layout="uniform",
        p_caches=p_caches,
        d_caches=d_caches,
        p_pm=manager(),
        d_pm=manager(),
        p_model=base,
        d_model=d_model,
    )
    try:
        assert outcome is not None, f"D reported done with P's {base} bytes read as {d_model}"
        assert field in outcome, outcome
        assert untouched(d_caches)
    finally:
        pair.close()


def _fields(model: ModelSpec) -> dict[str, Any]:
    import attrs

    return attrs.asdict(model, recurse=False)


def test_mla_on_one_side_only_is_refused() -> None:
    """An MLA latent of 64 B per token on P, MHA on D with the same bytes per block: refused."""
    mla = ModelSpec(name="geom", num_layers=2, attention="mla", head_dim=64, block_size=4)
    parallel = ParallelConfig(tp_size=1, num_layers=2)
    p_caches = {k: noise(v, 2) for k, v in allocate_kv_caches(mla, parallel, BLOCKS).items()}
    mha = ModelSpec(name="geom", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
    d_caches = allocate_kv_caches(mha, parallel, BLOCKS)  # K and V: 2 x 4 heads x 8 = 64 per token
    assert p_caches["layers.0"].nbytes == d_caches["layers.0"].nbytes
    pair, outcome = run_pair(
        layout="uniform",
        p_caches=p_caches,
        d_caches=d_caches,
        p_pm=manager(),
        d_pm=manager(),
        p_model=mla,
        d_model=mha,
    )
    try:
        assert outcome is not None and "model.attention" in outcome, outcome
        assert untouched(d_caches)
    finally:
        pair.close()


# ------------------------------------------------------------------------------ in-block order


VLLM_MODEL = ModelSpec(name="geom-vllm", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)


def vllm_views(order: str) -> dict[str, torch.Tensor]:
    """vLLM's ``[blocks, heads, tokens, 2 x head_dim]`` views, HND or NHD underneath."""
    shape = (BLOCKS, 4, 4, 16)
    out = {}
    for layer in range(2):
        if order == "HND":
            view = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            view = torch.zeros(BLOCKS, 4, 4, 16, dtype=torch.bfloat16).permute(0, 2, 1, 3)
        out[LAYER_NAME.format(layer)] = view
    return out


@pytest.mark.parametrize("disable", ["", "block_order"], ids=["builtin", "block_order_disabled"])
def test_hnd_prefill_and_nhd_decode_never_deliver(disable: str) -> None:
    """One layout name (``vllm``), P's blocks heads-outer, D's tokens-outer, same TP and block
    length: a whole-block WRITE would hand D its heads as tokens. Refused at the handshake,
    also with the built-in ``block_order`` validator disabled on both engines (documented as
    something an operator may do): core's plan check sees the two cuts differ."""
    p_caches = vllm_views("HND")
    for index, view in enumerate(p_caches.values()):
        noise(view, 10 + index)
    d_caches = vllm_views("NHD")
    pair, outcome = run_pair(
        layout="vllm",
        p_caches=p_caches,
        d_caches=d_caches,
        p_pm=manager(disable=disable),
        d_pm=manager(disable=disable),
        p_model=VLLM_MODEL,
    )
    try:
        if outcome is None:  # done: D's logical KV must be P's
            for name, view in p_caches.items():
                sent = view[list(P_IDS[0])].view(torch.int16)
                got = d_caches[name][list(D_IDS[0])].view(torch.int16)
                assert torch.equal(sent, got), f"{name}: D reads P's heads as tokens"
        else:
            assert "heads_outer" in outcome or "wrong heads" in outcome, outcome
            assert untouched(d_caches)
    finally:
        pair.close()


# ------------------------------------------------------------------------------ caches as (K, V) pairs


def describe_kv_pairs(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    """A third-party layout whose engine keeps ``{"<layer>": (K, V)}``, each
    ``(blocks, heads, tokens, head_dim)`` (HND): what an engine with per-layer K/V pairs passes."""
    heads = local_heads(model, parallel)
    regions = []
    for position, name in enumerate(sorted(kv_caches, key=natural_key)):
        k, v = kv_caches[name]
        for component, tensor in (("K", k), ("V", v)):
            regions.append(
                tensor_region(
                    tensor,
                    layer_names=(name,),
                    component=component,
                    kv_group=model.group_of(parallel.start_layer + position),
                    num_heads=heads,
                    block_order="heads_outer",
                )
            )
    return regions


def describe_kv_pairs_past_the_end(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    """The same with an off-by-one: the last region counts a block its tensor does not hold."""
    regions = describe_kv_pairs(kv_caches, parallel, model)
    last = regions[-1]
    return [*regions[:-1], KVRegion(**{**_region_fields(last), "num_blocks": last.num_blocks + 1})]


def _region_fields(region: KVRegion) -> dict[str, Any]:
    import attrs

    return attrs.asdict(region, recurse=False)


class KvPairsLayout:
    @hookimpl
    def kvpush_layouts(self) -> list[LayoutProvider]:
        return [LayoutProvider(name="kv_pairs", describe_regions=describe_kv_pairs)]


def kv_pairs(model: ModelSpec, dtype: torch.dtype, seed: int | None) -> dict[str, tuple[torch.Tensor, ...]]:
    shape = (BLOCKS, model.num_kv_heads, model.block_size, model.head_dim)
    out = {}
    for layer in range(model.num_layers):
        pair = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        if seed is not None:
            pair = tuple(
                torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)).to(dtype)
                for i in range(2)
            )
        out[f"layers.{layer}"] = pair
    return out


def test_kv_pair_caches_of_another_dtype_than_the_model_spec_never_deliver() -> None:
    """P's engine holds float16 K/V pairs, D's bfloat16, both configured with the bf16
    ModelSpec (the model's dtype, not the cache's): the same bytes per block on both sides.
    The layout rules say ``ModelSpec.dtype`` must be the cache's dtype, and for tensor-valued
    caches a rank breaking it is refused at start; here P must be refused too (or D end with
    P's numbers)."""
    pm = manager(("kv_pairs", KvPairsLayout()))
    p_caches = kv_pairs(BASE, torch.float16, seed=5)
    d_caches = kv_pairs(BASE, torch.bfloat16, seed=None)
    try:
        pair, outcome = run_pair(
            layout="kv_pairs", p_caches=p_caches, d_caches=d_caches, p_pm=pm, d_pm=pm, p_model=BASE
        )
    except ConfigError as err:
        assert "float16" in str(err), err
        return
    try:
        assert outcome is None or "float16" in outcome, outcome
        for name, (k, v) in p_caches.items():
            for sent, got in ((k, d_caches[name][0]), (v, d_caches[name][1])):
                same = torch.equal(sent[list(P_IDS[0])].float(), got[list(D_IDS[0])].float())
                assert outcome is not None or same, (
                    f"{name}: D reports done with P's float16 bits read as bf16"
                )
    finally:
        pair.close()


def test_kv_pair_region_past_its_tensor_is_refused_at_start() -> None:
    """The bounds half of the same gap: the off-by-one is refused for tensor-valued caches
    (tests/test_plugin_author_probe.py) but not when the tensors sit in (K, V) pairs. D would
    publish and register a region reaching into whatever memory follows its last tensor."""
    provider = LayoutProvider(name="kv_pairs_past", describe_regions=describe_kv_pairs_past_the_end)
    parallel = ParallelConfig(tp_size=1, num_layers=2)
    with pytest.raises(ConfigError, match="outside every KV tensor"):
        provider.describe(kv_pairs(BASE, torch.bfloat16, seed=None), parallel, BASE)


def test_kv_pair_caches_of_the_model_spec_dtype_push_exactly() -> None:
    """Control: the same layout with both sides' caches of ModelSpec.dtype pushes P's bytes."""
    pm = manager(("kv_pairs", KvPairsLayout()))
    p_caches = kv_pairs(BASE, torch.bfloat16, seed=7)
    d_caches = kv_pairs(BASE, torch.bfloat16, seed=None)
    pair, outcome = run_pair(
        layout="kv_pairs", p_caches=p_caches, d_caches=d_caches, p_pm=pm, d_pm=pm, p_model=BASE
    )
    try:
        assert outcome is None, outcome
        for name, (k, v) in p_caches.items():
            for sent, got in ((k, d_caches[name][0]), (v, d_caches[name][1])):
                assert torch.equal(
                    sent[list(P_IDS[0])].view(torch.int16), got[list(D_IDS[0])].view(torch.int16)
                )
    finally:
        pair.close()


# ------------------------------------------------------------------------------ vLLM: the model's identity


ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

MODEL_UPDATED_IN_PLACE = """
import json, socket, sys, tempfile
from pathlib import Path
from harness import LLAMA, Engine, EngineSpec, PrefillModel, make_request, prompt, run_until, suffix
from harness import write_model_dir

def port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

root = Path(tempfile.mkdtemp()) / "llama"
model_dir = write_model_dir(root, LLAMA)
engines = []
try:
    p = Engine(EngineSpec(model_dir=model_dir, role="kv_producer", engine_id=f"p-{port()}", port=port()))
    engines.append(p)
    # A new revision lands in the model directory before D starts (a rolling update): same
    # shapes, another RoPE base, so every K P computes means another position on D.
    write_model_dir(root, {**LLAMA, "rope_theta": 500000.0})
    d = Engine(EngineSpec(model_dir=model_dir, role="kv_consumer", engine_id=f"d-{port()}", port=port()))
    engines.append(d)
    tokens = prompt(1, 45)
    p_id, d_id = f"cmpl-rev-{suffix()}", f"cmpl-rev-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False}))
    d.add(make_request(d_id, tokens, 2, {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": p.spec.engine_id,
        "remote_host": "127.0.0.1", "remote_port": p.port, "tp_size": 1, "pp_size": 1,
    }))
    model = PrefillModel()
    run_until([p, d], lambda: d_id in d.finished_recving, "D's receive to end", kv_producer=model)
    outcome = "failed" if d_id in d.failed_recving else "received"  # a failed one is in both
    print("RESULT " + json.dumps({"outcome": outcome}), flush=True)
finally:
    for engine in reversed(engines):
        engine.close()
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="the vLLM venv (.venv-vllm) is not installed")
def test_vllm_engines_of_another_model_revision_never_pair() -> None:
    """P starts from a model directory; a new revision (same shapes, ``rope_theta`` 10000 ->
    500000) is written there before D starts. Both engines then hash the same ModelSpec (the
    served name is the path), so D's request was received: its decode would attend with its
    own RoPE over keys rotated by P's. D must refuse P at the handshake instead."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests_vllm")}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", MODEL_UPDATED_IN_PLACE],
        cwd=ROOT / "tests_vllm",
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the vLLM engines did not run (rc {done.returncode}):\n{done.stderr[-3000:]}"
    assert json.loads(lines[-1][7:])["outcome"] == "failed", "D received KV of another model revision"


def test_model_identity_is_the_same_in_every_process_for_one_config() -> None:
    """The config digest ignores where the model was loaded from, key order and memory
    addresses in reprs (P and D must agree on one model), and changes with what shapes the KV."""
    from kvpush.engines.vllm_config import model_identity

    class Opaque:
        pass

    p = {
        "rope_theta": 1e4,
        "sub": {1: 2, "x": 3},
        "o": Opaque(),
        "_name_or_path": "/p",
        "transformers_version": "5",
    }
    d = {
        "sub": {"x": 3, 1: 2},
        "o": Opaque(),
        "rope_theta": 1e4,
        "_name_or_path": "/d",
        "transformers_version": "6",
    }
    assert model_identity(p) == model_identity(d)
    assert model_identity({**p, "rope_theta": 5e5}) != model_identity(p)
    assert "revision abc" in model_identity(p, "abc")
