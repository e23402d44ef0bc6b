"""The layout rules (kvpush.layouts.regions): each broken rule is an error naming it."""

from __future__ import annotations

import attrs
import pytest

from kvpush.core.errors import ConfigError
from kvpush.core.types import HandshakeMode, ParallelConfig
from kvpush.layouts import regions as helpers
from kvpush.layouts.regions import check_regions
from kvpush.testing import make_agent_metadata


def meta(**kwargs):
    return make_agent_metadata(num_layers=4, **kwargs)


def renamed(regions, names):
    return [attrs.evolve(r, layer_names=(n,)) for r, n in zip(regions, names)]


def test_helpers_are_public_and_reexported():
    from kvpush.layouts import uniform

    for name in ("natural_key", "ordered_layers", "tensor_region", "local_heads"):
        assert getattr(uniform, name) is getattr(helpers, name)
        assert name in helpers.__all__
    assert sorted(["layers.10", "layers.2"], key=helpers.natural_key) == ["layers.2", "layers.10"]


def test_builtin_layouts_follow_the_rules(kvpush_pm):
    for name in ("uniform", "hma"):
        provider = kvpush_pm.layout(name)
        model = provider.demo_model
        for pp_rank in range(2):
            parallel = ParallelConfig.for_stage(
                num_layers=model.num_layers, pp_size=2, pp_rank=pp_rank, tp_size=2, tp_rank=1
            )
            caches = provider.allocate(model, parallel, (6, 3), "cpu")
            assert len(provider.describe(caches, parallel, model)) == 2 * parallel.num_local_layers


def test_layer_names_one_per_tensor_is_named():
    m = meta()
    names = [f"layers.{i // 2}.{'kv'[i % 2]}" for i in range(len(m.regions))]
    with pytest.raises(ConfigError, match="breaks the layer_names rule") as err:
        check_regions(renamed(m.regions, names), m.parallel, m.model, layout="split")
    assert "name 8 distinct layers" in str(err.value)
    assert "'layers.0.k'/'layers.0.v'" in str(err.value)
    assert "layout 'split'" in str(err.value)


def test_layer_names_shared_across_layers_is_named():
    m = meta()
    regions = list(m.regions)
    regions[3] = attrs.evolve(regions[3], layer_names=("layers.1", "layers.0"))
    with pytest.raises(ConfigError, match="breaks the layer_names rule"):
        check_regions(regions, m.parallel, m.model)


def test_region_order_is_named():
    m = meta()
    swapped = [*m.regions[2:4], *m.regions[0:2], *m.regions[4:]]
    with pytest.raises(ConfigError, match=r"breaks the region order rule: layer 'layers\.0' comes after"):
        check_regions(swapped, m.parallel, m.model)
    apart = [m.regions[0], m.regions[2], m.regions[1], *m.regions[3:]]
    with pytest.raises(
        ConfigError, match=r"region order rule: the regions of layer 'layers\.0' are not adjacent"
    ):
        check_regions(apart, m.parallel, m.model)


def test_components_are_named():
    m = meta()
    regions = list(m.regions)
    regions[1] = attrs.evolve(regions[1], component="K")
    with pytest.raises(ConfigError, match=r"breaks the components rule: layer 'layers\.0' has components"):
        check_regions(regions, m.parallel, m.model)
    regions = list(m.regions)
    regions[2], regions[3] = attrs.evolve(regions[2], component="V"), attrs.evolve(regions[3], component="K")
    with pytest.raises(ConfigError, match="same components in the same order"):
        check_regions(regions, m.parallel, m.model)


def test_in_block_order_is_named():
    m = meta()
    regions = list(m.regions)
    regions[0] = attrs.evolve(regions[0], num_heads=3)
    with pytest.raises(ConfigError, match="breaks the in-block order rule: region 0"):
        check_regions(regions, m.parallel, m.model)


def test_pp_slicing_states_the_rule_in_regions(kvpush_pm):
    local = meta(pp_size=2, pp_rank=1)
    names = [f"layers.{2 + i // 2}.{'kv'[i % 2]}" for i in range(len(local.regions))]
    local = attrs.evolve(local, regions=renamed(local.regions, names))
    peer = meta(role="decode")
    (problem,) = kvpush_pm.validate_peer(local, peer, HandshakeMode.FULL)
    assert "cannot be paired by offset PP slicing" in problem
    assert "name 4 distinct layers" in problem and "the stage owns 2" in problem
    assert "--layout" not in problem


def test_pp_slicing_names_a_region_order_mismatch(kvpush_pm):
    local = meta(pp_size=2, pp_rank=1)
    peer = meta(role="decode")
    reordered = [attrs.evolve(r, component="V" if r.component == "K" else "K") for r in peer.regions]
    (problem,) = kvpush_pm.validate_peer(local, attrs.evolve(peer, regions=reordered), HandshakeMode.FULL)
    assert "region 0 (layers.2 K) with the peer's region 4 (layers.2 V)" in problem
    assert "region order rule" in problem
