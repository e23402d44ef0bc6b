"""Adversarial probes of the vLLM adapter with vLLM 0.33's real scheduler: n>1 sampling on D
(a parent's children share one key: one receives, the others decode from its KV), prompts of
whole blocks, D's prefix cache holding all of a prompt. Nothing may be reported received with
other KV than P computed, and nothing written into blocks a request does not hold."""

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


def _children(
    p: Engine,
    d: Engine,
    tokens: list[int],
    n: int,
    *,
    transfer_id: bool,
    abort_p: bool = False,
    shared: bool = False,
) -> tuple[dict[str, str], dict[str, list[int]]]:
    """One P leg, and a D leg with ``n`` > 1 as vLLM's frontend fans it out (``ParentRequest``):
    children ``'<i>_<parent id>'``, each with the parent's ``kv_transfer_params``; the legs share a
    ``transfer_id`` or only the client's ``X-Request-Id`` (each engine appends its own
    ``-<8 hex>``). Steps both engines (D's local prefill writes like P's) until every child
    received or failed; ``abort_p``: P's prefill is aborted before it finishes. Returns how
    each child ended and the block table of each that decoded. ``shared``: the children hold one
    ``kv_transfer_params`` dict, as with vLLM's in-process engine core (``copy(request)`` and one
    cached child ``SamplingParams``; across processes each child gets its own copy). The loop's
    bound (40 s) is below D's registration timeout (120 s): a child left waiting for it fails."""
    from vllm.v1.request import RequestStatus

    model = PrefillModel()
    client = f"cmpl-n{n}-{suffix()}"
    key = {"transfer_id": f"xfer-{client}"} if transfer_id else {}
    p_id, parent = f"{client}-{suffix()}", f"{client}-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False, **key}))
    if abort_p:
        p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
    children = [f"{i}_{parent}" for i in range(n)]
    params = _d_params(p, **key)
    for rid in children:
        d.add(make_request(rid, tokens, 3, params if shared else dict(params)))
    ended: dict[str, str] = {}
    tables: dict[str, list[int]] = {}
    started = time.monotonic()
    while len(ended) < n:
        assert time.monotonic() - started < 40, f"children not settled: {ended}"
        p.step(model)
        d.step(model)
        for rid in children:
            if rid in ended:
                continue
            if rid in d.failed_recving or d.finish_reason(rid) == "error":
                ended[rid] = "failed"
            elif rid in d.scheduler.requests and d.scheduler.requests[rid].num_output_tokens > 0:
                _verify(d, rid, tokens)  # decoding: its KV is in place (received or computed)
                ended[rid] = "received" if rid in d.finished_recving else "computed"
                tables[rid] = d.block_ids(rid)[0]
            elif d.finish_reason(rid) is not None:
                ended[rid] = "finished unverified"
    _idle([p, d], model)
    return ended, tables


@pytest.mark.parametrize(
    ("transfer_id", "shared"),
    [(True, False), (False, False), (True, True)],
    ids=["transfer_id", "x-request-id", "in-process"],
)
def test_n2_children_on_d_every_child_decodes_from_the_prompts_kv(
    engines: Any, llama_dir: str, transfer_id: bool, shared: bool
) -> None:
    """n=2 on D: one P push serves the parent's first child; every other child waits for it and
    then decodes from the same KV (vLLM's prefix cache holds the received blocks; D computes
    the prompt's last, partial block itself). Before: sharing a transfer_id, the second child
    failed at once ('already being received'); without one, the children's keys ('0_<id>')
    never matched P's and both waited for their registration timeout. Children sharing one
    kv_transfer_params dict (in-process engine core) see the first one's registration mark and
    compute the prompt themselves: correct KV too."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    tokens = prompt(901, 40)
    ended, tables = _children(p, d, tokens, 3, transfer_id=transfer_id, shared=shared)
    assert sorted(ended.values()) == ["computed", "computed", "received"], ended
    assert not d.failed_recving
    if not shared:  # the siblings hit the received blocks in vLLM's prefix cache (full blocks)
        (holder,) = [rid for rid, how in ended.items() if how == "received"]
        full = len(tokens) // BLOCK_SIZE
        for rid in ended:
            assert tables[rid][:full] == tables[holder][:full], (rid, tables)


def test_n2_children_after_p_aborted_fail_at_once_under_fail(engines: Any, llama_dir: str) -> None:
    """n=2 on D whose P prefill was aborted: the child registered with P fails at once (P's
    abandon), and the child waiting for it fails then too (kv_load_failure_policy 'fail'),
    never decoding from unwritten blocks and never waiting for its registration timeout."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    ended, _ = _children(p, d, prompt(903, 40), 2, transfer_id=True, abort_p=True)
    assert set(ended.values()) == {"failed"}, ended


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


def test_n2_children_follow_their_sibling_when_one_d_rank_failed_it(engines: Any, llama_dir: str) -> None:
    """P TP2 -> D TP2 with half of P's WRITEs failing, n=2 on D under `fail`: a child that one D
    rank received and the other failed reaches vLLM failed (vLLM's aggregator hands on the
    failed rank's report at once and the request's finish only when both ranks reported, so
    the failure and the finish arrive in different steps); its sibling must fail too, never
    decode as if the KV had been received. A child both ranks received: its sibling decodes
    from the same KV, byte-exact."""
    flaky = {"transport": "faulty", "transport_options": {"inner": "nixl", "fail_writes": 0.5, "seed": 7}}
    faulty_none = {"transport": "faulty", "transport_options": {"inner": "nixl"}}
    p = engines(llama_dir, "kv_producer", tp=2, extra=flaky)
    d = engines(llama_dir, "kv_consumer", tp=2, extra=faulty_none, policy="fail")
    model = PrefillModel()
    parents = []
    for i in range(8):
        tokens = prompt(430 + i, 40 + 5 * i)
        key = f"xfer-n2-half-{i}-{suffix()}"
        parent = f"cmpl-n2-half-{i}-{suffix()}"
        p.add(make_request(f"{parent}-p", tokens, 1, {"do_remote_decode": True, "transfer_id": key}))
        children = [f"{c}_{parent}" for c in range(2)]
        for rid in children:
            d.add(make_request(rid, tokens, 3, _d_params(p, transfer_id=key)))
        parents.append((children, tokens))
    ended: dict[str, str] = {}
    started = time.monotonic()
    while len(ended) < 2 * len(parents):
        assert time.monotonic() - started < 60, f"children not settled: {ended}"
        p.step(model)
        d.step(model)
        for children, tokens in parents:
            for rid in children:
                if rid in ended:
                    continue
                if rid in d.failed_recving or d.finish_reason(rid) == "error":
                    ended[rid] = "failed"
                elif rid in d.scheduler.requests and d.scheduler.requests[rid].num_output_tokens > 0:
                    _verify(d, rid, tokens)
                    ended[rid] = "received" if rid in d.finished_recving else "computed"
                elif d.finish_reason(rid) is not None:
                    ended[rid] = "finished unverified"
    _idle([p, d], model)
    outcomes = [sorted(ended[rid] for rid in children) for children, _ in parents]
    assert all(o in (["failed", "failed"], ["computed", "received"]) for o in outcomes), outcomes
    by_rank = [d.failed_by_rank.get(rank, set()) for rank in (0, 1)]
    split = by_rank[0] ^ by_rank[1]
    assert split, "no child was received by one D rank and failed by the other"
