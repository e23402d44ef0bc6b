"""The token-major layout: separate K and V tensors per layer, tokens outermost in a block.

Each layer has a K and a V tensor of shape ``(num_blocks, block_size, local_heads, head_dim)``,
as vLLM's FlashAttention backend lays a block out (NHD) and as SGLang's pools read once viewed
as pages: SGLang keeps flat token slots, ``k_buffer[i]`` and ``v_buffer[i]`` of ``[slots,
local_heads, head_dim]``, which ``buf.view(-1, page_size, local_heads, head_dim)`` turns into
blocks of ``page_size`` tokens (block ids are then page ids). ``kv_caches`` maps ``"<layer>.k"``
and ``"<layer>.v"`` to them (:func:`token_major_caches` builds that from two per-layer lists).

A block's head slice is one range per token, so regions declare ``block_order="tokens_outer"``
with ``block_tokens=block_size``; heterogeneous TP cuts every token's row
(:mod:`kvpush.core.block_order`). Regions are K then V per layer in model order, like the
uniform layout, so PP slicing pairs them by offset.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.markers import hookimpl
from kvpush.core.types import KVRegion, LayoutProvider, ModelSpec, ParallelConfig
from kvpush.layouts.regions import check_tensors
from kvpush.layouts.uniform import local_heads, natural_key, tensor_region

LAYOUT_NAME = "token_major"
SUFFIXES = {"k": "K", "v": "V"}


def _split_name(name: str) -> tuple[str, str]:
    layer, _, suffix = name.rpartition(".")
    component = SUFFIXES.get(suffix.lower())
    if not layer or component is None:
        raise ConfigError(
            f"token_major KV cache key {name!r} must be '<layer>.k' or '<layer>.v' (e.g. "
            f"'layers.0.k'); build the mapping with token_major_caches(k_buffers, v_buffers, parallel)"
        )
    return layer, component


def token_major_caches(
    k_buffers: Sequence[Any], v_buffers: Sequence[Any], parallel: ParallelConfig
) -> dict[str, Any]:
    """``kv_caches`` for this layout from per-layer K and V lists of ``(num_blocks, block_size,
    local_heads, head_dim)`` tensors (SGLang's ``k_buffer`` and ``v_buffer`` of the layers this
    rank owns, in order, each viewed as pages: ``buf.view(-1, page_size, heads, head_dim)``),
    named ``layers.<model layer>.k|v``."""
    if len(k_buffers) != len(v_buffers) or len(k_buffers) != parallel.num_local_layers:
        raise ConfigError(
            f"got {len(k_buffers)} K and {len(v_buffers)} V tensors; rank {parallel.rank} owns "
            f"{parallel.num_local_layers} layers and needs one of each per layer"
        )
    caches: dict[str, Any] = {}
    for position, (k, v) in enumerate(zip(k_buffers, v_buffers)):
        layer = parallel.start_layer + position
        caches[f"layers.{layer}.k"], caches[f"layers.{layer}.v"] = k, v
    return caches


def describe_token_major(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    """K and V regions of every layer this rank owns (tokens-outer blocks), in model order."""
    if model.attention != "mha":
        raise ConfigError(
            f"the token_major layout holds MHA/GQA K and V heads; model {model.name!r} uses "
            f"{model.attention!r} attention (use the uniform layout for an MLA latent)"
        )
    if parallel.pp_size > 1 and model.num_groups > 1:
        raise ConfigError(
            f"the token_major layout cannot pipeline a hybrid model ({model.num_groups} KV-cache "
            f"groups) with PP={parallel.pp_size}: offset slicing would pair the wrong regions"
        )
    layers: dict[str, dict[str, Any]] = {}
    for name, tensor in kv_caches.items():
        layer, component = _split_name(name)
        layers.setdefault(layer, {})[component] = tensor
    if len(layers) != parallel.num_local_layers:
        raise ConfigError(
            f"got token_major KV caches for {len(layers)} layers, but rank {parallel.rank} owns "
            f"{parallel.num_local_layers} (layers {parallel.start_layer}-{parallel.end_layer - 1})"
        )
    heads = local_heads(model, parallel)
    expected = (model.block_size, heads, model.head_dim)
    regions = []
    for position, layer_name in enumerate(sorted(layers, key=natural_key)):
        pair = layers[layer_name]
        layer = parallel.start_layer + position
        for component in ("K", "V"):
            tensor = pair.get(component)
            if tensor is None:
                raise ConfigError(
                    f"token_major layer {layer_name} has no {component} tensor "
                    f"('{layer_name}.{component.lower()}')"
                )
            if tensor.dim() != 4 or tuple(tensor.shape[1:]) != expected:
                hint = ""
                if tensor.dim() == 3 and tuple(tensor.shape[1:]) == expected[1:]:
                    hint = (
                        f"; a flat pool of token slots ([slots, heads, head_dim], as SGLang's "
                        f"k_buffer/v_buffer) is passed as pages of block_size slots: "
                        f"tensor.view(-1, {model.block_size}, {heads}, {model.head_dim}), with page "
                        f"ids as block ids (docs/engine-api.md, 'Describing your KV memory')"
                    )
                raise ConfigError(
                    f"token_major {component} of layer {layer_name} must be (num_blocks, "
                    f"{model.block_size}, {heads}, {model.head_dim}) on TP rank {parallel.tp_rank}, "
                    f"got {tuple(tensor.shape)}{hint}"
                )
            regions.append(
                tensor_region(
                    tensor,
                    layer_names=(layer_name,),
                    kv_group=model.group_of(layer),
                    attention_kind=model.kind_of(layer),
                    component=component,
                    replicate=False,
                    num_heads=heads,
                    block_order="tokens_outer",
                    block_tokens=model.block_size,
                )
            )
    check_tensors(kv_caches, regions, model, layout=LAYOUT_NAME)
    return regions


def allocate_token_major_caches(
    model: ModelSpec, parallel: ParallelConfig, num_blocks: int, device: str = "cpu"
) -> dict[str, Any]:
    """Zeroed K and V tensors in this layout for the layers a rank owns (demos and tests)."""
    return allocate_token_major(model, parallel, [num_blocks] * model.num_groups, device)


def allocate_token_major(
    model: ModelSpec, parallel: ParallelConfig, blocks_per_group: Sequence[int], device: str = "cpu"
) -> dict[str, Any]:
    """:attr:`LayoutProvider.allocate`: layer ``i`` gets ``blocks_per_group[group_of(i)]`` blocks."""
    import torch

    counts = list(blocks_per_group)
    if len(counts) < model.num_groups:
        raise ConfigError(
            f"model {model.name!r} has {model.num_groups} KV-cache group(s), but {len(counts)} "
            f"block count(s) were given"
        )
    dtype = getattr(torch, model.dtype)
    heads = local_heads(model, parallel)
    k, v = [], []
    for layer in range(parallel.start_layer, parallel.end_layer):
        shape = (counts[model.group_of(layer)], model.block_size, heads, model.head_dim)
        k.append(torch.zeros(shape, dtype=dtype, device=device))
        v.append(torch.zeros(shape, dtype=dtype, device=device))
    return token_major_caches(k, v, parallel)


DEMO_MODEL = ModelSpec(name="demo-token-major", num_layers=8, num_kv_heads=4, head_dim=64)
"""The model ``kvpush demo --layout token_major`` pushes (GQA, 4 KV heads, 16-token blocks)."""


@hookimpl
def kvpush_layouts() -> list[LayoutProvider]:
    return [
        LayoutProvider(
            name=LAYOUT_NAME,
            describe_regions=describe_token_major,
            allocate=allocate_token_major,
            demo_model=DEMO_MODEL,
            description=(
                "MHA/GQA with separate K and V tensors per layer, (blocks, block_size, heads, "
                "head_dim) each (SGLang pools, vLLM NHD); head slices cut per token"
            ),
        )
    ]
