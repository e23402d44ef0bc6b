"""The uniform layout: the same regions for every layer.

- ``mha`` (MHA/GQA): each layer's tensor has shape ``(2, num_blocks, local_heads, block_size,
  head_dim)``; K (``[0]``) and V (``[1]``) are one region each, split by heads across TP.
- ``mla``: each layer's tensor has shape ``(num_blocks, block_size, latent_dim)``; one latent
  region, replicated on every TP rank.

Layers are taken in natural order of their names (``layers.10`` after ``layers.2``), which is
what PP slicing relies on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.markers import hookimpl
from kvpush.core.types import KVRegion, LayoutProvider, ModelSpec, ParallelConfig
from kvpush.layouts.regions import check_tensors, local_heads, natural_key, ordered_layers, tensor_region

__all__ = [  # the region helpers are re-exported from kvpush.layouts.regions, where they live
    "allocate_kv_caches",
    "describe_uniform",
    "local_heads",
    "natural_key",
    "ordered_layers",
    "tensor_region",
]


def describe_uniform(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    if parallel.pp_size > 1 and model.num_groups > 1:
        raise ConfigError(
            f"the uniform layout cannot pipeline a hybrid model ({model.num_groups} KV-cache "
            f"groups) with PP={parallel.pp_size}: offset slicing would pair the wrong regions. "
            f"Use the 'hma' layout, which matches regions by layer and group"
        )
    regions = []
    heads = local_heads(model, parallel) if model.attention == "mha" else 1
    for position, (name, tensor) in enumerate(ordered_layers(kv_caches, parallel)):
        layer = parallel.start_layer + position
        identity = {
            "layer_names": (name,),
            "kv_group": model.group_of(layer),
            "attention_kind": model.kind_of(layer),
            "block_order": "heads_outer",  # (2, blocks, heads, tokens, dim); a latent has one head
        }
        if model.attention == "mla":
            if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (model.block_size, model.head_dim):
                raise ConfigError(
                    f"MLA layer {name} must be (num_blocks, {model.block_size}, {model.head_dim}), "
                    f"got {tuple(tensor.shape)}; a flat pool of token slots ([slots, head_dim] or "
                    f"[slots, 1, head_dim], as SGLang's kv_buffer) is passed as pages of block_size "
                    f"slots: tensor.view(-1, {model.block_size}, {model.head_dim}), with page ids "
                    f"as block ids (docs/engine-api.md, 'Describing your KV memory')"
                )
            regions.append(tensor_region(tensor, component="latent", replicate=True, num_heads=1, **identity))
            continue
        expected = (2, heads, model.block_size, model.head_dim)
        if tensor.dim() != 5 or (tensor.shape[0], *tensor.shape[2:]) != expected:
            raise ConfigError(
                f"MHA layer {name} must be (2, num_blocks, {heads}, {model.block_size}, "
                f"{model.head_dim}) on TP rank {parallel.tp_rank}, got {tuple(tensor.shape)}"
            )
        for index, component in enumerate(("K", "V")):
            regions.append(
                tensor_region(
                    tensor[index], component=component, replicate=False, num_heads=heads, **identity
                )
            )
    check_tensors(kv_caches, regions, model, layout="uniform")
    return regions


def allocate_kv_caches(
    model: ModelSpec, parallel: ParallelConfig, num_blocks: int, device: str = "cpu"
) -> dict[str, Any]:
    """Allocate zeroed caches in this layout for the layers a rank owns (demos and tests)."""
    import torch

    dtype = getattr(torch, model.dtype)
    caches = {}
    for layer in range(parallel.start_layer, parallel.end_layer):
        if model.attention == "mla":
            shape: tuple[int, ...] = (num_blocks, model.block_size, model.head_dim)
        else:
            shape = (2, num_blocks, local_heads(model, parallel), model.block_size, model.head_dim)
        caches[f"layers.{layer}"] = torch.zeros(shape, dtype=dtype, device=device)
    return caches


def allocate_uniform(
    model: ModelSpec, parallel: ParallelConfig, blocks_per_group: Sequence[int], device: str = "cpu"
) -> dict[str, Any]:
    """:attr:`LayoutProvider.allocate` of the uniform layout: every group uses group 0's count."""
    return allocate_kv_caches(model, parallel, blocks_per_group[0], device=device)


DEMO_MODEL = ModelSpec(name="demo-gqa", num_layers=8, num_kv_heads=4, head_dim=64)


@hookimpl
def kvpush_layouts() -> list[LayoutProvider]:
    return [
        LayoutProvider(
            name="uniform",
            describe_regions=describe_uniform,
            allocate=allocate_uniform,
            demo_model=DEMO_MODEL,
            description="MHA/GQA (K and V regions per layer, head-split) or MLA (one latent region)",
        )
    ]
