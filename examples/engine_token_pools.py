"""An SGLang-style engine's view of kvpush: flat token-slot pools, every rank in its own process.

Each rank keeps, per layer, a K and a V pool of token slots, ``[slots, local_heads, head_dim]``
(SGLang's ``k_buffer[layer]`` / ``v_buffer[layer]``); a page is ``PAGE`` consecutive slots and a
request's ``req_to_token`` row lists the slot of each of its tokens. The engine hands kvpush
page views of the pools (the ``token_major`` layout) and page ids as block ids
(docs/engine-api.md, "Describing your KV memory" and "Which block ids each leg passes").

P runs one rank (TP 1), D two (TP 2: each holds half the heads). Two requests: one cold, one
whose first 64 tokens D already holds (a prefix hit: D registers the pages from its first
uncached token on). Each D rank then checks every slot of every pool: the request's prompt
slots hold P's values for its heads, every other slot is untouched.

Run it: ``python examples/engine_token_pools.py`` (CPU, real NIXL between the processes).
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
from kvpush.layouts.token_major import token_major_caches

PAGE = 16
MODEL = ModelSpec(
    name="example-pools", num_layers=3, num_kv_heads=4, head_dim=16, block_size=PAGE, dtype="bfloat16"
)
SLOTS = 40 * PAGE  # 40 pages; page 0 is the pool's padding page, never given to a request
DECODE_TP = 2
TOKENS = 150  # each prompt's length: 10 pages, the last one partly used
# Each request: (P's pages, D's pages of the whole prompt, tokens D holds already).
REQUESTS = {
    "req-1": ([9, 3, 17, 21, 5, 30, 12, 2, 26, 14], list(range(1, 11)), 0),
    "req-2": ([4, 6, 8, 10, 11, 13, 15, 16, 18, 19], [39, 37, 35, 33, 31, 29, 27, 25, 23, 22], 64),
}


class Pools:
    """One rank's pools: per layer a K and a V buffer of token slots (zeroed)."""

    def __init__(self, parallel: ParallelConfig) -> None:
        self.heads = MODEL.num_kv_heads // parallel.tp_size
        shape = (SLOTS, self.heads, MODEL.head_dim)
        layers = range(parallel.start_layer, parallel.end_layer)
        self.k_buffer = [torch.zeros(shape, dtype=torch.bfloat16) for _ in layers]
        self.v_buffer = [torch.zeros(shape, dtype=torch.bfloat16) for _ in layers]
        view = (-1, PAGE, self.heads, MODEL.head_dim)  # pages of PAGE slots
        self.kv_caches = token_major_caches(
            [k.view(view) for k in self.k_buffer], [v.view(view) for v in self.v_buffer], parallel
        )


def req_to_token(pages: list[int]) -> list[int]:
    """The slot of each token of a prompt laid out in ``pages``."""
    return [pages[t // PAGE] * PAGE + t % PAGE for t in range(TOKENS)]


def value(layer: int, kv: int, token: int, head: int) -> torch.Tensor:
    """The bits of one token's row of one head (distinct for every coordinate)."""
    base = (layer * 8 + kv * 4 + head) * 1000 + token
    return (torch.arange(MODEL.head_dim, dtype=torch.int32) * 31 + base * 7 + 1).to(torch.int16)


def prefill_rank(port: int, conn: Connection) -> None:
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MODEL.num_layers)
    pools = Pools(parallel)
    config = WorkerConfig(
        engine_id="prefill-0", parallel=parallel, model=MODEL, layout="token_major", side_channel_port=port
    )
    with PushSender(config, pools.kv_caches) as sender:
        conn.send((parallel.rank, sender.handshake_payload()))
        for rid, (pages, _, _) in REQUESTS.items():  # "prefill": write each prompt's KV
            for layer in range(MODEL.num_layers):
                for kv, buffer in enumerate((pools.k_buffer[layer], pools.v_buffer[layer])):
                    bits = buffer.view(torch.int16)
                    for token, slot in enumerate(req_to_token(pages)):
                        for head in range(pools.heads):
                            bits[slot, head] = value(layer, kv, token, head)
            # The prompt's pages, one id per page (the first slot of each page over PAGE).
            block_ids = [slot // PAGE for slot in req_to_token(pages)[::PAGE]]
            sender.request_finished(rid, block_ids, match_key=f"xfer-{rid}", num_tokens=TOKENS)
        outcome: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(outcome) < len(REQUESTS) and time.monotonic() < deadline:
            results = sender.get_finished()
            outcome.update({rid: "sent" for rid in results.sent})
            outcome.update(results.failed)
            time.sleep(0.01)
        conn.send(outcome)


def decode_rank(tp_rank: int, port: int, conn: Connection) -> None:
    parallel = ParallelConfig(tp_size=DECODE_TP, tp_rank=tp_rank, num_layers=MODEL.num_layers)
    pools = Pools(parallel)
    config = WorkerConfig(
        engine_id="decode-0", parallel=parallel, model=MODEL, layout="token_major", side_channel_port=port
    )
    with PushReceiver(config, pools.kv_caches) as receiver:
        conn.send((parallel.rank, receiver.handshake_payload()))
        params = conn.recv()
        expected = {}  # slot -> token of every prompt slot D receives
        for rid, (_, pages, cached) in REQUESTS.items():
            # The pages from the one holding the first uncached token to the prompt's last, and
            # where they start in the prompt (the pages of the prefix hit skipped) and its length:
            # P pairs by them and fails the request rather than guess.
            block_ids = pages[cached // PAGE :]
            receiver.add_request_params(
                rid,
                block_ids,
                {**params, "transfer_id": f"xfer-{rid}"},
                block_start=cached // PAGE,
                num_tokens=TOKENS,
            )
            slots = req_to_token(pages)
            expected.update({slots[t]: t for t in range(cached // PAGE * PAGE, TOKENS)})
        done: set[str] = set()
        try:
            while len(done) < len(REQUESTS):
                results = receiver.wait_finished(60)
                if results.failed:
                    conn.send(f"failed: {dict(results.failed)}")
                    return
                done.update(results.done)
        except WaitTimeout as err:
            conn.send(str(err))
            return
        for layer in range(MODEL.num_layers):
            for kv, buffer in enumerate((pools.k_buffer[layer], pools.v_buffer[layer])):
                bits = buffer.view(torch.int16)
                for slot in range(SLOTS):
                    for head in range(pools.heads):
                        token = expected.get(slot)
                        want = (
                            torch.zeros(MODEL.head_dim, dtype=torch.int16)
                            if token is None
                            else value(layer, kv, token, tp_rank * pools.heads + head)
                        )
                        if not torch.equal(bits[slot, head], want):
                            conn.send(f"layer {layer} {'KV'[kv]} slot {slot} head {head}: wrong bytes")
                            return
        conn.send("verified")


def start(target, args: tuple, server: SideChannelServer) -> Connection:
    """Spawn one rank process and publish its payload on its engine's side channel."""
    parent, child = mp.get_context("spawn").Pipe()
    mp.get_context("spawn").Process(target=target, args=(*args, child), daemon=True).start()
    if not parent.poll(120):
        raise TimeoutError(f"{target.__name__}{args} sent no handshake payload within 120s")
    rank, payload = parent.recv()
    server.publish(rank, payload)
    return parent


def main() -> int:
    p_server, d_server = SideChannelServer("prefill-0"), SideChannelServer("decode-0")
    try:
        p_rank = start(prefill_rank, (p_server.port,), p_server)  # P publishes first
        d_ranks = [start(decode_rank, (tp, d_server.port), d_server) for tp in range(DECODE_TP)]
        params = {  # the router's kv_transfer_params (each request adds its transfer_id)
            "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1",
            "remote_port": p_server.port,
            "tp_size": 1,
            "pp_size": 1,
        }
        for conn in d_ranks:
            conn.send(params)
        outcomes = [conn.recv() if conn.poll(120) else "no answer within 120s" for conn in [p_rank, *d_ranks]]
        print("P:", outcomes[0], "D:", outcomes[1:])
        return 0 if outcomes == [{rid: "sent" for rid in REQUESTS}, *["verified"] * DECODE_TP] else 1
    finally:
        p_server.close()
        d_server.close()


if __name__ == "__main__":
    sys.exit(main())
