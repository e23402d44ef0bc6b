"""Packed transfers: gather a request's scattered blocks into one registered staging buffer,
WRITE it as one (or a few) descriptors, scatter it into the blocks on D.

Measured on the 2-vCPU CPU box (16 layers x K/V, 512 scattered 4 KiB blocks, 64 MiB):

==========================================================  ========
formulation                                                 GB/s
==========================================================  ========
gather: one ``index_select`` over a strided view of all      6.3
regions ("universe" rows of ``gcd`` bytes)
gather: one ``index_select`` per layer over its (K|V, block)  4.2
gather: one ``index_select`` per region                      5.3
gather: ``numpy.take``                                        0.7
scatter: ``index_copy_`` on the universe view                0.7
scatter: ``index_put_`` per layer                             0.9
scatter: numpy fancy assignment on the universe view          3.7
==========================================================  ========

So on the CPU the gather is one ``torch.index_select`` over a view whose rows start every ``g``
bytes (``g`` = gcd of every block start, so each block is one row), and the scatter is one numpy
fancy assignment. On CUDA each is one Triton launch over every block of every region
(:mod:`kvpush.core.kernels`, on the writer's own stream, synchronised by events): 1.5-1.9 TB/s
of device time on an H200 for 32 KiB and 4 KiB blocks (see docs/performance.md).

Staging layout of one request on D (both sides compute it): D's regions in D's order, region
``j`` taking ``block_len_j x blocks(group_j)`` bytes; a producer that writes byte slice
``(index, count)`` of each block puts its ``blocks x block_len_j / count`` bytes at
``index x that`` inside region ``j``'s area. So one producer's bytes for consecutive regions
are adjacent and merge into one descriptor.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvpush.core.block_order import slice_rows
from kvpush.core.errors import ConfigError, TransferError, WireError
from kvpush.core.types import BlockIds, KVRegion, PackManifest, ReadSpec

logger = logging.getLogger(__name__)

STAGING_KEY = "kvpush.staging"
"""Metadata extension: ``{"addr": int, "len": int}`` of a rank's registered staging area."""
ALIGN = 256


# ------------------------------------------------------------------------------ pool


class StagingPool:
    """A first-fit byte allocator over one pre-touched staging tensor (thread-safe).

    ``alloc`` never blocks: it returns None when no free range is large enough, and the
    caller falls back to the direct strategy. ``free_later`` quarantines a range (e.g. of a
    failed request whose WRITE may still land) until a deadline.
    """

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        import torch

        if nbytes <= 0:
            raise ConfigError(f"staging pool size must be positive, got {nbytes}")
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # zeros: pre-touched
        self.addr = self.tensor.data_ptr()
        self.size = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._used: dict[int, int] = {}
        self._quarantine: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self.failed_allocs = 0

    def alloc(self, nbytes: int) -> int | None:
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            self._reclaim(time.monotonic())
            for i, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, length - need)
                    self._used[start] = need
                    return start
            self.failed_allocs += 1
            return None

    def free(self, offset: int) -> None:
        with self._lock:
            self._release(offset)

    def free_later(self, offset: int, delay_s: float) -> None:
        with self._lock:
            if offset in self._used:
                self._quarantine.append((time.monotonic() + delay_s, offset))

    def _reclaim(self, now: float) -> None:
        due = [item for item in self._quarantine if item[0] <= now]
        if due:
            self._quarantine = [item for item in self._quarantine if item[0] > now]
            for _, offset in due:
                self._release(offset)

    def _release(self, offset: int) -> None:
        length = self._used.pop(offset, None)
        if length is None:
            return
        self._free.append((offset, length))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged

    def reserved(self, offset: int) -> int | None:
        """Bytes of the live allocation that starts at ``offset`` (None: no allocation starts
        there; a range quarantined by ``free_later`` still counts until it is reclaimed)."""
        with self._lock:
            return self._used.get(offset)

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())


# ------------------------------------------------------------------------------ addresses


def block_addresses(
    regions: Sequence[KVRegion], block_ids: BlockIds, part: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """``(addr, size)`` uint64 arrays of the rows of byte slice ``part`` of every block,
    region-major: one row per block, or one per token for a sliced ``tokens_outer`` block."""
    addrs, sizes = [], []
    cuts = [slice_rows(r, part) for r in regions]
    bases = np.fromiter((r.base_addr for r in regions), dtype=np.uint64, count=len(regions))
    strides = np.fromiter((r.block_stride for r in regions), dtype=np.uint64, count=len(regions))
    size = np.fromiter((c.size for c in cuts), dtype=np.uint64, count=len(regions))
    first = np.fromiter((c.first for c in cuts), dtype=np.uint64, count=len(regions))
    groups = [r.kv_group for r in regions]
    if len(set(groups)) == 1 and regions and all(c.rows == 1 for c in cuts):
        ids = np.asarray(block_ids[groups[0]], dtype=np.uint64)
        out = bases[:, None] + strides[:, None] * ids[None, :] + first[:, None]
        return out.ravel(), np.repeat(size, len(ids))
    for i, region in enumerate(regions):
        ids = np.asarray(block_ids[region.kv_group], dtype=np.uint64)
        within = first[i] + np.arange(cuts[i].rows, dtype=np.uint64) * np.uint64(cuts[i].step)
        addrs.append((bases[i] + strides[i] * ids[:, None] + within[None, :]).ravel())
        sizes.append(np.full(len(ids) * cuts[i].rows, size[i], dtype=np.uint64))
    if not addrs:
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64)
    return np.concatenate(addrs), np.concatenate(sizes)


def staging_layout(regions: Sequence[KVRegion], block_ids: BlockIds) -> tuple[np.ndarray, int]:
    """Byte offset of each D region's area in a request's staging reservation, and the total."""
    lengths = np.fromiter(
        (r.block_len * len(block_ids[r.kv_group]) if r.kv_group < len(block_ids) else 0 for r in regions),
        dtype=np.int64,
        count=len(regions),
    )
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return offsets, int(lengths.sum())


class _RawView:
    """A ``__cuda_array_interface__`` over raw device memory, for ``torch.as_tensor``."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


def span_tensor(addr: int, nbytes: int, mem_type: str, device_id: int) -> Any:
    """A uint8 tensor over ``[addr, addr + nbytes)`` of memory this process already owns."""
    import torch

    if mem_type == "VRAM":
        return torch.as_tensor(_RawView(addr, nbytes), device=f"cuda:{device_id}")
    buffer = (ctypes.c_uint8 * nbytes).from_address(addr)
    return torch.frombuffer(buffer, dtype=torch.uint8)


_WIDE_TYPES = ((8, "int64"), (4, "int32"), (2, "int16"), (1, "uint8"))


@attrs.define
class BlockRows:
    """The blocks of a set of regions as rows of one strided view (one op per copy).

    Elements are as wide as the alignment of base, row step and row size allows (8 bytes for
    real KV layouts): copying rows of int64 runs several times faster than rows of bytes, on
    the GPU (one thread per element) and on the CPU alike.
    """

    view: Any
    """``(rows, size // width)`` tensor; row ``r`` starts at byte ``base + r * step``."""
    base: int
    step: int
    size: int
    width: int = 1
    """Bytes per element of ``view``."""
    _np: Any = None

    @classmethod
    def over(cls, regions: Sequence[KVRegion], part: tuple[int, int], size: int) -> BlockRows:
        import torch

        cuts = [slice_rows(r, part) for r in regions]
        starts = [r.base_addr + cut.first for r, cut in zip(regions, cuts)]
        base = min(starts)
        step = 0
        for region, start, cut in zip(regions, starts, cuts):
            step = math.gcd(step, region.block_stride, start - base, cut.step if cut.rows > 1 else 0)
        step = step or size
        end = max(r.end_addr for r in regions)
        rows = max(1, (end - size - base) // step + 1)
        width, dtype = next(
            (w, t) for w, t in _WIDE_TYPES if base % w == 0 and step % w == 0 and size % w == 0
        )
        span = span_tensor(base, (rows - 1) * step + size, regions[0].mem_type, regions[0].device_id)
        span = span.view(getattr(torch, dtype))
        view = span.as_strided((rows, size // width), (step // width, 1))
        return cls(view=view, base=base, step=step, size=size, width=width)

    def staging_rows(self, staging: Any, pos: int, n: int) -> Any:
        """``n`` rows of ``staging`` from byte ``pos``, in this view's element type."""
        chunk = staging[pos : pos + n * self.size]
        if self.width > 1:
            chunk = chunk.view(self.view.dtype)
        return chunk.view(n, self.size // self.width)

    def numpy(self) -> np.ndarray:
        if self._np is None:
            self._np = self.view.numpy()
        return self._np

    def rows(self, addrs: np.ndarray) -> np.ndarray:
        offsets = addrs.astype(np.int64) - self.base
        rows = offsets // self.step
        if len(rows) and (offsets % self.step).any():
            raise ConfigError("block addresses are not aligned to the row step; cannot pack")
        return rows


class Packer:
    """Gathers (P) or scatters (D) a rank's blocks against a staging tensor.

    Views are built per ``(part, size)`` once and cached; every copy is one op per run of
    equally sized descriptors (one op for uniform layouts).
    """

    def __init__(self, regions: Sequence[KVRegion]) -> None:
        self.regions = tuple(regions)
        self._views: dict[tuple[tuple[int, int], int], BlockRows] = {}

    def _rows(self, part: tuple[int, int], size: int) -> BlockRows:
        key = (part, size)
        view = self._views.get(key)
        if view is None:
            view = BlockRows.over(self.regions, part, size)
            self._views[key] = view
        return view

    def copy(
        self,
        staging: Any,
        offsets: Sequence[int],
        regions: Sequence[KVRegion],
        block_ids: BlockIds,
        part: tuple[int, int],
        *,
        gather: bool,
    ) -> int:
        """Gather (``gather=True``) the blocks of each region into ``staging`` at its offset
        (``offsets[i]`` for ``regions[i]``), or scatter them from there; returns the bytes.

        Regions whose areas follow one another with equal slice sizes share one op.
        ``regions`` must be a subset of this packer's regions.
        """
        import torch

        addrs, sizes = block_addresses(regions, block_ids, part)
        cuts = [slice_rows(r, part) for r in regions]
        counts = [len(block_ids[r.kv_group]) * cut.rows for r, cut in zip(regions, cuts)]
        if rows_on_cuda(staging):
            return self._copy_cuda(staging, offsets, counts, addrs, sizes, gather=gather)
        total = 0
        first = 0  # first descriptor of the current run
        run_start = run_len = 0
        run_size = -1
        cursor = 0
        runs: list[tuple[int, int, int, int]] = []  # (first desc, descs, staging offset, size)
        for cut, offset, count in zip(cuts, offsets, counts):
            size = cut.size
            if count and size == run_size and offset == run_start + run_len * size:
                run_len += count
            else:
                if run_len:
                    runs.append((first, run_len, run_start, run_size))
                first, run_start, run_len, run_size = cursor, int(offset), count, size
            cursor += count
        if run_len:
            runs.append((first, run_len, run_start, run_size))
        for lo, n, pos, size in runs:
            rows = self._rows(part, size)
            idx = rows.rows(addrs[lo : lo + n])
            if (staging.data_ptr() + pos) % rows.width:
                raise ConfigError(
                    f"staging byte {pos} is not {rows.width}-byte aligned like the KV blocks; "
                    f"staging allocations must be aligned to {ALIGN} bytes"
                )
            chunk = rows.staging_rows(staging, pos, n)
            if gather:
                index = torch.from_numpy(idx).to(rows.view.device, non_blocking=True)
                torch.index_select(rows.view, 0, index, out=chunk)
            elif rows.view.device.type == "cpu":
                rows.numpy()[idx] = chunk.numpy()
            else:
                index = torch.from_numpy(idx).to(rows.view.device, non_blocking=True)
                rows.view.index_copy_(0, index, chunk)
            total += n * size
        return total

    def _copy_cuda(
        self,
        staging: Any,
        offsets: Sequence[int],
        counts: Sequence[int],
        addrs: np.ndarray,
        sizes: np.ndarray,
        *,
        gather: bool,
    ) -> int:
        """CUDA: every block of every region in one kernel launch (``kernels.SpanCopier``) on
        this writer's own stream; waits for its event. The launch waits for no other stream:
        the caller makes sure the source bytes are written (the sender: the request's
        ``ready``), or the copy may read them before they are."""
        from kvpush.core.kernels import copier_for

        if not len(addrs):
            return 0
        count = np.asarray(counts, dtype=np.int64)
        blocks = addrs.astype(np.int64)
        lengths = sizes.astype(np.int64)
        first = np.repeat(np.cumsum(count) - count, count)
        within = np.arange(len(blocks), dtype=np.int64) - first
        stage = staging.data_ptr() + np.repeat(np.asarray(offsets, dtype=np.int64), count) + within * lengths
        end = int((stage + lengths).max()) - staging.data_ptr()
        if int(stage.min()) < staging.data_ptr() or end > staging.numel():
            raise ConfigError(f"packed bytes end at staging byte {end}, past its {staging.numel()} bytes")
        copier = copier_for(staging.device)
        if gather:
            return copier.copy(blocks, stage, lengths)
        return copier.copy(stage, blocks, lengths)


def rows_on_cuda(tensor: Any) -> bool:
    return getattr(tensor, "is_cuda", False)


def merge_pairs(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """Merge ``(local, remote, length)`` chunks that are adjacent on both sides."""
    out: list[tuple[int, int, int]] = []
    for lo, ro, n in zip(local.tolist(), remote.tolist(), lengths.tolist()):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((lo, ro, n))
    return out


CHUNK_BYTES = 4 << 20
"""DRAM: a destination's packed bytes go as WRITEs of about this size (at most ``MAX_CHUNKS``),
so D scatters chunk i while P gathers and writes chunk i+1 (P and D each keep a core busy)."""
MAX_CHUNKS = 8
VRAM_CHUNK_BYTES = 1 << 40
"""VRAM: chunk size of packed WRITEs; effectively one WRITE per destination. Measured on an
H200 (256 MiB of scattered 32 KiB blocks): 64 MiB chunks gave 58 GB/s and 32 MiB 37 GB/s against
94 GB/s unchunked, since each chunk pays its own synchronisations and notification. Measured
again with the one-launch gather/scatter (2026-11-30, ``kvpush bench --pipeline-mib 32``): 32
MiB chunks lost on every shape, 39 vs 71 GB/s at 256 MiB and 114 vs 162 at 1 GiB on one GPU."""


@attrs.define(eq=False)
class PackedGroup:
    """One destination's staging bytes on P, freed once every chunk's WRITE settled."""

    offset: int
    remaining: int


@attrs.define(eq=False)
class PackedWrite:
    """A posted packed WRITE (one chunk) and what to release once it settled."""

    handle: Any
    local_list: int
    remote_list: int
    group: PackedGroup


def chunk_regions(chunks: np.ndarray, mem_type: str) -> list[tuple[int, int]]:
    """Split consecutive regions into ``[lo, hi)`` runs of about ``CHUNK_BYTES``."""
    total = int(chunks.sum())
    size = VRAM_CHUNK_BYTES if mem_type == "VRAM" else CHUNK_BYTES
    count = max(1, min(MAX_CHUNKS, len(chunks), total // size))
    bounds = np.searchsorted(np.cumsum(chunks), [total * k / count for k in range(1, count)], side="left")
    edges = sorted({0, *[int(b) + 1 for b in bounds], len(chunks)})
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]


def staging_area(extensions: Any, what: str) -> dict[str, int] | None:
    """A peer's published staging area (``{"addr", "len", "dev"}``), checked: None when it
    publishes none; ``WireError`` naming the field when an address, length or device is not
    a plain int in range (a P must never compute WRITE targets from such values)."""
    staging = extensions.get(STAGING_KEY) if isinstance(extensions, Mapping) else None
    if staging is None:
        return None
    if not isinstance(staging, Mapping):
        raise WireError(
            f"{what}: metadata extension {STAGING_KEY!r} must be a map, got {str(staging)[:80]!r}"
        )
    fields = {"addr": staging.get("addr"), "len": staging.get("len"), "dev": staging.get("dev", 0)}
    lows = {"addr": 0, "len": 1, "dev": 0}
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or not lows[name] <= value < 1 << 64:
            raise WireError(
                f"{what}: metadata extension {STAGING_KEY!r} field {name!r} must be an int in "
                f"[{lows[name]}, 2**64), got {str(value)[:80]!r}"
            )
    if fields["addr"] + fields["len"] > 1 << 64:
        raise WireError(f"{what}: staging area {STAGING_KEY!r} ends past the 64-bit address space")
    return fields


def post_packed(
    *,
    transport: Any,
    pool: StagingPool,
    packer: Packer,
    local_regions: Sequence[KVRegion],
    peer_meta: Any,
    peer_agent: str,
    remote_indices: Sequence[int],
    decode_block_ids: BlockIds,
    decode_offset: int,
    spec: ReadSpec,
    encode_notif: Any,
    settle_timeout_s: float = 5.0,
) -> list[PackedWrite] | None:
    """Gather one destination's blocks into ``pool`` and WRITE them into D's reservation, in
    chunks (each with its own notification naming the regions it holds).

    Returns None (the caller goes direct) when D advertises no staging area, reserved none
    for this request, or this rank's pool has no room. Raises ``KvpushError`` when a WRITE
    cannot be posted, after the chunks already posted settled and everything was released.
    """
    staging = staging_area(peer_meta.extensions, f"D agent {peer_agent}")
    if staging is None or decode_offset < 0:
        return None
    d_regions = peer_meta.regions
    area, d_total = staging_layout(d_regions, decode_block_ids)
    index = spec.remote_part[0]
    lpart = spec.local_part
    sizes = np.array([r.block_len // lpart[1] for r in local_regions], dtype=np.int64)
    counts = np.array([len(spec.local_block_ids[r.kv_group]) for r in local_regions], dtype=np.int64)
    chunks = sizes * counts
    nbytes = int(chunks.sum())
    if nbytes == 0:
        return None
    targets = np.asarray(remote_indices, dtype=np.int64)
    remote = decode_offset + area[targets] + index * chunks
    if int((remote + chunks).max()) > decode_offset + d_total or decode_offset + d_total > staging["len"]:
        raise ConfigError(
            f"packed bytes for D regions {targets.tolist()} overflow D's reservation of {d_total} bytes"
        )
    offset = pool.alloc(nbytes)
    if offset is None:
        return None
    local = offset + np.concatenate(([0], np.cumsum(chunks)[:-1]))
    mem, dev = local_regions[0].mem_type, local_regions[0].device_id
    parts = chunk_regions(chunks, mem)
    group = PackedGroup(offset=offset, remaining=len(parts))
    posted: list[PackedWrite] = []
    lists: list[int] = []
    try:
        for number, (lo, hi) in enumerate(parts):
            regions = local_regions[lo:hi]
            packer.copy(pool.tensor, local[lo:hi].tolist(), regions, spec.local_block_ids, lpart, gather=True)
            merged = merge_pairs(local[lo:hi], remote[lo:hi], chunks[lo:hi])
            ldescs = np.array([(pool.addr + lo_, n, dev) for lo_, _, n in merged], dtype=np.uint64)
            rdev = staging.get("dev", 0)
            rdescs = np.array([(staging["addr"] + ro, n, rdev) for _, ro, n in merged], dtype=np.uint64)
            lists = [transport.prepare_local(ldescs, mem)]
            lists.append(transport.prepare_remote(peer_agent, rdescs, mem))
            ids = np.arange(len(merged), dtype=np.int32)
            manifest = PackManifest(
                staging_offset=decode_offset,
                regions=targets[lo:hi].tolist(),
                part=spec.remote_part,
                chunk=number,
                chunks=len(parts),
            )
            handle = transport.post_write(lists[0], ids, lists[1], ids, encode_notif(manifest))
            posted.append(PackedWrite(handle, lists[0], lists[1], group))
            lists = []
    except Exception as err:
        for handle_ in lists:
            transport.release_list(handle_)
        if posted and not _abortable(transport, posted):
            # Copies nothing takes back once launched (kernel copies): one may still run past
            # any settle timeout, reading this staging and writing D's. Released now, D (told
            # the push ended) would fence, which stops no such copy, and give its staging range
            # to the next request. The caller keeps them in flight instead, and fails the push
            # once they ended; the staging goes back with the last of them.
            group.remaining = len(posted)
            raise PackedPostFailed(
                f"{err} (after {len(posted)} chunk(s) of this packed WRITE were posted as copies "
                f"that cannot be aborted; the push fails once they ended)",
                posted,
            ) from err
        complete = _settle_quietly(transport, posted, settle_timeout_s)
        pool.free(offset)
        if not complete and not getattr(err, "maybe_sent", True):
            # The error speaks for the chunk that failed; the chunks posted before it were
            # handed to the network and did not all complete (still in flight when released,
            # or failed): their bytes may still land, so D must fence before it reuses them.
            raise TransferError(
                f"{err} (after {len(posted)} chunk(s) of this packed WRITE were posted and did "
                f"not all complete)",
                maybe_sent=True,
            ) from err
        raise
    return posted


class PackedPostFailed(TransferError):
    """A packed WRITE's chunk could not be posted after earlier chunks were posted as copies
    that cannot be aborted: ``posted`` are still the caller's to poll and release (in flight)."""

    def __init__(self, message: str, posted: list[PackedWrite]) -> None:
        super().__init__(message, maybe_sent=True)
        self.posted = posted


def _abortable(transport: Any, posted: list[PackedWrite]) -> bool:
    """Whether the transport can take back every posted chunk (as ``PushSender._post`` asks)."""
    abortable = getattr(transport, "abortable", None)
    try:
        if abortable is None:
            return bool(getattr(transport, "writes_abortable", True))
        return all(bool(abortable(write.handle)) for write in posted)
    except Exception:
        return False


def _settle_quietly(transport: Any, posted: list[PackedWrite], timeout_s: float) -> bool:
    """Wait (bounded) for chunks already posted, then release every one of them (error path
    only). Returns whether every one of them completed (none in flight or failed when
    released). A poll or release that raises is contained: that chunk counts as not complete
    (its bytes may still land), and the chunks after it are still settled and released."""
    from kvpush.core.transport import TransferState

    deadline = time.monotonic() + timeout_s
    complete = True
    for write in posted:
        try:
            state = transport.poll(write.handle)
            while state is TransferState.PENDING and time.monotonic() < deadline:
                time.sleep(0.0005)
                state = transport.poll(write.handle)
        except Exception as err:
            logger.warning("polling a posted chunk of a failed packed WRITE raised %r", err)
            state = TransferState.FAILED
        complete = complete and state is TransferState.DONE
        for release, handle in (
            (transport.release, write.handle),
            (transport.release_list, write.local_list),
            (transport.release_list, write.remote_list),
        ):
            try:
                release(handle)
            except Exception as err:
                logger.warning("releasing a chunk of a failed packed WRITE raised %r", err)
    return complete


def scatter_plan(
    regions: Sequence[KVRegion],
    block_ids: BlockIds,
    manifest: PackManifest,
    reserved: int,
    reserved_bytes: int,
) -> list[int]:
    """D: where in staging each region a packed DONE names starts (``offsets[i]`` for
    ``manifest.regions[i]``), after checking the manifest against D's own state: every region
    index is one of this rank's, none named twice, the byte slice cuts each region's blocks on
    a row boundary, the manifest's offset is D's reservation for the request (``reserved``),
    and every byte scattered lies inside ``[reserved, reserved + reserved_bytes)``.

    Raises ``WireError`` naming the field; nothing is scattered then."""
    count_regions = len(regions)
    if manifest.staging_offset != reserved or reserved < 0:
        raise WireError(
            f"packing manifest offset {manifest.staging_offset} is not D's reservation {reserved} "
            f"for this request"
        )
    chosen = manifest.regions
    if not all(type(j) is int for j in chosen) or (
        chosen and not 0 <= min(chosen) <= max(chosen) < count_regions
    ):
        bad = next(j for j in chosen if type(j) is not int or not 0 <= j < count_regions)
        raise WireError(f"packing manifest names region {bad!r}; this rank has {count_regions}")
    if len(set(chosen)) != len(chosen):
        twice = next(j for i, j in enumerate(chosen) if j in chosen[:i])
        raise WireError(f"packing manifest names region {twice} twice")
    area, total = staging_layout(regions, block_ids)
    if total > reserved_bytes:
        raise WireError(f"the request's {total} packed bytes exceed D's reservation of {reserved_bytes}")
    index, count = manifest.part
    starts = area.tolist()
    cut: dict[tuple[Any, ...], None] = {}  # region shapes whose slice was checked
    offsets = []
    end = reserved + reserved_bytes
    for j in chosen:
        region = regions[j]
        if count > 1 or index:
            shape = (
                region.block_len,
                region.block_order,
                region.block_tokens,
                region.num_heads,
                region.replicate,
            )
            if shape not in cut:
                try:
                    slice_rows(region, manifest.part)  # ConfigError: the slice does not fall on a row
                except ConfigError as err:
                    raise WireError(f"packing manifest part {manifest.part}: {err}") from None
                cut[shape] = None
        blocks = len(block_ids[region.kv_group]) if region.kv_group < len(block_ids) else 0
        share = region.block_len // count * blocks
        start = reserved + starts[j] + index * share
        if not (reserved <= start and start + share <= end):
            raise WireError(
                f"packing manifest region {j} part {manifest.part} covers staging bytes "
                f"[{start}, {start + share}), outside D's reservation [{reserved}, {end})"
            )
        offsets.append(start)
    return offsets


def check_chunks(manifests: Sequence[PackManifest]) -> None:
    """D: the packed DONEs one producer sent for one request agree with each other: the same
    staging offset, byte slice and chunk count, no chunk index stated twice with different
    regions (an identical repeat is a duplicate, not an error), and no D region in two chunks
    (their staging bytes would overlap, and a region left out would never be written, yet
    the producer would be counted once its announced chunks arrived).

    Raises ``WireError`` naming the disagreeing chunk; call it with every manifest so far."""
    if not manifests:
        return
    first = manifests[0]
    by_chunk: dict[int, PackManifest] = {}
    regions_seen: dict[int, int] = {}
    for manifest in manifests:
        for name in ("staging_offset", "part", "chunks"):
            if getattr(manifest, name) != getattr(first, name):
                raise WireError(
                    f"packed chunk {manifest.chunk} states {name} {getattr(manifest, name)!r}, "
                    f"chunk {first.chunk} of the same producer stated {getattr(first, name)!r}"
                )
        earlier = by_chunk.get(manifest.chunk)
        if earlier is not None:
            if earlier != manifest:
                raise WireError(
                    f"packed chunk {manifest.chunk} of {manifest.chunks} announced twice with different "
                    f"regions ({list(earlier.regions)} and {list(manifest.regions)})"
                )
            continue  # a duplicate DONE
        by_chunk[manifest.chunk] = manifest
        for j in manifest.regions:
            if regions_seen.get(j) == manifest.chunk:
                raise WireError(f"packed chunk {manifest.chunk} names D region {j} twice")
            if j in regions_seen:
                raise WireError(
                    f"packed chunks {regions_seen[j]} and {manifest.chunk} both name D region {j}: "
                    f"their staging bytes overlap"
                )
            regions_seen[j] = manifest.chunk


def unpack(
    packer: Packer,
    pool: StagingPool,
    regions: Sequence[KVRegion],
    block_ids: BlockIds,
    manifest: PackManifest,
) -> int:
    """D: scatter one producer's packed bytes from the staging area into the blocks, after
    :func:`scatter_plan` checked the manifest against the live reservation that starts at its
    offset (``WireError`` if not: nothing is scattered)."""
    reserved_bytes = pool.reserved(manifest.staging_offset)
    if reserved_bytes is None:
        raise WireError(
            f"packing manifest offset {manifest.staging_offset} is not a reservation in D's staging area"
        )
    offsets = scatter_plan(regions, block_ids, manifest, manifest.staging_offset, reserved_bytes)
    chosen = [regions[j] for j in manifest.regions]
    return packer.copy(pool.tensor, offsets, chosen, block_ids, manifest.part, gather=False)
