"""Building blocks for layout plugins, and the rules every layout's regions must follow.

A layout turns one rank's KV tensors into :class:`~kvpush.core.types.KVRegion`\\ s. The helpers
here do the common parts:

- :func:`natural_key` / :func:`ordered_layers`: a rank's layers in model order
  (``layers.10`` after ``layers.2``), checked against the layers the rank owns;
- :func:`local_heads`: KV heads per TP rank (the model's heads split evenly over TP);
- :func:`tensor_region`: a region over a ``(num_blocks, ...)`` tensor view, addresses included;
- :func:`check_regions`: the layout rules below, each broken rule a ``ConfigError`` naming it.

The layout rules (:data:`RULES`), checked by :func:`check_regions` whenever a rank starts:

``layer_names``
    Every region names the model layer(s) whose KV it holds, with the layer's own name (the key
    of its tensor in ``kv_caches``). The regions of one layer (K and V, or one latent) carry the
    *same* ``layer_names``; different layers never share a name. So a rank owning ``n`` layers
    describes exactly ``n`` distinct ``layer_names``.
``region order``
    Regions come layer by layer in model order: all regions of a layer are adjacent, and
    layers follow the natural order of their names. PP slicing pairs a stage's regions with a
    window of the decode side's list by position, so both sides must list them alike.
``components``
    Inside a layer each region has a distinct ``component`` (``K``, ``V``, ``KV`` or
    ``latent``), and every layer lists the same components in the same order (a layer of
    another KV group may differ; semantic matching pairs by ``(layer_names, kv_group,
    component)``). Regions of one KV group never share bytes (groups may overlay each other).
``kv_group``
    When the ``ModelSpec`` lists the model's KV-cache groups (``layer_groups``), each region's
    ``kv_group`` is ``model.group_of(layer)`` of the layer it holds (the rank's ``i``-th layer
    in natural name order is model layer ``start_layer + i``). Engines hand block ids in that
    group order, and both sides hash the ``ModelSpec``: a layout numbering groups its own way on
    both engines pairs consistently, so no handshake check can see that every layer is read
    and written at the block ids of another group. (A ``ModelSpec`` that lists no groups leaves
    the numbering to the layout, which must then follow the engine's block-id order.)
``in-block order``
    A region declares how its blocks are laid out (``KVRegion.block_order``,
    :mod:`kvpush.core.block_order`): ``heads_outer`` (``(heads, tokens, head_dim)``, "HND"; head
    ``h`` of ``num_heads`` is the ``h``-th equal byte slice of the block) or ``tokens_outer``
    (``(tokens, heads, head_dim)``, "NHD", with ``block_tokens``; a head slice is one range per
    token). A region that declares neither moves whole blocks only: heterogeneous TP is refused
    at handshake. ``block_len`` must divide by ``num_heads``; a replicated region (MLA latent)
    has ``num_heads == 1``. A region that declares an order holds exactly ``num_heads`` x
    ``model.block_size`` tokens x ``head_dim`` of ``model.dtype`` per block (twice for ``KV``;
    with several KV groups, any whole number of tokens): :func:`block_geometry`.
    :func:`tensor_region` checks a tensor's block shape against the declared order, and
    :func:`check_tensors` (run by ``LayoutProvider.describe``) that tensors are of ``model.dtype``
    and hold every region.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.types import KVRegion, ModelSpec, ParallelConfig

__all__ = [
    "RULES",
    "block_geometry",
    "check_regions",
    "check_tensors",
    "layer_groups",
    "local_heads",
    "natural_key",
    "ordered_layers",
    "tensor_region",
]

RULES = ("layer_names", "region order", "components", "kv_group", "in-block order")
"""The names layout-rule errors use (see the module docstring)."""


def natural_key(name: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10`` (digit runs compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def ordered_layers(kv_caches: Mapping[str, Any], parallel: ParallelConfig) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of every layer in natural name order; one entry per layer the rank owns."""
    names = sorted(kv_caches, key=natural_key)
    if len(names) != parallel.num_local_layers:
        raise ConfigError(
            f"got KV caches for {len(names)} layers, but rank {parallel.rank} owns "
            f"{parallel.num_local_layers} (layers {parallel.start_layer}-{parallel.end_layer - 1}); "
            f"pass one tensor per owned layer, keyed by the layer's name"
        )
    return [(name, kv_caches[name]) for name in names]


def local_heads(model: ModelSpec, parallel: ParallelConfig) -> int:
    """KV heads one TP rank holds: ``model.num_kv_heads / parallel.tp_size``, which must divide."""
    if model.num_kv_heads % parallel.tp_size:
        raise ConfigError(
            f"ModelSpec.num_kv_heads={model.num_kv_heads} cannot be split evenly over "
            f"ParallelConfig.tp_size={parallel.tp_size}; replicated GQA heads are not supported"
        )
    return model.num_kv_heads // parallel.tp_size


def tensor_region(tensor: Any, **identity: Any) -> KVRegion:
    """A region over a ``(num_blocks, ...)`` tensor whose blocks are each contiguous.

    ``identity`` holds the :class:`KVRegion` fields that say what the region is
    (``layer_names``, ``component``, ``kv_group``, ``num_heads``, ...); the address, block
    length and stride, block count, memory type and device come from the tensor. ``tensor[b]``
    must be block ``b``, laid out as ``identity``'s ``block_order`` says (the in-block order rule).
    """
    if not tensor[0].is_contiguous():
        raise ConfigError(
            f"blocks of {identity.get('layer_names')} are not contiguous in memory; each block "
            f"(tensor[b]) must be one contiguous span"
        )
    _check_block_shape(tuple(tensor.shape), identity)
    element = tensor.element_size()
    return KVRegion(
        base_addr=tensor.data_ptr(),
        block_len=tensor[0].numel() * element,
        block_stride=tensor.stride(0) * element,
        num_blocks=tensor.shape[0],
        mem_type="VRAM" if tensor.is_cuda else "DRAM",
        device_id=tensor.device.index or 0 if tensor.is_cuda else 0,
        **identity,
    )


def _check_block_shape(shape: tuple[int, ...], identity: Mapping[str, Any]) -> None:
    """The in-block order rule against a ``(blocks, a, b, ...)`` tensor's shape: a declared
    ``heads_outer`` block's first dimension is its heads, a ``tokens_outer`` block's its tokens
    (then heads). A one-head block is the same bytes either way; a block whose first two
    dimensions are equal cannot be told apart, nor a flat one."""
    order, heads = identity.get("block_order", "unspecified"), identity.get("num_heads", 1)
    if len(shape) < 3 or heads == 1 or order not in ("heads_outer", "tokens_outer"):
        return
    names = identity.get("layer_names")
    tokens = identity.get("block_tokens", 0)
    block = shape[1:]
    if order == "heads_outer" and block[0] != heads:
        if len(block) >= 3 and block[1] == heads and block[0] == 2 and identity.get("component") == "KV":
            hint = (
                "K and V are outermost in its blocks ((2, heads, ...)): describe them as two "
                "regions, tensor[:, 0] as component 'K' and tensor[:, 1] as 'V'"
            )
        elif len(block) >= 3 and block[1] == heads:
            hint = f"its blocks look token-major: declare block_order='tokens_outer', block_tokens={block[0]}"
        else:
            hint = f"num_heads={heads} is not its first block dimension"
        raise ConfigError(
            f"region of {names} breaks the in-block order rule: it declares heads_outer (a "
            f"block is (heads, ...), head h its h-th equal byte slice) but its tensor is "
            f"{shape}; {hint}. Under heterogeneous TP a head slice of a wrongly declared block "
            f"moves other bytes than that head's"
        )
    if order == "tokens_outer" and (block[0] != tokens or (len(block) >= 3 and block[1] != heads)):
        raise ConfigError(
            f"region of {names} breaks the in-block order rule: it declares tokens_outer with "
            f"block_tokens={tokens} and num_heads={heads} (a block is (tokens, heads, ...)), "
            f"but its tensor is {shape}"
        )


DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}
"""Bytes per element of the ``ModelSpec.dtype`` names the geometry rule knows (others: unchecked)."""

FP8_FORMATS = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
"""fp8 formats a uint8 tensor may hold: engines keep fp8 caches in uint8 buffers (SGLang's
``store_dtype``, vLLM's fp8 caches), so the tensor cannot say which; ``ModelSpec.dtype`` does."""


def block_geometry(region: KVRegion, model: ModelSpec, *, tokens: int | None = None) -> str | None:
    """Why a region that declares an in-block order does not hold what it declares (None: it
    does): a ``heads_outer``/``tokens_outer`` block is ``num_heads`` heads x ``tokens`` tokens x
    ``head_dim`` elements of ``model.dtype`` (twice that for a ``KV`` block), ``tokens``
    being ``model.block_size`` (the default) or, with ``tokens=0``, any whole number of tokens
    (a hybrid engine's groups may cut blocks into kernel blocks of their own size). A padded
    block length, two blocks described as one, another element size than the model's or
    another token count put head slices and block ids on other bytes than the peer's.
    Undeclared regions move whole blocks only and are not checked."""
    size = DTYPE_BYTES.get(model.dtype)
    if region.block_order == "unspecified" or size is None:
        return None
    row = model.head_dim * size * (2 if region.component == "KV" else 1)
    per_head, rest = divmod(region.block_len, region.num_heads * row)
    want = model.block_size if tokens is None else tokens  # 0: any whole number of tokens
    fits = not rest and per_head > 0 and (not want or per_head == want)
    if region.block_order == "tokens_outer":
        fits = fits and region.block_tokens == per_head
    if fits:
        return None
    kv = ", K and V" if region.component == "KV" else ""
    shape = f"{region.num_heads} head(s) x {want or 'a whole number of'} tokens x {row} B"
    return (
        f"{region.layer_names[0]} {region.component} declares {region.block_order} blocks of "
        f"{region.block_len} B, but a block of the model is {shape} (head_dim {model.head_dim} "
        f"of {model.dtype}{kv}). block_len must be one block's bytes exactly: without padding "
        f"(put it in block_stride), one block per block id, in ModelSpec.dtype (the cache's "
        f"dtype, e.g. an fp8 cache needs dtype='float8_e4m3fn'), with block_tokens = "
        f"ModelSpec.block_size"
    )


def _shared_bytes(regions: Sequence[KVRegion]) -> tuple[int, int] | None:
    """Two regions of one KV group whose blocks share a byte (indices), or None. Groups may
    overlay each other (vLLM's hybrid groups view one tensor); regions of a group may not."""
    order = sorted(range(len(regions)), key=lambda i: (regions[i].kv_group, regions[i].base_addr))
    active: list[int] = []
    found: list[tuple[int, int]] = []
    for i in order:
        region = regions[i]
        active = [
            j
            for j in active
            if regions[j].kv_group == region.kv_group and regions[j].end_addr > region.base_addr
        ]
        found += [(min(i, j), max(i, j)) for j in active if _blocks_meet(regions[j], region)]
        active.append(i)
    return min(found, default=None)  # the first pair in the layout's own order


def _blocks_meet(a: KVRegion, b: KVRegion) -> bool:
    """Whether a block of ``a`` and a block of ``b`` share a byte (their spans overlap)."""
    import numpy as np

    small, big = (a, b) if a.num_blocks <= b.num_blocks else (b, a)
    starts = small.base_addr + np.arange(small.num_blocks, dtype=np.int64) * small.block_stride
    ends = starts + small.block_len
    stride, base = big.block_stride, big.base_addr
    lo = np.maximum((starts - base - big.block_len) // stride + 1, 0)  # first big block ending past start
    hi = np.minimum(-((base - ends) // stride) - 1, big.num_blocks - 1)  # last one starting before end
    return bool(np.any(lo <= hi))


def check_tensors(
    kv_caches: Mapping[str, Any], regions: Sequence[KVRegion], model: ModelSpec, *, layout: str = "?"
) -> None:
    """Raise ``ConfigError`` when a KV tensor holding a region is not of ``model.dtype`` or a
    region reaches outside every tensor of ``kv_caches`` (values are tensors, objects with
    ``.tensor``, or tuples, lists or mappings of them such as ``(K, V)`` pairs; tensors holding
    no region are not checked). Caches holding no tensor at all cannot be checked: refused.

    ``model.dtype`` feeds the compatibility hash, so it must be the cache's own dtype: two
    engines whose caches hold fp8 of different formats (or bf16 vs fp16) under one
    ``ModelSpec`` exchange bytes the other reads as other numbers. A uint8 tensor may hold any
    of :data:`FP8_FORMATS` (an fp8 cache kept in uint8 buffers): the ``ModelSpec`` names it.
    A region outside the tensors would have P write (or read) memory no block id names."""
    spans = []
    for key, tensor in _tensors(kv_caches):
        extent = 1 + sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride()) if n)
        start = tensor.data_ptr()
        dtype = str(tensor.dtype).removeprefix("torch.")
        spans.append((start, start + extent * tensor.element_size(), key, dtype))
    if not spans:
        if regions:
            raise ConfigError(
                f"layout {layout!r}: kv_caches holds no tensor (values must be tensors, objects "
                f"with .tensor, or tuples / lists / dicts of them), so kvpush cannot check that "
                f"its regions lie inside the KV memory and hold ModelSpec.dtype {model.dtype!r}"
            )
        return
    for index, region in enumerate(regions):
        holders = [s for s in spans if s[0] <= region.base_addr and region.end_addr <= s[1]]
        # Only tensors that hold a region: a state the engine does not transfer (a group
        # excluded from transfer) may have a dtype of its own.
        for _lo, _hi, key, dtype in holders:
            if dtype != model.dtype and not (dtype == "uint8" and model.dtype in FP8_FORMATS):
                hint = ""
                if dtype == "uint8" or model.dtype == "uint8":
                    hint = (
                        ". An fp8 cache kept in uint8 buffers (SGLang, vLLM) states its fp8 "
                        f"format, {' or '.join(repr(f) for f in FP8_FORMATS[::2])}, never "
                        f"'uint8': uint8 on both engines hashes alike whatever the formats"
                    )
                raise ConfigError(
                    f"layout {layout!r}: KV cache {key!r} holds {dtype} but ModelSpec.dtype is "
                    f"{model.dtype!r}; ModelSpec.dtype must be the KV cache's dtype (both "
                    f"engines hash it: a peer whose cache holds another format would read these "
                    f"bytes as other numbers){hint}"
                )
        if not holders:
            raise ConfigError(
                f"layout {layout!r}: region {index} ({region.layer_names[0]} {region.component}) "
                f"spans bytes [{region.base_addr:#x}, {region.end_addr:#x}) ({region.num_blocks} "
                f"blocks of {region.block_len} B every {region.block_stride} B), outside every KV "
                f"tensor it was described from; a WRITE would land in memory no block id names"
            )


def _tensors(kv_caches: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(key, tensor)`` of every tensor in ``kv_caches``: a value that is a tensor, has one as
    ``.tensor``, or holds them in a tuple, list or mapping (an engine's ``(K, V)`` pairs)."""
    out: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = list(reversed(list(kv_caches.items())))
    while stack:
        key, value = stack.pop()
        tensor = getattr(value, "tensor", value)
        if hasattr(tensor, "data_ptr") and hasattr(tensor, "dtype"):
            out.append((key, tensor))
        elif isinstance(value, (tuple, list)):
            stack += [(f"{key}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
        elif isinstance(value, Mapping):
            stack += [(f"{key}[{k!r}]", v) for k, v in reversed(list(value.items()))]
    return out


def layer_groups(regions: Sequence[KVRegion]) -> list[tuple[tuple[str, ...], list[int]]]:
    """Adjacent regions with equal ``layer_names``: ``[(layer_names, [region indices]), ...]``."""
    groups: list[tuple[tuple[str, ...], list[int]]] = []
    for index, region in enumerate(regions):
        if groups and groups[-1][0] == region.layer_names:
            groups[-1][1].append(index)
        else:
            groups.append((region.layer_names, [index]))
    return groups


def _names(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_regions(
    regions: Sequence[KVRegion],
    parallel: ParallelConfig,
    model: ModelSpec | None = None,
    *,
    layout: str = "?",
) -> None:
    """Raise ``ConfigError`` naming the first layout rule the regions break (see :data:`RULES`)."""
    where = f"layout {layout!r} on rank {parallel.rank}"
    if not regions:
        raise ConfigError(f"{where} described no KV regions")
    groups = layer_groups(regions)
    unnamed = [i for i, r in enumerate(regions) if not r.layer_names or not all(r.layer_names)]
    if unnamed:
        raise ConfigError(
            f"{where} breaks the layer_names rule: regions {unnamed[:8]} name no layer; set "
            f"layer_names to the model layer the region belongs to"
        )
    seen: dict[str, int] = {}
    for position, (names, indices) in enumerate(groups):
        for name in names:
            if name in seen:
                earlier = groups[seen[name]]
                if earlier[0] == names:
                    raise ConfigError(
                        f"{where} breaks the region order rule: the regions of layer {name!r} are "
                        f"not adjacent (regions {earlier[1]} and {indices}); list every region of "
                        f"a layer together, layer after layer"
                    )
                raise ConfigError(
                    f"{where} breaks the layer_names rule: layer {name!r} appears in regions "
                    f"{earlier[1]} (layer_names {earlier[0]}) and {indices} (layer_names {names}); "
                    f"all regions of a layer carry the same layer_names"
                )
            seen[name] = position
    distinct = [names for names, _ in groups]
    if len(seen) != parallel.num_local_layers:
        flat = [n for names in distinct for n in names]
        raise ConfigError(
            f"{where} breaks the layer_names rule: its regions name {len(seen)} distinct layers "
            f"({_names(flat)}) but the rank owns {parallel.num_local_layers} (layers "
            f"{parallel.start_layer}-{parallel.end_layer - 1}). layer_names must be the model "
            f"layer's name, the same for K and V of that layer (not one name per tensor such as "
            f"'layers.0.k'/'layers.0.v'), and every layer the rank owns needs a region (a layer "
            f"left out, e.g. of a KV-cache group the engine does not transfer, gets no KV on D)"
        )
    keys = [natural_key(names[0]) for names in distinct]
    for i in range(1, len(keys)):
        if keys[i] < keys[i - 1]:
            raise ConfigError(
                f"{where} breaks the region order rule: layer {distinct[i][0]!r} comes after "
                f"{distinct[i - 1][0]!r}; list layers in model order (natural order of names, "
                f"layers.2 before layers.10)"
            )
    per_group: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for names, indices in groups:
        components = tuple(regions[i].component for i in indices)
        if len(set(components)) != len(components):
            raise ConfigError(
                f"{where} breaks the components rule: layer {names[0]!r} has components "
                f"{list(components)}; each region of a layer needs a distinct component (K, V, "
                f"KV or latent)"
            )
        group = regions[indices[0]].kv_group
        first = per_group.setdefault(group, (names, components))
        if first[1] != components:
            raise ConfigError(
                f"{where} breaks the components rule: layer {names[0]!r} lists components "
                f"{list(components)} but layer {first[0][0]!r} of the same KV group lists "
                f"{list(first[1])}; every layer of a group lists the same components in the same order"
            )
    if model is not None and model.layer_groups:
        _check_groups(regions, parallel, model, sorted(seen, key=natural_key), where)
    # A region of a group above 0 proves the model has several groups, even when all of this
    # rank's regions are of that one group (a PP stage of a hybrid model holding no layer of
    # group 0): its blocks may be kernel blocks of another width than ModelSpec.block_size.
    kv_groups = {r.kv_group for r in regions}
    one_group = kv_groups == {0} and (model is None or model.num_groups == 1)
    for index, region in enumerate(regions):
        what = f"region {index} ({region.layer_names[0]} {region.component})"
        if region.num_heads <= 0 or region.block_len % region.num_heads:
            raise ConfigError(
                f"{where} breaks the in-block order rule: {what} has block_len "
                f"{region.block_len} and num_heads {region.num_heads}; a block holds num_heads "
                f"equal head slices (heads outermost), so block_len must divide by num_heads"
            )
        if region.replicate and region.num_heads != 1:
            raise ConfigError(
                f"{where} breaks the in-block order rule: {what} is replicated (every TP rank "
                f"holds the same bytes) but says num_heads={region.num_heads}; use num_heads=1"
            )
        why = None if model is None else block_geometry(region, model, tokens=None if one_group else 0)
        if why is not None:
            raise ConfigError(f"{where} breaks the in-block order rule: region {index}: {why}")
    shared = _shared_bytes(regions)
    if shared is not None:
        i, j = shared
        a, b = regions[i], regions[j]
        raise ConfigError(
            f"{where} breaks the components rule: region {i} ({a.layer_names[0]} {a.component}) "
            f"and region {j} ({b.layer_names[0]} {b.component}) of KV group {a.kv_group} share "
            f"bytes; each region is its own memory (K of tensor[0], V of tensor[1], ...). Two "
            f"regions over one tensor get one side's bytes written twice and the other's never"
        )


def _check_groups(
    regions: Sequence[KVRegion], parallel: ParallelConfig, model: ModelSpec, names: list[str], where: str
) -> None:
    """The kv_group rule: ``names`` are the rank's distinct layer names in natural order (the
    layer_names and region order rules hold), so ``names[i]`` is model layer ``start_layer + i``."""
    layer_of = {name: parallel.start_layer + i for i, name in enumerate(names)}
    for index, region in enumerate(regions):
        for name in region.layer_names:
            layer = layer_of[name]
            if not 0 <= layer < len(model.layer_groups):
                raise ConfigError(
                    f"{where} breaks the kv_group rule: layer {name!r} is model layer {layer} but "
                    f"ModelSpec.layer_groups lists {len(model.layer_groups)} layers"
                )
            want = model.group_of(layer)
            if region.kv_group != want:
                raise ConfigError(
                    f"{where} breaks the kv_group rule: region {index} of layer {name!r} (model "
                    f"layer {layer}) says kv_group {region.kv_group} but ModelSpec.group_of({layer}) "
                    f"is {want}; engines hand block ids in the ModelSpec's group order, so this "
                    f"layer would be read and written at another group's block ids. Set "
                    f"kv_group=model.group_of(parallel.start_layer + position), or leave "
                    f"ModelSpec.layer_groups empty when the engine numbers its groups otherwise"
                )
