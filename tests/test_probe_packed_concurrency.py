"""Probe (packed): the packed strategy and its staging memory under concurrency and faults.

Every test runs real rank processes over NIXL (UCX on the CPU), the strategy forced to
``packed`` and P's chunk size cut to a few KiB (``small_chunks``, imported in each P rank), so
each push is several chunk WRITEs, each with its own DONE and scatter. D checks every byte of
a request it reports done against the prompt's seed (``kvpush.demo.content``), fills a failed
or cancelled request's blocks with a sentinel once released and checks later that nothing
changed them, and checks that no block no request named was ever written.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ParallelConfig
from kvpush.demo.rank import RankSpec
from kvpush.demo.runner import _Rank, _start_ranks, _stop
from kvpush.demo.soak import SOAK_MODEL

CHUNK = 4096
"""P's packed chunk size in the rank processes: SOAK_MODEL's 8 regions x 1 KiB blocks, so a
request of 8 blocks is 64 KiB, packed as 8 chunk WRITEs."""


class _NoHooks:
    """A plugin with no hooks: importing it is what counts (it shrinks P's chunks)."""


def __getattr__(name: str) -> Any:
    if name == "small_chunks":  # a rank process imports this module and asks for it
        from kvpush.core import packing

        packing.CHUNK_BYTES = CHUNK
        return _NoHooks()
    raise AttributeError(name)


PLUGINS = (("small_chunks", f"{__name__}:small_chunks"),)


class Mesh:
    """Several P engines (one rank each) and one D engine (one rank), as processes."""

    def __init__(
        self,
        p_engines: int = 2,
        *,
        d_engines: int = 1,
        blocks: int = 256,
        p_transport: dict[str, Any] | None = None,
        d_transport: dict[str, Any] | None = None,
        request_timeout_s: float = 30.0,
        lease_s: float = 30.0,
        p_options: dict[str, Any] | None = None,
        d_options: dict[str, Any] | None = None,
    ) -> None:
        self.servers: dict[str, SideChannelServer] = {}
        self.ranks: list[_Rank] = []
        self.p: dict[str, _Rank] = {}
        self.p_specs: dict[str, RankSpec] = {}
        self.ds: dict[str, _Rank] = {}
        parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=SOAK_MODEL.num_layers)
        faulty = p_transport is not None or d_transport is not None  # both sides, or the handshake refuses

        def spec(role: str, engine: str, transport: dict[str, Any] | None, options: Any) -> RankSpec:
            transport = {"inner": "nixl", **(transport or {})} if faulty else {}
            name = "faulty" if faulty else "nixl"
            return RankSpec(
                role=role,
                engine_id=engine,
                parallel=parallel,
                model=SOAK_MODEL,
                layout="uniform",
                blocks_per_group=(blocks,),
                request_timeout_s=request_timeout_s,
                lease_s=lease_s,
                transport=name,
                transport_options=transport,
                worker_options=dict(options or {}),
                strategy="packed",
                plugins=PLUGINS if role == "prefill" else (),
                load_entrypoints=False,
                side_channel_port=self.servers[engine].port,
                log_level="ERROR",
            )

        try:
            for i in range(p_engines):
                engine = f"prefill-{i}"
                self.servers[engine] = SideChannelServer(engine)
                self.p_specs[engine] = spec("prefill", engine, p_transport, p_options)
                (rank,), payloads = _start_ranks([self.p_specs[engine]], timeout_s=120)
                self.ranks.append(rank)
                self.servers[engine].publish_all(payloads)
                self.p[engine] = rank
            for i in range(d_engines):
                engine = f"decode-{i}"
                self.servers[engine] = SideChannelServer(engine)
                (rank,), payloads = _start_ranks([spec("decode", engine, d_transport, d_options)], 120)
                self.ranks.append(rank)
                self.servers[engine].publish_all(payloads)
                self.ds[engine] = rank
            self.d = self.ds["decode-0"]
        except BaseException:
            self.close()
            raise
        self.plans: dict[str, dict[str, Any]] = {}
        self.d_results: dict[str, tuple[str, Any]] = {}
        self.released: set[str] = set()
        self.p_results: dict[str, str | None] = {}
        self._seed = 0

    # ------------------------------------------------------------------ requests

    def plan(
        self, rid: str, engine: str, p_ids: list[int], d_ids: list[int], key: str = "", d: str = "decode-0"
    ) -> None:
        self._seed += 1
        self.plans[rid] = {
            "engine": engine,
            "seed": self._seed,
            "p": [p_ids],
            "d": [d_ids],
            "key": key or rid,
            "decode": d,
        }
        self.p[engine].call(("prepare", [(rid, self._seed, [p_ids])]))

    def params(self, rid: str) -> dict[str, Any]:
        plan = self.plans[rid]
        return {
            "remote_engine_id": plan["engine"],
            "remote_host": "127.0.0.1",
            "remote_port": self.servers[plan["engine"]].port,
            "tp_size": 1,
            "pp_size": 1,
            "transfer_id": f"xfer-{plan['key']}",
            "remote_request_id": rid,
        }

    def add(self, rid: str) -> None:
        plan = self.plans[rid]
        self.ds[plan["decode"]].call(("add", rid, plan["d"], self.params(rid), plan["seed"], [0]))

    def finish(self, rid: str) -> None:
        plan = self.plans[rid]
        self.p[plan["engine"]].call(("finish", rid, plan["p"], f"xfer-{plan['key']}"))

    def cancel(self, rid: str) -> None:
        self.ds[self.plans[rid]["decode"]].call(("cancel", rid))

    def restart(self, engine: str) -> None:
        """SIGKILL P ``engine``'s rank and start a fresh process under its name (a new
        incarnation) holding every planned prompt of that engine; serve its new metadata."""
        old = self.p[engine]
        os.kill(old.process.pid, signal.SIGKILL)
        old.process.join(timeout=10)
        (fresh,), payloads = _start_ranks([self.p_specs[engine]], timeout_s=120)
        self.ranks.append(fresh)
        mine = [
            (rid, plan["seed"], plan["p"]) for rid, plan in self.plans.items() if plan["engine"] == engine
        ]
        fresh.call(("prepare", mine))
        self.servers[engine].publish_all(payloads)
        self.p[engine] = fresh

    # ------------------------------------------------------------------ results

    def poll(self) -> None:
        for d in self.ds.values():
            polled = d.call(("poll",))
            for rid, info in polled["done"].items():
                self.d_results[rid] = ("done", info)
            for kind in ("failed", "cancelled"):
                for rid, reason in polled[kind].items():
                    self.d_results[rid] = (kind, reason)
            self.released.update(polled["released"])
        for rank in self.p.values():
            if not rank.process.is_alive():
                continue
            got = rank.call(("poll",))
            self.p_results.update(dict.fromkeys(got["sent"]))
            self.p_results.update(got["failed"])

    def wait(self, what: str, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if predicate():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; D: {self.d_results}")
            time.sleep(0.02)

    def wait_decode(self, rids: list[str], timeout_s: float = 60.0) -> None:
        self.wait(f"D to resolve {rids}", lambda: all(r in self.d_results for r in rids), timeout_s)

    def wait_released(self, rids: list[str], timeout_s: float = 60.0) -> None:
        self.wait(f"D to release {rids}", lambda: all(r in self.released for r in rids), timeout_s)

    def wrong(self, rids: list[str]) -> dict[str, Any]:
        """Requests D reported done whose bytes are not their prompt's."""
        return {
            rid: info["miss"]
            for rid in rids
            if (got := self.d_results.get(rid)) and got[0] == "done" and not (info := got[1])["ok"]
        }

    def damage(self) -> dict[str, Any]:
        """Freed blocks written after release, and never-named blocks written at all."""
        freed: dict[str, Any] = {}
        untouched: list[str] = []
        for d in self.ds.values():
            freed.update(d.call(("check_freed",)))
            untouched += d.call(("check_untouched",))
        return {"freed": freed, "untouched": untouched}

    def stats(self, rank: _Rank) -> dict[str, Any]:
        return rank.call(("health",))["stats"]

    def close(self) -> None:
        _stop(self.ranks)
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                server.close()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _blocks(rng: random.Random, pool: list[int], n: int) -> list[int]:
    picked = rng.sample(pool, n)
    for b in picked:
        pool.remove(b)
    return picked


# ---------------------------------------------------------------------------- 1. concurrency


def test_two_p_engines_packing_into_one_d_at_once_each_land_their_own_bytes() -> None:
    """Two P engines push interleaved requests into one D at once, every push in 8 chunks:
    D's staging is reserved per request, so no chunk of one lands in another's range; every
    request is done with its own prompt's bytes and no block outside the requests changed."""
    rng = random.Random(7)
    with Mesh(2) as mesh:
        d_pool = list(range(1, 256))
        p_pools = {engine: list(range(256)) for engine in mesh.p}
        rids = []
        for i in range(12):
            engine = f"prefill-{i % 2}"
            rid = f"r{i}"
            mesh.plan(rid, engine, _blocks(rng, p_pools[engine], 8), _blocks(rng, d_pool, 8))
            rids.append(rid)
        for rid in rids:
            mesh.add(rid)
        time.sleep(0.5)  # every PUSH_REG seen by its P (a late one goes direct)
        for rid in rids:
            mesh.finish(rid)
        mesh.wait_decode(rids)
        outcomes = {rid: mesh.d_results[rid][0] for rid in rids}
        assert set(outcomes.values()) == {"done"}, outcomes
        assert mesh.wrong(rids) == {}
        assert mesh.damage() == {"freed": {}, "untouched": []}
        packed = sum(mesh.stats(rank).get("packed_writes", 0) for rank in mesh.p.values())
        writes = sum(mesh.stats(rank).get("writes", 0) for rank in mesh.p.values())
        assert packed == len(rids) and writes >= 8 * len(rids), (packed, writes)


def _wave(mesh: Mesh, rng: random.Random, tag: str, count: int, d_blocks: list[int]) -> list[str]:
    """Plan ``count`` requests over both P engines into D blocks taken from ``d_blocks``."""
    pools = {engine: list(range(256)) for engine in mesh.p}
    rids = []
    for i in range(count):
        engine = f"prefill-{i % len(mesh.p)}"
        rid = f"{tag}{i}"
        mesh.plan(rid, engine, _blocks(rng, pools[engine], 8), _blocks(rng, d_blocks, 8))
        rids.append(rid)
    return rids


def test_cancels_racing_slow_chunk_writes_and_late_duplicated_dones_leave_no_wrong_kv() -> None:
    """P's chunk WRITEs are slow at random (some land after D cancelled), D reads DONEs late
    and twice. Half the requests are cancelled while their chunks land; once every one is
    released, a second wave reuses their blocks and D's staging: every request done holds its
    own prompt, no released block changed, no unnamed block was written."""
    rng = random.Random(11)
    p_faults = {"slow_writes": 0.4, "write_delay_s": 0.3, "seed": 3}
    d_faults = {
        "dup_notifs": 0.3,
        "delay_notifs": 0.3,
        "delay_s": 0.2,
        "notif_prefixes": ["DONE:"],
        "seed": 5,
    }
    with Mesh(2, p_transport=p_faults, d_transport=d_faults) as mesh:
        d_pool = list(range(1, 200))
        first = _wave(mesh, rng, "a", 10, d_pool)
        for rid in first:
            mesh.add(rid)
        time.sleep(0.5)
        for rid in first:
            mesh.finish(rid)
        cancelled = first[::2]
        for i, rid in enumerate(cancelled):
            time.sleep(0.03 * i)
            mesh.cancel(rid)
        mesh.wait_decode(first)
        ended = [rid for rid in first if mesh.d_results[rid][0] != "done"]
        mesh.wait_released(ended)
        assert mesh.wrong(first) == {}
        # the second wave reuses the blocks of every request of the first
        reuse = sorted({b for rid in first for b in mesh.plans[rid]["d"][0]} - {0})
        second = _wave(mesh, rng, "b", 10, reuse)
        for rid in second:
            mesh.add(rid)
        time.sleep(0.5)
        for rid in second:
            mesh.finish(rid)
        mesh.wait_decode(second)
        assert any(mesh.d_results[rid][0] == "done" for rid in first), mesh.d_results
        time.sleep(1.0)  # any late chunk of the first wave would have landed by now
        outcomes = {rid: mesh.d_results[rid][0] for rid in second}
        assert set(outcomes.values()) == {"done"}, outcomes
        assert mesh.wrong(second) == {}
        damage = mesh.damage()
        assert damage["untouched"] == [], damage


# ---------------------------------------------------------------------------- 2. faults


def test_a_push_whose_later_chunk_fails_after_earlier_ones_landed_is_never_done_and_a_retry_is() -> None:
    """Each chunk WRITE fails at random (nothing lands, no DONE) while its push's other chunks
    landed and were scattered. Such a request must fail, never be done with a region left
    unwritten; once released, a retry under the same transfer id into the same D blocks (a
    new prompt on P) must be done with the retry's bytes or fail by name."""
    rng = random.Random(23)
    with Mesh(2, p_transport={"fail_writes": 0.08, "seed": 9}) as mesh:
        d_pool = list(range(1, 200))
        first = _wave(mesh, rng, "f", 10, d_pool)
        for rid in first:
            mesh.add(rid)
        time.sleep(0.5)
        for rid in first:
            mesh.finish(rid)
        mesh.wait_decode(first)
        assert mesh.wrong(first) == {}
        failed = [rid for rid in first if mesh.d_results[rid][0] != "done"]
        assert failed and len(failed) < len(first), mesh.d_results
        mesh.wait_released(failed)
        mesh.wait("P to report the failed pushes", lambda: all(r in mesh.p_results for r in failed))
        for rid in failed:
            plan = mesh.plans[rid]
            retry = f"{rid}-again"
            mesh.plan(retry, plan["engine"], plan["p"][0], plan["d"][0], key=plan["key"])
            mesh.add(retry)
        time.sleep(0.5)
        retries = [f"{rid}-again" for rid in failed]
        for rid in retries:
            mesh.finish(rid)
        mesh.wait_decode(retries)
        assert mesh.wrong(retries) == {}
        assert mesh.damage()["untouched"] == []
        print({rid: mesh.d_results[rid] for rid in [*failed, *retries]})


# ---------------------------------------------------------------------------- 3. sizes


def test_odd_sizes_and_requests_larger_than_either_staging_area_land_whole() -> None:
    """Requests of 1 to 40 blocks (not multiples of the chunk size, chunks ending mid-region),
    D's staging holding ~1.5 requests of 8 blocks and P-1's smaller still, all at once from two
    P engines: a request that fits nowhere goes direct, one D could not reserve goes direct,
    the rest pack; every one is done with its own bytes and nothing outside them changed."""
    rng = random.Random(31)
    sizes = [1, 3, 5, 8, 13, 40, 2, 7, 9, 11]
    with Mesh(2, d_options={"staging_bytes": 96 << 10}, p_options={"staging_bytes": 48 << 10}) as mesh:
        d_pool = list(range(1, 256))
        p_pools = {engine: list(range(256)) for engine in mesh.p}
        rids = []
        for i, n in enumerate(sizes):
            engine = f"prefill-{i % 2}"
            rid = f"s{i}"
            mesh.plan(rid, engine, _blocks(rng, p_pools[engine], n), _blocks(rng, d_pool, n))
            rids.append(rid)
        for rid in rids:
            mesh.add(rid)
        time.sleep(0.5)
        for rid in rids:
            mesh.finish(rid)
        mesh.wait_decode(rids)
        outcomes = {rid: mesh.d_results[rid][0] for rid in rids}
        assert set(outcomes.values()) == {"done"}, mesh.d_results
        assert mesh.wrong(rids) == {}
        assert mesh.damage() == {"freed": {}, "untouched": []}
        stats = [mesh.stats(rank) for rank in mesh.p.values()]
        packed = sum(s.get("packed_writes", 0) for s in stats)
        fallbacks = sum(s.get("packed_fallbacks", 0) for s in stats)
        assert packed > 0 and fallbacks > 0, stats


# ---------------------------------------------------------------------------- 4. P restart


def test_a_p_killed_between_chunks_and_restarted_never_completes_a_request_with_mixed_bytes() -> None:
    """P-0 is SIGKILLed while its pushes are half landed (some chunks scattered on D, the rest
    slow and never posted); a new process takes its name and finishes the same prompts again.
    D must either re-register and end with the new process's whole push, or fail the request:
    never done with part of a push. P-1's concurrent pushes are unaffected, and a later wave
    into the same D blocks lands whole."""
    rng = random.Random(41)
    p_faults = {"slow_writes": 0.5, "write_delay_s": 1.5, "seed": 13}
    with Mesh(2, p_transport=p_faults, p_options={"heartbeat_interval_s": 0.5}) as mesh:
        d_pool = list(range(1, 200))
        first = _wave(mesh, rng, "k", 8, d_pool)
        for rid in first:
            mesh.add(rid)
        time.sleep(0.5)
        for rid in first:
            mesh.finish(rid)
        time.sleep(0.4)  # the quick chunks landed; the slow ones wait to be posted
        mesh.restart("prefill-0")
        for rid in first:
            if mesh.plans[rid]["engine"] == "prefill-0":
                with contextlib.suppress(RuntimeError):  # a key D already gave up on
                    mesh.finish(rid)
        mesh.wait_decode(first, timeout_s=90)
        assert mesh.wrong(first) == {}, mesh.d_results
        ended = [rid for rid in first if mesh.d_results[rid][0] != "done"]
        mesh.wait_released(ended, timeout_s=90)
        reuse = sorted({b for rid in first for b in mesh.plans[rid]["d"][0]})
        second = _wave(mesh, rng, "m", 8, reuse)
        for rid in second:
            mesh.add(rid)
        time.sleep(0.5)
        for rid in second:
            mesh.finish(rid)
        mesh.wait_decode(second, timeout_s=90)
        assert mesh.wrong(second) == {}
        assert {mesh.d_results[rid][0] for rid in second} == {"done"}, mesh.d_results
        assert mesh.damage()["untouched"] == []
        print({rid: mesh.d_results[rid][0] for rid in first})


# ---------------------------------------------------------------------------- 5. everything at once


def test_two_p_engines_each_packing_for_two_d_engines_under_every_fault_at_once() -> None:
    """2 P engines x 2 D engines, every P packing for both D's at once, chunks slow or failing
    at random, P's writer stalling, D reading DONEs late and twice, a third of the requests
    cancelled mid-push; then a second wave reusing every block. No request is done with bytes
    other than its own, and no block no request named was written."""
    rng = random.Random(53)
    p_faults = {
        "slow_writes": 0.3,
        "write_delay_s": 0.25,
        "fail_writes": 0.03,
        "stall_writer": 0.05,
        "seed": 17,
    }
    d_faults = {
        "dup_notifs": 0.2,
        "delay_notifs": 0.2,
        "delay_s": 0.15,
        "notif_prefixes": ["DONE:"],
        "seed": 19,
    }
    with Mesh(2, d_engines=2, p_transport=p_faults, d_transport=d_faults) as mesh:
        d_pools = {d: list(range(1, 250)) for d in mesh.ds}
        p_pools = {p: list(range(256)) for p in mesh.p}
        everything: list[str] = []
        for wave in ("a", "b"):
            rids = []
            for i in range(12):
                p, d = f"prefill-{i % 2}", f"decode-{(i // 2) % 2}"
                rid = f"{wave}{i}"
                n = rng.randint(1, 9)
                if len(p_pools[p]) < n:
                    p_pools[p] = list(range(256))
                mesh.plan(rid, p, _blocks(rng, p_pools[p], n), _blocks(rng, d_pools[d], n), d=d)
                rids.append(rid)
            for rid in rids:
                mesh.add(rid)
            time.sleep(0.5)
            for rid in rids:
                mesh.finish(rid)
            for rid in rids[::3]:
                time.sleep(rng.uniform(0.0, 0.1))
                mesh.cancel(rid)
            mesh.wait_decode(rids)
            ended = [rid for rid in rids if mesh.d_results[rid][0] != "done"]
            mesh.wait_released(ended)
            for rid in rids:  # the next wave reuses these blocks
                d_pools[mesh.plans[rid]["decode"]] += mesh.plans[rid]["d"][0]
            everything += rids
        time.sleep(1.0)
        assert mesh.wrong(everything) == {}
        assert mesh.damage()["untouched"] == []
        done = [rid for rid in everything if mesh.d_results[rid][0] == "done"]
        assert len(done) >= len(everything) // 3, mesh.d_results


def test_requests_that_time_out_between_chunks_keep_blocks_and_staging_until_the_late_chunks_land() -> None:
    """Every other chunk WRITE lands 1.5 s late, past D's 1 s watchdog: D fails each request
    with some chunks scattered and others still to come. The blocks and the staging range
    must stay held until those late chunks landed (or P acknowledged); once released, the
    blocks hold D's sentinel for good, and a second wave given the same blocks and staging
    ranges lands whole in every request it reports done."""
    rng = random.Random(61)
    p_faults = {"slow_writes": 0.5, "write_delay_s": 1.5, "seed": 23}
    with Mesh(2, p_transport=p_faults, request_timeout_s=1.0, d_options={"staging_bytes": 1 << 20}) as mesh:
        d_pool = list(range(1, 200))
        first = _wave(mesh, rng, "t", 8, d_pool)
        for rid in first:
            mesh.add(rid)
        time.sleep(0.3)
        for rid in first:
            mesh.finish(rid)
        mesh.wait_decode(first)
        late = [rid for rid in first if mesh.d_results[rid][0] != "done"]
        assert late, mesh.d_results
        mesh.wait_released(late)
        mesh.wait("P to report", lambda: all(r in mesh.p_results for r in first))
        time.sleep(2.0)  # nothing of the first wave is in flight any more
        assert mesh.damage() == {"freed": {}, "untouched": []}
        assert mesh.wrong(first) == {}
        reuse = sorted({b for rid in first for b in mesh.plans[rid]["d"][0]})
        second = _wave(mesh, rng, "u", 8, reuse)
        for rid in second:
            mesh.add(rid)
        time.sleep(0.3)
        for rid in second:
            mesh.finish(rid)
        mesh.wait_decode(second)
        assert mesh.wrong(second) == {}


# ---------------------------------------------------------------------------- 6. a stalled copy


def test_a_stalled_chunk_copy_behind_a_refused_chunk_keeps_d_from_releasing_its_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One P, one D, NIXL in one process under the ``faulty`` transport with
    ``kernel_copies`` (its WRITEs stand for copies nothing takes back once launched, as
    ``cuda_ipc``'s). d-old is packed as 8 chunks (one region each): chunk 0 lands, chunk 1's
    copy is launched and stalls (a stalled device), chunk 2's post is refused before anything
    went out. For a direct WRITE P keeps polling such a copy and D holds the blocks until it
    ended (tests/test_kernel_copy_hold.py). Here, after ``settle_timeout_s`` P releases the
    running copy's handle, frees its own staging and reports the push FAILED unsettled; D
    fences and releases d-old. d-new (the same block count) is given d-old's staging offset;
    the stalled copy then completes into it, between d-new's bytes landing and D reading
    d-new's DONE: d-new is reported done holding p-old's layer-0 V instead of p-new's."""
    import ctypes
    import threading

    import torch
    from cluster import Cluster, kv_bytes, wait_until

    from kvpush.core import packing
    from kvpush.core.errors import TransferError
    from kvpush.core.types import RankKey
    from kvpush.plugins.strategy import ForcedStrategy
    from kvpush.transports.faulty import _SlowWrite

    monkeypatch.setattr(packing, "CHUNK_BYTES", 64)  # one region per chunk
    monkeypatch.setitem(packing.post_packed.__kwdefaults__, "settle_timeout_s", 0.2)
    p0 = RankKey(0, 0)
    options = {"inner": "nixl", "kernel_copies": True}
    with Cluster(transport="faulty", transport_options=options, request_timeout_s=30.0) as cluster:
        cluster.pm.register(ForcedStrategy("packed"), "forced_strategy")
        p = cluster.senders[p0].transport
        lists: dict[int, Any] = {}
        prepare_local, prepare_remote, real_post = p.prepare_local, p.prepare_remote, p.post_write

        def local(descs: Any, mem: Any) -> int:
            handle = prepare_local(descs, mem)
            lists[("l", handle)] = descs.copy()  # type: ignore[index]
            return handle

        def remote(peer: str, descs: Any, mem: Any) -> int:
            handle = prepare_remote(peer, descs, mem)
            lists[("r", handle)] = descs.copy()  # type: ignore[index]
            return handle

        stuck: dict[str, Any] = {}
        posts: list[int] = []

        def post(local_list: int, local_ids: Any, remote_list: int, remote_ids: Any, notif: bytes) -> Any:
            posts.append(len(posts))
            if len(posts) == 2:  # launched, then stalled: its bytes have not landed yet, nothing stops it
                src, dst = lists[("l", local_list)], lists[("r", remote_list)]  # type: ignore[index]
                pairs = zip(local_ids, remote_ids, strict=True)
                stuck["copy"] = [(int(src[a][0]), int(dst[b][0]), int(src[a][1])) for a, b in pairs]
                stuck["bytes"] = [ctypes.string_at(s, size) for s, _, size in stuck["copy"]]  # what it reads
                stuck["handle"] = _SlowWrite(
                    (local_list, local_ids, remote_list, remote_ids, notif), float("inf")
                )
                p._slow.add(stuck["handle"])
                return stuck["handle"]
            if len(posts) == 3:
                raise TransferError("injected: the WRITE could not be prepared", maybe_sent=False)
            return real_post(local_list, local_ids, remote_list, remote_ids, notif)

        p.prepare_local, p.prepare_remote, p.post_write = local, remote, post  # type: ignore[method-assign]
        sender, receiver = cluster.senders[p0], cluster.receivers[0]
        cluster.add("d-old", [[1, 2, 3, 4]], "x-old")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 1, what="d-old's PUSH_REG")
        cluster.finish("p-old", [[5, 6, 7, 8]], "x-old")
        wait_until(lambda: len(posts) >= 3, what="d-old's third chunk refused")
        sender.call_on_writer(lambda: None)  # P handled the refusal
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and "d-old" not in cluster.released[0]:
            cluster.poll()  # D fails d-old and releases it once P's connection is fenced
            time.sleep(0.01)
        released_under_copy = "d-old" in cluster.released[0]
        want = {layer: kv_bytes(t)[:, [20, 21, 22, 23]].clone() for layer, t in cluster.p_caches[p0].items()}
        cluster.add("d-new", [[9, 10, 11, 12]], "x-new")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="d-new's PUSH_REG")
        gate = threading.Event()
        receiver.run_on_writer(lambda: gate.wait(10.0))  # D busy for a moment
        try:
            cluster.finish("p-new", [[20, 21, 22, 23]], "x-new")
            assert cluster.wait_prefill("p-new", timeout_s=10.0)[p0] is None
            for (_, dst, size), data in zip(stuck["copy"], stuck["bytes"], strict=True):  # the copy ends
                ctypes.memmove(dst, data, size)
        finally:
            gate.set()
        stuck["handle"].due = 0.0  # ... and its handle completes (posting the same bytes again)
        outcome = cluster.wait_decode("d-new", timeout_s=10.0)[0]
        wrong = [
            layer
            for layer, tensor in cluster.d_caches[0].items()
            if outcome is None and not torch.equal(kv_bytes(tensor)[:, [9, 10, 11, 12]], want[layer])
        ]
        assert cluster.wait_decode("d-old", timeout_s=10.0)[0] is not None  # failed, once the copy ended
        cluster.wait_released("d-old", timeout_s=15.0)
        assert not released_under_copy and not wrong, (
            f"d-old released while its chunk copy was still running: {released_under_copy}; "
            f"d-new reported done with layers {wrong} not holding p-new's KV"
        )


# ---------------------------------------------------------------------------- 7. mixed strategies


def test_one_stage_direct_and_the_other_packed_into_one_request_land_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PP2 -> TP1 over NIXL (one process, an agent per rank): stage 0's staging pool is full,
    so it writes d-1 direct, while stage 1 packs its layers into D's reservation in chunks.
    D counts a direct DONE and a packed push for one request; d-1 is done holding every
    layer of P's blocks, and D's reservation and P's staging all go back."""
    import torch
    from cluster import Cluster, kv_bytes, settle, wait_until

    from kvpush.core import packing
    from kvpush.core.types import RankKey
    from kvpush.plugins.strategy import ForcedStrategy

    monkeypatch.setattr(packing, "CHUNK_BYTES", 256)
    with Cluster(prefill_pp=2, transport="nixl") as cluster:
        cluster.pm.register(ForcedStrategy("packed"), "forced_strategy")
        stage0, stage1 = cluster.senders[RankKey(0, 0)], cluster.senders[RankKey(1, 0)]
        full = stage0.staging.alloc(stage0.staging.size)
        assert full is not None
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[3, 9, 17, 22, 40]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="d-1's PUSH_REGs")
        for sender in (stage0, stage1):
            settle(sender)
        cluster.finish("p-1", [[5, 11, 20, 33, 61]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert stage0.stats.get("packed_fallbacks") == 1 and stage1.stats.get("packed_writes") == 1
        assert stage1.stats["writes"] > 1  # chunks
        for layer, tensor in cluster.d_caches[0].items():
            stage = stage0 if layer in cluster.p_caches[RankKey(0, 0)] else stage1
            src = cluster.p_caches[stage.metadata.rank][layer]
            assert torch.equal(
                kv_bytes(tensor)[:, [3, 9, 17, 22, 40]], kv_bytes(src)[:, [5, 11, 20, 33, 61]]
            ), layer
        stage0.staging.free(full)
        wait_until(lambda: receiver.staging.bytes_in_use == 0, what="D's reservation freed")
        wait_until(lambda: stage1.staging.bytes_in_use == 0, what="stage 1's staging freed")


def test_hma_with_prefix_hits_packed_in_chunks_from_pp2_tp2_into_tp1_lands_whole() -> None:
    """Hybrid model (a full and a sliding-window group, different block counts per request),
    D with prefix hits registering only each group's suffix, P PP2 x TP2 each writing its
    head slice of its layers into one D rank, every push in chunks ending mid-region: every
    request verified byte for byte on D, every destination packed."""
    from kvpush.demo.runner import RunConfig, run_config

    cfg = RunConfig(
        layout="hma",
        prefill_pp=2,
        prefill_tp=2,
        decode_tp=1,
        requests=10,
        max_blocks=9,
        strategy="packed",
        prefix_hit_rate=0.5,
        timeout_s=90.0,
        plugins=PLUGINS,
    )
    row = run_config(cfg)
    assert row["failures"] == {}
    assert row["verified_requests"] == cfg.requests
    assert row["packed_fallbacks"] == 0 and row["packed_destinations"] == cfg.requests * 4


# ---------------------------------------------------------------------------- 8. chunk boundaries


def test_chunk_boundaries_cover_every_region_once_and_no_chunk_is_empty() -> None:
    """``chunk_regions`` for region byte counts that are not multiples of the chunk size, zero
    (a KV group with no block in this request), one region larger than every chunk, or a
    total below one chunk: the parts tile the regions in order (each region in exactly one
    chunk, so D's share check sees every one), at most ``MAX_CHUNKS`` of them, the first holding
    bytes. (A last part may hold only zero-byte regions, e.g. ``[8 MiB, 0]``: an empty WRITE
    and DONE that D scatters as nothing; wasteful, not wrong.)"""
    import numpy as np

    from kvpush.core import packing

    rng = random.Random(71)
    shapes = [[0, 0, 5000, 0], [1], [packing.CHUNK_BYTES * 9], [3, 0, 0, 7 << 20, 0, 1], [0, 1]]
    shapes += [
        [rng.choice([0, 1, 4095, 4096, 1 << 20, 5 << 20]) for _ in range(rng.randint(1, 40))]
        for _ in range(300)
    ]
    for sizes in shapes:
        if not sum(sizes):
            continue  # post_packed goes direct before chunking
        chunks = np.asarray(sizes, dtype=np.int64)
        for mem in ("DRAM", "VRAM"):
            parts = packing.chunk_regions(chunks, mem)
            assert [lo for lo, _ in parts] == [0, *[hi for _, hi in parts[:-1]]], (sizes, parts)
            assert parts[-1][1] == len(sizes) and len(parts) <= packing.MAX_CHUNKS, (sizes, parts)
            assert chunks[parts[0][0] : parts[0][1]].sum() > 0, (sizes, mem, parts)


# ---------------------------------------------------------------------------- 9. the soak, packed


def test_the_soak_with_every_push_packed_in_chunks_writes_nothing_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The soak (PP2 -> TP2, each P stage writing a head slice into both D ranks, random
    aborts, every fault of the ``faulty`` transport, a P rank killed and restarted, a D rank
    killed and restarted, a P rank paused) had never run packed: here every push is packed in
    chunks. No request done with wrong bytes, nothing written into freed or unnamed blocks,
    nothing leaked, no destination fell back to direct."""
    import attrs

    from kvpush.demo import soak

    specs = soak._specs

    def packed(*args: Any, **kwargs: Any) -> Any:
        p_specs, d_specs = specs(*args, **kwargs)
        p_specs = [attrs.evolve(s, strategy="packed", plugins=PLUGINS) for s in p_specs]
        return p_specs, [attrs.evolve(s, strategy="packed") for s in d_specs]

    monkeypatch.setattr(soak, "_specs", packed)
    report = soak.run_soak(
        soak.SoakConfig(
            requests=120, abort_rate=0.2, fault_rate=0.02, seed=5, p_kills=1, d_kills=1, p_pauses=1
        )
    )
    assert soak.soak_ok(report), soak.soak_failures(report)
    assert report["wrong_bytes_or_no_reason"] == 0 and report["writes_into_freed_blocks"] == 0
    assert report["verified"] > 0
    p_stats = [h["stats"] for key, h in report["health"].items() if key.endswith("P")]
    assert sum(s.get("packed_writes", 0) for s in p_stats) > 0
    assert sum(s.get("packed_fallbacks", 0) for s in p_stats) == 0
