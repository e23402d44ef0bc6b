"""Adversarial probe of the vLLM adapter under vLLM 0.33's real schedulers (real NIXL): late,
repeated, missing and foreign inputs on each path of the connector's two halves.

D must never decode from KV it did not receive, and P must never write into blocks D freed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import Engine, PrefillModel, assert_scheduler_empty, make_request, prompt, run_until, suffix
from test_vllm_adversarial import FAULTY_NONE, d_params, drain, verify


def forget_reports(engine: Engine, rid: str) -> None:
    """The harness's record of ``rid`` (its duplicate-report check is per request id): a request
    id the client reuses once the first request ended is a new request."""
    for seen in engine.reported.values():
        seen.discard(rid)
    engine.finished_recving.discard(rid)
    engine.failed_recving.discard(rid)


def test_a_request_id_reused_right_after_a_failed_receive_is_not_cancelled(
    engines: Any, llama_dir: str
) -> None:
    """D fails a request at once (its kv_transfer_params lack P's host): vLLM finishes it
    FINISHED_ERROR before it frees it, and the connector stages a cancel for it as for an abort.
    The client retries at once with the same request id (vLLM without request id randomisation):
    the stale cancel must not reach the new request, which vLLM would then take as received and
    decode from blocks nobody wrote. The retry is received byte-exact (or fails); never taken."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 30})
    model = PrefillModel()
    rid = f"cmpl-retry-{suffix()}"
    broken = d_params(p)
    del broken["remote_host"]
    d.add(make_request(rid, prompt(400, 40), 3, broken))
    run_until([d], lambda: rid in d.finished_recving, "D to fail the first request")
    assert rid in d.failed_recving and rid not in d.scheduler.requests
    forget_reports(d, rid)
    tokens = prompt(401, 40)
    p_id = f"cmpl-retry-p-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "transfer_id": "xfer-retry"}))
    d.add(make_request(rid, tokens, 3, d_params(p, transfer_id="xfer-retry")))
    run_until([p, d], lambda: rid in d.finished_recving, "D to end the retry", kv_producer=model)
    if rid not in d.failed_recving:
        verify(d, rid, tokens)  # taken as received: it must hold P's KV
    drain(p, d, model)
    assert rid not in d.failed_recving, "the retry failed (a stale cancel reached it)"
    assert p_id in p.finished_sending


def test_a_cancel_reaching_a_live_request_never_passes_for_its_kv(engines: Any, llama_dir: str) -> None:
    """The workers are handed a cancel for a request vLLM did not finish (a stale cancel of an
    earlier request of that id, or any other slip between the halves): the request must reach
    vLLM failed (kv_load_failure_policy applies), never as received: its blocks hold nothing."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 5})
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 30})
    model = PrefillModel()
    tokens = prompt(402, 40)
    rid = f"cmpl-stray-cancel-{suffix()}"
    d.add(make_request(rid, tokens, 3, d_params(p, transfer_id="xfer-stray-cancel")))

    def stray_cancel(engine: Engine, out: Any) -> None:
        if rid in out.kv_connector_metadata.recv:
            out.kv_connector_metadata.cancel.append(rid)

    run_until([d], lambda: rid in d.finished_recving, "D to settle the cancel", kv_consumer=stray_cancel)
    assert rid in d.failed_recving, "vLLM took a cancelled request as received"
    p_id = f"cmpl-stray-cancel-p-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "transfer_id": "xfer-stray-cancel"}))
    drain(p, d, model)
    assert d.finish_reason(rid) == "error"


@pytest.mark.parametrize("bound_to", [123, "", ["decode-elsewhere"]], ids=["int", "empty", "list"])
def test_a_mangled_decode_engine_binding_is_not_pushed_unbound(
    engines: Any, llama_dir: str, bound_to: Any
) -> None:
    """The router meant to bind P's push to one D engine, but its decode_engine_id is not a
    non-empty string: P must not push unbound (any D that knows the key could claim the KV). The
    prefill is not pushed; D's request fails at once (P abandons the key), nothing written."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 5})
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    tokens = prompt(403, 40)
    key = f"xfer-mangled-bind-{suffix()}"
    p_id, d_id = f"cmpl-mbind-{suffix()}", f"cmpl-mbind-{suffix()}"
    before = d.workers[0].call("snapshot")
    p_params = {"do_remote_decode": True, "transfer_id": key, "decode_engine_id": bound_to}
    p.add(make_request(p_id, tokens, 1, p_params))
    d.add(make_request(d_id, tokens, 3, d_params(p, transfer_id=key)))
    started = time.monotonic()
    run_until([p, d], lambda: d_id in d.finished_recving, f"D to hear of {d_id}", kv_producer=model)
    assert d_id in d.failed_recving, "P pushed although the router's binding was unreadable"
    assert time.monotonic() - started < 30, "D learnt of it only at its registration timeout"
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)
    assert p_id not in p.finished_sending


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_receive_with_a_group_excluded_from_transfer_keeps_the_engine_up(
    engines: Any, llama_dir: str, policy: str
) -> None:
    """D's KV-cache config holds a group vLLM excludes from transfer (a replica), so the
    connector transfers one group of two. A receive that fails must reach vLLM as a failed
    request: block-level load errors (invalid_block_ids) stop vLLM's scheduler with a
    RuntimeError on any model with more than one KV-cache group. Another request is received
    byte-exact."""
    p = engines(llama_dir, "kv_producer")
    d = engines(
        llama_dir, "kv_consumer", excluded_group=True, policy=policy, extra={"push_registration_timeout": 30}
    )
    model = PrefillModel()
    assert len(d.scheduler.kv_cache_config.kv_cache_groups) == 2
    bad = f"cmpl-excl-bad-{suffix()}"
    broken = d_params(p)
    del broken["remote_host"]
    d.add(make_request(bad, prompt(404, 40), 3, broken))
    tokens = prompt(405, 40)
    p_id, d_id = f"cmpl-excl-{suffix()}", f"cmpl-excl-{suffix()}"
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "transfer_id": "xfer-excl"}))
    d.add(make_request(d_id, tokens, 3, d_params(p, transfer_id="xfer-excl")))
    run_until([p, d], lambda: {bad, d_id} <= d.finished_recving, "D to end both", kv_producer=model)
    assert bad in d.failed_recving and d_id not in d.failed_recving
    verify(d, d_id, tokens)
    drain(p, d, model)
    assert d.finish_reason(bad) == ("error" if policy == "fail" else "length")


@pytest.mark.parametrize("target", ["itself", "another-decoder"])
def test_d_params_naming_a_decode_engine_as_p_fail_at_once(engines: Any, llama_dir: str, target: str) -> None:
    """A router that gives D the coordinates of a decode engine (D itself, or another D) as P's:
    the request fails at once, nothing is written into its blocks, and the engines go on."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    other = d if target == "itself" else engines(llama_dir, "kv_consumer", engine_id="decode-other")
    model = PrefillModel()
    rid = f"cmpl-self-{suffix()}"
    params = {
        **d_params(p, transfer_id=f"xfer-self-{suffix()}"),
        "remote_engine_id": other.spec.engine_id,
        "remote_port": other.port,
        "tp_size": other.spec.tp,
        "pp_size": other.spec.pp,
    }
    before = d.workers[0].call("snapshot")
    started = time.monotonic()
    d.add(make_request(rid, prompt(406, 40), 3, params))
    engines_stepped = [d] if other is d else [d, other]
    run_until(engines_stepped, lambda: rid in d.finished_recving, f"D to fail {rid}")
    assert rid in d.failed_recving and time.monotonic() - started < 30
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)


@pytest.mark.parametrize("name", ["kv_lease_duration", "push_registration_timeout", "handshake_timeout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["NaN", "Infinity"])
def test_settings_refuse_bounds_that_never_run_out(name: str, value: float) -> None:
    """vLLM reads --kv-transfer-config with json.loads, which takes NaN and Infinity: a bound
    that never runs out (a registration D waits on for ever, a lease that never frees P's blocks)
    is refused at start-up naming the key, on both halves (the scheduler half builds no worker)."""
    import json

    from kvpush.core.errors import ConfigError
    from kvpush.engines.vllm_config import ConnectorSettings

    extra = json.loads(f'{{"{name}": {json.dumps(value)}}}')
    assert extra[name] != extra[name] or extra[name] == float("inf")  # json.loads took it
    with pytest.raises(ConfigError, match=name):
        ConnectorSettings.from_extra_config(extra)


@pytest.mark.parametrize("same_prompt", [True, False], ids=["same-prompt", "other-prompt"])
def test_one_transfer_id_given_to_two_decode_engines(engines: Any, llama_dir: str, same_prompt: bool) -> None:
    """A router gives the D legs of two dispatches, on two decode engines, one transfer_id (one P
    leg): P pushes to at most one; a D that is not written fails (at once, not at its
    registration timeout) with nothing written into its blocks, and a D that is written holds
    its own prompt's KV byte-exact."""
    p = engines(llama_dir, "kv_producer", extra={"kv_lease_duration": 10})
    d1 = engines(llama_dir, "kv_consumer", engine_id="decode-a", extra={"push_registration_timeout": 60})
    d2 = engines(llama_dir, "kv_consumer", engine_id="decode-b", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    tokens = prompt(407, 40)
    other = tokens if same_prompt else prompt(408, 40)
    key = f"xfer-two-d-{suffix()}"
    p_id = f"cmpl-two-d-{suffix()}"
    legs = {d1: (f"cmpl-two-d-{suffix()}", tokens), d2: (f"cmpl-two-d-{suffix()}", other)}
    before = {d: d.workers[0].call("snapshot") for d in legs}
    p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "transfer_id": key}))
    for d, (rid, own) in legs.items():
        d.add(make_request(rid, own, 3, d_params(p, transfer_id=key)))
    started = time.monotonic()
    received: list[Engine] = []
    checked: set[str] = set()
    while len(checked) < 2:  # each leg checked in the step vLLM hears of it (before it decodes)
        assert time.monotonic() - started < 45, "a D leg waited for its registration timeout"
        for engine in (p, d1, d2):
            engine.step(model if engine is p else None)
        for d, (rid, own) in legs.items():
            if rid in d.finished_recving and rid not in checked:
                checked.add(rid)
                changed = d.workers[0].call("changed_blocks", before=before[d])
                if rid in d.failed_recving:
                    assert changed == set(), f"{d.spec.engine_id}'s failed request was written"
                    continue
                received.append(d)
                verify(d, rid, own)
                assert changed <= set(d.block_ids(rid)[0])
    assert len(received) <= 1, "one push reached two decode engines"
    run_until([p, d1, d2], lambda: not (p.busy() or d1.busy() or d2.busy()), "all idle", kv_producer=model)
    for engine in (p, d1, d2):
        assert_scheduler_empty(engine)


def test_a_prefill_finished_by_repetition_detection_is_pushed(llama_dir: str) -> None:
    """vLLM 0.33 finishes a request FINISHED_REPETITION from check_stop, as it does at a stop
    token or max_tokens: the prompt's KV is complete, so P pushes it (abandoning it failed D's
    request, which could have decoded)."""
    from harness import EngineSpec, kv_cache_configs, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    from kvpush.engines.vllm import KvpushConnector

    config = vllm_config(EngineSpec(model_dir=llama_dir, role="kv_producer", engine_id="P", port=5600))
    kv_config, _ = kv_cache_configs(config)
    connector = KvpushConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    request = make_request("rep-1", prompt(409, 40), 8, {"do_remote_decode": True, "transfer_id": "xfer-rep"})
    request.status = RequestStatus.FINISHED_REPETITION
    delay, params = connector.request_finished_all_groups(request, ([1, 2, 3, 4],))
    assert delay and params is not None and params["transfer_id"] == "xfer-rep"
    meta = connector.build_connector_meta(None)
    assert set(meta.send) == {"rep-1"} and not meta.abandon
    assert meta.send["rep-1"].block_ids == ((1, 2, 3),)  # the prompt's blocks
    connector.shutdown()


def test_two_prefill_engines_sharing_one_engine_id(llama_dir: str) -> None:
    """Two P engines started with one engine_id (one config file deployed twice): D's request
    naming the second engine's address must not be registered with the first (which never
    pushes it: D would wait for its registration timeout and P's blocks for their lease). It is
    received byte-exact from the engine it names, or fails at once naming the conflict."""
    from conftest import free_port
    from harness import EngineSpec

    made: list[Engine] = []
    try:
        for _ in range(2):
            spec = EngineSpec(
                model_dir=llama_dir, role="kv_producer", engine_id="prefill-shared", port=free_port()
            )
            made.append(Engine(spec))
        d_spec = EngineSpec(
            model_dir=llama_dir,
            role="kv_consumer",
            engine_id=f"decode-{free_port()}",
            port=free_port(),
            extra={"push_registration_timeout": 60},
        )
        d = Engine(d_spec)
        made.append(d)
        p_a, p_b = made[0], made[1]
        model = PrefillModel()
        for p in (p_a, p_b):  # one request through each P engine, in turn
            tokens = prompt(410 + len(d.finished_recving), 40)
            key = f"xfer-shared-id-{suffix()}"
            p_id, d_id = f"cmpl-shared-{suffix()}", f"cmpl-shared-{suffix()}"
            p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "transfer_id": key}))
            d.add(make_request(d_id, tokens, 3, d_params(p, transfer_id=key)))
            started = time.monotonic()
            while d_id not in d.finished_recving:
                assert time.monotonic() - started < 30, f"D's request to {p.port} waited for its timeout"
                p.step(model)
                d.step()
            if d_id not in d.failed_recving:
                verify(d, d_id, tokens)
    finally:
        for engine in reversed(made):
            engine.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_tp2_receives_where_some_ranks_fail_and_others_land(
    engines: Any, llama_dir: str, policy: str
) -> None:
    """P TP2 -> D TP2 with half of P's WRITEs failing: a request one D rank received and the
    other failed reaches vLLM failed (once, when both ranks reported: vLLM's aggregator sees
    the failed rank's report first), never as received; one both ranks received holds P's KV
    byte-exact on each. Both engines end clean."""
    flaky = {"transport": "faulty", "transport_options": {"inner": "nixl", "fail_writes": 0.5, "seed": 7}}
    p = engines(llama_dir, "kv_producer", tp=2, extra=flaky)
    d = engines(llama_dir, "kv_consumer", tp=2, extra=FAULTY_NONE, policy=policy)
    model = PrefillModel()
    requests = []
    for i in range(10):
        tokens = prompt(420 + i, 40 + 7 * i)
        p_id, d_id = f"cmpl-half-{i}-{suffix()}", f"cmpl-half-{i}-{suffix()}"
        p.add(make_request(p_id, tokens, 1, {"do_remote_decode": True, "transfer_id": f"xfer-half-{i}"}))
        d.add(make_request(d_id, tokens, 3, d_params(p, transfer_id=f"xfer-half-{i}")))
        requests.append((d_id, tokens))
    checked: set[str] = set()
    started = time.monotonic()
    while len(checked) < len(requests):
        assert time.monotonic() - started < 60, "D requests waited for their timeout"
        p.step(model)
        d.step()
        for d_id, tokens in requests:
            if d_id in d.finished_recving and d_id not in checked:
                checked.add(d_id)
                if d_id not in d.failed_recving:
                    verify(d, d_id, tokens)
    failed = {d_id for d_id, _ in requests} & d.failed_recving
    by_rank = [d.failed_by_rank.get(rank, set()) for rank in (0, 1)]
    assert failed == by_rank[0] | by_rank[1], "a rank's failure did not reach vLLM"
    assert by_rank[0] ^ by_rank[1], "no request was received by one D rank and failed by the other"
    drain(p, d, model)
    for d_id in failed:
        assert d.finish_reason(d_id) == ("error" if policy == "fail" else "length")


def test_a_request_id_reused_after_an_abort_with_a_write_in_flight(engines: Any, llama_dir: str) -> None:
    """D aborts request X while P's WRITE into it is held (2 s); once vLLM freed X, the client
    sends X again (same request id, a new dispatch). Nothing of the first push may complete or
    land in the retry: the retry holds its own prompt's KV byte-exact, and the first request's
    blocks, handed back to vLLM, receive nothing after the release."""
    slow = {
        "transport": "faulty",
        "transport_options": {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 2.0},
    }
    p = engines(llama_dir, "kv_producer", extra=slow)
    d = engines(llama_dir, "kv_consumer", extra=FAULTY_NONE)
    model = PrefillModel()
    from vllm.v1.request import RequestStatus

    rid = f"cmpl-reuse-inflight-{suffix()}"
    first = prompt(430, 64)
    p.add(
        make_request(
            f"cmpl-ri-p0-{suffix()}", first, 1, {"do_remote_decode": True, "transfer_id": "xfer-ri-0"}
        )
    )
    d.add(make_request(rid, first, 3, d_params(p, transfer_id="xfer-ri-0")))
    run_until([p, d], lambda: d.stats.get("push_regs_sent", 0) >= 1, "D to register", kv_producer=model)
    step_for([p, d], 0.7, model)  # P finished the prefill and posted the held WRITE
    old_blocks = d.block_ids(rid)[0]
    d.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    run_until(
        [p, d], lambda: rid not in d.scheduler.requests, "vLLM to free the aborted request", kv_producer=model
    )
    forget_reports(d, rid)
    for worker in d.workers:
        worker.call("fill", block_ids=old_blocks, value=0x5A5A)
    second = prompt(431, 64)
    p_id = f"cmpl-ri-p1-{suffix()}"
    p.add(make_request(p_id, second, 1, {"do_remote_decode": True, "transfer_id": "xfer-ri-1"}))
    d.add(make_request(rid, second, 3, d_params(p, transfer_id="xfer-ri-1")))
    run_until([p, d], lambda: rid in d.finished_recving, "D to end the retry", kv_producer=model)
    assert rid not in d.failed_recving, "the retry failed"
    verify(d, rid, second)
    reused = set(old_blocks) & set(d.block_ids(rid)[0])
    for worker in d.workers:
        untouched = [b for b in old_blocks if b not in reused]
        assert worker.call("holds", block_ids=untouched, value=0x5A5A), (
            "the first push landed after the release"
        )
    drain(p, d, model)
    assert p_id in p.finished_sending


def step_for(engines_: list[Engine], seconds: float, model: PrefillModel) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for engine in engines_:
            engine.step(model if engine.spec.role == "kv_producer" else None)
        time.sleep(0.002)
