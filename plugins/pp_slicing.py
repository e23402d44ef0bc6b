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
    counts = Counter(r.layer_names for r in meta.regions)
    if any(len(names) != 1 for names in counts):
        return None
    values = set(counts.values())
    if len(values) != 1 or len(counts) != meta.parallel.num_local_layers:
        return None
    return values.pop()


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
    per_layer = regions_per_layer(local)
    if per_layer is None:
        return [
            f"prefill stage {local.rank} has a different number of KV regions per layer, so "
            f"offset PP slicing cannot pair them; use a layout that matches regions by meaning "
            f"(--layout hma)"
        ]
    end = per_layer * local.parallel.start_layer + len(local.regions)
    if end > len(peer.regions):
        return [
            f"prefill stage {local.rank} needs peer regions up to {end} (layers "
            f"{local.parallel.start_layer}-{local.parallel.end_layer - 1}) but the peer "
            f"advertises {len(peer.regions)}; is D running the same model?"
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
