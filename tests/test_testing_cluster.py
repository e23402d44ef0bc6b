"""kvpush.testing.run_cluster: real P and D processes over NIXL, every byte verified."""

from __future__ import annotations

import argparse

import cluster_layouts
import pytest

from kvpush.core.errors import ConfigError
from kvpush.core.types import ModelSpec
from kvpush.demo import runner
from kvpush.testing import ClusterReport, run_cluster


def test_heterogeneous_tp_packed_with_prefix_hits():
    report = run_cluster(
        "uniform", prefill_pp=2, prefill_tp=2, decode_tp=1, strategy="packed", prefix_hit_rate=0.5, requests=6
    )
    report.raise_for_failures()
    assert report.verified == 6 and report.row["packed_destinations"] > 0


def test_broken_layout_is_reported_with_the_rule():
    model = ModelSpec(name="m", num_layers=4, num_kv_heads=2, head_dim=8, block_size=4)
    report = run_cluster("tensor_names", model=model, plugins=[cluster_layouts], decode_tp=1, requests=2)
    assert not report.ok and report.verified == 0
    assert "breaks the layer_names rule" in report.failures["*"]
    with pytest.raises(AssertionError, match="0/2 requests verified"):
        report.raise_for_failures()


def test_arguments_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"has no LayoutProvider\.demo_model; pass model="):
        run_cluster("tensor_names", plugins=[cluster_layouts])
    with pytest.raises(ConfigError, match="no layout named 'nope'"):
        run_cluster("nope")
    with pytest.raises(ConfigError, match="'loopback' reaches agents of one process only"):
        run_cluster(transport="loopback")
    with pytest.raises(ValueError, match="lives in __main__"):
        run_cluster(plugins=["__main__"])


def test_report_is_immutable():
    report = ClusterReport(layout="x", requests=1, verified=1, failures={}, row={"bytes": 1})
    assert report.ok
    with pytest.raises(TypeError):
        report.failures["r"] = "late"  # type: ignore[index]


def test_demo_layout_accepts_registered_names():
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    assert parser.parse_args(["--layout", "example_split"]).layout == ["example_split"]
    assert runner.model_for("hma")[1] == "hma"
    assert runner.model_for("uniform") == (runner.model_for("uniform")[0], "uniform")
    with pytest.raises(ConfigError, match="unknown --layout 'nope'"):
        runner.model_for("nope")
