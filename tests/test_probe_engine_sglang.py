"""Probe: a new engine integrated from docs/engine-api.md alone, modelled on SGLang.

The engine keeps per-layer *separate* K and V pools, ``k_buffer[layer]`` and ``v_buffer[layer]``,
each ``[slots, local_heads, head_dim]`` (flat token slots; ``page_size`` consecutive slots form
one page, page 0 the padding page), or one latent pool per layer for MLA
(``kv_buffer[layer]``, ``[slots, 1, latent_dim]``). A request's KV sits in the pages the engine
allocated for it; kvpush's block ids are page ids (token slots when ``page_size`` is 1).

Each test runs real pushes through ``kvpush.engine`` only and checks EVERY byte of every D
tensor: the registered pages hold P's bytes of the right tokens and heads, everything else
keeps its noise. Or a refusal is loud: an error naming what was wrong and what to do.

In-process ranks talk over real NIXL agents (``transport="nixl"``); the pure-logic cases use
loopback. ``test_sglang_engine_in_processes_over_nixl`` runs every rank in its own process.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import kvpush.transports.loopback
from kvpush.engine import (
    ConfigError,
    ModelSpec,
    ParallelConfig,
    PushReceiver,
    PushSender,
    RankKey,
    SideChannelServer,
    WorkerConfig,
    get_plugin_manager,
)
from kvpush.plugins.strategy import ForcedStrategy

HEADS, DIM = 4, 8


def gqa(page: int, layers: int = 3) -> ModelSpec:
    return ModelSpec(
        name="sglang-gqa",
        num_layers=layers,
        num_kv_heads=HEADS,
        head_dim=DIM,
        block_size=page,
        dtype="bfloat16",
    )


def mla(page: int, layers: int = 3) -> ModelSpec:
    return ModelSpec(
        name="sglang-mla", num_layers=layers, attention="mla", head_dim=24, block_size=page, dtype="bfloat16"
    )


# --------------------------------------------------------------------------- the engine's pools


class Pools:
    """One rank's KV pools, SGLang style: per layer a K and a V buffer (or one latent buffer)
    of ``[(pages + 1) * page, heads, dim]`` token slots (page 0 is the padding page)."""

    def __init__(
        self, model: ModelSpec, parallel: ParallelConfig, pages: int, store: torch.dtype = torch.bfloat16
    ) -> None:
        """``store``: the buffers' dtype (SGLang keeps an fp8 cache in uint8 buffers)."""
        self.model, self.parallel, self.pages, self.store = model, parallel, pages, store
        self.page = model.block_size
        slots = (pages + 1) * self.page
        layers = range(parallel.start_layer, parallel.end_layer)
        if model.attention == "mla":
            self.heads = 1
            self.buffers = {
                f"model.layers.{i}": [torch.empty(slots, 1, model.head_dim, dtype=store)] for i in layers
            }
        else:
            self.heads = model.num_kv_heads // parallel.tp_size
            self.buffers = {
                f"model.layers.{i}": [
                    torch.empty(slots, self.heads, model.head_dim, dtype=store) for _ in "kv"
                ]
                for i in layers
            }
        gen = torch.Generator().manual_seed(hash((parallel.pp_rank, parallel.tp_rank, pages)) & 0xFFFF)
        for pair in self.buffers.values():
            for buf in pair:
                view = bits(buf)
                info = torch.iinfo(view.dtype)
                view.copy_(torch.randint(info.min, info.max, buf.shape, generator=gen, dtype=view.dtype))

    def kv_caches(self) -> tuple[str, dict[str, torch.Tensor]]:
        """What the engine hands kvpush, per the docs: the layout name and its tensors."""
        if self.model.attention == "mla":  # uniform MLA: (num_blocks, block_size, latent)
            return "uniform", {
                name: pair[0].view(-1, self.page, self.model.head_dim) for name, pair in self.buffers.items()
            }
        caches = {}  # token_major: '<layer>.k'/'<layer>.v' of (num_blocks, block_size, heads, dim)
        for name, (k, v) in self.buffers.items():
            caches[f"{name}.k"] = k.view(-1, self.page, self.heads, self.model.head_dim)
            caches[f"{name}.v"] = v.view(-1, self.page, self.heads, self.model.head_dim)
        return "token_major", caches

    def snapshot(self) -> dict[str, list[torch.Tensor]]:
        return {name: [bits(b).clone() for b in pair] for name, pair in self.buffers.items()}


def bits(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer's raw bits as integers of its element size (comparisons without NaNs)."""
    return buffer.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[buffer.element_size()])


def value(layer: int, comp: int, token: int, head: int, dim: torch.Tensor) -> torch.Tensor:
    """The bit pattern of one logical KV element of the request (distinct per coordinate; int16,
    cut to the buffer's element size when stored)."""
    return ((layer * 7919 + comp * 104729 + token * 613 + head * 31 + dim * 3 + 17) % 65521 - 32760).to(
        torch.int16
    )


def layer_of(name: str) -> int:
    return int(name.rsplit(".", 1)[1])


def prefill(pools: Pools, pages: Sequence[int], tokens: int, first_token: int = 0) -> None:
    """The engine's prefill: write the KV of prompt tokens ``first_token..tokens-1`` into the
    slots of ``pages`` (token t in slot ``pages[t // page] * page + t % page``)."""
    dim = torch.arange(pools.model.head_dim)
    for name, pair in pools.buffers.items():
        for comp, buf in enumerate(pair):
            view = bits(buf)
            for t in range(first_token, tokens):
                slot = pages[t // pools.page] * pools.page + t % pools.page
                for h in range(pools.heads):
                    head = pools.parallel.tp_rank * pools.heads + h if pools.model.attention == "mha" else 0
                    view[slot, h] = value(layer_of(name), comp, t, head, dim)


def expected(
    before: dict[str, list[torch.Tensor]],
    pools: Pools,
    p_pools: Pools,
    p_pages: Sequence[int],
    d_pages: Sequence[int],
) -> dict[str, list[torch.Tensor]]:
    """D's buffers after a push: D's page ``d_pages[-i]`` holds P's whole page ``p_pages[-i]``
    (P trims a prefix hit from the front; a partly used last page moves whole, its unused slots
    included) in D's heads; every other slot its bytes of ``before``."""
    want = {name: [b.clone() for b in pair] for name, pair in before.items()}
    page = pools.page
    p_heads = p_pools.heads
    for name, pair in want.items():
        if name not in p_pools.buffers:
            continue  # another PP stage's layer
        for comp, view in enumerate(pair):
            source = bits(p_pools.buffers[name][comp])
            for i in range(1, len(d_pages) + 1):
                d, p = d_pages[-i], p_pages[-i]
                for h in range(pools.heads):
                    head = (
                        pools.parallel.tp_rank * pools.heads + h
                        if pools.heads > 1 or pools.model.attention == "mha"
                        else 0
                    )
                    if p_pools.model.attention == "mha" and head // p_heads != p_pools.parallel.tp_rank:
                        continue  # another P rank's head
                    ph = head % p_heads if p_pools.model.attention == "mha" else 0
                    view[d * page : (d + 1) * page, h] = source[p * page : (p + 1) * page, ph]
    return want


def logical(
    pools: Pools, d_pages: Sequence[int], tokens: int, cached: int, before: dict[str, list[torch.Tensor]]
) -> dict[str, list[torch.Tensor]]:
    """What the prompt's tokens ``cached..tokens-1`` must read on D (the slots the engine will
    attend to), from the values themselves: ``before`` with those slots replaced. Slots past the
    prompt in D's last page are left as they are in ``pools`` (P's unused tail may land there)."""
    want = {name: [b.clone() for b in pair] for name, pair in before.items()}
    dim = torch.arange(pools.model.head_dim)
    page = pools.page
    first = cached // page * page
    for name, pair in want.items():
        for comp, view in enumerate(pair):
            for t in range(first, tokens):
                slot = d_pages[(t - first) // page] * page + t % page
                for h in range(pools.heads):
                    head = pools.parallel.tp_rank * pools.heads + h if pools.model.attention == "mha" else 0
                    view[slot, h] = value(layer_of(name), comp, t, head, dim)
            last = d_pages[-1] * page
            tail = slice(last + (tokens - 1) % page + 1, last + page)
            view[tail] = bits(pools.buffers[name][comp])[tail]
    return want


def mismatches(pools: Pools, *wants: dict[str, list[torch.Tensor]]) -> list[str]:
    """Every slot of every D buffer holding an element that differs from that element in each
    of ``wants`` (empty: byte-exact; with several ``wants``, each element from one of them)."""
    out = []
    for name, pair in pools.buffers.items():
        for comp, buf in enumerate(pair):
            got = bits(buf)
            differs = torch.stack([got != want[name][comp] for want in wants]).all(0)
            bad = differs.flatten(1).any(1).nonzero().flatten().tolist()
            if bad:
                out.append(f"{name} {'kv'[comp] if len(pair) == 2 else 'latent'} slots {bad[:12]}")
    return out


# --------------------------------------------------------------------------- the two engines


class Engines:
    """A P engine (pp x tp ranks) and a D engine (tp ranks) in this process, each rank a worker
    of ``kvpush.engine``, one side channel per engine (docs/engine-api.md)."""

    def __init__(
        self,
        p_model: ModelSpec,
        d_model: ModelSpec | None = None,
        *,
        p_tp: int = 1,
        p_pp: int = 1,
        d_tp: int = 1,
        p_pages: int = 24,
        d_pages: int = 24,
        transport: str = "nixl",
        strategy: str | None = None,
        store: torch.dtype = torch.bfloat16,
        **config: Any,
    ) -> None:
        d_model = d_model or p_model
        self.pm = get_plugin_manager(
            load_entrypoints=False,
            plugins=[("loopback", kvpush.transports.loopback), ("forced", ForcedStrategy(strategy))],
        )
        self.p_server, self.d_server = SideChannelServer("sgl-prefill"), SideChannelServer("sgl-decode")
        self.p_tp, self.p_pp = p_tp, p_pp
        self.senders: dict[RankKey, PushSender] = {}
        self.receivers: dict[int, PushReceiver] = {}
        self.p_pools: dict[RankKey, Pools] = {}
        self.d_pools: dict[int, Pools] = {}
        self.done: dict[int, dict[str, str | None]] = {}
        self.released: dict[int, set[str]] = {}
        self.sent: dict[RankKey, dict[str, str | None]] = {}
        try:
            for pp in range(p_pp):
                for tp in range(p_tp):
                    par = ParallelConfig.for_stage(
                        num_layers=p_model.num_layers, pp_size=p_pp, pp_rank=pp, tp_size=p_tp, tp_rank=tp
                    )
                    pools = Pools(p_model, par, p_pages, store)
                    layout, caches = pools.kv_caches()
                    cfg = WorkerConfig(
                        engine_id="sgl-prefill",
                        parallel=par,
                        model=p_model,
                        layout=layout,
                        transport=transport,
                        side_channel_port=self.p_server.port,
                        **config,
                    )
                    sender = PushSender(cfg, caches, pm=self.pm)
                    self.senders[par.rank] = sender
                    sender.start()
                    self.p_server.publish(par.rank, sender.handshake_payload())
                    self.p_pools[par.rank], self.sent[par.rank] = pools, {}
            for tp in range(d_tp):
                par = ParallelConfig(tp_size=d_tp, tp_rank=tp, num_layers=d_model.num_layers)
                pools = Pools(d_model, par, d_pages, store)
                layout, caches = pools.kv_caches()
                cfg = WorkerConfig(
                    engine_id="sgl-decode",
                    parallel=par,
                    model=d_model,
                    layout=layout,
                    transport=transport,
                    side_channel_port=self.d_server.port,
                    **config,
                )
                receiver = PushReceiver(cfg, caches, pm=self.pm)
                self.receivers[tp] = receiver
                receiver.start()
                self.d_server.publish(par.rank, receiver.handshake_payload())
                self.d_pools[tp], self.done[tp], self.released[tp] = pools, {}, set()
        except BaseException:
            self.close()
            raise

    def params(self, key: str) -> dict[str, Any]:
        return {
            "remote_engine_id": "sgl-prefill",
            "remote_host": "127.0.0.1",
            "remote_port": self.p_server.port,
            "tp_size": self.p_tp,
            "pp_size": self.p_pp,
            "transfer_id": key,
        }

    def add(self, rid: str, pages: Any, key: str, **kwargs: Any) -> None:
        """Register D's pages on every D rank; ``kwargs``: ``block_start``, ``num_tokens``."""
        for receiver in self.receivers.values():
            receiver.add_request_params(rid, pages, self.params(key), **kwargs)

    def finish(self, rid: str, pages: Any, key: str, **kwargs: Any) -> None:
        for sender in self.senders.values():
            sender.request_finished(rid, pages, match_key=key, **kwargs)

    def poll(self) -> None:
        for tp, receiver in self.receivers.items():
            got = receiver.get_finished()
            self.done[tp].update({rid: None for rid in got.done})
            self.done[tp].update(got.failed)
            self.done[tp].update({rid: "cancelled" for rid in got.cancelled})
            self.released[tp].update(got.released)
        for rank, sender in self.senders.items():
            got = sender.get_finished()
            self.sent[rank].update({rid: None for rid in got.sent})
            self.sent[rank].update(got.failed)

    def wait(
        self, rid: str = "d-1", prid: str = "p-1", timeout_s: float = 30.0
    ) -> tuple[dict[int, str | None], dict[RankKey, str | None]]:
        """Each D rank's outcome of ``rid`` and each P rank's of ``prid`` (None: done / sent,
        else the reason)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if all(rid in d for d in self.done.values()) and all(prid in p for p in self.sent.values()):
                return (
                    {tp: d[rid] for tp, d in self.done.items()},
                    {r: p[prid] for r, p in self.sent.items()},
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{rid}/{prid}: no outcome within {timeout_s}s: D {self.done} P {self.sent}"
                )
            time.sleep(0.005)

    def prefill(self, pages: Sequence[int], tokens: int) -> None:
        for pools in self.p_pools.values():
            prefill(pools, pages, tokens)

    def close(self) -> None:
        for worker in [*self.senders.values(), *self.receivers.values()]:
            with contextlib.suppress(Exception):  # a worker that never started
                worker.close()
        self.p_server.close()
        self.d_server.close()

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def push_and_check(
    engines: Engines, p_pages: list[int], d_pages: list[int], tokens: int, cached: int = 0
) -> None:
    """Prefill ``tokens`` tokens into P's pages, register D's pages (its uncached suffix from
    token ``cached``), push, and check every byte of every D buffer."""
    engines.prefill(p_pages, tokens)
    before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
    page = engines.d_pools[0].page
    engines.add("d-1", d_pages, "x-1", block_start=cached // page, num_tokens=tokens)
    engines.finish("p-1", p_pages, "x-1")
    d, p = engines.wait()
    assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
    for tp, pools in engines.d_pools.items():
        if pools.model.attention == "mla":
            # The k P ranks of a fan-in all write the whole latent (plugins/mla_replication.py):
            # the prompt's slots are the same on each (checked exactly by `logical` below), but
            # the unused slots of a partly used last page hold each P rank's own noise, and two
            # WRITEs landing together leave them mixed, element by element (seen once in CI).
            wants = [
                expected(before[tp], pools, p_pools, p_pages, d_pages) for p_pools in engines.p_pools.values()
            ]
        else:  # each P rank writes its own heads
            wants = [before[tp]]
            for p_pools in engines.p_pools.values():
                wants = [expected(wants[0], pools, p_pools, p_pages, d_pages)]
        assert mismatches(pools, *wants) == [], f"D rank {tp}"
        assert mismatches(pools, logical(pools, d_pages, tokens, cached, before[tp])) == [], (
            f"D rank {tp} (tokens)"
        )


# --------------------------------------------------------------------------- integration


@pytest.mark.parametrize("strategy", ["direct", "packed"])
@pytest.mark.parametrize(
    ("page", "p_pp", "p_tp", "d_tp"),
    [(1, 1, 1, 1), (1, 1, 1, 2), (1, 2, 2, 1), (64, 1, 1, 2), (64, 1, 2, 1), (16, 2, 2, 4)],
    ids=str,
)
def test_sglang_gqa_pools_push_every_byte(page: int, p_pp: int, p_tp: int, d_tp: int, strategy: str) -> None:
    tokens = 150 if page > 1 else 37
    n = -(-tokens // page)
    p_pages = [3 + 2 * i for i in range(n)][::-1]
    d_pages = [1 + 3 * i for i in range(n)]
    with Engines(
        gqa(page), p_pp=p_pp, p_tp=p_tp, d_tp=d_tp, p_pages=2 * n + 3, d_pages=3 * n + 1, strategy=strategy
    ) as engines:
        push_and_check(engines, p_pages, d_pages, tokens)


@pytest.mark.parametrize("strategy", ["direct", "packed"])
@pytest.mark.parametrize(("page", "p_tp", "d_tp"), [(1, 1, 2), (64, 2, 1), (64, 1, 2), (1, 2, 4)], ids=str)
def test_sglang_mla_latent_pool_pushes_every_byte(page: int, p_tp: int, d_tp: int, strategy: str) -> None:
    tokens = 150 if page > 1 else 29
    n = -(-tokens // page)
    p_pages = [2 + 2 * i for i in range(n)]
    d_pages = [1 + 3 * i for i in range(n)][::-1]
    with Engines(
        mla(page), p_tp=p_tp, d_tp=d_tp, p_pages=2 * n + 2, d_pages=3 * n + 1, strategy=strategy
    ) as engines:
        push_and_check(engines, p_pages, d_pages, tokens)


@pytest.mark.parametrize(("page", "cached"), [(1, 23), (64, 64), (64, 128), (16, 100)], ids=str)
def test_a_decode_prefix_hit_registers_the_uncached_pages(page: int, cached: int) -> None:
    """D holds the prompt's first ``cached`` tokens (a page-aligned hit for page > 1: SGLang's
    radix cache matches whole pages; 100 on 16-token pages is 6 whole pages) and registers the
    pages from the first uncached token on; P passes all of its prompt's pages."""
    tokens = 150
    n = -(-tokens // page)
    hit = cached // page
    p_pages = [1 + i for i in range(n)]
    d_pages = [2 + 2 * i for i in range(n - hit)]
    with Engines(gqa(page), d_tp=2, p_pages=n + 1, d_pages=2 * n + 2) as engines:
        push_and_check(engines, p_pages, d_pages, tokens, cached=cached)


# --------------------------------------------------------------------------- adversarial


def outcome_or_bytes(
    engines: Engines, p_pages: list[int], d_pages: list[int], tokens: int, cached: int = 0
) -> list[str]:
    """Push; return [] when every D byte is right (or the push failed on both sides with nothing
    written), else what is wrong. D reporting done with wrong bytes is the silent case."""
    engines.prefill(p_pages[: -(-tokens // engines.p_pools[RankKey(0, 0)].page)], tokens)
    before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
    engines.add("d-1", d_pages, "x-1")
    engines.finish("p-1", p_pages, "x-1")
    d, _ = engines.wait()
    problems = []
    for tp, pools in engines.d_pools.items():
        if d[tp] is None:
            wrong = mismatches(pools, logical(pools, d_pages, tokens, cached, before[tp]))
            problems += [f"D rank {tp} reported done, but {w}" for w in wrong]
        else:
            problems += [
                f"D rank {tp} failed but its blocks changed: {w}" for w in mismatches(pools, before[tp])
            ]
    return problems


class Flag:
    """A CPU engine's ``ready``: ``query()`` is True once the engine wrote the KV."""

    def __init__(self) -> None:
        self.set = False
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.set


def test_cpu_kv_written_after_request_finished_is_pushed_once_ready() -> None:
    """D's registration is at P first, the engine calls request_finished before its KV is
    written (ready=a flag) and writes it afterwards: D gets the final bytes."""
    tokens, p_pages, d_pages = 40, [5, 2, 7], [1, 6, 3]
    with Engines(gqa(16), d_tp=2, p_pages=8, d_pages=8) as engines:
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", d_pages, "x-1")
        deadline = time.monotonic() + 10
        while not all(r.stats.get("push_regs_sent", 0) for r in engines.receivers.values()):
            assert time.monotonic() < deadline, "D never registered"
            time.sleep(0.005)
        flag = Flag()
        engines.finish("p-1", p_pages, "x-1", ready=flag)
        while flag.asked < 3:  # the writer thread is polling it: it would post now
            assert time.monotonic() < deadline, "ready never asked"
            time.sleep(0.005)
        engines.prefill(p_pages, tokens)
        flag.set = True
        d, p = engines.wait()
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
        for tp, pools in engines.d_pools.items():
            assert mismatches(pools, logical(pools, d_pages, tokens, 0, before[tp])) == []


def as_numpy(ids: list[int]) -> Any:
    import numpy as np

    return np.array(ids, dtype=np.int64)


def as_numpy_int32_groups(ids: list[int]) -> Any:
    import numpy as np

    return np.array([ids], dtype=np.int32)


def as_tensor(ids: list[int]) -> Any:
    return torch.tensor(ids, dtype=torch.int64)


def as_tensor_groups(ids: list[int]) -> Any:
    return torch.tensor([ids], dtype=torch.int32)


def as_numpy_scalars(ids: list[int]) -> Any:
    import numpy as np

    return [np.int64(i) for i in ids]


def as_generator(ids: list[int]) -> Any:
    return (i for i in ids)


def as_group_generators(ids: list[int]) -> Any:
    return ((i for i in ids) for _ in range(1))


FORMS = [
    as_numpy,
    as_numpy_int32_groups,
    as_tensor,
    as_tensor_groups,
    as_numpy_scalars,
    as_generator,
    as_group_generators,
]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_block_ids_as_arrays_tensors_and_generators_move_the_right_bytes_or_are_refused(form: Any) -> None:
    """An engine's block tables are often numpy arrays or torch tensors (SGLang's
    req_to_token is one): each form either pushes the right pages or raises ConfigError
    naming the ids, never another error or a wrong byte."""
    tokens, p_pages, d_pages = 40, [5, 2, 7], [1, 6, 3]
    with Engines(gqa(16), p_pages=8, d_pages=8, transport="loopback") as engines:
        engines.prefill(p_pages, tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        try:
            engines.add("d-1", form(d_pages), "x-1")
            engines.finish("p-1", form(p_pages), "x-1")
        except ConfigError as err:
            assert "block id" in str(err)
            return
        d, p = engines.wait()
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
        for tp, pools in engines.d_pools.items():
            assert mismatches(pools, logical(pools, d_pages, tokens, 0, before[tp])) == []


@pytest.mark.parametrize("page", [1, 16])
def test_prefill_passing_a_page_beyond_the_prompt_moves_the_right_bytes_or_fails(page: int) -> None:
    """P's engine passes its request's page table after the prefill, which holds one page more
    than the prompt (a page allocated ahead for the first decode token, or a speculative
    lookahead); D registers the prompt's pages, stating no start. P paired its pages with D's
    from the end, writing page i+1 into D's page i, and D reported done. Now P refuses to guess
    (unequal counts, no stated start): both legs fail and nothing is written."""
    tokens = 40
    n = -(-tokens // page)
    p_pages, d_pages = [1 + i for i in range(n + 1)], [2 + i for i in range(n)]
    with Engines(gqa(page), transport="loopback", p_pages=n + 2, d_pages=n + 2) as engines:
        assert outcome_or_bytes(engines, p_pages, d_pages, tokens) == []


@pytest.mark.parametrize("page", [1, 16])
def test_decode_registering_a_page_short_of_its_suffix_moves_the_right_bytes_or_fails(page: int) -> None:
    """D has no prefix hit but registers one page fewer than the prompt holds (it counted
    ``tokens // page`` pages, dropping the partly filled last one; with page 1, the last token
    left for decode to compute). P took that for a prefix hit and wrote its pages 1.. into
    D's pages for tokens 0.., and D reported done. Now P refuses to guess: both legs fail."""
    tokens = 40 if page == 1 else 44
    n = -(-tokens // page)
    p_pages, d_pages = [1 + i for i in range(n)], [2 + i for i in range(n - 1)]
    with Engines(gqa(page), transport="loopback", p_pages=n + 2, d_pages=n + 2) as engines:
        assert outcome_or_bytes(engines, p_pages, d_pages, (n - 1) * page) == []


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("cached", [0, 1])
def test_decode_stating_its_start_gets_the_right_pages_from_a_table_a_page_longer(
    page: int, cached: int
) -> None:
    """The fix: D states where its pages start (``block_start``: the pages of its prefix hit,
    ``cached``) and the prompt's length; P's table holds a page past the prompt. P pairs D's
    pages by index, its extra page moves nowhere, every byte is right."""
    tokens = 40
    n = -(-tokens // page)
    p_pages, d_pages = [1 + i for i in range(n + 1)], [2 + i for i in range(n - cached)]
    with Engines(gqa(page), transport="loopback", p_pages=n + 2, d_pages=n + 2) as engines:
        engines.prefill(p_pages[:n], tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", d_pages, "x-1", block_start=cached, num_tokens=tokens)
        engines.finish("p-1", p_pages, "x-1")
        d, p = engines.wait()
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
        for tp, pools in engines.d_pools.items():
            assert mismatches(pools, logical(pools, d_pages, tokens, cached * page, before[tp])) == []


def test_prefill_stating_where_its_pages_start_is_paired_by_index() -> None:
    """P passes only the last pages of its prompt (as an engine keeping a sliding window does)
    and states where they start; D, with a prefix hit, states its own start: P's page of D's
    index lands in each of D's pages. A D start before P's first page is refused (below)."""
    tokens, page = 100, 16  # 7 pages, the last partly used
    p_pages = [1 + i for i in range(7)]
    d_pages = [9, 10, 11]  # the prompt's pages 4, 5 and 6
    with Engines(gqa(page), d_tp=2, p_pages=8, d_pages=12, transport="loopback") as engines:
        engines.prefill(p_pages, tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", d_pages, "x-1", block_start=4, num_tokens=tokens)
        engines.finish("p-1", p_pages[3:], "x-1", block_start=3)
        d, p = engines.wait()
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
        for tp, pools in engines.d_pools.items():
            assert mismatches(pools, logical(pools, d_pages, tokens, 4 * page, before[tp])) == []
        with pytest.raises(ConfigError, match="one start per group"):
            engines.finish("p-2", [1, 2], "x-2", block_start=[0, 0])


def test_a_decode_start_before_the_prefills_first_page_fails_and_writes_nothing() -> None:
    with Engines(gqa(16), p_pages=8, d_pages=8, transport="loopback") as engines:
        engines.prefill([1, 2, 3, 4], 60)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", [5, 6, 7], "x-1", block_start=1, num_tokens=60)
        engines.finish("p-1", [3, 4], "x-1", block_start=2)
        d_why, p_why = _refused(engines, before)
        for why in (d_why, p_why):
            assert "D registered blocks 1 to 3 of KV group 0" in why and "P holds blocks 2 to 3" in why, why


def _refused(engines: Engines, before: dict[int, Any]) -> tuple[str, str]:
    """D's and P's reasons for a push that must fail with nothing written: every D rank failed,
    released the request's pages (no WRITE can land) and kept its bytes; P's leg failed."""
    d, p = engines.wait()
    assert all(reason is not None for reason in (*d.values(), *p.values())), (d, p)
    deadline = time.monotonic() + 10
    while not all("d-1" in released for released in engines.released.values()):
        assert time.monotonic() < deadline, engines.released
        time.sleep(0.01)
        engines.poll()
    for tp, pools in engines.d_pools.items():
        assert mismatches(pools, before[tp]) == [], f"D rank {tp} failed but its pages changed"
    return str(d[0]), str(p[RankKey(0, 0)])


@pytest.mark.parametrize("strategy", ["direct", "packed"])
def test_decode_pages_p_does_not_hold_fail_both_legs_naming_both_and_write_nothing(strategy: str) -> None:
    """P's table is a page short of what D registered from its stated start (P's engine passed
    the pages it had computed so far): P cannot fill D's last page, so it writes none of them;
    D fails with a reason naming both sides' pages and releases them."""
    tokens, page = 40, 16
    with Engines(gqa(page), d_tp=2, p_pages=8, d_pages=8, transport="loopback", strategy=strategy) as engines:
        engines.prefill([5, 2, 7], tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", [1, 6, 3], "x-1", block_start=0, num_tokens=tokens)
        engines.finish("p-1", [5, 2], "x-1")
        d_why, p_why = _refused(engines, before)
        for why in (d_why, p_why):
            assert "D registered blocks 0 to 2 of KV group 0" in why and "a 40-token prompt" in why, why
            assert "P holds blocks 0 to 1 (2 blocks)" in why, why


def test_prompt_lengths_the_legs_state_differently_fail_both_and_write_nothing() -> None:
    """D states a 41-token prompt, P a 40-token one (three 16-token pages either way): the two
    legs do not hold the same prompt, so P writes nothing and both fail naming both lengths."""
    with Engines(gqa(16), p_pages=8, d_pages=8, transport="loopback") as engines:
        engines.prefill([5, 2, 7], 40)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", [1, 6, 3], "x-1", block_start=0, num_tokens=41)
        engines.finish("p-1", [5, 2, 7], "x-1", num_tokens=40)
        d_why, p_why = _refused(engines, before)
        for why in (d_why, p_why):
            assert "D expects a prompt of 41 tokens, P prefilled 40" in why, why


@pytest.mark.parametrize("page", [1, 16])
def test_decode_stating_lengths_its_pages_do_not_cover_is_refused_at_add(page: int) -> None:
    """D counted ``tokens // page`` pages but states the prompt's length and its start: its own
    add refuses the request naming both (nothing is registered or sent), before P is asked."""
    tokens = 40 if page == 1 else 44
    n = -(-tokens // page)
    with Engines(gqa(page), transport="loopback", p_pages=n + 2, d_pages=n + 2) as engines:
        with pytest.raises(ConfigError) as err:
            engines.add("d-1", [2 + i for i in range(n - 1)], "x-1", block_start=0, num_tokens=tokens)
        assert f"blocks 0 to {n - 2} of the prompt" in str(err.value)
        assert f"num_tokens={tokens} tokens take blocks 0 to {n - 1}" in str(err.value)
        assert engines.receivers[0].pending_requests == 0
        with pytest.raises(ConfigError, match="one start per group"):
            engines.add("d-2", [2, 3], "x-2", block_start=[0, 0])


def test_get_finished_from_two_threads_reports_each_request_once() -> None:
    """An engine polling get_finished from two threads (scheduler and a metrics thread) sees
    every request exactly once across both, on P and on D."""
    import threading

    requests = 24
    with Engines(gqa(1), transport="loopback", p_pages=requests * 4 + 1, d_pages=requests * 4 + 1) as engines:
        seen: dict[str, list[str]] = {"d": [], "p": []}
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                for receiver in engines.receivers.values():
                    got = receiver.get_finished()
                    seen["d"] += list(got.done) + list(got.failed)
                for sender in engines.senders.values():
                    got = sender.get_finished()
                    seen["p"] += list(got.sent) + list(got.failed)

        threads = [threading.Thread(target=poll) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            for i in range(requests):
                engines.add(f"d-{i}", [1 + 4 * i + j for j in range(4)], f"x-{i}")
                engines.finish(f"p-{i}", [4 + 4 * i - j for j in range(4)], f"x-{i}")
            deadline = time.monotonic() + 30
            while len(seen["d"]) < requests or len(seen["p"]) < requests:
                assert time.monotonic() < deadline, seen
                time.sleep(0.01)
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
        assert sorted(seen["d"]) == sorted(f"d-{i}" for i in range(requests))
        assert sorted(seen["p"]) == sorted(f"p-{i}" for i in range(requests))


def test_a_second_request_finished_of_a_key_in_progress_is_refused_and_the_first_lands() -> None:
    tokens, p_pages, d_pages = 40, [5, 2, 7], [1, 6, 3]
    with Engines(gqa(16), p_pages=8, d_pages=8, transport="loopback") as engines:
        engines.prefill(p_pages, tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.finish("p-1", p_pages, "x-1")
        with pytest.raises(ConfigError, match="already being pushed"):
            engines.finish("p-1", [1, 3, 4], "x-1")
        with pytest.raises(ConfigError, match="already being pushed"):
            engines.finish("p-2", [1, 3, 4], "x-1")
        engines.add("d-1", d_pages, "x-1")
        d, p = engines.wait()
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
        for tp, pools in engines.d_pools.items():
            assert mismatches(pools, logical(pools, d_pages, tokens, 0, before[tp])) == []


@pytest.mark.parametrize("cached", [0, 64])
def test_pages_of_64_on_decode_and_token_slots_on_prefill_pair_as_block_size_1(cached: int) -> None:
    """P runs page_size 1 and D page_size 64: both describe their flat slot pools with
    ``block_size=1`` (docs/engine-api.md) and pass token slot ids; D's slots are whole pages of
    64, its prefix hit one page. Every byte lands."""
    tokens, page = 150, 64
    d_page_ids = [5, 2, 7]
    d_slots = [p * page + i for p in d_page_ids for i in range(page)][:tokens]
    p_slots = [3 + 2 * t for t in range(tokens)][::-1]
    with Engines(gqa(1), d_tp=2, p_pages=2 * tokens + 3, d_pages=8 * page) as engines:
        push_and_check(engines, p_slots, d_slots[cached:], tokens, cached=cached)


def _start_error(model: ModelSpec, layout: str, caches: dict[str, torch.Tensor]) -> str:
    pm = get_plugin_manager(load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback)])
    parallel = ParallelConfig(tp_size=1, num_layers=model.num_layers)
    config = WorkerConfig(
        engine_id="p",
        parallel=parallel,
        model=model,
        layout=layout,
        transport="loopback",
        side_channel_port=1,
    )
    sender = PushSender(config, caches, pm=pm)
    with pytest.raises(ConfigError) as err:
        sender.start()
    return str(err.value)


@pytest.mark.parametrize("page", [1, 64])
def test_flat_sglang_pools_passed_unviewed_are_refused_naming_the_view(page: int) -> None:
    """An integrator passes SGLang's flat ``[slots, heads, head_dim]`` buffers (MLA:
    ``[slots, 1, latent]``) as they are: refused, and the message says how to view them."""
    parallel = ParallelConfig(tp_size=1, num_layers=3)
    pools = Pools(gqa(page), parallel, 3)
    flat = {f"{n}.{c}": b for n, pair in pools.buffers.items() for c, b in zip("kv", pair)}
    message = _start_error(gqa(page), "token_major", flat)
    assert f".view(-1, {page}, {HEADS}, {DIM})" in message, message
    latent = Pools(mla(page), parallel, 3)
    message = _start_error(
        mla(page), "uniform", {n: pair[0].squeeze(1) for n, pair in latent.buffers.items()}
    )
    assert f".view(-1, {page}, 24)" in message, message
    if page > 1:  # [slots, 1, latent] has the MLA shape's rank: its 1 is not the page
        message = _start_error(mla(page), "uniform", {n: pair[0] for n, pair in latent.buffers.items()})
        assert f".view(-1, {page}, 24)" in message, message


def test_sglang_engine_in_processes_over_nixl() -> None:
    """examples/engine_token_pools.py: token-slot pools as page views, P and each D rank in its
    own process over NIXL, a cold request and a prefix hit, every slot of every D pool checked."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "engine_token_pools.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "D: ['verified', 'verified']" in out.stdout


def fp8(page: int, fmt: str) -> ModelSpec:
    return ModelSpec(
        name="sglang-fp8", num_layers=3, num_kv_heads=HEADS, head_dim=DIM, block_size=page, dtype=fmt
    )


def test_fp8_pools_kept_in_uint8_buffers_push_under_their_format_and_formats_never_mix() -> None:
    """SGLang (and vLLM) keep an fp8 KV cache in uint8 buffers. The engine states the format,
    ``ModelSpec.dtype="float8_e4m3fn"``: the push is byte-exact. A D whose cache holds the
    other fp8 format is refused naming the dtype, never written (stating ``uint8`` on both
    would hash alike and move e4m3 bytes into an e5m2 cache)."""
    tokens, p_pages, d_pages = 40, [5, 2, 7], [1, 6, 3]
    with Engines(fp8(16, "float8_e4m3fn"), d_tp=2, p_pages=8, d_pages=8, store=torch.uint8) as engines:
        push_and_check(engines, p_pages, d_pages, tokens)
    with Engines(
        fp8(16, "float8_e4m3fn"),
        fp8(16, "float8_e5m2"),
        p_pages=8,
        d_pages=8,
        store=torch.uint8,
        transport="loopback",
        lease_s=2.0,
    ) as engines:
        engines.prefill(p_pages, tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", d_pages, "x-1")
        engines.finish("p-1", p_pages, "x-1")
        d, p = engines.wait()
        assert "model.dtype: peer 'float8_e4m3fn', local 'float8_e5m2'" in str(d[0]), d
        assert p[RankKey(0, 0)] is not None
        assert mismatches(engines.d_pools[0], before[0]) == []


@pytest.mark.parametrize("page", [1, 16])
def test_prefill_stating_the_prompt_length_pushes_only_the_prompts_pages(page: int) -> None:
    """The fix for the lookahead page: ``request_finished(..., num_tokens=)`` keeps the prompt's
    ``ceil(num_tokens / block_size)`` pages of a longer page table, and every byte lands."""
    tokens = 40
    n = -(-tokens // page)
    p_pages, d_pages = [1 + i for i in range(n + 1)], [2 + i for i in range(n)]
    with Engines(gqa(page), transport="loopback", p_pages=n + 2, d_pages=n + 2) as engines:
        engines.prefill(p_pages[:n], tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", d_pages, "x-1")
        engines.finish("p-1", p_pages, "x-1", num_tokens=tokens)
        d, p = engines.wait()
        assert set(d.values()) == {None} and set(p.values()) == {None}, (d, p)
        for tp, pools in engines.d_pools.items():
            assert mismatches(pools, logical(pools, d_pages, tokens, 0, before[tp])) == []


def as_group_dict(ids: list[int]) -> Any:
    return {0: ids}  # per KV group, keyed by group id


def as_set(ids: list[int]) -> Any:
    return set(ids)


def as_group_sets(ids: list[int]) -> Any:
    return [frozenset(ids)]


@pytest.mark.parametrize("form", [as_group_dict, as_set, as_group_sets], ids=lambda f: f.__name__)
def test_block_ids_in_unordered_or_keyed_containers_are_refused(form: Any) -> None:
    """A dict of per-group lists was read as its keys (``{0: [5, 2, 7]}`` became block 0) and a
    set lost the token order (its iteration order is not the engine's): either way P pushed
    other blocks, or in another order, and D reported done. Both legs refuse them, naming why."""
    tokens, p_pages, d_pages = 40, [5, 2, 7], [1, 6, 3]
    with Engines(gqa(16), p_pages=8, d_pages=8, transport="loopback", lease_s=2.0) as engines:
        engines.prefill(p_pages, tokens)
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        with pytest.raises(ConfigError, match="order"):
            engines.add("d-1", form(d_pages), "x-1")
        with pytest.raises(ConfigError, match="order"):
            engines.finish("p-1", form(p_pages), "x-1")
        assert all(mismatches(pools, before[tp]) == [] for tp, pools in engines.d_pools.items())


def test_a_scheduler_publishing_a_ranks_payload_under_another_rank_is_told_so() -> None:
    """The engine's scheduler mixes up two ranks' payloads. Nothing is written (P's handshake
    sees the mismatch), but the engine should hear what is wrong: at publish, or in the
    request's failure reason."""
    with Engines(gqa(16), d_tp=2, p_pages=8, d_pages=8, transport="loopback", lease_s=3.0) as engines:
        try:
            engines.d_server.publish(RankKey(0, 0), engines.receivers[1].handshake_payload())
        except ConfigError as err:
            assert "rank" in str(err)
            return
        engines.d_server.publish(RankKey(0, 1), engines.receivers[0].handshake_payload())
        before = {tp: pools.snapshot() for tp, pools in engines.d_pools.items()}
        engines.add("d-1", [1, 6, 3], "x-1")
        engines.finish("p-1", [5, 2, 7], "x-1")
        d, _ = engines.wait()
        assert all(mismatches(pools, before[tp]) == [] for tp, pools in engines.d_pools.items())
        assert all("got (pp=0, tp=" in str(reason) for reason in d.values()), d
