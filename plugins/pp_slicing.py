"""PP slicing: a prefill stage pairs its regions with its own window of D's full-model list.

D (never pipeline-parallel) advertises the regions of every layer in model order; a P stage
owning layers ``[start, end)`` pairs its ``n`` local regions with D's regions
``[regions_per_layer × start, regions_per_layer × start + n)``. That needs the same number of
regions for every layer; layouts that match regions by meaning (HMA) publish
``region_matching = "semantic"`` and are left to their own plugin.
"""

from __future__ import annotations

from collections import Counter

from kvpush.core.markers import hookimpl
from kvpush.core.types import AgentMetadata, HandshakeMode, RegionAlignment


def regions_per_layer(meta: AgentMetadata) -> int | None:
    """Regions each layer has, or None when layers differ (or a region spans layers)."""
    return None if _why_not_sliceable(meta) else len(meta.regions) // meta.parallel.num_local_layers


def _why_not_sliceable(meta: AgentMetadata) -> str | None:
    """Which rule of offset slicing the rank's regions break, in terms of its regions; None if none."""
    spanning = [(i, r.layer_names) for i, r in enumerate(meta.regions) if len(r.layer_names) != 1]
    if spanning:
        index, names = spanning[0]
        return (
            f"region {index} names {len(names)} layers {list(names)}; offset slicing needs each "
            f"region to name exactly one model layer"
        )
    counts = Counter(r.layer_names[0] for r in meta.regions)
    owned = meta.parallel.num_local_layers
    if len(counts) != owned:
        sample = ", ".join(repr(n) for n in list(counts)[:4])
        return (
            f"its regions name {len(counts)} distinct layers ({sample}, ...) but the stage owns "
            f"{owned}; layer_names must be the model layer's name, shared by K and V of that "
            f"layer (one distinct name per layer)"
        )
    if len(set(counts.values())) != 1:
        shown = ", ".join(f"{name!r}: {n}" for name, n in list(counts.items())[:6])
        return (
            f"its layers have different numbers of regions ({shown}); offset slicing needs the "
            f"same number of regions for every layer"
        )
    return None


def _applies(local: AgentMetadata, peer: AgentMetadata) -> bool:
    return (
        local.parallel.pp_size > 1
        and local.extensions.get("region_matching") != "semantic"
        and len(peer.regions) > len(local.regions)
    )


@hookimpl
def kvpush_validate_peer(local: AgentMetadata, peer: AgentMetadata, mode: HandshakeMode) -> list[str]:
    if mode is not HandshakeMode.FULL or not _applies(local, peer):
        return []
    broken = _why_not_sliceable(local)
    if broken is not None:
        return [
            f"prefill stage {local.rank} (layers {local.parallel.start_layer}-"
            f"{local.parallel.end_layer - 1}) cannot be paired by offset PP slicing, which maps "
            f"its regions onto the decode side's regions [regions_per_layer × start_layer, ...) "
            f"by position: {broken}. Fix the layout's regions, or use a layout that matches "
            f"regions by meaning (publishes region_matching='semantic', like 'hma')"
        ]
    per_layer = len(local.regions) // local.parallel.num_local_layers
    end = per_layer * local.parallel.start_layer + len(local.regions)
    if end > len(peer.regions):
        return [
            f"prefill stage {local.rank} needs peer regions up to {end} (layers "
            f"{local.parallel.start_layer}-{local.parallel.end_layer - 1}) but the peer "
            f"advertises {len(peer.regions)} ({per_layer} per layer × layers "
            f"{local.parallel.start_layer}-{local.parallel.end_layer - 1} must lie inside its "
            f"list); does the decode engine run the same model and layout?"
        ]
    offset = per_layer * local.parallel.start_layer
    for i, mine in enumerate(local.regions):
        theirs = peer.regions[offset + i]
        if (mine.layer_names, mine.component) != (theirs.layer_names, theirs.component):
            return [
                f"offset PP slicing pairs prefill stage {local.rank}'s region {i} ({mine.layer_names[0]} "
                f"{mine.component}) with the peer's region {offset + i} ({', '.join(theirs.layer_names)} "
                f"{theirs.component}); both sides must list regions in the same order (region "
                f"order rule: layer by layer in model order, the same components per layer)"
            ]
    return []


@hookimpl
def kvpush_align_regions(local: AgentMetadata, peer: AgentMetadata) -> RegionAlignment | None:
    if not _applies(local, peer):
        return None
    per_layer = regions_per_layer(local)
    if per_layer is None:
        return None
    offset = per_layer * local.parallel.start_layer
    return RegionAlignment(remote_indices=range(offset, offset + len(local.regions)))
