"""TP mapping: which D ranks a P rank writes, and which head slice of each block.

A head slice is a part ``(index, count)`` of a block; where its bytes lie depends on the
region's in-block order (:mod:`kvpush.core.block_order`): one byte range for a heads-outer
(HND) block, one range per token for a tokens-outer (NHD) block. A region that declares no
order cannot be sliced, so heterogeneous TP over it fails here (and at handshake):

- P_TP == D_TP: rank r writes rank r, whole blocks.
- P_TP <  D_TP (k = D_TP // P_TP): rank r writes ranks r·k … r·k+k-1; D rank r·k+s gets
  local slice (s, k) into its whole block.
- P_TP >  D_TP (k = P_TP // D_TP): rank r writes rank r // k, its whole block into slot
  (r % k, k) of D's larger block; D waits for k notifications per stage.
"""

from __future__ import annotations

from kvpush.core.block_order import check_regions_sliceable
from kvpush.core.errors import ConfigError
from kvpush.core.markers import hookimpl
from kvpush.core.producers import tp_ratio  # one rule for plans and completion counts
from kvpush.core.types import KVRegion, PushJob, ReadSpec

_MIXED: dict[int, tuple[object, bool]] = {}
"""id(regions) -> (regions, whether replicated and head-split regions are mixed): the answer
for a worker's region tuple, which every request of that worker passes again."""


def _mixed(regions: tuple[KVRegion, ...]) -> bool:
    hit = _MIXED.get(id(regions))
    if hit is None or hit[0] is not regions:
        if len(_MIXED) >= 64:
            _MIXED.clear()
        replicated = [r.replicate for r in regions]
        hit = _MIXED[id(regions)] = (regions, any(replicated) and not all(replicated))
    return hit[1]


@hookimpl(trylast=True)
def kvpush_build_read_specs(job: PushJob) -> list[ReadSpec]:
    local = job.local.parallel
    if _mixed(job.local.regions):
        raise ConfigError(
            "a layout mixing replicated (MLA) and head-split regions is not supported by the "
            "built-in TP mapping"
        )
    k = tp_ratio(local.tp_size, job.decode_tp_size)
    what = f"P TP {local.tp_size} -> D TP {job.decode_tp_size} with layout {job.local.layout!r}"
    check_regions_sliceable(job.local.regions, k, what)
    common = {"local_block_ids": job.local_block_ids, "remote_block_ids": job.remote_block_ids}
    if local.tp_size == job.decode_tp_size:
        return [ReadSpec(dst_tp_rank=local.tp_rank, **common)]
    if local.tp_size < job.decode_tp_size:
        return [ReadSpec(dst_tp_rank=local.tp_rank * k + s, local_part=(s, k), **common) for s in range(k)]
    return [ReadSpec(dst_tp_rank=local.tp_rank // k, remote_part=(local.tp_rank % k, k), **common)]
