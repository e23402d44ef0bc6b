"""``kvpush bench --serve``: serving-shaped load at real model geometry.

Requests arrive open-loop (Poisson at ``--rate`` per second) with prompt lengths drawn from a
log-normal distribution (``--median-tokens``, ``--sigma``, capped at ``--max-tokens``) or a
fixed list (``--tokens``). By default this process is P (a real :class:`PushSender`, TP1, PP1)
and a spawned process is D (a real :class:`PushReceiver`, TP1), at one rank's geometry. Both
allocate each request's blocks at random from a churned pool, the way a paged cache does
(blocks return to the pool as requests end).

Per request: at arrival D registers it (its ``PUSH_REG`` goes to P); ``--prefill-ms`` later
P's "prefill" finishes (``request_finished``; no compute is simulated) and the clock starts;
the clock stops when D's receiver reports the request done, i.e. decode may start (both
clocks are ``CLOCK_MONOTONIC`` of one host). That interval is the **added latency** kvpush
owns in time-to-first-token. Every ``--verify-every``-th request is filled with a pattern on
P before its finish and checked block by block on D (the sample rate is reported).

The same arrivals and prompt lengths are replayed against the **ideal** (``--ideal``,
repeatable): ``nixl`` (default), a raw NIXL WRITE of the request's per-block descriptors (posted
at the finish, one notification, as a connector that needs nothing else would do); ``kernel``
(CUDA only), one kernel copying the request's blocks in P's process into a second allocation
on D's device (:mod:`kvpush.demo.serve_kernel`).

``--prefill-pp``/``--prefill-tp``/``--decode-tp`` run P as PP x TP rank processes and D as TP
rank processes instead (:mod:`kvpush.demo.serve_ranks`, on the demo's rank machinery): the
model then has the preset's KV heads x its TP, each rank holds its slice, the clock runs from
the earliest P rank's finish to the last D rank's done, every D rank verifies the samples, and
the ideals post the same per-(P rank, D rank) WRITEs (or one kernel per P rank).

``--sweep`` doubles the rate from ``--rate`` until p99 exceeds ``--p99-factor`` x the
unloaded p50 (the first rate's) or the achieved rate falls below 90 % of the offered one,
and reports the **knee** (the highest rate that kept p99 under that bound). ``--plot FILE``
writes latency against offered rate as a PNG (matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16},
    "llama3-70b-tp8": {"layers": 80, "kv_heads": 1, "head_dim": 128, "block_size": 16, "tp": 8},
    "deepseek-v3-mla": {"layers": 61, "attention": "mla", "head_dim": 576, "block_size": 16},
    "hybrid": {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "window_tokens": 1024},
}
"""KV geometry per rank: Llama-3-8B (32 layers, 8 KV heads x 128, bf16, block 16); Llama-3-70B
at TP8 (80 layers, 1 KV head per rank); a DeepSeek-V3-like MLA (61 layers, latent 576); a
hybrid of full and sliding-window layers (alternating, window ``window_tokens``). ``kv_heads`` is
per rank at the preset's TP (``tp``, default 1): the model has ``kv_heads x tp`` KV heads, which
a multi-rank run (``--prefill-tp``/``--decode-tp``) slices over its ranks."""


@attrs.frozen(kw_only=True)
class Workload:
    preset: str = "llama3-8b"
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    block_size: int | None = None
    median_tokens: int = 256
    sigma: float = 0.6
    max_tokens: int = 2048
    tokens: tuple[int, ...] = ()
    requests: int = 100
    prefill_ms: float = 2.0
    verify_every: int = 4
    pool_blocks: int = 0
    device: str = "cpu"
    decode_device: str | None = None
    transport: str = "nixl"
    nixl_options: dict[str, Any] = attrs.field(factory=dict, hash=False)
    """Options of kvpush's NIXL transport (``--nixl-option``; under ``cuda_ipc``, of the NIXL
    transport it wraps)."""
    seed: int = 0
    poll_s: float = 50e-6
    timeout_s: float = 30.0
    switch_interval_us: float = 0.0
    """When > 0, ``sys.setswitchinterval`` of P and D (how soon a thread waiting for the GIL
    gets it from a busy one; Python's default is 5000 us)."""
    prefill_pp: int | None = None
    prefill_tp: int | None = None
    decode_tp: int | None = None
    """Multi-rank topology (``--prefill-pp``/``--prefill-tp``/``--decode-tp``; unset ones are 1):
    P as PP x TP rank processes, D as TP rank processes (:mod:`kvpush.demo.serve_ranks`). All
    None: one P rank in this process and one D process at per-rank geometry (a rank pair of the
    preset's TP)."""

    def rank_devices(self) -> tuple[list[str], list[str]]:
        """Devices of P's and D's ranks: ``device`` and ``decode_device`` may list several,
        comma-separated (multi-rank only), handed out round-robin (P stage-major)."""
        p = [d.strip() for d in self.device.split(",") if d.strip()]
        d = [x.strip() for x in (self.decode_device or self.device).split(",") if x.strip()]
        if not p or not d:
            raise ValueError("--device/--decode-device: no device given")
        if not self.multi_rank and (len(p) > 1 or len(d) > 1):
            raise ValueError(
                "a device list (cuda:0,cuda:1) needs a multi-rank run; add --prefill-tp/--decode-tp"
            )
        return p, d

    @property
    def multi_rank(self) -> bool:
        return any(v is not None for v in (self.prefill_pp, self.prefill_tp, self.decode_tp))

    def topology(self) -> tuple[int, int, int]:
        """``(prefill PP, prefill TP, decode TP)``, checked against the model."""
        from kvpush.core.producers import tp_ratio

        pp, ptp, dtp = (v if v is not None else 1 for v in (self.prefill_pp, self.prefill_tp, self.decode_tp))
        for name, value in (("prefill-pp", pp), ("prefill-tp", ptp), ("decode-tp", dtp)):
            if value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}")
        try:
            tp_ratio(ptp, dtp)
        except Exception as err:
            raise ValueError(f"--prefill-tp {ptp} and --decode-tp {dtp}: one must divide the other") from err
        geo = self.geometry()
        if pp > geo["layers"]:
            raise ValueError(f"--prefill-pp {pp} exceeds the model's {geo['layers']} layers")
        if geo.get("attention") != "mla":
            heads = geo.get("kv_heads", 1) * (geo.get("tp", 1) if self.multi_rank else 1)
            for name, tp in (("prefill-tp", ptp), ("decode-tp", dtp)):
                if heads % tp:
                    raise ValueError(
                        f"--{name} {tp} does not divide the model's {heads} KV heads "
                        f"(--kv-heads {geo.get('kv_heads', 1)} per rank x preset TP {geo.get('tp', 1)})"
                    )
        return pp, ptp, dtp

    def geometry(self) -> dict[str, Any]:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown --preset {self.preset!r}; choose from {sorted(PRESETS)}")
        geo = dict(PRESETS[self.preset])
        for name in ("layers", "kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if value is not None:
                if value <= 0:
                    raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
                geo[name] = value
        return geo

    def model(self) -> Any:
        from kvpush.core.types import ModelSpec

        geo = self.geometry()
        layers = geo["layers"]
        heads = geo.get("kv_heads", 1)
        if self.multi_rank and geo.get("attention") != "mla":
            heads *= geo.get("tp", 1)  # the whole model; each rank holds its slice
        extra: dict[str, Any] = {}
        if "window_tokens" in geo:
            extra = {
                "layer_groups": [i % 2 for i in range(layers)],
                "layer_kinds": ["full" if i % 2 == 0 else "sliding_window" for i in range(layers)],
            }
        return ModelSpec(
            name=f"serve-{self.preset}",
            num_layers=layers,
            attention=geo.get("attention", "mha"),
            num_kv_heads=heads,
            head_dim=geo["head_dim"],
            block_size=geo["block_size"],
            **extra,
        )

    @property
    def layout(self) -> str:
        return "hma" if "window_tokens" in self.geometry() else "uniform"

    def blocks_per_group(self, tokens: int) -> list[int]:
        """Blocks a prompt of ``tokens`` needs in each KV-cache group."""
        geo = self.geometry()
        full = -(-tokens // geo["block_size"])
        if "window_tokens" not in geo:
            return [full]
        return [full, min(full, -(-geo["window_tokens"] // geo["block_size"]) + 1)]

    def prompt_lengths(self) -> list[int]:
        rng = np.random.default_rng(self.seed)
        if self.tokens:
            return [self.tokens[i % len(self.tokens)] for i in range(self.requests)]
        draws = rng.lognormal(np.log(self.median_tokens), self.sigma, self.requests)
        return [int(x) for x in np.clip(np.round(draws), 1, self.max_tokens)]

    def max_request_bytes(self) -> int:
        """Bytes of the longest prompt on one rank (an upper bound for hybrid models and for
        the larger-TP side of a multi-rank run)."""
        geo = self.geometry()
        tokens = max(self.tokens) if self.tokens else self.max_tokens
        sides = 1 if geo.get("attention") == "mla" else 2
        heads = geo.get("kv_heads", 1)
        if self.multi_rank and geo.get("attention") != "mla":
            _, ptp, dtp = self.topology()
            heads = heads * geo.get("tp", 1) // min(ptp, dtp)
        per_block = sides * heads * geo["head_dim"] * geo["block_size"] * 2
        return geo["layers"] * per_block * max(self.blocks_per_group(tokens))

    def pool(self) -> list[int]:
        """Blocks per group of each side's pool (default: room for ~16 of the longest prompts)."""
        need = self.blocks_per_group(self.max_tokens if not self.tokens else max(self.tokens))
        if self.pool_blocks:
            if self.pool_blocks < max(need):
                raise ValueError(
                    f"--pool-blocks {self.pool_blocks} cannot hold one prompt ({max(need)} blocks)"
                )
            return [self.pool_blocks for _ in need]
        return [16 * n for n in need]


class BlockPool:
    """Free block ids handed out at random (a churned paged-cache pool)."""

    def __init__(self, size: int, seed: int) -> None:
        self.free = list(range(size))
        self.rng = np.random.default_rng(seed)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        picks = self.rng.choice(len(self.free), n, replace=False)
        taken = [self.free[i] for i in picks]
        for i in sorted(picks.tolist(), reverse=True):
            self.free[i] = self.free[-1]
            self.free.pop()
        return taken

    def release(self, ids: Sequence[int]) -> None:
        self.free.extend(ids)


# ------------------------------------------------------------------------------ content


def pattern(request: int, regions: int, blocks: int) -> np.ndarray:
    """int16 fill value of block ``j`` of region ``r`` of request ``request``: ``[r, j]``."""
    r = np.arange(regions, dtype=np.int64)[:, None]
    j = np.arange(blocks, dtype=np.int64)[None, :]
    return (((request * 131 + r * 31 + j * 7) % 30_000) + 1).astype(np.int16)


def _request_of(value: int, region: int, block: int) -> int:
    """The request (mod 30,000) whose :func:`pattern` is ``value`` at ``[region, block]``."""
    return (pow(131, -1, 30_000) * (value - 1 - region * 31 - block * 7)) % 30_000


class Content:
    """Writes (P) or checks (D) the pattern of a request's blocks with one gather or scatter
    launch (:class:`kvpush.core.packing.Packer`) against a buffer of the expected bytes."""

    def __init__(self, regions: Sequence[Any], max_bytes: int, device: str) -> None:
        import torch

        from kvpush.core.packing import Packer

        self.regions = list(regions)
        self.packer = Packer(self.regions)
        self.buffer = torch.zeros(max_bytes + 256, dtype=torch.uint8, device=device)
        self.device = device

    def _expected(self, request: int, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], Any]:
        import torch

        counts = np.array([len(block_ids[r.kv_group]) for r in self.regions], dtype=np.int64)
        sizes = np.array([r.block_len for r in self.regions], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(counts * sizes)[:-1])).tolist()
        values = pattern(request, len(self.regions), int(counts.max()))
        flat = np.concatenate([values[r, : counts[r]] for r in range(len(self.regions))])
        repeats = torch.from_numpy(np.repeat(sizes // 2, counts)).to(self.device)
        return offsets, torch.repeat_interleave(torch.from_numpy(flat).to(self.device), repeats)

    def _ids(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(ids) for ids in block_ids)

    def fill(self, request: int, block_ids: Sequence[Sequence[int]]) -> None:
        import torch

        offsets, expected = self._expected(request, block_ids)
        self.buffer[: 2 * expected.numel()].view(expected.dtype).copy_(expected)
        if self.buffer.is_cuda:
            # The scatter runs on the packer's own stream and waits for nothing: without this
            # it could read the buffer before the copy above wrote it, and the blocks got the
            # previous sample's bytes (seen on the H200: 7 of 300 samples at 100-150 req/s).
            torch.cuda.current_stream(self.buffer.device).synchronize()
        self.packer.copy(self.buffer, offsets, self.regions, self._ids(block_ids), (0, 1), gather=False)

    def check(self, request: int, block_ids: Sequence[Sequence[int]]) -> bool:
        import torch

        offsets, expected = self._expected(request, block_ids)
        self.packer.copy(self.buffer, offsets, self.regions, self._ids(block_ids), (0, 1), gather=True)
        return bool(torch.equal(self.buffer[: 2 * expected.numel()].view(expected.dtype), expected))

    def miss(self, request: int, block_ids: Sequence[Sequence[int]]) -> str | None:
        """None if the request's blocks hold its pattern, else what they hold instead: how many
        blocks are wrong, and for the first few the value found and the request whose pattern
        has that value at that position (a block of another request, P's stale bytes, or a
        torn copy when the block is not one value)."""
        import torch

        if self.check(request, block_ids):
            return None
        counts = [len(block_ids[r.kv_group]) for r in self.regions]
        values = pattern(request, len(self.regions), max(counts))
        got = self.buffer.view(torch.int16)
        wrong: list[str] = []
        total = position = 0
        for r, (region, count) in enumerate(zip(self.regions, counts)):
            half = region.block_len // 2
            for j in range(count):
                block = got[position // 2 : position // 2 + half]
                position += region.block_len
                low, high = int(block.min()), int(block.max())
                if low == high == int(values[r, j]):
                    continue
                total += 1
                if len(wrong) < 4:
                    ids = block_ids[region.kv_group]
                    found = f"{low}" if low == high else f"{low}..{high} (torn)"
                    wrong.append(
                        f"region {r} block {j} (id {ids[j]}): {found}, expected {int(values[r, j])}"
                        f" (pattern of request {_request_of(low, r, j)})"
                    )
        return f"{total} of {sum(counts)} blocks wrong: " + "; ".join(wrong)


WAKE_S = 1e-3
"""Longest D's loop sleeps on its receiver while requests are in flight (a new registration
waits at most this; requests' ends wake it at once)."""


class DeferredChecks:
    """Sampled requests to verify later, when nothing is in flight: a check (a gather and a
    compare, host-synchronous) run the moment a request ends would hold up the loop that stamps
    the next requests' ends, and the samples' neighbours would carry its time as added latency
    (the slowest requests of a run were the ones right after a sample). The checked request's
    blocks stay allocated until its check, so nothing can overwrite them first."""

    def __init__(self, check: Callable[[int, list[list[int]]], str | None]) -> None:
        """``check(number, blocks)``: None if the sample holds its bytes, else what is wrong."""
        self.check = check
        self.queue: list[tuple[str, int, list[list[int]]]] = []

    def __bool__(self) -> bool:
        return bool(self.queue)

    def add(self, rid: str, number: int, blocks: list[list[int]]) -> None:
        self.queue.append((rid, number, blocks))

    def run_one(self, report: Callable[[str, str | None, list[list[int]]], None]) -> None:
        """Check the oldest held sample and ``report(rid, miss, blocks)`` (miss None: ok)."""
        rid, number, blocks = self.queue.pop(0)
        report(rid, self.check(number, blocks), blocks)

    def run_all(self, report: Callable[[str, str | None, list[list[int]]], None]) -> None:
        while self.queue:
            self.run_one(report)


# ------------------------------------------------------------------------------ D


def _worker_config(w: Workload, engine: str, port: int, device: str) -> Any:
    from kvpush.core.types import ParallelConfig
    from kvpush.core.worker import WorkerConfig
    from kvpush.demo.bench import nixl_transport_options

    model = w.model()
    cuda = int(device.split(":")[1]) if device.startswith("cuda:") else None
    return WorkerConfig(
        engine_id=engine,
        parallel=ParallelConfig(tp_size=1, num_layers=model.num_layers),
        model=model,
        layout=w.layout,
        side_channel_port=port,
        busy_poll_s=w.poll_s,
        staging_bytes=max(64 << 20, 4 * w.max_request_bytes()),
        request_timeout_s=w.timeout_s,
        cuda_device=cuda,
        transport=w.transport,
        transport_options=nixl_transport_options(w.transport, dict(w.nixl_options)),
    )


def _allocate(w: Workload, config: Any, device: str) -> dict[str, Any]:
    pool = w.pool()
    if w.layout == "hma":
        from kvpush.layouts.hma import allocate_hma_caches

        return allocate_hma_caches(config.model, config.parallel, pool, device=device)
    from kvpush.layouts.uniform import allocate_kv_caches

    return allocate_kv_caches(config.model, config.parallel, pool[0], device=device)


def _decode_main(w: Workload, port: int, conn: Connection) -> None:
    """D: register requests as they arrive, report each one's done time, verify samples."""
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        import torch

        from kvpush.core.errors import WaitTimeout
        from kvpush.core.receiver import PushReceiver
        from kvpush.core.types import RequestMetadata, TransferParams
        from kvpush.demo.bench import RawAgent

        if w.switch_interval_us > 0:
            sys.setswitchinterval(w.switch_interval_us / 1e6)
        device = w.decode_device or w.device
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        torch.set_num_threads(1)
        config = _worker_config(w, "serve-D", port, device)
        caches = _allocate(w, config, device)
        receiver = PushReceiver(config, caches)
        receiver.start()
        assert receiver.metadata is not None
        raw = RawAgent("serve-raw-D", receiver.metadata.regions)
        content = Content(receiver.metadata.regions, w.max_request_bytes(), device)
        pools = [BlockPool(n, w.seed + 1 + g) for g, n in enumerate(w.pool())]
        conn.send(("ready", (receiver.handshake_payload(), raw.metadata())))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    live: dict[str, tuple[int, list[list[int]], bool]] = {}
    unreleased: dict[str, list[list[int]]] = {}
    """Failed requests' blocks, held until the receiver reports them released."""
    raw_tags: dict[bytes, str] = {}
    got: Any = None  # results wait_finished already took from the receiver
    checks = DeferredChecks(lambda number, blocks: content.miss(number, blocks))

    def checked(rid: str, miss: str | None, blocks: list[list[int]]) -> None:
        for pool, ids_ in zip(pools, blocks):
            pool.release(ids_)
        conn.send(("verified", rid, miss is None, miss))

    try:
        while True:
            while conn.poll(0):
                message = conn.recv()
                kind = message[0]
                if kind == "stop":
                    return
                if kind == "check":  # P's run has ended: check every held sample now
                    checks.run_all(checked)
                    continue
                if kind == "connect":
                    raw.connect(message[1])
                elif kind == "add":  # (add, rid, number, blocks per group, params, verify, raw)
                    _, rid, number, counts, params, verify, is_raw = message
                    ids = [pool.alloc(n) for pool, n in zip(pools, counts)]
                    if any(i is None for i in ids) and checks:
                        for pool, taken in zip(pools, ids):  # the held samples first, then again
                            if taken is not None:
                                pool.release(taken)
                        checks.run_all(checked)
                        ids = [pool.alloc(n) for pool, n in zip(pools, counts)]
                    if any(i is None for i in ids):
                        for pool, taken in zip(pools, ids):
                            if taken is not None:
                                pool.release(taken)
                        conn.send(("failed", rid, time.monotonic(), "D's block pool is full"))
                        continue
                    blocks = [list(i) for i in ids if i is not None]
                    live[rid] = (number, blocks, verify)
                    if is_raw:
                        raw_tags[rid.encode()] = rid
                    else:
                        meta = RequestMetadata(
                            request_id=rid, block_ids=blocks, params=TransferParams.from_dict(params)
                        )
                        receiver.add_request(meta)
                    conn.send(("blocks", rid, blocks))
            finished: list[tuple[str, str | None]] = []
            if raw_tags:
                for messages in raw.agent.get_new_notifs().values():
                    for tag in messages:
                        rid = raw_tags.pop(bytes(tag), None)
                        if rid is not None:
                            finished.append((rid, None))
            if got is None:
                got = receiver.get_finished()
            finished += [(rid, None) for rid in got.done]
            finished += [(rid, str(reason)) for rid, reason in got.failed.items()]
            now = time.monotonic()  # every request of this batch finished by now
            # A kvpush request ended when the receiver's writer reported it (its stamp; the
            # same CLOCK_MONOTONIC as time.monotonic here), not when this loop looked.
            ended = dict(got.completed_at)
            released = list(got.released)
            got = None
            for rid, reason in finished:
                number, blocks, verify = live.pop(rid, (0, [], False))
                if reason is None and verify:  # checked once D is idle; its blocks held till then
                    checks.add(rid, number, blocks)
                elif reason is not None:  # a WRITE may still land: back once kvpush released it
                    unreleased[rid] = blocks
                else:
                    for pool, ids_ in zip(pools, blocks):
                        pool.release(ids_)
                state = "deferred" if reason is None and verify else None
                conn.send(("done", rid, ended.get(rid, now), reason, state))
            for rid in released:
                for pool, ids_ in zip(pools, unreleased.pop(rid, [])):
                    pool.release(ids_)
            if not finished:
                if not live and checks:
                    checks.run_one(checked)  # nothing in flight: no request's clock is running
                elif live and not raw_tags and not conn.poll(0):
                    # Sleep until the receiver reports an end (its condition wakes this at once)
                    # rather than asking every poll_s: a loop asking 20 k times a second takes the
                    # GIL from D's writer thread, and its end stamp lags by up to poll_s.
                    # A new registration waits at most WAKE_S (before its request's finish).
                    with contextlib.suppress(WaitTimeout):
                        got = receiver.wait_finished(WAKE_S)
                else:
                    conn.poll(w.poll_s)  # wakes at once for a new message
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        receiver.close()


# ------------------------------------------------------------------------------ P and the driver


@attrs.define
class Outcome:
    number: int
    rid: str
    tokens: int
    nbytes: int
    arrival: float = 0.0
    finish: float = 0.0
    done: float = 0.0
    failure: str | None = None
    verified: bool | str | None = None
    """True/False once checked; None if not sampled; "deferred" while D has yet to check it."""
    miss: str | None = None
    """What a sample that failed its check held instead of its bytes."""
    marks: dict[str, float] = attrs.Factory(dict)
    """P-side stamps of kvpush requests: first post starts, posts returned, WRITE settled."""


def schedule(
    w: Workload, rate: float, lengths: Sequence[int], prefix: str, start: float
) -> tuple[np.ndarray, list[Outcome]]:
    """One run's open-loop arrivals (Poisson at ``rate``, seeded by the workload and the rate, so
    every method replays the same ones; the first at ``start``) and a fresh outcome per request."""
    rng = np.random.default_rng(w.seed + int(rate * 1000))
    gaps = rng.exponential(1.0 / rate, len(lengths))
    arrivals = start + np.cumsum(gaps) - gaps[0]
    outcomes = [
        Outcome(number=i, rid=f"{prefix}-{rate:g}-{i}", tokens=t, nbytes=0) for i, t in enumerate(lengths)
    ]
    return arrivals, outcomes


class ServePair:
    """P (this process) and D (a child process) for one workload. ``modes`` (of
    :data:`kvpush.demo.serve_ranks.MODES`) names what :meth:`run` will replay; ``kernel`` sets up
    the one-kernel copy into a second allocation on D's device (CUDA only)."""

    def __init__(self, w: Workload, modes: Sequence[str] = ("kvpush", "nixl")) -> None:
        import torch

        from kvpush.core.manager import get_plugin_manager
        from kvpush.core.sender import PushSender
        from kvpush.core.sidechannel import SideChannelServer
        from kvpush.core.types import RankKey
        from kvpush.demo.bench import RawAgent

        os.environ.setdefault("UCX_LOG_LEVEL", "error")
        if {"kernel", "kernel_writer"} & set(modes):
            from kvpush.demo.serve_kernel import require_cuda

            require_cuda(w.device)
            require_cuda(w.decode_device or w.device)
        torch.set_num_threads(1)
        if w.switch_interval_us > 0:
            sys.setswitchinterval(w.switch_interval_us / 1e6)
        self.w = w
        self.kernel: Any = None
        self.p_server = SideChannelServer("serve-P")
        self.d_server = SideChannelServer("serve-D")
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_decode_main, args=(w, self.d_server.port, child), daemon=True, name="kvpush-serve-D"
        )
        self.process.start()
        self.sender: Any = None
        try:
            config = _worker_config(w, "serve-P", self.p_server.port, w.device)
            self.caches = _allocate(w, config, w.device)
            self.sender = PushSender(config, self.caches, pm=get_plugin_manager())
            self.sender.start()
            self._posts: list[tuple[float, float, bytes]] = []
            self._settled: dict[int, float] = {}
            self._owners: dict[Any, int] = {}
            self._stages: dict[str, dict[str, float]] = {}
            """Posts of the current run (start, return, notification), when each settled, and
            the index of each handle's post (a handle may be reused once released)."""
            self._instrument(self.sender.transport)
            self._instrument_writer(self.sender)
            assert self.sender.metadata is not None
            self.regions = self.sender.metadata.regions
            self.p_server.publish(RankKey(0, 0), self.sender.handshake_payload())
            self.raw = RawAgent("serve-raw-P", self.regions)
            status, value = self._recv(180)
            if status != "ready":
                raise RuntimeError(f"serve D failed to start:\n{value}")
            d_payload, d_raw = value
            self.d_server.publish(RankKey(0, 0), d_payload)
            from kvpush.core import wire

            self.d_regions = wire.decode_metadata(d_payload, expected_hash=None, source="serve D").regions
            self.raw.connect(d_raw, self.d_regions)
            self.conn.send(("connect", self.raw.metadata()))
            self.content = Content(self.regions, w.max_request_bytes(), w.device)
            self.pools = [BlockPool(n, w.seed + 100 + g) for g, n in enumerate(w.pool())]
            self.region_bytes = [r.block_len for r in self.regions]
            self.groups = [r.kv_group for r in self.regions]
            if {"kernel", "kernel_writer"} & set(modes):
                self._start_kernel(config)
        except BaseException:
            self.close()
            raise
        self.runs = 0
        self.params = {
            "remote_engine_id": "serve-P",
            "remote_host": "127.0.0.1",
            "remote_port": self.p_server.port,
        }

    def _start_kernel(self, config: Any) -> None:
        """The kernel ideal: a second allocation shaped as D's caches on D's device, written by
        one launch per request from P's blocks (and its own pool of D-side block ids)."""
        from kvpush.core.manager import get_plugin_manager
        from kvpush.demo.serve_kernel import KernelIdeal, SpanTable, enable_peer_access

        target = self.w.decode_device or self.w.device
        enable_peer_access(self.w.device, target)
        self.kernel_caches = _allocate(self.w, config, target)
        regions = (
            get_plugin_manager()
            .layout(self.w.layout)
            .describe(self.kernel_caches, config.parallel, config.model)
        )
        pair = (SpanTable(self.regions, (0, 1), self.groups), SpanTable(regions, (0, 1), self.groups))
        self.kernel = KernelIdeal(self.w.device, [pair])
        self.kernel_pools = [BlockPool(n, self.w.seed + 200 + g) for g, n in enumerate(self.w.pool())]

    def _instrument(self, transport: Any) -> None:
        """Stamp, per post, its start and return, and its WRITE settling (monotonic). Which
        request a post belongs to is worked out after the run (:meth:`_resolve_trace`): a search
        of the live ids in the writer thread, inside the timed post, cost ~30 µs a post."""
        poll = transport.poll
        owners = self._owners

        def timed(post: Callable[..., Any]) -> Callable[..., Any]:
            def timed_post(*args: Any) -> Any:
                start = time.monotonic()
                handle = post(*args)
                owners[handle] = len(self._posts)
                self._posts.append((start, time.monotonic(), args[-1]))
                return handle

            return timed_post

        def timed_poll(handle: Any) -> Any:
            state = poll(handle)
            if state.value != "pending" and handle in owners:
                self._settled[owners.pop(handle)] = time.monotonic()
            return state

        for name in ("post_write", "post_write_grid"):  # the second is optional (ids factored)
            if hasattr(transport, name):
                setattr(transport, name, timed(getattr(transport, name)))
        transport.poll = timed_poll

    def _instrument_writer(self, sender: Any) -> None:
        """Stamp, per request (the match key is the request id here), when P's writer took the
        finish (the hop's end) and when it began the post (the core's planning done): where
        "finish -> post" goes under load. Keyed by id, so nothing is searched in the writer."""
        on_finished, on_post = sender._finished, sender._post

        def took(finished: Any) -> Any:
            self._stages.setdefault(finished.key, {}).setdefault("writer", time.monotonic())
            return on_finished(finished)

        def posting(post: Any) -> Any:
            self._stages.setdefault(post.key, {}).setdefault("planned", time.monotonic())
            return on_post(post)

        sender._finished, sender._post = took, posting

    def _resolve_trace(self, rids: Sequence[str]) -> dict[str, dict[str, float]]:
        """The run's stamps per request id: its first post's start, its last post's return, its
        last WRITE's settling (a post belongs to the id its notification names)."""
        live = sorted(rids, key=len, reverse=True)  # longest first: no prefix matches
        trace: dict[str, dict[str, float]] = {}
        for index, (start, posted, notif) in enumerate(self._posts):
            rid = next((r for r in live if r.encode() in notif), None)
            if rid is None:
                continue
            marks = trace.setdefault(rid, self._stages.get(rid, {}))
            marks.setdefault("post", start)
            marks["posted"] = posted
            if index in self._settled:
                marks["settled"] = max(marks.get("settled", 0.0), self._settled[index])
        return trace

    def _recv(self, timeout_s: float) -> tuple[Any, ...]:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"serve D sent nothing within {timeout_s}s")
        return self.conn.recv()

    def nbytes(self, counts: Sequence[int]) -> int:
        return sum(size * counts[g] for size, g in zip(self.region_bytes, self.groups))

    def run(
        self,
        rate: float,
        lengths: Sequence[int],
        *,
        ideal: bool | str,
        say: Callable[[str], None],
        prefill_ms: float | None = None,
    ) -> list[Outcome]:
        """One open-loop run at ``rate`` requests/s (``ideal``: False for kvpush, True or
        ``"nixl"`` for raw NIXL, ``"kernel"`` for the one-kernel copy); returns every outcome."""
        from kvpush.core.planning import descriptor_ids

        if ideal in ("kernel", "kernel_writer"):
            return self._run_kernel(rate, lengths, prefill_ms, writer=ideal == "kernel_writer")
        ideal = bool(ideal)
        w = self.w
        self.runs += 1
        prefill_s = (w.prefill_ms if prefill_ms is None else prefill_ms) / 1e3
        prefix = f"{'raw' if ideal else 'kv'}{self.runs}"
        arrivals, outcomes = schedule(w, rate, lengths, prefix, time.monotonic() + 0.05)
        by_rid = {o.rid: o for o in outcomes}
        self._posts.clear()
        self._settled.clear()
        self._owners.clear()  # a late settling of the last run's WRITE is not stamped
        self._stages.clear()
        p_blocks: dict[str, list[list[int]]] = {}
        d_blocks: dict[str, list[list[int]]] = {}
        finishes: list[tuple[float, str]] = []
        raw_handles: dict[str, Any] = {}
        pending = len(outcomes)
        unchecked = 0  # samples D reported done and will verify once idle
        asked_checks = 0.0  # when P last told D to check its held samples (every request ended)
        next_arrival = 0
        deadline = arrivals[-1] + w.timeout_s + 5

        def finish(rid: str) -> None:
            o = by_rid[rid]
            o.finish = time.monotonic()
            if ideal:
                groups = self.groups
                lids = descriptor_ids(self.regions, groups, tuple(tuple(b) for b in p_blocks[rid]))
                rids = descriptor_ids(self.d_regions, groups, tuple(tuple(b) for b in d_blocks[rid]))
                handle = self.raw.agent.make_prepped_xfer(
                    "WRITE", self.raw.local, lids, self.raw.remote, rids, rid.encode()
                )
                self.raw.agent.transfer(handle)
                raw_handles[rid] = handle
            else:
                self.sender.request_finished(rid, p_blocks[rid], match_key=rid)
                self._stages.setdefault(rid, {})["returned"] = time.monotonic()

        while pending or unchecked:
            now = time.monotonic()
            if now > deadline:
                for o in outcomes:
                    if not o.done and o.failure is None:
                        o.failure = "timed out"
                    elif o.verified == "deferred":
                        o.verified = None  # D never got to check it (the sample rate says so)
                break
            while next_arrival < len(outcomes) and arrivals[next_arrival] <= now:
                o = outcomes[next_arrival]
                next_arrival += 1
                o.arrival = float(arrivals[o.number])
                counts = w.blocks_per_group(o.tokens)
                o.nbytes = self.nbytes(counts)
                ids = [pool.alloc(n) for pool, n in zip(self.pools, counts)]
                if any(i is None for i in ids):
                    for pool, got in zip(self.pools, ids):
                        if got is not None:
                            pool.release(got)
                    o.failure = "P's block pool is full"
                    pending -= 1
                    continue
                p_blocks[o.rid] = [list(i) for i in ids if i is not None]
                verify = w.verify_every > 0 and o.number % w.verify_every == 0
                if verify:
                    self.content.fill(o.number, p_blocks[o.rid])
                params = {**self.params, "transfer_id": o.rid, "remote_request_id": o.rid}
                self.conn.send(("add", o.rid, o.number, counts, params, verify, ideal))
                finishes.append((o.arrival + prefill_s, o.rid))
            finishes.sort()
            while finishes and finishes[0][0] <= time.monotonic() and finishes[0][1] in d_blocks:
                finish(finishes.pop(0)[1])
            for rid, handle in list(raw_handles.items()):
                state = self.raw.agent.check_xfer_state(handle)
                if state != "PROC":
                    self.raw.agent.release_xfer_handle(handle)
                    del raw_handles[rid]
                    self._release_p(rid, p_blocks)
                    if state != "DONE":
                        by_rid[rid].failure = f"raw WRITE ended in {state}"
            if not ideal:
                got = self.sender.get_finished()
                for rid in (*got.sent, *got.failed):
                    self._release_p(rid, p_blocks)
            while self.conn.poll(0):
                message = self.conn.recv()
                if message[0] != "error" and message[1] not in by_rid:
                    continue  # a late report of an earlier run's request
                if message[0] == "blocks":
                    d_blocks[message[1]] = message[2]
                elif message[0] in ("done", "failed"):
                    o = by_rid[message[1]]
                    if message[0] == "failed":
                        o.failure = message[3]
                        finishes = [f for f in finishes if f[1] != o.rid]
                        self._release_p(o.rid, p_blocks)
                    else:
                        o.done, o.failure, o.verified = message[2], message[3], message[4]
                        unchecked += o.verified == "deferred"
                    pending -= 1
                elif message[0] == "verified":
                    by_rid[message[1]].verified, by_rid[message[1]].miss = message[2], message[3]
                    unchecked -= 1
                elif message[0] == "error":
                    raise RuntimeError(f"serve D failed:\n{message[1]}")
            if not pending and unchecked and time.monotonic() - asked_checks > 1.0:
                self.conn.send(("check",))  # D may still count a request in flight; ask anyway
                asked_checks = time.monotonic()
            waits = [arrivals[next_arrival] if next_arrival < len(outcomes) else now + 0.01]
            if finishes and finishes[0][1] in d_blocks:
                waits.append(finishes[0][0])
            elif finishes:  # due or not, it waits for D's block ids, which wake the poll below
                waits.append(time.monotonic() + 0.001)
            sleep = min(waits) - time.monotonic()
            if sleep > 0 and not raw_handles:
                self.conn.poll(min(sleep, 0.001))
        for rid in list(p_blocks):
            self._release_p(rid, p_blocks)
        trace = self._resolve_trace(list(by_rid))
        for o in outcomes:
            o.marks = trace.get(o.rid, {})
        return outcomes

    def _run_kernel(
        self, rate: float, lengths: Sequence[int], prefill_ms: float | None, *, writer: bool = False
    ) -> list[Outcome]:
        """The kernel ideal under the same arrivals: at each finish one launch of the request's
        precomputed spans; done when its event has completed (polled); samples compared.

        ``writer``: the finish is handed to a :class:`KernelWriter` thread that launches and
        polls as kvpush's writer does (the thread hop and poll interval, nothing else)."""
        if self.kernel is None:
            raise ValueError("this pair was started without the kernel ideal (modes)")
        w = self.w
        self.runs += 1
        prefill_s = (w.prefill_ms if prefill_ms is None else prefill_ms) / 1e3
        arrivals, outcomes = schedule(w, rate, lengths, f"kn{self.runs}", time.monotonic() + 0.05)
        live: dict[int, tuple[list[list[int]], list[list[int]], Any, bool]] = {}
        finishes: list[tuple[float, int]] = []
        events: dict[int, Any] = {}
        pending, next_arrival = len(outcomes), 0
        held: dict[int, tuple[list[list[int]], list[list[int]]]] = {}

        def check(number: int, _blocks: list[list[int]]) -> str | None:
            ok = self.kernel.check(live.pop(number)[2])
            return None if ok else "the kernel's copy does not hold P's bytes"

        checks = DeferredChecks(check)

        def release(number: int) -> None:
            p_blocks, d_blocks = held.pop(number)
            for pools, ids_ in ((self.pools, p_blocks), (self.kernel_pools, d_blocks)):
                for pool, ids in zip(pools, ids_):
                    pool.release(ids)

        def checked(rid: str, miss: str | None, _blocks: list[list[int]]) -> None:
            number = int(rid)
            outcomes[number].verified, outcomes[number].miss = miss is None, miss
            release(number)

        deadline = arrivals[-1] + w.timeout_s + 5
        thread = KernelWriter(self.kernel) if writer else None
        while pending:
            now = time.monotonic()
            if now > deadline:
                for o in outcomes:
                    if not o.done and o.failure is None:
                        o.failure = "timed out"
                break
            while next_arrival < len(outcomes) and arrivals[next_arrival] <= now:
                o = outcomes[next_arrival]
                next_arrival += 1
                o.arrival = float(arrivals[o.number])
                counts = w.blocks_per_group(o.tokens)
                o.nbytes = self.nbytes(counts)
                p_ids = [pool.alloc(n) for pool, n in zip(self.pools, counts)]
                d_ids = [pool.alloc(n) for pool, n in zip(self.kernel_pools, counts)]
                if any(i is None for i in (*p_ids, *d_ids)) and checks:
                    for pools, got in ((self.pools, p_ids), (self.kernel_pools, d_ids)):
                        for pool, ids in zip(pools, got):
                            if ids is not None:
                                pool.release(ids)
                    checks.run_all(checked)  # the held samples first, then again
                    p_ids = [pool.alloc(n) for pool, n in zip(self.pools, counts)]
                    d_ids = [pool.alloc(n) for pool, n in zip(self.kernel_pools, counts)]
                if any(i is None for i in (*p_ids, *d_ids)):
                    for pools, got in ((self.pools, p_ids), (self.kernel_pools, d_ids)):
                        for pool, ids in zip(pools, got):
                            if ids is not None:
                                pool.release(ids)
                    o.failure = "a block pool is full"
                    pending -= 1
                    continue
                p_blocks = [list(i) for i in p_ids if i is not None]
                d_blocks = [list(i) for i in d_ids if i is not None]
                verify = w.verify_every > 0 and o.number % w.verify_every == 0
                if verify:
                    self.content.fill(o.number, p_blocks)
                live[o.number] = (p_blocks, d_blocks, self.kernel.spans(p_blocks, d_blocks), verify)
                finishes.append((o.arrival + prefill_s, o.number))
            finishes.sort()
            while finishes and finishes[0][0] <= time.monotonic():
                number = finishes.pop(0)[1]
                o = outcomes[number]
                o.finish = time.monotonic()
                if thread is not None:
                    thread.hand(number, live[number][2])
                    events[number] = None
                    continue
                events[number] = self.kernel.launch(live[number][2])
                o.marks = {"post": o.finish, "posted": time.monotonic()}
            ended = thread.take() if thread is not None else {}
            for number, event in list(events.items()):
                if thread is not None:
                    if number not in ended:
                        continue
                    o = outcomes[number]
                    o.marks = ended[number]
                    o.done = o.marks["settled"]
                elif event is not None and not event.query():
                    continue
                else:
                    o = outcomes[number]
                    o.done = o.marks["settled"] = time.monotonic()
                del events[number]
                p_blocks, d_blocks, _spans, verify = live[number]
                held[number] = (p_blocks, d_blocks)
                if verify:  # checked once nothing is in flight (as D does for kvpush)
                    checks.add(str(number), number, d_blocks)
                else:
                    del live[number]
                    release(number)
                pending -= 1
            if not events or thread is not None:
                waits = [arrivals[next_arrival] if next_arrival < len(outcomes) else now + 0.01]
                if finishes:
                    waits.append(finishes[0][0])
                sleep = min(waits) - time.monotonic()
                if sleep > 0 and checks and not events:
                    checks.run_one(checked)
                elif sleep > 0:
                    time.sleep(min(sleep, 0.001))
        if thread is not None:
            thread.stop()
        checks.run_all(checked)
        for number in list(held):
            release(number)
        for p_blocks, d_blocks, _, _ in live.values():
            for pools, ids_ in ((self.pools, p_blocks), (self.kernel_pools, d_blocks)):
                for pool, ids in zip(pools, ids_):
                    pool.release(ids)
        return outcomes

    def _release_p(self, rid: str, p_blocks: dict[str, list[list[int]]]) -> None:
        blocks = p_blocks.pop(rid, None)
        if blocks is not None:
            for pool, ids in zip(self.pools, blocks):
                pool.release(ids)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("stop",))
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
        if self.sender is not None:
            self.sender.close()
        self.p_server.close()
        self.d_server.close()

    def __enter__(self) -> ServePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ summary


def summarize(rate: float, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    done = [o for o in outcomes if o.failure is None and o.done]
    lat = sorted(1e3 * (o.done - o.finish) for o in done)
    span = (max(o.done for o in done) - min(o.arrival for o in outcomes)) if done else 0.0
    nbytes = sum(o.nbytes for o in done)
    sampled = [o for o in done if o.verified is not None]

    def pct(p: float) -> float | None:
        return float(np.percentile(lat, p)) if lat else None

    return {
        "offered_rps": rate,
        "achieved_rps": len(done) / span if span > 0 else None,
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "failures": sorted({o.failure for o in outcomes if o.failure})[:5],
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": max(lat) if lat else None,
        "gbps": nbytes / span / 1e9 if span > 0 else None,
        "mean_bytes": statistics.mean(o.nbytes for o in done) if done else None,
        "verified": sum(1 for o in sampled if o.verified is True),
        "verify_failed": sum(1 for o in sampled if o.verified is not True),
        "verify_misses": [f"request {o.number}: {o.miss}" for o in sampled if o.verified is not True][:5],
        "sample_rate": len(sampled) / len(done) if done else None,
        "trace_ms": _trace(done),
        "slowest": _slowest(done),
    }


def _slowest(done: Sequence[Outcome], count: int = 5) -> list[dict[str, Any]]:
    """The ``count`` slowest requests: id, number, arrival (s into the run), bytes, added ms,
    and P's stage split (ms) where it was stamped; what a tail percentile hides."""
    if not done:
        return []
    start = min(o.arrival for o in done)
    out = []
    for o in sorted(done, key=lambda o: o.done - o.finish, reverse=True)[:count]:
        steps, last = {}, o.finish
        for name in ("post", "posted", "settled"):
            t = o.marks.get(name)
            if t is not None:
                steps[f"to_{name}"] = round(1e3 * (t - last), 3)
                last = t
        steps["to_done"] = round(1e3 * (o.done - last), 3)
        out.append(
            {
                "rid": o.rid,
                "number": o.number,
                "arrival_s": round(o.arrival - start, 4),
                "bytes": o.nbytes,
                "added_ms": round(1e3 * (o.done - o.finish), 3),
                "steps_ms": steps,
            }
        )
    return out


def _trace(done: Sequence[Outcome]) -> dict[str, float] | None:
    """Median ms of finish -> first post (P's hop, planning, hooks), the posts themselves,
    posted -> settled on P (the copy or WRITE), settled -> D reports done (notification, D);
    and finish -> first post in parts where stamped: the engine's ``request_finished`` call,
    its return -> P's writer took it (the hop), -> the writer began the post (the core's
    planning), -> the transport's post (the post checks)."""
    marked = [o for o in done if {"post", "posted", "settled"} <= set(o.marks)]
    if not marked:
        return None
    staged = [o for o in marked if {"returned", "writer", "planned"} <= set(o.marks)]
    parts = {
        "finish_call": [o.marks["returned"] - o.finish for o in staged],
        "hop": [o.marks["writer"] - o.marks["returned"] for o in staged],
        "core_finished": [o.marks["planned"] - o.marks["writer"] for o in staged],
        "post_checks": [o.marks["post"] - o.marks["planned"] for o in staged],
    }
    steps = {
        **(parts if staged else {}),
        "finish_to_post": [o.marks["post"] - o.finish for o in marked],
        "post": [o.marks["posted"] - o.marks["post"] for o in marked],
        "posted_to_settled": [o.marks["settled"] - o.marks["posted"] for o in marked],
        "settled_to_done": [o.done - o.marks["settled"] for o in marked],
    }
    return {k: round(1e3 * statistics.median(v), 3) for k, v in steps.items()}


def _line(tag: str, s: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    return (
        f"{tag:>7} {f(s['offered_rps'], '.1f'):>8} {f(s['achieved_rps'], '.1f'):>8} {f(s['p50_ms']):>8} "
        f"{f(s['p90_ms']):>8} {f(s['p99_ms']):>8} {f(s['max_ms']):>8} {f(s['gbps']):>7} "
        f"{s['completed']:>5}/{s['requests']:<5} {s['verified']:>4} ok {s['verify_failed']} bad"
    )


HEADER = (
    f"{'method':>7} {'offered':>8} {'achieved':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
    f"{'GB/s':>7} {'done':>11} verified"
)


class GcPauses:
    """Python's garbage collections in this process while a run lasts (they stop every thread,
    the writer's too): how many, the longest and the total, in ms (``gc_here`` in ``--json``;
    this process is P in the one-pair harness, the driver in the multi-rank one)."""

    def __enter__(self) -> GcPauses:
        self.pauses: list[float] = []
        self._began = 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._began)

    def summary(self) -> dict[str, float]:
        ms = [1e3 * p for p in self.pauses]
        return {"count": len(ms), "max_ms": round(max(ms, default=0.0), 3), "total_ms": round(sum(ms), 3)}


def run(
    w: Workload,
    rates: Sequence[float],
    *,
    sweep: bool,
    p99_factor: float,
    ideal: bool | Sequence[str],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Warm up, then one run of kvpush and of each ideal per rate (``--sweep``: doubling until
    the knee); ``ideal``: True (raw NIXL), False (none) or a list of ``nixl``/``kernel``."""
    ideals = ("nixl",) if ideal is True else () if ideal is False else tuple(ideal)
    for name in ideals:
        if name not in IDEAL_KEYS:
            raise ValueError(f"--ideal {name!r}: choose from {sorted(IDEAL_KEYS)}")
    lengths = w.prompt_lengths()
    results: list[dict[str, Any]] = []
    if w.multi_rank:
        from kvpush.demo.serve_ranks import ServeCluster

        harness: Any = ServeCluster(w, modes=("kvpush", *ideals))
    else:
        harness = ServePair(w, modes=("kvpush", *ideals))
    with harness as pair:
        warm = lengths[: min(5, len(lengths))]
        # handshakes, first posts, kernel compiles; registrations land before the finish
        pair.run(min(rates), warm, ideal=False, say=say, prefill_ms=300)
        for name in ideals:
            pair.run(min(rates), warm, ideal=name, say=say, prefill_ms=300)
        strategy_before = _sender_stats(pair)
        ipc_before = getattr(getattr(pair, "sender", None), "transport", None)
        ipc_before = getattr(ipc_before, "ipc_writes", 0)
        say(HEADER)
        queue = list(rates)
        bound = None
        knee = None
        while queue:
            rate = queue.pop(0)
            with GcPauses() as pauses:
                kv = summarize(rate, pair.run(rate, lengths, ideal=False, say=say))
            kv["gc_here"] = pauses.summary()
            say(_line("kvpush", kv))
            for miss in kv["verify_misses"]:
                say(f"  WRONG BYTES: {miss}")
            entry: dict[str, Any] = {"rate": rate, "kvpush": kv}
            for name in ideals:
                key = IDEAL_KEYS[name]
                with GcPauses() as pauses:
                    entry[key] = summarize(rate, pair.run(rate, lengths, ideal=name, say=say))
                entry[key]["gc_here"] = pauses.summary()
                say(_line(IDEAL_TAGS[name], entry[key]))
                for miss in entry[key]["verify_misses"]:
                    say(f"  WRONG BYTES: {miss}")
            results.append(entry)
            if bound is None and kv["p50_ms"] is not None:
                bound = p99_factor * kv["p50_ms"]
            ok = (
                kv["failed"] == 0
                and kv["p99_ms"] is not None
                and bound is not None
                and kv["p99_ms"] <= bound
                and (kv["achieved_rps"] or 0) >= 0.9 * rate
            )
            if ok:
                knee = rate
            if sweep and ok and not queue and len(results) < 12:
                queue.append(rate * 2)
        stats = _sender_stats(pair)
        mix = {k: stats.get(k, 0) - strategy_before.get(k, 0) for k in ("packed_writes", "packed_fallbacks")}
        transport = getattr(getattr(pair, "sender", None), "transport", None)
        mix["ipc_writes"] = getattr(transport, "ipc_writes", 0) - ipc_before
        if getattr(transport, "ipc_writes", 0):
            from kvpush.core.kernels import _COPIERS

            posts = transport.ipc_writes
            mix["ipc_post_ms"] = {
                "address_lists": round(1e3 * transport.post_seconds[0] / posts, 3),
                "launch": round(1e3 * transport.post_seconds[1] / posts, 3),
            }
            host = [sum(c.host_seconds[i] for c in _COPIERS.values()) for i in (0, 1)]
            launches = sum(c.launches for c in _COPIERS.values()) or 1
            mix["copier_host_ms"] = {
                "prepare": round(1e3 * host[0] / launches, 3),
                "enqueue": round(1e3 * host[1] / launches, 3),
            }
        lengths_arr = np.array(lengths)
    pp, ptp, dtp = w.topology()
    return {
        "workload": attrs.asdict(w),
        "geometry": w.geometry(),
        "topology": {
            "prefill_pp": pp,
            "prefill_tp": ptp,
            "decode_tp": dtp,
            "processes": "P and D ranks as processes"
            if w.multi_rank
            else "P in the bench process, D one process",
            "model_kv_heads": w.model().num_kv_heads,
        },
        "ideals": {IDEAL_KEYS[name]: IDEAL_WHAT[name] for name in ideals},
        "prompt_tokens": {
            "median": float(np.median(lengths_arr)),
            "p90": float(np.percentile(lengths_arr, 90)),
            "max": int(lengths_arr.max()),
        },
        "strategy_mix": mix,
        "p99_bound_ms": bound,
        "knee_rps": knee,
        "runs": results,
    }


IDEAL_KEYS = {"nixl": "ideal", "kernel": "ideal_kernel", "kernel_writer": "ideal_kernel_writer"}
"""``--ideal`` choice -> its key in each run's entry (``ideal`` stays raw NIXL's)."""
IDEAL_TAGS = {"nixl": "ideal", "kernel": "ideal_k", "kernel_writer": "ideal_kw"}
"""``--ideal`` choice -> its tag in the printed table."""
IDEAL_WHAT = {
    "nixl": "raw NIXL: per (P rank, D rank) pair one WRITE of the request's per-block "
    "descriptors and one notification, posted at the finish (one pair: ids and handle made at "
    "the finish; multi-rank: handle made at arrival, only posted at the finish)",
    "kernel": "one kernel per P rank copying the request's slices into a second allocation on "
    "D's device (no IPC, no notification)",
    "kernel_writer": "the kernel ideal launched and polled by a writer thread woken by the finish, "
    "as kvpush's writer is (the thread hop and the poll interval, no planning, no notification)",
}


class KernelWriter:
    """The kernel ideal's launches on a thread of their own, woken and polling as kvpush's
    writer is (``WorkerConfig``'s poll intervals, ``FRESH_POLL_S`` while a copy runs, the same
    timer slack): what a Python connector with a writer thread pays before any logic of its
    own. :meth:`hand` queues a finish; :meth:`take` returns the ended ones' stamps."""

    def __init__(self, kernel: Any) -> None:
        import queue
        import threading

        self.kernel = kernel
        self._todo: queue.SimpleQueue[tuple[int, Any, float]] = queue.SimpleQueue()
        self._ended: queue.SimpleQueue[tuple[int, dict[str, float]]] = queue.SimpleQueue()
        self._wake = threading.Lock()
        self._wake.acquire()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kernel-writer", daemon=True)
        self._thread.start()

    def hand(self, number: int, spans: Any) -> None:
        self._todo.put((number, spans, time.monotonic()))
        if self._wake.locked():
            with contextlib.suppress(RuntimeError):
                self._wake.release()

    def take(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        while not self._ended.empty():
            number, marks = self._ended.get_nowait()
            out[number] = marks
        return out

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._wake.release()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        import queue

        from kvpush.core.worker import FRESH_POLL_S, WorkerConfig, set_timer_slack

        defaults = WorkerConfig.__attrs_attrs__  # type: ignore[attr-defined]
        idle = next(a.default for a in defaults if a.name == "idle_poll_s")
        slack = next(a.default for a in defaults if a.name == "timer_slack_ns")
        set_timer_slack(slack)
        if self.kernel.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.kernel.device)
        running: dict[int, tuple[Any, dict[str, float]]] = {}
        while not self._stop.is_set():
            while True:
                try:
                    number, spans, handed = self._todo.get_nowait()
                except queue.Empty:
                    break
                marks = {"post": time.monotonic(), "handed": handed}
                running[number] = (self.kernel.launch(spans), marks)
                marks["posted"] = time.monotonic()
            for number, (event, marks) in list(running.items()):
                if event is None or event.query():
                    marks["settled"] = time.monotonic()
                    self._ended.put((number, marks))
                    del running[number]
            self._wake.acquire(timeout=FRESH_POLL_S if running else idle)


def _sender_stats(pair: Any) -> dict[str, Any]:
    """P's sender stats (summed over P's ranks for a multi-rank run)."""
    if hasattr(pair, "stats"):
        return pair.stats()
    return dict(pair.sender.stats)


def plot(result: dict[str, Any], path: str) -> str:
    """Write latency against offered rate as a PNG; returns a line saying what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed; no plot written to {path}"
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, style in (
        ("kvpush", "-"),
        ("ideal", "--"),
        ("ideal_kernel", ":"),
        ("ideal_kernel_writer", "-."),
    ):
        runs = [r for r in result["runs"] if method in r]
        if not runs:
            continue
        x = [r["rate"] for r in runs]
        for key, marker in (("p50_ms", "o"), ("p99_ms", "s")):
            ax.plot(x, [r[method][key] for r in runs], style, marker=marker, label=f"{method} {key[:3]}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("added latency, finish -> D may decode (ms)")
    w = result["workload"]
    decode = w.get("decode_device") or w["device"]
    topo = result.get("topology") or {}
    shape = (
        f" PP{topo['prefill_pp']}xTP{topo['prefill_tp']} -> TP{topo['decode_tp']}"
        if w.get("prefill_pp") or w.get("prefill_tp") or w.get("decode_tp")
        else ""
    )
    ax.set_title(f"{w['preset']}{shape}: P {w['device']} -> D {decode}, {w.get('transport', 'nixl')}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:  # no run finished (a legend of nothing warns)
        ax.text(0.5, 0.5, "no runs", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"--plot: wrote {path}"


# ------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--serve`` options (the bench parser's ``--device``, ``--decode-device``, ``--json``
    and ``--seed`` apply too)."""
    group = parser.add_argument_group("--serve (serving-shaped load)")
    group.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b", help="model KV geometry")
    group.add_argument("--kv-heads", type=int, default=None, help="custom geometry: KV heads per rank")
    group.add_argument("--head-dim", type=int, default=None, help="custom geometry: head (or latent) size")
    group.add_argument("--block-size", type=int, default=None, help="custom geometry: tokens per block")
    group.add_argument("--serve-layers", type=int, default=None, help="custom geometry: layers")
    group.add_argument("--rate", type=float, action="append", help="requests/s, repeatable (default 10)")
    group.add_argument("--requests", type=int, default=100, help="requests per rate (default 100)")
    group.add_argument(
        "--median-tokens", type=int, default=256, help="log-normal prompt median (default 256)"
    )
    group.add_argument(
        "--sigma", type=float, default=0.6, help="log-normal sigma of prompt lengths (default 0.6)"
    )
    group.add_argument("--max-tokens", type=int, default=2048, help="prompt length cap (default 2048)")
    group.add_argument(
        "--tokens", type=int, action="append", help="fixed prompt lengths, cycled (repeatable)"
    )
    group.add_argument("--prefill-ms", type=float, default=2.0, help="registration -> finish (default 2)")
    group.add_argument("--verify-every", type=int, default=4, help="verify every Nth request (0: none)")
    group.add_argument(
        "--pool-blocks", type=int, default=0, help="blocks per group per side (default: 16 prompts)"
    )
    group.add_argument("--transport", choices=["nixl", "cuda_ipc"], default=None, help="default: nixl")
    group.add_argument("--sweep", action="store_true", help="double the rate until p99 breaks the bound")
    group.add_argument("--p99-factor", type=float, default=2.0, help="knee bound: p99 <= this x unloaded p50")
    group.add_argument("--no-ideal", action="store_true", help="skip every ideal replay")
    group.add_argument(
        "--ideal",
        action="append",
        choices=sorted(IDEAL_KEYS),
        help="ideal(s) replayed under the same arrivals, repeatable (default: nixl); kernel: the "
        "one-kernel copy into a second allocation on D's device (CUDA only); kernel_writer: that "
        "copy launched and polled by a writer thread, as kvpush's writer does (CUDA, one rank pair)",
    )
    group.add_argument(
        "--prefill-pp", type=int, default=None, help="P pipeline stages, one process each x TP (default 1)"
    )
    group.add_argument("--prefill-tp", type=int, default=None, help="P TP ranks per stage (default 1)")
    group.add_argument(
        "--prefill-devices",
        default=None,
        metavar="LIST",
        help="multi-rank: P ranks' devices, comma-separated, round-robin stage-major (e.g. "
        "cuda:0,cuda:1; default: --device); --decode-device takes a list the same way",
    )
    group.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        help="D TP ranks; any of the three topology flags runs every rank as its own process "
        "(none: P in this process and one D process, per-rank geometry)",
    )
    group.add_argument("--plot", default=None, metavar="PNG", help="write latency vs offered rate here")
    group.add_argument(
        "--switch-interval-us", type=float, default=0.0, help="sys.setswitchinterval of P and D (0: Python's)"
    )


def workload_from(args: argparse.Namespace) -> Workload:
    device = getattr(args, "prefill_devices", None) or ("cuda:0" if args.device == "cuda" else "cpu")
    return Workload(
        preset=args.preset,
        layers=args.serve_layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        median_tokens=args.median_tokens,
        sigma=args.sigma,
        max_tokens=args.max_tokens,
        tokens=tuple(args.tokens or ()),
        requests=args.requests,
        prefill_ms=args.prefill_ms,
        verify_every=args.verify_every,
        pool_blocks=args.pool_blocks,
        device=device,
        decode_device=args.decode_device,
        transport=args.transport or "nixl",
        nixl_options=dict(getattr(args, "nixl_option", None) or []),
        seed=args.seed,
        switch_interval_us=args.switch_interval_us,
        prefill_pp=args.prefill_pp,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
    )


def check_ideals(w: Workload, ideals: Sequence[str]) -> None:
    """Refuse, before anything starts, an ideal this workload's devices or topology cannot run."""
    if "kernel_writer" in ideals and w.multi_rank:
        from kvpush.core.errors import ConfigError

        raise ConfigError(
            "--ideal kernel_writer runs with one P and one D rank only (no --prefill-pp/-tp, --decode-tp)"
        )
    if {"kernel", "kernel_writer"} & set(ideals):
        from kvpush.demo.serve_kernel import require_cuda

        for device in {*w.rank_devices()[0], *w.rank_devices()[1]}:
            require_cuda(device)


def main(args: argparse.Namespace) -> int:
    from kvpush.core.errors import ConfigError

    try:
        w = workload_from(args)
        w.model()
        w.topology()
        w.rank_devices()
        rates = args.rate or [10.0]
        if not all(0 < r < 1e9 for r in rates):  # NaN and inf fail too
            raise ValueError(f"--rate must be a finite number of requests/s > 0, got {rates}")
        for flag, value, low in (("--prefill-ms", args.prefill_ms, 0), ("--p99-factor", args.p99_factor, 1)):
            if not low <= value < 1e9:
                raise ValueError(f"{flag} must be a finite number >= {low}, got {value}")
        for flag, value, low in (("--requests", args.requests, 1), ("--verify-every", args.verify_every, 0)):
            if value < low:
                raise ValueError(f"{flag} must be at least {low}, got {value}")
        ideals = [] if args.no_ideal else list(dict.fromkeys(args.ideal or ["nixl"]))
        check_ideals(w, ideals)
    except (ValueError, ConfigError) as err:
        print(f"kvpush bench --serve: {err}", file=sys.stderr)
        return 2
    try:
        result = run(
            w,
            rates,
            sweep=args.sweep,
            p99_factor=args.p99_factor,
            ideal=ideals,
            say=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    except Exception as err:
        traceback.print_exc()
        print(f"kvpush bench --serve failed: {err}", file=sys.stderr)
        return 1
    if args.plot:
        print(plot(result, args.plot), file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(
            f"knee: {result['knee_rps']} requests/s (p99 <= {_fmt(result['p99_bound_ms'])} ms); "
            f"strategy mix {result['strategy_mix']}; prompts {result['prompt_tokens']}"
        )
    wrong = [
        f"{key} at {entry['rate']:g}/s: {miss}"
        for entry in result["runs"]
        for key, summary in entry.items()
        if isinstance(summary, dict)
        for miss in summary.get("verify_misses", ())
    ]
    if wrong:  # a measurement of wrong bytes is no measurement: fail the command
        print("kvpush bench --serve: samples held the wrong bytes:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 1
    return 0


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


__all__ = ["IDEAL_KEYS", "PRESETS", "Workload", "add_arguments", "check_ideals", "main", "run", "summarize"]
