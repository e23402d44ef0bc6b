"""The serve bench's plans and ideals: who writes which slice to whom, and the copies a
connector that needed nothing else would post.

:func:`targets` is kvpush's TP mapping (``plugins/tp_mapping.py``, ``plugins/mla_replication.py``)
restated: for one P rank, each D rank it writes and the head slices on both sides. A
:class:`SpanTable` holds one side's descriptors (``region_descriptors`` of a slice, row for row
with the peer's, as the planner cuts them) so a request's spans are two fancy indexes.

:class:`KernelIdeal` (CUDA only) is the one-kernel scattered -> scattered copy of a request, in
P's process, into a second allocation on D's device (the bench's ``ceiling`` method): one
launch of :class:`kvpush.core.kernels.SpanCopier` over every (P rank, D rank) slice of the
request. Torch and Triton are imported on first use; on the CPU it refuses with a
``ConfigError`` naming the flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvpush.core.errors import ConfigError

Part = tuple[int, int]


def targets(tp_rank: int, prefill_tp: int, decode_tp: int, replicate: bool) -> list[tuple[int, Part, Part]]:
    """``(D rank, P's slice, D's slice)`` for every D rank P rank ``tp_rank`` writes."""
    from kvpush.core.producers import destinations, tp_ratio

    k = tp_ratio(prefill_tp, decode_tp)
    if replicate or prefill_tp == decode_tp:
        return [(d, (0, 1), (0, 1)) for d in destinations(tp_rank, prefill_tp, decode_tp)]
    if prefill_tp < decode_tp:
        return [(tp_rank * k + s, (s, k), (0, 1)) for s in range(k)]
    return [(tp_rank // k, (0, 1), (tp_rank % k, k))]


def align(local: Sequence[Any], peer: Sequence[Any]) -> list[Any]:
    """The peer's regions in the order of ``local`` (matched by layers, group and component)."""
    by_key = {(tuple(r.layer_names), r.kv_group, r.component): r for r in peer}
    out = []
    for region in local:
        key = (tuple(region.layer_names), region.kv_group, region.component)
        if key not in by_key:
            raise ConfigError(f"D has no region for {key} of P; the two sides describe different models")
        out.append(by_key[key])
    return out


class SpanTable:
    """Every row ``(addr, len)`` of slice ``part`` of every block of ``regions`` (descriptor order)."""

    def __init__(self, regions: Sequence[Any], part: Part, groups: Sequence[int]) -> None:
        from kvpush.core.planning import region_descriptors

        self.regions = list(regions)
        self.groups = list(groups)
        self.part = part
        self.table = region_descriptors(self.regions, part, per_token=True)

    def ids(self, block_ids: Sequence[Sequence[int]]) -> np.ndarray:
        from kvpush.core.planning import descriptor_ids

        return descriptor_ids(self.regions, self.groups, tuple(tuple(b) for b in block_ids), per_token=True)

    def spans(self, block_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        rows = self.table[self.ids(block_ids)]
        return rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)

    def bytes_per_block(self, num_groups: int) -> list[int]:
        """Bytes of this slice in one block of each group (summed over the regions)."""
        from kvpush.core.block_order import slice_rows

        out = [0] * num_groups
        for region, group in zip(self.regions, self.groups):
            cut = slice_rows(region, self.part, per_token=True)
            out[group] += cut.rows * cut.size
        return out


def require_cuda(device: str, what: str = "--ideal kernel") -> None:
    """Raise a ``ConfigError`` naming ``what`` unless ``device`` is a usable CUDA device."""
    if not str(device).startswith("cuda"):
        raise ConfigError(
            f"{what} is the one-kernel CUDA copy of each request and needs --device cuda "
            f"(got {device!r}); on the CPU use --ideal nixl"
        )
    from kvpush.core.kernels import triton_available

    if not triton_available():
        raise ConfigError(f"{what} needs a CUDA device and Triton (torch.cuda and triton import here)")


def enable_peer_access(a: str, b: str) -> None:
    """Let kernels on either device address the other's memory (a copy each way maps it)."""
    import torch

    if torch.device(a) != torch.device(b):
        torch.zeros(1, device=b).copy_(torch.zeros(1, device=a))
        torch.zeros(1, device=a).copy_(torch.zeros(1, device=b))


@attrs.define
class Spans:
    """A request's rows in the kernel ideal: ids into the concatenated P-side and copy-side
    descriptor tables. Their addresses (``src``, ``dst``, ``lengths``) are looked up only when
    needed (:meth:`KernelIdeal.addresses`: a check, or a launch without the id tables): for a
    Llama-70B TP8 request that is ~1-2 ms of random gathers, which the ideal must not pay at
    each arrival in the loop that stamps other requests' ends."""

    lids: np.ndarray
    rids: np.ndarray
    addrs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


class KernelIdeal:
    """One kernel launch per request from P's blocks into a copy allocation on D's device.

    ``pairs`` lists, per D rank P writes, ``(P's SpanTable, the copy's SpanTable)``: the copy's
    regions are a second allocation shaped as that D rank's caches (aligned to P's regions).
    Both sides' descriptor tables go to the GPU once (:class:`kvpush.core.kernels.DeviceTable`),
    so a request uploads only its row ids and the kernel resolves addresses
    (``launch_indirect``, as kvpush's ``cuda_ipc`` posts do); rows of unequal length or
    unaligned fall back to uploading addresses (``launch``).
    """

    def __init__(self, device: str, pairs: Sequence[tuple[SpanTable, SpanTable]]) -> None:
        require_cuda(device)
        import torch

        from kvpush.core.kernels import DeviceTable, copier_for

        self.device = torch.device(device)
        self.pairs = list(pairs)
        self.copier = copier_for(self.device)
        self.local = np.concatenate([local.table for local, _ in self.pairs]).astype(np.int64)
        self.remote = np.concatenate([copy.table for _, copy in self.pairs]).astype(np.int64)
        self.local_offsets = np.cumsum([0] + [len(local.table) for local, _ in self.pairs])[:-1]
        self.remote_offsets = np.cumsum([0] + [len(copy.table) for _, copy in self.pairs])[:-1]
        self.ltab = DeviceTable(self.local[:, 0], self.local[:, 1], self.device)
        self.rtab = DeviceTable(self.remote[:, 0], self.remote[:, 1], self.device)
        self.indirect = self.ltab.usable and self.rtab.usable and self.ltab.length == self.rtab.length
        if max(len(self.local), len(self.remote)) >= 1 << 31:
            self.indirect = False  # ids are int32
        self._check: Any = None

    def spans(self, p_ids: Sequence[Sequence[int]], d_ids: Sequence[Sequence[int]]) -> Spans:
        """The whole request's row ids (computed before its finish)."""
        lids, rids = [], []
        for (local, copy), lo, ro in zip(self.pairs, self.local_offsets, self.remote_offsets):
            lids.append(local.ids(p_ids).astype(np.int64) + lo)
            rids.append(copy.ids(d_ids).astype(np.int64) + ro)
        li, ri = np.concatenate(lids), np.concatenate(rids)
        if len(li) != len(ri):
            raise ConfigError("kernel ideal: P's and D's row counts differ (slices do not pair)")
        return Spans(lids=li.astype(np.int32), rids=ri.astype(np.int32))

    def addresses(self, spans: Spans) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, lengths)`` of the request's rows (looked up once, then kept)."""
        if spans.addrs is None:
            li, ri = spans.lids.astype(np.int64), spans.rids.astype(np.int64)
            lengths = self.local[li, 1]
            if not np.array_equal(lengths, self.remote[ri, 1]):
                raise ConfigError("kernel ideal: P's and D's rows differ in length (slices do not pair)")
            spans.addrs = (self.local[li, 0], self.remote[ri, 0], lengths)
        return spans.addrs

    def launch(self, spans: Spans) -> Any:
        """Enqueue the copy; returns the CUDA event recorded after it (``.query()`` to poll).
        With the id tables (equal, aligned rows: their lengths were checked when the tables
        were built) only the ids go up; otherwise the rows' addresses."""
        if self.indirect:
            return self.copier.launch_indirect(self.ltab, self.rtab, spans.lids, spans.rids)
        return self.copier.launch(*self.addresses(spans))

    def check(self, spans: Spans) -> bool:
        """True when every destination row holds its source row's bytes (both gathered into
        contiguous buffers by the same copier, then compared)."""
        import torch

        src, dst, lengths = self.addresses(spans)
        total = int(lengths.sum())
        if self._check is None or self._check.numel() < 2 * total:
            self._check = torch.empty(2 * total, dtype=torch.uint8, device=self.device)
        buffer = self._check
        offsets = buffer.data_ptr() + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        self.copier.copy(src, offsets, lengths)
        self.copier.copy(dst, offsets + total, lengths)
        return bool(torch.equal(buffer[:total], buffer[total : 2 * total]))


__all__ = ["KernelIdeal", "SpanTable", "Spans", "align", "enable_peer_access", "require_cuda", "targets"]
