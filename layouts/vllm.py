"""The ``vllm`` layout: KV regions from vLLM's per-layer cache views and its ``KVCacheConfig``.

vLLM (0.33) allocates one backing buffer and hands every attention layer a 4-D view
``[kernel_blocks, heads, tokens, content]`` (RFC #42082; K and V are packed into the content
dim, an MLA latent is one head). The physical order inside a block follows the KV cache layout:
``HND``/``LBHNC`` keeps heads outermost (a head slice is one byte range: ``heads_outer``),
``NHD``/``LBNHC`` keeps tokens outermost (one range per token: ``tokens_outer``). Layouts that
split a block across the buffer (``LHBNC``) cannot be transferred per block and are refused.

What this module turns into regions (one per layer and KV-cache group):

- **MHA/GQA**: one ``KV`` region per layer, split by heads across TP.
- **MLA**: one ``latent`` region per layer, replicated on every TP rank.
- **HMA** (full + sliding-window groups): each layer's region carries its group and attention
  kind; groups overlay the same bytes in vLLM, so NIXL registers each span once (the transport
  merges touching spans) while descriptors address blocks through each group's own view.
- **Logical vs kernel blocks**: a view's blocks are *kernel* blocks (an attention backend may
  split a scheduler block of 64 tokens into 4 of 16); regions are per kernel block so head
  slices stay contiguous, and block ids are expanded with :func:`expand_block_ids`.
- **Layers sharing one tensor** (cross-layer KV sharing): one region whose ``layer_names``
  lists every layer, registered and transferred once.

Regions are matched by meaning (layer names, group, component), like the ``hma`` layout, so a
PP prefill stage pairs with a non-PP decoder whatever the group interleaving. Nothing here
imports vLLM: the engine glue (:mod:`kvpush.engines.vllm`) builds the mapping with
:func:`layer_caches`, which reads ``KVCacheConfig`` by attribute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvpush.core.errors import ConfigError
from kvpush.core.markers import hookimpl
from kvpush.core.types import (
    AgentMetadata,
    KVRegion,
    LayoutProvider,
    ModelSpec,
    ParallelConfig,
    RegionAlignment,
)
from kvpush.layouts.hma import semantic_alignment
from kvpush.layouts.uniform import natural_key

LAYOUT_NAME = "vllm"
MATCHING_KEY = "region_matching"
SEMANTIC = "semantic"


@attrs.frozen(kw_only=True)
class VllmLayerCache:
    """One layer's KV cache view with what ``KVCacheConfig`` says about it."""

    tensor: Any
    """vLLM's 4-D view ``[kernel_blocks, heads, tokens, content]`` of this layer."""
    group: int
    """Index of the layer's KV-cache group in ``KVCacheConfig.kv_cache_groups``."""
    attention_kind: str = "full"
    """``full`` or ``sliding_window``."""
    mla: bool = False
    blocks_per_logical: int = 1
    """Kernel blocks per scheduler (logical) block of the layer's group."""


def _names(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def describe_group(gid: int, group: Any, layers: Sequence[str] | None = None) -> str:
    """``kv_cache_groups[1] (SlidingWindowSpec, role default; layers 'a', 'b')``: a
    ``KVCacheGroupSpec`` as errors name it (``layers``: the ones at issue, default all)."""
    spec = group.kv_cache_spec
    role = getattr(group, "role", None)
    role_text = f", role {getattr(role, 'value', role)}" if role is not None else ""
    shown = list(group.layer_names if layers is None else layers)
    return f"kv_cache_groups[{gid}] ({type(spec).__name__}{role_text}; layers {_names(shown)})"


def _spec_kind(spec: Any, where: str = "") -> tuple[str, bool]:
    """``(attention_kind, is_mla)`` of a vLLM ``KVCacheSpec``, read by class name (``where``:
    the group, as :func:`describe_group` names it, for errors)."""
    names = {cls.__name__ for cls in type(spec).__mro__}
    what = where or f"a {type(spec).__name__} KV-cache group"
    if "MambaSpec" in names:
        raise ConfigError(
            f"{what} holds Mamba/SSM state; the vllm layout transfers attention KV only, Mamba/SSM "
            f"state groups are not supported (serve the model without kv_transfer_config, or use "
            f"vLLM's NixlPushConnector)"
        )
    if "AttentionSpec" not in names:
        raise ConfigError(
            f"{what} has KV cache spec {type(spec).__name__}, which is not an attention spec: the "
            f"vllm layout cannot transfer it (serve the model without kv_transfer_config)"
        )
    kind = "sliding_window" if "SlidingWindowSpec" in names else "full"
    return kind, any("MLA" in name for name in names)


def layer_caches(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    kernel_block_sizes: Sequence[int] | None = None,
) -> dict[str, VllmLayerCache]:
    """This layout's ``kv_caches`` from vLLM's ``register_kv_caches`` argument and ``KVCacheConfig``.

    ``kernel_block_sizes[g]`` is the attention kernel's block size of group ``g``; by default it
    is inferred from each view's token dim. Groups are numbered as vLLM exchanges block ids: over
    ``KVCacheConfig.transfer_groups``; layers of other groups are left out.
    """
    every = list(kv_cache_config.kv_cache_groups)
    # Only groups that take part in KV transfer (vLLM >= 0.33); block ids are indexed by them.
    groups = list(getattr(kv_cache_config, "transfer_groups", every))
    index = list(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
    out: dict[str, VllmLayerCache] = {}
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for name in group.layer_names:
            if name not in kv_caches:
                continue  # a layer of another PP stage
            layer_spec = inner[name] if inner else spec
            kind, mla = _spec_kind(layer_spec, describe_group(index[gid], group))
            tensor = kv_caches[name]
            if tensor.dim() != 4:
                raise ConfigError(
                    f"vLLM KV cache of layer {name!r} has shape {tuple(tensor.shape)}; the vllm layout "
                    f"needs vLLM >= 0.33's 4-D [blocks, heads, tokens, content] views"
                )
            kernel = kernel_block_sizes[gid] if kernel_block_sizes else tensor.shape[2]
            if layer_spec.block_size % kernel:
                raise ConfigError(
                    f"kernel block size {kernel} of group {gid} does not divide its block size "
                    f"{layer_spec.block_size}"
                )
            out[name] = VllmLayerCache(
                tensor=tensor,
                group=gid,
                attention_kind=kind,
                mla=mla,
                blocks_per_logical=layer_spec.block_size // kernel,
            )
    known = {name for group in every for name in group.layer_names}
    missing = sorted(set(kv_caches) - known)
    if missing:
        raise ConfigError(
            f"KV caches {missing[:4]} belong to no group of the KVCacheConfig; pass the config the "
            f"caches were allocated from"
        )
    return out


def check_excluded_groups(
    kv_caches: Mapping[str, Any], kv_cache_config: Any, transferred: Mapping[str, Any], num_local_layers: int
) -> None:
    """Refuse, naming each group, a rank that would transfer fewer layers than it owns because
    vLLM excludes their KV-cache group from transfer (``KVCacheGroupSpec.enable_kv_transfer``
    False). ``transferred``: what :func:`layer_caches` returned for ``kv_caches``. Excluded
    groups whose layers are all transferred through another group (vLLM's device replicas of a
    transferred group) are fine."""
    if len(transferred) >= num_local_layers:
        return
    every = list(kv_cache_config.kv_cache_groups)
    included = set(getattr(kv_cache_config, "transfer_group_ids", range(len(every))))
    excluded = []
    for gid, group in enumerate(every):
        names = [n for n in group.layer_names if n in kv_caches and n not in transferred]
        if gid not in included and names:
            excluded.append(describe_group(gid, group, names))
    if not excluded:
        return
    raise ConfigError(
        f"kvpush cannot transfer this model's KV: vLLM excludes {'; '.join(excluded)} from KV "
        f"transfer (KVCacheGroupSpec.enable_kv_transfer=False), and kvpush moves only the groups "
        f"vLLM marks transferable (KVCacheConfig.transfer_groups): this rank would transfer "
        f"{len(transferred)} of its {num_local_layers} layers, and D would decode the others "
        f"from KV it never received. Serve this model without kv_transfer_config (no prefill/decode "
        f"split), or turn off the vLLM feature that made the group non-transferable"
    )


def expand_block_ids(
    block_ids: Sequence[Sequence[int]], ratios: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """Scheduler block ids to kernel block ids, per group (``b`` -> ``b*r .. b*r+r-1``)."""
    if len(ratios) < len(block_ids):
        raise ConfigError(f"block ids for {len(block_ids)} groups, kernel ratios for {len(ratios)}")
    return tuple(
        tuple(ids) if r == 1 else tuple(b * r + i for b in ids for i in range(r))
        for ids, r in zip(block_ids, ratios)
    )


def group_ratios(caches: Mapping[str, VllmLayerCache], num_groups: int) -> tuple[int, ...]:
    """Kernel blocks per scheduler block of each group (1 for a group this rank has no layer of)."""
    ratios = [1] * num_groups
    for cache in caches.values():
        ratios[cache.group] = cache.blocks_per_logical
    return tuple(ratios)


def _block_order(tensor: Any, name: str) -> tuple[str, int]:
    """``(block_order, block_tokens)`` of a ``[B, H, N, C]`` view, from its strides."""
    block = tensor[0]
    # A one-head block is contiguous either way; the strides still tell HND (heads dim outer)
    # from NHD (heads dim as inner as the content), so both engines declare what they resolved.
    # A one-head, one-token block is the same bytes in either order: call it heads_outer, as a
    # many-head block of the peer is, or the block-order rule refuses a pair that is correct.
    if block.is_contiguous() and (
        tensor.shape[1] > 1 or tensor.shape[2] == 1 or tensor.stride(1) > tensor.stride(2)
    ):
        return "heads_outer", 0
    if block.permute(1, 0, 2).is_contiguous():
        return "tokens_outer", tensor.shape[2]
    raise ConfigError(
        f"a block of layer {name!r} is not one contiguous span (strides {tuple(tensor.stride())}); "
        f"serve with the HND KV cache layout (the connector asks for it; do not override "
        f"VLLM_KV_CACHE_LAYOUT)"
    )


def _wrap_tensors(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> dict[str, Any]:
    """Plain 4-D views (no ``KVCacheConfig`` at hand): layer ``i`` of the rank's window, in natural
    name order, takes its group and kind from the model spec."""
    if all(isinstance(v, VllmLayerCache) for v in kv_caches.values()):
        return dict(kv_caches)
    if any(isinstance(v, VllmLayerCache) for v in kv_caches.values()):
        raise ConfigError("kv_caches mixes VllmLayerCache values and plain tensors; use one or the other")
    names = sorted(kv_caches, key=natural_key)
    if len(names) != parallel.num_local_layers:
        raise ConfigError(
            f"got {len(names)} plain KV tensors but rank {parallel.rank} owns {parallel.num_local_layers} "
            f"layers; with shared or partial layers build the mapping with "
            f"kvpush.layouts.vllm.layer_caches(kv_caches, kv_cache_config)"
        )
    out = {}
    for position, name in enumerate(names):
        layer = parallel.start_layer + position
        tensor = kv_caches[name]
        if not hasattr(tensor, "dim") or tensor.dim() != 4:
            raise ConfigError(
                f"KV cache of layer {name!r} must be a 4-D [blocks, heads, tokens, content] view (or a "
                f"VllmLayerCache from kvpush.layouts.vllm.layer_caches), got {type(tensor).__name__}"
            )
        out[name] = VllmLayerCache(
            tensor=tensor,
            group=model.group_of(layer),
            attention_kind=model.kind_of(layer),
            mla=model.attention == "mla",
        )
    return out


def describe_vllm(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """One region per layer (and group) this rank holds, in natural layer-name order.

    ``kv_caches`` maps layer names to :class:`VllmLayerCache` (:func:`layer_caches` builds them from
    vLLM's caches and ``KVCacheConfig``) or, without a ``KVCacheConfig``, to plain 4-D views whose
    groups and kinds come from ``model``.
    """
    kv_caches = _wrap_tensors(kv_caches, parallel, model)
    merged: dict[tuple[int, int, int], list[str]] = {}
    first: dict[tuple[int, int, int], VllmLayerCache] = {}
    for name in sorted(kv_caches, key=natural_key):
        cache = kv_caches[name]
        key = (cache.tensor.data_ptr(), cache.tensor.stride(0), cache.group)
        merged.setdefault(key, []).append(name)
        first.setdefault(key, cache)
    regions = []
    for key, names in merged.items():
        cache = first[key]
        tensor = cache.tensor
        blocks, heads = tensor.shape[:2]
        if cache.mla != (model.attention == "mla"):
            raise ConfigError(
                f"layer {names[0]!r} is {'an MLA' if cache.mla else 'a non-MLA'} layer but the model "
                f"spec says attention={model.attention!r}"
            )
        if not cache.mla and heads * parallel.tp_size != model.num_kv_heads:
            raise ConfigError(
                f"layer {names[0]!r} holds {heads} KV heads on each of {parallel.tp_size} TP ranks but "
                f"the model has {model.num_kv_heads}; replicated KV heads (TP > KV heads) are not supported"
            )
        order, block_tokens = _block_order(tensor, names[0])
        element = tensor.element_size()
        regions.append(
            KVRegion(
                base_addr=tensor.data_ptr(),
                block_len=tensor[0].numel() * element,
                block_stride=tensor.stride(0) * element,
                num_blocks=blocks,
                mem_type="VRAM" if tensor.is_cuda else "DRAM",
                device_id=(tensor.device.index or 0) if tensor.is_cuda else 0,
                layer_names=tuple(names),
                kv_group=cache.group,
                component="latent" if cache.mla else "KV",
                replicate=cache.mla,
                attention_kind=cache.attention_kind,
                num_heads=1 if cache.mla else heads,
                block_order=order,
                block_tokens=block_tokens,
            )
        )
    if not regions:
        raise ConfigError(f"rank {parallel.rank} got no KV caches to register")
    return regions


LAYER_NAME = "model.layers.{}.self_attn.attn"
DEMO_MODEL = ModelSpec(
    name="vllm-demo-gqa", num_layers=4, num_kv_heads=4, head_dim=8, block_size=16, dtype="bfloat16"
)


def allocate_vllm_caches(
    model: ModelSpec, parallel: ParallelConfig, blocks_per_group: Sequence[int], device: str = "cpu"
) -> dict[str, Any]:
    """Zeroed caches shaped like vLLM 0.33's HND views (demos and tests without vLLM): layer ``i``
    is ``[blocks of its group, local heads, block_size, content]``, content = K and V packed
    (``2 x head_dim``) or the MLA latent (one head)."""
    import torch

    counts = list(blocks_per_group)
    if len(counts) < model.num_groups or any(not isinstance(n, int) or n <= 0 for n in counts):
        raise ConfigError(
            f"model {model.name!r} needs a positive block count for each of its {model.num_groups} "
            f"KV-cache group(s), got {counts}"
        )
    mla = model.attention == "mla"
    if not mla and model.num_kv_heads % parallel.tp_size:
        raise ConfigError(
            f"ModelSpec.num_kv_heads={model.num_kv_heads} cannot be split over tp_size={parallel.tp_size}"
        )
    heads = 1 if mla else model.num_kv_heads // parallel.tp_size
    content = model.head_dim if mla else 2 * model.head_dim
    dtype = getattr(torch, model.dtype)
    return {
        LAYER_NAME.format(layer): torch.zeros(
            (counts[model.group_of(layer)], heads, model.block_size, content), dtype=dtype, device=device
        )
        for layer in range(parallel.start_layer, parallel.end_layer)
    }


@hookimpl
def kvpush_layouts() -> list[LayoutProvider]:
    extras: dict[str, Any] = {}
    fields = attrs.fields_dict(LayoutProvider)
    if "allocate" in fields and "demo_model" in fields:
        extras = {"allocate": allocate_vllm_caches, "demo_model": DEMO_MODEL}
    return [
        LayoutProvider(
            name=LAYOUT_NAME,
            describe_regions=describe_vllm,
            **extras,
            description=(
                "vLLM >= 0.33 per-layer [blocks, heads, tokens, content] views (HND or NHD), MHA/GQA, "
                "MLA and hybrid groups; kernel-block regions matched by layer name, group and component"
            ),
        )
    ]


@hookimpl
def kvpush_metadata_extensions(local: AgentMetadata) -> dict[str, Any] | None:
    if local.layout != LAYOUT_NAME:
        return None
    return {MATCHING_KEY: SEMANTIC}


@hookimpl
def kvpush_validate_peer(local: AgentMetadata, peer: AgentMetadata) -> list[str]:
    if local.layout != LAYOUT_NAME or peer.layout == LAYOUT_NAME:
        return []
    return [
        f"this rank uses the vllm layout but the peer uses {peer.layout!r}; both engines must run "
        f"kvpush's vLLM connector (kvpush.engines.vllm)"
    ]


@hookimpl
def kvpush_align_regions(local: AgentMetadata, peer: AgentMetadata) -> RegionAlignment | None:
    if local.layout != LAYOUT_NAME:
        return None
    alignment = semantic_alignment(local, peer)
    return attrs.evolve(alignment, source=LAYOUT_NAME)
