"""Probes as a third-party plugin author and as an operator who misconfigures things.

Each case is a plausible plugin or configuration that used to end in D reporting a request
done with wrong bytes in its blocks (or P writing outside the blocks D named), and must now be
a clear error naming the problem and the fix, before anything is written:

- a read-spec plugin that swaps (or edits) the job's block ids (both sides, or P only);
- a layout whose engines number their KV-cache groups differently on P and D;
- a plugin raising from each hook in turn (the request fails, bounded, naming the plugin);
- a layout that describes its tensors wrongly (NHD blocks declared heads-outer, a padded or
  multiple block length, a dtype other than the model's on one side).

Real NIXL where the behaviour crosses processes: ``kvpush.testing.run_cluster`` (each rank its
own process) and in-process ranks on real NIXL agents; pure functions where it does not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import attrs
import pytest
import test_plugin_author_probe_plugins as probe_plugins
import torch
from cluster import wait_until
from test_coverage_adversarial import Push, with_plugins

from kvpush import hookimpl
from kvpush.core.errors import ConfigError, PluginError
from kvpush.core.manager import KvpushPluginManager
from kvpush.core.peers import check_geometry
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import (
    KVRegion,
    LayoutProvider,
    ModelSpec,
    ParallelConfig,
    PushJob,
    ReadSpec,
    RegionAlignment,
    RequestMetadata,
    TransferParams,
)
from kvpush.core.worker import WorkerConfig
from kvpush.layouts.regions import local_heads, natural_key, tensor_region
from kvpush.testing import make_agent_metadata, run_cluster

# ------------------------------------------------------------------------------ a P/D pair


class Pair:
    """One P rank and one D rank in this process on real NIXL agents (or loopback), each with
    its own plugin manager, caches and model: what two engines configured apart look like."""

    def __init__(
        self,
        *,
        layout: str,
        p_caches: Mapping[str, torch.Tensor],
        d_caches: Mapping[str, torch.Tensor],
        p_pm: KvpushPluginManager,
        d_pm: KvpushPluginManager,
        p_model: ModelSpec,
        d_model: ModelSpec | None = None,
        transport: str = "nixl",
        request_timeout_s: float = 20,
    ) -> None:
        self.p_caches, self.d_caches = p_caches, d_caches
        self.p_server, self.d_server = SideChannelServer("P"), SideChannelServer("D")
        self.workers: list[Any] = []
        parallel = ParallelConfig(tp_size=1, num_layers=p_model.num_layers)

        def config(engine: str, model: ModelSpec, port: int) -> WorkerConfig:
            return WorkerConfig(
                engine_id=engine,
                parallel=parallel,
                model=model,
                layout=layout,
                transport=transport,
                side_channel_port=port,
                request_timeout_s=request_timeout_s,
            )

        try:
            self.sender = PushSender(config("P", p_model, self.p_server.port), dict(p_caches), pm=p_pm)
            self.workers.append(self.sender)
            self.sender.start()
            self.p_server.publish(parallel.rank, self.sender.handshake_payload())
            self.receiver = PushReceiver(
                config("D", d_model or p_model, self.d_server.port), dict(d_caches), pm=d_pm
            )
            self.workers.append(self.receiver)
            self.receiver.start()
            self.d_server.publish(parallel.rank, self.receiver.handshake_payload())
        except BaseException:
            self.close()
            raise

    def push(self, p_ids: Any, d_ids: Any, timeout_s: float = 30.0) -> str | None:
        """One request; None when D reported it done, else D's reason."""
        params = TransferParams.from_dict(
            {
                "remote_engine_id": "P",
                "remote_host": "127.0.0.1",
                "remote_port": self.p_server.port,
                "transfer_id": "x",
            }
        )
        self.receiver.add_request(RequestMetadata(request_id="d", block_ids=d_ids, params=params))
        self.sender.request_finished("p", p_ids, match_key="x")
        outcome: dict[str, str | None] = {}

        def ended() -> bool:
            got = self.receiver.get_finished()
            outcome.update({rid: None for rid in got.done})
            outcome.update(got.failed)
            return "d" in outcome

        wait_until(ended, timeout_s, "D to end request d")
        time.sleep(0.2)  # a WRITE landing after the report would show in the bytes
        return outcome["d"]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.p_server.close()
        self.d_server.close()


def random_bf16(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-30_000, 30_000, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)


def untouched(caches: Mapping[str, torch.Tensor]) -> bool:
    return not any(t.view(torch.int8).any() for t in caches.values())


# ------------------------------------------------------------------------------ read-spec block ids


def test_read_spec_plugin_swapping_block_ids_is_refused_across_processes() -> None:
    """A read-spec plugin (on every rank) that hands P's block ids to D's side and D's to P's
    tiles every region, so the coverage check passed, and P read other blocks of its cache and
    wrote them at its own ids in D: D reported done with other bytes in its blocks (run_cluster
    found 'block 30 of layers.0 K does not hold the pushed bytes'). D now refuses the producer
    at its handshake, naming the plugin, before anything is written."""
    report = run_cluster(
        "uniform",
        plugins=["test_plugin_author_probe_plugins:swapped_block_ids"],
        prefill_pp=1,
        decode_tp=1,
        requests=2,
        prefix_hit_rate=0,
        timeout_s=5,  # P never hears from a D that refused it: the runner waits this + 10 s
    )
    assert not report.ok and report.verified == 0, report
    for reason in report.failures.values():
        assert "does not hold the pushed bytes" not in reason, reason
        assert "swaps P's and D's block ids" in reason, reason


class DropsLastBlock:
    """A read-spec plugin that 'trims' a block: D's last registered block is never written."""

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> list[ReadSpec] | None:
        return [
            ReadSpec(
                dst_tp_rank=job.local.parallel.tp_rank,
                local_block_ids=tuple(g[:-1] for g in job.local_block_ids),
                remote_block_ids=tuple(g[:-1] for g in job.remote_block_ids),
            )
        ]


def test_plan_with_edited_block_ids_is_refused_naming_the_plugin() -> None:
    pm = with_plugins(("drops_last", DropsLastBlock()))
    job = PushJob(
        local=make_agent_metadata(role="prefill"),
        decode_tp_size=1,
        local_block_ids=((3, 1, 4),),
        remote_block_ids=((0, 2, 5),),
    )
    with pytest.raises(
        PluginError, match=r"'drops_last' changes the block ids.*\(\(0, 2\),\).*\(\(0, 2, 5\),\)"
    ):
        pm.build_read_specs(job)
    swapped = with_plugins(("swap", probe_plugins.SwappedBlockIds()))
    with pytest.raises(PluginError, match="'swap' swaps P's and D's block ids"):
        swapped.build_read_specs(job)


def test_read_spec_plugin_on_p_only_swapping_block_ids_never_delivers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only P has the plugin: D's own replay plans the built-in way and accepts; P's handshake
    with D replays its own plan and refuses it, so nothing is written (D fails at its HELLO
    bound: P cannot tell it why; P logs the plugin)."""
    with caplog.at_level(logging.WARNING, logger="kvpush.core.peers"):
        push = Push(pp=1, transport="nixl", p_pm=with_plugins(("swap", probe_plugins.SwappedBlockIds())))
        try:
            outcome = push.push(timeout_s=30)
            push.assert_exact_or_failed(outcome)
            assert all(outcome.values()), outcome
            assert all(not t[:, [0, 2]].view(torch.int8).any() for t in push.d_caches[0].values())
        finally:
            push.close()
    assert "'swap' swaps P's and D's block ids" in caplog.text


# ------------------------------------------------------------------------------ KV-cache groups


POOLS_MODEL = ModelSpec(name="pools", num_layers=4, num_kv_heads=2, head_dim=4, block_size=2)
"""A hybrid model whose ModelSpec (like vLLM's adapter's) does not list the groups: the layout
takes them from the engine's pools."""


def describe_pools(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    """A layout written from docs/plugins.md for an engine with one pool per attention kind,
    keyed ``"<pool>/<layer>"``, each layer ``(2, blocks, heads, tokens, head_dim)``. It numbers
    the KV-cache groups in the order the engine lists its pools (as the engine numbers the block
    id lists it passes)."""
    pools: list[str] = []
    for key in kv_caches:
        pool = key.split("/")[0]
        if pool not in pools:
            pools.append(pool)
    regions = []
    for key in sorted(kv_caches, key=lambda k: natural_key(k.split("/")[1])):
        pool, layer = key.split("/")
        for index, component in enumerate(("K", "V")):
            regions.append(
                tensor_region(
                    kv_caches[key][index],
                    layer_names=(layer,),
                    component=component,
                    kv_group=pools.index(pool),
                    num_heads=local_heads(model, parallel),
                    block_order="heads_outer",
                )
            )
    return regions


class PoolsLayout:
    @hookimpl
    def kvpush_layouts(self) -> list[LayoutProvider]:
        return [LayoutProvider(name="pools", describe_regions=describe_pools)]


def pool_caches(order: tuple[str, str], fill: bool) -> dict[str, torch.Tensor]:
    caches = {}
    for pool in order:
        for layer in range(4):
            if (layer % 2 == 0) == (pool == "full"):
                shape = (2, 8, 2, 2, 4)
                caches[f"{pool}/layers.{layer}"] = (
                    random_bf16(*shape, seed=layer) if fill else torch.zeros(shape, dtype=torch.bfloat16)
                )
    return caches


def test_kv_groups_numbered_differently_on_p_and_d_are_refused() -> None:
    """P's engine lists its full-attention pool first, D's its sliding-window pool: each passes
    block ids in its own group order, and the regions pair by position. P wrote each layer at
    the ids D gave for the *other* group (D reported done; its full-attention blocks were never
    written). D now refuses at its handshake, naming both groups and the fix."""
    pm = with_plugins(("pools", PoolsLayout()))
    pair = Pair(
        layout="pools",
        p_caches=pool_caches(("full", "swa"), fill=True),
        d_caches=pool_caches(("swa", "full"), fill=False),
        p_pm=pm,
        d_pm=pm,
        p_model=POOLS_MODEL,
    )
    try:
        # P: (full ids, swa ids); D: (swa ids, full ids)
        reason = pair.push(((3, 1), (6, 4)), ((0, 2), (5, 7)))
    finally:
        pair.close()
    assert reason is not None, "D reported done with its full-attention blocks never written"
    assert "KV-cache group 0" in reason and "group 1" in reason and "Number KV-cache groups" in reason, reason
    assert untouched(pair.d_caches)


def test_geometry_check_refuses_regions_paired_across_groups() -> None:
    local = make_agent_metadata(role="prefill")
    peer = make_agent_metadata(role="decode")
    moved = attrs.evolve(
        peer, regions=[attrs.evolve(r, kv_group=1) if i == 2 else r for i, r in enumerate(peer.regions)]
    )
    problems = check_geometry(local, moved, RegionAlignment(remote_indices=range(len(local.regions))))
    assert len(problems) == 1 and "is in KV-cache group 0" in problems[0] and "group 1" in problems[0]


# ------------------------------------------------------------------------------ hooks that raise


HOOK_ARGS = {
    "kvpush_transports": "",
    "kvpush_layouts": "",
    "kvpush_metadata_extensions": "local",
    "kvpush_handshake_mode": "role, peer_role",
    "kvpush_validate_peer": "local, peer, mode",
    "kvpush_align_regions": "local, peer",
    "kvpush_build_read_specs": "job",
    "kvpush_transfer_strategy": "job, spec, num_descriptors",
    "kvpush_expected_producers": "prefill, decode_tp_rank, decode_tp_size",
    "kvpush_decode_notification": "message",
}
START_HOOKS = {"kvpush_transports", "kvpush_layouts", "kvpush_metadata_extensions"}


def broken_plugin(hook: str, body: str) -> object:
    """A plugin whose only hookimpl (``tryfirst``, asked before the built-ins) runs ``body``."""
    args = HOOK_ARGS[hook]
    namespace: dict[str, Any] = {"hookimpl": hookimpl}
    exec(  # one hookimpl per hook, built from the spec's argument names
        f"class Broken:\n    @hookimpl(tryfirst=True)\n    def {hook}(self{', ' if args else ''}{args}):\n"
        f"        {body}\n",
        namespace,
    )
    return namespace["Broken"]()


class QuickPush(Push):
    """test_coverage_adversarial's P and D workers with a short registration timeout."""

    def _config(self, engine: str, parallel: ParallelConfig, model: ModelSpec, port: int) -> WorkerConfig:
        return attrs.evolve(super()._config(engine, parallel, model, port), request_timeout_s=8)


def sweep(hook: str, side: str, body: str) -> tuple[dict[int, str | None] | None, str]:
    """Push one request PP1 TP1 -> TP2 with the broken plugin on ``side``; D's outcome (None
    when a rank could not start) and the error text (start error or D's reasons)."""
    pm = with_plugins(("broken", broken_plugin(hook, body)))
    try:
        push = QuickPush(pp=1, p_tp=1, d_tp=2, **({"p_pm": pm} if side == "P" else {"d_pm": pm}))
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"
    try:
        started = time.monotonic()
        outcome = push.push(timeout_s=30)
        assert time.monotonic() - started < 15, "the failure took longer than the HELLO bound"
        push.assert_exact_or_failed(outcome)
    finally:
        push.close()
    return outcome, "\n".join(reason or "" for reason in outcome.values())


@pytest.mark.parametrize("side", ["P", "D"])
@pytest.mark.parametrize("hook", sorted(HOOK_ARGS))
def test_a_plugin_raising_from_a_hook_never_delivers_and_is_named(
    hook: str, side: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every hook in turn raises ZeroDivisionError on one side: the rank refuses to start, or
    the request fails within the HELLO bound (never done with wrong bytes), and what the
    operator reads (the start error, D's reason or the rank's log) names the plugin and the
    hook. Before, the reasons said only 'ZeroDivisionError: division by zero'."""
    with caplog.at_level(logging.WARNING):
        outcome, text = sweep(hook, side, "return 1 // 0")
    named = f"plugin 'broken' raised ZeroDivisionError in {hook}"
    if outcome is None:
        assert hook in START_HOOKS and text.startswith("PluginError") and named in text, text
        return
    assert hook not in START_HOOKS
    if all(reason is None for reason in outcome.values()):  # the hook is not asked on this side
        assert (hook, side) in {("kvpush_transfer_strategy", "D"), ("kvpush_handshake_mode", "P")}, outcome
        return
    assert all(outcome.values()), outcome
    assert named in text or named in caplog.text, (text, caplog.text[-2000:])


@pytest.mark.parametrize("side", ["P", "D"])
@pytest.mark.parametrize("hook", sorted(HOOK_ARGS))
def test_a_plugin_returning_none_from_a_hook_leaves_it_to_the_builtins(hook: str, side: str) -> None:
    """None is 'not me' for every hook: the built-ins answer and the push is exact."""
    outcome, text = sweep(hook, side, "return None")
    assert outcome == {0: None, 1: None}, text


def test_a_validator_returning_one_string_is_one_problem(kvpush_pm_factory: Any) -> None:
    """``return "peer is too old"`` used to be listed one character per line."""
    pm = kvpush_pm_factory(("stringy", broken_plugin("kvpush_validate_peer", "return 'peer is too old'")))
    local, peer = make_agent_metadata(role="prefill"), make_agent_metadata(role="decode")
    from kvpush.core.types import HandshakeMode

    assert pm.validate_peer(local, peer, HandshakeMode.FULL) == ["peer is too old"]


# ------------------------------------------------------------------------------ layouts written from the docs

DOC_MODEL = ModelSpec(name="doc-gqa", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)


def describe_from_docs(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    """docs/plugins.md's ``describe_split``, copied for an engine whose K and V tensors are
    ``(num_blocks, block_size, heads, head_dim)`` (token-major): heads_outer, as in the guide."""
    heads = local_heads(model, parallel)
    regions = []
    for position, layer in enumerate(sorted({k.rpartition(".")[0] for k in kv_caches}, key=natural_key)):
        for component in ("K", "V"):
            regions.append(
                tensor_region(
                    kv_caches[f"{layer}.{component.lower()}"],
                    layer_names=(layer,),
                    component=component,
                    kv_group=model.group_of(parallel.start_layer + position),
                    num_heads=heads,
                    block_order="heads_outer",
                )
            )
    return regions


def nhd_caches(model: ModelSpec, tp_size: int, blocks: int = 8) -> dict[str, torch.Tensor]:
    shape = (blocks, model.block_size, model.num_kv_heads // tp_size, model.head_dim)
    return {f"layers.{i}.{c}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(2) for c in "kv"}


def test_a_docs_layout_declaring_heads_outer_for_token_major_tensors_is_refused() -> None:
    """The NHD cache declared heads_outer passed every check and, under heterogeneous TP,
    delivered other heads' bytes reported done (tests/test_block_order.py shows the delivery).
    tensor_region now compares the declared order with the tensor's block shape."""
    provider = LayoutProvider(name="from_docs", describe_regions=describe_from_docs)
    parallel = ParallelConfig(tp_size=2, tp_rank=0, num_layers=2)
    with pytest.raises(
        ConfigError, match=r"declares heads_outer.*block_order='tokens_outer', block_tokens=4"
    ):
        provider.describe(nhd_caches(DOC_MODEL, 2), parallel, DOC_MODEL)
    # the same tensors declared tokens_outer with the wrong token count are refused too
    with pytest.raises(ConfigError, match="declares tokens_outer with block_tokens=2 and num_heads=2"):
        tensor_region(
            nhd_caches(DOC_MODEL, 2)["layers.0.k"],
            layer_names=("layers.0",),
            component="K",
            num_heads=2,
            block_order="tokens_outer",
            block_tokens=2,
        )


def double_blocks(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """A layout whose regions describe two cache blocks as one (block length and stride a
    multiple of the right ones), e.g. a scheduler block of two kernel blocks."""
    from kvpush.layouts.uniform import describe_uniform

    return [
        attrs.evolve(
            r, block_len=2 * r.block_len, block_stride=2 * r.block_stride, num_blocks=r.num_blocks // 2
        )
        for r in describe_uniform(kv_caches, parallel, model)
    ]


def padded(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """A layout over blocks padded to 64 B more than their KV, whose block_len includes it."""
    from kvpush.layouts.uniform import describe_uniform

    return [
        attrs.evolve(
            r, block_len=r.block_len + 64, block_stride=r.block_stride + 64, num_blocks=r.num_blocks - 1
        )
        for r in describe_uniform(kv_caches, parallel, model)
    ]


class GeometryLayouts:
    @hookimpl
    def kvpush_layouts(self) -> list[LayoutProvider]:
        return [
            LayoutProvider(name="double_blocks", describe_regions=double_blocks),
            LayoutProvider(name="padded", describe_regions=padded),
        ]


def uniform_caches(model: ModelSpec, fill: bool, dtype: str | None = None) -> dict[str, torch.Tensor]:
    from kvpush.layouts.uniform import allocate_kv_caches

    caches = allocate_kv_caches(
        attrs.evolve(model, dtype=dtype or model.dtype), ParallelConfig(tp_size=1, num_layers=2), 8
    )
    if fill:
        gen = torch.Generator().manual_seed(3)
        for tensor in caches.values():
            tensor.view(torch.int8).copy_(
                torch.randint(-100, 100, tensor.view(torch.int8).shape, generator=gen)
            )
    return caches


def test_a_layout_describing_two_blocks_as_one_is_refused_before_writing_outside_ds_blocks() -> None:
    """Both engines run the layout, so the peers agree and every check passed: D named blocks
    0 and 2, and P's WRITE covered cache blocks 0-1 and 4-5 (reported done, blocks D never
    named overwritten). The in-block order rule now refuses the layout when a rank starts."""
    pm = with_plugins(("geometry", GeometryLayouts()))
    d_caches = uniform_caches(DOC_MODEL, fill=False)
    with pytest.raises(ConfigError, match=r"breaks the in-block order rule.*one block per block id"):
        pair = Pair(
            layout="double_blocks",
            p_caches=uniform_caches(DOC_MODEL, fill=True),
            d_caches=d_caches,
            p_pm=pm,
            d_pm=pm,
            p_model=DOC_MODEL,
        )
        try:
            pair.push(((3, 1),), ((0, 2),))
        finally:
            pair.close()
    assert untouched(d_caches)


def test_a_padded_block_length_is_refused() -> None:
    provider = with_plugins(("geometry", GeometryLayouts())).layout("padded")
    with pytest.raises(ConfigError, match=r"without padding \(put it in block_stride\)"):
        provider.describe(
            uniform_caches(DOC_MODEL, fill=False), ParallelConfig(tp_size=1, num_layers=2), DOC_MODEL
        )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"block_size": 8}, "8 tokens"),  # the engine's blocks hold 4 tokens, the spec says 8
        ({"head_dim": 4}, "head_dim 4"),
        ({"dtype": "float32"}, "of float32"),
    ],
    ids=["block_size", "head_dim", "element_size"],
)
def test_a_model_spec_that_does_not_describe_the_cache_is_refused_at_start(change: dict, match: str) -> None:
    """A docs-style layout (no shape check of its own) given a ModelSpec that is not its
    cache's: the rank used to start, and was refused only at the peer's handshake when the
    peer's bytes per head differed (never when both sides were misconfigured alike)."""
    model = attrs.evolve(DOC_MODEL, **change)
    caches = {
        f"layers.{i}.{c}": t[j]
        for i in range(2)
        for j, c in enumerate("kv")
        for t in [uniform_caches(DOC_MODEL, False)[f"layers.{i}"]]
    }
    provider = LayoutProvider(name="from_docs", describe_regions=describe_from_docs)
    with pytest.raises(ConfigError, match=match):
        provider.describe(caches, ParallelConfig(tp_size=1, num_layers=2), model)


def test_fp8_caches_of_different_formats_under_one_model_spec_are_refused() -> None:
    """P holds float8_e4m3fn, D float8_e5m2, both engines configured with the same ModelSpec
    (dtype float8_e4m3fn): same bytes per head, so every check passed and D reported done with
    bytes it reads as other numbers. D's layout now refuses its rank at start."""
    model = attrs.evolve(DOC_MODEL, dtype="float8_e4m3fn")
    pm = with_plugins()
    with pytest.raises(
        ConfigError, match=r"KV cache 'layers.0' holds float8_e5m2 but ModelSpec.dtype is 'float8_e4m3fn'"
    ):
        pair = Pair(
            layout="uniform",
            p_caches=uniform_caches(model, fill=True),
            d_caches=uniform_caches(model, fill=False, dtype="float8_e5m2"),
            p_pm=pm,
            d_pm=pm,
            p_model=model,
        )
        try:
            pair.push(((3, 1),), ((0, 2),))
        finally:
            pair.close()


def beyond_tensor(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """A layout that counts one block more than its tensors hold (an off-by-one)."""
    from kvpush.layouts.uniform import describe_uniform

    return [
        attrs.evolve(r, num_blocks=r.num_blocks + 1) for r in describe_uniform(kv_caches, parallel, model)
    ]


def test_check_tensors_refuses_a_region_outside_its_tensors_and_a_foreign_dtype() -> None:
    from kvpush.layouts.regions import check_tensors

    caches = uniform_caches(DOC_MODEL, fill=False)
    parallel = ParallelConfig(tp_size=1, num_layers=2)
    with pytest.raises(ConfigError, match="outside every KV tensor"):
        check_tensors(caches, beyond_tensor(caches, parallel, DOC_MODEL), DOC_MODEL, layout="beyond")
    from kvpush.layouts.uniform import describe_uniform

    regions = describe_uniform(caches, parallel, DOC_MODEL)
    with pytest.raises(ConfigError, match=r"holds bfloat16 but ModelSpec.dtype is 'float16'"):
        check_tensors(caches, regions, attrs.evolve(DOC_MODEL, dtype="float16"))


def last_beyond(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """An off-by-one in the last region only: it shares no bytes with another region."""
    from kvpush.layouts.uniform import describe_uniform

    regions = describe_uniform(kv_caches, parallel, model)
    return [*regions[:-1], attrs.evolve(regions[-1], num_blocks=regions[-1].num_blocks + 1)]


def test_a_tensor_holding_no_region_may_have_a_dtype_of_its_own() -> None:
    """A state the engine does not transfer (a group excluded from transfer, say float32 next
    to bfloat16 KV) is not a KV tensor of the model: only tensors that hold a region count."""
    from kvpush.layouts.regions import check_tensors
    from kvpush.layouts.uniform import describe_uniform

    parallel = ParallelConfig(tp_size=1, num_layers=2)
    caches = uniform_caches(DOC_MODEL, fill=False)
    provider = LayoutProvider(name="u", describe_regions=describe_uniform)
    regions = provider.describe(caches, parallel, DOC_MODEL)
    check_tensors({**caches, "state": torch.zeros(4, dtype=torch.float32)}, regions, DOC_MODEL)


def test_a_third_party_layout_counting_a_block_past_its_tensor_is_refused_at_start() -> None:
    """``LayoutProvider.describe`` checks every layout's regions against its tensors
    (``check_tensors``), not only the built-in layouts that call it themselves."""
    parallel = ParallelConfig(tp_size=1, num_layers=2)
    caches = uniform_caches(DOC_MODEL, fill=False)
    with pytest.raises(ConfigError, match=r"outside every KV tensor|share bytes"):
        LayoutProvider(name="beyond", describe_regions=beyond_tensor).describe(caches, parallel, DOC_MODEL)
    with pytest.raises(ConfigError, match="outside every KV tensor"):
        LayoutProvider(name="last-beyond", describe_regions=last_beyond).describe(caches, parallel, DOC_MODEL)


def test_a_kv_region_whose_blocks_hold_k_then_v_is_refused() -> None:
    """A layout over ``(blocks, 2, heads, tokens, head_dim)`` tensors (K then V inside each
    block) that describes one ``KV`` region per layer, heads_outer: its bytes per block are
    right, so it passed every check, and P TP1 -> D TP2 gave D rank 0 the K of every head in
    place of its K and V (both D ranks reported done, in a loopback run of this layout).
    tensor_region now names the fix (two regions). With 2 heads per rank the two shapes are
    the same and cannot be told apart (a residual risk the docs state)."""
    tensor = torch.zeros(8, 2, 4, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"K and V are outermost.*tensor\[:, 0\] as component 'K'"):
        tensor_region(
            tensor, layer_names=("layers.0",), component="KV", num_heads=4, block_order="heads_outer"
        )


def test_the_geometry_rule_accepts_vllm_hybrid_kernel_blocks_of_their_own_size() -> None:
    """With several KV groups a group's kernel blocks may hold fewer tokens than the model's
    block (vLLM's sliding-window group at half size): whole tokens pass, a padded length does
    not."""
    from kvpush.layouts.regions import check_regions
    from kvpush.layouts.vllm import VllmLayerCache, describe_vllm

    kinds = ("full", "sliding_window", "full", "sliding_window")
    model = ModelSpec(
        name="hybrid", num_layers=4, num_kv_heads=4, head_dim=8, block_size=16,
        layer_groups=(0, 1, 0, 1), layer_kinds=kinds,
    )  # fmt: skip
    tensors = [torch.zeros(64, 4, 16, 16, dtype=torch.bfloat16) for _ in range(2)]
    caches = {
        f"model.layers.{i}.self_attn.attn": VllmLayerCache(
            tensor=tensors[i // 2] if i % 2 == 0 else tensors[i // 2].view(128, 4, 8, 16),
            group=i % 2,
            attention_kind=kinds[i],
            blocks_per_logical=1 + i % 2,
        )
        for i in range(4)
    }
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=4)
    regions = describe_vllm(caches, parallel, model)
    check_regions(regions, parallel, model, layout="vllm")
    padded_regions = [attrs.evolve(r, block_len=r.block_len - 64) for r in regions]
    with pytest.raises(ConfigError, match="a whole number of tokens"):
        check_regions(padded_regions, parallel, model, layout="vllm")


def k_twice(kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec) -> list[KVRegion]:
    """A copy-paste slip: V described over ``tensor[0]`` too. Both engines run it, so every
    check passed; a loopback push reported done with K's bytes in D's K (twice) and D's V
    never written."""
    from kvpush.layouts.regions import ordered_layers

    heads = local_heads(model, parallel)
    return [
        tensor_region(tensor[0], layer_names=(name,), component=c, num_heads=heads, block_order="heads_outer")
        for name, tensor in ordered_layers(kv_caches, parallel)
        for c in ("K", "V")
    ]


def kv_interleaved(
    kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
) -> list[KVRegion]:
    """K and V interleaved block by block, ``(blocks, 2, heads, tokens, head_dim)``, described
    right: K is ``tensor[:, 0]``, V ``tensor[:, 1]`` (spans overlap, bytes do not)."""
    from kvpush.layouts.regions import ordered_layers

    heads = local_heads(model, parallel)
    return [
        tensor_region(
            tensor[:, i], layer_names=(name,), component=c, num_heads=heads, block_order="heads_outer"
        )
        for name, tensor in ordered_layers(kv_caches, parallel)
        for i, c in enumerate(("K", "V"))
    ]


def test_regions_sharing_bytes_are_refused_and_interleaved_k_v_are_not() -> None:
    parallel = ParallelConfig(tp_size=1, num_layers=2)
    stacked = {f"layers.{i}": torch.zeros(2, 8, 4, 4, 8, dtype=torch.bfloat16) for i in range(2)}
    provider = LayoutProvider(name="k_twice", describe_regions=k_twice)
    with pytest.raises(
        ConfigError, match=r"region 0 \(layers.0 K\) and region 1 \(layers.0 V\) .* share bytes"
    ):
        provider.describe(stacked, parallel, DOC_MODEL)
    interleaved = {f"layers.{i}": torch.zeros(8, 2, 4, 4, 8, dtype=torch.bfloat16) for i in range(2)}
    regions = LayoutProvider(name="kv_interleaved", describe_regions=kv_interleaved).describe(
        interleaved, parallel, DOC_MODEL
    )
    assert [r.block_stride for r in regions] == [2 * regions[0].block_len] * 4


class DocsLayout:
    @hookimpl
    def kvpush_layouts(self) -> list[LayoutProvider]:
        return [LayoutProvider(name="from_docs", describe_regions=describe_from_docs)]


def hnd_caches(fill: bool, pad: int) -> dict[str, torch.Tensor]:
    """K and V ``(blocks, heads, tokens, head_dim)`` per layer; with ``pad``, each block is
    followed by ``pad`` unused elements (a padded block stride)."""
    heads, tokens, dim, blocks = DOC_MODEL.num_kv_heads, DOC_MODEL.block_size, DOC_MODEL.head_dim, 8
    caches = {}
    for i, name in enumerate(f"layers.{layer}.{c}" for layer in range(2) for c in "kv"):
        storage = (
            random_bf16(blocks, heads * tokens * dim + pad, seed=i)
            if fill
            else torch.zeros(blocks, heads * tokens * dim + pad, dtype=torch.bfloat16)
        )
        caches[name] = storage[:, : heads * tokens * dim].unflatten(1, (heads, tokens, dim))
    return caches


def test_a_padded_block_stride_on_one_side_only_pushes_exactly_over_nixl() -> None:
    """P's blocks are padded (stride > length), D's are not: tensor_region takes the padding
    into block_stride, and every byte of D's named blocks is P's, nothing else written."""
    pm = with_plugins(("docs", DocsLayout()))
    p_caches, d_caches = hnd_caches(fill=True, pad=24), hnd_caches(fill=False, pad=0)
    pair = Pair(layout="from_docs", p_caches=p_caches, d_caches=d_caches, p_pm=pm, d_pm=pm, p_model=DOC_MODEL)
    try:
        assert pair.push(((3, 1, 6),), ((0, 2, 5),)) is None
    finally:
        pair.close()
    for name, got in d_caches.items():
        assert torch.equal(got[[0, 2, 5]].view(torch.int16), p_caches[name][[3, 1, 6]].view(torch.int16)), (
            name
        )
        assert not got[[1, 3, 4, 6, 7]].view(torch.int16).any(), name


class PassThrough:
    """A read-spec plugin that answers what the built-in TP mapping would (equal TP)."""

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> list[ReadSpec] | None:
        if job.local.parallel.tp_size != job.decode_tp_size:
            return None
        return [
            ReadSpec(
                dst_tp_rank=job.local.parallel.tp_rank,
                local_block_ids=job.local_block_ids,
                remote_block_ids=job.remote_block_ids,
            )
        ]


def test_two_read_spec_plugins_answering_in_another_order_on_each_side_never_deliver(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two first-result plugins load in another order on P and D (entry points found in another
    order): D's replay takes the pass-through answer and accepts, P's takes the swapping one.
    P's own handshake check refuses it; nothing is written."""
    swap, same = probe_plugins.SwappedBlockIds(), PassThrough()
    p_pm = with_plugins(("same", same), ("swap", swap))  # pluggy asks the last registered first
    d_pm = with_plugins(("swap", swap), ("same", same))
    with caplog.at_level(logging.WARNING):
        outcome = run_push(pp=1, p_pm=p_pm, d_pm=d_pm)
    assert all(outcome.values()), outcome
    assert "'swap' swaps P's and D's block ids" in caplog.text + "".join(map(str, outcome.values()))


def run_push(**kwargs: Any) -> dict[int, str | None]:
    push = Push(**kwargs)
    try:
        outcome = push.push(timeout_s=30)
        push.assert_exact_or_failed(outcome)
    finally:
        push.close()
    return outcome
