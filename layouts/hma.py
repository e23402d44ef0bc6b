"""The HMA layout: hybrid models (full + sliding-window attention) with per-group KV caches.

A hybrid model keeps its layers' KV caches in several KV-cache groups (``ModelSpec.layer_groups``),
typically group 0 for full-attention layers and group 1 for sliding-window layers. Each group is
allocated by the engine on its own, so groups may have different block counts, and P and D may
allocate different counts per group. Each layer's tensor has shape
``(2, num_blocks_of_its_group, local_heads, block_size, head_dim)``: K (``[0]``) and V (``[1]``) are
one region each, split by heads across TP like the uniform MHA layout.

Regions are paired by *meaning* rather than by position: a prefill stage owning some layers
pairs each of its regions with the peer region of the same :attr:`KVRegion.semantic_key`
(layer name, KV group, component). That is what makes pipeline-parallel prefill of a hybrid
model safe: offset slicing (``pp_slicing``) assumes every stage's regions are a contiguous
window of D's list, which an interleaved hybrid model with per-group counts need not satisfy.

Everything here is wired through hooks only:

- ``kvpush_layouts`` offers the layout ``"hma"``;
- ``kvpush_metadata_extensions`` publishes ``region_matching = "semantic"``, which tells
  offset PP slicing to stand aside;
- ``kvpush_validate_peer`` checks the peer is an HMA rank matching regions by meaning;
- ``kvpush_align_regions`` claims the alignment of an HMA rank and pairs by semantic key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.core.errors import ConfigError, HandshakeError
from kvpush.core.markers import hookimpl
from kvpush.core.types import (
    AgentMetadata,
    HandshakeMode,
    KVRegion,
    LayoutProvider,
    ModelSpec,
    ParallelConfig,
    RegionAlignment,
)
from kvpush.layouts.regions import check_tensors, local_heads, ordered_layers, tensor_region

LAYOUT_NAME = "hma"
MATCHING_KEY = "region_matching"
SEMANTIC = "semantic"

SemanticKey = tuple[tuple[str, ...], int, str]


def _describe_key(key: SemanticKey) -> str:
    names, group, component = key
    return f"layer {', '.join(names)} (KV group {group}, {component})"


# ------------------------------------------------------------------------------ layout


def describe_hma(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """K and V regions of every layer this rank owns, in natural layer-name order."""
    if model.attention != "mha":
        raise ConfigError(
            f"the HMA layout handles MHA/GQA hybrid models; model {model.name!r} uses "
            f"{model.attention!r} attention (use the uniform layout)"
        )
    heads = local_heads(model, parallel)
    regions: list[KVRegion] = []
    group_blocks: dict[int, tuple[str, int]] = {}
    for position, (name, tensor) in enumerate(ordered_layers(kv_caches, parallel)):
        layer = parallel.start_layer + position
        group = model.group_of(layer)
        expected = (2, heads, model.block_size, model.head_dim)
        if tensor.dim() != 5 or (tensor.shape[0], *tensor.shape[2:]) != expected:
            raise ConfigError(
                f"HMA layer {name} must be (2, num_blocks_of_group_{group}, {heads}, "
                f"{model.block_size}, {model.head_dim}) on TP rank {parallel.tp_rank}, got "
                f"{tuple(tensor.shape)}"
            )
        first = group_blocks.setdefault(group, (name, tensor.shape[1]))
        if first[1] != tensor.shape[1]:
            raise ConfigError(
                f"HMA layers {first[0]} and {name} are both in KV group {group} but hold "
                f"{first[1]} and {tensor.shape[1]} blocks; every layer of a group shares the "
                f"group's block ids, so allocate them alike"
            )
        identity = {
            "layer_names": (name,),
            "kv_group": group,
            "attention_kind": model.kind_of(layer),
            "replicate": False,
            "num_heads": heads,
            "block_order": "heads_outer",
        }
        for index, component in enumerate(("K", "V")):
            regions.append(tensor_region(tensor[index], component=component, **identity))
    check_tensors(kv_caches, regions, model, layout="hma")
    return regions


def allocate_hma_caches(
    model: ModelSpec, parallel: ParallelConfig, blocks_per_group: Sequence[int], device: str = "cpu"
) -> dict[str, Any]:
    """Allocate zeroed HMA caches for the layers a rank owns: layer ``i`` gets
    ``blocks_per_group[group_of(i)]`` blocks (demos and tests)."""
    import torch

    counts = list(blocks_per_group)
    if len(counts) != model.num_groups:
        raise ConfigError(
            f"model {model.name!r} has {model.num_groups} KV-cache group(s), but "
            f"{len(counts)} block count(s) were given"
        )
    if any(not isinstance(n, int) or n <= 0 for n in counts):
        raise ConfigError(f"block counts per group must be positive ints, got {counts}")
    dtype = getattr(torch, model.dtype)
    heads = local_heads(model, parallel)
    caches = {}
    for layer in range(parallel.start_layer, parallel.end_layer):
        shape = (2, counts[model.group_of(layer)], heads, model.block_size, model.head_dim)
        caches[f"layers.{layer}"] = torch.zeros(shape, dtype=dtype, device=device)
    return caches


DEMO_MODEL = ModelSpec(
    name="demo-hybrid",
    num_layers=8,
    num_kv_heads=4,
    head_dim=64,
    layer_groups=[i % 2 for i in range(8)],
    layer_kinds=["full" if i % 2 == 0 else "sliding_window" for i in range(8)],
)
"""The model ``kvpush demo --layout hma`` pushes: full and sliding-window layers interleaved."""


# ------------------------------------------------------------------------------ alignment


def semantic_alignment(local: AgentMetadata, peer: AgentMetadata) -> RegionAlignment:
    """Pair every local region with the peer region of the same semantic key.

    Peer regions of layers this rank does not own (other PP stages) are ignored. A local
    region with no peer counterpart, or a key the peer (or this rank) advertises twice,
    raises ``HandshakeError`` naming the layer.
    """
    where = f"{peer.engine_id!r} {peer.rank}"
    by_key: dict[SemanticKey, int] = {}
    for j, region in enumerate(peer.regions):
        key = region.semantic_key
        if key in by_key:
            raise HandshakeError(
                f"{where} advertises {_describe_key(key)} twice (regions {by_key[key]} and {j}); "
                f"semantic matching needs one region per (layer, group, component)"
            )
        by_key[key] = j
    by_layer: dict[str, list[SemanticKey]] = {}
    for key in by_key:
        for name in key[0]:
            by_layer.setdefault(name, []).append(key)
    indices = []
    seen: dict[SemanticKey, int] = {}
    for i, region in enumerate(local.regions):
        key = region.semantic_key
        if key in seen:
            raise HandshakeError(
                f"{local.engine_id!r} {local.rank} describes {_describe_key(key)} twice (regions "
                f"{seen[key]} and {i}); its layout is broken"
            )
        seen[key] = i
        j = by_key.get(key)
        if j is None:
            related = sorted({k for name in key[0] for k in by_layer.get(name, ())})
            hint = (
                f"it has {'; '.join(_describe_key(k) for k in related)} instead"
                if related
                else "it has no region for that layer"
            )
            raise HandshakeError(
                f"{local.engine_id!r} {local.rank} owns {_describe_key(key)}, but {where} does not "
                f"advertise it ({hint}); check that both sides run the same model and layer names"
            )
        indices.append(j)
    return RegionAlignment(remote_indices=indices, source=LAYOUT_NAME)


# ------------------------------------------------------------------------------ hooks


@hookimpl
def kvpush_layouts() -> list[LayoutProvider]:
    return [
        LayoutProvider(
            name=LAYOUT_NAME,
            describe_regions=describe_hma,
            allocate=allocate_hma_caches,
            demo_model=DEMO_MODEL,
            description=(
                "hybrid (full + sliding-window) MHA/GQA: K and V regions per layer in per-group "
                "KV caches, matched by layer name, group and component (works under PP)"
            ),
        )
    ]


@hookimpl
def kvpush_metadata_extensions(local: AgentMetadata) -> dict[str, Any] | None:
    if local.layout != LAYOUT_NAME:
        return None
    return {MATCHING_KEY: SEMANTIC}


@hookimpl
def kvpush_validate_peer(local: AgentMetadata, peer: AgentMetadata, mode: HandshakeMode) -> list[str]:
    if local.layout != LAYOUT_NAME:
        return []
    problems = []
    if peer.layout != LAYOUT_NAME:
        problems.append(
            f"this rank uses the HMA layout but the peer uses {peer.layout!r}; set "
            f"WorkerConfig.layout='hma' on both engines (the demo's --layout hma)"
        )
    elif peer.extensions.get(MATCHING_KEY) != SEMANTIC:
        problems.append(
            f"the peer runs the HMA layout but does not publish {MATCHING_KEY}={SEMANTIC!r} "
            f"(is its 'hma' plugin disabled or outdated?); regions cannot be matched by meaning"
        )
    if mode is HandshakeMode.FULL:
        unnamed = [j for j, r in enumerate(peer.regions) if not r.layer_names]
        if unnamed:
            problems.append(f"peer regions {unnamed[:8]} carry no layer names; semantic matching needs them")
    return problems


@hookimpl
def kvpush_align_regions(local: AgentMetadata, peer: AgentMetadata) -> RegionAlignment | None:
    if local.layout != LAYOUT_NAME:
        return None
    return semantic_alignment(local, peer)
