"""Block-id translation between P and D, probed with real NIXL transfers, byte for byte.

Which of P's blocks land in which of D's: a prompt whose last block is partial, a P block table
holding a block past the prompt (lookahead), a D prefix hit (D states ``block_start``), D ids in
scattered order and at the end of the cache, two requests side by side. Every D block is
checked: the paired ones hold P's bytes of the same index, every other one keeps its noise.
Bad ids (repeated, negative, past the cache) and P and D of other block sizes are refused
with an error naming what was wrong.

Findings (vLLM's real scheduler, tests_vllm's harness; skipped outside the vLLM venv):

- Fixed 2026-12-03: vLLM P and D whose scheduler blocks differ (kernel blocks alike) on a
  hybrid model failed about every other sliding-window request (P's vLLM freed window blocks
  at its finer block, D registered its coarser window). Each side now publishes the block at
  which its engine frees a sliding window (``window_block_tokens``, per KV group) and the
  handshake refuses a P whose window blocks D's do not divide, naming both sizes; P's blocks a
  multiple of D's (or equal) push every prompt length byte for byte.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from cluster import Cluster, kv_bytes, wait_until

from kvpush.core.errors import ConfigError
from kvpush.core.peers import check_window_blocks
from kvpush.core.planning import pair_blocks
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import (
    AgentMetadata,
    ModelSpec,
    ParallelConfig,
    RankKey,
    RequestMetadata,
    Role,
    TransferParams,
)
from kvpush.core.worker import WINDOW_BLOCKS_KEY, WorkerConfig
from kvpush.layouts.uniform import allocate_kv_caches

BLOCKS = 32
MODEL = ModelSpec(name="blocks-probe", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def _noise(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensor in caches.values():
        kv_bytes(tensor).copy_(torch.randint(-30_000, 30_000, tensor.shape, dtype=torch.int16, generator=gen))


def _snapshot(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: kv_bytes(t).clone() for name, t in caches.items()}


def _check(
    before: dict[str, torch.Tensor],
    d_caches: dict[str, torch.Tensor],
    p_caches: dict[str, torch.Tensor],
    pairs: dict[int, int],
) -> None:
    """D block ``d`` holds P block ``pairs[d]``; every other D block is unchanged."""
    for name, tensor in d_caches.items():
        got = kv_bytes(tensor)
        src = kv_bytes(p_caches[name])
        for block in range(got.shape[1]):
            want = src[:, pairs[block]] if block in pairs else before[name][:, block]
            assert torch.equal(got[:, block], want), (name, block, pairs.get(block))


@pytest.fixture(scope="module")
def nixl_cluster() -> Any:
    with Cluster(MODEL, num_blocks=BLOCKS, transport="nixl", request_timeout_s=30) as cluster:
        yield cluster


def test_prefix_hit_lookahead_and_partial_last_block_pair_by_index_byte_for_byte(
    nixl_cluster: Cluster,
) -> None:
    """A 22-token prompt (6 blocks of 4, the last holding 2 tokens) that P holds in 7 blocks
    (one allocated ahead for decode), pushed twice: to a D with a 2-block prefix hit (block_start
    2, ids scattered and at the cache's end) and to a D with none. Each D block gets P's block of
    its index in the prompt, the lookahead block goes nowhere, nothing else on D changes."""
    cluster = nixl_cluster
    sender = cluster.senders[RankKey(0, 0)]
    p_caches, d_caches = cluster.p_caches[RankKey(0, 0)], cluster.d_caches[0]
    _noise(d_caches, 7)
    before = _snapshot(d_caches)
    tokens = 22
    p_a = (3, 9, 1, 14, 27, 5, 20)  # 6 prompt blocks + a lookahead
    p_b = (2, 8, 11, 30, 16, 12, 6)
    d_a = (31, 0, 17, 4)  # blocks 2..5 of the prompt (hit on 0, 1)
    d_b = (10, 25, 13, 19, 22, 7)  # blocks 0..5
    sender.request_finished("pa", p_a, match_key="ka", num_tokens=tokens)
    sender.request_finished("pb", p_b, match_key="kb", num_tokens=tokens)
    cluster.add("da", d_a, "ka", block_start=2, num_tokens=tokens)
    cluster.add("db", d_b, "kb", num_tokens=tokens)
    assert cluster.wait_decode("da", 30) == {0: None}
    assert cluster.wait_decode("db", 30) == {0: None}
    pairs = {d: p_a[2 + i] for i, d in enumerate(d_a)}
    pairs.update({d: p_b[i] for i, d in enumerate(d_b)})
    _check(before, d_caches, p_caches, pairs)


def test_a_d_window_one_block_shorter_than_ps_pairs_by_index_not_from_the_start() -> None:
    """A sliding-window group D keeps one block fewer of (D's window starts one block later):
    with both starts stated, D's blocks pair with P's of the same index; the full group is
    paired whole. One block of skew never shifts the rest."""
    p = ((10, 11, 12, 13, 14, 15), (40, 41, 42, 43))  # group 1: blocks 2..5 of the prompt
    from kvpush.core.planning import PromptBlocks

    producer = PromptBlocks(p, None, (0, 2), None)
    d = ((0, 1, 2, 3, 4, 5), (7, 8, 9))  # group 1: blocks 3..5
    assert pair_blocks(producer, d, "r", decode_start=(0, 3)) == (p[0], (41, 42, 43))
    with pytest.raises(ConfigError, match=r"blocks 1 to 3 of KV group 1.*P holds blocks 2 to 5"):
        pair_blocks(producer, d, "r", decode_start=(0, 1))


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        ((1, 2, 2), r"repeat a block id"),
        ((1, -1), r"(?i)negative|non-negative|>= 0|-1"),
        ((1, BLOCKS), rf"block id {BLOCKS} is beyond group 0's {BLOCKS} blocks"),
    ],
)
def test_repeated_negative_and_out_of_range_ids_are_refused_on_both_legs(
    nixl_cluster: Cluster, ids: tuple[int, ...], why: str
) -> None:
    cluster = nixl_cluster
    d_caches = cluster.d_caches[0]
    before = _snapshot(d_caches)
    with pytest.raises(ConfigError, match=why):
        cluster.senders[RankKey(0, 0)].request_finished("bad-p", ids, match_key="bad")
    with pytest.raises(ConfigError, match=why):
        cluster.add("bad-d", ids, "bad")
    _check(before, d_caches, cluster.p_caches[RankKey(0, 0)], {})


def _rank(
    role: str, model: ModelSpec, port: int, window_block_tokens: tuple[int, ...] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=model.num_layers)
    caches = allocate_kv_caches(model, parallel, BLOCKS)
    config = WorkerConfig(
        engine_id=role,
        parallel=parallel,
        model=model,
        transport="nixl",
        side_channel_port=port,
        request_timeout_s=20,
        handshake_timeout_s=10,
        lease_s=3,
        window_block_tokens=window_block_tokens,
    )
    worker = (PushSender if role == "P" else PushReceiver)(config, caches)
    worker.start()
    return worker, caches


def test_p_and_d_of_other_block_sizes_are_refused_naming_block_size_and_nothing_lands() -> None:
    """P cuts the KV in blocks of 4 tokens, D in blocks of 8 (same bytes per token): P's blocks
    would land as halves of D's. The request fails naming block_size; D's blocks keep their
    bytes."""
    p_server, d_server = SideChannelServer("P"), SideChannelServer("D")
    workers = []
    try:
        sender, p_caches = _rank("P", MODEL, p_server.port)
        workers.append(sender)
        p_server.publish(RankKey(0, 0), sender.handshake_payload())
        d_model = ModelSpec(name=MODEL.name, num_layers=2, num_kv_heads=2, head_dim=8, block_size=8)
        receiver, d_caches = _rank("D", d_model, d_server.port)
        workers.append(receiver)
        d_server.publish(RankKey(0, 0), receiver.handshake_payload())
        _noise(d_caches, 3)
        before = _snapshot(d_caches)
        sender.request_finished("p", (1, 2, 3, 4), match_key="k")
        params = TransferParams(
            remote_engine_id="P", remote_host="127.0.0.1", remote_port=p_server.port, transfer_id="k"
        )
        receiver.add_request(RequestMetadata(request_id="d", block_ids=(5, 6), params=params))
        failed: dict[str, str] = {}

        def ended() -> bool:
            got = receiver.get_finished()
            assert "d" not in got.done, "D finished a request from a P of another block size"
            failed.update(got.failed)
            return "d" in failed

        wait_until(ended, 40, "D to fail the request")
        assert "block_size" in failed["d"], failed["d"]
        _check(before, d_caches, p_caches, {})
    finally:
        for worker in workers:
            worker.close()
        p_server.close()
        d_server.close()


def _meta(role: Role, window: list[int] | None) -> AgentMetadata:
    extensions = {} if window is None else {WINDOW_BLOCKS_KEY: window}
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MODEL.num_layers)
    return AgentMetadata(
        engine_id=role.name,
        role=role,
        parallel=parallel,
        model=MODEL,
        layout="uniform",
        transport="nixl",
        agent_name=role.name,
        agent_blob=b"",
        regions=(),
        extensions=extensions,
    )


@pytest.mark.parametrize(
    ("p_window", "d_window", "refused"),
    [
        (
            [0, 16],
            [0, 32],
            r"KV group 1 .* P 'PREFILL' schedules in blocks of 16 tokens and D 'DECODE' in blocks of 32",
        ),
        ([0, 48], [0, 32], r"blocks of 48 tokens .* blocks of 32.*same --block-size"),
        (
            [0, 16],
            [0, 0],
            r"KV group 1 is a sliding-window group on 'PREFILL' and keeps every block on 'DECODE'",
        ),
        ([0, 16], [0, 16, 0], r"P 'PREFILL' states the window blocks of 2 KV group\(s\), D 'DECODE' of 3"),
        ([0, 32], [0, 16], None),
        ([64, 16], [16, 16], None),
        ([0, 0], [0, 0], None),
        (None, [0, 32], None),
        ([0, 16], None, None),
    ],
)
def test_the_handshake_refuses_a_p_whose_sliding_window_blocks_ds_do_not_divide_on_both_sides(
    p_window: list[int] | None, d_window: list[int] | None, refused: str | None
) -> None:
    """Whichever side checks (D loading P, P loading D), the same verdict: D's block of every
    sliding-window group must divide P's; a side stating nothing frees no window blocks."""
    p_meta, d_meta = _meta(Role.PREFILL, p_window), _meta(Role.DECODE, d_window)
    for local, peer in ((d_meta, p_meta), (p_meta, d_meta)):
        problems = check_window_blocks(local, peer)
        if refused is None:
            assert problems == []
        else:
            assert len(problems) == 1 and re.search(refused, problems[0]), problems


def test_p_and_d_freeing_a_sliding_window_at_blocks_that_do_not_divide_are_refused_over_nixl() -> None:
    """Real ranks over NIXL: P states it frees a sliding window at blocks of 16 tokens, D at 32.
    D's request fails at the handshake naming both sizes; nothing lands in D's blocks."""
    p_server, d_server = SideChannelServer("P"), SideChannelServer("D")
    workers = []
    try:
        sender, p_caches = _rank("P", MODEL, p_server.port, (16,))
        workers.append(sender)
        p_server.publish(RankKey(0, 0), sender.handshake_payload())
        receiver, d_caches = _rank("D", MODEL, d_server.port, (32,))
        workers.append(receiver)
        d_server.publish(RankKey(0, 0), receiver.handshake_payload())
        _noise(d_caches, 5)
        before = _snapshot(d_caches)
        sender.request_finished("p", (1, 2, 3, 4), match_key="k")
        params = TransferParams(
            remote_engine_id="P", remote_host="127.0.0.1", remote_port=p_server.port, transfer_id="k"
        )
        receiver.add_request(RequestMetadata(request_id="d", block_ids=(5, 6, 7, 8), params=params))
        failed: dict[str, str] = {}

        def ended() -> bool:
            got = receiver.get_finished()
            assert "d" not in got.done, "D finished a request from a P freeing its window at other blocks"
            failed.update(got.failed)
            return "d" in failed

        wait_until(ended, 40, "D to fail the request")
        assert "blocks of 16 tokens" in failed["d"] and "blocks of 32" in failed["d"], failed["d"]
        _check(before, d_caches, p_caches, {})
    finally:
        for worker in workers:
            worker.close()
        p_server.close()
        d_server.close()


def _vllm_harness() -> Any:
    """tests_vllm's harness (vLLM's real scheduler and connector), or skip outside the vLLM venv."""
    pytest.importorskip("vllm")
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parents[1] / "tests_vllm")
    if here not in sys.path:
        sys.path.insert(0, here)
    import harness

    return harness


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _vllm_pair(tmp_path: Any, p_block: int, d_block: int) -> tuple[Any, Any, Any]:
    """A P and a D of a hybrid model (layers 1 and 3 with a 32-token sliding window) whose
    scheduler blocks are ``p_block`` and ``d_block`` tokens, both cut into kernel blocks of 16
    (their ModelSpecs hash alike). P releases unclaimed blocks after 3 s."""
    harness = _vllm_harness()
    model_dir = harness.write_model_dir(tmp_path, harness.LLAMA)

    def engine(role: str, block_size: int) -> Any:
        name = "prefill" if role == "kv_producer" else "decode"
        spec = harness.EngineSpec(
            model_dir=model_dir,
            role=role,
            engine_id=f"{name}-{_free_port()}",
            port=_free_port(),
            sliding_layers=(1, 3),
            block_size=block_size,
            kernel_block_size=16,
            num_blocks=256,
            extra={"kv_lease_duration": 3.0} if role == "kv_producer" else {},
        )
        return harness.Engine(spec)

    p = engine("kv_producer", p_block)
    try:
        d = engine("kv_consumer", d_block)
    except BaseException:
        p.close()
        raise
    return harness, p, d


def _push_prompts(harness: Any, p: Any, d: Any, lengths: Any) -> tuple[list[int], dict[int, list[str]]]:
    """Each prompt prefilled on P and received on D, one after the other: the lengths whose
    receive failed, and the lengths whose D blocks do not hold P's KV (every prompt token of
    every block D's request holds, sliding-window layers included), with the first problems."""
    model = harness.PrefillModel()
    failed, wrong = [], {}
    for length in lengths:
        tokens = harness.prompt(900 + length, length)
        p_id = f"cmpl-win{length}-0-{harness.suffix()}"
        d_id = f"cmpl-win{length}-0-{harness.suffix()}"
        p.add(harness.make_request(p_id, tokens, 1, {"do_remote_decode": True}))
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": p.spec.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": p.port,
            "tp_size": 1,
            "pp_size": 1,
        }
        d.add(harness.make_request(d_id, tokens, 3, params))
        harness.run_until([p, d], lambda d_id=d_id: d_id in d.finished_recving, d_id, kv_producer=model)
        if d_id in d.failed_recving:
            failed.append(length)
        else:
            for worker in d.workers:
                problems = worker.call(
                    "verify", tokens=tokens, block_ids=d.block_ids(d_id), whole_blocks=True
                )
                if problems:
                    wrong[length] = problems[:3]
        harness.run_until([p, d], lambda: not p.busy() and not d.busy(), "idle", kv_producer=model)
    return failed, wrong


def test_vllm_p_with_finer_sliding_window_blocks_than_d_is_refused_at_the_handshake_naming_both(
    tmp_path: Any,
) -> None:
    """P schedules blocks of 16 tokens, D of 32; both attention backends cut kernel blocks of 16,
    so the ModelSpecs hash alike. On a hybrid model (a 32-token sliding window) P's vLLM frees
    the window's blocks wholly before the window at 16-token granularity before
    request_finished, D's vLLM keeps its window from a 32-token boundary: for about every other
    prompt length (47-62, 79-94, ...) D's blocks start up to 16 tokens before P's. Registering
    only the kernel blocks P still holds is not safe: D's vLLM caches its 32-token blocks under
    the prompt's hash once received, and a later request hitting that prefix would read the
    kernel block nobody wrote. So the handshake compares the block at which each side frees a
    sliding window (published per KV group) and refuses a P whose window blocks D's do not
    divide: every such request fails at once naming both block sizes and what to do, and
    nothing is written into D's blocks (never wrong KV). Was a strict xfail: half the requests
    failed one by one after P refused D's registration."""
    harness, p, d = _vllm_pair(tmp_path, 16, 32)
    try:
        before = [worker.call("snapshot") for worker in d.workers]
        failed, wrong = _push_prompts(harness, p, d, (20, 48, 50, 64, 80))
        assert failed == [20, 48, 50, 64, 80] and not wrong, (failed, wrong)
        for worker, snapshot in zip(d.workers, before, strict=True):
            assert not worker.call("changed_blocks", before=snapshot), "P wrote into D's blocks"
            reasons = worker.call("warnings", containing="sliding-window group")
            assert reasons, worker.call("warnings")
            assert all(
                "blocks of 16 tokens" in r and "blocks of 32" in r and "--block-size" in r for r in reasons
            ), reasons[:2]
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 16), (64, 16), (16, 16)])
def test_vllm_p_with_coarser_or_equal_sliding_window_blocks_pushes_every_prompt_byte_for_byte(
    tmp_path: Any, p_block: int, d_block: int
) -> None:
    """P's scheduler blocks a multiple of D's (kernel blocks of 16 on both): P's vLLM frees its
    window's blocks at a boundary that is also one of D's, never past D's first kept block, so
    P holds every block D keeps. Every prompt length from 1 to 130 tokens (the window starting
    at each offset in P's and D's blocks) is received, and every prompt token of every block
    D's request holds carries P's KV (what D's vLLM caches under the prompt's hash)."""
    harness, p, d = _vllm_pair(tmp_path, p_block, d_block)
    try:
        failed, wrong = _push_prompts(harness, p, d, range(1, 131))
        assert not failed and not wrong, (failed, wrong)
    finally:
        d.close()
        p.close()
