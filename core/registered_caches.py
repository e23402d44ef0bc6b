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
values, nested lists and dicts, a plain object's attributes, a slotted object's set slots) and
the ``.tensor`` of wrapper values by identity, and the ``data_ptr()``, ``stride()`` and
``dtype`` of each tensor that holds a registered region, with what they were at start (about
0.3-0.4 µs a tensor on a loaded 2-core host; only a change walks the caches again). A tensor
re-laid out in place (``resize_`` to another shape, ``set_`` or ``as_strided_`` with other
strides) keeps its identity and address but not its strides: refused too. So is one
reinterpreted as another dtype (``tensor.data = tensor.view(other)``, even of the same element
size): the engine would write values of a type the peer does not read them as. A tensor
replaced by another viewing exactly the registered bytes (the same address, strides and dtype:
the engine re-made its view of the same buffer) is the same cache and is adopted. Every object
compared is held here, and so is the storage of each registered tensor: the registered memory
stays allocated while the worker lives, even when the engine drops or re-points its tensor (so
no other allocation can take a registered address).
"""

from __future__ import annotations

import operator
import types
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.types import KVRegion

_TENSOR = operator.attrgetter("tensor")
_DATA_PTR = operator.methodcaller("data_ptr")
_STRIDE = operator.methodcaller("stride")
_DTYPE = operator.attrgetter("dtype")
MAX_DEPTH = 8
"""Nesting levels of containers and objects walked below a ``kv_caches`` value."""


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") and hasattr(value, "dtype")


def _span(tensor: Any) -> tuple[int, int]:
    """The bytes ``[start, end)`` a tensor's elements reach (as ``check_tensors`` counts them)."""
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride()) if n)
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


def _placement(tensor: Any) -> tuple[int, tuple[int, ...], Any]:
    """Where a tensor's elements lie and what they are: its address, strides and dtype."""
    return tensor.data_ptr(), tuple(tensor.stride()), tensor.dtype


_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType)


def _walks_attributes(value: Any) -> bool:
    """A plain object whose attributes may hold caches (not a class, module or function)."""
    return isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, _NOT_WALKED)


def _slot_names(value: Any) -> tuple[str, ...]:
    """The attribute names of the slots ``value``'s class declares (``__slots__``, as an
    ``attrs.define`` class has; private names mangled), in declaration order."""
    if isinstance(value, _NOT_WALKED):
        return ()
    names: list[str] = []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"
            names.append(name)
    return tuple(dict.fromkeys(names))


class _Snapshot:
    """One walk of ``kv_caches``: what the fast check compares (see the module docstring)."""

    def __init__(self, kv_caches: Mapping[str, Any]) -> None:
        self.containers: list[tuple[Any, bool, tuple[Any, ...]]] = []
        """(mutable container, whether a mapping, its items at the walk)."""
        self.wrappers: list[Any] = []
        """Values whose ``.tensor`` (a plain attribute) is the tensor."""
        self.wrapped: list[Any] = []
        """The ``.tensor`` of each of ``wrappers`` at the walk."""
        self.slot_owners: list[Any] = []
        self.slot_names: list[str] = []
        self.slot_values: list[Any] = []
        """Each set slot of a slotted object walked: its object, name and value at the walk."""
        self.computed: list[tuple[str, Any]] = []
        """(path, wrapper) whose ``.tensor`` is made afresh on each access (a property)."""
        self.leaves: dict[str, Any] = {}
        """Path (``key``, ``key[0]``, ``key['k']``, ``key.k``) -> tensor, in walk order."""
        self._seen: set[int] = {id(kv_caches)}
        self._add(kv_caches, True)
        for key, value in list(kv_caches.items()):
            self._visit(str(key), value, 1)

    def _add(self, container: Any, mapping: bool) -> None:
        items = tuple(container.values()) if mapping else tuple(container)
        self.containers.append((container, mapping, items))

    def _first_visit(self, value: Any, depth: int) -> bool:
        """Whether to walk into ``value``: not seen yet (a cycle is walked once), not too deep."""
        if depth > MAX_DEPTH or id(value) in self._seen:
            return False
        self._seen.add(id(value))
        return True

    def _visit(self, path: str, value: Any, depth: int) -> None:
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
            if not self._first_visit(value, depth):
                return
            if isinstance(value, list):
                self._add(value, False)
            for index, item in enumerate(value):
                self._visit(f"{path}[{index}]", item, depth + 1)
        elif isinstance(value, Mapping):
            if not self._first_visit(value, depth):
                return
            self._add(value, True)
            for key, item in list(value.items()):
                self._visit(f"{path}[{key!r}]", item, depth + 1)
        elif _walks_attributes(value) or _slot_names(value):  # a plugin's cache object
            if not self._first_visit(value, depth):
                return
            if _walks_attributes(value):  # its attributes, as a mapping
                attributes = vars(value)
                self._add(attributes, True)
                for name, item in list(attributes.items()):
                    self._visit(f"{path}.{name}", item, depth + 1)
            for name in _slot_names(value):  # its slots, each compared by identity
                try:
                    item = getattr(value, name)
                except AttributeError:  # unset: holds no cache
                    continue
                self.slot_owners.append(value)
                self.slot_names.append(name)
                self.slot_values.append(item)
                self._visit(f"{path}.{name}", item, depth + 1)

    def unchanged(self) -> bool:
        """Every container holds the same items (the same objects) and every wrapper the same
        tensor: ``operator.is_`` mapped in C, no object made per item."""
        for container, mapping, items in self.containers:
            if len(container) != len(items):
                return False
            if not all(map(operator.is_, container.values() if mapping else container, items)):
                return False
        if self.slot_owners:
            try:
                slots = list(map(getattr, self.slot_owners, self.slot_names))
            except AttributeError:  # a slot deleted
                return False
            if not all(map(operator.is_, slots, self.slot_values)):
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
        self._placements = {path: _placement(tensor) for path, (tensor, _, _) in self.registered.items()}
        """Path -> (address, strides, dtype) of each registered tensor at start."""
        self._set_fast()
        self.storages = [
            storage for tensor, _, _ in self.registered.values() if (storage := _storage(tensor)) is not None
        ]
        """The registered tensors' storages: their memory stays allocated while this is held."""

    def _set_fast(self) -> None:
        computed = {path for path, _ in self._snapshot.computed}
        self._leaves = [t for path, (t, _, _) in self.registered.items() if path not in computed]
        self._ptrs = tuple(ptr for path, (_, ptr, _) in self.registered.items() if path not in computed)
        self._strides = tuple(self._placements[path][1] for path in self.registered if path not in computed)
        self._dtypes = tuple(self._placements[path][2] for path in self.registered if path not in computed)
        kinds = {type(tensor) for tensor in self._leaves}
        # One tensor type (torch's): its unbound methods and getter, a third cheaper than
        # methodcaller's and attrgetter's.
        kind = next(iter(kinds)) if len(kinds) == 1 else None
        self._data_ptr = kind.data_ptr if kind is not None else _DATA_PTR
        self._stride = kind.stride if kind is not None else _STRIDE
        dtype = getattr(kind, "dtype", None)
        self._dtype = dtype.__get__ if hasattr(dtype, "__get__") else _DTYPE
        self._computed = [
            (wrapper, self._placements[path])
            for path, wrapper in self._snapshot.computed
            if path in self.registered
        ]

    def check(self, call: str, agent: str) -> None:
        """Raise ``ConfigError`` naming the cache when a registered tensor is no longer the
        engine's (replaced in ``kv_caches``, or its storage swapped). Cheap when nothing changed."""
        if (
            self._snapshot.unchanged()
            and tuple(map(self._data_ptr, self._leaves)) == self._ptrs
            and tuple(map(self._stride, self._leaves)) == self._strides
            and tuple(map(self._dtype, self._leaves)) == self._dtypes
            and all(_placement(wrapper.tensor) == placed for wrapper, placed in self._computed)
        ):
            return
        self._check_walk(call, agent)

    def _check_walk(self, call: str, agent: str) -> None:
        """Something changed: walk the caches again. A registered tensor gone, replaced by one
        over other bytes, moved or re-laid out is refused; one replaced by a view of exactly
        the registered bytes is adopted; a change elsewhere (state kvpush does not move) is
        taken as the new snapshot."""
        current = _Snapshot(self._caches)
        computed = {path for path, _ in current.computed}
        adopted: dict[str, Any] = {}
        for path, (tensor, ptr, layers) in self.registered.items():
            now = current.leaves.get(path)
            placed = self._placements[path]
            if now is None:
                why = "is gone from kv_caches"
            elif now is not tensor and path not in computed:
                if _placement(now) == placed:
                    adopted[path] = now  # a fresh view of the registered bytes: the same cache
                    continue
                why = (
                    f"was replaced by another tensor (at {now.data_ptr():#x}, strides "
                    f"{tuple(now.stride())}, {now.dtype}; registered at {ptr:#x}, strides "
                    f"{placed[1]}, {placed[2]})"
                )
            elif now.data_ptr() != ptr:
                why = f"now lies at {now.data_ptr():#x}, not at the {ptr:#x} registered"
            elif _placement(now) != placed:
                why = (
                    f"was re-laid out or reinterpreted in place (strides {tuple(now.stride())}, "
                    f"{now.dtype}; registered: strides {placed[1]}, {placed[2]})"
                )
            else:
                continue
            raise ConfigError(
                f"{call} on {agent}: KV cache {path!r} (layer(s) {', '.join(layers[:4])}"
                f"{', ...' if len(layers) > 4 else ''}) {why} since start(); kvpush moves KV through "
                f"the memory registered at start(), so this request's KV would be wrong. Close this "
                f"worker and start a new one with the new caches (kvpush never re-registers silently)"
            )
        for path, now in adopted.items():
            _, ptr, layers = self.registered[path]
            self.registered[path] = (now, ptr, layers)
        self._snapshot = current
        self._set_fast()


def _storage(tensor: Any) -> Any:
    """The tensor's storage (torch), or None for another array type."""
    try:
        return tensor.untyped_storage()
    except Exception:  # not a torch tensor: nothing to hold beyond the tensor itself
        return None
