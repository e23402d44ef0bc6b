"""``kvpush bench``: sweep transfer shapes, P and D in two processes over real NIXL, and compare
kvpush (``direct`` and ``packed``) with raw NIXL writing the same descriptors and with a plain
in-process copy of the same bytes.

This process is P: a real :class:`~kvpush.core.sender.PushSender` plus a raw ``nixl_agent``
over the same KV memory. A spawned process is D: a real
:class:`~kvpush.core.receiver.PushReceiver` plus a raw agent. Every time is P-side wall clock
from the start of the request to D's acknowledgement over a pipe (so every method pays the same
pipe hop), with D waiting for the data the way each method needs:

- ``raw_nixl``: ``make_prepped_xfer`` of the prepared whole-pool lists with the request's
  descriptor ids (computed beforehand), ``transfer``, poll to DONE; D polls ``get_new_notifs``
  every ``poll_s`` for the notification;
- ``direct`` / ``packed``: D has registered the request (``PUSH_REG`` already stashed on P);
  P calls ``request_finished``, its writer thread plans and posts; D's writer (polling every
  ``poll_s``) counts the DONE (and, packed, scatters first); D reports the request done;
- ``raw_contig``: raw NIXL writing the same number of bytes laid out contiguously (block ids
  ``0..n-1`` on both sides, which NIXL merges per region): what the hardware path does with
  the same bytes when nothing is scattered;
- ``cuda_ipc`` (GPU): kvpush over the ``cuda_ipc`` transport (direct strategy: one kernel from
  P's blocks into D's blocks through CUDA IPC, then the DONE over NIXL), in a second pair of
  processes whose transport is ``cuda_ipc`` (UCX and this process must not both map D's memory);
- ``ceiling`` (GPU): the same one-kernel copy of P's scattered blocks into scattered blocks of
  a second KV allocation on D's device, in P's process (peer access, no IPC, no host protocol):
  what one launch can do;
  ``ceiling_kernel`` is the same copy's device time alone (CUDA events around the
  descriptor upload and the kernel);
- ``copy``: one gather of the same blocks into a buffer, in P's process (the memory
  bandwidth the bytes would need without any transfer).

``--shape`` runs named presets (real model geometry) instead of the grid: ``llama70b-tp8``
(80 layers x K/V = 160 regions, 256 blocks of 4 KiB, a 4k-token prompt at block 16),
``llama8b`` (64 regions x 256 x 32 KiB), ``scattered-256m`` and ``scattered-1g`` (64 regions
x 128 / 512 x 32 KiB), or ``issue14`` (all four).

Buffers are pre-touched, no NIXL progress thread runs, each process runs torch with one
intra-op thread, reps of the methods are interleaved, and the foreign CPU load of each row is
recorded (cores busy outside these two processes).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np

BLOCK_BYTES = (4096, 32768)
BLOCK_COUNTS = (16, 128, 512)
PATTERNS = ("scattered", "contiguous")
METHODS = ("raw_nixl", "raw_contig", "direct", "packed", "cuda_ipc", "ceiling", "copy")
GPU_METHODS = ("cuda_ipc", "ceiling")
SHAPES: dict[str, tuple[int, int, int]] = {
    "llama70b-tp8": (80, 4096, 256),
    "llama8b": (32, 32768, 256),
    "scattered-256m": (32, 32768, 128),
    "scattered-1g": (32, 32768, 512),
}
"""Preset -> (layers, block bytes, blocks per request); each layer has a K and a V region."""
SHAPE_GROUPS = {"issue14": ("scattered-256m", "scattered-1g", "llama70b-tp8", "llama8b")}
STRATEGIES = ("direct", "packed")
HEAD_DIM, TOKENS = 128, 16


def bench_model(block_bytes: int, layers: int) -> Any:
    """A GQA model whose K (or V) block of one layer is ``block_bytes`` (bf16, 16 tokens)."""
    from kvpush.core.types import ModelSpec

    per_head = TOKENS * HEAD_DIM * 2
    if block_bytes % per_head:
        raise ValueError(f"block size must be a multiple of {per_head} bytes, got {block_bytes}")
    return ModelSpec(
        name=f"bench-{block_bytes}",
        num_layers=layers,
        num_kv_heads=block_bytes // per_head,
        head_dim=HEAD_DIM,
        block_size=TOKENS,
    )


def block_tables(blocks: int, pool: int, pattern: str, seed: int) -> tuple[list[int], list[int]]:
    """P's and D's block ids. ``scattered``: random even ids (no two adjacent, so nothing
    merges); ``contiguous``: ``0..blocks-1`` on both sides (NIXL merges them per region)."""
    if pattern == "contiguous":
        return list(range(blocks)), list(range(blocks))
    rng = np.random.default_rng(seed)
    evens = np.arange(0, pool, 2)
    return rng.permutation(evens)[:blocks].tolist(), rng.permutation(evens)[:blocks].tolist()


def foreign_cores(since: tuple[float, float, float], pids: Sequence[int]) -> float:
    """Cores busy with processes other than ``pids`` since ``since`` (from ``snapshot``)."""
    now = snapshot(pids)
    wall = now[2] - since[2]
    return max(0.0, ((now[0] - since[0]) - (now[1] - since[1])) / wall) if wall > 0 else 0.0


def snapshot(pids: Sequence[int]) -> tuple[float, float, float]:
    """(busy CPU seconds of the machine, CPU seconds of ``pids``, monotonic time)."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:8]]
    busy = (sum(fields) - fields[3] - fields[4]) / hz
    own = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            own += (float(parts[11]) + float(parts[12])) / hz
        except OSError:
            pass
    return busy, own, time.monotonic()


# ------------------------------------------------------------------------------ raw NIXL


class RawAgent:
    """A bare ``nixl_agent`` (no progress thread, UCX, err mode none) over the KV regions."""

    def __init__(self, name: str, regions: Sequence[Any]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from kvpush.core.planning import region_descriptors
        from kvpush.transports.nixl import _merge_spans

        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self.mem = regions[0].mem_type
        spans = _merge_spans([(r.base_addr, r.end_addr, r.device_id) for r in regions])
        reg = np.array([(s, e - s, d) for s, e, d in spans], dtype=np.uint64)
        self.registration = self.agent.register_memory(self.agent.get_reg_descs(reg, self.mem))
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", region_descriptors(regions), self.mem)
        self.remote: Any = None

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def connect(self, blob: bytes, peer_regions: Sequence[Any] | None = None) -> None:
        from kvpush.core.planning import region_descriptors

        peer = self.agent.add_remote_agent(blob)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        if peer_regions is not None:
            self.remote = self.agent.prep_xfer_dlist(peer, region_descriptors(peer_regions), self.mem)

    def write(self, local_ids: np.ndarray, remote_ids: np.ndarray, notif: bytes, timeout_s: float) -> None:
        handle = self.agent.make_prepped_xfer("WRITE", self.local, local_ids, self.remote, remote_ids, notif)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"raw NIXL WRITE not done within {timeout_s}s")
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL WRITE ended in {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def wait_notif(self, tag: bytes, poll_s: float, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for messages in self.agent.get_new_notifs().values():
                if tag in messages:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw NIXL notification {tag!r} not seen within {timeout_s}s")
            time.sleep(poll_s)


# ------------------------------------------------------------------------------ the two sides


@attrs.frozen(kw_only=True)
class PairSpec:
    block_bytes: int
    layers: int = 16
    pool_blocks: int = 1024
    device: str = "cpu"
    decode_device: str | None = None
    """Where D's caches live (default: ``device``); another GPU measures NVLink."""
    poll_s: float = 50e-6
    staging_bytes: int = 0
    side_channel_port: int = 0
    timeout_s: float = 60.0
    torch_threads: int = 1
    """Intra-op threads of P and of D: they share the cores, and a 2-thread op stalls on its
    barrier whenever another job holds the second core (bimodal timings on a shared box)."""
    transport: str = "nixl"
    """The kvpush transport of both engines (``cuda_ipc`` for the ``cuda_ipc`` method)."""
    nixl_options: dict[str, Any] = attrs.field(factory=dict, hash=False)
    """Options of kvpush's NIXL transport (``--nixl-option``; under ``cuda_ipc``, of the NIXL
    transport it wraps), e.g. ``{"progress_thread": True}``. The raw agents keep their own."""
    decode_hook: str | None = None
    """``module:function`` D calls with its receiver after start; what the function returns (a
    callable giving a picklable value) answers D's ``stats`` under ``hook`` (profiling stamps)."""


def _worker_config(spec: PairSpec, engine: str, model: Any) -> Any:
    from kvpush.core.types import ParallelConfig
    from kvpush.core.worker import WorkerConfig

    cuda = int(spec.device.split(":")[1]) if spec.device.startswith("cuda:") else None
    return WorkerConfig(
        engine_id=engine,
        parallel=ParallelConfig(tp_size=1, num_layers=model.num_layers),
        model=model,
        side_channel_port=spec.side_channel_port,
        busy_poll_s=spec.poll_s,
        staging_bytes=spec.staging_bytes,
        request_timeout_s=spec.timeout_s,
        cuda_device=cuda,
        transport=spec.transport,
        transport_options=nixl_transport_options(spec.transport, spec.nixl_options),
    )


def nixl_transport_options(transport: str, nixl_options: dict[str, Any]) -> dict[str, Any]:
    """The transport options that give kvpush's NIXL transport ``nixl_options``: as they are
    for ``nixl``, as ``inner_options`` of ``cuda_ipc``."""
    if not nixl_options:
        return {}
    return dict(nixl_options) if transport == "nixl" else {"inner_options": dict(nixl_options)}


def _block_sums(caches: dict[str, Any], ids: Sequence[int]) -> Any:
    """Per-block int64 sums of every layer's K and V blocks ``ids`` (order-sensitive)."""
    import torch

    from kvpush.layouts.uniform import natural_key

    index = torch.tensor(list(ids), device=next(iter(caches.values())).device)
    out = []
    for name in sorted(caches, key=natural_key):
        words = caches[name].view(torch.int32).flatten(2)
        out.append(words.index_select(1, index).sum(-1, dtype=torch.int64).cpu())
    return torch.stack(out)


PACK_TIMES: dict[str, list[float]] = {"gather": [0.0, 0.0], "scatter": [0.0, 0.0]}
"""Seconds and calls of ``Packer.copy`` in this process, by direction (``time_packer``)."""


def time_packer() -> None:
    """Count the wall time of every ``Packer.copy`` of this process in ``PACK_TIMES``."""
    from kvpush.core.packing import Packer

    if getattr(Packer.copy, "_timed", False):
        return
    copy = Packer.copy

    def timed(self: Any, *args: Any, gather: bool, **kwargs: Any) -> int:
        start = time.perf_counter()
        try:
            return copy(self, *args, gather=gather, **kwargs)
        finally:
            entry = PACK_TIMES["gather" if gather else "scatter"]
            entry[0] += time.perf_counter() - start
            entry[1] += 1

    timed._timed = True  # type: ignore[attr-defined]
    Packer.copy = timed  # type: ignore[method-assign]


def _decode_main(spec: PairSpec, conn: Connection) -> None:
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        import torch

        time_packer()

        from kvpush.core.receiver import PushReceiver
        from kvpush.core.types import RequestMetadata, TransferParams
        from kvpush.layouts.uniform import allocate_kv_caches

        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        torch.set_num_threads(spec.torch_threads)
        model = bench_model(spec.block_bytes, spec.layers)
        config = _worker_config(spec, "bench-D", model)
        caches = allocate_kv_caches(model, config.parallel, spec.pool_blocks, device=spec.device)
        receiver = PushReceiver(config, caches)
        receiver.start()
        assert receiver.metadata is not None
        raw = RawAgent("bench-raw-D", receiver.metadata.regions)
        hook_report: Callable[[], Any] | None = None
        if spec.decode_hook:
            import importlib

            module, _, function = spec.decode_hook.partition(":")
            hook_report = getattr(importlib.import_module(module), function)(receiver)
        conn.send(("ready", (receiver.handshake_payload(), raw.metadata())))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    done: set[str] = set()
    failed: dict[str, str] = {}
    try:
        while conn.poll(600):
            message = conn.recv()
            kind = message[0]
            try:
                if kind == "stop":
                    conn.send(("ok", None))
                    break
                if kind == "connect":
                    raw.connect(message[1])
                    reply: Any = None
                elif kind == "add":
                    _, rid, ids, params = message
                    meta = RequestMetadata(
                        request_id=rid, block_ids=[ids], params=TransferParams.from_dict(params)
                    )
                    receiver.add_request(meta)
                    reply = None
                elif kind == "wait":
                    _, rid, timeout_s = message
                    deadline = time.monotonic() + timeout_s
                    while rid not in done and rid not in failed:
                        got = receiver.wait_finished(max(0.001, deadline - time.monotonic()))
                        done.update(got.done)
                        failed.update(got.failed)
                    if rid in failed:
                        raise RuntimeError(f"D failed {rid}: {failed.pop(rid)}")
                    done.discard(rid)
                    reply = None
                elif kind == "raw_wait":
                    raw.wait_notif(message[1], spec.poll_s, message[2])
                    reply = None
                elif kind == "zero":
                    index = torch.tensor(message[1], device=spec.device)
                    for tensor in caches.values():
                        tensor.index_fill_(1, index, 0)
                    if index.is_cuda:  # zeroed before P's copy can land, not after it
                        torch.cuda.synchronize(index.device)
                    reply = None
                elif kind == "sums":
                    reply = _block_sums(caches, message[1]).numpy()
                elif kind == "stats":
                    reply = {
                        "staging_in_use": receiver.staging.bytes_in_use if receiver.staging else 0,
                        "pack_times": {k: list(v) for k, v in PACK_TIMES.items()},
                        "hook": hook_report() if hook_report is not None else None,
                    }
                else:
                    raise ValueError(f"unknown message {kind!r}")
                conn.send(("ok", reply))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        receiver.close()


class BenchPair:
    """P (this process) and D (a child process) for one block size."""

    def __init__(self, spec: PairSpec) -> None:
        import torch

        from kvpush.core.manager import get_plugin_manager
        from kvpush.core.sender import PushSender
        from kvpush.core.sidechannel import SideChannelServer
        from kvpush.core.types import RankKey
        from kvpush.layouts.uniform import allocate_kv_caches
        from kvpush.plugins.strategy import ForcedStrategy

        os.environ.setdefault("UCX_LOG_LEVEL", "error")
        torch.set_num_threads(spec.torch_threads)
        self.p_server = SideChannelServer("bench-P")
        self.d_server = SideChannelServer("bench-D")
        self.spec = spec
        self.model = bench_model(spec.block_bytes, spec.layers)
        d_spec = attrs.evolve(
            spec, side_channel_port=self.d_server.port, device=spec.decode_device or spec.device
        )
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_decode_main, args=(d_spec, child), daemon=True, name="kvpush-bench-D"
        )
        self.process.start()
        self.sender: Any = None
        try:
            self.force = ForcedStrategy(None)
            self.pm = get_plugin_manager(plugins=[("bench_forced_strategy", self.force)])
            config = _worker_config(
                attrs.evolve(spec, side_channel_port=self.p_server.port), "bench-P", self.model
            )
            self.caches = allocate_kv_caches(
                self.model, config.parallel, spec.pool_blocks, device=spec.device
            )
            self._fill()
            time_packer()
            self.sender = PushSender(config, self.caches, pm=self.pm)
            self.sender.start()
            self.trace: dict[str, float] = {}
            self.traces: dict[str, list[list[float]]] = {}
            self._instrument(self.sender.transport)
            assert self.sender.metadata is not None
            self.regions = self.sender.metadata.regions
            self.p_server.publish(RankKey(0, 0), self.sender.handshake_payload())
            self.raw = RawAgent("bench-raw-P", self.regions)
            d_payload, d_raw = self._reply(("start",), 180)
            self.d_server.publish(RankKey(0, 0), d_payload)
            self.raw.connect(d_raw, self._decode_regions(d_payload))
            self._call(("connect", self.raw.metadata()))
            from kvpush.core.packing import Packer

            self.packer = Packer(self.regions)
            self.copy_buffer = torch.zeros(spec.staging_bytes or 1, dtype=torch.uint8, device=spec.device)
            self.ceiling_regions: Any = None
            self.ceiling_gpu_s = 0.0
            if spec.device.startswith("cuda") and spec.transport == "nixl":
                self._start_ceiling(config)
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count()
        self._sent: set[str] = set()
        self._unsettled: str | None = None
        self.params = {
            "remote_engine_id": "bench-P",
            "remote_host": "127.0.0.1",
            "remote_port": self.p_server.port,
        }

    def _instrument(self, transport: Any) -> None:
        """Time P's posts: finish -> post starts -> post returns -> WRITE settled -> D's ack."""
        poll = transport.poll
        trace = self.trace

        def timed(post: Callable[..., Any]) -> Callable[..., Any]:
            def timed_post(*args: Any) -> Any:
                trace.setdefault("post", time.perf_counter())
                handle = post(*args)
                trace["posted"] = time.perf_counter()
                return handle

            return timed_post

        def timed_poll(handle: Any) -> Any:
            state = poll(handle)
            if state.value == "done":
                trace.setdefault("done", time.perf_counter())
            return state

        for name in ("post_write", "post_write_grid"):  # the second is optional (ids factored)
            if hasattr(transport, name):
                setattr(transport, name, timed(getattr(transport, name)))
        transport.poll = timed_poll

    def _start_ceiling(self, config: Any) -> None:
        """A second KV allocation on D's device, written by one kernel from P's blocks."""
        import torch

        from kvpush.layouts.uniform import allocate_kv_caches, describe_uniform

        target = self.spec.decode_device or self.spec.device
        if torch.device(target) != torch.device(self.spec.device):  # enable peer access both ways
            torch.zeros(1, device=target).copy_(torch.zeros(1, device=self.spec.device))
            torch.zeros(1, device=self.spec.device).copy_(torch.zeros(1, device=target))
        self.ceiling_caches = allocate_kv_caches(
            self.model, config.parallel, self.spec.pool_blocks, device=target
        )
        self.ceiling_regions = describe_uniform(self.ceiling_caches, config.parallel, self.model)

    def _ceiling_spans(self, p_ids: list[int], d_ids: list[int]) -> tuple[Any, Any, Any]:
        from kvpush.core.packing import block_addresses

        src, lengths = block_addresses(self.regions, (tuple(p_ids),), (0, 1))
        dst, _ = block_addresses(self.ceiling_regions, (tuple(d_ids),), (0, 1))
        return src.astype(np.int64), dst.astype(np.int64), lengths.astype(np.int64)

    def _fill(self) -> None:
        import torch

        from kvpush.layouts.uniform import natural_key

        names = sorted(self.caches, key=natural_key)
        first = self.caches[names[0]].view(torch.int16)
        first.copy_(torch.randint(-30_000, 30_000, first.shape, dtype=torch.int16, device=first.device))
        for layer, name in enumerate(names[1:], 1):
            self.caches[name].view(torch.int16).copy_(first).add_(layer)
        if first.is_cuda:  # the methods read on their own streams, which wait for nothing
            torch.cuda.synchronize(first.device)

    def _decode_regions(self, payload: bytes) -> Any:
        from kvpush.core import wire

        return wire.decode_metadata(payload, expected_hash=None, source="bench D").regions

    # ---------------------------------------------------------------- pipe to D

    def _reply(self, message: tuple[Any, ...], timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"bench D did not answer {message[0]!r} within {timeout_s}s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"bench D failed on {message[0]!r}:\n{value}")
        return value

    def _call(self, message: tuple[Any, ...], timeout_s: float = 60.0) -> Any:
        self.conn.send(message)
        return self._reply(message, timeout_s)

    # ---------------------------------------------------------------- methods

    def request_bytes(self, blocks: int) -> int:
        return sum(r.block_len for r in self.regions) * blocks

    def strategy_for(self, p_ids: list[int], d_ids: list[int]) -> str:
        """What the built-in strategy rule picks for this request."""
        from kvpush.core.types import PushJob, ReadSpec
        from kvpush.plugins.strategy import choose

        assert self.sender.metadata is not None
        job = PushJob(
            local=self.sender.metadata, decode_tp_size=1, local_block_ids=[p_ids], remote_block_ids=[d_ids]
        )
        return choose(job, ReadSpec(dst_tp_rank=0, local_block_ids=[p_ids], remote_block_ids=[d_ids]))

    def prepare(self, method: str, p_ids: list[int], d_ids: list[int]) -> Callable[[], float]:
        """Everything a rep needs before its clock starts; returns the timed part."""
        self.settle()
        timeout = self.spec.timeout_s
        if method == "raw_nixl":
            from kvpush.core.planning import descriptor_ids

            groups = [0] * len(self.regions)
            lids = descriptor_ids(self.regions, groups, (tuple(p_ids),))
            rids = descriptor_ids(self.regions, groups, (tuple(d_ids),))
            tag = f"raw-{next(self._ids)}".encode()
            self.conn.send(("raw_wait", tag, timeout))

            def raw() -> float:
                start = time.perf_counter()
                self.raw.write(lids, rids, tag, timeout)
                self._reply(("raw_wait",), timeout)
                return time.perf_counter() - start

            return raw
        if method == "raw_contig":
            from kvpush.core.planning import descriptor_ids

            groups = [0] * len(self.regions)
            ids = (tuple(range(len(p_ids))),)
            lids = descriptor_ids(self.regions, groups, ids)
            tag = f"rawc-{next(self._ids)}".encode()
            self.conn.send(("raw_wait", tag, timeout))

            def raw_contig() -> float:
                start = time.perf_counter()
                self.raw.write(lids, lids, tag, timeout)
                self._reply(("raw_wait",), timeout)
                return time.perf_counter() - start

            return raw_contig
        if method == "ceiling":
            from kvpush.core.kernels import copier_for

            if self.ceiling_regions is None:
                raise ValueError("the ceiling method needs CUDA caches (and the nixl pair)")
            copier = copier_for(self.spec.device)
            src, dst, lengths = self._ceiling_spans(p_ids, d_ids)

            def ceiling() -> float:
                start = time.perf_counter()
                copier.copy(src, dst, lengths, timed=True)
                elapsed = time.perf_counter() - start
                self.ceiling_gpu_s = (copier.gpu_ms() or 0.0) / 1e3
                return elapsed

            return ceiling
        if method == "copy":
            packer = self.packer
            size = self.regions[0].block_len * len(p_ids)
            offsets = [i * size for i in range(len(self.regions))]
            packer.copy(self.copy_buffer, offsets, self.regions, (tuple(p_ids),), (0, 1), gather=True)

            def copy() -> float:
                start = time.perf_counter()
                packer.copy(self.copy_buffer, offsets, self.regions, (tuple(p_ids),), (0, 1), gather=True)
                return time.perf_counter() - start

            return copy
        if method not in (*STRATEGIES, "cuda_ipc"):
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
        rid = f"{method}-{next(self._ids)}"
        key = f"x-{rid}"
        self._call(("add", rid, d_ids, {**self.params, "transfer_id": key, "remote_request_id": rid}))
        self._until(self._registration_stashed, "PUSH_REG")
        self.force.name = "direct" if method == "cuda_ipc" else method
        self.conn.send(("wait", rid, timeout))

        def push() -> float:
            self.trace.clear()
            start = time.perf_counter()
            self.sender.request_finished(rid, [p_ids], match_key=key)
            self._reply(("wait",), timeout + 5)
            end = time.perf_counter()
            self._unsettled = rid
            if self.trace.get("posted") and self.trace.get("done"):
                marks = (start, self.trace["post"], self.trace["posted"], self.trace["done"], end)
                steps = [1e3 * (b - a) for a, b in itertools.pairwise(marks)]
                self.traces.setdefault(method, []).append(steps)
            return end - start

        return push

    def pack_times(self) -> dict[str, list[float]]:
        """D's ``PACK_TIMES`` (seconds, calls) so far."""
        return self._call(("stats",))["pack_times"]

    def _registration_stashed(self) -> bool:
        """D's PUSH_REG reached P's core (one request at a time: one stashed registration)."""
        core = self.sender.core
        return core is not None and core.state_sizes()["stashed"] >= 1

    def settle(self) -> None:
        """Wait (bounded) until P reported the last push sent (its staging is free again)."""
        rid, self._unsettled = self._unsettled, None
        if rid is not None:
            self._until(lambda: self._sender_done(rid), f"P to report {rid} sent")

    def _sender_done(self, rid: str) -> bool:
        got = self.sender.get_finished()
        if got.failed:
            raise RuntimeError(f"P failed: {got.failed}")
        self._sent.update(got.sent)
        if rid in self._sent:
            self._sent.discard(rid)
            return True
        return False

    def _until(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench: no {what} within {self.spec.timeout_s}s")
            time.sleep(0.0005)

    def run(self, method: str, p_ids: list[int], d_ids: list[int]) -> float:
        """One rep of ``method``: seconds from the request's start to D's acknowledgement."""
        return self.prepare(method, p_ids, d_ids)()

    def verify(self, method: str, p_ids: list[int], d_ids: list[int]) -> None:
        """Zero D's blocks, run one rep, and check every block's bytes arrived (sums per block)."""
        if method == "ceiling":
            import torch

            index = torch.tensor(d_ids, device=next(iter(self.ceiling_caches.values())).device)
            for tensor in self.ceiling_caches.values():
                tensor.index_fill_(1, index, 0)
            # zeroed before the copy runs (the copier's stream waits for no other stream)
            torch.cuda.synchronize(index.device)
            self.run(method, p_ids, d_ids)
            if not np.array_equal(
                _block_sums(self.caches, p_ids).numpy(), _block_sums(self.ceiling_caches, d_ids)
            ):
                raise AssertionError("ceiling: the kernel's copy does not hold P's bytes")
            return
        if method == "raw_contig":
            return  # D's blocks 0..n-1 hold P's 0..n-1 (checked by the contiguous rows of raw_nixl)
        self._call(("zero", d_ids))
        self.run(method, p_ids, d_ids)
        self.settle()
        want = _block_sums(self.caches, p_ids).numpy()
        got = self._call(("sums", d_ids))
        if not np.array_equal(want, got):
            bad = int(np.argwhere(want != got)[0][0])
            raise AssertionError(f"{method}: D's blocks do not hold P's bytes (first bad layer {bad})")
        if method == "cuda_ipc" and not getattr(self.sender.transport, "ipc_writes", 0):
            reasons = getattr(self.sender.transport, "fallbacks", {})
            raise AssertionError(f"cuda_ipc: P posted no IPC copy; it fell back to NIXL: {reasons}")

    def default_strategy(self, p_ids: list[int], d_ids: list[int]) -> str:
        """What the plugin chain picks for this request (nothing pinned)."""
        from kvpush.core.types import PushJob, ReadSpec

        assert self.sender.metadata is not None
        job = PushJob(
            local=self.sender.metadata, decode_tp_size=1, local_block_ids=[p_ids], remote_block_ids=[d_ids]
        )
        spec = ReadSpec(dst_tp_rank=0, local_block_ids=[p_ids], remote_block_ids=[d_ids])
        saved, self.force.name = self.force.name, None
        try:
            return self.pm.transfer_strategy(job, spec, len(p_ids) * len(self.regions))
        finally:
            self.force.name = saved

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self._call(("stop",), 10)
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
        if self.sender is not None:
            self.sender.close()
        self.p_server.close()
        self.d_server.close()

    def __enter__(self) -> BenchPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [os.getpid(), self.process.pid or 0]


# ------------------------------------------------------------------------------ sweep


def _group_shapes(
    shapes: Sequence[str] | None,
    block_bytes: Sequence[int],
    block_counts: Sequence[int],
    patterns: Sequence[str],
    layers: int,
) -> list[tuple[int, int, list[tuple[int, str, str]]]]:
    """``[(layers, block bytes, [(blocks, pattern, label), ...]), ...]``: one pair of
    processes per (layers, block bytes)."""
    groups: dict[tuple[int, int], list[tuple[int, str, str]]] = {}
    if shapes:
        names: list[str] = []
        for name in shapes:
            if name in SHAPE_GROUPS:
                names += SHAPE_GROUPS[name]
            elif name in SHAPES:
                names.append(name)
            else:
                raise ValueError(f"unknown --shape {name!r}; choose from {sorted({*SHAPES, *SHAPE_GROUPS})}")
        for name in dict.fromkeys(names):
            n_layers, size, blocks = SHAPES[name]
            groups.setdefault((n_layers, size), []).append((blocks, "scattered", name))
    else:
        for size in block_bytes:
            groups[(layers, size)] = [(b, p, "") for b, p in itertools.product(block_counts, patterns)]
    return [(n_layers, size, rows) for (n_layers, size), rows in groups.items()]


def sweep(
    *,
    device: str = "cpu",
    decode_device: str | None = None,
    block_bytes: Sequence[int] = BLOCK_BYTES,
    block_counts: Sequence[int] = BLOCK_COUNTS,
    patterns: Sequence[str] = PATTERNS,
    methods: Sequence[str] = METHODS,
    layers: int = 16,
    reps: int = 5,
    seed: int = 0,
    shapes: Sequence[str] | None = None,
    pipeline_bytes: int = 0,
    nixl_options: dict[str, Any] | None = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> list[dict[str, Any]]:
    """Measure every shape; one row per (block size, blocks, pattern), medians of ``reps``.

    On CUDA the ``cuda_ipc`` method runs in a second pair of processes whose transport is
    ``cuda_ipc``; every other method in the first (NIXL). ``pipeline_bytes`` adds the
    ``packed_pipe`` method: packed with VRAM WRITEs cut into chunks of that many bytes (gather
    of chunk i+1 overlapping the WRITE of chunk i).
    """
    from kvpush.core import packing

    if not device.startswith("cuda"):
        methods = [m for m in methods if m not in GPU_METHODS]
    methods = list(methods) + (["packed_pipe"] if pipeline_bytes else [])
    rows = []
    for n_layers, size, shapes_ in _group_shapes(shapes, block_bytes, block_counts, patterns, layers):
        max_blocks = max(b for b, _, _ in shapes_)
        staging = 2 * n_layers * size * max_blocks + (1 << 20)
        times: dict[tuple[int, str], dict[str, list[float]]] = {(b, p): {} for b, p, _ in shapes_}
        picks: dict[tuple[int, str], dict[str, str]] = {(b, p): {} for b, p, _ in shapes_}
        loads: dict[tuple[int, str], float] = {}
        trace_rows: dict[tuple[int, str], dict[str, list[float]]] = {}
        pack_rows: dict[tuple[int, str], dict[str, float]] = {}
        by_transport = [("nixl", [m for m in methods if m != "cuda_ipc"])]
        if "cuda_ipc" in methods:
            by_transport.append(("cuda_ipc", ["cuda_ipc"]))
        for transport, pair_methods in by_transport:
            spec = PairSpec(
                block_bytes=size,
                layers=n_layers,
                pool_blocks=2 * max_blocks,
                device=device,
                decode_device=decode_device,
                staging_bytes=staging,
                transport=transport,
                nixl_options=dict(nixl_options or {}),
            )
            say(
                f"block {size // 1024} KiB: starting P and D over {transport} "
                f"({2 * n_layers} regions x {2 * max_blocks} blocks)"
            )
            with BenchPair(spec) as pair:
                for blocks, pattern, _ in shapes_:
                    p_ids, d_ids = block_tables(blocks, spec.pool_blocks, pattern, seed)
                    for method in pair_methods:
                        if method not in ("copy", "packed_pipe"):
                            pair.verify(method, p_ids, d_ids)  # also the warm-up rep
                    got = times[(blocks, pattern)]
                    before = (pair.pack_times(), {k: list(v) for k, v in PACK_TIMES.items()})
                    since = snapshot(pair.pids)
                    for _ in range(reps):
                        for method in pair_methods:
                            if method == "packed_pipe":
                                saved, packing.VRAM_CHUNK_BYTES = packing.VRAM_CHUNK_BYTES, pipeline_bytes
                                try:
                                    got.setdefault(method, []).append(pair.run("packed", p_ids, d_ids))
                                    pair.settle()
                                finally:
                                    packing.VRAM_CHUNK_BYTES = saved
                            else:
                                got.setdefault(method, []).append(pair.run(method, p_ids, d_ids))
                            if method == "ceiling":  # its device time alone (upload + kernel)
                                got.setdefault("ceiling_kernel", []).append(pair.ceiling_gpu_s)
                    key = (blocks, pattern)
                    for method, steps in pair.traces.items():
                        trace_rows.setdefault(key, {})[method] = [
                            round(statistics.median(col), 3) for col in zip(*steps)
                        ]
                    pair.traces.clear()
                    after = (pair.pack_times(), PACK_TIMES)
                    pack_rows[key] = {
                        f"{side}_{kind}": round(
                            1e3 * (a[kind][0] - b[kind][0]) / (a[kind][1] - b[kind][1]), 3
                        )
                        for side, a, b in (("d", after[0], before[0]), ("p", after[1], before[1]))
                        for kind in ("gather", "scatter")
                        if a[kind][1] > b[kind][1]
                    } or pack_rows.get(key, {})
                    loads[key] = max(loads.get(key, 0.0), foreign_cores(since, pair.pids))
                    picks[key][transport] = pair.default_strategy(p_ids, d_ids)
        for blocks, pattern, label in shapes_:
            key = (blocks, pattern)
            row: dict[str, Any] = {
                "shape": label or None,
                "layers": n_layers,
                "block_bytes": size,
                "blocks": blocks,
                "pattern": pattern,
                "bytes": 2 * n_layers * size * blocks,
                "descriptors": 2 * n_layers * blocks,
            }
            for method in (*METHODS, "packed_pipe", "ceiling_kernel"):
                med = statistics.median(times[key][method]) if times[key].get(method) else None
                row[f"{method}_gbps"] = row["bytes"] / med / 1e9 if med else None
                row[f"{method}_ms"] = med * 1e3 if med else None
            row["pipeline_bytes"] = pipeline_bytes or None
            chosen = picks[key].get("nixl", "direct")
            row["strategy"] = chosen
            row["default_gbps"] = row.get(f"{chosen}_gbps")
            if "cuda_ipc" in picks[key]:  # the same-host default: the cuda_ipc transport's pick
                row["strategy_cuda_ipc"] = picks[key]["cuda_ipc"]
                row["default_gbps"] = row["cuda_ipc_gbps"] if picks[key]["cuda_ipc"] == "direct" else None
            row["foreign_cores"] = round(loads.get(key, 0.0), 2)
            # per kvpush method, median ms of: finish -> first post, the posts, posted -> WRITEs
            # settled on P, settled -> D's acknowledgement reached P
            row["trace_ms"] = trace_rows.get(key, {})
            row["pack_copy_ms"] = pack_rows.get(key, {})  # mean wall ms of one Packer.copy, P and D
            rows.append(row)
            say(_row_line(row))
    return rows


def ratios(row: dict[str, Any]) -> dict[str, float | None]:
    def div(a: Any, b: Any) -> float | None:
        return a / b if a and b else None

    best = max((row.get(f"{s}_gbps") or 0.0) for s in (*STRATEGIES, "cuda_ipc")) or None
    return {
        "direct_vs_raw": div(row.get("direct_gbps"), row.get("raw_nixl_gbps")),
        "packed_vs_raw": div(row.get("packed_gbps"), row.get("raw_nixl_gbps")),
        "default_vs_best": div(row.get("default_gbps"), best),
        "default_vs_raw": div(row.get("default_gbps"), row.get("raw_nixl_gbps")),
        "default_vs_contig": div(row.get("default_gbps"), row.get("raw_contig_gbps")),
        "packed_vs_contig": div(row.get("packed_gbps"), row.get("raw_contig_gbps")),
        "packed_vs_copy": div(row.get("packed_gbps"), row.get("copy_gbps")),
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = (
    ("raw", "raw_nixl_gbps"),
    ("rawC", "raw_contig_gbps"),
    ("direct", "direct_gbps"),
    ("packed", "packed_gbps"),
    ("pipe", "packed_pipe_gbps"),
    ("ipc", "cuda_ipc_gbps"),
    ("ceil", "ceiling_gbps"),
    ("ceilK", "ceiling_kernel_gbps"),
    ("copy", "copy_gbps"),
)
HEADER = (
    f"{'shape':>15}{'block':>6}{'blocks':>7}{'pattern':>11}{'MiB':>8}"
    + "".join(f"{name:>8}" for name, _ in COLUMNS)
    + f"{'dir/raw':>9}{'def/raw':>9}{'def/rawC':>9}{'default':>9}{'def/best':>9}{'load':>6}"
)


def _row_line(row: dict[str, Any]) -> str:
    r = ratios(row)
    default = row["strategy"] if "strategy_cuda_ipc" not in row else f"ipc:{row['strategy_cuda_ipc']}"
    return (
        f"{row.get('shape') or '-':>15}{row['block_bytes'] // 1024:>5}K{row['blocks']:>7}{row['pattern']:>11}"
        f"{row['bytes'] / 2**20:>8.1f}"
        + "".join(f"{_fmt(row.get(key), '.2f'):>8}" for _, key in COLUMNS)
        + f"{_fmt(r['direct_vs_raw'], '.2f'):>9}{_fmt(r['default_vs_raw'], '.1f'):>9}"
        f"{_fmt(r['default_vs_contig'], '.2f'):>9}{default:>9}"
        f"{_fmt(r['default_vs_best'], '.2f'):>9}{row['foreign_cores']:>6.2f}"
    )


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    print(HEADER, file=out)
    print("-" * len(HEADER), file=out)
    for row in rows:
        print(_row_line(row), file=out)


# ------------------------------------------------------------------------------ CLI


def _key_value(text: str) -> tuple[str, Any]:
    from kvpush.demo.runner import _key_value as parse

    return parse(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the KV caches live")
    parser.add_argument(
        "--decode-device",
        default=None,
        help="D's device, e.g. cuda:1 to push across NVLink (default: the same as P's)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=None,
        help="measure only this kvpush strategy (default: both, and report the built-in choice)",
    )
    parser.add_argument(
        "--block-bytes", type=int, action="append", help=f"repeatable (default {BLOCK_BYTES})"
    )
    parser.add_argument("--blocks", type=int, action="append", help=f"repeatable (default {BLOCK_COUNTS})")
    parser.add_argument("--pattern", choices=PATTERNS, action="append", help="repeatable (default: both)")
    parser.add_argument("--layers", type=int, default=16, help="model layers; 2 regions each (default 16)")
    parser.add_argument("--reps", type=int, default=5, help="timed reps per method and shape (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shape",
        action="append",
        choices=sorted({*SHAPES, *SHAPE_GROUPS}),
        help="repeatable: run named model-geometry presets (scattered) instead of the grid",
    )
    parser.add_argument(
        "--method",
        action="append",
        choices=METHODS,
        help="repeatable: measure only these methods (default: all that apply to the device)",
    )
    parser.add_argument(
        "--pipeline-mib",
        type=int,
        default=0,
        help="also measure packed with VRAM WRITEs cut into chunks of this many MiB (packed_pipe)",
    )
    parser.add_argument(
        "--nixl-option",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="an option of kvpush's NIXL transport (under cuda_ipc: of the NIXL transport it "
        "wraps), e.g. progress_thread=true; VALUE read as JSON when it parses; repeatable",
    )
    from kvpush.demo import serve

    serve.add_arguments(parser)
    parser.add_argument(
        "--serve",
        action="store_true",
        help="serving-shaped load (Poisson arrivals, model presets) instead of the sweep; see demo/serve.py",
    )


def main(args: argparse.Namespace) -> int:
    if getattr(args, "serve", False):
        from kvpush.demo import serve

        return serve.main(args)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    methods = [
        m
        for m in args.method or METHODS
        if args.strategy is None or m not in STRATEGIES or m == args.strategy
    ]
    started = time.monotonic()
    try:
        rows = sweep(
            device=device,
            decode_device=args.decode_device,
            block_bytes=args.block_bytes or BLOCK_BYTES,
            block_counts=args.blocks or BLOCK_COUNTS,
            patterns=args.pattern or PATTERNS,
            methods=methods,
            layers=args.layers,
            reps=args.reps,
            seed=args.seed,
            shapes=args.shape,
            pipeline_bytes=args.pipeline_mib << 20,
            nixl_options=dict(args.nixl_option),
            say=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    except Exception as err:
        traceback.print_exc()
        print(f"kvpush bench failed: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {"device": device, "decode_device": args.decode_device or device, "rows": rows}, indent=2
            )
        )
    else:
        print_table(rows)
        print(
            f"\n{len(rows)} shapes in {time.monotonic() - started:.0f}s on {device}; GB/s = request bytes / "
            f"(start of request -> D acknowledges); load = foreign CPU cores busy"
        )
    return 0
