"""kvpush's vLLM connector against vLLM 0.33's real scheduler, over real NIXL between processes."""

from __future__ import annotations

from typing import Any

from harness import Engine, PrefillModel, make_request, prompt, run_until, suffix


def dispatch(
    p: Engine, d: Engine, base: str, tokens: list[int], *, transfer_id: str | None = None, max_tokens: int = 3
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
    p.add(make_request(p_id, tokens, 1, p_params))
    d.add(make_request(d_id, tokens, max_tokens, d_params))
    return p_id, d_id


def verify(d: Engine, d_id: str, tokens: list[int]) -> None:
    blocks = d.block_ids(d_id)
    for worker in d.workers:
        problems = worker.call("verify", tokens=tokens, block_ids=blocks)
        assert not problems, f"D rank {worker.rank}: {problems[:3]}"


def drain(p: Engine, d: Engine, model: PrefillModel) -> None:
    run_until([p, d], lambda: not p.busy() and not d.busy(), "both engines idle", kv_producer=model)


def test_tp1_to_tp1_mha_byte_exact(engines: Any, llama_dir: str) -> None:
    p = engines(llama_dir, "kv_producer")
    d = engines(llama_dir, "kv_consumer")
    model = PrefillModel()
    tokens = prompt(1, 45)
    p_id, d_id = dispatch(p, d, "cmpl-1-0", tokens)
    run_until([p, d], lambda: d_id in d.finished_recving, "D to receive", kv_producer=model)
    verify(d, d_id, tokens)
    drain(p, d, model)
    assert p_id in p.finished_sending
    assert d.finish_reason(d_id) == "length"
    params = p.kv_transfer_params(p_id)
    assert params["remote_engine_id"] == p.spec.engine_id and params["remote_port"] == p.port
