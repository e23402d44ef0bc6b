"""pytest fixtures and helpers for kvpush plugin authors.

kvpush declares this module as a ``pytest11`` plugin, so installing kvpush makes the fixtures
available in every test suite without a ``conftest.py``:

- ``kvpush_pm``: a fresh :class:`~kvpush.core.manager.KvpushPluginManager` per test with the
  built-in plugins and no entry points, ignoring ``KVPUSH_*`` variables of the shell.
- ``kvpush_pm_factory``: builds such a manager with extra ``(name, plugin)`` pairs registered,
  e.g. ``kvpush_pm_factory(("example", kvpush_example_plugin))``.

Helpers: :func:`register_plugin` adds a plugin to an existing manager (and re-runs the typo
check), :func:`make_agent_metadata` builds a valid :class:`~kvpush.core.types.AgentMetadata`
without any KV tensors, for the handshake and region hooks, and :func:`run_cluster`
(:mod:`kvpush.testing_cluster`) runs a real multi-process push with any registered layout and
checks every byte on every decode rank.

Importing this module is cheap: no torch, no NIXL, no manager is built until a fixture runs.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvpush.core.manager import KvpushPluginManager
    from kvpush.core.types import AgentMetadata, Role
    from kvpush.testing_cluster import ClusterReport, run_cluster

__all__ = [
    "ClusterReport",
    "kvpush_pm",
    "kvpush_pm_factory",
    "make_agent_metadata",
    "register_plugin",
    "run_cluster",
]

PluginManagerFactory = Callable[..., "KvpushPluginManager"]


def _manager(
    plugins: tuple[tuple[str, object], ...],
    env: Mapping[str, str] | None,
    load_entrypoints: bool,
) -> KvpushPluginManager:
    from kvpush.core.manager import get_plugin_manager

    return get_plugin_manager(
        load_entrypoints=load_entrypoints, plugins=plugins, env={} if env is None else env
    )


@pytest.fixture
def kvpush_pm() -> KvpushPluginManager:
    """A fresh manager with the built-in plugins only (no entry points, shell env ignored)."""
    return _manager((), None, False)


@pytest.fixture
def kvpush_pm_factory() -> PluginManagerFactory:
    """A callable building fresh managers: ``factory(*(name, plugin), env=None, load_entrypoints=False)``.

    ``env`` replaces ``os.environ`` for ``KVPUSH_DISABLE_PLUGINS`` / ``KVPUSH_LOAD_PLUGINS``
    (default: empty, so the shell cannot change what a test sees). A misspelled hookimpl in one
    of the plugins raises :class:`~kvpush.core.errors.PluginError`, as at engine start-up.
    """

    def factory(
        *plugins: tuple[str, object],
        env: Mapping[str, str] | None = None,
        load_entrypoints: bool = False,
    ) -> KvpushPluginManager:
        return _manager(tuple(plugins), env, load_entrypoints)

    return factory


def register_plugin(manager: KvpushPluginManager, plugin: object, name: str | None = None) -> object:
    """Register ``plugin`` on ``manager`` and re-check for misspelled hooks; return what was registered.

    ``plugin`` may be a module, a class, an instance, or a single ``@hookimpl`` function (it is
    wrapped in a namespace). ``name`` defaults to the plugin's ``__name__`` (or its class name).
    """
    if isinstance(plugin, types.FunctionType):
        function = plugin
        plugin = types.SimpleNamespace(**{function.__name__: function})
        name = name or f"{function.__module__}.{function.__name__}"
    if name is None:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
    manager.register(plugin, name, ("local", "-"))
    manager.check_pending()
    return plugin


def make_agent_metadata(
    *,
    role: Role | str = "prefill",
    engine_id: str | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    num_layers: int = 2,
    start_layer: int | None = None,
    end_layer: int | None = None,
    attention: str = "mha",
    num_kv_heads: int = 4,
    head_dim: int = 8,
    block_size: int = 16,
    num_blocks: int = 8,
    mem_type: str = "DRAM",
    layout: str = "uniform",
    transport: str = "nixl",
    extensions: Mapping[str, Any] | None = None,
) -> AgentMetadata:
    """A valid rank description in the uniform layout, with made-up addresses and no tensors.

    MHA ranks get a K and a V region per owned layer (heads split over TP); MLA ranks get one
    replicated latent region per layer. The layer window is an even PP split unless
    ``start_layer``/``end_layer`` are given.
    """
    from kvpush.core.types import AgentMetadata, KVRegion, ModelSpec, ParallelConfig, Role

    role = Role(role) if isinstance(role, str) else role
    if start_layer is None and end_layer is None:
        parallel = ParallelConfig.for_stage(
            num_layers=num_layers, pp_size=pp_size, pp_rank=pp_rank, tp_size=tp_size, tp_rank=tp_rank
        )
    else:
        parallel = ParallelConfig(
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
            num_layers=num_layers,
            start_layer=start_layer or 0,
            end_layer=-1 if end_layer is None else end_layer,
        )
    model = ModelSpec(
        name="test-model",
        num_layers=num_layers,
        attention=attention,
        num_kv_heads=1 if attention == "mla" else num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    heads = 1 if attention == "mla" else num_kv_heads // tp_size
    block_len = heads * block_size * head_dim * 2  # bfloat16
    components = ("latent",) if attention == "mla" else ("K", "V")
    regions = []
    base = 0x10000 * (1 + tp_rank + 16 * pp_rank)
    for layer in range(parallel.start_layer, parallel.end_layer):
        for component in components:
            regions.append(
                KVRegion(
                    base_addr=base,
                    block_len=block_len,
                    block_stride=block_len,
                    num_blocks=num_blocks,
                    mem_type=mem_type,
                    layer_names=(f"layers.{layer}",),
                    component=component,
                    replicate=attention == "mla",
                    num_heads=heads,
                    block_order="heads_outer",
                )
            )
            base += block_len * num_blocks
    return AgentMetadata(
        engine_id=engine_id or f"{role.value}-engine",
        role=role,
        parallel=parallel,
        model=model,
        layout=layout,
        transport=transport,
        agent_name=f"{engine_id or role.value}-pp{parallel.pp_rank}-tp{parallel.tp_rank}",
        agent_blob=b"\x00" * 16,
        regions=regions,
        extensions=dict(extensions or {}),
    )


def __getattr__(name: str) -> Any:
    """``run_cluster`` and ``ClusterReport`` come from :mod:`kvpush.testing_cluster` on first use."""
    if name in ("run_cluster", "ClusterReport"):
        from kvpush import testing_cluster

        return getattr(testing_cluster, name)
    raise AttributeError(f"module 'kvpush.testing' has no attribute {name!r}")
