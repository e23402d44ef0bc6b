"""kvpush's vLLM connector against vLLM 0.33's real schedulers, over real NIXL between processes.

Every test ends with both schedulers empty: no request, block or pending push left.
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


def dispatch(
    p: Engine,
    d: Engine,
    base: str,
    tokens: list[int],
    *,
    transfer_id: str | None = None,
    max_tokens: int = 3,
    bind: bool = False,
) -> tuple[str, str]:
    """What a router does: the same request to P and D at once, each engine adding its own suffix."""
    p_id, d_id = f"{base}-{suffix()}", f"{base}-{suffix()}"
    p_params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    d_params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": p.spec.tp,
        "pp_size": p.spec.pp,
    }
    if transfer_id is not None:
        p_params["transfer_id"] = d_params["transfer_id"] = transfer_id
    if bind:
        p_params["decode_engine_id"] = d.spec.engine_id
    p.add(make_request(p_id, tokens, 1, p_params))
    d.add(make_request(d_id, tokens, max_tokens, d_params))
    return p_id, d_id


def verify(d: Engine, d_id: str, tokens: list[int]) -> None:
    """Every D rank holds, in the blocks D's scheduler gave the request, what P computed."""
    blocks = d.block_ids(d_id)
    for worker in d.workers:
        problems = worker.call("verify", tokens=tokens, block_ids=blocks)
        assert not problems, f"D rank {worker.rank}: {problems[:3]}"


def receive(p: Engine, d: Engine, model: PrefillModel, d_id: str) -> None:
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to receive {d_id}", kv_producer=model)


def drain(p: Engine, d: Engine, model: PrefillModel) -> None:
    run_until([p, d], lambda: not p.busy() and not d.busy(), "both engines idle", kv_producer=model)
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


def test_tp1_to_tp1_mha_byte_exact(engines: Any, llama_dir: str) -> None:
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(1, 45)
    p_id, d_id = dispatch(p, d, "cmpl-1-0", tokens)
    before = {w.rank: w.call("snapshot") for w in d.workers}
    receive(p, d, model, d_id)
    verify(d, d_id, tokens)
    for worker in d.workers:  # nothing outside the request's blocks was written
        assert worker.call("changed_blocks", before=before[worker.rank]) == set(d.block_ids(d_id)[0])
    drain(p, d, model)
    assert p_id in p.finished_sending
    assert d.finish_reason(d_id) == "length"
    params = p.kv_transfer_params(p_id)
    assert params["remote_engine_id"] == p.spec.engine_id and params["remote_port"] == p.port
    assert p.stats.get("pushes", 0) >= 1  # kvpush's counters reach vLLM's stats path


def test_sequential_router_forwards_p_response_params(engines: Any, llama_dir: str) -> None:
    """A router that waits for P's response can hand its kv_transfer_params to D unchanged."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(2, 33)
    p_id, d_id = f"cmpl-seq-0-{suffix()}", f"cmpl-seq-0-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False}))
    run_until([p], lambda: p.kv_transfer_params(p_id) is not None, "P's response", kv_producer=model)
    d.add(make_request(d_id, tokens, 2, dict(p.kv_transfer_params(p_id))))
    receive(p, d, model, d_id)
    verify(d, d_id, tokens)
    drain(p, d, model)


def test_pp2_prefill_to_tp2_decode(engines: Any, llama_dir: str) -> None:
    """Each P stage pushes its own layers; each D rank gets its head of every layer."""
    p = engines(llama_dir, "kv_producer", pp=2)
    d = engines(llama_dir, "kv_consumer", tp=2)
    model = PrefillModel()
    requests = [(prompt(10 + i, 20 + 17 * i), f"cmpl-pp-{i}") for i in range(3)]
    ids = [
        dispatch(p, d, base, tokens, transfer_id=f"xfer-{i}", bind=i == 1)
        for i, (tokens, base) in enumerate(requests)
    ]
    for (tokens, _), (_, d_id) in zip(requests, ids):
        receive(p, d, model, d_id)
        verify(d, d_id, tokens)
    drain(p, d, model)
    assert {p_id for p_id, _ in ids} <= p.finished_sending


@pytest.mark.parametrize(
    ("p_kwargs", "d_kwargs"),
    [
        ({"tp": 2}, {}),
        ({"layouts": ("LBNHC",)}, {"tp": 2, "layouts": ("LBNHC",)}),
        ({"kernel_block_size": 8}, {"tp": 2, "kernel_block_size": 8}),
    ],
    ids=["tp2-to-tp1", "nhd-tp1-to-tp2", "kernel-blocks-of-8"],
)
def test_heterogeneous_tp_layouts_and_kernel_blocks(
    engines: Any, llama_dir: str, p_kwargs: dict[str, Any], d_kwargs: dict[str, Any]
) -> None:
    """P_TP > D_TP (P ranks write head slots of D's blocks), an NHD backend (head slices cut per
    token), and an attention backend splitting 16-token blocks into kernel blocks of 8."""
    p = engines(llama_dir, "kv_producer", **p_kwargs)
    d = engines(llama_dir, "kv_consumer", **d_kwargs)
    model = PrefillModel()
    requests = [(prompt(40 + i, 30 + 21 * i), f"cmpl-het-{i}") for i in range(2)]
    ids = [dispatch(p, d, base, tokens) for tokens, base in requests]
    for (tokens, _), (_, d_id) in zip(requests, ids):
        receive(p, d, model, d_id)
        verify(d, d_id, tokens)
    drain(p, d, model)


def test_mla_tp1_to_tp2_replicates_the_latent(engines: Any, deepseek_dir: str) -> None:
    p = engines(deepseek_dir, "kv_producer")
    d = engines(deepseek_dir, "kv_consumer", tp=2)
    assert p.config.model_config.use_mla
    model = PrefillModel()
    tokens = prompt(3, 50)
    _, d_id = dispatch(p, d, "cmpl-mla-0", tokens)
    receive(p, d, model, d_id)
    verify(d, d_id, tokens)  # both D ranks hold the whole latent
    drain(p, d, model)


def test_prefix_hit_on_d_registers_only_the_suffix(engines: Any, llama_dir: str) -> None:
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    first = prompt(4, 40)
    _, d_first = dispatch(p, d, "cmpl-a-0", first)
    receive(p, d, model, d_first)
    drain(p, d, model)
    second = prompt(5, 60, prefix=first[: 2 * BLOCK_SIZE])
    before = d.workers[0].call("snapshot")
    _, d_second = dispatch(p, d, "cmpl-b-0", second)
    receive(p, d, model, d_second)
    verify(d, d_second, second)
    blocks = d.block_ids(d_second)[0]
    written = d.workers[0].call("changed_blocks", before=before)
    assert written == set(blocks[2:]), "P wrote into the cached prefix (or outside the request)"
    drain(p, d, model)


def test_hma_pp2_prefill_to_tp1_decode(engines: Any, llama_dir: str) -> None:
    """A hybrid model (full + sliding-window groups, vLLM's hybrid allocator) with PP on P: each
    stage's regions pair with D's by layer name and group; sliding-window groups send their window."""
    p = engines(llama_dir, "kv_producer", pp=2, sliding_layers=(1, 3))
    d = engines(llama_dir, "kv_consumer", sliding_layers=(1, 3))
    assert len(d.scheduler.kv_cache_config.kv_cache_groups) == 2
    model = PrefillModel()
    requests = [(prompt(30 + i, 40 + 23 * i), f"cmpl-hma-{i}") for i in range(2)]
    ids = [dispatch(p, d, base, tokens) for tokens, base in requests]
    for (tokens, _), (_, d_id) in zip(requests, ids):
        receive(p, d, model, d_id)
        verify(d, d_id, tokens)
    drain(p, d, model)


def test_d_abort_while_receiving_holds_blocks_until_the_cancel_settles(engines: Any, llama_dir: str) -> None:
    """P's WRITE is in flight (held 2 s) when D aborts: vLLM keeps the blocks until kvpush says the
    cancel settled, and nothing lands in them after they are freed."""
    slow = {
        "transport": "faulty",
        "transport_options": {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 2.0},
    }
    p = engines(llama_dir, "kv_producer", extra=slow)
    d = engines(llama_dir, "kv_consumer", extra=FAULTY_NONE)
    model = PrefillModel()
    tokens = prompt(6, 64)
    p_id, d_id = dispatch(p, d, "cmpl-abort-0", tokens)
    run_until(
        [p, d], lambda: p.kv_transfer_params(p_id) is not None, "P to finish the prefill", kv_producer=model
    )
    deadline = time.monotonic() + 0.5  # PUSH_REG reaches P, P posts the (slow) WRITE
    while time.monotonic() < deadline:
        p.step(model)
        d.step()
    blocks = d.block_ids(d_id)[0]
    free_before = d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    from vllm.v1.request import RequestStatus

    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    aborted = time.monotonic()
    while d_id not in d.finished_recving:
        assert time.monotonic() - aborted < 30, "the cancel never settled"
        assert d_id in d.scheduler.requests, "vLLM freed the request before the cancel settled"
        assert d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
        p.step(model)
        d.step()
    assert d_id not in d.scheduler.requests  # freed exactly when kvpush reported it
    for worker in d.workers:
        worker.call("fill", block_ids=blocks, value=0x5A5A)
    deadline = time.monotonic() + 2.5  # longer than the WRITE delay: a late WRITE would show
    while time.monotonic() < deadline:
        p.step(model)
        d.step()
    for worker in d.workers:
        assert worker.call("holds", block_ids=blocks, value=0x5A5A), "P wrote into freed blocks"
    drain(p, d, model)
    assert p_id in p.finished_sending


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_write(engines: Any, llama_dir: str, policy: str) -> None:
    """Every WRITE of P fails: D learns at once (no watchdog) and vLLM applies its policy."""
    failing = {"transport": "faulty", "transport_options": {"inner": "nixl", "fail_writes": 1.0}}
    p = engines(llama_dir, "kv_producer", extra=failing)
    d = engines(llama_dir, "kv_consumer", extra=FAULTY_NONE, policy=policy)
    model = PrefillModel()
    p_id, d_id = dispatch(p, d, "cmpl-fail-0", prompt(7, 40))
    started = time.monotonic()
    run_until([p, d], lambda: d_id in d.finished_recving, "D to learn of the failure", kv_producer=model)
    assert time.monotonic() - started < 30  # far below the 120 s registration watchdog
    assert d_id in d.failed_recving
    drain(p, d, model)
    assert p_id in p.finished_sending  # P released its blocks
    assert d.finish_reason(d_id) == ("error" if policy == "fail" else "length")


def test_preemption_on_d_after_receiving_does_not_register_again(engines: Any, llama_dir: str) -> None:
    """Decode growth in a tiny pool preempts a received request; it resumes from its cached
    blocks without a second registration, and both requests finish."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", num_blocks=10, max_model_len=144)
    model = PrefillModel()
    preempted: set[str] = set()

    def watch(engine: Engine, out: Any) -> None:
        preempted.update(out.preempted_req_ids or ())

    requests = [(prompt(20 + i, 48), f"cmpl-pre-{i}") for i in range(2)]
    ids = [dispatch(p, d, base, tokens, max_tokens=60) for tokens, base in requests]
    for (tokens, _), (_, d_id) in zip(requests, ids):
        run_until([p, d], lambda d_id=d_id: d_id in d.finished_recving, "D to receive", kv_producer=model)
        verify(d, d_id, tokens)
    idle = lambda: not p.busy() and not d.busy()  # noqa: E731
    run_until([p, d], idle, "both engines idle", kv_producer=model, kv_consumer=watch)
    assert preempted & {d_id for _, d_id in ids}, "the pool was meant to force a preemption on D"
    assert all(d.finish_reason(d_id) == "length" for _, d_id in ids)
    assert not d.connector._scheduler.receiving  # no request registered twice
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


def test_d_abort_in_the_step_it_registers(engines: Any, llama_dir: str) -> None:
    """Registration and cancel reach the worker together: the request settles at once, and P
    releases its blocks (the cancel reaches it, or its lease expires)."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 5})
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    p_id, d_id = dispatch(p, d, "cmpl-early-0", prompt(8, 40))
    d.step()  # allocates and stages the registration
    from vllm.v1.request import RequestStatus

    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    run_until([p, d], lambda: d_id in d.finished_recving, "the cancel to settle", kv_producer=model)
    drain(p, d, model)
    assert p_id in p.finished_sending


def test_p_abort_fails_d_and_leaves_both_engines_clean(engines: Any, llama_dir: str) -> None:
    """P aborts the prefill (nothing to push): D's request fails (P answers its registration FAIL,
    or at the latest its 3 s registration timeout) and both engines end with nothing left."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 3})
    model = PrefillModel()
    p_id, d_id = dispatch(p, d, "cmpl-p-abort-0", prompt(9, 40))
    from vllm.v1.request import RequestStatus

    p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
    run_until([p, d], lambda: d_id in d.finished_recving, "D's registration timeout", kv_producer=model)
    assert d_id in d.failed_recving
    drain(p, d, model)
    assert d.finish_reason(d_id) == "error"


def test_p_abort_fails_d_at_once(engines: Any, llama_dir: str) -> None:
    """P aborts two prefills (client gone): one before D registered, one after D's registration
    reached P (P's prefill not finished). D's requests fail within seconds, far below their
    registration timeout, nothing is written into D's blocks, and vLLM on P hears of neither
    (their blocks were freed at the abort)."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 90})
    model = PrefillModel()
    from vllm.v1.request import RequestStatus

    before = d.workers[0].call("snapshot")
    early = dispatch(p, d, "cmpl-p-abort-1", prompt(14, 40), transfer_id="xfer-p-abort-1")
    p.scheduler.finish_requests(early[0], RequestStatus.FINISHED_ABORTED)
    late = dispatch(p, d, "cmpl-p-abort-2", prompt(15, 150), transfer_id="xfer-p-abort-2")
    # Only D steps: it registers both (PUSH_REG sent), P's prefill does not advance.
    run_until([d], lambda: d.stats.get("push_regs_sent", 0) >= 2, "D's two registrations")
    time.sleep(0.5)  # the PUSH_REGs reach P's rank
    p.scheduler.finish_requests(late[0], RequestStatus.FINISHED_ABORTED)
    started = time.monotonic()
    both = lambda: {early[1], late[1]} <= d.finished_recving  # noqa: E731
    run_until([p, d], both, "D to learn both prefills were aborted on P", 20.0, kv_producer=model)
    assert time.monotonic() - started < 20.0  # the registration timeout is 90 s
    assert {early[1], late[1]} <= d.failed_recving
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)
    assert not {early[0], late[0]} & p.finished_sending
    assert d.finish_reason(early[1]) == d.finish_reason(late[1]) == "error"


def test_p_abort_is_staged_for_every_rank_unless_another_request_pushes_its_key(llama_dir: str) -> None:
    """P's scheduler half: a prefill that ends without a push (aborted, or errored) is staged as
    abandoned for the workers (its key, a reason naming the request and status); one whose key
    another request of the engine is pushing is not (D may still receive that push)."""
    from harness import EngineSpec, kv_cache_configs, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from kvpush.engines.vllm import KvpushConnector

    config = vllm_config(EngineSpec(model_dir=llama_dir, role="kv_producer", engine_id="P", port=5600))
    kv_config, _ = kv_cache_configs(config)
    connector = KvpushConnector(config, KVConnectorRole.SCHEDULER, kv_config)

    def finish(rid: str, status: RequestStatus, transfer_id: str, blocks: list[int]) -> Any:
        request = make_request(rid, prompt(16, 40), 1, {"do_remote_decode": True, "transfer_id": transfer_id})
        request.status = status
        return connector.request_finished_all_groups(request, (blocks,))

    assert finish("a-1", RequestStatus.FINISHED_ABORTED, "xfer-a", []) == (False, None)
    assert finish("b-1", RequestStatus.FINISHED_ERROR, "xfer-b", [1]) == (False, None)
    assert finish("c-1", RequestStatus.FINISHED_LENGTH_CAPPED, "xfer-c", [1, 2, 3])[0]
    assert finish("c-2", RequestStatus.FINISHED_ABORTED, "xfer-c", [])[0] is False  # key in use
    assert connector.has_pending_push_work()
    meta = connector.build_connector_meta(None)
    assert set(meta.abandon) == {"a-1", "b-1"} and set(meta.send) == {"c-1"}
    key, why = meta.abandon["a-1"]
    assert key == "xfer-a" and "'a-1'" in why and "FINISHED_ABORTED" in why
    connector.update_connector_output(KVConnectorOutput(finished_sending={"c-1"}))
    assert not connector.has_pending_push_work()
    finish("c-3", RequestStatus.FINISHED_ABORTED, "xfer-c", [])  # the key is free again
    assert set(connector.build_connector_meta(None).abandon) == {"c-3"}
    connector.shutdown()


def test_many_requests_with_aborts_and_shared_prefixes(engines: Any, llama_dir: str) -> None:
    """PP2 -> TP2 under load: 12 requests, some sharing a prefix, three aborted on D at different
    points; every other request lands byte-exact, and nothing is left behind."""
    p = engines(llama_dir, "kv_producer", pp=2)
    d = engines(llama_dir, "kv_consumer", tp=2)
    model = PrefillModel()
    shared = prompt(100, 2 * BLOCK_SIZE)
    requests = []
    for i in range(12):
        tokens = prompt(200 + i, 40 + 9 * i, prefix=shared if i % 3 == 0 else None)
        requests.append((tokens, *dispatch(p, d, f"cmpl-load-{i}", tokens, transfer_id=f"xfer-load-{i}")))
    abort_at = {0: 2, 3: 5, 8: 9}  # D step -> request aborted then
    aborted = {requests[i][2] for i in abort_at.values()}
    from vllm.v1.request import RequestStatus

    landed: set[str] = set()
    for step in range(400):
        p.step(model)
        d.step()
        if step in (0, 3, 8):
            d.scheduler.finish_requests(
                requests[(2, 5, 9)[(0, 3, 8).index(step)]][2], RequestStatus.FINISHED_ABORTED
            )
        for tokens, _, d_id in requests:
            if d_id in d.finished_recving and d_id not in landed and d_id not in aborted:
                verify(d, d_id, tokens)
                landed.add(d_id)
        if len(landed) + len(aborted & d.finished_recving) == len(requests):
            break
    assert landed == {d_id for _, _, d_id in requests} - aborted
    drain(p, d, model)


def test_a_transfer_id_reused_by_the_router_does_not_stop_the_engines(engines: Any, llama_dir: str) -> None:
    """Two requests (two prompts) given the same transfer_id: kvpush refuses the second push (its
    blocks are released) and, by the prompt fingerprints, never pairs the first push with the
    second prompt's D request; the engines keep stepping and every request ends. A D request
    received holds its own prompt's KV; the other fails (at once, or at its timeout)."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 5})
    model = PrefillModel()
    tokens = {"cmpl-dup-0": prompt(11, 40), "cmpl-dup-1": prompt(12, 40)}
    first = dispatch(p, d, "cmpl-dup-0", tokens["cmpl-dup-0"], transfer_id="xfer-dup")
    second = dispatch(p, d, "cmpl-dup-1", tokens["cmpl-dup-1"], transfer_id="xfer-dup")
    pairs = [(first[1], tokens["cmpl-dup-0"]), (second[1], tokens["cmpl-dup-1"])]
    run_until(
        [p, d],
        lambda: all(d_id in d.finished_recving for d_id, _ in pairs),
        "both D requests to end",
        kv_producer=model,
    )
    for d_id, own in pairs:
        if d_id not in d.failed_recving:
            verify(d, d_id, own)  # received: its own prompt's KV, never the other's
    drain(p, d, model)
    assert {first[0], second[0]} <= p.finished_sending
    reasons = sorted(str(d.finish_reason(d_id)) for _, d_id in (first, second))
    assert "error" in reasons  # at most one D request can be paired with the one push


def test_p_bound_to_another_decode_engine_refuses_this_one(engines: Any, llama_dir: str) -> None:
    """The router bound P's push to another D engine: this D's registration is refused, its request
    fails, nothing is written into its blocks, and P releases its blocks."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 5})
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 10})
    model = PrefillModel()
    tokens = prompt(13, 40)
    p_id, d_id = f"cmpl-bound-0-{suffix()}", f"cmpl-bound-0-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "decode_engine_id": "decode-elsewhere"}))
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": p.spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
    }
    d.add(make_request(d_id, tokens, 2, params))
    before = d.workers[0].call("snapshot")
    run_until([p, d], lambda: d_id in d.finished_recving, "D's request to fail", kv_producer=model)
    assert d_id in d.failed_recving
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)
    assert p_id in p.finished_sending
