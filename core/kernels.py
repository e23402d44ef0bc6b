"""One-launch copies of many byte spans: the gather/scatter of packed transfers and the
scattered -> scattered copy of the ``cuda_ipc`` transport.

A copy is given as three arrays, ``src`` and ``dst`` addresses and ``lengths`` in bytes (or
one length for all). On CUDA it is one Triton kernel launch: program ``(i, c)`` copies chunk
``c`` of span ``i``, in the widest element (8, 4, 2 or 1 bytes) that every address and length
allows; spans longer than ``PIECE_BYTES`` are cut on the host so the grid stays small. The
descriptor table goes to the GPU with one pinned host-to-device copy on the copier's own
stream; the caller waits on the event the copy records, never on the device.

A copy waits for no engine stream unless given one (``after``): the KV it reads is complete
when the engine says so (``request_finished(..., ready=event)`` gates the post on the host).
Waiting on the device's default stream by default, as this did before, ordered the copy after
the engine's work queued there only, and tied it to that stream: a stalled engine stream (say a
hung collective) kept a ``cuda_ipc`` copy queued past P's WRITE deadline, after which D may
have fenced P and released the blocks the copy then writes. On the CPU the same call is a loop of
``memmove`` (tests and reference only; CPU packing uses torch index ops, see ``packing``).

Triton is imported on the first CUDA copy, never at module import.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import numpy as np

from kvpush.core.cuda_driver import DriverEvent, driver
from kvpush.core.errors import ConfigError
from kvpush.core.planning import IdGrid

PIECE_BYTES = 1 << 20
"""Spans longer than this are cut into pieces of this size (grid axis 1 stays <= 16 K)."""
MAX_BLOCK = 1024
"""Elements one program of the general kernel copies (8 KiB of int64)."""
ALIGNED_BLOCK = 2048
"""int64 elements one program of the aligned kernel copies (16 KiB)."""

_KERNEL: Any = None
triton: Any = None
tl: Any = None
_KERNEL_LOCK = threading.Lock()


def _kernel() -> Any:
    """The Triton kernels, compiled lazily (import of triton happens here).

    Their count arguments (``n``, ``k``) are not specialised: Triton would otherwise compile a
    variant for a count of 1 and one for a multiple of 16 the first time each occurs, and
    every push of the rank waited for that compile (on the H200 the first request of 80 blocks,
    after requests of other counts, took 77 ms, and the two behind it 54 and 46 ms)."""
    global _KERNEL, triton, tl  # module globals: the jitted body resolves ``tl`` there
    with _KERNEL_LOCK:
        if _KERNEL is None:
            import triton
            import triton.language as tl

            @triton.jit(do_not_specialize=["n"])
            def copy_spans_kernel(table, n, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
                i = tl.program_id(0)
                c = tl.program_id(1)
                src_addr = tl.load(table + i)
                dst_addr = tl.load(table + n + i)
                length = tl.load(table + 2 * n + i)  # elements
                if WIDTH == 8:
                    src = src_addr.to(tl.pointer_type(tl.int64))
                    dst = dst_addr.to(tl.pointer_type(tl.int64))
                elif WIDTH == 4:
                    src = src_addr.to(tl.pointer_type(tl.int32))
                    dst = dst_addr.to(tl.pointer_type(tl.int32))
                elif WIDTH == 2:
                    src = src_addr.to(tl.pointer_type(tl.int16))
                    dst = dst_addr.to(tl.pointer_type(tl.int16))
                else:
                    src = src_addr.to(tl.pointer_type(tl.int8))
                    dst = dst_addr.to(tl.pointer_type(tl.int8))
                offs = c * BLOCK + tl.arange(0, BLOCK)
                mask = offs < length
                values = tl.load(src + offs, mask=mask)
                tl.store(dst + offs, values, mask=mask)

            @triton.jit(do_not_specialize=["n"])
            def copy_aligned_kernel(
                base, table, n, LEN: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr
            ):
                # table: span starts in 16-byte units from ``base`` (an int64 pointer), so
                # ``start * 2`` is known to be 16-byte aligned and loads vectorise to 16 bytes.
                i = tl.program_id(0)
                c = tl.program_id(1)
                src = base + tl.load(table + i) * 2
                dst = base + tl.load(table + n + i) * 2
                offs = c * BLOCK + tl.arange(0, BLOCK)
                if MASK:
                    mask = offs < LEN
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
                else:
                    tl.store(dst + offs, tl.load(src + offs))

            @triton.jit(do_not_specialize=["n"])
            def copy_indirect_kernel(
                ltab, rtab, ids, n, LEN: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr
            ):
                # ltab/rtab: span starts of whole descriptor lists, in 16-byte units from the
                # table's own address; ids: n local then n remote descriptor ids (int32).
                i = tl.program_id(0)
                c = tl.program_id(1)
                lid = tl.load(ids + i).to(tl.int64)
                rid = tl.load(ids + n + i).to(tl.int64)
                src = ltab + tl.load(ltab + lid) * 2
                dst = rtab + tl.load(rtab + rid) * 2
                offs = c * BLOCK + tl.arange(0, BLOCK)
                if MASK:
                    mask = offs < LEN
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
                else:
                    tl.store(dst + offs, tl.load(src + offs))

            @triton.jit(do_not_specialize=["k"])
            def copy_grid_kernel(
                ltab, rtab, vals, k, LEN: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr
            ):
                # As copy_indirect_kernel, with the ids in factored form (IdGrid): program i is
                # region r = i // k, block b = i % k; vals (int32): n local then n remote region
                # starts, k local then k remote block ids (n = grid size // k).
                i = tl.program_id(0)
                c = tl.program_id(1)
                n = tl.num_programs(0) // k
                r = i // k
                b = i - r * k
                lid = (tl.load(vals + r) + tl.load(vals + 2 * n + b)).to(tl.int64)
                rid = (tl.load(vals + n + r) + tl.load(vals + 2 * n + k + b)).to(tl.int64)
                src = ltab + tl.load(ltab + lid) * 2
                dst = rtab + tl.load(rtab + rid) * 2
                offs = c * BLOCK + tl.arange(0, BLOCK)
                if MASK:
                    mask = offs < LEN
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
                else:
                    tl.store(dst + offs, tl.load(src + offs))

            _KERNEL = (copy_spans_kernel, copy_aligned_kernel, copy_indirect_kernel, copy_grid_kernel)
    return _KERNEL


_REPLAY = [True]
"""Whether compiled kernels are launched directly (off after a replay failed once)."""


def _spec(value: Any) -> tuple[Any, ...]:
    """What Triton specialises an argument on: a pointer's 16-byte alignment; an int's width
    (the kernels' ints are not specialised on their value, see :func:`_kernel`). Launches
    that agree on these reuse one compiled kernel."""
    if isinstance(value, int):
        return (-(1 << 31) <= value < 1 << 31,)
    ptr = getattr(value, "data_ptr", None)
    return (ptr() % 16 == 0,) if ptr is not None else (type(value),)


class _Launcher:
    """Launches Triton kernels with the least host work.

    The first launch of each specialisation (kernel, constexprs, warps, argument
    specialisation) goes through Triton's JIT entry (binding, specialisation, cache lookup:
    ~50-90 µs of host time, more in a busy engine process); later ones call that compiled
    kernel's own launcher directly, as the JIT entry would (Triton >= 3.3: ``run(grid, stream,
    function, packed_metadata, launch_metadata, hooks, *all arguments)``). Any failure of the
    direct call turns it off for the process and launches through the JIT entry again.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self.replays = 0
        self._knobs: Any = None
        if _REPLAY[0]:
            try:
                from triton import knobs

                self._knobs = knobs
            except ImportError:  # Triton < 3.3: another launcher signature
                _REPLAY[0] = False

    def __call__(
        self,
        kernel: Any,
        grid: tuple[int, int],
        args: tuple[Any, ...],
        constexprs: dict[str, Any],
        warps: int,
        stream: Any,
    ) -> None:
        import torch

        key = (id(kernel), warps, *constexprs.items(), *map(_spec, args))
        compiled = self._compiled.get(key) if _REPLAY[0] else None
        if compiled is not None and torch.cuda.current_device() == self.device.index:
            knobs = self._knobs.runtime
            values = (*args, *constexprs.values())
            handle = stream.cuda_stream
            try:
                metadata = compiled.launch_metadata(grid, handle, *values)
                compiled.run(
                    grid[0],
                    grid[1],
                    1,
                    handle,
                    compiled.function,
                    compiled.packed_metadata,
                    metadata,
                    knobs.launch_enter_hook,
                    knobs.launch_exit_hook,
                    *values,
                )
                self.replays += 1
                return
            except Exception as err:  # a launcher signature this code does not know: JIT from now on
                import logging

                logging.getLogger(__name__).warning(
                    "direct Triton launch failed (%r); using Triton's JIT entry", err
                )
                _REPLAY[0] = False
        with torch.cuda.stream(stream):
            compiled = kernel[grid](*args, **constexprs, num_warps=warps)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if _REPLAY[0] and all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")
        ):
            if len(self._compiled) >= 256:
                self._compiled.clear()
            self._compiled[key] = compiled


def widest(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> int:
    """The widest element size (8, 4, 2, 1) dividing every address and length."""
    bits = int(np.bitwise_or.reduce(src)) if len(src) else 0
    bits |= int(np.bitwise_or.reduce(dst)) if len(dst) else 0
    bits |= int(np.bitwise_or.reduce(lengths)) if len(lengths) else 0
    for width in (8, 4, 2):
        if bits % width == 0:
            return width
    return 1


def split_long(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, piece: int = PIECE_BYTES
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut spans longer than ``piece`` bytes into pieces (same bytes, more spans)."""
    if not len(lengths) or int(lengths.max()) <= piece:
        return src, dst, lengths
    counts = -(-lengths // piece)
    owner = np.repeat(np.arange(len(lengths)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    k = (np.arange(len(owner)) - starts).astype(np.int64)
    shift = k * piece
    return src[owner] + shift, dst[owner] + shift, np.minimum(piece, lengths[owner] - shift)


def as_spans(src: Any, dst: Any, lengths: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert to three int64 arrays of equal length (``lengths`` may be one int)."""
    s = np.asarray(src, dtype=np.int64).ravel()
    d = np.asarray(dst, dtype=np.int64).ravel()
    if np.ndim(lengths) == 0:
        n = np.full(len(s), int(lengths), dtype=np.int64)
    else:
        n = np.asarray(lengths, dtype=np.int64).ravel()
    if not len(s) == len(d) == len(n):
        raise ConfigError(
            f"copy_spans: src ({len(s)}), dst ({len(d)}) and lengths ({len(n)}) must be equally long"
        )
    if len(n) and int(n.min()) < 0:
        raise ConfigError("copy_spans: a span length is negative; lengths are byte counts >= 0")
    return s, d, n


def copy_spans_cpu(src: Any, dst: Any, lengths: Any) -> int:
    """CPU reference: ``memmove`` each span; returns the bytes copied."""
    s, d, n = as_spans(src, dst, lengths)
    for a, b, k in zip(s.tolist(), d.tolist(), n.tolist()):
        ctypes.memmove(b, a, k)
    return int(n.sum())


UPLOAD_SLOTS = 4
"""Pinned upload buffers per copier, used round robin (a launch never waits for the copy before)."""
UPLOAD_WORDS = 1 << 18
"""First size of each slot (words): a Llama-70B TP8 request of 8k tokens needs ~164 k, so slots
normally never grow (growing pins host memory, which takes milliseconds, and waits for the
stream)."""


class _UploadRing:
    """Pinned host buffers and their device twins, used round robin. A slot's host buffer is
    refilled only once the upload that read it has finished (its event), which, ``slots``
    launches later, it normally has: a launch does not wait for the previous request's copy, as
    one shared buffer made it (the upload queues behind the copy before it on the stream).
    A device twin is overwritten by a later upload on the same stream, so after every kernel
    that read it. Each slot keeps a numpy view of its host buffer (filled in place)."""

    def __init__(self, device: Any, dtype: Any, context: int, slots: int = UPLOAD_SLOTS) -> None:
        import torch

        self.device, self.dtype, self.context = device, dtype, context
        self.host = [torch.empty(0, dtype=dtype).pin_memory() for _ in range(slots)]
        self.views = [h.numpy() for h in self.host]
        self.dev = [torch.empty(0, dtype=dtype, device=device) for _ in range(slots)]
        self.events: list[DriverEvent | None] = [None] * slots
        self.capacity = UPLOAD_WORDS
        """Every slot is (re)allocated at this size; it grows past the largest request seen."""
        self.next = 0
        self.waits = 0
        """Launches that had to wait for an earlier upload (the ring was too short)."""

    def take(self, words: int, stream: Any) -> tuple[np.ndarray, int]:
        """A free slot with room for ``words``: its host view and its index."""
        import torch

        slot = self.next
        self.next = (slot + 1) % len(self.host)
        event = self.events[slot]
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        if len(self.views[slot]) < max(words, 1):
            # Grow every slot at once (pinning host memory takes milliseconds: pay it once,
            # not on each of the next launches), after the queued kernels that read them.
            self.capacity = max(self.capacity, words, 2 * len(self.views[slot]))
            stream.synchronize()
            for i in range(len(self.host)):
                if len(self.views[i]) < self.capacity:
                    self.host[i] = torch.empty(self.capacity, dtype=self.dtype).pin_memory()
                    self.views[i] = self.host[i].numpy()
                    self.dev[i] = torch.empty(self.capacity, dtype=self.dtype, device=self.device)
        return self.views[slot], slot

    def upload(self, slot: int, words: int, stream: int) -> Any:
        """Queue the upload of the slot's first ``words`` on ``stream`` (raw handle) and mark
        the slot busy until it finished; returns the device twin."""
        host, dev = self.host[slot], self.dev[slot]
        driver().upload(dev.data_ptr(), host.data_ptr(), words * host.element_size(), stream)
        event = self.events[slot]
        if event is None:
            event = self.events[slot] = DriverEvent(self.context)
        event.record(stream)
        return dev


class SpanCopier:
    """Copies span lists on one CUDA device with one kernel launch each, on its own stream.

    Not thread-safe: one per writer thread (a ``Packer`` or a transport owns one). Events,
    stream waits and uploads go through the driver (:mod:`kvpush.core.cuda_driver`).
    """

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ConfigError(f"SpanCopier needs a CUDA device, got {self.device}")
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.stream = torch.cuda.Stream(self.device)
        self._handle = int(self.stream.cuda_stream)
        self._driver = driver()
        self.context = self._driver.primary_context(self.index)
        self._tables = _UploadRing(self.device, torch.int64, self.context)
        self._timing: tuple[Any, Any] | None = None
        self.launches = 0
        self.aligned_launches = 0
        self.host_seconds = [0.0, 0.0]
        """Host time of launches: preparing the table, enqueueing upload and kernel (totals)."""
        self._ids = _UploadRing(self.device, torch.int32, self.context)
        self._launch = _Launcher(self.device)
        self._after = DriverEvent(self.context)
        """Re-recorded per launch on the stream waited for (a wait takes the record of its call)."""

    @property
    def upload_waits(self) -> int:
        """Launches that waited for an earlier upload to finish (0 when the ring is long enough)."""
        return self._tables.waits + self._ids.waits

    @property
    def replays(self) -> int:
        """Launches that skipped Triton's JIT entry (see ``_Launcher``)."""
        return self._launch.replays

    def _wait_for(self, after: Any) -> None:
        """Make the copier's stream wait for stream ``after`` by an event (None: no wait)."""
        if after is None:
            return
        handle = int(after.cuda_stream)
        if handle != self._handle:
            self._after.record(handle)
            self._driver.wait_event(self._handle, self._after.handle)

    def _done(self, timed: bool) -> Any:
        """The event a launch returns, recorded after its kernel."""
        if timed:
            import torch

            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
            return done
        done = DriverEvent(self.context)
        done.record(self._handle)
        return done

    def launch(self, src: Any, dst: Any, lengths: Any, *, after: Any = None, timed: bool = False) -> Any:
        """Enqueue the copy; returns an event recorded after it (``query``, ``synchronize``;
        None if there is nothing to copy).

        With ``after`` (a stream), the copier's stream first waits for the work queued there
        (by event); without it the copy waits for nothing (see the module docstring).
        """
        previous = self._driver.switch(self.context)
        try:
            return self._launch_spans(src, dst, lengths, after, timed)
        finally:
            self._driver.restore(previous)

    def _launch_spans(self, src: Any, dst: Any, lengths: Any, after: Any, timed: bool) -> Any:
        import torch

        began = time.perf_counter()
        s, d, n = as_spans(src, dst, lengths)
        keep = n > 0
        if not keep.all():
            s, d, n = s[keep], d[keep], n[keep]
        if not len(n):
            return None
        s, d, n = split_long(s, d, n)
        count = len(n)
        first = int(n[0])
        aligned = first % 16 == 0 and not ((s | d) & 15).any()
        aligned = aligned and bool((n == first).all()) and first // 8 <= 65535 * ALIGNED_BLOCK
        view, slot = self._tables.take(3 * count, self.stream)
        table_addr = self._tables.dev[slot].data_ptr()
        if aligned:  # one length, 16-byte aligned: starts in 16-byte units from the table's address
            words = 2 * count
            view[:count], view[count:words] = (s - table_addr) >> 4, (d - table_addr) >> 4
            elems = first // 8
            block = min(ALIGNED_BLOCK, 1 << max(0, (elems - 1).bit_length()))
            grid: tuple[int, int] = (count, -(-elems // block))
        else:
            width = widest(s, d, n)
            words = 3 * count
            view[:count], view[count : 2 * count], view[2 * count : words] = s, d, n // width
            longest = int(n.max()) // width
            block = min(MAX_BLOCK, 1 << max(0, (longest - 1).bit_length()))
            grid = (count, -(-longest // block))
        self._wait_for(after)
        plain, fast = _kernel()[:2]
        prepared = time.perf_counter()
        start = None
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
        table = self._tables.upload(slot, words, self._handle)
        warps = max(1, min(8, block // 256))
        if aligned:
            constexprs = {"LEN": elems, "BLOCK": block, "MASK": elems % block != 0}
            self._launch(fast, grid, (table, table, count), constexprs, warps, self.stream)
        else:
            self._launch(plain, grid, (table, count), {"WIDTH": width, "BLOCK": block}, warps, self.stream)
        done = self._done(timed)
        self._timing = (start, done) if timed else None
        self.host_seconds[0] += prepared - began
        self.host_seconds[1] += time.perf_counter() - prepared
        self.launches += 1
        self.aligned_launches += int(aligned)
        return done

    def launch_indirect(
        self, ltab: DeviceTable, rtab: DeviceTable, lids: Any, rids: Any, *, after: Any = None
    ) -> Any:
        """Copy descriptor ``lids[k]`` of ``ltab``'s list to descriptor ``rids[k]`` of ``rtab``'s,
        resolving addresses on the GPU (host work: the id upload). Both lists must be
        ``DeviceTable.usable`` with the same span length. Returns the done event."""
        count = len(lids)
        if count != len(rids):
            raise ConfigError("launch_indirect: lists differ in span length or descriptor count")

        def fill(view: np.ndarray) -> None:
            view[:count], view[count : 2 * count] = lids, rids

        return self._launch_by_ids(2, ltab, rtab, count, 2 * count, fill, count, after)

    def launch_grid(
        self, ltab: DeviceTable, rtab: DeviceTable, local: IdGrid, remote: IdGrid, *, after: Any = None
    ) -> Any:
        """:meth:`launch_indirect` with the ids in factored form (both grids of one shape):
        only ``2 x (regions + blocks)`` ids go up, and the host builds no id lists."""
        n, k = len(local.starts), len(local.blocks)
        if (n, k) != (len(remote.starts), len(remote.blocks)):
            raise ConfigError("launch_grid: the two id grids differ in shape")

        def fill(view: np.ndarray) -> None:
            view[:n], view[n : 2 * n] = local.starts.reshape(-1), remote.starts.reshape(-1)
            view[2 * n : 2 * n + k], view[2 * n + k : 2 * (n + k)] = local.blocks, remote.blocks

        return self._launch_by_ids(3, ltab, rtab, n * k, 2 * (n + k), fill, k, after)

    def _launch_by_ids(
        self,
        which: int,
        ltab: DeviceTable,
        rtab: DeviceTable,
        rows: int,
        words: int,
        fill: Any,
        last_arg: int,
        after: Any,
    ) -> Any:
        """Launch kernel ``which`` of :func:`_kernel` over ``rows`` descriptor pairs of two usable
        tables of one span length: ``fill`` writes the ``words`` int32 ids into the upload
        slot; the kernel gets ``(ltab, rtab, ids, last_arg)``. Returns the done event."""
        if ltab.length != rtab.length or not (ltab.usable and rtab.usable):
            raise ConfigError("launch by ids: lists differ in span length or descriptor count")
        if not rows:
            return None
        previous = self._driver.switch(self.context)
        try:
            began = time.perf_counter()
            view, slot = self._ids.take(words, self.stream)
            fill(view)
            elems = ltab.length // 8
            block = min(ALIGNED_BLOCK, 1 << max(0, (elems - 1).bit_length()))
            grid = (rows, -(-elems // block))
            self._wait_for(after)
            kernel = _kernel()[which]
            prepared = time.perf_counter()
            ids = self._ids.upload(slot, words, self._handle)
            warps = max(1, min(8, block // 256))
            constexprs = {"LEN": elems, "BLOCK": block, "MASK": elems % block != 0}
            self._launch(
                kernel, grid, (ltab.tensor, rtab.tensor, ids, last_arg), constexprs, warps, self.stream
            )
            done = self._done(False)
        finally:
            self._driver.restore(previous)
        self._timing = None
        self.launches += 1
        self.aligned_launches += 1
        self.host_seconds[0] += prepared - began
        self.host_seconds[1] += time.perf_counter() - prepared
        return done

    def gpu_ms(self) -> float | None:
        """Device time of the last ``timed`` launch (table upload and kernel), once it finished."""
        if self._timing is None:
            return None
        start, done = self._timing
        done.synchronize()
        return float(start.elapsed_time(done))

    def copy(self, src: Any, dst: Any, lengths: Any, *, after: Any = None, timed: bool = False) -> int:
        """Copy and wait for the copy's event; returns the bytes copied."""
        s, d, n = as_spans(src, dst, lengths)
        event = self.launch(s, d, n, after=after, timed=timed)
        if event is not None:
            event.synchronize()
        return int(n.sum())


class DeviceTable:
    """A descriptor list's span starts on the GPU, in 16-byte units from the table's own address
    (for :meth:`SpanCopier.launch_indirect`). ``usable`` is False unless every span starts
    16-byte aligned and all have one length (a multiple of 16)."""

    def __init__(self, addrs: np.ndarray, lengths: np.ndarray, device: Any) -> None:
        import torch

        a = np.asarray(addrs, dtype=np.int64)
        n = np.asarray(lengths, dtype=np.int64)
        self.count = len(a)
        self.length = int(n[0]) if len(n) else 0
        self.usable = bool(
            len(a) and self.length % 16 == 0 and not (a & 15).any() and bool((n == self.length).all())
        )
        self.tensor = torch.empty(max(1, len(a)), dtype=torch.int64, device=device)
        if self.usable:
            base = self.tensor.data_ptr()
            # A blocking copy from host memory returns once the bytes are on the device (torch
            # synchronizes its stream), so a launch on another stream right after reads them.
            self.tensor[: len(a)].copy_(torch.from_numpy((a - base) >> 4))


_COPIERS: dict[tuple[int, int], SpanCopier] = {}


def copier_for(device: Any) -> SpanCopier:
    """This thread's copier for ``device`` (one dedicated stream per writer thread and device)."""
    import torch

    dev = torch.device(device)
    key = (threading.get_ident(), dev.index if dev.index is not None else torch.cuda.current_device())
    copier = _COPIERS.get(key)
    if copier is None:
        copier = SpanCopier(torch.device("cuda", key[1]))
        _COPIERS[key] = copier
    return copier


def triton_available() -> bool:
    """True when a CUDA device and Triton are both there (the GPU path can run)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
