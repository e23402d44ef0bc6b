"""In-block order: where a TP head slice of a block lies, and which peers can be sliced at all.

A block of a head-split region holds ``num_heads`` heads of ``block_tokens`` tokens. Its
:attr:`~kvpush.core.types.KVRegion.block_order` says how:

- ``heads_outer`` (HND, ``[heads, tokens, head_dim]``): head slice ``(index, count)`` is one
  byte range, ``[index, index + 1) x block_len / count``;
- ``tokens_outer`` (NHD, ``[tokens, heads, head_dim]``, SGLang's pools, vLLM's FlashAttention
  layout): it is one range per token, ``token_bytes / count`` bytes at
  ``t x token_bytes + index x token_bytes / count`` for every token ``t``;
- ``unspecified`` (a layout that does not say): only whole blocks may move, so heterogeneous
  TP is refused at handshake.

:func:`slice_rows` gives the rows (byte ranges) of one block's slice; the planner and the
packer cut blocks with it. :func:`check_peer_order` is the handshake rule (run by the
``block_order`` plugin): both sides must declare the same order, and a slice must fall on head
and token boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvpush.core.errors import ConfigError
from kvpush.core.types import AgentMetadata, KVRegion

HEADS_OUTER = "heads_outer"
TOKENS_OUTER = "tokens_outer"
UNSPECIFIED = "unspecified"

RULE = (
    "a TP head slice must cut the same heads out of both sides' blocks: both layouts declare "
    "the same KVRegion.block_order (heads_outer or tokens_outer, with block_tokens), and the "
    "slice count divides the heads (and, tokens_outer, each token's row)"
)
"""The rule :func:`check_peer_order` enforces, quoted in its errors."""


@attrs.frozen
class SliceRows:
    """Byte slice ``(index, count)`` of one block: ``rows`` ranges of ``size`` bytes, range
    ``r`` at ``first + r x step`` from the block's start."""

    rows: int
    step: int
    size: int
    first: int


def token_rows(region: KVRegion) -> int:
    """Rows a block of ``region`` is cut into by the direct planner: ``block_tokens`` for a
    head-split ``tokens_outer`` region (a head slice is one row per token), else 1."""
    if region.block_order == TOKENS_OUTER and not region.replicate:
        return region.block_tokens
    return 1


def slice_rows(region: KVRegion, part: tuple[int, int], *, per_token: bool = False) -> SliceRows:
    """Where byte slice ``part = (index, count)`` of a block of ``region`` lies.

    A ``tokens_outer`` head-split region is cut per token when ``count > 1`` (or when
    ``per_token``, so both sides of a transfer cut into the same number of rows); every other
    region is one range. Raises ``ConfigError`` when the slice would not fall on a row boundary.
    """
    index, count = part
    if not 0 <= index < count:
        raise ConfigError(f"block part {part} must satisfy 0 <= index < count")
    if token_rows(region) > 1 and (count > 1 or per_token):
        row = region.token_bytes
        if row % count:
            raise ConfigError(
                f"token rows of {region.layer_names} {region.component} ({row} bytes, "
                f"{region.num_heads} head(s)) cannot be cut into {count} equal head slices"
            )
        size = row // count
        return SliceRows(rows=region.block_tokens, step=row, size=size, first=index * size)
    if region.block_len % count:
        raise ConfigError(
            f"block of {region.layer_names} ({region.block_len} bytes) cannot be cut into "
            f"{count} equal slices"
        )
    size = region.block_len // count
    return SliceRows(rows=1, step=size, size=size, first=index * size)


def _describe(meta: AgentMetadata, region: KVRegion) -> str:
    names = ", ".join(region.layer_names) or "?"
    order = region.block_order
    if order == TOKENS_OUTER:
        order += f" ({region.block_tokens} tokens)"
    where = f"layout {meta.layout!r} of {meta.engine_id!r} {meta.rank}"
    return f"{where} declares {names} {region.component} {order}"


def _sliceable(meta: AgentMetadata, region: KVRegion, count: int) -> str | None:
    """Why ``region`` (on the side whose blocks are cut ``count`` ways) cannot be sliced."""
    if region.block_order == UNSPECIFIED:
        return (
            f"{_describe(meta, region)}: with no in-block order a head slice cannot be located; "
            f"declare block_order='heads_outer' for [heads, tokens, head_dim] blocks or "
            f"'tokens_outer' (and block_tokens) for [tokens, heads, head_dim] blocks"
        )
    if region.num_heads % count:
        return f"{_describe(meta, region)} with {region.num_heads} head(s), which do not split {count} ways"
    return None


def check_peer_order(local: AgentMetadata, peer: AgentMetadata) -> list[str]:
    """Problems with slicing heads between ``local`` and ``peer`` (empty: none).

    Regions pair by semantic key (layer names, group, component); when no key is shared the
    sides are compared as a whole. Declared orders (and token counts) must match everywhere:
    even whole blocks are read in the peer's order. When the TP sizes differ, every head-split
    region of the side with more heads per rank must be sliceable (order declared, heads
    divisible).
    """
    mine, theirs = local.parallel.tp_size, peer.parallel.tp_size
    problems: list[str] = []
    by_key = {r.semantic_key: r for r in peer.regions}
    pairs = [(r, by_key[r.semantic_key]) for r in local.regions if r.semantic_key in by_key]
    if not pairs and local.regions and peer.regions:
        pairs = list(zip(local.regions, peer.regions))
    for a, b in pairs:
        declared = UNSPECIFIED not in (a.block_order, b.block_order)
        if declared and (a.block_order, a.block_tokens) != (b.block_order, b.block_tokens):
            problems.append(
                f"{_describe(local, a)} but {_describe(peer, b)}; {RULE}. Run both engines with "
                f"the same layout code"
            )
            break  # one is enough: the layouts disagree
    if mine == theirs:
        return problems
    big, small = max(mine, theirs), min(mine, theirs)
    count = big // small if big % small == 0 else 0
    if not count:
        return problems  # TP sizes that do not divide are refused elsewhere (tp_mapping)
    cut = local if mine < theirs else peer  # the side with more heads per rank
    other = peer if cut is local else local
    for meta in (cut, other):
        for region in meta.regions:
            if region.replicate:
                continue
            why = _sliceable(meta, region, count if meta is cut else 1)
            if why is not None:
                problems.append(
                    f"P TP {_prefill_tp(local, peer)} -> D TP {_decode_tp(local, peer)} moves "
                    f"head slices, but {why}. Rule: {RULE}"
                )
                return problems
    return problems


def _prefill_tp(local: AgentMetadata, peer: AgentMetadata) -> int:
    return (local if local.role.value == "prefill" else peer).parallel.tp_size


def _decode_tp(local: AgentMetadata, peer: AgentMetadata) -> int:
    return (peer if local.role.value == "prefill" else local).parallel.tp_size


def check_regions_sliceable(regions: Sequence[KVRegion], count: int, what: str) -> None:
    """Raise ``ConfigError`` when a head-split region cannot be cut ``count`` ways (planning)."""
    if count == 1:  # whole blocks: nothing is cut (per request: skip the scan of every region)
        return
    for region in regions:
        if region.replicate:
            continue
        if region.block_order == UNSPECIFIED:
            raise ConfigError(
                f"{what}: region {region.layer_names} {region.component} declares no in-block "
                f"order, so its head slices cannot be located. Rule: {RULE}"
            )
