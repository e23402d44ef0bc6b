"""kvpush's vLLM connector off the happy path of vLLM 0.33's real scheduler (real NIXL between
worker processes): router fields the wire cannot carry, request ids reused after a finish,
many requests ending in one step, a P leg aborted after its prompt was computed.

D must never decode from KV P did not write for its prompt, P must never write into blocks D's
vLLM freed, nothing may wait for a timer where the cause is known, and a bad field names itself.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import Engine, PrefillModel, make_request, prompt, run_until, suffix
from test_vllm_adversarial import d_params, drain, verify


def _legs(
    p: Engine, d: Engine, base: str, tokens: list[int], *, p_max_tokens: int = 1, **extra: Any
) -> tuple[str, str]:
    """A router's two legs at once (``extra``: fields both legs' kv_transfer_params carry)."""
    p_id, d_id = f"{base}-{suffix()}", f"{base}-{suffix()}"
    p.add(make_request(p_id, tokens, p_max_tokens, {"do_remote_decode": True, **extra}))
    d.add(make_request(d_id, tokens, 3, d_params(p, **extra)))
    return p_id, d_id


def _step_until(engines: list[Engine], done: Any, what: str, within_s: float, model: PrefillModel) -> None:
    """Step until ``done()``; fail naming ``what`` past ``within_s`` (the bound the test asserts)."""
    run_until(engines, done, what, within_s, kv_producer=model)


def test_a_transfer_id_longer_than_the_wire_carries_fails_at_once_and_alone(
    engines: Any, llama_dir: str
) -> None:
    """A router forwards a client's transfer_id of 1100 chars. kvpush's wire carries keys of at
    most 1024: the request must fail at once naming the field, nothing written, and a
    well-formed request of the same D engine that waits 25 s for P's prefill (longer than D's
    20 s peer-silence window) must still be received byte-exact."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 90})
    model = PrefillModel()
    waiting = prompt(1001, 40)
    wait_p, wait_d = f"cmpl-wait-{suffix()}", f"cmpl-wait-{suffix()}"
    d.add(make_request(wait_d, waiting, 3, d_params(p, transfer_id="xfer-wait")))
    before = d.workers[0].call("snapshot")
    started = time.monotonic()
    p_id, d_id = _legs(p, d, "cmpl-long-key", prompt(1000, 40), transfer_id="xfer-" + "k" * 1100)
    _step_until([p, d], lambda: d_id in d.finished_recving, "D to fail the long key", 10, model)
    assert d_id in d.failed_recving
    assert d.workers[0].call("changed_blocks", before=before) == set()
    while time.monotonic() - started < 25:  # P's prefill of the waiting request comes late
        p.step(model)
        d.step()
    p.add(make_request(wait_p, waiting, 1, {"do_remote_decode": True, "transfer_id": "xfer-wait"}))
    _step_until([p, d], lambda: wait_d in d.finished_recving, "D to receive the waiting request", 30, model)
    assert wait_d not in d.failed_recving, "a well-formed request failed for another's bad field"
    verify(d, wait_d, waiting)
    drain(p, d, model)
    assert d.finish_reason(d_id) == "error" and p_id not in p.finished_sending


@pytest.mark.parametrize("same_prompt", [True, False], ids=["same-prompt", "other-prompt"])
def test_request_ids_reused_after_a_received_request(engines: Any, llama_dir: str, same_prompt: bool) -> None:
    """Both legs of a request finish (D received byte-exact); the client sends a request again
    with the same X-Request-Id, and vLLM keeps ids as given (no random suffix): each leg has
    the ended request's id. The second is received byte-exact too, or fails at once; it must
    not wait for D's registration timeout."""
    from test_vllm_probe import forget_reports

    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    rid = f"job-{suffix()}"
    for attempt in range(2):
        tokens = prompt(1010 if same_prompt else 1010 + attempt, 40)
        for engine in (p, d):
            forget_reports(engine, rid)
            engine.finished_sending.discard(rid)
        p.add(make_request(rid, tokens, 1, {"do_remote_decode": True}))
        d.add(make_request(rid, tokens, 3, d_params(p)))
        _step_until([p, d], lambda: rid in d.finished_recving, f"D to end attempt {attempt}", 15, model)
        if rid not in d.failed_recving:
            verify(d, rid, tokens)
        drain(p, d, model)
        assert rid not in d.failed_recving, f"attempt {attempt} failed"


def test_a_retry_under_a_reused_x_request_id_aborted_on_p_fails_d_at_once(
    engines: Any, llama_dir: str
) -> None:
    """A client sends a request again with the same X-Request-Id (no transfer_id: the legs pair
    by it) after the first was received; P aborts the retry's prefill (the client went away) as
    it arrives, before D registered. D's retry must fail at once, as it does for a first
    request aborted on P, with nothing written; not at its registration timeout."""
    from vllm.v1.request import RequestStatus

    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    base = f"job-{suffix()}"
    first = prompt(1020, 40)
    _, d_first = _legs(p, d, base, first)
    _step_until([p, d], lambda: d_first in d.finished_recving, "D to receive the first", 15, model)
    verify(d, d_first, first)
    drain(p, d, model)
    before = d.workers[0].call("snapshot")
    p_id, d_id = _legs(p, d, base, prompt(1021, 40))
    p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
    _step_until([p, d], lambda: d_id in d.finished_recving, "D to hear P aborted the retry", 15, model)
    assert d_id in d.failed_recving
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)
    assert d.finish_reason(d_id) == "error"


def test_many_prefills_finishing_in_one_step_each_land_in_their_own_blocks(
    engines: Any, llama_dir: str
) -> None:
    """Eight prefills (two sharing a prompt, under their own X-Request-Ids) finish in one P step
    and D registers their legs together: each D request holds its own prompt's KV
    byte-exact, nothing is written outside the eight requests' blocks, both engines end empty."""
    p = engines(llama_dir, "kv_producer", max_tokens_per_step=512)
    d = engines(llama_dir, "kv_consumer", max_tokens_per_step=512)
    model = PrefillModel()
    prompts = [prompt(1030 + i, 33 + 3 * i) for i in range(7)]
    prompts.append(list(prompts[0]))
    before = d.workers[0].call("snapshot")
    legs = [_legs(p, d, f"cmpl-batch-{i}", tokens) for i, tokens in enumerate(prompts)]
    p.step(model)  # one step computes every prompt: vLLM finishes all eight in its update
    assert all(p.kv_transfer_params(p_id) is not None for p_id, _ in legs), "not one P step"
    ids = {d_id for _, d_id in legs}
    _step_until([p, d], lambda: ids <= d.finished_recving, "D to receive all eight", 30, model)
    assert not ids & d.failed_recving
    blocks: set[int] = set()
    for (_, d_id), tokens in zip(legs, prompts, strict=True):
        verify(d, d_id, tokens)
        blocks |= set(d.block_ids(d_id)[0])
    assert d.workers[0].call("changed_blocks", before=before) <= blocks
    drain(p, d, model)
    assert {p_id for p_id, _ in legs} <= p.finished_sending


@pytest.mark.parametrize("when", ["in-the-step-its-prompt-ends", "while-decoding"])
def test_p_abort_after_the_prompt_was_computed(engines: Any, llama_dir: str, when: str) -> None:
    """P's prompt is computed, then its leg is aborted before vLLM finished it: between the
    workers' output and the scheduler's update of the step that computed the prompt's last
    token (an abort under async scheduling), or while the leg decodes past the prompt
    (max_tokens > 1). vLLM finishes it FINISHED_ABORTED: nothing is pushed, D fails at once
    (not at its registration timeout) with nothing written, both engines end empty."""
    from vllm.v1.request import RequestStatus

    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    tokens = prompt(1050, 40)
    before = d.workers[0].call("snapshot")
    p_id, d_id = _legs(p, d, "cmpl-p-late-abort", tokens, p_max_tokens=1 if when.startswith("in") else 8)
    aborted: list[str] = []

    def abort_once(engine: Engine, kv: Any) -> None:
        request = engine.scheduler.requests.get(p_id)
        if aborted or request is None or request.num_computed_tokens < len(tokens):
            return
        if when.startswith("in") or request.num_output_tokens >= 2:
            engine.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
            aborted.append(p_id)

    started = time.monotonic()
    while d_id not in d.finished_recving:
        assert time.monotonic() - started < 15, "D waited for its registration timeout"
        p.step(model, before_update=abort_once)
        d.step()
    assert aborted and d_id in d.failed_recving
    assert d.workers[0].call("changed_blocks", before=before) == set()
    drain(p, d, model)
    assert p_id not in p.finished_sending
    assert d.finish_reason(d_id) == "error"


def test_a_transfer_id_of_the_longest_length_the_wire_carries_is_received(
    engines: Any, llama_dir: str
) -> None:
    """A transfer_id of exactly 1024 chars (the wire's limit) pairs both legs as any other:
    D receives the prompt byte-exact, P reports the push."""
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer", extra={"push_registration_timeout": 60})
    model = PrefillModel()
    tokens = prompt(1060, 40)
    key = "xfer-" + "k" * (1024 - len("xfer-"))
    p_id, d_id = _legs(p, d, "cmpl-key-1024", tokens, transfer_id=key)
    _step_until([p, d], lambda: d_id in d.finished_recving, "D to receive it", 15, model)
    assert d_id not in d.failed_recving
    verify(d, d_id, tokens)
    drain(p, d, model)
    assert p_id in p.finished_sending
