"""Descriptor ids of regions in several KV groups, factored (``RaggedIdGrid``): what the
``cuda_ipc`` transport uploads for a hybrid model instead of one id per descriptor."""

from __future__ import annotations

import numpy as np
import pytest

import kvpush.demo.serve as serve
from kvpush.core.errors import ConfigError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.planning import RaggedIdGrid, descriptor_id_ragged, descriptor_ids
from kvpush.transports.cuda_ipc import _ragged_in_range


def _regions(preset: str) -> tuple[serve.Workload, tuple, tuple[int, ...]]:
    w = serve.Workload(preset=preset)
    config = serve._worker_config(w, "x", 0, "cpu")
    caches = serve._allocate(w, config, "cpu")
    regions = tuple(get_plugin_manager().layout(w.layout).describe(caches, config.parallel, config.model))
    return w, regions, tuple(r.kv_group for r in regions)


@pytest.mark.parametrize("preset", ["hybrid", "llama3-8b"])
@pytest.mark.parametrize("tokens", [1, 17, 1054, 5000])
def test_ragged_ids_expand_to_exactly_the_descriptor_ids(preset: str, tokens: int) -> None:
    w, regions, groups = _regions(preset)
    rng = np.random.default_rng(tokens)
    counts = w.blocks_per_group(tokens)
    blocks = tuple(tuple(int(b) for b in rng.choice(n, c, replace=False)) for n, c in zip(w.pool(), counts))
    grid = descriptor_id_ragged(regions, groups, blocks)
    assert grid is not None
    expected = descriptor_ids(regions, groups, blocks)
    assert len(grid) == len(expected)
    assert np.array_equal(grid.ids(), expected)
    assert _ragged_in_range(grid, int(expected.max()) + 1)
    assert not _ragged_in_range(grid, int(expected.max()))


def test_a_block_beyond_its_groups_capacity_is_refused_as_descriptor_ids_does() -> None:
    _, regions, groups = _regions("hybrid")
    small = min(r.num_blocks for r in regions)  # the sliding-window group's pool
    blocks = ((0, 1), (0, small))
    with pytest.raises(ConfigError, match="outside the region"):
        descriptor_ids(regions, groups, blocks)
    with pytest.raises(ConfigError, match="outside the region"):
        descriptor_id_ragged(regions, groups, blocks)


def test_the_transport_range_check_refuses_a_slice_outside_the_blocks_or_negative_ids() -> None:
    starts, first = np.array([0, 10], np.int32), np.array([0, 2], np.int32)
    counts = np.array([2, 1], np.int32)
    good = RaggedIdGrid(starts, np.array([1, 3, 4], np.int32), first, counts)
    assert _ragged_in_range(good, 15) and not _ragged_in_range(good, 14)
    assert not _ragged_in_range(RaggedIdGrid(starts, good.blocks, first, np.array([2, 2], np.int32)), 99)
    assert not _ragged_in_range(RaggedIdGrid(starts, np.array([1, -3, 4], np.int32), first, counts), 99)
    assert not _ragged_in_range(RaggedIdGrid(-starts, good.blocks, first, counts), 99)
    empty = RaggedIdGrid(starts, np.empty(0, np.int32), first, np.zeros(2, np.int32))
    assert _ragged_in_range(empty, 0) and len(empty) == 0 and empty.ids().size == 0
