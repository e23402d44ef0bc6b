"""Completion aggregation on D: the decode core's per-notification path.

Target (issue): >= 1 M notifications/s. Each round feeds pre-decoded DONE notifications for
requests that each expect 8 distinct producers (PP 4 x TP 2), plus a duplicate per request, to
``DecodeCore.notification`` — the path the writer thread runs for every notification, identity
checks included (producer in the expected set, from its own agent, stating P's TP size).
"""

from __future__ import annotations

from _helpers import ForeignLoad

from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.types import Notification, NotificationKind, RankKey, RequestMetadata, TransferParams

REQUESTS, PRODUCERS = 2000, 8
TARGET_PER_S = 1e6
RANKS = [RankKey(p // 2, p % 2) for p in range(PRODUCERS)]
AGENTS = {rank: f"P-prefill-pp{rank.pp_rank}-tp{rank.tp_rank}" for rank in RANKS}


def _notifications() -> list[tuple[str, Notification]]:
    notes = []
    for i in range(REQUESTS):
        for rank in RANKS:
            note = Notification(
                kind=NotificationKind.DONE, request_id=f"r{i}", producer=rank, producer_tp_size=2
            )
            notes.append((AGENTS[rank], note))
        notes.append(notes[-1])  # one duplicate per request
    return notes


def _ready_core() -> DecodeCore:
    """A D core whose P engine is handshaken (HELLO answered) with REQUESTS registered requests."""
    settings = DecodeSettings(engine_id="D", incarnation="d", tp_rank=0, tp_size=1, host="h", port=1)
    core = DecodeCore(settings)
    params = TransferParams(remote_engine_id="P", remote_host="127.0.0.1", remote_port=1, transfer_id="t")
    core.add(RequestMetadata(request_id="warm", block_ids=[[0]], params=params), 0.0)
    info = ProducerInfo(
        prefill_pp=4,
        prefill_tp=2,
        agents=AGENTS,
        incarnations={a: "p" for a in AGENTS.values()},
        write_deadline_s=10.0,
    )
    core.connected("P", info, "", 0.0)
    for agent in AGENTS.values():
        core.notification(
            agent, Notification(kind=NotificationKind.HEARTBEAT, stamp=0.0, incarnation="p"), 0.0
        )
    for i in range(REQUESTS):
        params = TransferParams(
            remote_engine_id="P", remote_host="127.0.0.1", remote_port=1, transfer_id=f"t{i}"
        )
        core.add(RequestMetadata(request_id=f"r{i}", block_ids=[[0]], params=params), 0.0)
    return core


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


def test_decode_core_counting_path(benchmark):
    notes = _notifications()
    cores: list[DecodeCore] = []

    def setup():
        cores.append(_ready_core())
        return (), {}

    def run():
        handle = cores[-1].notification
        for agent, note in notes:
            handle(agent, note, 1.0)

    with ForeignLoad() as load:
        benchmark.pedantic(run, setup=setup, rounds=15, iterations=1, warmup_rounds=1)
    core = cores[-1]
    assert core.pending == 1  # every request done except the warm-up one
    assert core.stats["rejected_notifications"] == 0 and core.stats["duplicate_notifications"] == REQUESTS
    _record(benchmark, load, len(notes))
