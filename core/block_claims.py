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
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

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
    """The blocks each request in progress holds on one D rank, per id space.

    Each id space keeps an array of owners (one slot per unit, 0 when free), so a claim or a
    release costs one conversion of the ids and a few vectorised index operations, whatever
    else is held."""

    def __init__(self, spaces: Sequence[GroupSpace] = ()) -> None:
        self._spaces = tuple(spaces)
        self._owner: dict[int, np.ndarray] = {}
        """Id space -> owner slot of each unit (0: free)."""
        self._held: dict[str, tuple[int, list[tuple[int, np.ndarray]]]] = {}
        """Request -> (its slot, its (space, units) pairs)."""
        self._names: dict[int, str] = {}
        """Slot -> request."""
        self._free_slots: list[int] = []
        self._next_slot = 1

    @classmethod
    def for_regions(cls, regions: Sequence[KVRegion]) -> BlockClaims:
        return cls(group_spaces(regions))

    def _space(self, group: int) -> GroupSpace:
        if group < len(self._spaces):
            return self._spaces[group]
        return GroupSpace(len(self._spaces) + group)  # unknown: a space of its own

    def _units(self, space: GroupSpace, ids: Sequence[int]) -> np.ndarray:
        units = np.fromiter(ids, np.int64, len(ids))
        if space.units != 1:
            r = space.units
            units = (units[:, None] * r + np.arange(r)).reshape(-1)
        return units

    def _owners(self, space: int, units: np.ndarray) -> np.ndarray:
        owner = self._owner.get(space)
        top = int(units.max()) + 1
        if owner is None or owner.size < top:
            grown = np.zeros(max(top, 2 * (0 if owner is None else owner.size), 64), np.int32)
            if owner is not None:
                grown[: owner.size] = owner
            owner = self._owner[space] = grown
        return owner

    def claim(self, request_id: str, block_ids: BlockIds) -> None:
        """Claim ``block_ids`` (normalised, no repeats within a group) for ``request_id``.

        Raises ``ConfigError`` naming the overlapping block ids and the requests holding them,
        and claims nothing, when any is held by another request or named twice (two KV groups
        sharing memory), or when ``request_id`` holds blocks already."""
        if request_id in self._held:
            raise ConfigError(f"request {request_id!r} already holds blocks on this D rank")
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        taken: list[tuple[int, np.ndarray]] = []
        error = ""
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            space = self._space(group)
            units = self._units(space, ids)
            owner = self._owners(space.space, units)
            got = owner[units]
            if got.any():
                if (got == slot).any():
                    error = (
                        f"block_ids of {request_id!r} name the same memory in two KV groups "
                        f"({[list(g)[:8] for g in block_ids]}); those groups share one block pool"
                    )
                else:
                    error = "conflict"
                break
            owner[units] = slot
            taken.append((space.space, units))
        if error:
            for space_index, units in taken:
                self._owner[space_index][units] = 0
            self._free_slots.append(slot)
            raise ConfigError(self._conflict(request_id, block_ids) if error == "conflict" else error)
        self._held[request_id] = (slot, taken)
        self._names[slot] = request_id

    def release(self, request_id: str) -> None:
        """Give back ``request_id``'s blocks (done or released); unknown ids are ignored."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        slot, taken = held
        for space, units in taken:
            self._owner[space][units] = 0
        del self._names[slot]
        self._free_slots.append(slot)

    def clear(self) -> None:
        for owner in self._owner.values():
            owner.fill(0)
        self._held.clear()
        self._names.clear()
        self._free_slots.clear()
        self._next_slot = 1

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        """How many requests hold blocks."""
        return len(self._held)

    @property
    def claimed_units(self) -> Mapping[int, frozenset[int]]:
        """Id space -> claimed units (a snapshot, for tests)."""
        out = {}
        for space, owner in self._owner.items():
            units = np.flatnonzero(owner)
            if units.size:
                out[space] = frozenset(int(u) for u in units)
        return out

    def holders(self, block_ids: BlockIds) -> dict[str, list[tuple[int, list[int]]]]:
        """Request -> ``(group, block ids)`` of ``block_ids`` that request holds."""
        out: dict[str, list[tuple[int, list[int]]]] = {}
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            space = self._space(group)
            owner = self._owner.get(space.space)
            if owner is None:
                continue
            r = space.units
            hits: dict[int, list[int]] = {}
            for block in ids:
                slots = owner[block * r : block * r + r]
                for slot in {int(s) for s in slots if s}:
                    hits.setdefault(slot, []).append(block)
            for slot, blocks in hits.items():
                out.setdefault(self._names[slot], []).append((group, blocks))
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
