"""Probe (probeD): can D report wrong KV done, or let a WRITE/scatter land in blocks or staging
it released, outside the demo's happy conditions?

Angles: D's packed staging (reservations freed and reserved again while a chunk of the old
request may still land or be scattered, duplicate and overtaken chunk notifications), block
claims, and who may still write after D reported a request done. The cores are driven directly
(no transport, an injected clock) as in ``tests/test_review_findings.py``; finding 1 is shown
over real NIXL (UCX CMA) between workers.

Finding 1 (section 3): a D worker closed with a request no producer acknowledged drops its
staging pool with the worker; a producer's late copy lands in whatever the process allocates
there next (the next worker's staging: a request reported done with another prompt's KV).
Finding 2 (section 4): a producer counted by its old process's DONE, read after its exit was
seen, is registered again with the new process; the request is then done (blocks to the
engine, staging freed) while that registration may still be written.
Both fixed (2026-12-02): a closed worker that left requests unacknowledged keeps its staging
pool's memory for the process's life (``core/worker.py``, ``keep_for_process_life``), and
``DecodeCore._reregister`` registers no producer again that reported since its exit was seen.
Each test failed before its fix.
"""

from __future__ import annotations

import gc
import weakref
from fractions import Fraction
from typing import Any

import attrs
import pytest
import torch
from cluster import Cluster, wait_until

from kvpush.core import notifications as wire
from kvpush.core.actions import FreeStaging, Release, Report, Scatter, Send
from kvpush.core.block_claims import BlockClaims, group_spaces
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.errors import ConfigError
from kvpush.core.types import KVRegion, Notification, PackManifest, RankKey, RequestMetadata, TransferParams
from kvpush.plugins.strategy import ForcedStrategy

P0, P1 = RankKey(0, 0), RankKey(1, 0)
A0, A1 = "P-prefill-pp0-tp0", "P-prefill-pp1-tp0"
WHOLE = (Fraction(0), Fraction(1))


# ---------------------------------------------------------------------------- core helpers


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


class _Staging:
    """First-fit offsets like the receiver's pool: a freed range is the next one handed out."""

    def __init__(self) -> None:
        self.held: dict[int, str] = {}

    def reserve(self, meta: RequestMetadata) -> int:
        offset = 0
        while offset in self.held:
            offset += 4096
        self.held[offset] = meta.request_id
        return offset


def _settings() -> DecodeSettings:
    return DecodeSettings(
        engine_id="D",
        incarnation="d1",
        tp_rank=0,
        tp_size=1,
        host="d.example",
        port=5700,
        heartbeat_interval_s=0.25,
        fresh_s=0.5,
        peer_silence_s=3.0,
        request_timeout_s=12.0,
    )


def _info(stages: int = 1) -> ProducerInfo:
    agents = {r: a for r, a in [(P0, A0), (P1, A1)][:stages]}
    shares = {P0: [0, 1], P1: [2, 3]} if stages == 2 else {P0: [0, 1, 2, 3]}
    return ProducerInfo(
        prefill_pp=stages,
        prefill_tp=1,
        agents=agents,
        incarnations={a: f"a-{a}" for a in agents.values()},
        write_deadline_s=1.0,
        processes={a: {"host": "elsewhere", "pid": 10 + r.pp_rank} for r, a in agents.items()},
        shares={r: frozenset((j, *WHOLE) for j in regions) for r, regions in shares.items() if r in agents},
    )


class _D:
    """One D core with P's engine loaded (``stages`` producers), playing the receiver's driver
    for staging: ``FreeStaging`` frees, ``Scatter`` records which reservation it reads."""

    def __init__(self, stages: int = 1) -> None:
        self.staging = _Staging()
        self.core = DecodeCore(_settings(), reserve_staging=self.staging.reserve)
        self.info = _info(stages)
        self.scattered: list[tuple[str, int]] = []
        self.released: list[str] = []
        self.reports: list[tuple[str, str]] = []
        self.offset: dict[str, int] = {}
        self.connected = False

    def run(self, actions: list[Any], t: float) -> list[Any]:
        out = list(actions)
        for action in actions:
            if isinstance(action, FreeStaging):
                holder = self.staging.held.pop(action.offset, None)
                assert holder is not None, f"freed staging {action.offset} twice"
            elif isinstance(action, Release):
                self.released.append(action.request_id)
            elif isinstance(action, Report):
                self.reports.append((action.request_id, action.outcome))
            elif isinstance(action, Scatter):
                m = action.manifest
                holder = self.staging.held.get(m.staging_offset)
                assert holder == action.request_id, (
                    f"scatter of {action.request_id} reads staging {m.staging_offset}, held by {holder}"
                )
                self.scattered.append((action.request_id, m.chunk))
                out += self.run(
                    self.core.scattered(action.request_id, action.producer, m.chunk, m.chunks, "", t), t
                )
        return out

    def add(self, rid: str, key: str, t: float) -> list[Any]:
        meta = RequestMetadata(
            request_id=rid,
            block_ids=((1, 2),),
            params=TransferParams.from_dict(
                {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": key}
            ),
        )
        out = self.run(self.core.add(meta, t), t)
        if not self.connected:
            self.connected = True
            out += self.run(self.core.connected("P", self.info, "", t), t)
            for rank, agent in self.info.agents.items():
                answer = wire.encode_heartbeat_answer(rank, t, self.info.incarnations[agent])
                out += self.run(self.core.notification(agent, _note(answer), t), t)
        self.offset[rid] = self.core._requests[rid].staging_offset
        return out

    def chunk(
        self, rid: str, producer: RankKey, regions: tuple[int, ...], n: int, of: int, t: float
    ) -> list[Any]:
        agent = self.info.agents[producer]
        manifest = PackManifest(
            staging_offset=self.offset[rid], regions=regions, part=(0, 1), chunk=n, chunks=of
        )
        done = wire.encode_done(rid, producer, 1, manifest, self.info.incarnations[agent])
        return self.run(self.core.notification(agent, _note(done), t), t)

    def note(self, producer: RankKey, message: bytes, t: float) -> list[Any]:
        return self.run(self.core.notification(self.info.agents[producer], _note(message), t), t)


# ---------------------------------------------------------------------------- 1. staging (held)


def test_an_overtaken_chunk_done_of_a_released_request_scatters_nothing_into_the_next_reservation() -> None:
    """r1 (two chunks) is cancelled after chunk 0 was scattered. P acknowledges once chunk 1
    settled; the ack overtakes chunk 1's DONE (UCX lanes). D releases r1 and frees its staging
    range; r2 gets the same range. r1's chunk 1 DONE (and a duplicate of chunk 0) then arrive:
    nothing is scattered for r2, r2 is not counted, and r2 completes from its own chunks."""
    d = _D()
    d.add("r1", "k1", 0.0)
    d.chunk("r1", P0, (0, 1), 0, 2, 0.1)
    assert d.scattered == [("r1", 0)]
    d.run(d.core.cancel("r1", 0.2), 0.2)
    assert "r1" not in d.released  # chunk 1 may still land in the staging range
    d.note(P0, wire.encode_cancel_ack("r1", P0, True, unsettled=False, incarnation=f"a-{A0}"), 0.3)
    assert "r1" in d.released and ("r1", "cancelled") in d.reports
    d.add("r2", "k2", 0.4)
    assert d.offset["r2"] == d.offset["r1"]  # the freed range, handed out again
    d.chunk("r1", P0, (2, 3), 1, 2, 0.5)  # r1's overtaken DONE
    d.chunk("r1", P0, (0, 1), 0, 2, 0.5)  # and a duplicate
    assert d.scattered == [("r1", 0)] and not [r for r in d.reports if r[0] == "r2"]
    d.chunk("r2", P0, (0, 1, 2, 3), 0, 1, 0.6)
    assert d.scattered[-1] == ("r2", 0) and ("r2", "done") in d.reports


def test_a_failed_request_keeps_its_staging_until_every_chunk_of_each_producer_arrived() -> None:
    """PP2: stage 1 fails r1 (nothing unsettled) while stage 0 has sent one chunk of two. The
    staging range (shared by both stages) is freed only once stage 0's last chunk arrived;
    a duplicate of the first chunk does not count as the second."""
    d = _D(stages=2)
    d.add("r1", "k1", 0.0)
    d.chunk("r1", P0, (0,), 0, 2, 0.1)
    d.note(P1, wire.encode_failed("r1", P1, "boom", False, f"a-{A1}"), 0.2)
    assert ("r1", "failed") in d.reports and "r1" not in d.released
    d.chunk("r1", P0, (0,), 0, 2, 0.3)  # a duplicate of chunk 0
    assert "r1" not in d.released and d.offset["r1"] in d.staging.held
    d.chunk("r1", P0, (1,), 1, 2, 0.4)
    assert "r1" in d.released and d.offset["r1"] not in d.staging.held
    assert d.scattered == [("r1", 0)]  # nothing is scattered for a closing request


def test_a_chunk_done_naming_another_live_requests_reservation_is_refused_before_any_scatter() -> None:
    """r1 and r2 both in flight; a DONE of r1 whose manifest states r2's staging offset (a stale
    or confused P) must not scatter r2's staging bytes into r1's blocks."""
    d = _D()
    d.add("r1", "k1", 0.0)
    d.add("r2", "k2", 0.0)
    assert d.offset["r1"] != d.offset["r2"]
    agent = A0
    manifest = PackManifest(
        staging_offset=d.offset["r2"], regions=(0, 1, 2, 3), part=(0, 1), chunk=0, chunks=1
    )
    out = d.run(
        d.core.notification(agent, _note(wire.encode_done("r1", P0, 1, manifest, f"a-{A0}")), 0.1), 0.1
    )
    assert not [a for a in out if isinstance(a, Scatter)] and ("r1", "failed") in d.reports
    assert ("r1", "done") not in d.reports


# ---------------------------------------------------------------------------- 2. block claims (held)


def _region(group: int, base: int, stride: int, blocks: int = 16) -> KVRegion:
    return KVRegion(
        base_addr=base,
        block_len=stride,
        block_stride=stride,
        num_blocks=blocks,
        layer_names=(f"l{group}",),
        kv_group=group,
    )


def test_two_kv_groups_viewing_one_tensor_cannot_both_hold_a_null_block_or_the_same_block() -> None:
    """vLLM's hybrid allocator: every group's layers view one tensor, and block 0 is the shared
    null block of skipped sliding-window positions. Two requests naming it (or the same block
    in two groups) would let one WRITE land in the other's KV: the second add is refused."""
    regions = [_region(0, 0x10000, 256), _region(1, 0x10000, 256)]
    assert group_spaces(regions)[0].space == group_spaces(regions)[1].space
    claims = BlockClaims.for_regions(regions)
    claims.claim("a", ((3, 4), (0, 5)))
    with pytest.raises(ConfigError, match="held by 'a'"):
        claims.claim("b", ((7,), (0, 8)))  # the null block again
    with pytest.raises(ConfigError, match="held by 'a'"):
        claims.claim("c", ((5,), (9,)))  # group 1's block 5 is group 0's block 5
    with pytest.raises(ConfigError, match="same memory in two KV groups"):
        claims.claim("d", ((11,), (11,)))


# ---------------------------------------------------------------------------- 3. a closed worker's staging


def _wait_registered(receiver: Any) -> None:
    wait_until(lambda: receiver.stats["push_regs_sent"] == 1, what="D's PUSH_REG")


def _wait_inflight(sender: Any, count: int, timeout_s: float = 10.0) -> None:
    wait_until(
        lambda: sender.call_on_writer(lambda: len(sender.core.inflight_handles())) == count,
        timeout_s,
        what=f"{count} WRITE(s) in flight on P",
    )


def test_a_closed_decode_worker_keeps_the_staging_a_held_packed_write_may_still_copy_into() -> None:
    """Real NIXL (UCX CMA on one host). P's packed WRITE is a copy stalled past D's
    ``close_timeout_s`` (the ``faulty`` transport's slow kernel copy, as in
    tests/test_close_tells_decode.py). D's close reports d-1 failed and not released, so the
    engine keeps d-1's blocks; but the staging range the WRITE targets is kvpush's own memory,
    and it is freed once the closed worker is dropped. The process then allocates again (a new
    worker's staging, or anything of that size) and P's copy lands there."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 1.5, "kernel_copies": True}
    with Cluster(
        transport="faulty",
        transport_options=options,
        close_timeout_s=0.3,
        request_timeout_s=60,
        heartbeat_interval_s=5.0,
    ) as cluster:
        cluster.pm.register(ForcedStrategy("packed"), "forced_strategy")
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3, 9, 17]], "x-1")
        _wait_registered(receiver)
        cluster.finish("p-1", [[5, 11, 20]], "x-1")
        _wait_inflight(sender, 1)  # P's packed copy into D's staging range: stalled
        receiver.close()
        results = receiver.get_finished()
        assert "decode worker closed" in results.failed["d-1"] and "d-1" not in results.released
        size, kept = receiver.staging.size, weakref.ref(receiver.staging.tensor)
        del cluster.receivers[0]
        del receiver, results
        gc.collect()  # the engine dropped the closed worker
        again = torch.zeros(size, dtype=torch.uint8)  # the process allocates again
        _wait_inflight(sender, 0)  # P's stalled copy ended
        landed = int(again.count_nonzero())
        assert kept() is not None and landed == 0, (
            f"staging still held: {kept() is not None}; {landed} bytes of P's late copy landed in "
            f"memory the process allocated after the closed worker went"
        )


def test_a_stalled_copy_for_a_closed_worker_does_not_become_the_next_workers_kv() -> None:
    """As above; then the engine starts a new D worker in the process (a new engine id, as a
    vLLM instance gets). Its 64 MiB staging pool takes the freed memory and its first request
    r2 reserves offset 0, where d-1's reservation was. P writes r2 at once; r2's DONE is read
    late (``delay_notifs``, a busy D), and P's stalled copy for d-1 lands between the two:
    r2 is scattered from d-1's bytes and reported done holding p-1's KV instead of p-2's."""
    from cluster import kv_bytes

    from kvpush.core.receiver import PushReceiver
    from kvpush.core.sidechannel import SideChannelServer
    from kvpush.core.types import ParallelConfig
    from kvpush.core.worker import WorkerConfig
    from kvpush.layouts.uniform import allocate_kv_caches

    stall_s, late_done_s = 1.5, 2.0
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": stall_s, "kernel_copies": True}
    slow = {"request_timeout_s": 60, "heartbeat_interval_s": 5.0}
    with Cluster(transport="faulty", transport_options=options, close_timeout_s=0.3, **slow) as cluster:
        cluster.pm.register(ForcedStrategy("packed"), "forced_strategy")
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3, 9, 17]], "x-1")
        _wait_registered(receiver)
        cluster.finish("p-1", [[5, 11, 20]], "x-1")
        _wait_inflight(sender, 1)  # P's packed copy of p-1 into d-1's staging range: stalled
        receiver.close()
        assert "d-1" not in receiver.get_finished().released
        kept = weakref.ref(receiver.staging.tensor)
        del cluster.receivers[0]
        del receiver
        gc.collect()  # the engine dropped the closed worker
        sender.transport.rates["slow_writes"] = 0.0  # P's next WRITEs are quick
        server = SideChannelServer("D2")
        parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=cluster.model.num_layers)
        caches = allocate_kv_caches(cluster.model, parallel, 64, device="cpu")
        late = {"inner": "nixl", "delay_notifs": 1.0, "delay_prefixes": ["DONE:"], "delay_s": late_done_s}
        config = WorkerConfig(
            engine_id="D2",
            parallel=parallel,
            model=cluster.model,
            transport="faulty",
            transport_options=late,
            side_channel_port=server.port,
            **slow,
        )
        d2 = PushReceiver(config, caches, pm=cluster.pm)
        try:
            d2.start()
            server.publish(parallel.rank, d2.handshake_payload())
            params = TransferParams.from_dict(cluster.params("x-2"))
            d2.add_request(RequestMetadata(request_id="r2", block_ids=[[3, 9, 17]], params=params))
            wait_until(lambda: d2.stats.get("push_regs_sent", 0) == 1, what="D2's PUSH_REG")
            cluster.finish("p-2", [[30, 31, 32]], "x-2")
            results = d2.wait_finished(stall_s + late_done_s + 10)
            assert results.done == ("r2",), results
            src = cluster.p_caches[P0]
            wrong = [
                layer
                for layer, tensor in caches.items()
                if not torch.equal(kv_bytes(tensor)[:, [3, 9, 17]], kv_bytes(src[layer])[:, [30, 31, 32]])
            ]
            theirs = [
                layer
                for layer in wrong
                if torch.equal(kv_bytes(caches[layer])[:, [3, 9, 17]], kv_bytes(src[layer])[:, [5, 11, 20]])
            ]
            assert kept() is not None and not wrong, (
                f"closed worker's staging still held: {kept() is not None}; r2 reported done with "
                f"layers {wrong} not holding p-2's KV ({theirs} hold p-1's)"
            )
        finally:
            d2.close()
            server.close()


# ------------------------------------------------------------------------ 4. counted, then registered again


def _exit_reregister_then_finish(packed: bool) -> tuple[_D, list[str], list[Any]]:
    """PP2. Stage 0's WRITE of r1 completed and its process was killed; D's probe sees the
    exit first (``_agents_exited``: r1 to be registered again with the new process, the
    engine fenced), then reads the old process's DONE (or both packed chunks), which counts
    stage 0 (its bytes landed: a DONE follows its WRITE). The fence is confirmed, the new
    stage-0 process loaded, and stage 1's DONE arrives. Returns D, the agents r1's PUSH_REGs
    went to after the fence (stage 1's too where the exit path registers live stages again,
    as a renewal: its DONE comes after it), and the actions of stage 1's DONE."""
    from kvpush.core.actions import Fence
    from kvpush.core.decode_core import ENGINE_PROBE

    d = _D(stages=2)
    d.add("r1", "k1", 0.0)
    out = d.run(d.core.producers_exited(ENGINE_PROBE + "P", [A0], 1.0), 1.0)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    if packed:
        d.chunk("r1", P0, (0,), 0, 2, 1.05)
        d.chunk("r1", P0, (1,), 1, 2, 1.06)
    else:
        d.note(P0, wire.encode_done("r1", P0, 1, None, f"a-{A0}"), 1.05)
    assert not d.reports  # stage 0 counted, stage 1 not yet
    out = d.run(d.core.fenced(fence.fence_id, 1.1), 1.1)
    new = d.info = attrs.evolve(d.info, incarnations={A0: f"b-{A0}", A1: f"a-{A1}"})
    out += d.run(d.core.connected("P", new, "", 1.2), 1.2)
    for rank, agent in new.agents.items():
        answer = wire.encode_heartbeat_answer(rank, 1.2, new.incarnations[agent])
        out += d.run(d.core.notification(agent, _note(answer), 1.2), 1.2)
    regs = [a.agent for a in out if isinstance(a, Send) and _note(a.message).kind.value == "push_reg"]
    if packed:
        last = d.chunk("r1", P1, (2, 3), 0, 1, 1.5)
    else:
        last = d.note(P1, wire.encode_done("r1", P1, 1, None, f"a-{A1}"), 1.5)
    return d, regs, last


def test_a_producer_counted_after_its_exit_was_seen_is_not_registered_again_behind_done() -> None:
    d, regs, _ = _exit_reregister_then_finish(packed=False)
    done = ("r1", "done") in d.reports
    unanswered = sorted(set(regs) - {A1})  # stage 1's DONE came after its PUSH_REG
    assert not (unanswered and done), (
        f"r1 reported done while D had just registered it again with {unanswered} (the new "
        f"stage-0 process), which reported nothing since: its WRITE lands in blocks the engine owns"
    )


def test_a_packed_producer_counted_after_its_exit_does_not_leave_a_registration_on_freed_staging() -> None:
    d, regs, last = _exit_reregister_then_finish(packed=True)
    freed = [a.offset for a in last if isinstance(a, FreeStaging)]
    unanswered = sorted(set(regs) - {A1})  # stage 1's chunk came after its PUSH_REG
    assert not (unanswered and freed), (
        f"r1's staging range {freed} freed (r1 {d.reports}) while D had just registered r1 "
        f"again with {unanswered}, naming that range, with nothing reported since"
    )
