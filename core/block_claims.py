"""Which request holds which of a D rank's blocks: a request whose blocks overlap another's is refused.

A D rank claims a request's blocks when the engine adds it and gives them back when the request
is done (the engine owns them from then) or released (failed or cancelled, and no WRITE can land
any more). A request that names a block still claimed would share it with a request P may still
write: one of them would get the other's KV with no error. :meth:`BlockClaims.claim` refuses it.

Block ids are per KV group. Groups whose regions overlay the same bytes (vLLM's hybrid allocator:
every group's layers view one tensor) share one id space, measured in *units* (the gcd of their
block strides), so block ``b`` of a group ``r`` units wide covers units ``b*r .. b*r+r-1``; groups
on memory of their own have an id space each (:func:`group_spaces`). Pure: no I/O, no locks (the
receiver holds its results lock around every call).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from kvpush.core.errors import ConfigError
from kvpush.core.types import BlockIds, KVRegion

logger = logging.getLogger(__name__)


@attrs.frozen
class GroupSpace:
    """Where a KV group's block ids live: id space ``space``, ``units`` units per block."""

    space: int
    units: int = 1


def group_spaces(regions: Sequence[KVRegion]) -> tuple[GroupSpace, ...]:
    """Each KV group's id space, from the rank's regions.

    Two groups share a space when a region of one overlaps a region of the other in memory
    (same memory kind and device). Such groups are expected to view one tensor from its start
    (vLLM); a block of stride ``s`` is then ``s / gcd`` units wide. Anything else (overlap at
    another address, several strides in one group) is logged and the groups share ids one to
    one."""
    groups = sorted({r.kv_group for r in regions})
    parent = {g: g for g in groups}
    exact = True

    def root(g: int) -> int:
        while parent[g] != g:
            g = parent[g]
        return g

    spans = sorted(
        (
            (r.mem_type, r.device_id, r.base_addr, r.base_addr + r.block_stride * r.num_blocks, r)
            for r in regions
        ),
        key=lambda s: s[:3],
    )
    for i, (kind, device, start, end, region) in enumerate(spans):
        for other_kind, other_device, other_start, _end, other in spans[i + 1 :]:
            if (other_kind, other_device) != (kind, device) or other_start >= end:
                break
            if other.kv_group != region.kv_group:
                exact = exact and other_start == start
                parent[root(other.kv_group)] = root(region.kv_group)
    strides: dict[int, set[int]] = {}
    for region in regions:
        strides.setdefault(region.kv_group, set()).add(region.block_stride)
    members: dict[int, list[int]] = {}
    for group in groups:
        members.setdefault(root(group), []).append(group)
    exact = exact and all(len(s) == 1 for s in strides.values())
    if not exact:
        logger.warning(
            "KV groups %s overlap in memory other than as views of one tensor from its start; "
            "their block ids are taken to name the same blocks one to one",
            [m for m in members.values() if len(m) > 1],
        )
    index = {space: n for n, space in enumerate(sorted(members))}
    out = []
    for group in range(max(groups, default=-1) + 1):
        if group not in parent:
            out.append(GroupSpace(len(index) + group))  # no region: a space of its own
            continue
        space = root(group)
        units = 1
        if exact and len(members[space]) > 1:
            unit = math.gcd(*(s for g in members[space] for s in strides[g]))
            units = next(iter(strides[group])) // unit
        out.append(GroupSpace(index[space], units))
    return tuple(out)


class BlockClaims:
    """The blocks each request in progress holds on one D rank, per id space."""

    def __init__(self, spaces: Sequence[GroupSpace] = ()) -> None:
        self._spaces = tuple(spaces)
        self._claimed: dict[int, set[int]] = {}
        """Id space -> claimed ids (units) in it."""
        self._held: dict[str, list[tuple[int, Iterable[int]]]] = {}
        """Request -> its (space, ids) pairs, for :meth:`release` and the error message."""

    @classmethod
    def for_regions(cls, regions: Sequence[KVRegion]) -> BlockClaims:
        return cls(group_spaces(regions))

    def _space(self, group: int) -> GroupSpace:
        return self._spaces[group] if group < len(self._spaces) else GroupSpace(len(self._spaces) + group)

    def _units(self, block_ids: BlockIds) -> list[tuple[int, Iterable[int]]]:
        out = []
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            space = self._space(group)
            if space.units == 1:
                out.append((space.space, ids))
            else:
                r = space.units
                out.append((space.space, [u for b in ids for u in range(b * r, b * r + r)]))
        return out

    def claim(self, request_id: str, block_ids: BlockIds) -> None:
        """Claim ``block_ids`` (normalised, no repeats within a group) for ``request_id``.

        Raises ``ConfigError`` naming the overlapping block ids and the requests holding them,
        and claims nothing, when any is held by another request (or by this one, added twice)."""
        units = self._units(block_ids)
        claimed = self._claimed
        for space, ids in units:
            held = claimed.get(space)
            if held and not held.isdisjoint(ids):
                raise ConfigError(self._conflict(request_id, block_ids))
        if len({space for space, _ in units}) < len(units):  # two groups share a space
            per_space: dict[int, list[int]] = {}
            for space, ids in units:
                per_space.setdefault(space, []).extend(ids)
            if any(len(set(ids)) != len(ids) for ids in per_space.values()):
                raise ConfigError(
                    f"block_ids of {request_id!r} name the same memory in two KV groups "
                    f"({[list(g)[:8] for g in block_ids]}); those groups share one block pool"
                )
        for space, ids in units:
            claimed.setdefault(space, set()).update(ids)
        self._held[request_id] = units

    def release(self, request_id: str) -> None:
        """Give back ``request_id``'s blocks (done or released); unknown ids are ignored."""
        units = self._held.pop(request_id, None)
        if units is None:
            return
        for space, ids in units:
            self._claimed[space].difference_update(ids)

    def clear(self) -> None:
        self._claimed.clear()
        self._held.clear()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        """How many requests hold blocks."""
        return len(self._held)

    @property
    def claimed_units(self) -> Mapping[int, frozenset[int]]:
        """Id space -> claimed units (a snapshot, for tests)."""
        return {space: frozenset(ids) for space, ids in self._claimed.items() if ids}

    def holders(self, block_ids: BlockIds) -> dict[str, list[tuple[int, list[int]]]]:
        """Request -> ``(group, block ids)`` of ``block_ids`` that request holds."""
        out: dict[str, list[tuple[int, list[int]]]] = {}
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            space = self._space(group)
            r = space.units
            for holder, units in self._held.items():
                theirs = set().union(*(set(u) for s, u in units if s == space.space))
                hit = [b for b in ids if not theirs.isdisjoint(range(b * r, b * r + r))]
                if hit:
                    out.setdefault(holder, []).append((group, hit))
        return out

    def _conflict(self, request_id: str, block_ids: BlockIds) -> str:
        held = self.holders(block_ids)
        parts = [
            f"group {g} block ids {ids[:16]} held by {holder!r}"
            for holder, hits in list(held.items())[:4]
            for g, ids in hits
        ]
        names = ", ".join(repr(h) for h in list(held)[:4])
        return (
            f"block_ids of {request_id!r} overlap blocks this D rank still holds for another "
            f"request: {'; '.join(parts)}. A WRITE for {names} may still land in them: add "
            f"{request_id!r} with other blocks, or only once get_finished() reports {names} done "
            f"or released"
        )
