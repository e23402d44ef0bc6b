"""An engine's view of kvpush: every rank in its own process, one side channel per engine.

P runs as 2 pipeline stages (one process each), D as 2 TP ranks (one process each). Each rank
creates its worker (``PushSender`` / ``PushReceiver``) and hands ``handshake_payload()`` to its
engine's scheduler, here the parent process, which serves it from the engine's one
``SideChannelServer``. The parent then plays the router: it tells D's ranks about a request
(``kv_transfer_params``) and P's ranks that its prefill finished. Each D rank checks that every
block it owns holds what P wrote, head slices included (P has 4 heads per rank, D 2).

Run it: ``python examples/engine_multiprocess.py`` (CPU, real NIXL between the processes).
Only ``kvpush.engine`` and torch are used.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection

import torch

from kvpush.engine import (
    ModelSpec,
    ParallelConfig,
    PushReceiver,
    PushSender,
    SideChannelServer,
    WaitTimeout,
    WorkerConfig,
)

MODEL = ModelSpec(
    name="example-gqa", num_layers=4, num_kv_heads=4, head_dim=16, block_size=8, dtype="float32"
)
NUM_BLOCKS = 32
PREFILL_PP, DECODE_TP = 2, 2


def kv_caches(parallel: ParallelConfig) -> dict[str, torch.Tensor]:
    """The uniform layout: per layer ``(2, num_blocks, local_heads, block_size, head_dim)``."""
    heads = MODEL.num_kv_heads // parallel.tp_size
    shape = (2, NUM_BLOCKS, heads, MODEL.block_size, MODEL.head_dim)
    return {f"layers.{i}": torch.zeros(shape) for i in range(parallel.start_layer, parallel.end_layer)}


def content(layer: int, kv: int, head: int, position: int) -> float:
    return float(1000 * layer + 100 * kv + 10 * head + position)


def prefill_rank(pp_rank: int, port: int, conn: Connection) -> None:
    """One P rank: start, hand the payload to the scheduler, push one request when told."""
    parallel = ParallelConfig.for_stage(
        num_layers=MODEL.num_layers, pp_size=PREFILL_PP, pp_rank=pp_rank, tp_size=1, tp_rank=0
    )
    caches = kv_caches(parallel)
    config = WorkerConfig(engine_id="prefill-0", parallel=parallel, model=MODEL, side_channel_port=port)
    sender = PushSender(config, caches)
    sender.start()
    try:
        conn.send((parallel.rank, sender.handshake_payload()))  # the scheduler publishes it
        request_id, block_ids, match_key = conn.recv()
        for name, tensor in caches.items():  # "prefill": write this request's KV
            layer = int(name.split(".")[1])
            for position, block in enumerate(block_ids):
                for kv in range(2):
                    for head in range(tensor.shape[2]):
                        tensor[kv, block, head] = content(layer, kv, head, position)
        sender.request_finished(request_id, block_ids, match_key=match_key)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            results = sender.get_finished()
            if request_id in results.sent or request_id in results.failed:
                conn.send(results.failed.get(request_id, "sent"))
                break
            time.sleep(0.01)
        else:
            conn.send(f"not reported sent or failed within 60s: {request_id}")
        # A P engine keeps serving: it closes when the deployment stops, here once D has
        # checked its bytes.
        conn.poll(90)
    finally:
        sender.close()


def decode_rank(tp_rank: int, port: int, conn: Connection) -> None:
    """One D rank: start, hand the payload over, receive one request and check its bytes."""
    parallel = ParallelConfig(tp_size=DECODE_TP, tp_rank=tp_rank, num_layers=MODEL.num_layers)
    caches = kv_caches(parallel)
    config = WorkerConfig(engine_id="decode-0", parallel=parallel, model=MODEL, side_channel_port=port)
    receiver = PushReceiver(config, caches)
    receiver.start()
    try:
        conn.send((parallel.rank, receiver.handshake_payload()))
        request_id, block_ids, kv_transfer_params = conn.recv()
        receiver.add_request_params(request_id, block_ids, kv_transfer_params)
        try:
            results = receiver.wait_finished(60)
        except WaitTimeout as err:
            conn.send(str(err))
            return
        if request_id not in results.done:
            conn.send(f"failed: {results.failed.get(request_id)}")
            return
        heads = MODEL.num_kv_heads // DECODE_TP
        for name, tensor in caches.items():
            layer = int(name.split(".")[1])
            for position, block in enumerate(block_ids):
                for kv in range(2):
                    for head in range(heads):
                        expected = content(layer, kv, tp_rank * heads + head, position)
                        if not bool((tensor[kv, block, head] == expected).all()):
                            conn.send(f"{name} block {block} head {head} holds the wrong bytes")
                            return
        conn.send("verified")
    finally:
        receiver.close()


def start(target, index: int, server: SideChannelServer) -> Connection:
    """Spawn one rank process and publish its payload on its engine's side channel."""
    parent, child = mp.get_context("spawn").Pipe()
    mp.get_context("spawn").Process(target=target, args=(index, server.port, child), daemon=True).start()
    if not parent.poll(120):
        raise TimeoutError(f"{target.__name__}({index}) sent no handshake payload within 120s")
    rank, payload = parent.recv()
    server.publish(rank, payload)
    return parent


def main() -> int:
    p_server, d_server = SideChannelServer("prefill-0"), SideChannelServer("decode-0")
    try:
        p_ranks = [start(prefill_rank, pp, p_server) for pp in range(PREFILL_PP)]
        d_ranks = [start(decode_rank, tp, d_server) for tp in range(DECODE_TP)]
        # The router: D learns where P is; P learns the prefill finished. Block tables differ.
        params = {
            "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1",
            "remote_port": p_server.port,
            "tp_size": 1,
            "pp_size": PREFILL_PP,
            "transfer_id": "xfer-1",
        }
        for conn in d_ranks:
            conn.send(("req-1", [7, 3, 12], params))
        for conn in p_ranks:
            conn.send(("req-1", [20, 5, 9], "xfer-1"))
        outcomes = []
        for conn in [*p_ranks, *d_ranks]:
            outcomes.append(conn.recv() if conn.poll(90) else "no answer within 90s")
        for conn in p_ranks:  # the deployment stops: P's workers close
            conn.send("stop")
        print("P:", outcomes[:PREFILL_PP], "D:", outcomes[PREFILL_PP:])
        return 0 if outcomes == ["sent"] * PREFILL_PP + ["verified"] * DECODE_TP else 1
    finally:
        p_server.close()
        d_server.close()


if __name__ == "__main__":
    sys.exit(main())
