"""Timer ticks of the protocol cores: ``handle_timer(now)`` under a loaded state.

Target (issue 11): <= 50 us per tick on a P rank holding 20k tombstones and 500 prefills waiting
for D's registration, and on a D rank with 500 pending requests (the old design walked every
tracked key: 3.8 ms per tick, against a 0.2 ms poll period). Deadlines sit in a heap, so a tick
costs O(expired). Run with
``.venv/bin/pytest benchmarks/bench_core_tick.py --benchmark-enable -p no:cacheprovider``.
"""

from __future__ import annotations

import itertools

from _helpers import ForeignLoad

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Send
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.types import RankKey, ReadSpec, RequestMetadata, TransferParams

TOMBSTONES, WAITING, PENDING = 20_000, 500, 500
TARGET_S = 50e-6
T0 = 1000.0
TOMB_SPACING_S = 1e-3
"""Tombstones are made 1 ms apart, so a clock stepping 1 ms per tick expires about one per tick."""


def _prefill_core() -> PrefillCore:
    core = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1),
        plan=lambda blocks, reg: [
            ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)
        ],
    )
    for i in range(TOMBSTONES):
        now = T0 + i * TOMB_SPACING_S
        core.finished(f"done-{i}", f"rid-{i}", ((i % 4096,),), "", now)
        core.fail(f"done-{i}", "ended", now)  # reported: leaves a tombstone that expires later
    now = T0 + TOMBSTONES * TOMB_SPACING_S + core.s.registration_ttl_s  # leases outlive the runs below
    for i in range(WAITING):
        core.finished(f"wait-{i}", f"wrid-{i}", ((i,),), "", now)  # leases armed, no PUSH_REG yet
    sizes = core.state_sizes()
    assert sizes["tombstones"] == TOMBSTONES and sizes["requests"] == WAITING, sizes
    return core


def _request(i: int) -> RequestMetadata:
    params = {
        "remote_engine_id": "P",
        "remote_host": "p.example",
        "remote_port": 5600,
        "transfer_id": f"k{i}",
    }
    return RequestMetadata(request_id=f"r{i}", block_ids=((i,),), params=TransferParams.from_dict(params))


def _decode_core() -> DecodeCore:
    core = DecodeCore(
        DecodeSettings(engine_id="D", incarnation="d1", tp_rank=0, tp_size=1, host="d.example", port=5700)
    )
    now = T0
    actions = core.add(_request(0), now)
    assert any(isinstance(a, Connect) for a in actions)
    info = ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={RankKey(0, 0): "P-a"},
        incarnations={"P-a": "p1"},
        write_deadline_s=10.0,
    )
    core.connected("P", info, "", now)
    answer = wire.decode_notification(wire.encode_heartbeat_answer(RankKey(0, 0), now, "p1"))
    assert answer is not None
    regs = core.notification("P-a", answer, now)  # HELLO answered: r0 registers
    assert any(isinstance(a, Send) for a in regs)
    for i in range(1, PENDING):
        core.add(_request(i), now)
    assert core.state_sizes()["requests"] == PENDING and core.stats["push_regs_sent"] == PENDING
    return core


def _record(benchmark, load: ForeignLoad, **extra) -> None:
    benchmark.extra_info.update(extra)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing to compare
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        target_us=TARGET_S * 1e6,
        median_us=round(median * 1e6, 3),
        target_met=median <= TARGET_S,
        foreign_cores=round(load.cores, 2),
    )


def test_prefill_tick_20k_tombstones_500_waiting(benchmark):
    """A tick with nothing due (the common case between deadlines)."""
    core = _prefill_core()
    now = T0 + TOMBSTONES * TOMB_SPACING_S + 1.0  # every tombstone and lease is still in the future
    with ForeignLoad() as load:
        out = benchmark(core.handle_timer, now)
    assert out == [] and core.state_sizes()["tombstones"] == TOMBSTONES
    _record(benchmark, load, **core.state_sizes())


def test_prefill_tick_expiring_tombstones(benchmark):
    """Ticks 1 ms apart while tombstones expire (about one per tick), 20k held."""
    core = _prefill_core()
    clock = itertools.count()
    start = T0 + core.s.registration_ttl_s

    def tick() -> None:
        core.handle_timer(start + next(clock) * TOMB_SPACING_S)

    with ForeignLoad() as load:
        benchmark.pedantic(tick, rounds=2000, iterations=1, warmup_rounds=10)
    left = core.state_sizes()["tombstones"]
    assert TOMBSTONES - 2100 < left < TOMBSTONES, left
    assert core.state_sizes()["requests"] == WAITING
    _record(benchmark, load, tombstones_left=left, waiting=WAITING)


def test_decode_tick_500_pending(benchmark):
    """A tick with nothing due on a D rank with 500 registered requests (heartbeats, watchdogs)."""
    core = _decode_core()
    now = T0 + 1.0  # before the first heartbeat (5 s) and every watchdog (120 s)
    with ForeignLoad() as load:
        out = benchmark(core.handle_timer, now)
    assert out == [] and core.state_sizes()["requests"] == PENDING
    _record(benchmark, load, **core.state_sizes())
