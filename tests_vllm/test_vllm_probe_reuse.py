"""Adversarial probes of the vLLM adapter with vLLM 0.33's real scheduler: blocks vLLM frees and
hands on, a D abort during a prefix hit, a load vLLM cannot allocate yet (asked again each step),
the children of an n>1 request when the push to their sibling fails or is cancelled. Nothing may
be decoded from KV other than the prompt's, and nothing land in blocks a request does not hold."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import BLOCK_SIZE, Engine, PrefillModel, make_request, prompt, run_until, suffix
from test_vllm_probe_edges import SLOW, _d_params, _idle, _verify

FAULTY_NONE = {"transport": "faulty", "transport_options": {"inner": "nixl"}}


def _legs(p: Engine, d: Engine, base: str, tokens: list[int], max_tokens: int = 3) -> tuple[str, str]:
    p_id, d_id = f"{base}-{suffix()}", f"{base}-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False}))
    d.add(make_request(d_id, tokens, max_tokens, _d_params(p)))
    return p_id, d_id


def _steps(p: Engine, d: Engine, model: PrefillModel, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        p.step(model)
        d.step(model)


def _abort_and_settle(p: Engine, d: Engine, model: PrefillModel, d_id: str) -> None:
    """Abort ``d_id`` on D; step until kvpush reports it, checking vLLM keeps its blocks meanwhile."""
    from vllm.v1.request import RequestStatus

    free_before = d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    aborted = time.monotonic()
    while d_id not in d.finished_recving:
        assert time.monotonic() - aborted < 30, "the cancel never settled"
        assert d_id in d.scheduler.requests, "vLLM freed the request before the cancel settled"
        assert d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
        p.step(model)
        d.step(model)
    assert d_id not in d.scheduler.requests


def test_d_abort_during_a_prefix_hit_leaves_the_cached_prefix_and_its_freed_suffix_alone(
    engines: Any, llama_dir: str
) -> None:
    """D caches a prompt; a second prompt sharing its first two blocks registers only its suffix;
    P's WRITE of it is slow when D aborts. vLLM holds the suffix blocks until the cancel settled;
    after, nothing lands in them, and a third request hitting the cached prefix decodes from the
    first prompt's KV, byte-exact (the aborted push never touched the shared blocks)."""
    p = engines(llama_dir, "kv_producer", extra=SLOW)
    d = engines(llama_dir, "kv_consumer", extra=FAULTY_NONE)
    model = PrefillModel()
    first = prompt(990, 40)
    _, d_first = _legs(p, d, "cmpl-pfx-a", first)
    run_until([p, d], lambda: d_first in d.finished_recving, "D to receive the first", kv_producer=model)
    _idle([p, d], model)
    second = prompt(991, 70, prefix=first[: 2 * BLOCK_SIZE])
    p_id, d_id = _legs(p, d, "cmpl-pfx-b", second)
    run_until([p, d], lambda: p.kv_transfer_params(p_id) is not None, "P's prefill", kv_producer=model)
    _steps(p, d, model, 0.5)  # PUSH_REG reaches P, P posts the slow WRITE
    table = d.block_ids(d_id)[0]
    prefix, tail = table[:2], table[2:]
    _abort_and_settle(p, d, model, d_id)
    for worker in d.workers:
        worker.call("fill", block_ids=tail, value=0x5A5A)
    _steps(p, d, model, 2.0)  # longer than the WRITE delay: a late WRITE would show
    for worker in d.workers:
        assert worker.call("holds", block_ids=tail, value=0x5A5A), "P wrote into freed blocks"
    third = prompt(992, 50, prefix=first[: 2 * BLOCK_SIZE])
    _, d_third = _legs(p, d, "cmpl-pfx-c", third)
    run_until([p, d], lambda: d_third in d.finished_recving, "D to receive the third", kv_producer=model)
    assert d_third not in d.failed_recving
    assert d.block_ids(d_third)[0][:2] == prefix, "the third request did not hit the cached prefix"
    _verify(d, d_third, third)
    _idle([p, d], model)


def test_a_load_vllm_cannot_allocate_yet_registers_once_when_it_can(engines: Any, llama_dir: str) -> None:
    """D's pool holds one load at a time: vLLM asks get_num_new_matched_tokens again every step
    while the second request waits for blocks, and the worker must see one registration per
    request, each received byte-exact (a load staged twice would register twice with P)."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", num_blocks=8, max_model_len=96)
    model = PrefillModel()
    prompts = [prompt(995 + i, 5 * BLOCK_SIZE - 3) for i in range(3)]
    ids = [_legs(p, d, f"cmpl-full-{i}", tokens, max_tokens=2)[1] for i, tokens in enumerate(prompts)]
    waited = False
    started = time.monotonic()
    seen: set[str] = set()
    while len(seen) < len(ids):
        assert time.monotonic() - started < 60, f"not every request was received: {seen}"
        p.step(model)
        d.step(model)
        waiting = {r.request_id for r in d.scheduler.waiting}
        waited |= bool(waiting & set(ids)) and bool(d.connector._scheduler.receiving)
        for rid, tokens in zip(ids, prompts, strict=True):
            if rid in seen or rid not in d.finished_recving:
                continue
            assert rid not in d.failed_recving, f"{rid} failed"
            if d.scheduler.requests.get(rid) is not None:
                _verify(d, rid, tokens)
            seen.add(rid)
    assert waited, "the pool was meant to hold a load back while another was receiving"
    _idle([p, d], model)
    assert d.stats.get("push_regs_sent") == len(ids), d.stats


def _run_children(
    p: Engine, d: Engine, model: PrefillModel, children: list[str], tokens: list[int]
) -> dict[str, str]:
    """Step until every child decodes (verified byte-exact) or finishes; how each ended."""
    ended: dict[str, str] = {}
    started = time.monotonic()
    while len(ended) < len(children):
        assert time.monotonic() - started < 40, f"children not settled: {ended}"
        p.step(model)
        d.step(model)
        for rid in children:
            if rid in ended:
                continue
            request = d.scheduler.requests.get(rid)
            if request is not None and request.num_output_tokens > 0:
                _verify(d, rid, tokens)
                ended[rid] = "decoded"
            elif d.finish_reason(rid) is not None:
                ended[rid] = str(d.finish_reason(rid))
    return ended


def test_n2_children_under_recompute_when_every_write_fails_all_decode_from_the_prompts_kv(
    engines: Any, llama_dir: str
) -> None:
    """Every WRITE of P fails, D's policy is `recompute`, n=3: the child registered with P fails
    and vLLM recomputes it; its siblings fail with it and are recomputed too. Every child decodes
    from the prompt's KV, byte-exact (none from blocks P never wrote)."""
    failing = {"transport": "faulty", "transport_options": {"inner": "nixl", "fail_writes": 1.0}}
    p = engines(llama_dir, "kv_producer", extra=failing)
    d = engines(llama_dir, "kv_consumer", extra=FAULTY_NONE, policy="recompute")
    model = PrefillModel()
    tokens = prompt(996, 45)
    key = f"xfer-n3-rc-{suffix()}"
    parent = f"cmpl-n3-rc-{suffix()}"
    p.add(make_request(f"{parent}-p", tokens, 1, {"do_remote_decode": True, "transfer_id": key}))
    children = [f"{i}_{parent}" for i in range(3)]
    for rid in children:
        d.add(make_request(rid, tokens, 3, _d_params(p, transfer_id=key)))
    ended = _run_children(p, d, model, children, tokens)
    assert set(ended.values()) == {"decoded"}, ended
    _idle([p, d], model)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_n2_child_aborted_while_its_push_is_in_flight(engines: Any, llama_dir: str, policy: str) -> None:
    """n=2 on D, P's WRITE slow: the child registered with P is aborted (its blocks held until
    the cancel settled, nothing lands after); its sibling, waiting for it, then fails at once
    (`fail`) or is recomputed and decodes from the prompt's KV byte-exact (`recompute`)."""
    p = engines(llama_dir, "kv_producer", extra=SLOW)
    d = engines(llama_dir, "kv_consumer", extra=FAULTY_NONE, policy=policy)
    model = PrefillModel()
    tokens = prompt(997, 45)
    key = f"xfer-n2-ab-{suffix()}"
    parent = f"cmpl-n2-ab-{suffix()}"
    p_id = f"{parent}-p"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "transfer_id": key}))
    children = [f"{i}_{parent}" for i in range(2)]
    for rid in children:
        d.add(make_request(rid, tokens, 3, _d_params(p, transfer_id=key)))
    run_until([p, d], lambda: p.kv_transfer_params(p_id) is not None, "P's prefill", kv_producer=model)
    _steps(p, d, model, 0.5)
    holder = d.connector._scheduler._recv_keys.get(key)
    assert holder in children, d.connector._scheduler._recv_keys
    (sibling,) = set(children) - {holder}
    assert d.scheduler.requests[sibling].num_output_tokens == 0, "the sibling did not wait"
    blocks = d.block_ids(holder)[0]
    _abort_and_settle(p, d, model, holder)
    for worker in d.workers:
        worker.call("fill", block_ids=blocks, value=0x5A5A)
    deadline = time.monotonic() + 2.0  # longer than the WRITE delay; D's scheduler not stepped,
    while time.monotonic() < deadline:  # so the freed blocks stay free (kvpush's threads run)
        p.step(model)
    for worker in d.workers:
        assert worker.call("holds", block_ids=blocks, value=0x5A5A), "P wrote into freed blocks"
    ended = _run_children(p, d, model, [sibling], tokens)
    want = "error" if policy == "fail" else "decoded"
    assert ended == {sibling: want}, ended
    _idle([p, d], model)


def test_hybrid_pp2_p_decoding_past_the_prompt_under_slow_writes(engines: Any, llama_dir: str) -> None:
    """Hybrid P (pp=2: stage 0 holds only the full-attention group, stage 1 only the sliding one)
    decodes past the prompt and drops window blocks D needs; WRITEs are slow. Stage 1 refuses
    (fewer ids of its own group than D registered: "D registered 2 blocks in group 1 but P
    computed only 1"), stage 0 would push its group (group 1's ids, which it holds no layer of,
    are skipped) unless D's cancel reaches it first (here it usually does). D's receive fails at
    once, and vLLM gets the blocks back only once nothing of stage 0 can land: nothing does."""
    p = engines(llama_dir, "kv_producer", pp=2, sliding_layers=(2, 3), extra=SLOW)
    d = engines(llama_dir, "kv_consumer", sliding_layers=(2, 3), extra=FAULTY_NONE)
    model = PrefillModel()
    tokens = prompt(998, 64)
    p_id, d_id = f"cmpl-hpp-long-{suffix()}", f"cmpl-hpp-long-{suffix()}"
    p.add(make_request(p_id, tokens, 20, {"do_remote_decode": True, "do_remote_prefill": False}))
    d.add(make_request(d_id, tokens, 3, _d_params(p)))
    d.step()
    blocks = sorted({b for group in d.block_ids(d_id) for b in group if b})
    started = time.monotonic()
    while d_id not in d.finished_recving:
        assert time.monotonic() - started < 30, "D did not hear of the failure"
        p.step(model)
        d.step()
    assert d_id in d.failed_recving, "P was meant to have dropped window blocks D needs"
    assert d_id not in d.scheduler.requests or d.finish_reason(d_id) == "error"
    for worker in d.workers:
        worker.call("fill", block_ids=blocks, value=0x5A5A)
    _steps(p, d, model, 2.0)  # longer than the WRITE delay: a late WRITE would show
    for worker in d.workers:
        assert worker.call("holds", block_ids=blocks, value=0x5A5A), "P wrote into freed blocks"
    _idle([p, d], model)
