"""Probe: an engine that restarts a rank's worker (``close()``, then a new ``PushSender`` /
``PushReceiver`` started and its payload published again on the engine's side channel).

The engine is the SGLang-like one of ``test_probe_engine_sglang`` (separate K/V token-slot
pools), every rank a worker of ``kvpush.engine`` over real NIXL agents in this process.
What must hold: requests after the restart land byte-exact, and no D request's blocks are held
for ever (every failed request is eventually in ``released``).
"""

from __future__ import annotations

import time

from test_probe_engine_sglang import Engines, Pools, gqa, logical, mismatches, push_and_check

from kvpush.engine import ParallelConfig, PushReceiver, PushSender, RankKey, WorkerConfig

FAST = {"lease_s": 3.0, "write_deadline_s": 1.0, "handshake_timeout_s": 1.0}
"""Heartbeats every 0.5 s, a silent P dead after 2.5 s: the probe's bounds stay short."""


def restart_prefill_rank(engines: Engines, rank: RankKey) -> None:
    """Close P rank ``rank``'s worker and start a new one in this process on fresh pools."""
    engines.senders[rank].close()
    start_prefill_rank(engines, rank)


def start_prefill_rank(engines: Engines, rank: RankKey) -> None:
    """Start a new worker for P rank ``rank`` (its old one closed) in this process on fresh
    pools, and publish it on P's side channel."""
    old = engines.senders[rank]
    model, parallel = old.config.model, old.config.parallel
    pools = Pools(model, parallel, engines.p_pools[rank].pages)
    layout, caches = pools.kv_caches()
    config = WorkerConfig(
        engine_id="sgl-prefill",
        parallel=parallel,
        model=model,
        layout=layout,
        transport="nixl",
        side_channel_port=engines.p_server.port,
        **FAST,
    )
    sender = PushSender(config, caches, pm=engines.pm)
    engines.senders[rank] = sender
    sender.start()
    engines.p_server.publish(rank, sender.handshake_payload())
    engines.p_pools[rank], engines.sent[rank] = pools, {}


def restart_decode_rank(engines: Engines, tp: int) -> None:
    old = engines.receivers[tp]
    old.close()
    model = old.config.model
    parallel = ParallelConfig(tp_size=old.config.parallel.tp_size, tp_rank=tp, num_layers=model.num_layers)
    pools = Pools(model, parallel, engines.d_pools[tp].pages)
    layout, caches = pools.kv_caches()
    config = WorkerConfig(
        engine_id="sgl-decode",
        parallel=parallel,
        model=model,
        layout=layout,
        transport="nixl",
        side_channel_port=engines.d_server.port,
        **FAST,
    )
    receiver = PushReceiver(config, caches, pm=engines.pm)
    engines.receivers[tp] = receiver
    receiver.start()
    engines.d_server.publish(parallel.rank, receiver.handshake_payload())
    engines.d_pools[tp], engines.done[tp], engines.released[tp] = pools, {}, set()


def settle_or_land(
    engines: Engines, rid: str, prid: str, d_pages: list[int], tokens: int, bound_s: float
) -> None:
    """The request's outcome on every D rank: done with every byte right, or failed with its
    blocks released within ``bound_s`` (nothing written into them)."""
    before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
    d, _ = engines.wait(rid, prid, timeout_s=bound_s)
    deadline = time.monotonic() + bound_s
    for tp, pools in engines.d_pools.items():
        if d[tp] is None:
            assert mismatches(pools, logical(pools, d_pages, tokens, 0, before[tp])) == [], f"D rank {tp}"
            continue
        while rid not in engines.released[tp]:
            assert time.monotonic() < deadline, (
                f"D rank {tp}: {rid} failed ({d[tp]}) and its blocks were not released within "
                f"{bound_s}s; stats {engines.receivers[tp].stats}"
            )
            engines.poll()
            time.sleep(0.02)


def test_a_prefill_rank_restarted_in_its_process_leaves_no_decode_blocks_held() -> None:
    """D used to register the first request after the restart with the closed incarnation's
    agent, fail it at peer_silence_s, then hold its blocks until P's process exited (it cannot
    fence same-host copies, and dropped the new incarnation's CANCEL_ACK): a worker re-created
    in a live process never let them go. Now the closed worker says goodbye (``BYE``) once
    nothing of it is in flight, and D handshakes afresh with the one that serves now."""
    with Engines(gqa(16), p_pages=12, d_pages=12, **FAST) as engines:
        push_and_check(engines, [3, 5, 7], [1, 2, 4], 40)
        restart_prefill_rank(engines, RankKey(0, 0))
        engines.prefill([6, 8, 9], 40)
        engines.add("d-2", [5, 6, 7], "x-2")
        engines.finish("p-2", [6, 8, 9], "x-2")
        settle_or_land(engines, "d-2", "p-2", [5, 6, 7], 40, bound_s=15)


def test_a_request_added_before_the_restarted_rank_is_published_waits_for_it() -> None:
    """P's side channel still serves the closed worker when D handshakes for the next request:
    D does not greet an incarnation that said goodbye (its HELLO would go unanswered and fail
    the request); it handshakes again after the backoff and registers with the new worker."""
    with Engines(gqa(16), p_pages=12, d_pages=12, **FAST) as engines:
        push_and_check(engines, [3, 5, 7], [1, 2, 4], 40)
        engines.senders[RankKey(0, 0)].close()
        before = engines.d_pools[0].snapshot()
        engines.add("d-2", [5, 6, 7], "x-2")
        time.sleep(0.5)  # D handshook meanwhile and loaded the closed worker's payload
        start_prefill_rank(engines, RankKey(0, 0))
        engines.prefill([6, 8, 9], 40)
        engines.finish("p-2", [6, 8, 9], "x-2")
        d, p = engines.wait("d-2", "p-2", timeout_s=15)
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
        assert mismatches(engines.d_pools[0], logical(engines.d_pools[0], [5, 6, 7], 40, 0, before)) == []


def test_a_decode_rank_restarted_in_its_process_gets_later_requests_byte_exact() -> None:
    """The first request around the restart may fail (P sees a new D incarnation); its blocks
    are released, and the next one lands byte-exact on every rank."""
    with Engines(gqa(16), d_tp=2, p_pages=12, d_pages=12, **FAST) as engines:
        push_and_check(engines, [3, 5, 7], [1, 2, 4], 40)
        restart_decode_rank(engines, 1)
        for i, d_pages in ((2, [5, 6, 7]), (3, [8, 9, 10])):
            engines.prefill([6, 8, 9], 40)
            engines.add(f"d-{i}", d_pages, f"x-{i}")
            engines.finish(f"p-{i}", [6, 8, 9], f"x-{i}")
            settle_or_land(engines, f"d-{i}", f"p-{i}", d_pages, 40, bound_s=15)
        d, p = engines.wait("d-3", "p-3")
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
