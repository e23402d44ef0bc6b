"""Transfer strategy: ``direct`` (one descriptor per block) or ``packed`` (gather, one WRITE,
scatter) for one (request, destination), from the request's shape.

Cost model, from ``kvpush bench`` on the 2-vCPU CPU box (see docs/performance.md):

- adjacent blocks merge into one descriptor per run (NIXL ``make_prepped_xfer`` merges
  neighbours), so what counts is descriptors *after* merging and bytes per merged descriptor;
- in DRAM, a scattered descriptor costs a CMA syscall (~4-7 µs) while the packed path pays two
  extra memory copies (gather on P, scatter on D, each ~5-10 GB/s here); packing wins while
  the merged descriptors are small (``DRAM_PACK_MAX_BYTES``) and numerous
  (``DRAM_PACK_MIN_DESCRIPTORS``);
- in VRAM a non-adjacent descriptor costs ~9 µs on cuda_ipc while packing costs a fixed
  ~1.25 ms more per request plus ~11 ps per byte (gather and scatter at device speed), fitted
  to ``kvpush bench --device cuda`` on an H200 (docs/performance.md): packed wins when
  ``descriptors × 9.3 µs > 1.25 ms + bytes × 11 ps`` — scattered tables from ~150 descriptors
  on, never the merged one-descriptor-per-region contiguous case.

:class:`ForcedStrategy` pins one strategy (``--strategy`` on ``kvpush demo``/``bench``).
"""

from __future__ import annotations

import numpy as np

from kvpush.core.block_order import token_rows
from kvpush.core.markers import hookimpl
from kvpush.core.packing import STAGING_KEY
from kvpush.core.types import PushJob, ReadSpec

DRAM_PACK_MAX_BYTES = 8 * 1024
"""Measured: scattered 4 KiB blocks gain from packing at 512 blocks x 32 regions; 32 KiB blocks
lose at every count (CMA moves 32 KiB descriptors at 4-6 GB/s, packing copies 3 times)."""
DRAM_PACK_MIN_DESCRIPTORS = 4096
"""Measured with int64-row packing (18:31 UTC run in docs/performance.md): 4 KiB x 16,384
descriptors packed ~1.2x direct; x 4,096 1.0-1.2x; x 512 ~0.75x."""
VRAM_DESCRIPTOR_S = 9.3e-6
"""H200, 4 KiB scattered blocks: 32 MiB as 8192 descriptors took 76 ms by raw NIXL."""
VRAM_PACKED_FIXED_S = 1.25e-3
VRAM_PACKED_S_PER_BYTE = 11e-12


def merged_descriptors(spec: ReadSpec, job: PushJob) -> tuple[int, int]:
    """``(descriptors after merging adjacent blocks, bytes)`` of a direct transfer."""
    runs_per_group = []
    for local, remote in zip(spec.local_block_ids, spec.remote_block_ids):
        if not local:
            runs_per_group.append(0)
            continue
        lo = np.asarray(local, dtype=np.int64)
        ro = np.asarray(remote, dtype=np.int64)
        breaks = np.count_nonzero((np.diff(lo) != 1) | (np.diff(ro) != 1))
        runs_per_group.append(1 + int(breaks))
    descriptors = nbytes = 0
    sliced = spec.local_part[1] > 1 or spec.remote_part[1] > 1
    for region in job.local.regions:
        group = region.kv_group
        if group < len(runs_per_group):
            rows = token_rows(region) if sliced else 1  # a sliced tokens_outer block: a row per token
            descriptors += runs_per_group[group] if rows == 1 else rows * len(spec.local_block_ids[group])
            nbytes += region.block_len // spec.local_part[1] * len(spec.local_block_ids[group])
    return descriptors, nbytes


def choose(job: PushJob, spec: ReadSpec) -> str:
    """The built-in rule (see the module docstring)."""
    if STAGING_KEY not in job.local.extensions:
        return "direct"
    descriptors, nbytes = merged_descriptors(spec, job)
    if descriptors == 0:
        return "direct"
    if job.local.regions[0].mem_type == "VRAM":
        direct_extra = descriptors * VRAM_DESCRIPTOR_S
        packed_extra = VRAM_PACKED_FIXED_S + nbytes * VRAM_PACKED_S_PER_BYTE
        return "packed" if direct_extra > packed_extra else "direct"
    per_descriptor = nbytes / descriptors
    if descriptors >= DRAM_PACK_MIN_DESCRIPTORS and per_descriptor <= DRAM_PACK_MAX_BYTES:
        return "packed"
    return "direct"


@hookimpl
def kvpush_transfer_strategy(job: PushJob, spec: ReadSpec, num_descriptors: int) -> str | None:
    return choose(job, spec)


class ForcedStrategy:
    """A plugin that pins the strategy (``name``; None defers to the built-in rule).

    Register it with ``get_plugin_manager(plugins=[("forced_strategy", ForcedStrategy("packed"))])``.
    ``name`` may be changed between requests.
    """

    def __init__(self, name: str | None) -> None:
        self.name = name

    @hookimpl(tryfirst=True)
    def kvpush_transfer_strategy(self, job: PushJob, spec: ReadSpec, num_descriptors: int) -> str | None:
        return self.name
