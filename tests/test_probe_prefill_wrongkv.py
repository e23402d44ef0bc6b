"""Probe (probeP): ways in which D ends up with WRONG KV reported done, caused on P's side,
outside the demo's happy conditions: the engine API used as real engines use (and misuse) it,
P's source blocks handed back to the engine while a push still needs them.

Findings (each test failed before its fix, 2026-12-02):
1. A request id still being pushed under one match key was accepted again under another;
   ``get_finished`` reports by request id, so an engine freed (and reused) the retry's blocks
   on the first prefill's outcome while D was still written from them. ``request_finished`` now
   refuses a request id still held (``ConfigError`` naming its key).
2. A packed WRITE whose later chunk's post failed with ``maybe_sent=False`` told D nothing was
   on the way, though earlier chunks were still in flight when released: D reused the staging
   without a fence and the old chunk landed in the next request's. ``post_packed`` now raises
   ``maybe_sent=True`` unless every posted chunk completed.
3. (liveness) ``num_tokens`` with ``block_start`` trimmed the block list as if it began at block
   0, refusing a prompt's tail stated with its start.
The in-process clusters run on the loopback transport unless a test says otherwise.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from typing import Any

import pytest
import torch
from cluster import Cluster, kv_bytes, wait_until

from kvpush.core import packing
from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.transport import TransferState
from kvpush.core.types import RankKey
from kvpush.plugins.strategy import ForcedStrategy
from kvpush.transports import loopback

P0 = RankKey(0, 0)


def _snapshot(cluster: Cluster, ids: list[int]) -> dict[str, torch.Tensor]:
    return {layer: kv_bytes(t)[:, ids].clone() for layer, t in cluster.p_caches[P0].items()}


def _overwrite(cluster: Cluster, ids: list[int]) -> None:
    """P's engine reuses blocks ``ids`` for another prefill: their KV changes."""
    for tensor in cluster.p_caches[P0].values():
        view = kv_bytes(tensor)[:, ids]
        kv_bytes(tensor)[:, ids] = torch.randint(-30_000, 30_000, view.shape, dtype=torch.int16)


def _d_holds(cluster: Cluster, d_ids: list[int], want: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(kv_bytes(got)[:, d_ids], want[layer]) for layer, got in cluster.d_caches[0].items()
    )


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_a_p_request_id_pending_under_another_key_is_refused_or_never_reported_ambiguously(
    transport: str,
) -> None:
    """A P engine that reuses a request id (a client's retry keeping its X-Request-Id, given a
    fresh transfer_id by the router) while the first prefill of that id is still held by
    kvpush: the first push's lease expires (its D never registered) and ``p-1`` shows up in
    ``.failed``. The engine, keyed by request id like every engine's scheduler, frees "p-1's
    blocks" (the retry's, its current entry) and reuses them; the retry's D then registers and
    is pushed the reused blocks, reported done. kvpush must refuse the reused id at the call
    (as it refuses a second finish of a key), or D must never get the wrong bytes done."""
    with Cluster(transport=transport, lease_s=2.0, request_timeout_s=30.0) as cluster:
        sender = cluster.senders[P0]
        sender.request_finished("p-1", [[3, 4]], match_key="x-1")  # its D never registers
        time.sleep(1.0)  # the retry comes later: its lease ends a second after the first's
        try:
            sender.request_finished("p-1", [[7, 8]], match_key="x-2")  # the id, reused
        except ConfigError:
            return  # refused: the engine learns at the call, nothing is ambiguous
        retry_kv = _snapshot(cluster, [7, 8])
        outcome = cluster.wait_prefill("p-1", timeout_s=10.0)[P0]  # x-1's lease: failed
        assert outcome is not None and "lease" in outcome, outcome
        # The engine frees what its table holds for "p-1" (the retry's blocks) and reuses them.
        _overwrite(cluster, [7, 8])
        cluster.add("d-2", [[1, 2]], "x-2")
        result = cluster.wait_decode("d-2", timeout_s=10.0)[0]
        if result is None:  # reported done: it must hold the retry's KV
            assert _d_holds(cluster, [1, 2], retry_kv), "D reported d-2 done with blocks P's engine reused"


def test_a_prompt_tail_stated_with_its_start_and_length_is_pushed() -> None:
    """A one-group sliding-window engine passes the prompt's last blocks (the window), states
    where they start and the prompt's length; D, with a prefix hit, registers the same blocks."""
    with Cluster() as cluster:  # block_size 4: a 10-token prompt is blocks 0 to 2
        want = _snapshot(cluster, [7, 8])
        cluster.senders[P0].request_finished("p-1", [[7, 8]], match_key="x-1", block_start=1, num_tokens=10)
        cluster.add("d-1", [[1, 2]], "x-1", block_start=1, num_tokens=10)
        assert cluster.wait_decode("d-1")[0] is None
        assert _d_holds(cluster, [1, 2], want)


def test_a_refused_chunk_after_a_stuck_chunk_never_tells_d_nothing_is_on_the_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PP2 -> TP1, packed, one region per chunk. Stage 0 pushes d-old: chunk 0 lands, chunk 1
    is handed to the network and stalls (a slow link), chunk 2's post is refused before
    anything went out (``TransferError(maybe_sent=False)``, as NIXL's ``make_prepped_xfer``
    failing). D fails d-old and releases it; d-new (one block) gets the same staging offset,
    and stage 1 writes d-new's layers 2-3 where d-old's chunk 1 was headed. The stalled chunk
    lands (as a stalled TCP send does) unless D fenced stage 0 since; then D scatters."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 64)  # one region per chunk
    monkeypatch.setitem(packing.post_packed.__kwdefaults__, "settle_timeout_s", 0.2)
    p0, p1 = RankKey(0, 0), RankKey(1, 0)
    with Cluster(prefill_pp=2, request_timeout_s=30.0) as cluster:
        cluster.pm.register(ForcedStrategy("packed"), "forced_strategy")
        stage0 = cluster.senders[p0].transport
        d_transport = cluster.receivers[0].transport
        fenced: list[str] = []
        d_fence = d_transport.fence_peer

        def fence_peer(peer: str) -> None:
            fenced.append(peer)
            d_fence(peer)

        d_transport.fence_peer = fence_peer  # type: ignore[method-assign]
        stuck: dict[str, Any] = {}
        calls = itertools.count()
        real = stage0.post_write

        def post_write(
            local_list: int, local_ids: Any, remote_list: int, remote_ids: Any, notif: bytes
        ) -> Any:
            n = next(calls)
            if n == 1:  # handed to the network, then stalled: in flight, its bytes not landed yet
                _, local = stage0._lists[local_list]
                _, remote = stage0._lists[remote_list]
                pairs = zip(local_ids, remote_ids, strict=True)
                stuck["pairs"] = [(local[int(a)].copy(), remote[int(b)].copy()) for a, b in pairs]
                stuck["fences"] = len(fenced)
                handle = next(loopback._IDS)
                stage0._states[handle] = TransferState.PENDING
                return handle
            if n == 2:
                raise TransferError("injected: the WRITE could not be prepared", maybe_sent=False)
            return real(local_list, local_ids, remote_list, remote_ids, notif)

        stage0.post_write = post_write  # type: ignore[method-assign]
        cluster.add("d-old", [[1, 2, 3, 4]], "x-old")
        cluster.finish("p-old", [[5, 6, 7, 8]], "x-old")
        assert cluster.wait_decode("d-old", timeout_s=10.0)[0] is not None  # failed
        cluster.wait_released("d-old", timeout_s=10.0)
        want = {
            rank: {layer: kv_bytes(t)[:, [10]].clone() for layer, t in caches.items()}
            for rank, caches in cluster.p_caches.items()
        }
        cluster.add("d-new", [[9]], "x-new")
        for rank in (p0, p1):
            sender = cluster.senders[rank]
            held = lambda s=sender: "x-new" in s.core._requests  # noqa: E731
            wait_until(lambda s=sender, h=held: s.call_on_writer(h), 10.0, "P to hold d-new's registration")
        gate = threading.Event()
        cluster.receivers[0].run_on_writer(lambda: gate.wait(10.0))  # D busy for a moment
        try:
            cluster.finish("p-new", [[10]], "x-new")
            assert set(cluster.wait_prefill("p-new", timeout_s=10.0).values()) == {None}
            if len(fenced) == stuck["fences"]:  # no fence cut the stalled connection: it lands
                for src, dst in stuck["pairs"]:
                    ctypes.memmove(int(dst[0]), int(src[0]), int(src[1]))
        finally:
            gate.set()
        assert cluster.wait_decode("d-new", timeout_s=10.0)[0] is None
        for rank, layers in want.items():
            for layer, kv in layers.items():
                got = kv_bytes(cluster.d_caches[0][layer])[:, [9]]
                why = f"D reported d-new done, but {layer} (stage {rank.pp_rank}) holds other bytes"
                assert torch.equal(got, kv), why


@pytest.mark.timeout(120)
def test_processes_a_p_request_id_reused_under_another_key_never_reaches_d_done_with_reused_blocks() -> None:
    from kvpush.core.sidechannel import SideChannelServer
    from kvpush.core.types import ParallelConfig
    from kvpush.demo.rank import RankSpec
    from kvpush.demo.runner import _Rank, _start_ranks, _stop
    from kvpush.demo.soak import SOAK_MODEL

    p_server, d_server = SideChannelServer("prefill-0"), SideChannelServer("decode-0")
    common: dict[str, Any] = {
        "model": SOAK_MODEL,
        "layout": "uniform",
        "blocks_per_group": (64,),
        "request_timeout_s": 30.0,
        "lease_s": 2.0,
        "transport": "nixl",
        "log_level": "ERROR",
    }
    ranks: list[_Rank] = []
    try:
        p_spec = RankSpec(
            role="prefill",
            engine_id="prefill-0",
            parallel=ParallelConfig.for_stage(
                num_layers=SOAK_MODEL.num_layers, pp_size=1, pp_rank=0, tp_size=1, tp_rank=0
            ),
            side_channel_port=p_server.port,
            reuse_failed_blocks=True,
            **common,
        )
        d_spec = RankSpec(
            role="decode",
            engine_id="decode-0",
            parallel=ParallelConfig(tp_size=1, tp_rank=0, num_layers=SOAK_MODEL.num_layers),
            side_channel_port=d_server.port,
            **common,
        )
        (p,), p_payloads = _start_ranks([p_spec], timeout_s=120)
        ranks.append(p)
        p_server.publish_all(p_payloads)
        (d,), d_payloads = _start_ranks([d_spec], timeout_s=120)
        ranks.append(d)
        d_server.publish_all(d_payloads)
        p.call(("prepare", [("first", 1, [[3, 4]]), ("retry", 2, [[7, 8]])]))
        p.call(("finish", "p-1", [[3, 4]], "x-1"))  # its D never registers: fails at the lease
        time.sleep(1.0)
        try:
            p.call(("finish", "p-1", [[7, 8]], "x-2"))  # the id, reused for the retry
        except Exception as err:  # refused at the call (the rank answers with the error)
            if "request_id" in str(err):
                return
            raise
        deadline = time.monotonic() + 15
        failed: dict[str, str] = {}
        while "p-1" not in failed:  # polling is the engine: it overwrites "p-1's" blocks now
            assert time.monotonic() < deadline, "P never reported p-1"
            failed.update(p.call(("poll",))["failed"])
            time.sleep(0.02)
        params = {
            "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1",
            "remote_port": p_server.port,
            "tp_size": 1,
            "pp_size": 1,
            "transfer_id": "x-2",
        }
        d.call(("add", "d-2", [[11, 12]], params, 2, [0]))
        done: dict[str, Any] = {}
        while "d-2" not in done:
            assert time.monotonic() < deadline + 15, "D never resolved d-2"
            polled = d.call(("poll",))
            done.update(polled["done"])
            if "d-2" in polled["failed"]:
                return  # failed with a reason: never wrong bytes reported done
            time.sleep(0.02)
        assert done["d-2"]["ok"], f"D reported d-2 done with other bytes: {done['d-2']['miss']}"
    finally:
        _stop(ranks)
        p_server.close()
        d_server.close()


def test_a_p_request_id_reported_but_not_collected_is_refused_until_get_finished() -> None:
    """The same ambiguity one step later (D's side had it too: tests/test_probe_decode_engine_api.py):
    the first prefill of ``p-1`` was reported (its lease ran out) but the engine has not called
    ``get_finished()`` yet. Finished again now, the next ``get_finished()`` would name ``p-1`` in
    ``.failed`` for the earlier prefill, and the engine would free the new one's blocks while P
    pushes them. Refused until the result is collected; accepted after."""
    with Cluster(transport="loopback", lease_s=0.5, request_timeout_s=30.0) as cluster:
        sender = cluster.senders[P0]
        sender.request_finished("p-1", [[3, 4]], match_key="x-1")  # its D never registers
        wait_until(lambda: "p-1" in sender._failed, 10.0, what="p-1's lease to run out")
        with pytest.raises(ConfigError, match="get_finished"):
            sender.request_finished("p-1", [[7, 8]], match_key="x-2")
        assert "lease" in sender.get_finished().failed["p-1"]
        sender.request_finished("p-1", [[7, 8]], match_key="x-2")  # collected: a new prefill
