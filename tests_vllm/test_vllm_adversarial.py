"""Adversarial paths of kvpush's vLLM connector under vLLM 0.33's real schedulers (real NIXL).

Each test drives a path vLLM's scheduler takes that the connector must not get wrong: D must
never decode from wrong KV silently, and P must never write into blocks D's vLLM has freed.
"""

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

FAULTY_NONE = {"transport": "faulty", "transport_options": {"inner": "nixl"}}
SENTINEL = 0x5A5A


def d_params(p: Engine, **extra: Any) -> dict[str, Any]:
    """The D leg's kv_transfer_params, naming P."""
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


def dispatch(
    p: Engine, d: Engine, base: str, tokens: list[int], *, p_max_tokens: int = 1, **extra: Any
) -> tuple[str, str]:
    """Both legs at once (``extra``: fields given to both legs' kv_transfer_params)."""
    p_id, d_id = f"{base}-{suffix()}", f"{base}-{suffix()}"
    p.add(make_request(p_id, tokens, p_max_tokens, {"do_remote_decode": True, **extra}))
    d.add(make_request(d_id, tokens, 3, d_params(p, **extra)))
    return p_id, d_id


def verify(d: Engine, d_id: str, tokens: list[int]) -> None:
    blocks = d.block_ids(d_id)
    for worker in d.workers:
        problems = worker.call("verify", tokens=tokens, block_ids=blocks)
        assert not problems, f"D rank {worker.rank}: {problems[:3]}"


def drain(p: Engine, d: Engine, model: PrefillModel) -> None:
    run_until([p, d], lambda: not p.busy() and not d.busy(), "both engines idle", kv_producer=model)
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


def step_for(engines: list[Engine], seconds: float, model: PrefillModel) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for engine in engines:
            engine.step(model if engine.spec.role == "kv_producer" else None)
        time.sleep(0.002)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_receive_keeps_blocks_until_no_write_can_land(
    engines: Any, llama_dir: str, policy: str
) -> None:
    """D's registration times out while P's WRITE is still in flight (held 4 s): kvpush reports the
    failure at once but quarantines the blocks; vLLM must not get the request back (and free or
    recompute into its blocks) before kvpush released them, and nothing may land after that."""
    slow = {
        "transport": "faulty",
        "transport_options": {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 4.0},
    }
    p = engines(llama_dir, "kv_producer", extra=slow)
    d = engines(
        llama_dir, "kv_consumer", extra={**FAULTY_NONE, "push_registration_timeout": 1.5}, policy=policy
    )
    model = PrefillModel()
    tokens = prompt(61, 64)
    p_id, d_id = dispatch(p, d, "cmpl-qfail-0", tokens)
    d.step()  # D allocates and registers
    blocks = d.block_ids(d_id)[0]
    assert blocks, "D allocated no blocks"
    run_until([p, d], lambda: d_id in d.finished_recving, "D to report the failure", kv_producer=model)
    assert d_id in d.failed_recving
    for worker in d.workers:  # vLLM may hand these blocks out now: mark them
        worker.call("fill", block_ids=blocks, value=SENTINEL)
    step_for([p, d], 5.0, model)  # longer than P's WRITE delay: a late WRITE would show
    for worker in d.workers:
        assert worker.call("holds", block_ids=blocks, value=SENTINEL), (
            "P's WRITE landed in blocks vLLM had been given back"
        )
    drain(p, d, model)
    assert p_id in p.finished_sending
    assert d.finish_reason(d_id) == ("error" if policy == "fail" else "length")


@pytest.mark.parametrize("length", [48, 40])
def test_p_decoding_past_the_prompt_pushes_the_prompt_blocks(
    engines: Any, llama_dir: str, length: int
) -> None:
    """A P leg with max_tokens > 1 computes KV past the prompt (a block more when the prompt fills
    its blocks): P must push the prompt's blocks, not the last ones (end-trimmed to D's count, they
    would be shifted by a block: D would decode from another position's KV)."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(62, length)
    _, d_id = dispatch(p, d, "cmpl-long-p-0", tokens, p_max_tokens=4)
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)
    assert d_id not in d.failed_recving
    verify(d, d_id, tokens)
    drain(p, d, model)


def test_malformed_transfer_id_fails_only_its_request(engines: Any, llama_dir: str) -> None:
    """A client's kv_transfer_params with a non-string transfer_id, on P's leg and on D's: each
    request ends (D's fails, P's is not pushed) and the engines keep serving the others."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 5})
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 5})
    model = PrefillModel()
    bad_p = f"cmpl-bad-p-{suffix()}"
    p.add(make_request(bad_p, prompt(63, 40), 1, {"do_remote_decode": True, "transfer_id": 123}))
    bad_d = f"cmpl-bad-d-{suffix()}"
    d.add(make_request(bad_d, prompt(64, 40), 3, d_params(p, transfer_id=["x"])))
    good = prompt(65, 50)
    p_id, d_id = dispatch(p, d, "cmpl-good-0", good, transfer_id="xfer-good")
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)
    verify(d, d_id, good)
    drain(p, d, model)
    assert d.finish_reason(bad_d) == "error"
    assert p.finish_reason(bad_p) == "length"
    assert bad_p not in p.finished_sending  # nothing was staged for it
    assert d.finish_reason(d_id) == "length" and p_id in p.finished_sending


def test_prefix_hit_on_d_with_p_decoding_past_the_prompt(engines: Any, llama_dir: str) -> None:
    """D caches the first two blocks, P computes a block past the prompt: D's suffix gets exactly
    the prompt's tail blocks."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    first = prompt(66, 40)
    _, d_first = dispatch(p, d, "cmpl-pre-a-0", first)
    run_until([p, d], lambda: d_first in d.finished_recving, "the first request", kv_producer=model)
    drain(p, d, model)
    second = prompt(67, 64, prefix=first[: 2 * BLOCK_SIZE])
    before = d.workers[0].call("snapshot")
    _, d_second = dispatch(p, d, "cmpl-pre-b-0", second, p_max_tokens=3)
    run_until([p, d], lambda: d_second in d.finished_recving, "the second request", kv_producer=model)
    verify(d, d_second, second)
    blocks = d.block_ids(d_second)[0]
    assert d.workers[0].call("changed_blocks", before=before) == set(blocks[2:])
    drain(p, d, model)


@pytest.mark.parametrize("length", [70, 100])
def test_hybrid_prefix_hit_on_d(engines: Any, llama_dir: str, length: int) -> None:
    """A hybrid model (full + sliding-window groups) with a 4-block prefix hit on D: the sliding
    group's hit blocks out of the window are vLLM's null block; D must register (and P write) only
    real blocks, and every token D's window needs holds P's KV."""
    p = engines(llama_dir, "kv_producer", sliding_layers=(1, 3))
    d = engines(llama_dir, "kv_consumer", sliding_layers=(1, 3))
    model = PrefillModel()
    first = prompt(68, 4 * BLOCK_SIZE + 5)
    _, d_first = dispatch(p, d, "cmpl-hyb-a-0", first)
    run_until([p, d], lambda: d_first in d.finished_recving, "the first request", kv_producer=model)
    drain(p, d, model)
    second = prompt(69, length, prefix=first[: 4 * BLOCK_SIZE])
    _, d_second = dispatch(p, d, "cmpl-hyb-b-0", second)
    run_until([p, d], lambda: d_second in d.finished_recving, "the second request", kv_producer=model)
    assert d_second not in d.failed_recving
    verify(d, d_second, second)
    drain(p, d, model)


@pytest.mark.parametrize(("length", "p_max_tokens"), [(64, 20), (72, 9)])
def test_hybrid_p_decoding_past_the_prompt(
    engines: Any, llama_dir: str, length: int, p_max_tokens: int
) -> None:
    """A hybrid P leg decoding past the prompt: vLLM drops P's sliding-window blocks the *decode*
    no longer needs, and D's window at the prompt's end needs some of them. P must not push its
    null block in their place (D would decode from it): D's receive fails at once instead."""
    p = engines(llama_dir, "kv_producer", sliding_layers=(1, 3))
    d = engines(llama_dir, "kv_consumer", sliding_layers=(1, 3), extra={"push_registration_timeout": 30})
    model = PrefillModel()
    tokens = prompt(70, length)
    _, d_id = dispatch(p, d, "cmpl-hyb-long-0", tokens, p_max_tokens=p_max_tokens)
    started = time.monotonic()
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to hear of {d_id}", kv_producer=model)
    if d_id not in d.failed_recving:
        verify(d, d_id, tokens)
        raise AssertionError("P was meant to have dropped window blocks D needs")
    assert time.monotonic() - started < 20, "D learnt of it only at its registration timeout"
    drain(p, d, model)


def test_d_abort_after_its_receive_failed_still_waits_for_the_release(engines: Any, llama_dir: str) -> None:
    """D's registration times out while P's WRITE is in flight (the failure is held back), then the
    client aborts: the abort must not free the blocks before kvpush released them."""
    slow = {
        "transport": "faulty",
        "transport_options": {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 4.0},
    }
    p = engines(llama_dir, "kv_producer", extra=slow)
    d = engines(llama_dir, "kv_consumer", tp=2, extra={**FAULTY_NONE, "push_registration_timeout": 1.5})
    model = PrefillModel()
    tokens = prompt(71, 64)
    p_id, d_id = dispatch(p, d, "cmpl-qabort-0", tokens)
    d.step()
    blocks = d.block_ids(d_id)[0]
    step_for([p, d], 2.0, model)  # the registration timed out; P's WRITE is still held
    assert d_id not in d.finished_recving
    from vllm.v1.request import RequestStatus

    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    run_until([p, d], lambda: d_id in d.finished_recving, "the release", kv_producer=model)
    for worker in d.workers:
        worker.call("fill", block_ids=blocks, value=SENTINEL)
    step_for([p, d], 3.0, model)
    for worker in d.workers:
        assert worker.call("holds", block_ids=blocks, value=SENTINEL), "P wrote into freed blocks"
    drain(p, d, model)
    assert p_id in p.finished_sending


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_a_key_reused_for_another_prompt_is_not_received_as_this_prompts_kv(
    engines: Any, llama_dir: str, decode_tp: int
) -> None:
    """A router that reuses a transfer_id (or an X-Request-Id, without transfer_id) for a different
    prompt: by the key alone D's registration would pair with P's push of the other prompt and D
    would report that KV received. Each leg fingerprints its own prompt, so P refuses: both legs
    fail at once (long before D's registration timeout), nothing is written into D's blocks."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", tp=decode_tp, extra={"push_registration_timeout": 5})
    model = PrefillModel()
    p_tokens, d_tokens = prompt(72, 40), prompt(73, 40)
    p_id, d_id = f"cmpl-reuse-0-{suffix()}", f"cmpl-reuse-0-{suffix()}"
    before = [worker.call("snapshot") for worker in d.workers]
    started = time.monotonic()
    p.add(make_request(p_id, p_tokens, 1, {"do_remote_decode": True, "transfer_id": "xfer-reused"}))
    d.add(make_request(d_id, d_tokens, 3, d_params(p, transfer_id="xfer-reused")))
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to hear of {d_id}", kv_producer=model)
    received = d_id not in d.failed_recving
    problems = d.workers[0].call("verify", tokens=d_tokens, block_ids=d.block_ids(d_id)) if received else []
    assert not received, f"D took another prompt's KV as its own: {problems[:2]}"
    assert time.monotonic() - started < 5, "D learnt of it only at its registration timeout"
    for worker, snapshot in zip(d.workers, before, strict=True):
        assert worker.call("changed_blocks", before=snapshot) == set(), f"D rank {worker.rank} written"
    drain(p, d, model)
    assert p_id in p.finished_sending


def test_d_given_another_prompts_p_params_fails_before_registering(engines: Any, llama_dir: str) -> None:
    """P returns its prompt's fingerprint in kv_transfer_params; a router that forwards them to a
    D request of another prompt makes D fail that request at once (it never registers with P),
    while the request they were returned for is received as usual."""
    from kvpush.engine import prompt_fingerprint

    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 5})
    model = PrefillModel()
    tokens = prompt(74, 40)
    p_id, d_id = dispatch(p, d, "cmpl-fwd-0", tokens, transfer_id="xfer-fwd-0")
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)
    assert d_id not in d.failed_recving
    verify(d, d_id, tokens)
    returned = p.kv_transfer_params(p_id)
    assert returned is not None and returned["prompt_fingerprint"] == prompt_fingerprint(tokens)
    other = f"cmpl-fwd-1-{suffix()}"
    forwarded = {**returned, "do_remote_prefill": True, "do_remote_decode": False}
    regs_before = d.stats.get("push_regs_sent", 0)
    d.add(make_request(other, prompt(75, 40), 3, forwarded))
    run_until([p, d], lambda: other in d.finished_recving, f"D to fail {other}", kv_producer=model)
    assert other in d.failed_recving
    assert d.stats.get("push_regs_sent", 0) == regs_before
    drain(p, d, model)


@pytest.mark.parametrize(
    ("p_kwargs", "d_kwargs", "length", "d_cached"),
    [
        ({"block_size": 32, "kernel_block_size": 16}, {}, 40, 0),
        ({}, {"block_size": 32, "kernel_block_size": 16}, 40, 0),
        ({}, {"block_size": 32, "kernel_block_size": 16}, 70, 64),
    ],
    ids=["p-blocks-of-32", "d-blocks-of-32", "d-blocks-of-32-prefix-hit"],
)
def test_scheduler_blocks_of_different_sizes_pair_the_prompts_tokens(
    engines: Any,
    llama_dir: str,
    p_kwargs: dict[str, Any],
    d_kwargs: dict[str, Any],
    length: int,
    d_cached: int,
) -> None:
    """P and D schedule blocks of different sizes over kernel blocks of one size (the attention
    backends agree, the engines' block sizes do not): the last scheduler block of each covers a
    different stretch past the prompt's end, so pairing the kernel blocks each engine allocated
    from the end shifts D's KV (P's 40-token prompt in 2 blocks of 32 = kernel blocks of tokens
    0-63; D's 3 blocks of 16 hold tokens 0-47: its last three kernel blocks, tokens 16-63, are
    not D's). With a prefix hit on D the shift would be silent even when D allocated more. D
    must receive its own tokens' KV, byte for byte, or fail; never decode from shifted KV."""
    p = engines(llama_dir, "kv_producer", **p_kwargs)
    d = engines(llama_dir, "kv_consumer", **{"extra": {"push_registration_timeout": 10}, **d_kwargs})
    model = PrefillModel()
    tokens = prompt(76, length)
    if d_cached:  # D computed the shared prefix itself (a local request), so it is a cache hit
        local = f"cmpl-local-{suffix()}"
        d.add(make_request(local, tokens[:d_cached] + prompt(77, 8), 1, None))
        run_until([d], lambda: not d.busy(), "D's local request", kv_consumer=model)
    before = d.workers[0].call("snapshot")
    _, d_id = dispatch(p, d, "cmpl-bsz-0", tokens)
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to hear of {d_id}", kv_producer=model)
    assert d_id not in d.failed_recving, "the engines' block sizes differ, their kernel blocks do not"
    verify(d, d_id, tokens)
    hits = d_cached // d.spec.block_size
    assert d.workers[0].call("changed_blocks", before=before) == set(d.block_ids(d_id)[0][hits:])
    drain(p, d, model)


def test_d_params_missing_or_out_of_range_fail_at_once(engines: Any, llama_dir: str) -> None:
    """A router omits P's coordinates, or sends them with a wrong type, out of range, or naming
    another engine or another P shape: each D request fails at once (not at its registration
    timeout) with nothing written into any of D's blocks, and the engine serves the next one."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    base = d_params(p)
    missing_host = {k: v for k, v in base.items() if k != "remote_host"}
    bad = {
        "no-remote_host": missing_host,
        "no-remote_engine_id": {k: v for k, v in base.items() if k != "remote_engine_id"},
        "port-as-string": {**base, "remote_port": str(p.port)},
        "port-out-of-range": {**base, "remote_port": 70000},
        "tp_size-zero": {**base, "tp_size": 0},
        "tp_size-not-p's": {**base, "tp_size": 2},
        "pp_size-not-p's": {**base, "pp_size": 2},
        "another-engine-id": {**base, "remote_engine_id": "prefill-elsewhere"},
    }
    before = d.workers[0].call("snapshot")
    started = time.monotonic()
    ids = {}
    for i, (name, params) in enumerate(bad.items()):
        ids[name] = rid = f"cmpl-badp-{i}-{suffix()}"
        d.add(make_request(rid, prompt(80 + i, 40), 3, {**params, "transfer_id": f"xfer-badp-{i}"}))
    every = set(ids.values())
    run_until([p, d], lambda: every <= d.finished_recving, "D to fail every bad request", kv_producer=model)
    assert time.monotonic() - started < 30, "a bad request waited for its registration timeout"
    assert set(ids.values()) <= d.failed_recving
    assert d.workers[0].call("changed_blocks", before=before) == set(), "a bad request's blocks were written"
    tokens = prompt(90, 50)
    _, d_id = dispatch(p, d, "cmpl-badp-good", tokens, transfer_id="xfer-badp-good")
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)
    assert d_id not in d.failed_recving
    verify(d, d_id, tokens)
    drain(p, d, model)
    assert all(d.finish_reason(rid) == "error" for rid in ids.values())


def test_d_abort_before_its_blocks_are_allocated_never_registers(engines: Any, llama_dir: str) -> None:
    """The client aborts the D leg before D's scheduler allocated it (nothing registered): D frees
    nothing it lent, P's finished blocks wait for the lease and are released, nothing is written
    into D's cache, and a later request pairs as usual."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 3})
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    from vllm.v1.request import RequestStatus

    p_id, d_id = dispatch(p, d, "cmpl-preabort-0", prompt(91, 40), transfer_id="xfer-preabort-0")
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    assert d_id not in d.scheduler.requests, "nothing was registered: vLLM frees the request at once"
    before = d.workers[0].call("snapshot")
    run_until([p, d], lambda: p_id in p.finished_sending, "P's lease to expire", kv_producer=model)
    assert d.workers[0].call("changed_blocks", before=before) == set()
    assert d_id not in d.finished_recving
    tokens = prompt(92, 45)
    _, d_next = dispatch(p, d, "cmpl-preabort-1", tokens, transfer_id="xfer-preabort-1")
    run_until([p, d], lambda: d_next in d.finished_recving, f"D to receive {d_next}", kv_producer=model)
    verify(d, d_next, tokens)
    drain(p, d, model)


def test_d_abort_between_the_workers_done_and_the_schedulers_update(engines: Any, llama_dir: str) -> None:
    """TP2 D: the workers report the request received, and the client's abort reaches the
    scheduler before it processed that report (vLLM's engine core does so under async
    scheduling). vLLM holds the blocks for the abort, frees them on the report, and the cancel
    staged for it is dropped (the workers reported it already; a later request of that id must
    not get it): nothing is reported twice, nothing is left behind."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", tp=2)
    model = PrefillModel()
    from vllm.v1.request import RequestStatus

    tokens = prompt(93, 56)
    _, d_id = dispatch(p, d, "cmpl-late-abort-0", tokens, transfer_id="xfer-late-abort-0")
    aborted: list[bool] = []

    def abort_on_done(engine: Engine, kv: Any) -> None:
        if not aborted and d_id in (kv.finished_recving or ()):
            blocks = engine.block_ids(d_id)[0]
            assert blocks
            engine.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
            assert d_id in engine.scheduler.requests, "vLLM freed blocks a receive still held"
            aborted.append(True)

    deadline = time.monotonic() + 60
    while not aborted:
        assert time.monotonic() < deadline, f"D never received {d_id}"
        p.step(model)
        d.step(before_update=abort_on_done)
    assert d_id not in d.scheduler.requests, "the report freed the aborted request"
    assert d_id not in d.failed_recving
    step_for([p, d], 1.0, model)  # nothing more reaches the workers for it
    assert not d.connector._scheduler.receiving
    drain(p, d, model)


@pytest.mark.parametrize("cached_on", ["p", "d", "both-differently"])
def test_p_and_d_with_different_prefix_hits(engines: Any, llama_dir: str, cached_on: str) -> None:
    """P and D start the prompt from different cache hits (each engine computed a different
    prefix of it before, locally): P pushes the prompt's blocks whatever it computed itself, and
    D registers, and gets written, exactly its blocks past its own hit, each holding its own
    tokens' KV."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(94, 75)
    p_hit, d_hit = {"p": (64, 0), "d": (0, 48), "both-differently": (16, 64)}[cached_on]
    for engine, hit in ((p, p_hit), (d, d_hit)):
        if hit:  # a local request (no transfer) leaves the prefix in the engine's cache
            engine.add(make_request(f"cmpl-local-{suffix()}", tokens[:hit] + prompt(95, 7), 1, None))
            step = {engine.spec.role: model}
            run_until([engine], lambda e=engine: not e.busy(), "the local request", **step)
    before = d.workers[0].call("snapshot")
    _, d_id = dispatch(p, d, "cmpl-hits-0", tokens, transfer_id="xfer-hits-0")
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)
    assert d_id not in d.failed_recving
    verify(d, d_id, tokens)
    blocks = d.block_ids(d_id)[0]
    assert d.workers[0].call("changed_blocks", before=before) == set(blocks[d_hit // BLOCK_SIZE :])
    drain(p, d, model)


@pytest.mark.parametrize("write_delay_s", [3.0, 8.0])
def test_p_engine_shut_down_while_its_write_is_in_flight(
    engines: Any, llama_dir: str, write_delay_s: float
) -> None:
    """P's engine shuts down (its connector's shutdown, its worker processes exit) while its
    WRITE into D's blocks is held in flight. P's close waits up to close_timeout_s (5 s) for the
    WRITE to settle: held 3 s, it lands and its DONE reaches D, which receives the prompt
    byte-exact within seconds. Held 8 s, P leaves it to D: D's request fails before its
    registration timeout (D notices P's silence after 20 s of unanswered heartbeats), vLLM gets
    the blocks back only once kvpush released them, and nothing lands in them afterwards."""
    slow = {
        "transport": "faulty",
        "transport_options": {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": write_delay_s},
    }
    p = engines(llama_dir, "kv_producer", extra=slow)
    d = engines(llama_dir, "kv_consumer", extra={**FAULTY_NONE, "push_registration_timeout": 120})
    model = PrefillModel()
    tokens = prompt(97, 64)
    _, d_id = dispatch(p, d, "cmpl-p-down-0", tokens, transfer_id="xfer-p-down-0")
    d.step()
    blocks = d.block_ids(d_id)[0]
    step_for([p, d], 1.0, model)  # P finished the prefill and posted the (held) WRITE
    assert d_id not in d.finished_recving
    p.close()
    started = time.monotonic()
    while d_id not in d.finished_recving:
        assert time.monotonic() - started < 110, "D waited for its registration timeout"
        d.step()
        time.sleep(0.002)
    if write_delay_s < 5.0:  # settled within P's close: D was told DONE
        assert d_id not in d.failed_recving and time.monotonic() - started < 20
        verify(d, d_id, tokens)
    else:
        assert d_id in d.failed_recving
        for worker in d.workers:
            worker.call("fill", block_ids=blocks, value=SENTINEL)
        step_for([d], write_delay_s + 1.0, model)
        for worker in d.workers:
            assert worker.call("holds", block_ids=blocks, value=SENTINEL), "a WRITE landed after the release"
    run_until([d], lambda: not d.busy(), "D idle")
    assert_scheduler_empty(d)
    assert d.finish_reason(d_id) == ("length" if write_delay_s < 5.0 else "error")


def test_a_load_vllm_cuts_short_fails_rather_than_receive_shifted_kv(engines: Any, llama_dir: str) -> None:
    """vLLM loads fewer tokens than the connector offered (as its bounded-replay path trims a load
    to whole blocks and computes the rest itself): D's blocks then end before the prompt's last
    block while P pushes up to it, and paired from the end every block D registered would get
    P's KV of later tokens. The request must fail at once with nothing written."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 3})
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 30})
    offered = d.connector.get_num_new_matched_tokens

    def cut_short(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, is_async = offered(request, num_computed_tokens)
        return (count - BLOCK_SIZE, is_async) if count and count > BLOCK_SIZE else (count, is_async)

    d.connector.get_num_new_matched_tokens = cut_short  # type: ignore[method-assign]
    model = PrefillModel()
    before = d.workers[0].call("snapshot")
    started = time.monotonic()
    p_id, d_id = dispatch(p, d, "cmpl-cut-0", prompt(98, 40), transfer_id="xfer-cut-0")
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to hear of {d_id}", kv_producer=model)
    assert d_id in d.failed_recving, "D took KV paired from the wrong end as its own"
    assert time.monotonic() - started < 15, "D learnt of it only at its registration timeout"
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)
    assert p_id in p.finished_sending


def test_d_preemption_pressure_never_takes_the_blocks_of_a_request_being_pushed(
    engines: Any, llama_dir: str
) -> None:
    """D's pool is too small for a decoding request to grow while another request's KV is being
    pushed (WRITEs held 2 s): vLLM preempts the decoding one, never the receiving one; the
    receiving request keeps its blocks (no other request is given one of them) until kvpush
    reports it, and lands byte-exact."""
    slow = {
        "transport": "faulty",
        "transport_options": {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 2.0},
    }
    p = engines(llama_dir, "kv_producer", extra=slow)
    d = engines(llama_dir, "kv_consumer", extra=FAULTY_NONE, num_blocks=10, max_model_len=144)
    model = PrefillModel()
    first_tokens = prompt(300, 48)
    first = f"cmpl-press-0-{suffix()}"
    p.add(make_request(f"cmpl-press-0-{suffix()}", first_tokens, 1, {"do_remote_decode": True}))
    d.add(make_request(first, first_tokens, 90, d_params(p)))
    run_until([p, d], lambda: first in d.finished_recving, "D to receive the first", kv_producer=model)
    verify(d, first, first_tokens)
    tokens = prompt(301, 48)
    _, second = dispatch(p, d, "cmpl-press-1", tokens, transfer_id="xfer-press-1")
    preempted: set[str] = set()
    held: list[int] = []

    def watch(engine: Engine, out: Any) -> None:
        preempted.update(out.preempted_req_ids or ())
        request = engine.scheduler.requests.get(second)
        if request is None or second in engine.finished_recving:
            return
        from vllm.v1.request import RequestStatus

        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            blocks = engine.block_ids(second)[0]
            held[:] = held or blocks
            assert blocks == held, "the receiving request's blocks changed"
            for rid in engine.scheduler.requests:
                if rid != second:
                    other = set(engine.block_ids(rid)[0])
                    assert not other & set(held), f"{rid} was given blocks of the receiving request"

    run_until(
        [p, d],
        lambda: second in d.finished_recving,
        "D to receive the second",
        kv_producer=model,
        kv_consumer=watch,
    )
    assert held, "the second request never waited for its KV"
    assert second not in d.failed_recving and second not in preempted
    verify(d, second, tokens)
    run_until(
        [p, d],
        lambda: not p.busy() and not d.busy(),
        "both engines idle",
        kv_producer=model,
        kv_consumer=watch,
    )
    assert first in preempted, "the pool was meant to force a preemption on D"
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


@pytest.mark.parametrize("length", [48, 40])
def test_d_with_the_whole_prompt_cached_receives_only_what_vllm_recomputes(
    engines: Any, llama_dir: str, length: int
) -> None:
    """D already holds the whole prompt in its prefix cache (the same prompt again): vLLM still
    computes the prompt's last block, so D loads that block alone; P writes only it, byte-exact."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(310 + length, length)
    _, first = dispatch(p, d, "cmpl-whole-0", tokens, transfer_id=f"xfer-whole-{length}-0")
    run_until([p, d], lambda: first in d.finished_recving, "D to receive the prompt", kv_producer=model)
    drain(p, d, model)
    before = d.workers[0].call("snapshot")
    p_id, again = dispatch(p, d, "cmpl-whole-1", tokens, transfer_id=f"xfer-whole-{length}-1")
    run_until([p, d], lambda: again in d.finished_recving, "D to receive the prompt again", kv_producer=model)
    assert again not in d.failed_recving
    verify(d, again, tokens)
    blocks = d.block_ids(again)[0]
    assert d.workers[0].call("changed_blocks", before=before) <= {blocks[-1]}
    drain(p, d, model)
    assert p_id in p.finished_sending


def test_d_params_naming_p_block_ids_are_ignored_or_refused(engines: Any, llama_dir: str) -> None:
    """kv_transfer_params carrying ``remote_block_ids`` (P's blocks, a pull-mode field): more
    blocks than the prompt needs, or ids past any cache, change nothing (D registers its own
    blocks, P pushes its own); malformed ids fail the request at once, nothing written."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    cases = {
        "too-many": [list(range(1, 40))],
        "out-of-range": [[10_000, 10_001, 10_002]],
    }
    received = []
    for i, (name, ids) in enumerate(cases.items()):
        tokens = prompt(320 + i, 40)
        legs = dispatch(p, d, f"cmpl-rbi-{name}", tokens, transfer_id=f"xfer-rbi-{i}", remote_block_ids=ids)
        received.append((legs, tokens))
    before = d.workers[0].call("snapshot")
    bad = f"cmpl-rbi-bad-{suffix()}"
    d.add(
        make_request(
            bad, prompt(329, 40), 3, d_params(p, transfer_id="xfer-rbi-bad", remote_block_ids=[[-1]])
        )
    )
    started = time.monotonic()
    run_until([p, d], lambda: bad in d.finished_recving, "D to refuse the malformed ids", kv_producer=model)
    assert time.monotonic() - started < 30 and bad in d.failed_recving
    for (_, d_id), tokens in received:
        run_until(
            [p, d], lambda d_id=d_id: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model
        )
        assert d_id not in d.failed_recving
        verify(d, d_id, tokens)
    written = d.workers[0].call("changed_blocks", before=before)
    assert not written & set(d.block_ids(bad)[0]), "the refused request's blocks were written"
    drain(p, d, model)


def test_d_blocks_past_its_cache_fail_the_request_at_once(engines: Any, llama_dir: str) -> None:
    """The worker is handed block ids past its cache (a scheduler and worker that disagree on the
    pool): the request fails at once with nothing written, the engine goes on."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    tokens = prompt(330, 40)
    _, d_id = dispatch(p, d, "cmpl-range-0", tokens, transfer_id="xfer-range-0")

    def past_the_cache(engine: Engine, out: Any) -> None:
        item = out.kv_connector_metadata.recv.get(d_id)
        if item is not None:
            item.block_ids = ((d.spec.num_blocks + 5, d.spec.num_blocks + 6, d.spec.num_blocks + 7),)

    before = d.workers[0].call("snapshot")
    started = time.monotonic()
    run_until(
        [p, d],
        lambda: d_id in d.finished_recving,
        "D to fail it",
        kv_producer=model,
        kv_consumer=past_the_cache,
    )
    assert time.monotonic() - started < 30 and d_id in d.failed_recving
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)


@pytest.mark.parametrize("same_prompt", [True, False])
def test_one_transfer_id_on_two_d_requests_at_once(engines: Any, llama_dir: str, same_prompt: bool) -> None:
    """A router gives two concurrent D requests the same transfer_id (one P leg): at most one is
    paired with P's push and receives its own prompt's KV byte-exact; the other fails at once
    (not at its registration timeout), nothing written into its blocks."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    tokens = prompt(340, 40)
    other = tokens if same_prompt else prompt(341, 40)
    p_id, first = dispatch(p, d, "cmpl-twin-0", tokens, transfer_id="xfer-twin")
    second = f"cmpl-twin-1-{suffix()}"
    d.add(make_request(second, other, 3, d_params(p, transfer_id="xfer-twin")))
    before = d.workers[0].call("snapshot")
    started = time.monotonic()
    both = lambda: {first, second} <= d.finished_recving  # noqa: E731
    run_until([p, d], both, "both D requests to end", kv_producer=model)
    assert time.monotonic() - started < 30, "one waited for its registration timeout"
    assert second in d.failed_recving and first not in d.failed_recving
    verify(d, first, tokens)
    written = d.workers[0].call("changed_blocks", before=before)
    assert written <= set(d.block_ids(first)[0]), "P wrote outside the paired request's blocks"
    drain(p, d, model)
    assert p_id in p.finished_sending


def test_d_load_checks_only_the_groups_kvpush_transfers(llama_dir: str) -> None:
    """D's scheduler half with a KV-cache group vLLM excludes from transfer (a device replica,
    sized its own way): the load-end check and the staged block ids cover the transferred groups
    only, so the replica's block count neither fails the load nor reaches the workers."""
    import dataclasses

    from harness import EngineSpec, kv_cache_configs, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvpush.engines.vllm import KvpushConnector

    spec = EngineSpec(
        model_dir=llama_dir, role="kv_consumer", engine_id="D", port=5600, sliding_layers=(1, 3)
    )
    config = vllm_config(spec)
    kv_config, _ = kv_cache_configs(config, (1, 3))
    groups = list(kv_config.kv_cache_groups)
    groups[1] = dataclasses.replace(groups[1], enable_kv_transfer=False)
    kv_config = dataclasses.replace(kv_config, kv_cache_groups=groups)
    connector = KvpushConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    tokens = prompt(350, 40)  # 3 blocks of 16
    request = make_request(
        f"cmpl-replica-{suffix()}", tokens, 3, {**d_params_of("P", 5601), "transfer_id": "x"}
    )
    full = [KVCacheBlock(i) for i in (4, 5, 6)]
    replica = [KVCacheBlock(i) for i in (7, 8)]  # a replica sized its own way
    connector.update_state_after_alloc(request, KVCacheBlocks((full, replica)), len(tokens))
    item = connector.build_connector_meta(None).recv[request.request_id]
    assert item.error is None, item.error
    assert item.block_ids == ((4, 5, 6),)
    connector.shutdown()


def d_params_of(engine_id: str, port: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": port,
    }


@pytest.mark.parametrize("length", [1, BLOCK_SIZE, BLOCK_SIZE + 1])
def test_shortest_prompts_are_received_byte_exact(engines: Any, llama_dir: str, length: int) -> None:
    """A one-token prompt, a prompt of exactly one block and one token past it: D loads the whole
    prompt, P pushes its blocks, D holds P's KV byte-exact and nothing outside its blocks."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(360 + length, length)
    before = d.workers[0].call("snapshot")
    p_id, d_id = dispatch(p, d, f"cmpl-short-{length}", tokens, transfer_id=f"xfer-short-{length}")
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)
    assert d_id not in d.failed_recving
    verify(d, d_id, tokens)
    assert d.workers[0].call("changed_blocks", before=before) <= set(d.block_ids(d_id)[0])
    drain(p, d, model)
    assert p_id in p.finished_sending
