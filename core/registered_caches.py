"""The KV tensors a rank registered at ``start()``, and a cheap check that the engine still holds
exactly them.

kvpush registers the memory of the ``kv_caches`` tensors once, at start: P reads KV from it and
D's blocks are published from it. An engine that later puts a new tensor in the mapping it handed
the worker (a re-allocated pool), or swaps a tensor's storage (``tensor.data = ...``,
``tensor.set_(...)``), has its KV elsewhere: P would push bytes the engine no longer writes, and D
would report a request done while the engine's tensor holds none of P's bytes. The engine calls
that start a request (P's ``request_finished``, D's ``add_request``) run :meth:`RegisteredCaches.check`,
which refuses such a change, naming the cache, instead of moving wrong KV silently.

The check compares, in C-level ``map`` calls, every mutable container's items (the mapping's
values, nested lists and dicts) and the ``.tensor`` of wrapper values by identity, and the
``data_ptr()`` of each tensor that holds a registered region, with what they were at start
(about 0.1 µs a tensor; only a change walks the caches again). Every object compared is held
here, and so is the storage of each registered tensor: the registered memory stays allocated
while the worker lives, even when the engine drops or re-points its tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.types import KVRegion

_TENSOR = operator.attrgetter("tensor")
_DATA_PTR = operator.methodcaller("data_ptr")


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") and hasattr(value, "dtype")


def _span(tensor: Any) -> tuple[int, int]:
    """The bytes ``[start, end)`` a tensor's elements reach (as ``check_tensors`` counts them)."""
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride()) if n)
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


class _Snapshot:
    """One walk of ``kv_caches``: what the fast check compares (see the module docstring)."""

    def __init__(self, kv_caches: Mapping[str, Any]) -> None:
        self.containers: list[tuple[Any, bool, tuple[Any, ...]]] = []
        """(mutable container, whether a mapping, its items at the walk)."""
        self.wrappers: list[Any] = []
        """Values whose ``.tensor`` (a plain attribute) is the tensor."""
        self.wrapped: list[Any] = []
        """The ``.tensor`` of each of ``wrappers`` at the walk."""
        self.computed: list[tuple[str, Any]] = []
        """(path, wrapper) whose ``.tensor`` is made afresh on each access (a property)."""
        self.leaves: dict[str, Any] = {}
        """Path (``key``, ``key[0]``, ``key['k']``) -> tensor, in walk order."""
        self._add(kv_caches, True)
        for key, value in list(kv_caches.items()):
            self._visit(str(key), value)

    def _add(self, container: Any, mapping: bool) -> None:
        items = tuple(container.values()) if mapping else tuple(container)
        self.containers.append((container, mapping, items))

    def _visit(self, path: str, value: Any) -> None:
        if _is_tensor(value):
            self.leaves[path] = value
            return
        tensor = getattr(value, "tensor", None)
        if tensor is not None and _is_tensor(tensor):
            if getattr(value, "tensor", None) is tensor:
                self.wrappers.append(value)
                self.wrapped.append(tensor)
            else:  # a property making a new view per access: compared by address
                self.computed.append((path, value))
            self.leaves[path] = tensor
        elif isinstance(value, (tuple, list)):
            if isinstance(value, list):
                self._add(value, False)
            for index, item in enumerate(value):
                self._visit(f"{path}[{index}]", item)
        elif isinstance(value, Mapping):
            self._add(value, True)
            for key, item in list(value.items()):
                self._visit(f"{path}[{key!r}]", item)

    def unchanged(self) -> bool:
        """Every container holds the same items (the same objects) and every wrapper the same
        tensor: ``operator.is_`` mapped in C, no object made per item."""
        for container, mapping, items in self.containers:
            if len(container) != len(items):
                return False
            if not all(map(operator.is_, container.values() if mapping else container, items)):
                return False
        return all(map(operator.is_, map(_TENSOR, self.wrappers), self.wrapped))


class RegisteredCaches:
    """The ``kv_caches`` of a started rank and the tensors whose memory it registered."""

    def __init__(self, kv_caches: Mapping[str, Any], regions: Sequence[KVRegion]) -> None:
        self._caches = kv_caches
        self._snapshot = _Snapshot(kv_caches)
        # The tensors holding a region (the rest is state kvpush does not move): path ->
        # (tensor, its data_ptr, the layers it holds).
        self.registered: dict[str, tuple[Any, int, tuple[str, ...]]] = {}
        for path, tensor in self._snapshot.leaves.items():
            low, high = _span(tensor)
            layers = [
                name
                for region in regions
                if low <= region.base_addr and region.end_addr <= high
                for name in region.layer_names
            ]
            if layers:
                self.registered[path] = (tensor, tensor.data_ptr(), tuple(dict.fromkeys(layers)))
        self._set_fast()
        self.storages = [
            storage for tensor, _, _ in self.registered.values() if (storage := _storage(tensor)) is not None
        ]
        """The registered tensors' storages: their memory stays allocated while this is held."""

    def _set_fast(self) -> None:
        computed = {path for path, _ in self._snapshot.computed}
        self._leaves = [t for path, (t, _, _) in self.registered.items() if path not in computed]
        self._ptrs = tuple(ptr for path, (_, ptr, _) in self.registered.items() if path not in computed)
        kinds = {type(tensor) for tensor in self._leaves}
        # One tensor type (torch's): its unbound data_ptr, a third cheaper than methodcaller's.
        self._data_ptr = next(iter(kinds)).data_ptr if len(kinds) == 1 else _DATA_PTR
        self._computed = [
            (wrapper, self.registered[path][1])
            for path, wrapper in self._snapshot.computed
            if path in self.registered
        ]

    def check(self, call: str, agent: str) -> None:
        """Raise ``ConfigError`` naming the cache when a registered tensor is no longer the
        engine's (replaced in ``kv_caches``, or its storage swapped). Cheap when nothing changed."""
        if (
            self._snapshot.unchanged()
            and tuple(map(self._data_ptr, self._leaves)) == self._ptrs
            and all(wrapper.tensor.data_ptr() == ptr for wrapper, ptr in self._computed)
        ):
            return
        self._check_walk(call, agent)

    def _check_walk(self, call: str, agent: str) -> None:
        """Something changed: walk the caches again. A registered tensor gone, replaced or moved
        is refused; a change elsewhere (state kvpush does not move) is taken as the new snapshot."""
        current = _Snapshot(self._caches)
        computed = {path for path, _ in current.computed}
        for path, (tensor, ptr, layers) in self.registered.items():
            now = current.leaves.get(path)
            if now is None:
                why = "is gone from kv_caches"
            elif now is not tensor and path not in computed:
                why = "was replaced by another tensor"
            elif now.data_ptr() != ptr:
                why = f"now lies at {now.data_ptr():#x}, not at the {ptr:#x} registered"
            else:
                continue
            raise ConfigError(
                f"{call} on {agent}: KV cache {path!r} (layer(s) {', '.join(layers[:4])}"
                f"{', ...' if len(layers) > 4 else ''}) {why} since start(); kvpush moves KV through "
                f"the memory registered at start(), so this request's KV would be wrong. Close this "
                f"worker and start a new one with the new caches (kvpush never re-registers silently)"
            )
        self._snapshot = current
        self._set_fast()


def _storage(tensor: Any) -> Any:
    """The tensor's storage (torch), or None for another array type."""
    try:
        return tensor.untyped_storage()
    except Exception:  # not a torch tensor: nothing to hold beyond the tensor itself
        return None
