"""kvpush: push-mode KV-cache transfer for disaggregated LLM serving.

Plugin authors need one name from here::

    from kvpush import hookimpl

Engines start with :func:`get_plugin_manager`. Importing kvpush has no side effects: no NIXL
agent is created and no device is probed until an engine asks for one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpush.core.markers import PROJECT_NAME, hookimpl

if TYPE_CHECKING:
    from kvpush.core.manager import KvpushPluginManager

__all__ = ["PROJECT_NAME", "__version__", "get_plugin_manager", "hookimpl"]


def get_plugin_manager(**kwargs: Any) -> KvpushPluginManager:
    """Build a ready plugin manager; see :func:`kvpush.core.manager.get_plugin_manager`."""
    from kvpush.core.manager import get_plugin_manager as _get

    return _get(**kwargs)


def __getattr__(name: str) -> str:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("kvpush")
        except PackageNotFoundError:  # running from a source tree that is not installed
            return "0+unknown"
    raise AttributeError(f"module 'kvpush' has no attribute {name!r}")
