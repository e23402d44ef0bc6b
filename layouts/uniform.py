"""The uniform layout: the same regions for every layer.

- ``mha`` (MHA/GQA): each layer's tensor has shape ``(2, num_blocks, local_heads, block_size,
  head_dim)``; K (``[0]``) and V (``[1]``) are one region each, split by heads across TP.
- ``mla``: each layer's tensor has shape ``(num_blocks, block_size, latent_dim)``; one latent
  region, replicated on every TP rank.

Layers are taken in natural order of their names (``layers.10`` after ``layers.2``), which is
what PP slicing relies on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.markers import hookimpl
from kvpush.core.types import KVRegion, LayoutProvider, ModelSpec, ParallelConfig


def natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def ordered_layers(kv_caches: Mapping[str, Any], parallel: ParallelConfig) -> list[tuple[str, Any]]:
    names = sorted(kv_caches, key=natural_key)
    if len(names) != parallel.num_local_layers:
        raise ConfigError(
            f"got KV caches for {len(names)} layers, but rank {parallel.rank} owns "
            f"{parallel.num_local_layers} (layers {parallel.start_layer}-{parallel.end_layer - 1})"
        )
    return [(name, kv_caches[name]) for name in names]


def local_heads(model: ModelSpec, parallel: ParallelConfig) -> int:
    if model.num_kv_heads % parallel.tp_size:
        raise ConfigError(
            f"{model.num_kv_heads} KV heads cannot be split evenly over TP {parallel.tp_size}; "
            f"replicated GQA heads are not supported"
        )
    return model.num_kv_heads // parallel.tp_size


def tensor_region(tensor: Any, **identity: Any) -> KVRegion:
    """A region over a ``(num_blocks, ...)`` tensor whose blocks are each contiguous."""
    if not tensor[0].is_contiguous():
        raise ConfigError(f"blocks of {identity.get('layer_names')} are not contiguous in memory")
    element = tensor.element_size()
    return KVRegion(
        base_addr=tensor.data_ptr(),
        block_len=tensor[0].numel() * element,
        block_stride=tensor.stride(0) * element,
        num_blocks=tensor.shape[0],
        mem_type="VRAM" if tensor.is_cuda else "DRAM",
        device_id=tensor.device.index or 0 if tensor.is_cuda else 0,
        **identity,
    )


def describe_uniform(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    if parallel.pp_size > 1 and model.num_groups > 1:
        raise ConfigError(
            f"the uniform layout cannot pipeline a hybrid model ({model.num_groups} KV-cache "
            f"groups) with PP={parallel.pp_size}: offset slicing would pair the wrong regions. "
            f"Use the HMA layout (--layout hma), which matches regions by layer and group"
        )
    regions = []
    heads = local_heads(model, parallel) if model.attention == "mha" else 1
    for position, (name, tensor) in enumerate(ordered_layers(kv_caches, parallel)):
        layer = parallel.start_layer + position
        identity = {
            "layer_names": (name,),
            "kv_group": model.group_of(layer),
            "attention_kind": model.kind_of(layer),
        }
        if model.attention == "mla":
            if tensor.dim() != 3 or tensor.shape[-1] != model.head_dim:
                raise ConfigError(
                    f"MLA layer {name} must be (num_blocks, {model.block_size}, {model.head_dim}), "
                    f"got {tuple(tensor.shape)}"
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


@hookimpl
def kvpush_layouts() -> list[LayoutProvider]:
    return [
        LayoutProvider(
            name="uniform",
            describe_regions=describe_uniform,
            description="MHA/GQA (K and V regions per layer, head-split) or MLA (one latent region)",
        )
    ]
