"""Adversarial probes of the vLLM adapter with vLLM 0.33's real scheduler: n>1 sampling on D (a
parent's children register one key), prompts of whole blocks, D's prefix cache holding all of a
prompt. Nothing may be reported received with other KV than P computed, and nothing written into
blocks a request does not hold."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import (
    BLOCK_SIZE,
    Engine,
    PrefillModel,
    assert_scheduler_empty,
    make_request,
    prompt,
    run_until,
    suffix,
)


def _d_params(p: Engine, **extra: Any) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": p.spec.tp,
        "pp_size": p.spec.pp,
        **extra,
    }


def _verify(d: Engine, rid: str, tokens: list[int]) -> None:
    blocks = d.block_ids(rid)
    for worker in d.workers:
        problems = worker.call("verify", tokens=tokens, block_ids=blocks)
        assert not problems, f"D rank {worker.rank}, {rid}: {problems[:3]}"


def _idle(engines: list[Engine], model: PrefillModel) -> None:
    run_until(engines, lambda: not any(e.busy() for e in engines), "all idle", kv_producer=model)
    for engine in engines:
        assert_scheduler_empty(engine)


def test_n2_children_on_d_sharing_one_transfer_id(engines: Any, llama_dir: str) -> None:
    """n=2 on D: vLLM's frontend makes two child requests ('0_<id>', '1_<id>') with the parent's
    kv_transfer_params, so both register P's one transfer_id with one decode engine. Each child
    reported received holds the prompt's KV byte-exact; a child not written fails, with nothing
    written into its blocks."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 10})
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 30})
    model = PrefillModel()
    tokens = prompt(901, 40)
    key = f"xfer-n2-{suffix()}"
    parent = f"cmpl-n2-{suffix()}"
    p.add(make_request(f"cmpl-n2-{suffix()}", tokens, 1, {"do_remote_decode": True, "transfer_id": key}))
    children = [f"{i}_{parent}" for i in range(2)]
    before = d.workers[0].call("snapshot")
    for rid in children:
        d.add(make_request(rid, tokens, 3, _d_params(p, transfer_id=key)))
    started = time.monotonic()
    checked: dict[str, str] = {}
    blocks: dict[str, set[int]] = {}
    while len(checked) < 2:
        assert time.monotonic() - started < 40, f"children not settled: {checked}"
        for engine in (p, d):
            engine.step(model if engine is p else None)
        for rid in children:
            if rid in d.scheduler.requests and rid not in blocks:
                ids = d.block_ids(rid)
                if ids and ids[0]:
                    blocks[rid] = set(ids[0])
            if rid in checked:
                continue
            if rid in d.failed_recving:
                checked[rid] = "failed"
            elif rid in d.finished_recving:
                _verify(d, rid, tokens)
                checked[rid] = "received"
    changed = d.workers[0].call("changed_blocks", before=before)
    received = [rid for rid, how in checked.items() if how == "received"]
    allowed = set().union(*(blocks[r] for r in received)) if received else set()
    assert changed <= allowed, (
        f"blocks written outside the received children's: {changed - allowed} ({checked})"
    )
    _idle([p, d], model)


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_prompt_of_whole_blocks_with_d_prefix_cache_holding_all_of_it(
    engines: Any, llama_dir: str, blocks: int
) -> None:
    """A prompt of whole blocks: first pushed cold, then again while D's prefix cache holds every
    block of it (vLLM recomputes the last token: the hit is capped at len - 1). Both byte-exact,
    and the second writes no cached block."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(950 + blocks, blocks * BLOCK_SIZE)
    for attempt in range(2):
        before = d.workers[0].call("snapshot")
        p_id, d_id = f"cmpl-whole-{attempt}-{suffix()}", f"cmpl-whole-{attempt}-{suffix()}"
        p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False}))
        d.add(make_request(d_id, tokens, 3, _d_params(p)))
        run_until(
            [p, d],
            lambda d_id=d_id: (
                d_id in d.finished_recving
                or d.finish_reason(d_id) is not None
                or (d_id in d.scheduler.requests and d.scheduler.requests[d_id].num_output_tokens > 0)
            ),
            f"D to receive {d_id}",
            kv_producer=model,
        )
        assert d_id not in d.failed_recving
        if d_id in d.scheduler.requests:
            _verify(d, d_id, tokens)
            mine = set(d.block_ids(d_id)[0])
            changed = d.workers[0].call("changed_blocks", before=before)
            assert changed <= mine, f"written outside {d_id}'s blocks: {changed - mine}"
        _idle([p, d], model)


SLOW = {
    "transport": "faulty",
    "transport_options": {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 1.5},
}


def test_p_blocks_under_a_slow_write_are_not_reused_by_later_prefills(engines: Any, llama_dir: str) -> None:
    """P's pool is small and its WRITE to D slow: the prefills P runs meanwhile (other prompts,
    filling and recycling the pool) must not get the pushed request's blocks before the WRITE
    read them, so D receives the pushed prompt's KV, not a later prompt's."""
    p = engines(llama_dir, "kv_producer", num_blocks=16, max_model_len=128, extra=SLOW)
    d = engines(
        llama_dir, "kv_consumer", extra={"transport": "faulty", "transport_options": {"inner": "nixl"}}
    )
    model = PrefillModel()
    tokens = prompt(970, 4 * BLOCK_SIZE)
    p_id, d_id = f"cmpl-slow-{suffix()}", f"cmpl-slow-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False}))
    d.add(make_request(d_id, tokens, 3, _d_params(p)))
    run_until([p, d], lambda: p.kv_transfer_params(p_id) is not None, "P's prefill", kv_producer=model)
    others = 0
    deadline = time.monotonic() + 30
    while d_id not in d.finished_recving:
        assert time.monotonic() < deadline, "D did not receive"
        if not p.busy() or (len(p.scheduler.waiting) == 0 and others < 12):
            p.add(make_request(f"cmpl-fill-{others}-{suffix()}", prompt(980 + others, 44), 1, None))
            others += 1
        p.step(model)
        d.step()
    assert d_id not in d.failed_recving
    assert others >= 3, "no prefill ran while the WRITE was in flight"
    _verify(d, d_id, tokens)
    _idle([p, d], model)


def test_d_abort_under_slow_writes_from_a_hybrid_pp2_prefill(engines: Any, llama_dir: str) -> None:
    """P (pp=2, a hybrid model whose stages each hold one KV group) WRITEs slowly when D aborts:
    vLLM keeps D's blocks until every P stage's cancel settled, and no WRITE lands after."""
    from vllm.v1.request import RequestStatus

    p = engines(llama_dir, "kv_producer", pp=2, sliding_layers=(2, 3), extra=SLOW)
    d = engines(
        llama_dir,
        "kv_consumer",
        sliding_layers=(2, 3),
        extra={"transport": "faulty", "transport_options": {"inner": "nixl"}},
    )
    model = PrefillModel()
    tokens = prompt(975, 70)
    p_id, d_id = f"cmpl-hab-{suffix()}", f"cmpl-hab-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False}))
    d.add(make_request(d_id, tokens, 3, _d_params(p)))
    run_until([p, d], lambda: p.kv_transfer_params(p_id) is not None, "P's prefill", kv_producer=model)
    deadline = time.monotonic() + 0.5  # PUSH_REG reaches P's stages, they post the slow WRITEs
    while time.monotonic() < deadline:
        p.step(model)
        d.step()
    blocks = sorted({b for group in d.block_ids(d_id) for b in group if b})
    free_before = d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    aborted = time.monotonic()
    while d_id not in d.finished_recving:
        assert time.monotonic() - aborted < 30, "the cancel never settled"
        assert d_id in d.scheduler.requests, "vLLM freed the request before the cancel settled"
        assert d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
        p.step(model)
        d.step()
    assert d_id not in d.scheduler.requests
    for worker in d.workers:
        worker.call("fill", block_ids=blocks, value=0x5A5A)
    deadline = time.monotonic() + 2.0  # longer than the WRITE delay: a late WRITE would show
    while time.monotonic() < deadline:
        p.step(model)
        d.step()
    for worker in d.workers:
        assert worker.call("holds", block_ids=blocks, value=0x5A5A), "P wrote into freed blocks"
    _idle([p, d], model)
