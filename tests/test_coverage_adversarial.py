"""Adversarial metadata: P ranks that disagree with each other or with D, and plugins whose
producer set or region mapping does not tile D's blocks.

Each case must be refused before anything is written, or the request must fail naming it;
never reported done with bytes written by nobody or by two producers. Two levels:

- the handshake/plan replay of tests/test_coverage.py (every hook and check D and P run, the
  bytes computed from the descriptors P would post);
- real workers (in-process, loopback or real NIXL agents: bytes really copied), where D's blocks must
  hold exactly P's bytes for every request reported done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from cluster import kv_bytes, wait_until
from test_coverage import REFUSALS, build_decode, build_prefill, check_push

import kvpush.transports.loopback
from kvpush import hookimpl
from kvpush.core.errors import ConfigError, HandshakeError
from kvpush.core.manager import KvpushPluginManager, get_plugin_manager
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import (
    ModelSpec,
    ParallelConfig,
    PushJob,
    RankKey,
    ReadSpec,
    RegionAlignment,
    RequestMetadata,
    TransferParams,
)
from kvpush.core.worker import WorkerConfig
from kvpush.layouts.uniform import allocate_kv_caches

MODEL = ModelSpec(name="adv", num_layers=4, num_kv_heads=4, head_dim=4, block_size=2)
P_BLOCKS = ((3, 1),)
D_BLOCKS = ((0, 2),)


# ------------------------------------------------------------------------------ plugins


class ExpectOnly:
    """An expected-producers plugin that drops or adds producers."""

    def __init__(self, edit: Callable[[set[RankKey], ParallelConfig], set[RankKey]]) -> None:
        self.edit = edit

    @hookimpl(tryfirst=True)
    def kvpush_expected_producers(
        self, prefill: ParallelConfig, decode_tp_rank: int, decode_tp_size: int
    ) -> frozenset[RankKey]:
        from kvpush.core.producers import expected_producers

        rule = expected_producers(
            prefill_pp=prefill.pp_size,
            prefill_tp=prefill.tp_size,
            decode_tp_rank=decode_tp_rank,
            decode_tp_size=decode_tp_size,
        )
        return frozenset(self.edit(set(rule), prefill))


class SameSlot:
    """A read-spec plugin whose slices overlap: every P rank writes slot 0 of D's block."""

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> list[ReadSpec] | None:
        me, d_tp = job.local.parallel, job.decode_tp_size
        if me.tp_size <= d_tp:
            return None
        k = me.tp_size // d_tp
        return [
            ReadSpec(
                dst_tp_rank=me.tp_rank // k,
                local_block_ids=job.local_block_ids,
                remote_block_ids=job.remote_block_ids,
                remote_part=(0, k),
            )
        ]


class WrongHeads:
    """A read-spec plugin that sends every D rank P's first head slice (tiles D, wrong bytes)."""

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> list[ReadSpec] | None:
        me, d_tp = job.local.parallel, job.decode_tp_size
        if me.tp_size >= d_tp:
            return None
        k = d_tp // me.tp_size
        return [
            ReadSpec(
                dst_tp_rank=me.tp_rank * k + s,
                local_block_ids=job.local_block_ids,
                remote_block_ids=job.remote_block_ids,
                local_part=(0, k),
            )
            for s in range(k)
        ]


class FirstWindow:
    """An alignment plugin (PP 1) that pairs every region with D's first layer's regions."""

    @hookimpl
    def kvpush_align_regions(self, local: Any, peer: Any) -> RegionAlignment | None:
        if local.parallel.pp_size > 1:
            return None
        return RegionAlignment(remote_indices=[i % 2 for i in range(len(local.regions))])


def with_plugins(*plugins: tuple[str, object]) -> KvpushPluginManager:
    return get_plugin_manager(
        load_entrypoints=False, env={}, plugins=[("loopback", kvpush.transports.loopback), *plugins]
    )


def window(start: int, end: int) -> Callable[[int, int], ParallelConfig | None]:
    """Stage 1 of a PP-2, TP-1 P publishes layers ``[start, end)`` (stage 0 keeps ``[0, 2)``)."""

    def parallel_of(pp: int, tp: int) -> ParallelConfig | None:
        if pp != 1:
            return None
        return ParallelConfig(
            tp_size=1, tp_rank=tp, pp_size=2, pp_rank=1, num_layers=4, start_layer=start, end_layer=end
        )

    return parallel_of


# ------------------------------------------------------------------------------ replay


def replay(
    pm: KvpushPluginManager,
    *,
    pp: int = 2,
    p_tp: int = 1,
    d_tp: int = 1,
    parallel_of: Any = None,
    model: ModelSpec = MODEL,
) -> str:
    prefill = build_prefill(pm, model, "uniform", pp, p_tp, [4], parallel_of)
    decode = build_decode(pm, model, "uniform", d_tp, [4])
    try:
        check_push(pm, prefill, decode, P_BLOCKS, D_BLOCKS)
    except REFUSALS as err:
        return str(err)
    return "pushed"


def test_replay_refuses_overlapping_stage_windows() -> None:
    outcome = replay(with_plugins(), parallel_of=window(1, 4))  # stage 0 owns [0, 2)
    assert "layer" in outcome and "overlap" in outcome, outcome


def test_replay_refuses_a_gap_between_stage_windows() -> None:
    outcome = replay(with_plugins(), parallel_of=window(3, 4))  # layer 2 owned by nobody
    assert "layer" in outcome and "gap" in outcome, outcome


def test_replay_refuses_ranks_publishing_different_tp_sizes() -> None:
    def parallel_of(pp: int, tp: int) -> ParallelConfig | None:
        if pp != 1:
            return None
        return ParallelConfig.for_stage(num_layers=4, pp_size=2, pp_rank=1, tp_size=2, tp_rank=tp)

    outcome = replay(with_plugins(), parallel_of=parallel_of)
    assert "tp_size" in outcome, outcome


def test_replay_refuses_ranks_publishing_different_pp_sizes() -> None:
    def parallel_of(pp: int, tp: int) -> ParallelConfig | None:
        if pp != 1:
            return None
        return ParallelConfig.for_stage(num_layers=4, pp_size=3, pp_rank=1, tp_size=1, tp_rank=tp)

    outcome = replay(with_plugins(), parallel_of=parallel_of)
    assert "pp_size" in outcome, outcome


@pytest.mark.parametrize(
    "change",
    [{"num_kv_heads": 8}, {"head_dim": 8}, {"block_size": 4}, {"dtype": "float32"}],
    ids=["heads", "head_dim", "block_size", "dtype"],
)
def test_replay_refuses_a_rank_with_other_model_geometry(change: dict[str, Any]) -> None:
    pm = with_plugins()
    prefill = build_prefill(pm, MODEL, "uniform", 2, 1, [4])
    odd = build_prefill(pm, attrs.evolve(MODEL, **change), "uniform", 2, 1, [4])
    prefill.metas[RankKey(1, 0)] = odd.metas[RankKey(1, 0)]
    decode = build_decode(pm, MODEL, "uniform", 1, [4])
    with pytest.raises(REFUSALS) as err:
        check_push(pm, prefill, decode, P_BLOCKS, D_BLOCKS)
    assert next(iter(change)) in str(err.value), err.value


def test_a_payload_whose_model_contradicts_its_compatibility_hash_is_refused() -> None:
    """The hash is computed by the publisher: a rank publishing another model under the right
    hash (a build mixing versions, a tampered payload) is refused by the fetching side."""
    from kvpush.core.peers import check_published_hash

    pm = with_plugins()
    right = build_prefill(pm, MODEL, "uniform", 1, 1, [4]).metas[RankKey(0, 0)]
    wrong = attrs.evolve(right, model=attrs.evolve(MODEL, head_dim=8))
    check_published_hash(right, right)
    with pytest.raises(HandshakeError, match="head_dim"):
        check_published_hash(wrong, right)


def test_replay_refuses_an_expected_producer_plugin_that_drops_a_stage() -> None:
    pm = with_plugins(("drop_stage", ExpectOnly(lambda s, p: {r for r in s if r.pp_rank == 0})))
    outcome = replay(pm)
    assert outcome != "pushed" and "layer" in outcome, outcome


def test_replay_refuses_an_expected_producer_plugin_that_drops_a_tp_rank() -> None:
    pm = with_plugins(("drop_tp", ExpectOnly(lambda s, p: {r for r in s if r.tp_rank == 0})))
    outcome = replay(pm, pp=1, p_tp=2, d_tp=1)
    assert outcome != "pushed" and "head" in outcome, outcome


def test_replay_refuses_an_expected_producer_plugin_that_adds_one() -> None:
    pm = with_plugins(("add", ExpectOnly(lambda s, p: s | {RankKey(0, p.tp_size - 1)})))
    outcome = replay(pm, pp=1, p_tp=2, d_tp=2)
    assert outcome != "pushed" and "(pp=0, tp=1)" in outcome, outcome


def test_replay_refuses_read_specs_with_overlapping_slices() -> None:
    outcome = replay(with_plugins(("same_slot", SameSlot())), pp=1, p_tp=2, d_tp=1)
    assert outcome != "pushed" and "overlap" in outcome, outcome


def test_replay_refuses_read_specs_that_move_the_wrong_heads() -> None:
    outcome = replay(with_plugins(("wrong_heads", WrongHeads())), pp=1, p_tp=1, d_tp=2)
    assert outcome != "pushed" and "head" in outcome, outcome


def test_replay_refuses_an_alignment_that_maps_two_regions_onto_one() -> None:
    outcome = replay(with_plugins(("first_window", FirstWindow())), pp=1)
    assert outcome != "pushed" and "region" in outcome, outcome


# ------------------------------------------------------------------------------ real workers


class Push:
    """P (PP x TP) and D (TP) workers in this process (loopback, or real NIXL agents), with
    per-rank overrides."""

    def __init__(
        self,
        *,
        pp: int = 2,
        p_tp: int = 1,
        d_tp: int = 1,
        p_pm: KvpushPluginManager | None = None,
        d_pm: KvpushPluginManager | None = None,
        parallel_of: Any = None,
        model_of: Callable[[int, int], ModelSpec | None] = lambda pp, tp: None,
        dtype_of: Callable[[int, int], str | None] = lambda pp, tp: None,
        transport: str = "loopback",
    ) -> None:
        self.transport = transport
        self.p_pm, self.d_pm = p_pm or with_plugins(), d_pm or with_plugins()
        self.p_server, self.d_server = SideChannelServer("P"), SideChannelServer("D")
        self.senders: dict[RankKey, PushSender] = {}
        self.receivers: dict[int, PushReceiver] = {}
        self.p_caches: dict[RankKey, dict[str, torch.Tensor]] = {}
        self.d_caches: dict[int, dict[str, torch.Tensor]] = {}
        self.pp, self.p_tp = pp, p_tp
        try:
            self._start(pp, p_tp, d_tp, parallel_of, model_of, dtype_of)
        except BaseException:
            self.close()  # a rank refused to start: stop the ones that did
            raise

    def _start(self, pp: int, p_tp: int, d_tp: int, parallel_of: Any, model_of: Any, dtype_of: Any) -> None:
        gen = torch.Generator().manual_seed(7)
        for p in range(pp):
            for t in range(p_tp):
                parallel = ParallelConfig.for_stage(
                    num_layers=4, pp_size=pp, pp_rank=p, tp_size=p_tp, tp_rank=t
                )
                if parallel_of is not None:
                    parallel = parallel_of(p, t) or parallel
                model = model_of(p, t) or MODEL
                dtype = dtype_of(p, t)
                caches = allocate_kv_caches(attrs.evolve(model, dtype=dtype or model.dtype), parallel, 4)
                for tensor in caches.values():
                    tensor.view(torch.int8).copy_(
                        torch.randint(-100, 100, tensor.view(torch.int8).shape, generator=gen)
                    )
                config = self._config("P", parallel, model, self.p_server.port)
                sender = PushSender(config, caches, pm=self.p_pm)
                sender.start()
                self.p_server.publish(parallel.rank, sender.handshake_payload())
                self.senders[RankKey(p, t)], self.p_caches[RankKey(p, t)] = sender, caches
        for t in range(d_tp):
            parallel = ParallelConfig(tp_size=d_tp, tp_rank=t, num_layers=4)
            caches = allocate_kv_caches(MODEL, parallel, 4)
            receiver = PushReceiver(
                self._config("D", parallel, MODEL, self.d_server.port), caches, pm=self.d_pm
            )
            receiver.start()
            self.d_server.publish(parallel.rank, receiver.handshake_payload())
            self.receivers[t], self.d_caches[t] = receiver, caches

    def _config(self, engine: str, parallel: ParallelConfig, model: ModelSpec, port: int) -> WorkerConfig:
        return WorkerConfig(
            engine_id=engine,
            parallel=parallel,
            model=model,
            transport=self.transport,
            side_channel_port=port,
            request_timeout_s=20,
        )

    def push(self, timeout_s: float = 15.0) -> dict[int, str | None]:
        """One request; each D rank's outcome (None: done, else the reason it failed)."""
        params = TransferParams.from_dict(
            {
                "remote_engine_id": "P",
                "remote_host": "127.0.0.1",
                "remote_port": self.p_server.port,
                "transfer_id": "x-1",
            }
        )
        for receiver in self.receivers.values():
            receiver.add_request(RequestMetadata(request_id="d-1", block_ids=D_BLOCKS, params=params))
        for sender in self.senders.values():
            sender.request_finished("p-1", P_BLOCKS, match_key="x-1")
        outcome: dict[int, str | None] = {}

        def ended() -> bool:
            for tp, receiver in self.receivers.items():
                got = receiver.get_finished()
                if got.done:
                    outcome[tp] = None
                for reason in got.failed.values():
                    outcome[tp] = reason
            return len(outcome) == len(self.receivers)

        wait_until(ended, timeout_s, "every D rank to end request d-1")
        time.sleep(0.2)  # a WRITE landing after the report would show in the bytes below
        return outcome

    def assert_exact_or_failed(self, outcome: dict[int, str | None]) -> None:
        """A D rank that reported done holds exactly P's bytes in its registered blocks."""
        for tp, reason in outcome.items():
            if reason is not None:
                continue
            for layer, got in self.d_caches[tp].items():
                owners = [key for key, caches in self.p_caches.items() if layer in caches]
                stages = {key.pp_rank for key in owners}
                assert stages, f"D rank {tp} done though no stage holds {layer}: a gap"
                assert len(stages) == 1, f"D rank {tp} done though stages {sorted(stages)} both hold {layer}"
                parts = [kv_bytes(self.p_caches[k][layer]) for k in sorted(owners, key=lambda k: k.tp_rank)]
                source = torch.cat(parts, dim=2)
                heads = got.shape[2]
                want = source[:, list(P_BLOCKS[0]), tp * heads : (tp + 1) * heads]
                assert torch.equal(kv_bytes(got)[:, list(D_BLOCKS[0])], want), f"D rank {tp} {layer} wrong"

    def close(self) -> None:
        for worker in [*self.senders.values(), *self.receivers.values()]:
            worker.close()
        self.p_server.close()
        self.d_server.close()


def run(expect_failure: bool = True, **kwargs: Any) -> dict[int, str | None]:
    push = Push(**kwargs)
    try:
        outcome = push.push()
        push.assert_exact_or_failed(outcome)
    finally:
        push.close()
    if expect_failure:
        assert all(reason for reason in outcome.values()), outcome
    return outcome


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_workers_honest_pp2_push_is_exact(transport: str) -> None:
    assert run(expect_failure=False, transport=transport, d_tp=2) == {0: None, 1: None}


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_workers_overlapping_stage_windows_fail_the_request(transport: str) -> None:
    outcome = run(parallel_of=window(1, 4), transport=transport)
    assert "overlap" in outcome[0], outcome


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_workers_gap_between_stage_windows_fails_the_request(transport: str) -> None:
    outcome = run(parallel_of=window(3, 4), transport=transport)
    assert "gap" in outcome[0], outcome


def test_workers_rank_with_other_head_dim_fails_the_request() -> None:
    outcome = run(model_of=lambda pp, tp: attrs.evolve(MODEL, head_dim=8) if pp == 1 else None)
    assert "head_dim" in outcome[0], outcome


def test_workers_expected_producers_plugin_dropping_a_stage_fails_the_request() -> None:
    drop = ExpectOnly(lambda s, p: {r for r in s if r.pp_rank == 0})
    pm = with_plugins(("drop_stage", drop))
    outcome = run(p_pm=pm, d_pm=pm)
    assert "layer" in outcome[0], outcome


def test_workers_expected_producers_plugin_dropping_a_tp_rank_fails_the_request() -> None:
    drop = ExpectOnly(lambda s, p: {r for r in s if r.tp_rank == 0})
    pm = with_plugins(("drop_tp", drop))
    outcome = run(pp=1, p_tp=2, d_tp=1, p_pm=pm, d_pm=pm)
    assert "head" in outcome[0], outcome


def test_workers_overlapping_read_specs_fail_the_request() -> None:
    pm = with_plugins(("same_slot", SameSlot()))
    outcome = run(pp=1, p_tp=2, d_tp=1, p_pm=pm, d_pm=pm)
    assert "overlap" in outcome[0], outcome


def test_workers_rank_publishing_another_tp_size_fails_the_request() -> None:
    def parallel_of(pp: int, tp: int) -> ParallelConfig | None:
        if pp != 1:
            return None
        return ParallelConfig.for_stage(num_layers=4, pp_size=2, pp_rank=1, tp_size=2, tp_rank=0)

    outcome = run(parallel_of=parallel_of)
    assert "tp_size" in outcome[0], outcome


@pytest.mark.parametrize(
    "change",
    [{"num_kv_heads": 8}, {"block_size": 4}, {"dtype": "float32"}],
    ids=["heads", "block_size", "dtype"],
)
def test_workers_rank_with_other_model_geometry_fails_the_request(change: dict[str, Any]) -> None:
    outcome = run(model_of=lambda pp, tp: attrs.evolve(MODEL, **change) if pp == 1 else None)
    assert next(iter(change)) in outcome[0], outcome


def test_workers_read_spec_plugin_on_p_only_moving_wrong_heads_fails_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """D plans the built-in way and sees a tiling; P's plugin would give D rank 1 the heads of
    rank 0: P's own handshake with D rank 1 refuses it (rank 0 gets its right heads), and tells
    D rank 1 why (P loads its agent notify-only and answers its HELLO FAIL)."""
    with caplog.at_level("WARNING", logger="kvpush.core.peers"):
        outcome = run(
            expect_failure=False, pp=1, p_tp=1, d_tp=2, p_pm=with_plugins(("wrong_heads", WrongHeads()))
        )
    assert outcome[1] and "wrong heads" in outcome[1], outcome
    assert "refused this D rank's handshake metadata" in outcome[1], outcome
    assert "wrong heads" in caplog.text


def test_workers_alignment_plugin_on_p_only_pairing_two_regions_with_one_fails_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="kvpush.core.peers"):
        outcome = run(pp=1, p_pm=with_plugins(("first_window", FirstWindow())))
    assert "an overlap" in caplog.text
    assert "an overlap" in outcome[0], outcome  # D hears P's reason, not a HELLO timeout


def test_workers_rank_whose_cache_dtype_is_not_the_models_refuses_to_start() -> None:
    """Stage 1 publishes the model's bfloat16 but holds float32 blocks (twice the bytes per
    head). It used to start and D named the block length at its handshake; the layout now
    refuses the rank at start, naming the dtype (a cache of another format with the same
    element size, fp8 e4m3 vs e5m2, would have passed D's length check: see
    tests/test_plugin_author_probe.py). D's own length check stays covered by the replay of
    a rank publishing another dtype (test_replay_refuses_a_rank_with_other_model_geometry)."""
    with pytest.raises(ConfigError, match=r"holds float32 but ModelSpec.dtype is 'bfloat16'"):
        run(dtype_of=lambda pp, tp: "float32" if pp == 1 else None)


def test_replay_refuses_ranks_whose_regions_hold_other_heads_than_their_tp_size_says() -> None:
    """Every P rank publishes TP 1, but its regions hold the two heads of a TP-2 rank (a layout
    that does not check its tensors): a whole-block WRITE of half a block's bytes."""
    pm = with_plugins()
    prefill = build_prefill(pm, MODEL, "uniform", 2, 2, [4])
    for key in list(prefill.metas):
        meta = prefill.metas.pop(key)
        if key.tp_rank == 0:
            prefill.metas[key] = attrs.evolve(meta, parallel=attrs.evolve(meta.parallel, tp_size=1))
    decode = build_decode(pm, MODEL, "uniform", 1, [4])
    try:
        check_push(pm, prefill, decode, P_BLOCKS, D_BLOCKS)
    except REFUSALS as err:
        assert "head" in str(err), err
    else:
        pytest.fail("pushed")


def test_workers_expected_producers_plugin_adding_one_fails_the_rank_it_adds_to() -> None:
    """D rank 0 would wait for P rank (0, 1), which writes only D rank 1: D rank 0 refuses it
    at handshake, and P rank (0, 1) fails the request for D rank 1 too (its plan disagrees with
    the producer set: P checks it before posting)."""
    pm = with_plugins(("add", ExpectOnly(lambda s, p: s | {RankKey(0, p.tp_size - 1)})))
    outcome = run(pp=1, p_tp=2, d_tp=2, p_pm=pm, d_pm=pm)
    assert "extra producer" in outcome[0], outcome
    assert "kvpush_expected_producers" in outcome[1], outcome


def test_workers_expected_producers_plugin_on_p_only_fails_the_request_naming_the_hook() -> None:
    """P counts stage 1 for no D rank, D (built-in rule) waits for it: stage 1's plan check
    fails the request before it posts, and D is told why."""
    pm = with_plugins(("drop_stage", ExpectOnly(lambda s, p: {r for r in s if r.pp_rank == 0})))
    outcome = run(p_pm=pm)
    assert "kvpush_expected_producers" in outcome[0], outcome


@pytest.mark.parametrize("layout", ["uniform", "hma"])
def test_replay_refuses_a_stage_whose_regions_name_layers_outside_its_window(layout: str) -> None:
    """Stage 1 owns layers 2-3 but its regions name layers.1 and layers.3 (a layout bug): D
    would get layers.1 twice and layers.2 never. Offset slicing (uniform) and semantic matching
    (hma) both pair by name, and are refused."""
    pm = with_plugins()
    model = attrs.evolve(MODEL, layer_groups=(0, 1, 0, 1)) if layout == "hma" else MODEL
    prefill = build_prefill(pm, model, layout, 2, 1, [4] * model.num_groups)
    stage = prefill.metas[RankKey(1, 0)]
    renamed = tuple(
        attrs.evolve(r, layer_names=("layers.1",)) if r.layer_names == ("layers.2",) else r
        for r in stage.regions
    )
    prefill.metas[RankKey(1, 0)] = attrs.evolve(stage, regions=renamed)
    decode = build_decode(pm, model, layout, 1, [4] * model.num_groups)
    blocks = (
        tuple(P_BLOCKS[0] for _ in range(model.num_groups)),
        tuple(D_BLOCKS[0] for _ in range(model.num_groups)),
    )
    with pytest.raises(REFUSALS) as err:
        check_push(pm, prefill, decode, *blocks)
    assert "layers.1" in str(err.value) or "layers.2" in str(err.value), err.value
