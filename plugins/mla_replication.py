"""MLA replication: the latent KV is replicated on every D TP rank, so P writes it to each.

A P rank writes the whole latent block to every D rank it maps to (D ranks r·k … r·k+k-1 when
D_TP >= P_TP). Each D rank gets a real WRITE with its own completion notification — never a
bare notification. When P_TP > D_TP, the k P ranks of one D rank all write the same latent
(consistent with D expecting k notifications per stage).
"""

from __future__ import annotations

from kvpush.core.markers import hookimpl
from kvpush.core.types import PushJob, ReadSpec
from kvpush.plugins.tp_mapping import tp_ratio


@hookimpl(tryfirst=True)
def kvpush_build_read_specs(job: PushJob) -> list[ReadSpec] | None:
    regions = job.local.regions
    if not regions or not all(r.replicate for r in regions):
        return None
    local = job.local.parallel
    k = tp_ratio(local.tp_size, job.decode_tp_size)
    if local.tp_size >= job.decode_tp_size:
        targets = [local.tp_rank // k]
    else:
        targets = [local.tp_rank * k + s for s in range(k)]
    return [
        ReadSpec(
            dst_tp_rank=dst,
            local_block_ids=job.local_block_ids,
            remote_block_ids=job.remote_block_ids,
        )
        for dst in targets
    ]
