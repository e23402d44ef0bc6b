"""Plugins a third-party author could plausibly write, for tests/test_plugin_author_probe.py.

Rank processes of ``kvpush.testing.run_cluster`` import them by path, so they live in a module
of their own (no tests here)."""

from __future__ import annotations

from kvpush import hookimpl
from kvpush.core.types import PushJob, ReadSpec


class SwappedBlockIds:
    """A read-spec plugin (equal TP) that mixes up the job's two block-id lists: P's blocks are
    read at D's ids and written at P's ids."""

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> list[ReadSpec] | None:
        if job.local.parallel.tp_size != job.decode_tp_size:
            return None
        return [
            ReadSpec(
                dst_tp_rank=job.local.parallel.tp_rank,
                local_block_ids=job.remote_block_ids,
                remote_block_ids=job.local_block_ids,
            )
        ]


swapped_block_ids = SwappedBlockIds()
