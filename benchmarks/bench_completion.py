"""Completion aggregation on D: the receiver's per-notification counting path.

Target (issue): >= 1 M notifications/s. Each round feeds pre-decoded DONE notifications for
requests that each expect 8 distinct producers (PP 4 x TP 2), plus a duplicate per request, to
``PushReceiver._on_notification`` (the path the writer thread runs for every notification).
"""

from __future__ import annotations

import pytest
from _helpers import ForeignLoad

from kvpush.core.completion import count_producer
from kvpush.core.receiver import PendingReceive, PushReceiver
from kvpush.core.types import (
    ModelSpec,
    Notification,
    NotificationKind,
    ParallelConfig,
    RankKey,
    RequestMetadata,
    TransferParams,
)
from kvpush.core.worker import WorkerConfig

REQUESTS, PRODUCERS = 2000, 8
TARGET_PER_S = 1e6


def _notifications() -> list[Notification]:
    notes = []
    for i in range(REQUESTS):
        for p in range(PRODUCERS):
            producer = RankKey(p // 2, p % 2)
            notes.append(Notification(kind=NotificationKind.DONE, request_id=f"r{i}", producer=producer))
        notes.append(notes[-1])  # one duplicate per request
    return notes


def _receiver() -> PushReceiver:
    model = ModelSpec(name="bench", num_layers=4)
    cfg = WorkerConfig(
        engine_id="D",
        parallel=ParallelConfig(tp_size=1, num_layers=4),
        model=model,
        side_channel_port=1,
    )
    return PushReceiver(cfg, {})


def _pending(receiver: PushReceiver) -> None:
    params = TransferParams(
        remote_engine_id="P", remote_host="127.0.0.1", remote_port=1, pp_size=4, tp_size=2
    )
    for i in range(REQUESTS):
        rid = f"r{i}"
        meta = RequestMetadata(request_id=rid, block_ids=[[0]], params=params)
        receiver._pending[rid] = PendingReceive(meta=meta, expected=PRODUCERS, deadline=float("inf"))


def _record(benchmark, load: ForeignLoad, count: int) -> None:
    median = benchmark.stats.stats.median
    rate = count / median
    benchmark.extra_info.update(
        notifications=count,
        per_s=round(rate),
        ns_per_notification=round(median / count * 1e9, 1),
        target_per_s=TARGET_PER_S,
        target_met=rate >= TARGET_PER_S,
        foreign_cores=round(load.cores, 2),
    )


def test_receiver_counting_path(benchmark):
    notes = _notifications()
    receiver = _receiver()

    def setup():
        _pending(receiver)
        receiver.get_finished()
        return (), {}

    def run():
        handle = receiver._on_notification
        for note in notes:
            handle("p", note)

    with ForeignLoad() as load:
        benchmark.pedantic(run, setup=setup, rounds=15, iterations=1, warmup_rounds=1)
    finished = receiver.get_finished()
    assert len(finished.done) == REQUESTS and not finished.failed
    _record(benchmark, load, len(notes))


@pytest.mark.parametrize("producers", [PRODUCERS])
def test_count_producer_function(benchmark, producers):
    """The pure counting function alone (the floor of the receiver path)."""
    keys = [RankKey(p // 2, p % 2) for p in range(producers)]
    items = [keys[p] for _ in range(REQUESTS) for p in range(producers)]

    def run():
        sets = [set() for _ in range(REQUESTS)]
        i = 0
        for n, key in enumerate(items):
            count_producer(sets[i], producers, key)
            if n % producers == producers - 1:
                i += 1

    with ForeignLoad() as load:
        benchmark.pedantic(run, rounds=15, iterations=1, warmup_rounds=1)
    _record(benchmark, load, len(items))
