"""Deterministic KV content for any layout: what P writes into a block and what D must find.

Everything works from the regions a layout described, not from its tensor shapes: a region's
blocks are found by address inside the rank's KV tensors (:func:`region_views`), and every byte
of a block gets a value derived from (request seed, the region's layer names, KV group and
component, the block's position in the request, the byte's *global head* and its offset inside
that head). The head comes from the region's in-block order (``heads_outer``: head-major;
``tokens_outer``: one head row per token), so a head slice pushed under heterogeneous TP lands
where D expects it, and a block in the wrong slot, layer, component or head never matches.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvpush.core.types import KVRegion, ParallelConfig

__all__ = ["fill_request", "region_views", "verify_request"]


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of ``tensor``."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def region_views(kv_caches: Mapping[str, torch.Tensor], regions: Sequence[KVRegion]) -> list[torch.Tensor]:
    """For each region, a ``(num_blocks, block_len)`` uint8 view of its blocks inside the caches.

    A region must lie inside the storage of one of the tensors of ``kv_caches`` (the tensors the
    layout described it from); ``ValueError`` names the region otherwise.
    """
    storages = []
    for tensor in kv_caches.values():
        flat = _storage_bytes(tensor)
        storages.append((flat.data_ptr(), flat.data_ptr() + flat.numel(), flat))
    views = []
    for index, region in enumerate(regions):
        owner = next((s for s in storages if s[0] <= region.base_addr and region.end_addr <= s[1]), None)
        if owner is None:
            raise ValueError(
                f"region {index} ({region.layer_names} {region.component}) lies in none of the KV "
                f"cache tensors; a layout must describe regions over the tensors it was given"
            )
        start, _, flat = owner
        views.append(
            flat.as_strided(
                (region.num_blocks, region.block_len), (region.block_stride, 1), region.base_addr - start
            )
        )
    return views


def _logical_offsets(region: KVRegion, parallel: ParallelConfig, device: Any) -> torch.Tensor:
    """For each byte of a block: ``global head x bytes per head + offset inside the head``."""
    heads = 1 if region.replicate else region.num_heads
    first = 0 if region.replicate else parallel.tp_rank * region.num_heads
    offsets = torch.arange(region.block_len, dtype=torch.int64, device=device)
    per_head = region.block_len // heads
    tokens = getattr(region, "block_tokens", 0)
    if getattr(region, "block_order", "heads_outer") == "tokens_outer" and tokens > 0:
        row = per_head // tokens  # bytes of one head in one token
        token, rest = offsets // (heads * row), offsets % (heads * row)
        head, within = rest // row, token * row + rest % row
    else:
        head, within = offsets // per_head, offsets % per_head
    return (first + head) * per_head + within


def _identity(region: KVRegion) -> int:
    key = f"{'|'.join(region.layer_names)}/{region.kv_group}/{region.component}".encode()
    return zlib.crc32(key)


def _blocks(region: KVRegion, parallel: ParallelConfig, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """uint8 content of the blocks at ``positions`` of a request: ``(len(positions), block_len)``."""
    logical = _logical_offsets(region, parallel, positions.device)
    base = (seed * 1_000_003 + _identity(region) * 7919 + positions * 104_729) % (1 << 31)
    mixed = (base[:, None] * 31 + logical[None, :]) * 2_654_435_761 % (1 << 32)
    return (mixed >> 24).to(torch.uint8)


def fill_request(
    regions: Sequence[KVRegion],
    tensors: Sequence[torch.Tensor],
    parallel: ParallelConfig,
    seed: int,
    block_ids: Sequence[Sequence[int]],
) -> None:
    """P: write the request's content into its blocks (per group); ``tensors`` from :func:`region_views`."""
    for region, view in zip(regions, tensors, strict=True):
        ids = list(block_ids[region.kv_group])
        if not ids:
            continue
        positions = torch.arange(len(ids), dtype=torch.int64, device=view.device)
        view[torch.tensor(ids, dtype=torch.int64, device=view.device)] = _blocks(
            region, parallel, seed, positions
        )


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
    for region, view in zip(regions, tensors, strict=True):
        ids = list(block_ids[region.kv_group])
        if not ids:
            continue
        offset = position_offset[region.kv_group] if position_offset else 0
        positions = torch.arange(offset, offset + len(ids), dtype=torch.int64, device=view.device)
        expected = _blocks(region, parallel, seed, positions)
        got = view[torch.tensor(ids, dtype=torch.int64, device=view.device)]
        if not torch.equal(got, expected):
            row = int((got != expected).any(dim=1).nonzero()[0, 0])
            byte = int((got[row] != expected[row]).nonzero()[0, 0])
            return (
                f"block {ids[row]} (position {row + offset}) of {', '.join(region.layer_names)} "
                f"{region.component} does not hold the pushed bytes (first wrong byte {byte} of "
                f"{region.block_len})"
            )
    return None
