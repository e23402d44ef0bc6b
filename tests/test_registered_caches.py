"""RegisteredCaches: the engine's ``kv_caches`` still hold the tensors registered at start.

A registered tensor replaced (in the mapping, in a nested list or dict, as a wrapper's
``.tensor``), removed, or re-pointed at other memory is refused naming the cache; a change of
state kvpush does not move (a tensor holding no region, a new key) is accepted and becomes the
new snapshot; nothing changed is the cheap path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvpush.core.errors import ConfigError
from kvpush.core.registered_caches import RegisteredCaches
from kvpush.core.types import KVRegion


def _regions(named: Sequence[tuple[str, torch.Tensor]]) -> list[KVRegion]:
    """One region over each tensor (two blocks of its first row's bytes)."""
    return [
        KVRegion(
            base_addr=tensor.data_ptr(),
            block_len=tensor[0].numel() * tensor.element_size(),
            block_stride=tensor[0].numel() * tensor.element_size(),
            num_blocks=2,
            mem_type="DRAM",
            device_id=0,
            layer_names=(layer,),
        )
        for layer, tensor in named
    ]


def _kv() -> torch.Tensor:
    return torch.zeros(2, 8)


class Wrapper:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ComputedView:
    """A wrapper whose ``.tensor`` is a new view on every access."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor.view(self._tensor.shape)


def _refused(caches: RegisteredCaches, *words: str) -> str:
    with pytest.raises(ConfigError) as err:
        caches.check("add_request", "D-decode-pp0-tp0")
    text = str(err.value)
    assert "add_request on D-decode-pp0-tp0" in text and "start a new one with the new caches" in text
    for word in words:
        assert word in text, text
    return text


def test_nothing_changed_passes() -> None:
    caches = {f"layers.{i}": _kv() for i in range(4)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    for _ in range(3):
        registered.check("add_request", "D")
    assert set(registered.registered) == set(caches)


def test_a_tensor_replaced_in_the_mapping_is_refused_naming_it() -> None:
    caches = {f"layers.{i}": _kv() for i in range(4)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    caches["layers.2"] = _kv()
    _refused(registered, "'layers.2'", "layers.2", "replaced")


def test_a_tensor_removed_is_refused() -> None:
    caches = {f"layers.{i}": _kv() for i in range(2)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    del caches["layers.1"]
    _refused(registered, "'layers.1'", "gone")


def test_a_tensor_re_pointed_at_other_memory_is_refused() -> None:
    caches = {"layers.0": _kv()}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    caches["layers.0"].data = _kv()  # same object, new storage
    _refused(registered, "'layers.0'", "not at the 0x")


def test_the_registered_storage_stays_allocated_after_the_engine_drops_it() -> None:
    caches = {"layers.0": _kv()}
    address = caches["layers.0"].data_ptr()
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    caches["layers.0"].data = _kv()
    assert [s.data_ptr() for s in registered.storages] == [address]


def test_a_tensor_replaced_inside_a_k_v_list_is_refused() -> None:
    caches: dict[str, Any] = {f"layers.{i}": [_kv(), _kv()] for i in range(2)}
    named = [(name, tensor) for name, pair in caches.items() for tensor in pair]
    registered = RegisteredCaches(caches, _regions(named))
    registered.check("add_request", "D")
    caches["layers.1"][1] = _kv()
    _refused(registered, "'layers.1[1]'")


def test_a_tensor_replaced_inside_a_nested_mapping_is_refused() -> None:
    caches: dict[str, Any] = {"pool": {"k": _kv(), "v": _kv()}}
    registered = RegisteredCaches(caches, _regions(list(caches["pool"].items())))
    caches["pool"]["v"] = _kv()
    _refused(registered, "\"pool['v']\"")


def test_a_wrappers_tensor_reassigned_is_refused() -> None:
    caches: dict[str, Any] = {"layers.0": Wrapper(_kv())}
    registered = RegisteredCaches(caches, _regions([("layers.0", caches["layers.0"].tensor)]))
    registered.check("add_request", "D")
    caches["layers.0"].tensor = _kv()
    _refused(registered, "'layers.0'", "replaced")


def test_a_wrapper_making_a_view_per_access_passes_until_its_memory_moves() -> None:
    base = _kv()
    caches: dict[str, Any] = {"layers.0": ComputedView(base)}
    registered = RegisteredCaches(caches, _regions([("layers.0", base)]))
    registered.check("add_request", "D")  # a fresh view of the same memory: the same cache
    base.data = _kv()
    _refused(registered, "'layers.0'", "not at the 0x")


def test_a_change_of_state_kvpush_does_not_move_is_accepted() -> None:
    caches: dict[str, Any] = {"layers.0": _kv(), "state": torch.zeros(3)}
    registered = RegisteredCaches(caches, _regions([("layers.0", caches["layers.0"])]))
    assert set(registered.registered) == {"layers.0"}
    caches["state"] = torch.ones(3)  # holds no region
    caches["extra"] = torch.ones(1)
    registered.check("add_request", "D")
    registered.check("add_request", "D")  # the new snapshot: the cheap path again
    caches["layers.0"] = _kv()
    _refused(registered, "'layers.0'")


def test_a_tensor_reinterpreted_in_place_as_another_dtype_of_its_size_is_refused() -> None:
    """``tensor.data = tensor.view(other dtype)`` keeps identity, address, strides and element
    size: the engine now writes values of another type into the bytes P pushes and D reads as the
    dtype both agreed on at the handshake (wrong KV, silently), so the check compares dtypes too."""
    caches = {f"layers.{i}": _kv() for i in range(4)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    tensor = caches["layers.1"]
    tensor.data = tensor.view(torch.int32)
    assert caches["layers.1"] is tensor and tensor.dtype == torch.int32
    _refused(registered, "'layers.1'", "torch.int32", "torch.float32")


def test_a_view_of_the_registered_bytes_as_another_dtype_is_refused_not_adopted() -> None:
    caches = {f"layers.{i}": _kv() for i in range(4)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    caches["layers.3"] = caches["layers.3"].view(torch.int32)
    _refused(registered, "'layers.3'", "torch.int32")
    caches["layers.3"] = caches["layers.3"].view(torch.float32)  # back to the registered dtype
    registered.check("add_request", "D")


def test_a_wrapper_view_per_access_of_another_dtype_is_refused() -> None:
    base = _kv()
    wrapper = ComputedView(base)
    caches: dict[str, Any] = {"layers.0": wrapper}
    registered = RegisteredCaches(caches, _regions([("layers.0", base)]))
    registered.check("add_request", "D")
    wrapper._tensor = base.view(torch.int32)
    _refused(registered, "'layers.0'", "torch.int32")
