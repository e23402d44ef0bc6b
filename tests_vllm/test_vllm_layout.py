"""The ``vllm`` layout over caches vLLM 0.33 itself plans and allocates (no processes, no NIXL)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from harness import BLOCK_SIZE, LAYER, EngineSpec, kv_cache_configs, vllm_config

from kvpush.core.errors import ConfigError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.types import ModelSpec, ParallelConfig
from kvpush.core.wire import compatibility_hash
from kvpush.engines.vllm import KvpushConnector, kv_spec_dtype
from kvpush.engines.vllm_config import ConnectorSettings, base_request_id, match_key, parent_request_id
from kvpush.layouts.vllm import expand_block_ids, group_ratios, layer_caches


def allocate(
    model_dir: str,
    *,
    tp: int = 1,
    rank: int = 0,
    sliding: tuple[int, ...] = (),
    layouts: tuple[str, ...] = ("LBNHC", "LBHNC"),
    kernel: int | None = None,
) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """``(vllm_config, this rank's KVCacheConfig, vLLM's per-layer views)``."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = EngineSpec(
        model_dir=model_dir,
        role="kv_consumer",
        engine_id="D",
        tp=tp,
        port=5600,
        num_blocks=32,
        max_model_len=256,
        sliding_layers=sliding,
    )
    config = vllm_config(spec)
    _, workers = kv_cache_configs(config, sliding, layouts)
    kv_config = workers[rank]
    kernels = [kernel] * len(kv_config.kv_cache_groups) if kernel else None
    caches = allocate_kv_cache(
        kv_config, torch.device("cpu"), KVCacheLayout[kv_config.kv_cache_layout], kernels
    )
    return config, kv_config, caches


def describe(config: Any, kv_config: Any, caches: dict[str, Any], rank: int = 0) -> list[Any]:
    model = config.model_config
    parallel = ParallelConfig(tp_size=config.parallel_config.tensor_parallel_size, tp_rank=rank, num_layers=4)
    first = next(iter(caches.values()))
    spec = ModelSpec(
        name="m",
        num_layers=4,
        attention="mla" if model.use_mla else "mha",
        num_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        block_size=first.shape[2],
        dtype=str(first.dtype).removeprefix("torch."),
    )
    layout = get_plugin_manager(load_entrypoints=False).layout("vllm")
    return list(layout.describe_regions(layer_caches(caches, kv_config), parallel, spec))


def test_the_connector_asks_for_hnd(llama_dir: str, deepseek_dir: str) -> None:
    config, kv_config, _ = allocate(llama_dir)
    assert KvpushConnector.get_required_kvcache_layout(config) == "HND"
    assert kv_config.kv_cache_layout == "LBHNC"  # what vLLM resolved from it
    mla, _, _ = allocate(deepseek_dir)
    assert KvpushConnector.get_required_kvcache_layout(mla) is None


def test_hnd_regions_split_heads_over_tp(llama_dir: str) -> None:
    config, kv_config, caches = allocate(llama_dir, tp=2, rank=1)
    regions = describe(config, kv_config, caches, rank=1)
    assert [r.layer_names for r in regions] == [(LAYER.format(i),) for i in range(4)]
    view = caches[LAYER.format(0)]
    for region in regions:
        assert region.component == "KV" and not region.replicate and region.num_heads == 1
        assert region.block_order == "heads_outer"
        assert region.block_len == view[0].numel() * 2 == 1 * BLOCK_SIZE * 2 * 16 * 2
        assert region.num_blocks == view.shape[0] and region.block_stride >= region.block_len


def test_nhd_regions_are_tokens_outer(llama_dir: str) -> None:
    config, kv_config, caches = allocate(llama_dir, layouts=("LBNHC",))
    regions = describe(config, kv_config, caches)
    assert {(r.block_order, r.block_tokens, r.num_heads) for r in regions} == {
        ("tokens_outer", BLOCK_SIZE, 2)
    }
    # One head per rank: the block is contiguous either way, and still declared as resolved.
    config, kv_config, caches = allocate(llama_dir, tp=2, rank=1, layouts=("LBNHC",))
    orders = {(r.block_order, r.block_tokens, r.num_heads) for r in describe(config, kv_config, caches, 1)}
    assert orders == {("tokens_outer", BLOCK_SIZE, 1)}


def test_block_split_layouts_are_refused(llama_dir: str) -> None:
    config, kv_config, caches = allocate(llama_dir, layouts=("LHBNC",))
    with pytest.raises(ConfigError, match="HND"):
        describe(config, kv_config, caches)


def test_mla_is_one_replicated_latent_per_layer(deepseek_dir: str) -> None:
    config, kv_config, caches = allocate(deepseek_dir, tp=2, rank=1)
    regions = describe(config, kv_config, caches, rank=1)
    assert len(regions) == 4
    for region in regions:
        assert (region.component, region.replicate, region.num_heads) == ("latent", True, 1)
        assert region.block_len == BLOCK_SIZE * (32 + 8) * 2  # kv_lora_rank + rope dims, bf16


def test_hma_groups_full_and_sliding_window(llama_dir: str) -> None:
    config, kv_config, caches = allocate(llama_dir, sliding=(1, 3))
    assert len(kv_config.kv_cache_groups) == 2
    regions = describe(config, kv_config, caches)
    kinds = {r.layer_names[0]: (r.kv_group, r.attention_kind) for r in regions}
    full, sliding = kinds[LAYER.format(0)][0], kinds[LAYER.format(1)][0]
    assert full != sliding
    assert kinds == {
        LAYER.format(0): (full, "full"),
        LAYER.format(1): (sliding, "sliding_window"),
        LAYER.format(2): (full, "full"),
        LAYER.format(3): (sliding, "sliding_window"),
    }
    # vLLM overlays the groups on one allocation: the regions cover shared bytes, which the
    # transport registers once (it merges touching spans).
    spans = sorted((r.base_addr, r.end_addr) for r in regions)
    assert any(a_end > b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_kernel_blocks_smaller_than_scheduler_blocks(llama_dir: str) -> None:
    config, kv_config, caches = allocate(llama_dir, kernel=8)
    regions = describe(config, kv_config, caches)
    assert {r.num_blocks for r in regions} == {2 * kv_config.num_blocks}
    assert group_ratios(layer_caches(caches, kv_config), 1) == (2,)
    assert expand_block_ids([[3, 5]], (2,)) == ((6, 7, 10, 11),)
    assert expand_block_ids([[3], [4]], (1, 2)) == ((3,), (8, 9))


def test_layers_sharing_a_tensor_are_one_region(llama_dir: str) -> None:
    """Cross-layer KV sharing: vLLM hands the target's tensor under both names."""
    config, kv_config, caches = allocate(llama_dir)
    shared = LAYER.format(3)
    caches = {name: t for name, t in caches.items() if name != shared}
    caches[shared] = caches[LAYER.format(2)]
    regions = describe(config, kv_config, caches)
    assert [r.layer_names for r in regions][-1] == (LAYER.format(2), shared)
    assert len(regions) == 3


def test_plain_views_take_groups_from_the_model_spec(llama_dir: str) -> None:
    """Without a KVCacheConfig (kvpush demo, tests): plain 4-D views describe the same regions."""
    config, kv_config, caches = allocate(llama_dir)
    with_config = describe(config, kv_config, caches)
    layout = get_plugin_manager(load_entrypoints=False).layout("vllm")
    spec = ModelSpec(name="m", num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="float16")
    plain = layout.describe_regions(caches, ParallelConfig(tp_size=1, num_layers=4), spec)
    assert list(plain) == with_config
    mixed = {**layer_caches(caches, kv_config), LAYER.format(9): caches[LAYER.format(0)]}
    with pytest.raises(ConfigError, match="mixes"):
        layout.describe_regions(mixed, ParallelConfig(tp_size=1, num_layers=4), spec)


def test_settings_name_bad_keys_and_values() -> None:
    assert ConnectorSettings.from_extra_config({}, 1).side_channel_port == 5601
    with pytest.raises(ConfigError, match="kv_lease_duraton"):
        ConnectorSettings.from_extra_config({"kv_lease_duraton": 3})
    with pytest.raises(ConfigError, match="side_channel_port"):
        ConnectorSettings.from_extra_config({"side_channel_port": "5600"})
    with pytest.raises(ConfigError, match="kv_lease_duration"):
        ConnectorSettings.from_extra_config({"kv_lease_duration": 0})
    with pytest.raises(ConfigError, match="side_channel_insecure"):
        ConnectorSettings.from_extra_config({"side_channel_insecure": "yes"})
    assert ConnectorSettings.from_extra_config({"side_channel_insecure": True}).side_channel_insecure


@pytest.mark.parametrize(
    ("cache_dtype", "tensor_dtype", "expected"),
    [
        ("auto", "bfloat16", ("bfloat16", "")),
        ("bfloat16", "bfloat16", ("bfloat16", "")),
        ("fp8", "uint8", ("float8_e4m3fn", "")),
        ("fp8_e4m3", "uint8", ("float8_e4m3fn", "")),
        ("fp8_e5m2", "uint8", ("float8_e5m2", "")),
        ("fp8_inc", "float8_e4m3fn", ("float8_e4m3fn", " (kv_cache_dtype=fp8_inc)")),
        ("nvfp4", "uint8", ("uint8", " (kv_cache_dtype=nvfp4)")),
    ],
)
def test_the_model_spec_states_the_kv_cache_format(
    cache_dtype: str, tensor_dtype: str, expected: tuple
) -> None:
    # vLLM keeps fp8 e4m3 and e5m2 (and other quantized) caches in uint8 tensors: the tensors'
    # dtype made every one "uint8", so P with fp8_e4m3 and D with fp8_e5m2 hashed alike and D
    # decoded P's bytes in the other format, reported done.
    assert kv_spec_dtype(cache_dtype, tensor_dtype) == expected


def test_two_fp8_formats_are_different_models() -> None:
    specs = []
    for cache_dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4"):
        dtype, note = kv_spec_dtype(cache_dtype, "uint8")
        spec = ModelSpec(
            name=f"m{note}", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype
        )
        specs.append(compatibility_hash(spec, "vllm", "nixl"))
    assert len(set(specs)) == 3


def test_matching_key() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert match_key("cmpl-abc-0-1a2b3c4d", {"transfer_id": "xfer-1"}) == "xfer-1"
    assert match_key("cmpl-abc-0-1a2b3c4d", {}) == "cmpl-abc-0"
    with pytest.raises(ConfigError, match="transfer_id"):
        match_key("x", {"transfer_id": 3})
    # n > 1 on D: vLLM's frontend names the children '<i>_<parent id>'; each pairs with P's leg
    assert match_key("0_cmpl-abc-0-1a2b3c4d", {}) == match_key("cmpl-abc-0-5e6f7a8b", {}) == "cmpl-abc-0"
    assert match_key("12_cmpl-abc-0-1a2b3c4d", {}) == "cmpl-abc-0"
    assert parent_request_id("1_cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0-1a2b3c4d"
    assert parent_request_id("cmpl-abc-0-1a2b3c4d") is None
    assert parent_request_id("1_cmpl-abc") is None  # no engine suffix: not vLLM's child id
    assert match_key("1_cmpl-abc", {}) == "1_cmpl-abc"
    # a client id that itself starts with '<digits>_': P's leg and D's children still agree
    assert match_key("0_5_job-1a2b3c4d", {}) == match_key("5_job-5e6f7a8b", {})
    assert match_key("1_5_job-1a2b3c4d", {}) == match_key("5_job-9e8f7a6b", {})
    assert parent_request_id("1_5_job-1a2b3c4d") == "5_job-1a2b3c4d"


def _exclude(kv_config: Any, gid: int) -> Any:
    """``kv_config`` with group ``gid`` marked non-transferable, as vLLM marks its device replicas."""
    import dataclasses

    groups = list(kv_config.kv_cache_groups)
    groups[gid] = dataclasses.replace(groups[gid], enable_kv_transfer=False)
    return dataclasses.replace(kv_config, kv_cache_groups=groups)


def test_a_group_excluded_from_transfer_is_named_at_start_up(llama_dir: str) -> None:
    """vLLM excludes a KV-cache group that holds model layers from transfer: the connector's
    start-up refusal names the group (index, spec, layers), says why and what to do, instead of a
    generic layout-rule error; nothing is started."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config, kv_config, caches = allocate(llama_dir, sliding=(1, 3))
    sliding = next(i for i, g in enumerate(kv_config.kv_cache_groups) if g.layer_names[0] == LAYER.format(1))
    excluded = _exclude(kv_config, sliding)
    connector = KvpushConnector(config, KVConnectorRole.WORKER, excluded)
    with pytest.raises(ConfigError) as caught:
        connector.register_kv_caches(caches)
    message = str(caught.value)
    assert f"kv_cache_groups[{sliding}] (SlidingWindowSpec" in message
    assert repr(LAYER.format(1)) in message and repr(LAYER.format(3)) in message
    assert "enable_kv_transfer=False" in message and "2 of its 4 layers" in message
    assert "without kv_transfer_config" in message  # the fix
    assert "layer_names rule" not in message
    assert connector._worker is not None and connector._worker.engine is None  # nothing started
    connector.shutdown()


def test_an_excluded_replica_of_transferred_layers_is_not_refused(llama_dir: str) -> None:
    """An excluded group whose layers all reach D through a transferred group (vLLM's device
    replicas) leaves nothing untransferred: no refusal."""
    from kvpush.layouts.vllm import check_excluded_groups

    _, kv_config, caches = allocate(llama_dir, sliding=(1, 3))
    transferred = layer_caches(caches, kv_config)
    check_excluded_groups(caches, kv_config, transferred, 4)
    sliding = _exclude(kv_config, 1)
    with pytest.raises(ConfigError, match=r"kv_cache_groups\[1\]"):
        check_excluded_groups(caches, sliding, layer_caches(caches, sliding), 4)


def test_a_mamba_group_is_named(llama_dir: str) -> None:
    """A Mamba/SSM state group is refused naming the group and its layers."""
    import dataclasses

    from vllm.v1.kv_cache_interface import MambaSpec

    _, kv_config, caches = allocate(llama_dir, sliding=(1, 3))
    groups = list(kv_config.kv_cache_groups)
    mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.float16,))
    groups[1] = dataclasses.replace(groups[1], kv_cache_spec=mamba)
    with pytest.raises(ConfigError, match=r"kv_cache_groups\[1\] \(MambaSpec.*layers.*Mamba/SSM"):
        layer_caches(caches, dataclasses.replace(kv_config, kv_cache_groups=groups))
