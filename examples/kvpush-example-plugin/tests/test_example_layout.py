"""Tests of the example layout: unit tests with kvpush.testing's fixtures, then a real push.

``run_cluster`` starts P (2 PP stages) and D (2 TP ranks) as processes over NIXL with the
layout registered in each, pushes scattered requests (some with a prefix already on D) and
checks every byte on every D rank.
"""

from __future__ import annotations

import attrs
import kvpush_example_layout
import pytest

from kvpush.core.errors import ConfigError
from kvpush.core.types import ParallelConfig
from kvpush.layouts.regions import check_regions
from kvpush.testing import run_cluster

MODEL = kvpush_example_layout.DEMO_MODEL


@pytest.fixture
def pm(kvpush_pm_factory):
    return kvpush_pm_factory(("example_layout", kvpush_example_layout))


def stage(pp_rank, tp_rank=0, pp_size=2, tp_size=2):
    return ParallelConfig.for_stage(
        num_layers=MODEL.num_layers, pp_size=pp_size, pp_rank=pp_rank, tp_size=tp_size, tp_rank=tp_rank
    )


def test_offered_and_listed(pm):
    assert "example_layout" in {p.name for p in pm.list_plugins()}
    provider = pm.layout("example_split")
    assert provider.allocate is not None and provider.demo_model == MODEL


def test_regions_follow_the_rules(pm):
    provider = pm.layout("example_split")
    parallel = stage(1, tp_rank=1)
    caches = provider.allocate(MODEL, parallel, (6,), "cpu")
    regions = provider.describe(caches, parallel, MODEL)  # describe() checks the layout rules
    assert [(r.layer_names, r.component) for r in regions] == [
        (("layers.2",), "K"),
        (("layers.2",), "V"),
        (("layers.3",), "K"),
        (("layers.3",), "V"),
    ]
    assert regions[1].base_addr == caches["layers.2.v"].data_ptr()
    assert {r.num_heads for r in regions} == {2}
    check_regions(regions, parallel, MODEL, layout="example_split")


def test_tensor_keys_as_layer_names_break_a_rule(pm):
    provider = pm.layout("example_split")
    parallel = stage(0)
    regions = provider.describe(provider.allocate(MODEL, parallel, (4,), "cpu"), parallel, MODEL)
    renamed = [attrs.evolve(r, layer_names=(f"{r.layer_names[0]}.{r.component.lower()}",)) for r in regions]
    with pytest.raises(ConfigError, match="breaks the layer_names rule"):
        check_regions(renamed, parallel, MODEL, layout="example_split")


def test_pushes_every_byte_pp2_to_tp2():
    report = run_cluster("example_split", plugins=[kvpush_example_layout], prefill_pp=2, decode_tp=2)
    report.raise_for_failures()
    assert report.verified == report.requests == 8
