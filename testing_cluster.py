"""A real multi-process push for tests: P (PP x TP) and D (TP) rank processes, every byte checked.

:func:`run_cluster` is what a layout, transport or policy plugin uses to prove that requests
actually arrive intact::

    from kvpush.testing import run_cluster

    def test_my_layout_pushes_every_byte():
        report = run_cluster("my_layout", plugins=["my_plugin"], prefill_pp=2, decode_tp=2)
        report.raise_for_failures()

It runs the machinery of ``kvpush demo`` (:func:`kvpush.demo.runner.run_config`): each rank is
its own process with its own plugin manager and transport agent (NIXL by default), this process
serves both engines' side channels; P's caches are allocated by the layout
(``LayoutProvider.allocate``) and filled with request-specific bytes; requests with scattered
block tables (and, at ``prefix_hit_rate``, a prefix already cached on D) are dispatched to both
legs at once; then every block of every region on every D rank is compared with what P wrote.
Failures come back with their reasons (the rank's error, D's failure reason, or the first wrong
block). Nothing is imported until it is called: importing this module is cheap.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from kvpush.core.types import ModelSpec

__all__ = ["ClusterReport", "PluginSpec", "run_cluster"]

PluginSpec = Any
"""A plugin for the ranks: an imported module, a ``"module"`` / ``"module:attr"`` import path,
or a ``(name, module_or_path)`` pair. Rank processes import it by path, so it must be importable
there (a module on ``sys.path``, not an object defined inside a test function)."""


@attrs.frozen(kw_only=True)
class ClusterReport:
    """What one :func:`run_cluster` call found."""

    layout: str
    requests: int
    verified: int
    """Requests whose bytes matched on every D rank."""
    failures: Mapping[str, str] = attrs.field(converter=lambda m: types.MappingProxyType(dict(m)))
    """Request id -> reason (at most 10 listed); ``"*"`` when the cluster did not run at all."""
    row: Mapping[str, Any] = attrs.field(
        converter=lambda m: types.MappingProxyType(dict(m)), repr=False, eq=False
    )
    """The demo's report row: bytes, handshake and latency figures, writes, packed destinations."""

    @property
    def ok(self) -> bool:
        return self.verified == self.requests and not self.failures

    def describe(self) -> str:
        head = f"layout {self.layout!r}: {self.verified}/{self.requests} requests verified byte for byte"
        return "\n".join([head, *(f"  {rid}: {reason}" for rid, reason in self.failures.items())])

    def raise_for_failures(self) -> None:
        """``AssertionError`` listing every failure with its reason, unless all were verified."""
        if not self.ok:
            raise AssertionError(self.describe())


def _plugin_path(plugin: PluginSpec) -> tuple[str, str]:
    name = None
    if isinstance(plugin, tuple):
        name, plugin = plugin
    if isinstance(plugin, types.ModuleType):
        path = plugin.__name__
    elif isinstance(plugin, str):
        path = plugin
    else:
        raise TypeError(
            f"plugins entries must be a module, an import path 'module[:attr]' or (name, either); "
            f"got {plugin!r}"
        )
    if path.partition(":")[0] == "__main__":
        raise ValueError(f"plugin {path!r} lives in __main__; rank processes cannot import it by path")
    return name or path.replace(":", "."), path


def _start_error(err: BaseException) -> str:
    """The useful part of a rank's error: what failed, and the exception's last line."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[0].rstrip(':')}: {lines[-1].strip()}"


def run_cluster(
    layout: str = "uniform",
    *,
    model: ModelSpec | None = None,
    plugins: Sequence[PluginSpec] = (),
    load_entrypoints: bool | None = None,
    prefill_pp: int = 2,
    prefill_tp: int = 1,
    decode_tp: int = 2,
    requests: int = 8,
    max_blocks: int = 8,
    prefix_hit_rate: float = 0.25,
    strategy: str | None = None,
    transport: str = "nixl",
    device: str = "cpu",
    decode_device: str | None = None,
    seed: int = 0,
    timeout_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> ClusterReport:
    """Push ``requests`` requests from a PP x TP prefill engine to a TP decode engine and verify.

    :param layout: a registered layout name (its plugin among ``plugins`` or installed).
    :param model: the model to push; default: the layout's ``LayoutProvider.demo_model``.
    :param plugins: extra plugins every rank (and this process, to look the layout up) registers.
    :param load_entrypoints: also load installed plugins; default: only when ``plugins`` is empty.
    :param strategy: force ``"direct"`` or ``"packed"``; None lets the strategy plugin choose.
    :param transport: a transport that reaches other processes (``nixl``; ``loopback`` cannot).
    :param timeout_s: bound on each request (and on the wait for all of them, plus 10 s).
    :return: a :class:`ClusterReport`; call ``raise_for_failures()`` in a test.
    """
    import importlib

    from kvpush.core.errors import ConfigError
    from kvpush.core.manager import get_plugin_manager
    from kvpush.demo.runner import RunConfig, run_config

    if transport == "loopback":
        raise ConfigError(
            "transport 'loopback' reaches agents of one process only, and run_cluster runs every "
            "rank as its own process; use 'nixl' (or another multi-process transport)"
        )
    specs = tuple(_plugin_path(p) for p in plugins)
    entrypoints = not specs if load_entrypoints is None else load_entrypoints
    local = []
    for name, path in specs:
        module, _, attr = path.partition(":")
        obj: object = importlib.import_module(module)
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
        local.append((name, obj))
    provider = get_plugin_manager(plugins=local, load_entrypoints=entrypoints).layout(layout)
    if provider.allocate is None:
        raise ConfigError(
            f"layout {layout!r} has no LayoutProvider.allocate(model, parallel, blocks_per_group, "
            f"device); run_cluster needs it to allocate each rank's caches"
        )
    model = model or provider.demo_model
    if model is None:
        raise ConfigError(f"layout {layout!r} has no LayoutProvider.demo_model; pass model=ModelSpec(...)")
    cfg = RunConfig(
        layout=layout,
        model=model,
        plugins=specs,
        load_entrypoints=entrypoints,
        transport=transport,
        prefill_pp=prefill_pp,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        requests=requests,
        max_blocks=max_blocks,
        prefix_hit_rate=prefix_hit_rate,
        strategy=strategy,
        device=device,
        decode_device=decode_device,
        seed=seed,
        timeout_s=timeout_s,
    )
    try:
        row = run_config(cfg, progress=progress)
    except Exception as err:
        return ClusterReport(
            layout=layout, requests=requests, verified=0, failures={"*": _start_error(err)}, row={}
        )
    return ClusterReport(
        layout=layout,
        requests=row["requests"],
        verified=row["verified_requests"],
        failures=row["failures"],
        row=row,
    )
