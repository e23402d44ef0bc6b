"""Vectorised transfer planning: descriptor lists and descriptor ids (numpy, no per-block loop).

A prepared descriptor list holds, region by region, ``rows_i`` descriptors per block of the
region (region-major, then block, then row). ``rows_i`` is 1, or ``block_tokens`` for a
head-split ``tokens_outer`` region, whose head slice is one range per token
(:mod:`kvpush.core.block_order`); such a region is cut per token in every list, whole blocks
included, so a sliced side always pairs row for row with an unsliced one. The descriptor id of
row ``t`` of block ``b`` of region ``i`` is ``offset[i] + b x rows_i + t`` where ``offset`` is
the running sum of the regions' ``num_blocks x rows``. Both sides compute ids over their
regions in *local* region order (the remote list is built over the aligned peer regions), so
entry ``n`` of the local ids pairs with entry ``n`` of the remote ids.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np

from kvpush.core.block_order import slice_rows, token_rows
from kvpush.core.errors import ConfigError
from kvpush.core.types import BlockIds, KVRegion


def region_descriptors(
    regions: Sequence[KVRegion], part: tuple[int, int] = (0, 1), *, per_token: bool = True
) -> np.ndarray:
    """Nx3 uint64 ``(addr, len, device)`` for every row of every block of every region.

    ``part = (index, count)`` selects head slice ``index`` of ``count`` equal slices of each
    block (heterogeneous TP): one byte range (``heads_outer``), or one per token
    (``tokens_outer``, see the module docstring). ``per_token=False`` keeps whole
    ``tokens_outer`` blocks as one descriptor: only for lists no sliced transfer pairs with
    (equal TP), and with the same flag to :func:`descriptor_ids`.
    """
    if not per_token and part[1] > 1 and any(token_rows(r) > 1 for r in regions):
        raise ConfigError(
            f"part {part} of a tokens_outer block is a descriptor per token; use per_token=True"
        )
    rows = [slice_rows(r, part, per_token=per_token) for r in regions]
    out = np.empty((sum(r.num_blocks * s.rows for r, s in zip(regions, rows)), 3), dtype=np.uint64)
    start = 0
    for region, cut in zip(regions, rows):
        end = start + region.num_blocks * cut.rows
        blocks = np.arange(region.num_blocks, dtype=np.uint64) * np.uint64(region.block_stride)
        within = np.uint64(cut.first) + np.arange(cut.rows, dtype=np.uint64) * np.uint64(cut.step)
        out[start:end, 0] = (np.uint64(region.base_addr) + blocks[:, None] + within[None, :]).ravel()
        out[start:end, 1] = cut.size
        out[start:end, 2] = region.device_id
        start = end
    return out


def _rows(region: KVRegion, per_token: bool) -> int:
    return token_rows(region) if per_token else 1


def region_offsets(regions: Sequence[KVRegion], *, per_token: bool = True) -> np.ndarray:
    """Descriptor id of each region's first row (the running sum of ``num_blocks x rows``)."""
    rows = (r.num_blocks * _rows(r, per_token) for r in regions)
    counts = np.fromiter(rows, dtype=np.int64, count=len(regions))
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def descriptor_ids(
    regions: Sequence[KVRegion], groups: Sequence[int], block_ids: BlockIds, *, per_token: bool = True
) -> np.ndarray:
    """int32 descriptor ids of ``block_ids`` in every region (``groups[i]`` is region i's group),
    in lists built by :func:`region_descriptors` with the same ``per_token``.

    Raises ``ConfigError`` for a block id beyond a region's capacity.
    """
    grid = descriptor_id_grid(regions, groups, block_ids, per_token=per_token)
    if grid is not None:  # common case: one broadcast, int32
        return grid.ids()
    table = _region_table(regions, per_token)
    if table.one_row:  # several KV groups (hybrid models): one gather over all regions
        return _ids_across_groups(table, groups, block_ids)
    # region order is kept: ids are emitted region by region (then block, then token row)
    offsets, capacities, rows = table.offsets, table.capacities, table.rows
    parts = []
    for i, group in enumerate(groups):
        ids = np.asarray(block_ids[group], dtype=np.int64)
        _check_capacity(ids, capacities[i], group)
        n = rows[i]
        parts.append((offsets[i] + ids[:, None] * n + np.arange(n, dtype=np.int64)[None, :]).ravel())
    out = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return out.astype(np.int32)


def _ids_across_groups(table: _Table, groups: Sequence[int], block_ids: BlockIds) -> np.ndarray:
    """:func:`descriptor_ids` for regions of one row per block in several KV groups, without a
    loop over regions (a per-region loop cost ~0.5 ms a request for a 64-region hybrid model):
    region ``i``'s ids are ``offset[i] + block_ids[groups[i]]``, emitted region by region."""
    group_of = _group_array(groups)
    arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in block_ids]
    lens = np.array([len(a) for a in arrays], dtype=np.int64)
    per_region = lens[group_of]
    used = per_region > 0
    if used.any():
        highest = np.array([a.max() if len(a) else -1 for a in arrays], dtype=np.int64)[group_of]
        lowest = np.array([a.min() if len(a) else 0 for a in arrays], dtype=np.int64)[group_of]
        bad = np.flatnonzero(used & ((highest >= table.capacities) | (lowest < 0)))
        if len(bad):
            i = int(bad[0])
            _check_capacity(arrays[int(group_of[i])], int(table.capacities[i]), int(group_of[i]))
    total = int(per_region.sum())
    if not total:
        return np.empty(0, dtype=np.int32)
    every = np.concatenate(arrays)
    group_start = np.cumsum(lens) - lens
    region_start = np.cumsum(per_region) - per_region
    within = np.arange(total, dtype=np.int64) - np.repeat(region_start, per_region)
    picked = every[np.repeat(group_start[group_of], per_region) + within]
    return (np.repeat(table.offsets, per_region) + picked).astype(np.int32)


_GROUP_ARRAYS: dict[int, tuple[Sequence[int], np.ndarray]] = {}


def _group_array(groups: Sequence[int]) -> np.ndarray:
    """``groups`` as an int64 array, remembered per tuple object (as :func:`_group_span`)."""
    hit = _GROUP_ARRAYS.get(id(groups))
    if hit is not None and hit[0] is groups:
        return hit[1]
    array = np.asarray(groups, dtype=np.int64).reshape(-1)
    if isinstance(groups, tuple):
        if len(_GROUP_ARRAYS) >= 256:
            _GROUP_ARRAYS.clear()
        array.flags.writeable = False
        _GROUP_ARRAYS[id(groups)] = (groups, array)
    return array


@attrs.frozen(eq=False)
class IdGrid:
    """Descriptor ids in factored form: id ``r x len(blocks) + b`` is ``starts[r] + blocks[b]``
    (region-major, as :func:`descriptor_ids` emits them). Every region has one row per block
    and one KV group, the common layout; a transport that resolves ids on the device takes
    this instead of the ``regions x blocks`` expanded ids (``post_write_grid``, optional)."""

    starts: np.ndarray
    """int32 ``(regions, 1)``: the descriptor id of each region's block 0."""
    blocks: np.ndarray
    """int32 ``(blocks,)``: the block ids, checked against every region's capacity."""

    def __len__(self) -> int:
        return len(self.starts) * len(self.blocks)

    def ids(self) -> np.ndarray:
        """The expanded int32 ids (what :func:`descriptor_ids` returns)."""
        return np.add(self.starts, self.blocks).reshape(-1)


def descriptor_id_grid(
    regions: Sequence[KVRegion], groups: Sequence[int], block_ids: BlockIds, *, per_token: bool = True
) -> IdGrid | None:
    """:func:`descriptor_ids` as an :class:`IdGrid` when every region has one row per block
    and all are in one KV group; None otherwise (use :func:`descriptor_ids`). Raises
    ``ConfigError`` for a block id beyond a region's capacity, as it does."""
    table = _region_table(regions, per_token)
    top, single = _group_span(groups)
    if top >= len(block_ids):
        raise ConfigError(
            f"regions use KV-cache group {top} but block ids were given for {len(block_ids)} group(s)"
        )
    if not (table.one_row and single):
        return None
    seq = block_ids[top]
    if len(seq) <= 256 and type(seq) is tuple:  # builtins beat numpy's reductions here
        if seq and (max(seq) >= table.min_capacity or min(seq) < 0):
            _check_capacity(np.asarray(seq, dtype=np.int64), table.min_capacity, top)
        ids = np.array(seq, dtype=np.int32)  # in range: below a capacity that fits int32
    else:
        wide = np.asarray(seq, dtype=np.int64)
        _check_capacity(wide, table.min_capacity, top)
        ids = wide.astype(np.int32)
    return IdGrid(table.column32, ids)


_GROUP_SPANS: dict[int, tuple[Sequence[int], int, bool]] = {}


def _group_span(groups: Sequence[int]) -> tuple[int, bool]:
    """``(highest group, whether there is one group)`` of a region-group list, remembered per
    tuple object (a worker passes the same tuple on every request; a per-request ``max`` and
    ``min`` over 160 regions costs more than the rest of the grid)."""
    hit = _GROUP_SPANS.get(id(groups))
    if hit is not None and hit[0] is groups:
        return hit[1], hit[2]
    top = max(groups, default=-1)
    single = bool(groups) and min(groups) == top
    if isinstance(groups, tuple):  # immutable: safe to remember (held, so its id stays its own)
        if len(_GROUP_SPANS) >= 256:
            _GROUP_SPANS.clear()
        _GROUP_SPANS[id(groups)] = (groups, top, single)
    return top, single


class _Table(NamedTuple):
    regions: Sequence[KVRegion]
    offsets: np.ndarray
    capacities: np.ndarray
    column32: np.ndarray
    """``offsets`` as an int32 (n, 1) column, for the broadcast."""
    rows: tuple[int, ...]
    one_row: bool
    """Every region one row per block (the broadcast path)."""
    min_capacity: int


_TABLES: dict[tuple[Any, ...], _Table] = {}
_TABLES_MAX = 256


def _region_table(regions: Sequence[KVRegion], per_token: bool) -> _Table:
    """Offsets, capacities and rows of a region list, cached per list object (a worker passes
    the same tuple on every request) and per list of region objects (a per-request call
    otherwise rebuilds them: ~25 µs for 32 regions, ~150 µs for 160)."""
    hit = _TABLES.get((per_token, id(regions)))
    if hit is not None and hit.regions is regions:
        return hit
    key = (per_token, *map(id, regions))
    hit = _TABLES.get(key)
    if hit is not None and all(a is b for a, b in zip(hit.regions, regions)):
        return hit
    offsets = region_offsets(regions, per_token=per_token)
    capacities = np.fromiter((r.num_blocks for r in regions), dtype=np.int64, count=len(regions))
    rows = tuple(_rows(r, per_token) for r in regions)
    last = int(offsets[-1] + capacities[-1] * rows[-1]) if len(offsets) else 0
    if last > np.iinfo(np.int32).max:
        raise ConfigError(f"{last} descriptors do not fit int32 ids")
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.clear()
    column32 = offsets.astype(np.int32)[:, None]
    column32.flags.writeable = False  # shared by every IdGrid of this table: nobody may change it
    table = _Table(
        regions=tuple(regions),
        offsets=offsets,
        capacities=capacities,
        column32=column32,
        rows=rows,
        one_row=all(n == 1 for n in rows),
        min_capacity=int(capacities.min(initial=np.iinfo(np.int64).max)),
    )
    _TABLES[key] = table
    if isinstance(regions, tuple):  # held by the entry, so its id is not reused meanwhile
        _TABLES[(per_token, id(regions))] = table._replace(regions=regions)
    return table


def _check_capacity(ids: np.ndarray, capacity: int, group: int) -> None:
    if len(ids) and (ids.max() >= capacity or ids.min() < 0):
        raise ConfigError(
            f"block id {int(ids.max())} of group {group} is outside the region's {int(capacity)} blocks"
        )


class HeldBlockIds(tuple):  # type: ignore[type-arg]
    """A prefill rank's block ids of a request (a tuple of per-group tuples, as :data:`BlockIds`)
    that name KV groups the rank holds no layer of (a PP stage of a hybrid model), with the
    groups it does hold (``held``). :meth:`RankWorker._check_blocks` hands these on, so that
    :func:`trim_for_prefix_hit` checks and trims only the held groups, whoever calls it."""

    held: frozenset[int]

    def __new__(cls, groups: BlockIds, held: frozenset[int]) -> HeldBlockIds:
        out = super().__new__(cls, groups)
        out.held = frozenset(held)
        return out

    def __reduce__(self) -> Any:
        return (HeldBlockIds, (tuple(self), self.held))


def trim_for_prefix_hit(
    producer: BlockIds, decode: BlockIds, request_id: str, held: Collection[int] | None = None
) -> BlockIds:
    """End-trim P's blocks to D's count per group.

    D registers only its uncached suffix, so P sends the *last* ``len(D)`` blocks of each
    group, never the first (trimming the front writes P's prefix into D's suffix slots).

    ``held``: the KV groups this P rank holds a layer of (default: ``producer.held`` for a
    :class:`HeldBlockIds`, else every group). A group it holds no layer of moves nothing from
    this rank (another PP stage writes it): its ids are neither checked against D's count nor
    used (``()``), whatever the engine handed this rank for it (a vLLM stage cuts a group it
    lacks at its scheduler block, D at its kernel block: fewer ids than D's). A held group
    with fewer ids than D registered is refused: D would count blocks P never writes.
    """
    if held is None:
        held = getattr(producer, "held", None)
    if len(producer) != len(decode):
        raise ConfigError(
            f"request {request_id!r}: P has {len(producer)} KV-cache groups, D registered {len(decode)}"
        )
    trimmed = []
    for group, (p_ids, d_ids) in enumerate(zip(producer, decode)):
        if held is not None and group not in held:
            trimmed.append(())  # no layer of it here: nothing of it moves from this rank
            continue
        if len(d_ids) > len(p_ids):
            raise ConfigError(
                f"request {request_id!r}: D registered {len(d_ids)} blocks in group {group} but "
                f"P computed only {len(p_ids)}"
            )
        trimmed.append(tuple(p_ids[len(p_ids) - len(d_ids) :]) if d_ids else ())
    if type(producer) is tuple and all(a is b or a == b for a, b in zip(trimmed, producer)):
        return producer  # nothing trimmed: the checked tuple itself (its checks are not redone)
    return tuple(trimmed)


class PromptBlocks(tuple):  # type: ignore[type-arg]
    """A prefill rank's block ids of a request (per-group tuples, as :data:`BlockIds`) with what
    P's engine stated about them: the groups this rank holds a layer of (``held``, None: all),
    where each group's ids start in the request's block sequence (``start``, None: at block 0)
    and the prompt's length (``num_tokens``, None: not stated). :func:`pair_blocks` reads them."""

    held: frozenset[int] | None
    start: tuple[int, ...] | None
    num_tokens: int | None

    def __new__(
        cls,
        groups: BlockIds,
        held: Collection[int] | None = None,
        start: tuple[int, ...] | None = None,
        num_tokens: int | None = None,
    ) -> PromptBlocks:
        out = super().__new__(cls, groups)
        out.held = None if held is None else frozenset(held)
        out.start, out.num_tokens = start, num_tokens
        return out

    def __reduce__(self) -> Any:
        return (PromptBlocks, (tuple(self), self.held, self.start, self.num_tokens))


def pair_blocks(
    producer: BlockIds,
    decode: BlockIds,
    request_id: str,
    *,
    decode_start: Sequence[int] | None = None,
    decode_tokens: int | None = None,
) -> BlockIds:
    """P's blocks that pair with D's registered ones, per group: D's ``i``-th block of group
    ``g`` receives P's block of index ``decode_start[g] + i`` in the request's block sequence
    (P's ids start at index ``producer.start[g]``, 0 unless P's engine stated otherwise).

    Never "from the end": with no ``decode_start`` (a D of an earlier release, or an engine
    that cannot tell), P pairs only a group where D registered as many blocks as P holds and
    P's start at block 0; fewer could be a prefix hit, a registration one block short or a
    block P holds past the prompt, and P refuses to guess. ``ConfigError`` (naming both sides'
    blocks) when D's blocks are not all within P's, or when both sides stated a prompt length
    and they differ: the request fails and nothing is written. Groups this rank holds no layer of move nothing
    (``()``), as in :func:`trim_for_prefix_hit`.
    """
    held = getattr(producer, "held", None)
    p_start = getattr(producer, "start", None)
    p_tokens = getattr(producer, "num_tokens", None)
    if len(producer) != len(decode):
        raise ConfigError(
            f"request {request_id!r}: P has {len(producer)} KV-cache groups, D registered {len(decode)}"
        )
    if decode_tokens is not None and p_tokens is not None and decode_tokens != p_tokens:
        raise ConfigError(
            f"request {request_id!r}: D expects a prompt of {decode_tokens} tokens, P prefilled "
            f"{p_tokens}: the two legs hold different prompts (or one counts wrong), so P writes "
            f"nothing into D's blocks"
        )
    if decode_start is not None and len(decode_start) != len(decode):
        raise ConfigError(
            f"request {request_id!r}: D stated {len(decode_start)} block starts for {len(decode)} KV groups"
        )
    paired = []
    for group, (p_ids, d_ids) in enumerate(zip(producer, decode)):
        if (held is not None and group not in held) or not d_ids:
            paired.append(())  # no layer of it here (another PP stage writes it), or nothing
            continue
        first = p_start[group] if p_start is not None else 0
        if decode_start is None:
            if len(d_ids) != len(p_ids):
                raise ConfigError(
                    f"request {request_id!r}: D registered {len(d_ids)} blocks in KV group {group} "
                    f"without stating where they start in the prompt, and "
                    f"{_holds(first, p_ids, p_tokens)}: a prefix hit on D, a registration short of "
                    f"the prompt's end and a block P holds past it look alike, so P writes nothing. "
                    f"D must state block_start (add_request_params(..., block_start=, num_tokens=); "
                    f"a D of this release does when its engine passes it)"
                )
            if first != 0:
                raise ConfigError(
                    f"request {request_id!r}: D registered {len(d_ids)} blocks in KV group {group} "
                    f"without stating where they start in the prompt, and {_holds(first, p_ids, p_tokens)} "
                    f"(P's engine stated block_start={first}): block for block would pair P's block "
                    f"{first} with D's block 0, so P writes nothing. D must state block_start"
                )
            paired.append(p_ids)
            continue
        at = decode_start[group]
        if at < first or at + len(d_ids) > first + len(p_ids):
            raise ConfigError(
                f"request {request_id!r}: D registered blocks {at} to {at + len(d_ids) - 1} of KV "
                f"group {group} ({len(d_ids)} blocks from block_start={at}"
                f"{f', a {decode_tokens}-token prompt' if decode_tokens is not None else ''}), but "
                f"{_holds(first, p_ids, p_tokens)}: P cannot fill them, so it writes nothing"
            )
        skip = at - first
        paired.append(p_ids if skip == 0 and len(d_ids) == len(p_ids) else p_ids[skip : skip + len(d_ids)])
    if type(producer) is tuple and all(a is b or a == b for a, b in zip(paired, producer)):
        return producer  # every block pairs: the checked tuple itself (its checks are not redone)
    return tuple(paired)


def _holds(first: int, ids: Sequence[int], tokens: int | None) -> str:
    """What P holds of a group, for an error: ``P holds blocks 0 to 2 (3 blocks)``."""
    prompt = f" of its {tokens}-token prompt" if tokens is not None else ""
    return f"P holds blocks {first} to {first + len(ids) - 1} ({len(ids)} blocks){prompt}"


def producer_ranks_for(decode_tp_rank: int, decode_tp: int, producer_tp: int) -> list[int]:
    """P TP ranks that write into one D rank (the inverse of the built-in TP mapping)."""
    if producer_tp <= decode_tp:
        if decode_tp % producer_tp:
            raise ConfigError(f"prefill TP {producer_tp} must divide decode TP {decode_tp}")
        return [decode_tp_rank // (decode_tp // producer_tp)]
    if producer_tp % decode_tp:
        raise ConfigError(f"decode TP {decode_tp} must divide prefill TP {producer_tp}")
    k = producer_tp // decode_tp
    return [decode_tp_rank * k + i for i in range(k)]
