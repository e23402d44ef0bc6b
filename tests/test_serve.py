"""``kvpush bench --serve``: workload pieces on their own, and one short open-loop run of real
P and D processes over NIXL with every sampled request verified byte for byte."""

from __future__ import annotations

import argparse

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
