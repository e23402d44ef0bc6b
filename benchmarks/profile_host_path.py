"""Where one request's host time goes, stage by stage, on P and on D (issue 14).

P (this process) and D (a spawned process) are the ``kvpush bench`` pair
(:class:`kvpush.demo.bench.BenchPair`: real ``PushSender`` / ``PushReceiver`` over real NIXL,
plus a bare ``nixl_agent`` each for the raw column). Both sides' methods are wrapped with
``time.perf_counter_ns`` stamps (CLOCK_MONOTONIC: one clock for both processes), one request
at a time, and each stage's median is printed beside raw NIXL doing the same WRITE:

P: ``finish -> core``   ``request_finished`` returns -> the writer thread runs the core (the hop)
   ``core -> post``     core.finished (planning, read-spec hook) -> ``_post`` starts
   ``post checks``      ``_post`` -> transport post (confirm_post, descriptor ids, strategy hook)
   ``transport post``   NIXL ``make_prepped_xfer`` + ``transfer`` (or the packed gather+post)
   ``post -> DONE``     posted -> the poll that saw DONE
D: ``DONE -> D drain``  P saw DONE -> D's drain returned the notification (D's poll wait)
   ``D core``           D's core handled the notification (and its actions up to the report)
   ``D report -> ack``  D reported the request -> P got D's acknowledgement (pipe, bench loop)

plus the time inside each plugin hook, planning and descriptor-id building per request. Run::

    .venv/bin/python benchmarks/profile_host_path.py            # both shapes, 60 reps
    .venv/bin/python benchmarks/profile_host_path.py --cprofile  # cProfile of P's writer thread

``--cprofile`` adds a run with cProfile enabled in P's writer thread (and D's, via
``KVPUSH_PROFILE_D``) and prints the top functions by own time.
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
Event = tuple[str, int, int]
"""(label, start ns, end ns) of one wrapped call."""


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
            start = ns()
            try:
                return original(*args, **kwargs)
            finally:
                events.append((tag(*args, **kwargs) if tag else fixed, start, ns()))

        setattr(obj, name, timed)

    def take(self) -> list[Event]:
        out, self.events[:] = list(self.events), []
        return out


# ------------------------------------------------------------------------------ D's side


def instrument_decode(receiver: Any) -> Callable[[], Any]:
    """Stamp D's drain, core and report; the returned callable hands the events over (and a
    cProfile text of D's writer thread when ``KVPUSH_PROFILE_D`` is set)."""
    rec = Recorder()
    transport = receiver.transport
    drain = transport.drain_notifs

    def drain_notifs() -> Any:
        start = ns()
        batch = drain()
        if batch:
            rec.events.append(("D.drain", start, ns()))
        return batch

    transport.drain_notifs = drain_notifs
    rec.wrap(receiver.core, "notification", tag=lambda peer, note, now: f"D.note.{note.kind.value}")
    rec.wrap(receiver, "_report", "D.report")
    profiler = cProfile.Profile() if os.environ.get("KVPUSH_PROFILE_D") else None
    if profiler is not None:
        receiver.call_on_writer(profiler.enable)

    def report() -> Any:
        text = ""
        if profiler is not None:
            receiver.call_on_writer(profiler.disable)
            text = _top(profiler, 25)
            profiler.clear()
            receiver.call_on_writer(profiler.enable)
        return {"events": rec.take(), "profile": text}

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
    for hook in ("build_read_specs", "transfer_strategy", "expected_producers"):
        rec.wrap(sender.pm, hook, f"P.hook.{hook}")
    transport = sender.transport
    rec.wrap(transport, "post_write", "P.transport.post")
    poll = transport.poll

    def timed_poll(handle: Any) -> Any:
        start = ns()
        state = poll(handle)
        rec.events.append((f"P.poll.{state.value}", start, ns()))
        return state

    transport.poll = timed_poll
    return rec


def _first(events: list[Event], label: str, after: int = 0) -> Event | None:
    return next((e for e in events if e[0] == label and e[1] >= after), None)


def _last(events: list[Event], label: str, before: int) -> Event | None:
    hits = [e for e in events if e[0] == label and e[2] <= before]
    return hits[-1] if hits else None


def _total(events: list[Event], label: str) -> tuple[float, int]:
    hits = [e for e in events if e[0] == label]
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
            "D core (DONE)": (note[2] - note[1]) / 1e3,
            "D core -> report": (report[2] - note[2]) / 1e3,
            "D report -> ack": (t_end - report[2]) / 1e3,
            "P DONE -> P report": (p_report[2] - done[2]) / 1e3 if p_report else float("nan"),
        }
    )
    for label in ("P.plan", "P.descriptor_ids", *(f"P.hook.{h}" for h in HOOKS)):
        total, calls = _total([e for e in p if t0 <= e[1] <= t_end], label)
        out[f"{label} (x{calls})"] = total
    return out


HOOKS = ("build_read_specs", "transfer_strategy", "expected_producers")


def _top(profiler: cProfile.Profile, n: int) -> str:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(n)
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
    *, layers: int, block_bytes: int, blocks: int, pattern: str, method: str, reps: int, cprofile: bool
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
    )
    if cprofile:
        os.environ["KVPUSH_PROFILE_D"] = "1"
    else:
        os.environ.pop("KVPUSH_PROFILE_D", None)
    with BenchPair(spec) as pair:
        p_ids, d_ids = block_tables(blocks, spec.pool_blocks, pattern, seed=0)
        pair.verify(method, p_ids, d_ids)
        pair.verify("raw_nixl", p_ids, d_ids)
        rec = instrument_prefill(pair)
        profiler = cProfile.Profile() if cprofile else None
        if profiler is not None:
            pair.sender.call_on_writer(profiler.enable)
        raw_times: list[float] = []
        rows: list[dict[str, float]] = []
        for rep in range(reps + 3):
            raw_times.append(pair.run("raw_nixl", p_ids, d_ids) * 1e6)
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
                rows.append(request_stages(t0, t_ret, t_end, rec.take(), d_events))
        d_profile = pair._call(("stats",))["hook"]["profile"] if cprofile else ""
        p_profile = ""
        if profiler is not None:
            pair.sender.call_on_writer(profiler.disable)
            p_profile = _top(profiler, 30)
    stages = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[-1]}
    return {
        "shape": f"{2 * layers} regions x {blocks} x {block_bytes // 1024} KiB {pattern}, {method}",
        "bytes": 2 * layers * block_bytes * blocks,
        "raw_nixl_us": statistics.median(raw_times[3:]),
        "stages_us": stages,
        "p_profile": p_profile,
        "d_profile": d_profile,
    }


SHAPES = {
    "small": {"layers": 4, "block_bytes": 4096, "blocks": 16, "pattern": "contiguous", "method": "direct"},
    "large": {"layers": 16, "block_bytes": 4096, "blocks": 512, "pattern": "scattered", "method": "direct"},
    "packed": {"layers": 16, "block_bytes": 4096, "blocks": 512, "pattern": "scattered", "method": "packed"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: small and large")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument(
        "--cprofile", action="store_true", help="also print cProfile tops of P's and D's writer"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    for name in args.shape or ["small", "large"]:
        result = profile_shape(**SHAPES[name], reps=args.reps, cprofile=args.cprofile)
        stages = result["stages_us"]
        print(
            f"\n== {name}: {result['shape']} ({result['bytes'] / 2**20:.1f} MiB), medians of {args.reps} (us)"
        )
        print(f"{'raw NIXL (same WRITE, D polls the notif)':<44}{result['raw_nixl_us']:>10.1f}")
        for label, value in stages.items():
            print(f"{label:<44}{value:>10.1f}")
        print(f"{'overhead over raw NIXL':<44}{stages['total'] - result['raw_nixl_us']:>10.1f}")
        if args.cprofile:
            print("\n-- P writer thread, cProfile by own time --\n" + result["p_profile"])
            print("\n-- D writer thread, cProfile by own time --\n" + result["d_profile"])
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
