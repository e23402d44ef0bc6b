"""Where one request's host time goes, stage by stage, on P and on D (issue 14).

P (this process) and D (a spawned process) are the ``kvpush bench`` pair
(:class:`kvpush.demo.bench.BenchPair`: real ``PushSender`` / ``PushReceiver`` over real NIXL,
plus a bare ``nixl_agent`` each for the raw column). Both sides' methods are wrapped with
``time.perf_counter_ns`` stamps (CLOCK_MONOTONIC: one clock for both processes) and
``time.thread_time_ns`` (the calling thread's CPU time, which load on a shared box inflates
less than wall time), one request at a time; each stage's median is printed beside raw NIXL
doing the same WRITE (D polling for its notification):

P  ``request_finished call``   the engine's call itself (id checks, queueing for the writer)
   ``finish -> core``          request start -> the writer thread runs the core (the hop, and
                               the notification drain that must come first)
   ``core.finished``           the core: planning (``P.plan``: trim, read-spec hook, producer
                               check) and the Post action
   ``post checks``             ``_post`` -> the transport's post (confirm_post, descriptor ids,
                               strategy hook, DONE encoding)
   ``transport post``          NIXL ``make_prepped_xfer`` + ``transfer`` (cuda_ipc: the launch)
   ``post -> P polls DONE``    posted -> the poll that saw DONE (cuda_ipc sends D's DONE then)
D  ``post -> D drained DONE``  posted -> D's drain returned the DONE (D's poll interval)
   ``D drained -> D core``     decoding the notification (plugin hook)
   ``D core (DONE)``, ``D core -> report``, ``D report -> ack`` (the bench's pipe back to P)

plus the time inside each plugin hook, planning and descriptor-id building per request, and on
CUDA P's kernel launches (how many skipped Triton's JIT entry). Shapes: ``small`` (8 regions x
16 x 4 KiB contiguous, direct) and ``large`` (32 x 512 x 4 KiB scattered, direct) on the CPU;
``direct32m`` and ``direct256m`` (64 x 16 and 64 x 128 x 32 KiB contiguous, direct over NIXL),
``ipc256m`` (64 x 128 x 32 KiB scattered, ``cuda_ipc``) and ``ipc70b`` (160 x 256 x 4 KiB
scattered, ``cuda_ipc``) with ``--device cuda``. Run::

    .venv/bin/python benchmarks/profile_host_path.py                    # small and large
    .venv/bin/python benchmarks/profile_host_path.py --device cuda      # direct32m and ipc256m
    .venv/bin/python benchmarks/profile_host_path.py --cprofile         # + cProfile tops

``--ab`` alternates requests with and without round 2's fast paths in one run (both columns
and their ratio; same processes and load, so it sees changes of a few µs on a busy box).
Every run ends with the writers' CPU (% of a core, ``time.thread_time_ns`` on the writer
thread) idle and with one request pending on D, and D's polls per second;
``--d-busy-poll-us`` sets D's ``busy_poll_s`` to weigh D's poll interval against that CPU.

``--cprofile`` also runs cProfile in P's writer thread (and D's, via ``KVPUSH_PROFILE_D``) and
prints the top functions by own time (on a loaded box, time a thread waits for a core lands on
whatever function it was in).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ns = time.perf_counter_ns
cpu = time.thread_time_ns
Event = tuple[str, int, int, int]
"""(label, start ns, end ns, CPU ns of the calling thread) of one wrapped call."""


class Recorder:
    """Every wrapped call of one side, as (label, start, end)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def wrap(
        self, obj: Any, name: str, label: str | None = None, *, tag: Callable[..., str] | None = None
    ) -> None:
        """Replace ``obj.name`` with a timed wrapper (an instance attribute for bound methods)."""
        original = getattr(obj, name)
        events = self.events
        fixed = label or name

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, busy = ns(), cpu()
            try:
                return original(*args, **kwargs)
            finally:
                events.append((tag(*args, **kwargs) if tag else fixed, start, ns(), cpu() - busy))

        setattr(obj, name, timed)

    def take(self) -> list[Event]:
        out, self.events[:] = list(self.events), []
        return out


# ------------------------------------------------------------------------------ A/B switch

AB_ENV = "KVPUSH_PROFILE_AB"
D_POLL_ENV = "KVPUSH_PROFILE_D_BUSY_POLL_US"
FAST: dict[str, bool] = {"on": True}
"""``--ab``: whether this rep runs with round 2's host-path fast paths (both processes flip
it per rep: P before each rep, D when the rep's events are collected)."""


def install_switch() -> None:
    """Route round 2's fast paths through ``FAST`` so one run interleaves requests with and
    without them (same process, same load): the inline DONE decode, hooks called without
    pluggy's loop, the leaner descriptor ids and the trim that keeps the checked tuple. Off
    runs the code they replaced (the general decode, pluggy, the baselines below)."""
    from kvpush.core import manager, notifications, planning, sender

    direct_done = notifications._direct_done
    direct_calls = manager.KvpushPluginManager._direct_calls
    notifications._direct_done = lambda message: direct_done(message) if FAST["on"] else None
    manager.KvpushPluginManager._direct_calls = (  # type: ignore[method-assign]
        lambda self, name: direct_calls(self, name) if FAST["on"] else None
    )
    ids, pair = planning.descriptor_ids, planning.pair_blocks
    sender.descriptor_ids = lambda *a, **k: (ids if FAST["on"] else _baseline_ids)(*a, **k)
    sender.pair_blocks = lambda *a, **k: (pair if FAST["on"] else _baseline_trim)(*a)


def _baseline_ids(regions: Any, groups: Any, block_ids: Any, *, per_token: bool = True) -> Any:
    """``descriptor_ids`` before round 2 (its one-row path; the rest is shared)."""
    import numpy as np

    from kvpush.core import planning

    table = planning._region_table(regions, per_token)
    top = max(groups, default=-1)
    if not (table.one_row and groups and min(groups) == top and top < len(block_ids)):
        return planning.descriptor_ids(regions, groups, block_ids, per_token=per_token)
    seq = block_ids[top]
    ids = np.asarray(seq, dtype=np.int64)
    if len(seq) <= 256 and isinstance(seq, tuple):
        if seq and (max(seq) >= table.min_capacity or min(seq) < 0):
            planning._check_capacity(ids, table.min_capacity, top)
    else:
        planning._check_capacity(ids, table.min_capacity, top)
    offsets32 = table.column32.reshape(-1)
    out = np.empty((len(offsets32), len(ids)), dtype=np.int32)
    np.add(offsets32[:, None], ids.astype(np.int32)[None, :], out=out)
    return out.ravel()


def _baseline_trim(producer: Any, decode: Any, request_id: str) -> Any:
    """``trim_for_prefix_hit`` before round 2: always a new tuple (checked again downstream)."""

    from kvpush.core.errors import ConfigError

    if len(producer) != len(decode):
        raise ConfigError(f"request {request_id!r}: P has {len(producer)} groups, D {len(decode)}")
    trimmed = []
    for group, (p_ids, d_ids) in enumerate(zip(producer, decode)):
        if len(d_ids) > len(p_ids):
            raise ConfigError(f"request {request_id!r}: D registered more blocks in group {group}")
        trimmed.append(tuple(p_ids[len(p_ids) - len(d_ids) :]) if d_ids else ())
    return tuple(trimmed)


# ------------------------------------------------------------------------------ D's side


def instrument_decode(receiver: Any) -> Callable[[], Any]:
    """Stamp D's drain, core and report; the returned callable hands the events over (and a
    cProfile text of D's writer thread when ``KVPUSH_PROFILE_D`` is set)."""
    rec = Recorder()
    transport = receiver.transport
    drain = transport.drain_notifs

    drains = [0]

    def drain_notifs() -> Any:
        drains[0] += 1
        start, busy = ns(), cpu()
        batch = drain()
        if batch:
            rec.events.append(("D.drain", start, ns(), cpu() - busy))
        return batch

    transport.drain_notifs = drain_notifs
    rec.wrap(receiver.core, "notification", tag=lambda peer, note, now: f"D.note.{note.kind.value}")
    rec.wrap(receiver.pm, "decode_notification", "D.decode")
    rec.wrap(receiver, "_report", "D.report")
    profiler = cProfile.Profile() if os.environ.get("KVPUSH_PROFILE_D") else None
    if profiler is not None:
        receiver.call_on_writer(profiler.enable)
    ab = bool(os.environ.get(AB_ENV))
    poll = os.environ.get(D_POLL_ENV)
    if poll:  # WorkerConfig is frozen: the experiment sets the field underneath
        object.__setattr__(receiver.config, "busy_poll_s", float(poll) * 1e-6)
    if ab:
        install_switch()

    def report() -> Any:
        if ab:  # every report ends a rep: the next one runs with the fast paths flipped
            FAST["on"] = not FAST["on"]
        text = ""
        if profiler is not None:  # cumulative: the last report holds every request's calls
            receiver.call_on_writer(profiler.disable)
            text = _top(profiler, 25)
            receiver.call_on_writer(profiler.enable)
        writer_cpu = receiver.call_on_writer(time.thread_time_ns)
        return {"events": rec.take(), "profile": text, "writer_cpu_ns": writer_cpu, "drains": drains[0]}

    return report


# ------------------------------------------------------------------------------ P's side


def instrument_prefill(pair: Any) -> Recorder:
    from kvpush.core import sender as sender_module

    rec = Recorder()
    sender = pair.sender
    core = sender.core
    rec.wrap(core, "finished", "P.core.finished")
    rec.wrap(core, "_plan", "P.plan")
    rec.wrap(sender, "_post", "P.post")
    rec.wrap(sender, "_report", "P.report")
    rec.wrap(sender_module, "descriptor_ids", "P.descriptor_ids")
    rec.wrap(sender_module, "descriptor_id_grid", "P.descriptor_ids")  # cuda_ipc: ids factored
    for hook in ("build_read_specs", "transfer_strategy", "expected_producers"):
        rec.wrap(sender.pm, hook, f"P.hook.{hook}")
    transport = sender.transport
    rec.wrap(transport, "post_write", "P.transport.post")
    if hasattr(transport, "post_write_grid"):  # optional; falls back to post_write (first stamp wins)
        rec.wrap(transport, "post_write_grid", "P.transport.post")
    poll = transport.poll

    def timed_poll(handle: Any) -> Any:
        start, busy = ns(), cpu()
        state = poll(handle)
        rec.events.append((f"P.poll.{state.value}", start, ns(), cpu() - busy))
        return state

    transport.poll = timed_poll
    return rec


def _first(events: list[Event], label: str, after: int = 0) -> Event | None:
    return next((e for e in events if e[0] == label and e[1] >= after), None)


def _last(events: list[Event], label: str, before: int) -> Event | None:
    hits = [e for e in events if e[0] == label and e[2] <= before]
    return hits[-1] if hits else None


def _total(events: list[Event], label: str, index: int = 2) -> tuple[float, int]:
    """Microseconds (wall, or with ``index=3`` the thread's CPU time) and calls of ``label``."""
    hits = [e for e in events if e[0] == label]
    if index == 3:
        return sum(e[3] for e in hits) / 1e3, len(hits)
    return sum(e[2] - e[1] for e in hits) / 1e3, len(hits)


def request_stages(t0: int, t_ret: int, t_end: int, p: list[Event], d: list[Event]) -> dict[str, float]:
    """Microseconds per stage of one request (see the module docstring)."""
    out: dict[str, float] = {"total": (t_end - t0) / 1e3, "request_finished call": (t_ret - t0) / 1e3}
    core = _first(p, "P.core.finished", t0)
    post = _first(p, "P.post", t0)
    tpost = _first(p, "P.transport.post", t0)
    done = _first(p, "P.poll.done", t0)
    note = _first(d, "D.note.done", t0)
    drain = _last(d, "D.drain", note[1]) if note else None
    decode = _last(d, "D.decode", note[1]) if note else None
    report = _first(d, "D.report", t0)
    p_report = _first(p, "P.report", t0)
    if not (core and post and tpost and done and note and report):
        return out
    polls = [e for e in p if e[0] == "P.poll.pending" and e[1] >= tpost[2]]
    out.update(
        {
            "finish -> core": (core[1] - t0) / 1e3,
            "core.finished": (core[2] - core[1]) / 1e3,
            "core -> post": (post[1] - core[2]) / 1e3,
            "post checks": (tpost[1] - post[1]) / 1e3,
            "transport post": (tpost[2] - tpost[1]) / 1e3,
            "post -> P polls DONE": (done[2] - tpost[2]) / 1e3,
            "pending polls": float(len(polls)),
            "post -> D drained DONE": (drain[2] - tpost[2]) / 1e3 if drain else float("nan"),
            "D drain call (of DONE)": (drain[2] - drain[1]) / 1e3 if drain else float("nan"),
            "D drained -> D core": (note[1] - drain[2]) / 1e3 if drain else float("nan"),
            "D decode (of DONE)": (decode[2] - decode[1]) / 1e3 if decode else float("nan"),
            "D core (DONE)": (note[2] - note[1]) / 1e3,
            "D core -> report": (report[2] - note[2]) / 1e3,
            "D report -> ack": (t_end - report[2]) / 1e3,
            "P DONE -> P report": (p_report[2] - done[2]) / 1e3 if p_report else float("nan"),
        }
    )
    mine = [e for e in p if t0 <= e[1] <= t_end]
    for label in ("P.plan", "P.descriptor_ids", *(f"P.hook.{h}" for h in HOOKS)):
        total, calls = _total(mine, label)
        out[f"{label} (x{calls})"] = total
    # CPU time of the calling thread: what the work costs, whatever else holds the cores
    out["CPU: P core.finished"] = core[3] / 1e3
    out["CPU: P post checks (post - transport)"] = (post[3] - tpost[3]) / 1e3
    out["CPU: P transport post"] = tpost[3] / 1e3
    out["CPU: P plan"] = _total(mine, "P.plan", 3)[0]
    out["CPU: P descriptor ids"] = _total(mine, "P.descriptor_ids", 3)[0]
    out["CPU: D core (DONE)"] = note[3] / 1e3
    out["CPU: D decode (DONE)"] = decode[3] / 1e3 if decode else float("nan")
    out["CPU: D drain call (of DONE)"] = drain[3] / 1e3 if drain else float("nan")
    return out


HOOKS = ("build_read_specs", "transfer_strategy", "expected_producers")


def _top(profiler: cProfile.Profile, n: int) -> str:
    """The top ``n`` functions, by own time (``KVPUSH_PROFILE_SORT=cumulative``: by time with
    callees, which shows the writer's stages; D's writer reads it too)."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats(os.environ.get("KVPUSH_PROFILE_SORT", "tottime")).print_stats(n)
    return text.getvalue()


# ------------------------------------------------------------------------------ runs


def _stamped(call: Callable[..., Any], returned: list[int]) -> Callable[..., Any]:
    """``call``, noting in ``returned`` when it returned."""

    def stamped(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        finally:
            returned.append(ns())

    return stamped


def profile_shape(
    *,
    layers: int,
    block_bytes: int,
    blocks: int,
    pattern: str,
    method: str,
    reps: int,
    cprofile: bool,
    device: str = "cpu",
    ab: bool = False,
) -> dict[str, Any]:
    from kvpush.demo.bench import BenchPair, PairSpec, block_tables

    module = __spec__.name if __spec__ is not None else "profile_host_path"
    staging = 2 * layers * block_bytes * blocks + (1 << 20) if method == "packed" else 0
    spec = PairSpec(
        block_bytes=block_bytes,
        layers=layers,
        pool_blocks=max(2 * blocks, 64),
        staging_bytes=staging,
        decode_hook=f"{module}:instrument_decode",
        device=device,
        transport="cuda_ipc" if method == "cuda_ipc" else "nixl",
    )
    # raw NIXL beside a cuda_ipc pair would map D's memory twice (see kvpush.demo.bench)
    raw = None if method == "cuda_ipc" else "raw_nixl"
    if cprofile:
        os.environ["KVPUSH_PROFILE_D"] = "1"
    else:
        os.environ.pop("KVPUSH_PROFILE_D", None)
    if ab:
        os.environ[AB_ENV] = "1"
        install_switch()
    else:
        os.environ.pop(AB_ENV, None)
    FAST["on"] = True
    with BenchPair(spec) as pair:
        p_ids, d_ids = block_tables(blocks, spec.pool_blocks, pattern, seed=0)
        pair.verify(method, p_ids, d_ids)
        if raw:
            pair.verify(raw, p_ids, d_ids)
        rec = instrument_prefill(pair)
        profiler = cProfile.Profile() if cprofile else None
        if profiler is not None:
            pair.sender.call_on_writer(profiler.enable)
        raw_times: list[float] = []
        rows: list[dict[str, float]] = []
        off_rows: list[dict[str, float]] = []
        for rep in range(reps + 3):
            FAST["on"] = not ab or rep % 2 == 0  # D flips its own at each rep's "stats"
            if raw:
                raw_times.append(pair.run(raw, p_ids, d_ids) * 1e6)
            run = pair.prepare(method, p_ids, d_ids)
            rec.take()
            returned: list[int] = []
            pair.sender.request_finished = _stamped(pair.sender.request_finished, returned)
            try:
                t0 = ns()
                run()
                t_end = ns()
            finally:
                del pair.sender.request_finished
            t_ret = returned[0] if returned else t0
            pair.settle()
            d_events = pair._call(("stats",))["hook"]["events"]
            if rep >= 3:  # warm-up reps are not counted
                row = request_stages(t0, t_ret, t_end, rec.take(), d_events)
                (rows if FAST["on"] else off_rows).append(row)
        idle = idle_cpu(pair, method, p_ids, d_ids)
        d_profile = pair._call(("stats",))["hook"]["profile"] if cprofile else ""
        p_profile = ""
        if profiler is not None:
            pair.sender.call_on_writer(profiler.disable)
            p_profile = _top(profiler, 60)
    FAST["on"] = True
    stages = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[-1]}
    off = {k: statistics.median(r[k] for r in off_rows if k in r) for k in rows[-1]} if off_rows else {}
    return {
        "stages_off_us": off,
        "idle": idle,
        "shape": f"{2 * layers} regions x {blocks} x {block_bytes // 1024} KiB {pattern}, {method}",
        "bytes": 2 * layers * block_bytes * blocks,
        "raw_nixl_us": statistics.median(raw_times[3:]) if raw_times else float("nan"),
        "launches": _launch_stats(pair),
        "stages_us": stages,
        "p_profile": p_profile,
        "d_profile": d_profile,
    }


def idle_cpu(pair: Any, method: str, p_ids: Any, d_ids: Any, seconds: float = 1.0) -> dict[str, float]:
    """Writer threads' CPU (% of a core) and D's polls per second, with nothing to do and
    with one request registered on D that P has not finished yet (D is busy: it polls at
    its busy interval)."""

    def sample() -> tuple[int, int, int, int]:
        d = pair._call(("stats",))["hook"]
        return ns(), pair.sender.call_on_writer(time.thread_time_ns), d["writer_cpu_ns"], d["drains"]

    def share(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[float, float, float]:
        wall = b[0] - a[0]
        return 100 * (b[1] - a[1]) / wall, 100 * (b[2] - a[2]) / wall, 1e9 * (b[3] - a[3]) / wall

    pair.settle()
    first = sample()
    time.sleep(seconds)
    p_idle, d_idle, d_idle_polls = share(first, sample())
    first = sample()  # D answers nothing while it waits for a request: sample around it
    run = pair.prepare(method, p_ids, d_ids)  # D registered, P not finished: D polls busy
    time.sleep(seconds)
    run()
    pair.settle()
    p_wait, d_pending, d_polls = share(first, sample())
    return {
        "P writer CPU %, idle": p_idle,
        "D writer CPU %, idle": d_idle,
        "D polls/s, idle": d_idle_polls,
        "P writer CPU %, D waiting": p_wait,
        "D writer CPU %, a request pending": d_pending,
        "D polls/s, a request pending": d_polls,
    }


def _launch_stats(pair: Any) -> dict[str, Any]:
    """P's kernel launches (CUDA): launches, direct replays, host seconds per launch."""
    from kvpush.core import kernels

    out: dict[str, Any] = {}
    for (_thread, device), copier in kernels._COPIERS.items():
        launches = max(1, copier.launches)
        out[f"cuda:{device}"] = {
            "launches": copier.launches,
            "replays": copier.replays,
            "host_us_per_launch": [round(1e6 * x / launches, 1) for x in copier.host_seconds],
        }
    seconds = getattr(pair.sender.transport, "post_seconds", None)
    writes = getattr(pair.sender.transport, "ipc_writes", 0)
    if seconds and writes:
        out["ipc_post_us_per_write"] = [round(1e6 * x / writes, 1) for x in seconds]
    return out


SHAPES = {
    "small": {"layers": 4, "block_bytes": 4096, "blocks": 16, "pattern": "contiguous", "method": "direct"},
    "large": {"layers": 16, "block_bytes": 4096, "blocks": 512, "pattern": "scattered", "method": "direct"},
    "packed": {"layers": 16, "block_bytes": 4096, "blocks": 512, "pattern": "scattered", "method": "packed"},
    # GPU (--device cuda): issue 14's rows
    "direct32m": {
        "layers": 32,
        "block_bytes": 32768,
        "blocks": 16,
        "pattern": "contiguous",
        "method": "direct",
    },
    "direct256m": {  # issue 14's `direct` target row (contiguous, NIXL): where its gap to raw goes
        "layers": 32,
        "block_bytes": 32768,
        "blocks": 128,
        "pattern": "contiguous",
        "method": "direct",
    },
    "ipc256m": {
        "layers": 32,
        "block_bytes": 32768,
        "blocks": 128,
        "pattern": "scattered",
        "method": "cuda_ipc",
    },
    # Llama-70B TP8 (80 layers x K/V, 256 blocks of 4 KiB: a 4k-token prompt), issue 17's preset
    "ipc70b": {
        "layers": 80,
        "block_bytes": 4096,
        "blocks": 256,
        "pattern": "scattered",
        "method": "cuda_ipc",
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: small and large")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument(
        "--d-busy-poll-us",
        type=float,
        help="D's busy_poll_s for this run, in microseconds (the bench pair's default: 50)",
    )
    parser.add_argument(
        "--ab",
        action="store_true",
        help="alternate requests with and without round 2's fast paths (one run, both columns)",
    )
    parser.add_argument(
        "--cprofile", action="store_true", help="also print cProfile tops of P's and D's writer"
    )
    parser.add_argument(
        "--cprofile-sort",
        choices=["tottime", "cumulative"],
        default="tottime",
        help="order of the cProfile tops: own time (default) or with callees (the stages)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="KV caches on cuda:0 (shapes direct32m, ipc256m)",
    )
    args = parser.parse_args(argv)
    os.environ["KVPUSH_PROFILE_SORT"] = args.cprofile_sort  # D's process inherits it
    device = "cuda:0" if args.device == "cuda" else "cpu"
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    if args.d_busy_poll_us is not None:
        os.environ[D_POLL_ENV] = str(args.d_busy_poll_us)
    for name in args.shape or (["direct32m", "ipc256m"] if device != "cpu" else ["small", "large"]):
        result = profile_shape(
            **SHAPES[name], reps=args.reps, cprofile=args.cprofile, device=device, ab=args.ab
        )
        stages, off = result["stages_us"], result["stages_off_us"]
        print(
            f"\n== {name}: {result['shape']} ({result['bytes'] / 2**20:.1f} MiB), medians of {args.reps} (us)"
        )
        if off:
            print(f"{'(fast paths)':<44}{'off':>10}{'on':>10}  on/off")
        print(f"{'raw NIXL (same WRITE, D polls the notif)':<44}{result['raw_nixl_us']:>10.1f}")
        for label, value in stages.items():
            if off:
                ratio = value / off[label] if off.get(label) else float("nan")
                print(f"{label:<44}{off.get(label, float('nan')):>10.1f}{value:>10.1f}  {ratio:.2f}")
            else:
                print(f"{label:<44}{value:>10.1f}")
        over = stages["total"] - result["raw_nixl_us"]
        if off:
            print(f"{'overhead over raw NIXL':<44}{off['total'] - result['raw_nixl_us']:>10.1f}{over:>10.1f}")
        else:
            print(f"{'overhead over raw NIXL':<44}{over:>10.1f}")
        for label, value in result["idle"].items():
            print(f"{label:<44}{value:>10.1f}")
        if result["launches"]:
            print(f"kernel launches on P: {result['launches']}")
        if args.cprofile:
            print("\n-- P writer thread, cProfile (" + args.cprofile_sort + ") --\n" + result["p_profile"])
            print("\n-- D writer thread, cProfile (" + args.cprofile_sort + ") --\n" + result["d_profile"])
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
