"""Deterministic KV content: what P writes into a block and what D must find there.

Every element of a block gets a 16-bit value derived from (request seed, layer, component,
position of the block in the request, global head, element index), so a block that lands in
the wrong slot, the wrong layer, or with the wrong head slice never matches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvpush.core.types import KVRegion, ModelSpec, ParallelConfig

COMPONENT_CODE = {"K": 1, "V": 2, "KV": 3, "latent": 4}


def layer_index(name: str) -> int:
    digits = "".join(ch if ch.isdigit() else " " for ch in name).split()
    return int(digits[-1]) if digits else 0


def block_pattern(
    seed: int, layer: int, component: str, position: int, heads: range, per_head: int, device: Any
) -> torch.Tensor:
    """int16 values of one block: ``len(heads)`` rows of ``per_head`` elements."""
    base = (seed * 1_000_003 + layer * 7919 + COMPONENT_CODE[component] * 104_729 + position * 31) % 65_536
    head_ids = torch.tensor(list(heads), dtype=torch.int64, device=device)
    offsets = head_ids[:, None] * per_head + torch.arange(per_head, dtype=torch.int64, device=device)[None, :]
    return ((base + offsets) % 65_536 - 32_768).to(torch.int16)


def region_heads(region: KVRegion, parallel: ParallelConfig) -> range:
    """Global head indices a rank holds in a region (0..0 for a replicated latent)."""
    if region.replicate:
        return range(1)
    start = parallel.tp_rank * region.num_heads
    return range(start, start + region.num_heads)


def _block_view(region: KVRegion, tensor: torch.Tensor, block: int) -> torch.Tensor:
    return tensor[block].reshape(-1).view(torch.int16)


def region_tensors(kv_caches: Mapping[str, torch.Tensor], model: ModelSpec) -> list[torch.Tensor]:
    """The per-region tensors in region order (K then V per layer for mha/hma; latent for mla)."""
    from kvpush.layouts.uniform import natural_key

    out = []
    for name in sorted(kv_caches, key=natural_key):
        tensor = kv_caches[name]
        if model.attention == "mla":
            out.append(tensor)
        else:
            out.extend([tensor[0], tensor[1]])
    return out


def fill_request(
    regions: Sequence[KVRegion],
    tensors: Sequence[torch.Tensor],
    parallel: ParallelConfig,
    seed: int,
    block_ids: Sequence[Sequence[int]],
) -> None:
    """P: write the request's content into its blocks (per group)."""
    for region, tensor in zip(regions, tensors, strict=True):
        heads = region_heads(region, parallel)
        per_head = region.block_len // 2 // len(heads)
        layer = layer_index(region.layer_names[0])
        for position, block in enumerate(block_ids[region.kv_group]):
            values = block_pattern(seed, layer, region.component, position, heads, per_head, tensor.device)
            _block_view(region, tensor, block).copy_(values.reshape(-1))


def verify_request(
    regions: Sequence[KVRegion],
    tensors: Sequence[torch.Tensor],
    parallel: ParallelConfig,
    seed: int,
    block_ids: Sequence[Sequence[int]],
    position_offset: Sequence[int] = (),
) -> str | None:
    """D: None if every block holds the expected bytes, else a description of the first miss.

    ``position_offset[g]`` shifts positions for a prefix-cache hit (D registered only the
    suffix of group g, so its first block is P's block number ``offset``).
    """
    for region, tensor in zip(regions, tensors, strict=True):
        heads = region_heads(region, parallel)
        per_head = region.block_len // 2 // len(heads)
        layer = layer_index(region.layer_names[0])
        offset = position_offset[region.kv_group] if position_offset else 0
        for position, block in enumerate(block_ids[region.kv_group]):
            expected = block_pattern(
                seed, layer, region.component, position + offset, heads, per_head, tensor.device
            )
            if not torch.equal(_block_view(region, tensor, block), expected.reshape(-1)):
                return (
                    f"block {block} (position {position + offset}) of {region.layer_names[0]} "
                    f"{region.component} does not hold the pushed bytes"
                )
    return None
