"""Multi-rank ``kvpush bench --serve``: P as PP x TP rank processes, D as TP rank processes.

Every rank is a process built by the demo's machinery (:mod:`kvpush.demo.rank`: its
``RankSpec``, plugin manager, caches, and a started ``PushSender`` or ``PushReceiver`` with its
own transport agent), driven open-loop from here instead of the demo's request/reply loop:
messages to a rank get no reply unless noted, and a rank reports on its own as things happen.
This process plays both engines' schedulers (one churned block pool per engine, its ids shared
by all the engine's ranks, as one block table is) and the router.

Per request: at arrival D's ranks register it and P's ranks learn its blocks (a sampled request
is filled with :func:`kvpush.demo.content.fill_request`, which is head-aware, so a slice pushed
across different TP sizes lands where D expects it); ``--prefill-ms`` later every P rank
"finishes" it. The clock starts at the **earliest** P rank's finish stamp and stops when the
**last** D rank reported the request done (its receiver's completion stamp). Each D rank
verifies sampled requests with ``verify_request`` once nothing is in flight on it (a check run
at once would hold up the stamps of the requests after it), and the driver keeps a sample's
blocks until every check reported. Stamps are ``time.perf_counter`` (``CLOCK_MONOTONIC``, one
host).

Ideals for the same arrivals (``mode``):

- ``nixl``: each P rank posts, at the finish, one raw NIXL WRITE per D rank it writes (kvpush's
  TP mapping, :func:`kvpush.demo.serve_kernel.targets`), whose transfer handle was built at
  arrival from prepared descriptor lists (nothing is computed at the finish); each D rank is
  done when it has every producer's notification;
- ``kernel`` (CUDA): each P rank launches one kernel copying all its slices into a second
  allocation shaped as its D ranks' caches on D's device; done when every P rank's copy
  finished (sampled: the copy is compared with P's rows).

Protocol (tuples): to P ``("connect", [(d_rank, payload, raw_meta)], d_specs, kernel)``
-> ``("connected", bytes per block per group)``; ``("prefill", rid, p_ids, d_ids, seed, mode)``;
``("finish", rid)`` -> ``("finished", rid, t)``, later ``("sent", rid, reason)`` and (kernel)
``("done", rid, t, reason, ok, miss)``. To D ``("connect", [raw_meta])`` -> ``("connected",
None)``; ``("add", rid, d_ids, params, seed, mode)`` -> later ``("done", rid, t, reason, ok,
miss)``. ``ok`` is None for a request not sampled and ``"deferred"`` for a sample, whose
``("verified", rid, ok, miss)`` follows (on P, kernel ideal: before its ``sent``). To both
``("stats",)`` -> ``("stats", dict)``; ``("stop",)`` -> ``("stopped", None)``.
A rank that fails sends ``("error", traceback)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs

MODES = ("kvpush", "nixl", "kernel")


@attrs.frozen(kw_only=True)
class RankOptions:
    """What a serve rank needs beyond its ``RankSpec`` (picklable)."""

    prefill_pp: int
    prefill_tp: int
    decode_tp: int
    poll_s: float = 50e-6
    raw: bool = True
    """Build a raw NIXL agent over the rank's KV (the ``nixl`` ideal)."""
    switch_interval_us: float = 0.0


class _Landed:
    """Stands in for the event of an empty copy."""

    @staticmethod
    def query() -> bool:
        return True


@attrs.define
class _Request:
    p_ids: list[list[int]]
    d_ids: list[list[int]]
    seed: int | None
    mode: str
    handles: list[Any] = attrs.Factory(list)
    spans: Any = None
    event: Any = None
    """Kernel ideal: the copy's CUDA event; nixl ideal: when the WRITEs were posted."""


def serve_rank_main(spec: Any, conn: Connection, options: RankOptions) -> None:
    """A serve rank's process: ``("ready", (handshake payload, raw agent metadata))``, then the
    open-loop protocol of the module docstring until ``("stop",)`` or the parent is gone."""
    logging.basicConfig(
        level=os.environ.get("KVPUSH_LOG_LEVEL", spec.log_level),
        format=f"%(asctime)s serve-{spec.role}{spec.parallel.rank} %(message)s",
    )
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        import torch

        torch.set_num_threads(1)
        if options.switch_interval_us > 0:
            sys.setswitchinterval(options.switch_interval_us / 1e6)
        rank = _ServeRank(spec, options, conn)
        raw_meta = rank.raw.metadata() if rank.raw is not None else None
        conn.send(("ready", (rank.worker.handshake_payload(), raw_meta)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        rank.loop()
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        rank.worker.close()


class _ServeRank:
    def __init__(self, spec: Any, options: RankOptions, conn: Connection) -> None:
        from kvpush.core.producers import expected_producers
        from kvpush.demo.bench import RawAgent
        from kvpush.demo.rank import _RankServer

        self.base = _RankServer(spec)  # caches, started worker, regions and their views
        self.spec, self.options, self.conn = spec, options, conn
        self.worker = self.base.worker
        self.regions = self.base.regions
        self.groups = [r.kv_group for r in self.regions]
        self.prefill = spec.role == "prefill"
        p = spec.parallel
        self.tag = f"{p.pp_rank}.{p.tp_rank}"
        self.raw = RawAgent(f"serve-raw-{spec.role}-{self.tag}", self.regions) if options.raw else None
        self.requests: dict[str, _Request] = {}
        self.checks: list[tuple[str, _Request]] = []
        """Sampled requests that ended, checked once nothing is in flight on this rank (see
        ``kvpush.demo.serve.DeferredChecks``); reported with ``("verified", rid, ok, miss)``."""
        self._got: Any = None  # results wait_finished already took from the receiver
        self.raw_pairs: list[tuple[Any, Any, Any, Any]] = []
        self.kernel: Any = None
        self._keep: list[Any] = []  # kernel-ideal copy allocations
        self.notifs: dict[str, int] = {}
        self.unreleased: dict[str, tuple[float, str]] = {}
        """D: failed requests whose blocks kvpush has not released yet (reported once it has:
        the driver gives the blocks back to its pool when a request is reported)."""
        self.expected = (
            0
            if self.prefill
            else len(
                expected_producers(
                    prefill_pp=options.prefill_pp,
                    prefill_tp=options.prefill_tp,
                    decode_tp_rank=p.tp_rank,
                    decode_tp_size=options.decode_tp,
                )
            )
        )

    # ------------------------------------------------------------------ loop

    def loop(self) -> None:
        while True:
            while self.conn.poll(0):
                if not self.handle(self.conn.recv()):
                    return
            busy = self.poll_prefill() if self.prefill else self.poll_decode()
            if busy:
                continue
            if self.checks and not self.requests:  # nothing in flight: no clock is running
                self.run_check()
            elif not self.prefill and self._pushes_in_flight() and not self.conn.poll(0):
                # Sleep on the receiver (it wakes this at a request's end) instead of asking it
                # every poll_s, which takes the GIL from its writer thread 20 k times a second.
                from kvpush.core.errors import WaitTimeout
                from kvpush.demo.serve import WAKE_S

                with contextlib.suppress(WaitTimeout):
                    self._got = self.worker.wait_finished(WAKE_S)
            else:
                self.conn.poll(self.options.poll_s)  # wakes at once for a new message

    def _pushes_in_flight(self) -> bool:
        """D: a kvpush request is registered and not yet done (and no raw ideal to poll)."""
        pending = self.requests.values()
        return bool(pending) and (self.raw is None or all(r.mode == "kvpush" for r in pending))

    def run_check(self) -> None:
        """Verify the oldest held sample and report it (P, kernel ideal: then ``sent``, which
        frees its blocks)."""
        rid, request = self.checks.pop(0)
        if self.prefill:
            ok = bool(self.kernel.check(request.spans))
            miss = None if ok else "the kernel's copy does not hold P's bytes"
            self.send(("verified", rid, ok, miss))
            self.send(("sent", rid, None))
            return
        from kvpush.demo.content import verify_request

        self.base._synchronize()
        parallel = self.spec.parallel
        miss = verify_request(self.regions, self.base.tensors, parallel, request.seed, request.d_ids)
        self.send(("verified", rid, miss is None, miss))

    def send(self, message: tuple[Any, ...]) -> None:
        self.conn.send(message)

    def handle(self, message: tuple[Any, ...]) -> bool:
        kind = message[0]
        if kind == "stop":
            self.send(("stopped", None))
            return False
        if kind == "stats":
            worker = self.worker
            self.send(
                ("stats", {"stats": dict(worker.stats), "counters": worker.transport.counters.as_dict()})
            )
        elif kind == "connect":
            self.send(
                (
                    "connected",
                    self.connect_prefill(*message[1:]) if self.prefill else self.connect_decode(message[1]),
                )
            )
        elif kind == "prefill":
            self.on_prefill(*message[1:])
        elif kind == "finish":
            self.on_finish(message[1])
        elif kind == "add":
            self.on_add(*message[1:])
        else:
            raise ValueError(f"serve rank: unknown message {kind!r}")
        return True

    # ------------------------------------------------------------------ P

    def connect_prefill(
        self,
        d_infos: Sequence[tuple[int, bytes, bytes | None]],
        d_specs: Sequence[Any],
        kernel: bool,
    ) -> list[int]:
        """Plan this rank's WRITEs to D's ranks (and, ``kernel``, allocate the kernel ideal's
        copies on each D rank's device); returns the bytes it writes per block per group."""
        from kvpush.core import wire
        from kvpush.demo.serve_kernel import KernelIdeal, SpanTable, align, enable_peer_access, targets

        o, p = self.options, self.spec.parallel
        replicate = all(r.replicate for r in self.regions)
        infos = {d: (payload, raw_meta) for d, payload, raw_meta in d_infos}
        groups = self.groups
        total = [0] * self.spec.model.num_groups
        kernel_pairs = []
        for d, local_part, remote_part in targets(p.tp_rank, o.prefill_tp, o.decode_tp, replicate):
            device = d_specs[d].device
            payload, raw_meta = infos[d]
            meta = wire.decode_metadata(payload, expected_hash=None, source=f"serve D rank {d}")
            local = SpanTable(self.regions, local_part, groups)
            remote = SpanTable(align(self.regions, meta.regions), remote_part, groups)
            total = [a + b for a, b in zip(total, local.bytes_per_block(len(total)))]
            if self.raw is not None and raw_meta is not None:
                agent, mem = self.raw.agent, self.raw.mem
                peer = agent.add_remote_agent(raw_meta)
                peer = peer.decode() if isinstance(peer, bytes) else peer
                local_list = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local.table, mem)
                remote_list = agent.prep_xfer_dlist(peer, remote.table, mem)
                self.raw_pairs.append((local_list, remote_list, local, remote))
            if kernel:
                enable_peer_access(self.spec.device, device)
                kernel_pairs.append((local, self._copy_table(d_specs[d], device, remote_part)))
        if kernel_pairs:
            self.kernel = KernelIdeal(self.spec.device, kernel_pairs)
        return total

    def _copy_table(self, d_spec: Any, device: str, part: tuple[int, int]) -> Any:
        """A second allocation shaped as D rank ``d_spec``'s caches on ``device`` (the kernel
        ideal writes there), as a span table aligned to this rank's regions."""
        import attrs as _attrs

        from kvpush.demo.rank import allocate, plugin_manager
        from kvpush.demo.serve_kernel import SpanTable, align, require_cuda

        require_cuda(device)
        spec = _attrs.evolve(d_spec, device=device)
        pm = plugin_manager(spec)
        caches = allocate(spec, pm)
        self._keep.append(caches)
        regions = pm.layout(spec.layout).describe(caches, spec.parallel, spec.model)
        return SpanTable(align(self.regions, regions), part, self.groups)

    def on_prefill(
        self, rid: str, p_ids: list[list[int]], d_ids: list[list[int]], seed: int | None, mode: str
    ) -> None:
        if seed is not None:
            from kvpush.demo.content import fill_request

            fill_request(self.regions, self.base.tensors, self.spec.parallel, seed, p_ids)
            self.base._synchronize()
        request = _Request(p_ids, d_ids, seed, mode)
        if mode == "nixl":
            if self.raw is None:
                raise ValueError("serve rank: the nixl ideal needs the raw agent (RankOptions.raw)")
            agent = self.raw.agent
            notif = f"{rid}|{self.tag}".encode()
            for local_list, remote_list, local, remote in self.raw_pairs:
                request.handles.append(
                    agent.make_prepped_xfer(
                        "WRITE", local_list, local.ids(p_ids), remote_list, remote.ids(d_ids), notif
                    )
                )
        elif mode == "kernel":
            if self.kernel is None:
                raise ValueError("serve rank: the kernel ideal was not set up (connect without a device)")
            request.spans = self.kernel.spans(p_ids, d_ids)
        self.requests[rid] = request

    def on_finish(self, rid: str) -> None:
        request = self.requests[rid]
        now = time.perf_counter()
        if request.mode == "kvpush":
            self.worker.request_finished(rid, request.p_ids, match_key=rid)
        elif request.mode == "nixl":
            for handle in request.handles:
                self.raw.agent.transfer(handle)
            request.event = now  # posted
        else:
            request.event = self.kernel.launch(request.spans) or _Landed()  # None: nothing to copy
        self.send(("finished", rid, now))

    def poll_prefill(self) -> bool:
        busy = False
        got = self.worker.get_finished()
        for rid in got.sent:
            self.requests.pop(rid, None)
            self.send(("sent", rid, None))
        for rid, reason in got.failed.items():
            self.requests.pop(rid, None)
            self.send(("sent", rid, str(reason)))
        for rid, request in list(self.requests.items()):
            if request.mode == "nixl" and request.event is not None:  # posted
                states = [self.raw.agent.check_xfer_state(h) for h in request.handles]
                if "PROC" in states:
                    busy = True
                    continue
                for handle in request.handles:
                    self.raw.agent.release_xfer_handle(handle)
                del self.requests[rid]
                bad = [s for s in states if s != "DONE"]
                self.send(("sent", rid, f"raw WRITE ended in {bad[0]}" if bad else None))
            elif request.mode == "kernel" and request.event is not None:
                if not request.event.query():
                    busy = True
                    continue
                now = time.perf_counter()
                del self.requests[rid]
                if request.seed is not None:  # checked once idle; "sent" (blocks free) after
                    self.checks.append((rid, request))
                    self.send(("done", rid, now, None, "deferred", None))
                    continue
                self.send(("done", rid, now, None, None, None))
                self.send(("sent", rid, None))
        return busy

    # ------------------------------------------------------------------ D

    def connect_decode(self, raw_metas: Sequence[bytes | None]) -> None:
        if self.raw is not None:
            for blob in raw_metas:
                if blob is not None:
                    self.raw.agent.add_remote_agent(blob)

    def on_add(
        self, rid: str, d_ids: list[list[int]], params: dict[str, Any], seed: int | None, mode: str
    ) -> None:
        from kvpush.core.types import RequestMetadata, TransferParams

        self.requests[rid] = _Request([], d_ids, seed, mode)
        if mode == "kvpush":
            meta = RequestMetadata(request_id=rid, block_ids=d_ids, params=TransferParams.from_dict(params))
            self.worker.add_request(meta)
        elif self.notifs.get(rid, 0) >= self.expected:  # every WRITE landed before the add
            self._done(rid, time.perf_counter(), None)

    def poll_decode(self) -> bool:
        got, self._got = self._got or self.worker.get_finished(), None
        now = time.perf_counter()
        for rid in got.done:
            self._done(rid, got.completed_at.get(rid, now), None)
        for rid, reason in got.failed.items():
            self.unreleased[rid] = (now, str(reason))
        for rid in got.released:
            if rid in self.unreleased:
                self._done(rid, *self.unreleased.pop(rid))
        if self.raw is not None:
            for messages in self.raw.agent.get_new_notifs().values():
                for tag in messages:
                    rid = bytes(tag).split(b"|", 1)[0].decode()
                    self.notifs[rid] = self.notifs.get(rid, 0) + 1
                    if rid in self.requests and self.notifs[rid] == self.expected:
                        self._done(rid, now, None)
        return False

    def _done(self, rid: str, t: float, reason: str | None) -> None:
        request = self.requests.pop(rid, None)
        self.notifs.pop(rid, None)
        if request is None:
            return
        if reason is None and request.seed is not None:  # checked once this rank is idle
            self.checks.append((rid, request))
            self.send(("done", rid, t, reason, "deferred", None))
            return
        self.send(("done", rid, t, reason, None, None))


# ---------------------------------------------------------------------------- the driver


@attrs.define
class _Tally:
    """One request's reports so far."""

    finished: list[float] = attrs.Factory(list)
    sent: int = 0
    done: int = 0
    done_at: float = 0.0
    oks: list[bool] = attrs.Factory(list)
    misses: list[str] = attrs.Factory(list)
    unchecked: int = 0
    """Reports of ``done`` whose sample check is still to come (``verified``)."""
    failure: str | None = None


class ServeCluster:
    """P's and D's rank processes for one multi-rank workload; this process schedules both."""

    def __init__(self, w: Any, modes: Sequence[str] = ("kvpush", "nixl")) -> None:
        from kvpush.core.types import ParallelConfig
        from kvpush.demo.rank import RankSpec
        from kvpush.demo.runner import _start_ranks, start_side_channel
        from kvpush.demo.serve import BlockPool

        self.w = w
        self.modes = tuple(modes)
        pp, ptp, dtp = w.topology()
        self.topology = (pp, ptp, dtp)
        model = w.model()
        self.model = model
        p_devices, d_devices = w.rank_devices()
        kernel = "kernel" in self.modes
        if kernel:
            from kvpush.demo.serve_kernel import require_cuda

            for device in {*p_devices, *d_devices}:
                require_cuda(device)
        self.p_ranks: list[Any] = []
        self.d_ranks: list[Any] = []
        self.servers: list[Any] = []
        try:
            p_server = start_side_channel("serve-P")
            self.servers.append(p_server)
            d_server = start_side_channel("serve-D")
            self.servers.append(d_server)
            from kvpush.demo.bench import nixl_transport_options

            common = {
                "model": model,
                "layout": w.layout,
                "blocks_per_group": tuple(w.pool()),
                "request_timeout_s": w.timeout_s,
                "transport": w.transport,
                "transport_options": nixl_transport_options(w.transport, dict(w.nixl_options)),
                "worker_options": {
                    "busy_poll_s": w.poll_s,
                    "staging_bytes": max(64 << 20, 4 * w.max_request_bytes()),
                },
            }
            p_specs = [
                RankSpec(
                    role="prefill",
                    engine_id="serve-P",
                    parallel=ParallelConfig.for_stage(
                        num_layers=model.num_layers, pp_size=pp, pp_rank=s, tp_size=ptp, tp_rank=t
                    ),
                    device=p_devices[(s * ptp + t) % len(p_devices)],
                    side_channel_port=p_server.port,
                    **common,
                )
                for s in range(pp)
                for t in range(ptp)
            ]
            d_specs = [
                RankSpec(
                    role="decode",
                    engine_id="serve-D",
                    parallel=ParallelConfig(tp_size=dtp, tp_rank=t, num_layers=model.num_layers),
                    device=d_devices[t % len(d_devices)],
                    side_channel_port=d_server.port,
                    **common,
                )
                for t in range(dtp)
            ]
            options = RankOptions(
                prefill_pp=pp,
                prefill_tp=ptp,
                decode_tp=dtp,
                poll_s=w.poll_s,
                raw="nixl" in self.modes,
                switch_interval_us=w.switch_interval_us,
            )
            extra = (options,)
            self.p_ranks, p_ready = _start_ranks(p_specs, 180, target=serve_rank_main, extra=extra)
            self.d_ranks, d_ready = _start_ranks(d_specs, 180, target=serve_rank_main, extra=extra)
            p_server.publish_all({k: v[0] for k, v in p_ready.items()})
            d_server.publish_all({k: v[0] for k, v in d_ready.items()})
            d_infos = [(r.key.tp_rank, d_ready[r.key][0], d_ready[r.key][1]) for r in self.d_ranks]
            for rank in self.p_ranks:
                rank.send(("connect", d_infos, d_specs, kernel))
            for rank in self.d_ranks:
                rank.send(("connect", [p_ready[r.key][1] for r in self.p_ranks]))
            per_block = [self._expect(rank, "connected", 120) for rank in self.p_ranks]
            for rank in self.d_ranks:
                self._expect(rank, "connected", 120)
            self.group_bytes = [sum(col) for col in zip(*per_block)]
            self.p_pools = [BlockPool(n, w.seed + 100 + g) for g, n in enumerate(w.pool())]
            self.d_pools = [BlockPool(n, w.seed + 1 + g) for g, n in enumerate(w.pool())]
        except BaseException:
            self.close()
            raise
        self.runs = 0
        self.params = {
            "remote_engine_id": "serve-P",
            "remote_host": "127.0.0.1",
            "remote_port": p_server.port,
            "tp_size": ptp,
            "pp_size": pp,
        }
        self._tallies: dict[str, _Tally] = {}

    # ------------------------------------------------------------------ plumbing

    def _expect(self, rank: Any, kind: str, timeout_s: float) -> Any:
        """Read ``rank``'s messages (handling any late report) until one of ``kind``; bounded."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not rank.conn.poll(left):
                raise TimeoutError(f"serve rank {rank.key} sent no {kind!r} within {timeout_s}s")
            message = rank.conn.recv()
            if message[0] == kind:
                return message[1]
            self._on_message(rank, message)

    def _on_message(self, rank: Any, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "error":
            raise RuntimeError(f"serve rank {rank.key} failed:\n{message[1]}")
        if kind not in ("finished", "sent", "done", "verified"):
            return  # a reply nobody waits for any more
        tally = self._tallies.get(message[1])
        if tally is None:
            return  # a late report of an earlier run
        if kind == "finished":
            tally.finished.append(message[2])
        elif kind == "sent":
            tally.sent += 1
            if message[2] is not None and tally.failure is None:
                tally.failure = f"P rank {rank.key}: {message[2]}"
        elif kind == "done":
            _, _, t, reason, ok, miss = message
            tally.done += 1
            tally.done_at = max(tally.done_at, t)
            if reason is not None and tally.failure is None:
                tally.failure = f"rank {rank.key}: {reason}"
            if ok == "deferred":
                tally.unchecked += 1
            elif ok is not None:
                tally.oks.append(bool(ok))
        elif kind == "verified":
            _, _, ok, miss = message
            tally.unchecked -= 1
            tally.oks.append(bool(ok))
            if not ok and miss:
                tally.misses.append(f"rank {rank.key}: {miss}")
                logging.getLogger(__name__).warning("rank %s: %s", rank.key, miss)

    # ------------------------------------------------------------------ one run

    def nbytes(self, counts: Sequence[int]) -> int:
        return sum(c * b for c, b in zip(counts, self.group_bytes))

    def run(
        self,
        rate: float,
        lengths: Sequence[int],
        *,
        ideal: bool | str,
        say: Callable[[str], None],
        prefill_ms: float | None = None,
    ) -> list[Any]:
        """One open-loop run at ``rate`` requests/s (``ideal``: False for kvpush, True or
        ``"nixl"``/``"kernel"`` for an ideal); returns every request's :class:`Outcome`."""
        from kvpush.demo.serve import schedule

        mode = "kvpush" if ideal is False else ("nixl" if ideal is True else str(ideal))
        if mode not in self.modes:
            raise ValueError(f"this cluster was started for {self.modes}, not {mode!r}")
        w = self.w
        self.runs += 1
        prefill_s = (w.prefill_ms if prefill_ms is None else prefill_ms) / 1e3
        arrivals, outcomes = schedule(w, rate, lengths, f"{mode[:2]}{self.runs}", time.perf_counter() + 0.05)
        by_rid = {o.rid: o for o in outcomes}
        self._tallies = {o.rid: _Tally() for o in outcomes}
        blocks: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
        finishes: list[tuple[float, str]] = []
        reporters = self.p_ranks if mode == "kernel" else self.d_ranks
        ranks = [*self.p_ranks, *self.d_ranks]
        conns = {rank.conn: rank for rank in ranks}
        open_ = set(by_rid)
        next_arrival = 0
        deadline = arrivals[-1] + w.timeout_s + 5
        while open_:
            now = time.perf_counter()
            if now > deadline:
                for rid in open_:
                    by_rid[rid].failure = by_rid[rid].failure or "timed out"
                break
            while next_arrival < len(outcomes) and arrivals[next_arrival] <= now:
                o = outcomes[next_arrival]
                next_arrival += 1
                o.arrival = float(arrivals[o.number])
                if not self._arrive(o, mode, blocks, reporters):
                    open_.discard(o.rid)
                    continue
                finishes.append((o.arrival + prefill_s, o.rid))
            finishes.sort()
            while finishes and finishes[0][0] <= time.perf_counter():
                rid = finishes.pop(0)[1]
                for rank in self.p_ranks:
                    rank.send(("finish", rid))
            for conn in wait(list(conns), timeout=0):
                while conn.poll(0):
                    self._on_message(conns[conn], conn.recv())
            for rid in list(open_):
                tally, o = self._tallies[rid], by_rid[rid]
                ended = tally.done >= len(reporters) and len(tally.finished) >= len(self.p_ranks)
                if ended and not tally.unchecked:  # (a sample's blocks stay held until checked)
                    o.finish, o.done = min(tally.finished), tally.done_at
                    o.failure = tally.failure
                    o.verified = all(tally.oks) if tally.oks else None
                    o.miss = "; ".join(tally.misses) or None
                    open_.discard(rid)
                    self._release(self.d_pools, blocks, rid, 1)
                elif mode == "nixl" and tally.failure and tally.sent >= len(self.p_ranks):
                    o.failure = tally.failure  # a raw WRITE failed: D would wait for it in vain
                    open_.discard(rid)
            for rid in [r for r, e in blocks.items() if e[0] is not None]:
                if self._tallies[rid].sent >= len(self.p_ranks):  # every P rank is done with them
                    self._release(self.p_pools, blocks, rid, 0)
            waits = [arrivals[next_arrival] if next_arrival < len(outcomes) else now + 0.01]
            if finishes:
                waits.append(finishes[0][0])
            sleep = min(waits) - time.perf_counter()
            if sleep > 0 and open_:
                wait(list(conns), timeout=min(sleep, 0.001))
        self._settle(blocks)
        return outcomes

    def _arrive(self, o: Any, mode: str, blocks: dict[str, Any], reporters: Sequence[Any]) -> bool:
        """Allocate both engines' blocks and tell every rank; False when a pool is full."""
        w = self.w
        counts = w.blocks_per_group(o.tokens)
        o.nbytes = self.nbytes(counts)
        p_ids = [pool.alloc(n) for pool, n in zip(self.p_pools, counts)]
        d_ids = [pool.alloc(n) for pool, n in zip(self.d_pools, counts)]
        if any(i is None for i in (*p_ids, *d_ids)):
            for pools, got in ((self.p_pools, p_ids), (self.d_pools, d_ids)):
                for pool, ids in zip(pools, got):
                    if ids is not None:
                        pool.release(ids)
            o.failure = "a block pool is full"
            return False
        p_blocks = [list(i) for i in p_ids if i is not None]
        d_blocks = [list(i) for i in d_ids if i is not None]
        blocks[o.rid] = (p_blocks, d_blocks)
        verify = w.verify_every > 0 and o.number % w.verify_every == 0
        seed = self.runs * 1_000_003 + o.number + 1 if verify else None
        if mode != "kernel":
            params = {**self.params, "transfer_id": o.rid, "remote_request_id": o.rid}
            for rank in self.d_ranks:
                rank.send(("add", o.rid, d_blocks, params, seed, mode))
        for rank in self.p_ranks:
            rank.send(("prefill", o.rid, p_blocks, d_blocks, seed, mode))
        return True

    def _release(self, pools: list[Any], blocks: dict[str, Any], rid: str, side: int) -> None:
        entry = blocks.get(rid)
        if entry is None or entry[side] is None:
            return
        for pool, ids in zip(pools, entry[side]):
            pool.release(ids)
        blocks[rid] = (None, entry[1]) if side == 0 else (entry[0], None)
        if blocks[rid] == (None, None):
            del blocks[rid]

    def _settle(self, blocks: dict[str, Any]) -> None:
        """Wait (bounded) for P's last reports, then give every block back."""
        deadline = time.monotonic() + 10
        conns = {rank.conn: rank for rank in self.p_ranks}
        while any(e[0] is not None for e in blocks.values()) and time.monotonic() < deadline:
            for conn in wait(list(conns), timeout=0.05):
                while conn.poll(0):
                    self._on_message(conns[conn], conn.recv())
            for rid in list(blocks):
                if self._tallies[rid].sent >= len(self.p_ranks):
                    self._release(self.p_pools, blocks, rid, 0)
        for rid in list(blocks):
            self._release(self.p_pools, blocks, rid, 0)
            if rid in blocks:
                self._release(self.d_pools, blocks, rid, 1)

    # ------------------------------------------------------------------ reports and teardown

    def stats(self) -> dict[str, int]:
        """P's ranks' sender stats, summed."""
        total: dict[str, int] = {}
        for rank in self.p_ranks:
            rank.send(("stats",))
        for rank in self.p_ranks:
            for key, value in self._expect(rank, "stats", 60)["stats"].items():
                if isinstance(value, int | float):
                    total[key] = total.get(key, 0) + value
        return total

    def close(self) -> None:
        for rank in [*self.p_ranks, *self.d_ranks]:
            with contextlib.suppress(Exception):
                rank.send(("stop",))
        for rank in [*self.p_ranks, *self.d_ranks]:
            rank.process.join(timeout=10)
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(timeout=5)
        for server in self.servers:
            server.close()

    def __enter__(self) -> ServeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MODES", "RankOptions", "ServeCluster", "serve_rank_main"]
