"""Compact, generic wire form of a rank's KV regions (part of the handshake payload).

Regions are sent column by column, one column per :class:`~kvpush.core.types.KVRegion` field
(``attrs.fields``, so a field added to ``KVRegion`` travels without touching this module):

    {"n": number of regions, "cols": {field name: column}}

An int column is ``{"i": [start, step, count, ...]}``: runs of arithmetic progressions, so the
base addresses of regularly spaced regions take three numbers per run. Any other column is
``{"v": [value, count, ...]}``: runs of equal values (tuples travel as lists). 80 layers x 64
regions per layer encode in a few tens of KiB instead of ~1 MiB as maps.

Decoding trusts nothing: the region count is at most ``MAX_REGIONS`` (a run's count is checked
before it is expanded, so a 40-byte payload cannot ask for 2**40 values), and every known field
is range-checked (:data:`FIELD_BOUNDS`), with a ``WireError`` naming the region and the field.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvpush.core.errors import WireError
from kvpush.core.types import KVRegion

__all__ = [
    "FIELD_BOUNDS",
    "MAX_KV_GROUPS",
    "MAX_REGIONS",
    "check_regions",
    "decode_regions",
    "encode_regions",
]

MAX_REGIONS = 1 << 16
"""Most regions one rank may publish (80 layers x 64 regions per layer use 5120)."""
MAX_ADDRESS = (1 << 64) - 1
MAX_KV_GROUPS = 1 << 12
"""Most KV-cache groups a peer may state (regions' ``kv_group`` and registrations' block lists)."""
FIELD_BOUNDS: dict[str, tuple[int, int]] = {
    "base_addr": (0, MAX_ADDRESS),
    "block_len": (1, 1 << 40),
    "block_stride": (1, 1 << 40),
    "num_blocks": (1, 1 << 31),
    "device_id": (0, 1 << 16),
    "kv_group": (0, MAX_KV_GROUPS - 1),
    "num_heads": (1, 1 << 20),
    "block_tokens": (0, 1 << 20),
}
"""``[low, high]`` of each int field of a decoded region (plain ints only, never bools)."""
_BOOL_FIELDS = ("replicate",)
_STR_FIELDS = ("mem_type", "component", "attention_kind", "block_order")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _int_runs(values: Sequence[int]) -> list[int]:
    out: list[int] = []
    i, n = 0, len(values)
    while i < n:
        step = values[i + 1] - values[i] if i + 1 < n else 0
        j = i + 1
        while j < n and values[j] - values[j - 1] == step:
            j += 1
        out += [values[i], step, j - i]
        i = j
    return out


def _value_runs(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if out and out[-2] == value:
            out[-1] += 1
        else:
            out += [value, 1]
    return out


def encode_regions(regions: Sequence[KVRegion]) -> dict[str, Any]:
    """The column-run form of ``regions`` (msgpack-ready)."""
    cols: dict[str, Any] = {}
    for field in attrs.fields(KVRegion):
        values = [_plain(getattr(r, field.name)) for r in regions]
        if values and all(_is_int(v) for v in values):
            cols[field.name] = {"i": _int_runs(values)}
        else:
            cols[field.name] = {"v": _value_runs(values)}
    return {"n": len(regions), "cols": cols}


def _expand(name: str, column: Any, n: int, what: str) -> list[Any]:
    if not isinstance(column, Mapping) or len(column) != 1:
        raise WireError(f"{what}: column {name!r} must be {{'i': runs}} or {{'v': runs}}")
    (kind, runs), values = next(iter(column.items())), []
    if kind not in ("i", "v") or not isinstance(runs, list) or len(runs) % (3 if kind == "i" else 2):
        raise WireError(f"{what}: column {name!r} has malformed runs")
    if kind == "i":
        for k in range(0, len(runs), 3):
            start, step, count = runs[k : k + 3]
            if not (_is_int(start) and _is_int(step) and _is_int(count) and count > 0):
                raise WireError(f"{what}: column {name!r} run {k // 3} is not [start, step, count]")
            if len(values) + count > n:
                raise WireError(
                    f"{what}: column {name!r} run {k // 3} holds {count} values past the {n} regions"
                )
            for value in (start, start + step * (count - 1)):  # the run's extremes
                _check_value(name, value, len(values), what)
            values += range(start, start + step * count, step) if step else [start] * count
    else:
        for k in range(0, len(runs), 2):
            value, count = runs[k : k + 2]
            if not _is_int(count) or count <= 0 or len(values) + count > n:
                raise WireError(f"{what}: column {name!r} run {k // 2} has a bad count {count!r}")
            _check_value(name, value, len(values), what)
            values += [value] * count
    if len(values) != n:
        raise WireError(f"{what}: column {name!r} holds {len(values)} values for {n} regions")
    return values


def decode_regions(encoded: Any, what: str = "regions") -> tuple[KVRegion, ...]:
    """Regions from :func:`encode_regions`' form; ``WireError`` naming the column if malformed."""
    if not isinstance(encoded, Mapping) or not _is_int(encoded.get("n")) or encoded["n"] < 0:
        raise WireError(f"{what} must be {{'n': count, 'cols': {{...}}}}")
    if encoded["n"] > MAX_REGIONS:
        raise WireError(f"{what} count {encoded['n']} is over the {MAX_REGIONS} regions a rank may publish")
    n, cols = encoded["n"], encoded.get("cols")
    if not isinstance(cols, Mapping):
        raise WireError(f"{what} has no 'cols' map")
    # Fields a newer minor release added are ignored (a field that changes what the bytes mean
    # comes with a new wire version instead, which the compatibility hash covers).
    known = {f.name for f in attrs.fields(KVRegion)}
    columns = {name: _expand(name, column, n, what) for name, column in cols.items() if name in known}
    try:
        regions = tuple(KVRegion(**{name: values[i] for name, values in columns.items()}) for i in range(n))
    except (TypeError, ValueError) as err:
        raise WireError(f"{what} are malformed: {err}") from None
    _check_ends(regions, what)
    return regions


def _value_problem(name: str, value: Any) -> str:
    """What is wrong with one value of a known region field ("" when nothing)."""
    if name in FIELD_BOUNDS:
        low, high = FIELD_BOUNDS[name]
        return "" if _is_int(value) and low <= value <= high else f"an int in [{low}, {high}]"
    if name in _BOOL_FIELDS:
        return "" if isinstance(value, bool) else "a bool"
    if name in _STR_FIELDS:
        return "" if isinstance(value, str) and 0 < len(value) <= 64 else "a string of 1 to 64 chars"
    if name == "layer_names":
        ok = isinstance(value, (list, tuple)) and all(isinstance(x, str) and len(x) <= 1024 for x in value)
        return "" if ok else "a list of layer names (strings)"
    return ""


def _check_value(name: str, value: Any, index: int, what: str) -> None:
    problem = _value_problem(name, value)
    if problem:
        raise WireError(f"{what}: region {index} field {name!r} must be {problem}, got {str(value)[:80]!r}")


def _check_ends(regions: Sequence[KVRegion], what: str) -> None:
    for i, region in enumerate(regions):
        if region.end_addr > MAX_ADDRESS:
            raise WireError(f"{what}: region {i} ends at {region.end_addr:#x}, past the 64-bit address space")


def check_regions(regions: Sequence[KVRegion], what: str = "regions") -> None:
    """Refuse (``WireError`` naming the region and field) a peer's regions whose count, field
    types or ranges (:data:`FIELD_BOUNDS`) are out of bounds, or that end past 2**64."""
    if len(regions) > MAX_REGIONS:
        raise WireError(f"{what} count {len(regions)} is over the {MAX_REGIONS} regions a rank may publish")
    names = [f.name for f in attrs.fields(KVRegion)]
    for i, region in enumerate(regions):
        for name in names:
            _check_value(name, getattr(region, name), i, what)
    _check_ends(regions, what)
