"""An example layout plugin: separate K and V tensors per layer, heads outermost in a block.

An engine that keeps ``k_cache[layer]`` and ``v_cache[layer]`` apart, each of shape
``(num_blocks, local_heads, block_size, head_dim)``, passes them as
``{"layers.0.k": k0, "layers.0.v": v0, ...}``. The layout turns every layer into a K and a V
region, following the layout rules (kvpush.layouts.regions):

- ``layer_names`` is the model layer (``("layers.0",)``), the same for K and V — never the
  tensor's key (``"layers.0.k"``);
- regions come layer by layer in model order, K then V;
- components are ``K`` and ``V``, the same for every layer;
- blocks are heads-outer (``block_order="heads_outer"``): head ``h`` is the ``h``-th equal byte
  slice of a block, so heterogeneous TP can move head slices.

Module import is cheap: torch is imported inside ``allocate_split`` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpush import hookimpl
from kvpush.core.errors import ConfigError
from kvpush.core.types import KVRegion, LayoutProvider, ModelSpec, ParallelConfig
from kvpush.layouts.regions import local_heads, natural_key, tensor_region

LAYOUT = "example_split"
DEMO_MODEL = ModelSpec(name="example-split-gqa", num_layers=4, num_kv_heads=4, head_dim=32, block_size=8)


def _layers(kv_caches: Mapping[str, Any], parallel: ParallelConfig) -> list[tuple[str, Any, Any]]:
    """``(layer name, K tensor, V tensor)`` per owned layer, in model order."""
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in kv_caches.items():
        layer, _, suffix = key.rpartition(".")
        if suffix not in ("k", "v") or not layer:
            raise ConfigError(f"{LAYOUT}: cache key {key!r} must be '<layer>.k' or '<layer>.v'")
        pairs.setdefault(layer, {})[suffix] = tensor
    missing = [layer for layer, kv in pairs.items() if set(kv) != {"k", "v"}]
    if missing:
        raise ConfigError(f"{LAYOUT}: layers {missing} need both a '.k' and a '.v' tensor")
    if len(pairs) != parallel.num_local_layers:
        raise ConfigError(
            f"{LAYOUT}: got {len(pairs)} layers, rank {parallel.rank} owns {parallel.num_local_layers}"
        )
    return [(layer, pairs[layer]["k"], pairs[layer]["v"]) for layer in sorted(pairs, key=natural_key)]


def describe_split(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    heads = local_heads(model, parallel)
    regions = []
    for position, (layer, k, v) in enumerate(_layers(kv_caches, parallel)):
        for component, tensor in (("K", k), ("V", v)):
            if tuple(tensor.shape[1:]) != (heads, model.block_size, model.head_dim):
                raise ConfigError(
                    f"{LAYOUT}: {layer}.{component.lower()} must be (num_blocks, {heads}, "
                    f"{model.block_size}, {model.head_dim}), got {tuple(tensor.shape)}"
                )
            regions.append(
                tensor_region(
                    tensor,
                    layer_names=(layer,),
                    component=component,
                    kv_group=model.group_of(parallel.start_layer + position),
                    num_heads=heads,
                    block_order="heads_outer",
                )
            )
    return regions


def allocate_split(
    model: ModelSpec, parallel: ParallelConfig, blocks_per_group: Sequence[int], device: str = "cpu"
) -> dict[str, Any]:
    import torch

    shape = (blocks_per_group[0], local_heads(model, parallel), model.block_size, model.head_dim)
    caches = {}
    for layer in range(parallel.start_layer, parallel.end_layer):
        for suffix in ("k", "v"):
            caches[f"layers.{layer}.{suffix}"] = torch.zeros(
                shape, dtype=getattr(torch, model.dtype), device=device
            )
    return caches


@hookimpl
def kvpush_layouts() -> list[LayoutProvider]:
    return [
        LayoutProvider(
            name=LAYOUT,
            describe_regions=describe_split,
            allocate=allocate_split,
            demo_model=DEMO_MODEL,
            description="example: separate K and V tensors per layer, heads outermost",
        )
    ]
