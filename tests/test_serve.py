"""``kvpush bench --serve``: workload pieces on their own, and one short open-loop run of real
P and D processes over NIXL with every sampled request verified byte for byte."""

from __future__ import annotations

import argparse

import attrs
import numpy as np
import pytest

from kvpush.demo import bench, serve


def test_presets_have_real_kv_geometry() -> None:
    per_token = {}
    for name in serve.PRESETS:
        w = serve.Workload(preset=name)
        model = w.model()
        heads = 1 if model.attention == "mla" else model.num_kv_heads
        sides = 1 if model.attention == "mla" else 2
        per_token[name] = model.num_layers * sides * heads * model.head_dim * 2
    assert per_token["llama3-8b"] == 128 * 1024  # 32 layers x K,V x 8 heads x 128 x bf16
    assert per_token["llama3-70b-tp8"] == 80 * 2 * 128 * 2
    assert per_token["deepseek-v3-mla"] == 61 * 576 * 2
    hybrid = serve.Workload(preset="hybrid")
    assert hybrid.layout == "hma" and hybrid.model().num_groups == 2
    assert hybrid.blocks_per_group(4096) == [256, 65]  # the sliding group keeps the window only
    custom = serve.Workload(preset="llama3-8b", layers=4, kv_heads=2)
    assert custom.model().num_layers == 4 and custom.model().num_kv_heads == 2
    with pytest.raises(ValueError, match="--kv-heads must be positive"):
        serve.Workload(kv_heads=0).model()
    with pytest.raises(ValueError, match="unknown --preset"):
        serve.Workload(preset="gpt-9").model()


def test_prompt_lengths_and_pools() -> None:
    w = serve.Workload(median_tokens=512, sigma=0.5, max_tokens=4096, requests=2000, seed=3)
    lengths = np.array(w.prompt_lengths())
    assert 450 < np.median(lengths) < 580 and lengths.max() <= 4096 and lengths.min() >= 1
    assert serve.Workload(tokens=(100, 300), requests=5).prompt_lengths() == [100, 300, 100, 300, 100]
    with pytest.raises(ValueError, match="cannot hold one prompt"):
        serve.Workload(max_tokens=4096, pool_blocks=10).pool()
    pool = serve.BlockPool(64, seed=1)
    first = pool.alloc(40)
    assert first is not None and len(set(first)) == 40 and pool.alloc(30) is None
    pool.release(first[:20])
    second = pool.alloc(44)
    assert second is not None and len(set(second) | set(first[20:])) == 64  # no block handed out twice
    assert first != sorted(first)  # scattered, as a churned paged cache hands them out


def test_pattern_differs_per_request_region_and_block() -> None:
    a, b = serve.pattern(1, 4, 8), serve.pattern(2, 4, 8)
    assert a.shape == (4, 8) and a.dtype == np.int16 and (a != b).all()
    assert len(np.unique(a)) == a.size and a.min() > 0


def test_plot_without_runs_and_summary_of_failures(tmp_path) -> None:
    outcomes = [serve.Outcome(number=0, rid="a", tokens=16, nbytes=10, arrival=1.0, finish=1.0, done=1.002)]
    outcomes.append(serve.Outcome(number=1, rid="b", tokens=16, nbytes=10, arrival=1.0, failure="timed out"))
    summary = serve.summarize(5.0, outcomes)
    assert summary["completed"] == 1 and summary["failed"] == 1 and summary["failures"] == ["timed out"]
    assert summary["p50_ms"] == pytest.approx(2.0)
    line = serve.plot({"runs": [], "workload": {"preset": "x", "device": "cpu"}}, str(tmp_path / "p.png"))
    assert "p.png" in line


def test_serve_flags_parse_through_the_bench_parser() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--serve", "--preset", "llama3-70b-tp8", "--rate", "5", "--rate", "20", "--sweep"]
    )
    w = serve.workload_from(args)
    assert args.serve and args.rate == [5.0, 20.0] and w.preset == "llama3-70b-tp8" and w.transport == "nixl"


def test_short_open_loop_run_completes_and_verifies_over_nixl() -> None:
    w = serve.Workload(
        preset="llama3-8b", layers=2, median_tokens=48, max_tokens=128, requests=12, verify_every=2
    )
    result = serve.run(w, [40.0], sweep=False, p99_factor=2.0, ideal=True, say=lambda _m: None)
    (entry,) = result["runs"]
    for method in ("kvpush", "ideal"):
        s = entry[method]
        assert s["completed"] == 12 and s["failed"] == 0, s
        assert s["verified"] == 6 and s["verify_failed"] == 0 and s["sample_rate"] == 0.5
        assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert result["prompt_tokens"]["max"] <= 128 and result["knee_rps"] in (None, 40.0)


def test_deferred_checks_hold_samples_until_checked_in_arrival_order() -> None:
    seen: list[int] = []
    checks = serve.DeferredChecks(
        lambda number, blocks: seen.append(number) or (None if number % 2 == 0 else "odd")
    )
    assert not checks
    checks.add("a", 1, [[5]])
    checks.add("b", 2, [[6]])
    reports: list[tuple[str, str | None, list[list[int]]]] = []
    checks.run_one(lambda *r: reports.append(r))
    assert reports == [("a", "odd", [[5]])] and checks
    checks.run_all(lambda *r: reports.append(r))
    assert seen == [1, 2] and reports[1] == ("b", None, [[6]]) and not checks


def test_a_wrong_block_is_named_with_the_request_whose_bytes_it_holds() -> None:
    """A failed sample says which blocks are wrong and whose pattern they hold, and a run
    with a failed sample is counted (and reported) as failed, never as verified."""
    from kvpush.core.manager import get_plugin_manager

    w = serve.Workload(preset="llama3-8b", layers=2, median_tokens=48, max_tokens=128)
    config = serve._worker_config(w, "test", 0, "cpu")
    caches = serve._allocate(w, config, "cpu")
    regions = get_plugin_manager().layout(w.layout).describe(caches, config.parallel, config.model)
    content = serve.Content(regions, w.max_request_bytes(), "cpu")
    blocks = [[3, 1, 4]]
    content.fill(5, blocks)
    assert content.miss(5, blocks) is None
    content.fill(9, [[7, 1]])  # block 1 now holds request 9's second block in every region
    miss = content.miss(5, blocks)
    assert miss is not None and miss.startswith(f"{len(regions)} of {3 * len(regions)} blocks wrong"), miss
    assert "block 1 (id 1)" in miss and "pattern of request 9" in miss, miss
    outcomes = [
        serve.Outcome(number=n, rid=str(n), tokens=16, nbytes=1, arrival=1.0, finish=1.0, done=1.001)
        for n in range(3)
    ]
    outcomes[0].verified, outcomes[1].verified, outcomes[1].miss = True, False, miss
    outcomes[2].verified = "deferred"  # never checked: not verified either
    s = serve.summarize(5.0, outcomes)
    assert s["verified"] == 1 and s["verify_failed"] == 2 and s["verify_misses"][0] == f"request 1: {miss}"


def test_every_request_sampled_from_a_tight_pool_is_verified() -> None:
    """verify_every=1 with room for three prompts: D holds each sample's blocks until it checks
    it (idle, or when an allocation needs them), and every request still lands and verifies."""
    w = serve.Workload(preset="llama3-8b", layers=2, tokens=(64,), requests=8, verify_every=1, pool_blocks=12)
    result = serve.run(w, [100.0], sweep=False, p99_factor=2.0, ideal=True, say=lambda _m: None)
    (entry,) = result["runs"]
    for method in ("kvpush", "ideal"):
        s = entry[method]
        assert s["completed"] + s["failed"] == 8, s
        # every request that landed is verified (on a loaded box P's pool may refuse a few)
        assert s["verified"] == s["completed"] >= 1 and s["verify_failed"] == 0, s
        assert set(s["failures"]) <= {"P's block pool is full", "D's block pool is full"}, s


# ---------------------------------------------------------------------------- multi-rank


def test_topology_flags_parse_and_are_checked() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--serve",
            "--preset",
            "llama3-70b-tp8",
            "--prefill-pp",
            "2",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "8",
        ]
    )
    w = serve.workload_from(args)
    assert w.multi_rank and w.topology() == (2, 2, 8)
    assert w.model().num_kv_heads == 8  # 1 head per rank at the preset's TP8: the model has 8
    assert not serve.Workload(preset="llama3-70b-tp8").multi_rank
    assert serve.Workload(preset="llama3-70b-tp8").model().num_kv_heads == 1  # one rank pair
    with pytest.raises(ValueError, match="--decode-tp 3 does not divide the model's 8 KV heads"):
        serve.Workload(decode_tp=3).topology()
    with pytest.raises(ValueError, match="--prefill-tp 2 and --decode-tp 3"):
        serve.Workload(preset="deepseek-v3-mla", prefill_tp=2, decode_tp=3).topology()
    with pytest.raises(ValueError, match="--prefill-pp 5 exceeds the model's 4 layers"):
        serve.Workload(layers=4, prefill_pp=5).topology()
    with pytest.raises(ValueError, match="needs a multi-rank run"):
        serve.Workload(decode_device="cuda:0,cuda:1").rank_devices()
    assert serve.Workload(decode_tp=2, device="cuda:0,cuda:1").rank_devices() == (
        ["cuda:0", "cuda:1"],
        ["cuda:0", "cuda:1"],
    )


def test_kernel_ideal_is_refused_on_the_cpu_with_the_flag_named() -> None:
    from kvpush.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--ideal kernel .* needs --device cuda"):
        serve.check_ideals(serve.Workload(), ["nixl", "kernel"])
    serve.check_ideals(serve.Workload(), ["nixl"])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert serve.main(parser.parse_args(["--serve", "--ideal", "kernel", "--requests", "2"])) == 2


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
@pytest.mark.parametrize("replicate", [False, True])
def test_ideal_plan_covers_each_d_block_once_with_kvpushs_producers(
    prefill_tp: int, decode_tp: int, replicate: bool
) -> None:
    """The ideal's per-(P rank, D rank) slices: D counts exactly kvpush's producers, and the
    slices written into one D block tile it without gaps or overlap (or, MLA, all of it)."""
    from kvpush.core.producers import expected_producers
    from kvpush.demo.serve_kernel import targets

    writers: dict[int, list[tuple[int, tuple[int, int]]]] = {}
    for p in range(prefill_tp):
        for d, local_part, remote_part in targets(p, prefill_tp, decode_tp, replicate):
            assert local_part == (0, 1) or remote_part == (0, 1)
            writers.setdefault(d, []).append((p, remote_part))
    for d in range(decode_tp):
        expected = expected_producers(
            prefill_pp=1, prefill_tp=prefill_tp, decode_tp_rank=d, decode_tp_size=decode_tp
        )
        assert {p for p, _ in writers[d]} == {k.tp_rank for k in expected}
        parts = sorted(part for _, part in writers[d])
        if replicate or prefill_tp <= decode_tp:
            assert set(parts) == {(0, 1)}
        else:
            assert parts == [(i, prefill_tp // decode_tp) for i in range(prefill_tp // decode_tp)]


def test_span_tables_pair_row_for_row_across_tp_sizes() -> None:
    """P TP1 (8 heads) -> D TP2: P's two head slices of a block are its two halves, and D's
    whole block has the same row lengths, so a request's spans pair up."""
    from kvpush.core.types import ParallelConfig
    from kvpush.demo.serve_kernel import SpanTable, align
    from kvpush.layouts.uniform import allocate_kv_caches, describe_uniform

    model = serve.Workload(layers=2, decode_tp=2).model()
    p_par = ParallelConfig(tp_size=1, num_layers=2)
    d_par = ParallelConfig(tp_size=2, tp_rank=1, num_layers=2)
    p_regions = describe_uniform(allocate_kv_caches(model, p_par, 8), p_par, model)
    d_regions = describe_uniform(allocate_kv_caches(model, d_par, 8), d_par, model)
    groups = [r.kv_group for r in p_regions]
    local = SpanTable(p_regions, (1, 2), groups)
    remote = SpanTable(align(p_regions, d_regions), (0, 1), groups)
    src, n = local.spans([[5, 2]])
    dst, m = remote.spans([[0, 7]])
    assert (n == m).all() and len(n) == 2 * 2 * 2  # layers x K/V x blocks
    block = p_regions[0].block_len
    assert src[0] == p_regions[0].base_addr + 5 * p_regions[0].block_stride + block // 2
    assert dst[1] == d_regions[0].base_addr + 7 * d_regions[0].block_stride
    assert local.bytes_per_block(1) == [2 * 2 * block // 2]


def _check_multi_rank(result: dict, requests: int, sampled: int) -> None:
    assert {"workload", "geometry", "topology", "ideals", "prompt_tokens", "strategy_mix", "runs"} <= set(
        result
    )
    (entry,) = result["runs"]
    for method in ("kvpush", "ideal"):
        s = entry[method]
        assert s["completed"] == requests and s["failed"] == 0, s
        assert s["verified"] == sampled and s["verify_failed"] == 0, s
        assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"] and s["mean_bytes"] > 0
        assert {"offered_rps", "achieved_rps", "p90_ms", "gbps", "sample_rate"} <= set(s)


@pytest.mark.parametrize(
    ("preset", "prefill_pp", "prefill_tp", "decode_tp"),
    [("llama3-8b", 2, 1, 2), ("llama3-8b", None, 2, None), ("deepseek-v3-mla", None, None, 2)],
    ids=["PP2xTP1-to-TP2", "TP2-to-TP1", "mla-TP1-to-TP2"],
)
def test_multi_rank_open_loop_run_verifies_on_every_d_rank(
    preset: str, prefill_pp: int | None, prefill_tp: int | None, decode_tp: int | None
) -> None:
    w = serve.Workload(
        preset=preset,
        layers=2,
        median_tokens=40,
        max_tokens=96,
        requests=6,
        verify_every=2,
        poll_s=1e-3,
        timeout_s=30,
        prefill_pp=prefill_pp,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    )
    result = serve.run(w, [20.0], sweep=False, p99_factor=2.0, ideal=True, say=lambda _m: None)
    _check_multi_rank(result, requests=6, sampled=3)
    topo = result["topology"]
    assert (topo["prefill_pp"], topo["prefill_tp"], topo["decode_tp"]) == w.topology()
    model = w.model()
    sides = 1 if model.attention == "mla" else 2
    per_token = model.num_layers * sides * model.num_kv_heads * model.head_dim * 2
    writes = (decode_tp or 1) if model.attention == "mla" else 1  # the latent goes to every D rank
    s = result["runs"][0]["kvpush"]
    total = round(s["mean_bytes"] * s["completed"])
    assert total % (writes * per_token * model.block_size) == 0  # whole blocks of every head


def test_multi_rank_blocks_go_back_to_the_pools_as_requests_end() -> None:
    """P's and D's blocks return to their pools as each request ends, not at the end of the
    run: a pool one block short of holding every request at once serves them all."""
    base = serve.Workload(layers=2, median_tokens=40, max_tokens=96, requests=5, verify_every=0, poll_s=1e-3)
    need = sum(base.blocks_per_group(t)[0] for t in base.prompt_lengths())
    w = attrs.evolve(base, prefill_tp=2, pool_blocks=max(need - 1, base.blocks_per_group(96)[0]))
    result = serve.run(w, [2.0], sweep=False, p99_factor=2.0, ideal=False, say=lambda _m: None)
    s = result["runs"][0]["kvpush"]
    assert s["completed"] == 5 and s["failures"] == [], s


class _CpuCopier:
    """Stands in for the CUDA kernel on the CPU: the same span lists (and, indirect, the same
    ``DeviceTable`` encoding of addresses), copied with ``kvpush.core.kernels.copy_spans_cpu``."""

    class _Landed:
        @staticmethod
        def query() -> bool:
            return True

    def launch(self, src, dst, lengths, **_kw):
        from kvpush.core.kernels import copy_spans_cpu

        copy_spans_cpu(src, dst, lengths)
        return self._Landed()

    def launch_indirect(self, ltab, rtab, lids, rids, **_kw):
        from kvpush.core.kernels import copy_spans_cpu

        def resolve(tab, ids):
            return tab.tensor.data_ptr() + tab.tensor.numpy()[np.asarray(ids)] * 16

        copy_spans_cpu(resolve(ltab, lids), resolve(rtab, rids), ltab.length)
        return self._Landed()

    def copy(self, src, dst, lengths, **_kw) -> int:
        from kvpush.core.kernels import copy_spans_cpu

        return copy_spans_cpu(src, dst, lengths)


@pytest.fixture
def cpu_kernel(monkeypatch):
    from kvpush.core import kernels
    from kvpush.demo import serve_kernel

    monkeypatch.setattr(serve_kernel, "require_cuda", lambda *_a, **_k: None)
    monkeypatch.setattr(kernels, "copier_for", lambda _device: _CpuCopier())


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_kernel_ideal_lands_every_head_where_d_expects_it(
    cpu_kernel, prefill_tp: int, decode_tp: int
) -> None:
    """The kernel ideal's rows for P TP -> D TP: P's ranks fill their heads, each copies its
    slices into D-shaped copies, and every D rank's copy holds D's expected (global) heads."""
    from kvpush.core.types import ParallelConfig
    from kvpush.demo.content import fill_request, region_views, verify_request
    from kvpush.demo.serve_kernel import KernelIdeal, SpanTable, align, targets
    from kvpush.layouts.uniform import allocate_kv_caches, describe_uniform

    model = serve.Workload(layers=2, decode_tp=2).model()
    seed, p_ids, d_ids = 11, [[3, 5, 1]], [[6, 0, 2]]
    d_side = []
    for t in range(decode_tp):
        par = ParallelConfig(tp_size=decode_tp, tp_rank=t, num_layers=2)
        caches = allocate_kv_caches(model, par, 8)
        d_side.append((par, caches, describe_uniform(caches, par, model)))
    ideals = []
    for r in range(prefill_tp):
        par = ParallelConfig(tp_size=prefill_tp, tp_rank=r, num_layers=2)
        caches = allocate_kv_caches(model, par, 8)
        regions = describe_uniform(caches, par, model)
        fill_request(regions, region_views(caches, regions), par, seed, p_ids)
        groups = [x.kv_group for x in regions]
        pairs = [
            (SpanTable(regions, lp, groups), SpanTable(align(regions, d_side[d][2]), rp, groups))
            for d, lp, rp in targets(r, prefill_tp, decode_tp, replicate=False)
        ]
        ideal = KernelIdeal("cpu", pairs)
        assert ideal.indirect  # uniform rows: the id-only launch is taken
        spans = ideal.spans(p_ids, d_ids)
        assert ideal.launch(spans).query() and spans.addrs is None  # ids only, no address lookup
        assert ideal.check(spans)
        ideals.append((ideal, spans, caches))
    for par, caches, regions in d_side:
        assert verify_request(regions, region_views(caches, regions), par, seed, d_ids) is None
    ideal, spans, _ = ideals[0]
    d_caches = d_side[0][1]
    next(iter(d_caches.values()))[0, 6].view(-1)[0] += 1  # a byte of D's first block, K of layer 0
    assert not ideal.check(spans)
    assert verify_request(d_side[0][2], region_views(d_caches, d_side[0][2]), d_side[0][0], seed, d_ids)


def test_pair_kernel_ideal_run_replays_the_arrivals(cpu_kernel) -> None:
    """``--ideal kernel`` in the one-pair harness, the CPU copy standing in for the kernel: every
    request lands by the same Poisson arrivals and the sampled ones compare equal."""
    w = serve.Workload(layers=2, median_tokens=40, max_tokens=96, requests=6, verify_every=2, poll_s=1e-3)
    with serve.ServePair(w, modes=("kvpush", "kernel")) as pair:
        s = serve.summarize(20.0, pair.run(20.0, w.prompt_lengths(), ideal="kernel", say=lambda _m: None))
    assert s["completed"] == 6 and s["verified"] == 3 and s["verify_failed"] == 0, s
    assert 0 < s["p50_ms"] <= s["max_ms"]


def test_pair_kernel_writer_ideal_hands_each_finish_to_a_thread(cpu_kernel) -> None:
    """``--ideal kernel_writer``: the same copies launched and polled on a writer thread; every
    request lands, the samples compare equal, and each was launched after its finish."""
    w = serve.Workload(layers=2, median_tokens=40, max_tokens=96, requests=6, verify_every=2, poll_s=1e-3)
    with serve.ServePair(w, modes=("kvpush", "kernel_writer")) as pair:
        outcomes = pair.run(20.0, w.prompt_lengths(), ideal="kernel_writer", say=lambda _m: None)
    s = serve.summarize(20.0, outcomes)
    assert s["completed"] == 6 and s["verified"] == 3 and s["verify_failed"] == 0, s
    for o in outcomes:
        assert o.finish <= o.marks["handed"] <= o.marks["post"] <= o.marks["settled"] == o.done


def test_kernel_writer_ideal_is_refused_for_several_ranks() -> None:
    from kvpush.core.errors import ConfigError

    with pytest.raises(ConfigError, match="kernel_writer runs with one P and one D rank"):
        serve.check_ideals(serve.Workload(prefill_tp=2), ["kernel_writer"])


def _cuda() -> bool:
    from kvpush.core.kernels import triton_available

    return triton_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("topology", [{}, {"prefill_pp": 2, "decode_tp": 2}, {"prefill_tp": 2}])
def test_kernel_ideal_on_cuda_replays_and_verifies(topology: dict) -> None:
    """On a GPU: kvpush and both ideals (raw NIXL, the one-kernel copy) for one pair and for
    multi-rank topologies, every sampled request verified."""
    w = serve.Workload(
        layers=2, median_tokens=40, max_tokens=96, requests=8, verify_every=2, device="cuda:0", **topology
    )
    ideals = ["nixl", "kernel"] if topology else ["nixl", "kernel", "kernel_writer"]
    result = serve.run(w, [20.0], sweep=False, p99_factor=2.0, ideal=ideals, say=lambda _m: None)
    (entry,) = result["runs"]
    for method in ("kvpush", "ideal", "ideal_kernel", *(["ideal_kernel_writer"] if not topology else [])):
        s = entry[method]
        assert s["completed"] == 8 and s["verified"] == 4 and s["verify_failed"] == 0, (method, s)


def test_nixl_options_reach_kvpushs_transport_in_both_benches() -> None:
    """``--nixl-option`` sets kvpush's NIXL transport options (the wrapped one under cuda_ipc)
    in the sweep's pair and in the serve bench (one pair and multi-rank)."""
    from kvpush.cli import build_parser
    from kvpush.demo import bench

    args = build_parser().parse_args(
        ["bench", "--nixl-option", "progress_thread=true", "--nixl-option", "num_threads=2"]
    )
    assert dict(args.nixl_option) == {"progress_thread": True, "num_threads": 2}
    assert bench.nixl_transport_options("nixl", {"progress_thread": True}) == {"progress_thread": True}
    assert bench.nixl_transport_options("cuda_ipc", {"progress_thread": True}) == {
        "inner_options": {"progress_thread": True}
    }
    assert bench.nixl_transport_options("nixl", {}) == {}
    model = serve.Workload(layers=2).model()
    spec = bench.PairSpec(block_bytes=4096, nixl_options={"progress_thread": True})
    assert bench._worker_config(spec, "P", model).transport_options == {"progress_thread": True}
    w = serve.Workload(layers=2, transport="cuda_ipc", nixl_options={"progress_thread": True})
    config = serve._worker_config(w, "P", 0, "cpu")
    assert config.transport_options == {"inner_options": {"progress_thread": True}}
