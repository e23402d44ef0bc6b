"""Layouts for tests/test_testing_cluster.py, importable by path from rank processes."""

from __future__ import annotations

from typing import Any

import attrs

from kvpush import hookimpl
from kvpush.core.types import LayoutProvider
from kvpush.layouts.uniform import allocate_uniform, describe_uniform


def describe_tensor_names(kv_caches: Any, parallel: Any, model: Any) -> list[Any]:
    """The uniform layout's regions named per tensor (``layers.0.K``): breaks the layer_names rule."""
    return [
        attrs.evolve(r, layer_names=(f"{r.layer_names[0]}.{r.component}",))
        for r in describe_uniform(kv_caches, parallel, model)
    ]


@hookimpl
def kvpush_layouts() -> list[LayoutProvider]:
    return [
        LayoutProvider(
            name="tensor_names",
            describe_regions=describe_tensor_names,
            allocate=allocate_uniform,
            demo_model=None,
        )
    ]
