"""Frozen attrs types for everything that crosses a hook, the side channel or a notification.

Block ids are always given per KV-cache group: ``((ids of group 0), (ids of group 1), ...)``.
Non-hybrid models have one group.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import attrs
from attrs import field, frozen

from kvpush.core.addresses import canonical_host
from kvpush.core.errors import ConfigError
from kvpush.core.fingerprint import check_fingerprint

MemType = Literal["DRAM", "VRAM"]
Component = Literal["K", "V", "KV", "latent"]
AttentionKind = Literal["full", "sliding_window"]
BlockOrder = Literal["unspecified", "heads_outer", "tokens_outer"]
BLOCK_ORDERS: tuple[str, ...] = ("unspecified", "heads_outer", "tokens_outer")
BlockIds = tuple[tuple[int, ...], ...]
BlockIdsLike = Sequence[int] | Sequence[Sequence[int]]
"""Block ids as an engine passes them: a flat list (one KV group) or one list per KV group;
any iterable of ints, numpy / torch integer arrays and scalars included. kvpush normalises them
to :data:`BlockIds` (a tuple of per-group tuples)."""


def to_block_ids(value: Any) -> BlockIds:
    """Normalise block ids to a tuple of per-group tuples; a flat list becomes one group."""
    if value is None:
        return ()
    if _CHECKED.get(id(value)) is value:
        return value  # normalised and checked before (each hop of a request passes it on)
    if type(value) is tuple and all(type(g) is tuple and _plain_ids(g) for g in value):
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[id(value)] = value  # the entry holds the tuple, so its id is not reused
        return value
    value = _array_ids(value)
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Iterable):
        raise ConfigError(f"block ids must be a list of ints or a list of per-group lists, got {value!r}")
    _check_ordered(value)
    items = list(value)
    if items and (
        _INT.issuperset(map(type, items))
        or all(isinstance(x, int) and not isinstance(x, bool) for x in items)
    ):
        return to_block_ids([items])  # one group, checked like any other
    items = [_array_ids(item) for item in items]  # per-group arrays, numpy / torch scalars
    if items and all(_is_int(x) for x in items):
        return to_block_ids([[int(x) for x in items]])
    groups = []
    for group in items:
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise ConfigError(f"block ids must be a list of ints or a list of per-group lists, got {value!r}")
        _check_ordered(group)
        ids = tuple(group)
        if not _plain_ids(ids):  # else: numpy / torch scalars, int subclasses, or a bad id
            if all(_is_int(block) for block in ids):
                ids = tuple(int(block) for block in ids)
            for block in ids:
                if not isinstance(block, int) or isinstance(block, bool) or block < 0:
                    raise ConfigError(f"block id {block!r} in {value!r} is not a non-negative int")
        groups.append(ids)
    return tuple(groups)


def _check_ordered(value: Any) -> None:
    """Refuse a container whose iteration is not the engine's block order: a mapping iterates
    its keys (``{0: [5, 2, 7]}`` would be block 0), a set its own order (not the token order)."""
    if isinstance(value, (Mapping, AbstractSet)):
        kind = "a mapping (it iterates its keys)" if isinstance(value, Mapping) else "a set (unordered)"
        raise ConfigError(
            f"block ids must be in token order, one list per KV group in group order; got "
            f"{kind}: {value!r:.200}. Pass a list (per-group lists: [ids of group 0, ...])"
        )


def _array_ids(value: Any) -> Any:
    """A numpy array or torch tensor of block ids as (nested) lists of ints; other values as
    they are. Iterating a 1-D tensor gives 0-d tensors, and a numpy array numpy scalars, which
    are not ints: engines keep block tables in both (SGLang's ``req_to_token``). An array of
    another dtype (float, bool) is refused naming it."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not callable(getattr(value, "tolist", None)) or isinstance(value, (str, bytes)):
        return value
    name = str(dtype).removeprefix("torch.")
    if not _INTEGER_DTYPE.fullmatch(name):
        raise ConfigError(
            f"block ids must be integers, got an array of dtype {name}: {value!r:.200}; pass "
            f"an integer array (e.g. .long()/.astype('int64')) or a list of ints"
        )
    return value.tolist()


_INTEGER_DTYPE = re.compile(r"u?int(8|16|32|64)")


def _is_int(value: Any) -> bool:
    """A plain int, or an integer scalar of numpy/torch (an ``__index__`` that is not a bool)."""
    if isinstance(value, int):
        return not isinstance(value, bool)
    dtype = getattr(value, "dtype", None)
    return (
        dtype is not None
        and _INTEGER_DTYPE.fullmatch(str(dtype).removeprefix("torch.")) is not None
        and getattr(value, "ndim", 0) == 0
        and hasattr(value, "__index__")
    )


_INT = frozenset((int,))
_CHECKED: dict[int, tuple[tuple[int, ...], ...]] = {}
"""Recently checked normalised block ids by id() (immutable, so checked once)."""
_CHECKED_MAX = 64


def _plain_ids(ids: tuple[Any, ...]) -> bool:
    """Every id a plain, non-negative ``int`` (no bool or int subclass), checked at C speed."""
    return not ids or (_INT.issuperset(map(type, ids)) and min(ids) >= 0)


def read_only(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only view of a fresh copy of ``mapping`` (results handed to engines are immutable)."""
    return MappingProxyType(dict(mapping))


def _non_negative(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name} must be a non-negative int, got {value!r}")


def _positive(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


class HandshakeMode(enum.Enum):
    """How much of a peer is loaded during a handshake."""

    FULL = "full"
    """Load the agent, align regions and prepare remote descriptor lists (P → D)."""
    NOTIF_ONLY = "notif_only"
    """Load the agents only, to send notifications; no descriptors (D → P, always)."""


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class _RankPair(NamedTuple):
    pp_rank: int
    tp_rank: int


class RankKey(_RankPair):
    """Identity of one rank of an engine. Non-PP engines use ``pp_rank`` 0.

    A tuple underneath: hashing and comparing it runs in C, which matters on D's completion
    path (every DONE is looked up by its producer)."""

    __slots__ = ()

    def __new__(cls, pp_rank: int, tp_rank: int) -> RankKey:
        for name, value in (("pp_rank", pp_rank), ("tp_rank", tp_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
        return super().__new__(cls, pp_rank, tp_rank)

    def __str__(self) -> str:
        return f"(pp={self.pp_rank}, tp={self.tp_rank})"

    def __repr__(self) -> str:
        return f"RankKey(pp_rank={self.pp_rank}, tp_rank={self.tp_rank})"


@frozen(kw_only=True)
class ParallelConfig:
    """Where one rank sits in its engine: TP and PP position and the layers it owns."""

    tp_size: int = field(validator=_positive)
    tp_rank: int = field(default=0, validator=_non_negative)
    pp_size: int = field(default=1, validator=_positive)
    pp_rank: int = field(default=0, validator=_non_negative)
    num_layers: int = field(validator=_positive)
    """Layers of the whole model."""
    start_layer: int = field(default=0, validator=_non_negative)
    end_layer: int = field(default=-1)
    """One past the last layer this rank owns; -1 means ``num_layers``."""

    def __attrs_post_init__(self) -> None:
        if self.end_layer == -1:
            object.__setattr__(self, "end_layer", self.num_layers)
        if self.tp_rank >= self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is not below tp_size {self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise ConfigError(f"pp_rank {self.pp_rank} is not below pp_size {self.pp_size}")
        if not 0 <= self.start_layer < self.end_layer <= self.num_layers:
            raise ConfigError(
                f"layer window [{self.start_layer}, {self.end_layer}) must be non-empty and "
                f"inside the model's {self.num_layers} layers"
            )

    @property
    def rank(self) -> RankKey:
        return RankKey(self.pp_rank, self.tp_rank)

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @classmethod
    def for_stage(
        cls, *, num_layers: int, pp_size: int, pp_rank: int, tp_size: int, tp_rank: int
    ) -> ParallelConfig:
        """Split ``num_layers`` as evenly as possible over ``pp_size`` stages (earlier get more)."""
        if pp_size > num_layers:
            raise ConfigError(f"pp_size {pp_size} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        end = start + base + (1 if pp_rank < extra else 0)
        return cls(
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
            num_layers=num_layers,
            start_layer=start,
            end_layer=end,
        )


@frozen(kw_only=True)
class ModelSpec:
    """The model facts both sides must agree on (they feed the compatibility hash)."""

    name: str
    num_layers: int = field(validator=_positive)
    attention: Literal["mha", "mla"] = "mha"
    num_kv_heads: int = field(default=1, validator=_positive)
    """Total KV heads (1 for MLA)."""
    head_dim: int = field(default=64, validator=_positive)
    """Per-head size; for MLA the latent size."""
    block_size: int = field(default=16, validator=_positive)
    """Tokens per block."""
    dtype: str = "bfloat16"
    layer_groups: tuple[int, ...] = field(default=(), converter=tuple)
    """KV-cache group of each layer (hybrid models); empty = every layer in group 0."""
    layer_kinds: tuple[str, ...] = field(default=(), converter=tuple)
    """Attention kind of each layer (``full``/``sliding_window``); empty = all full."""

    def __attrs_post_init__(self) -> None:
        for name in ("layer_groups", "layer_kinds"):
            value = getattr(self, name)
            if value and len(value) != self.num_layers:
                raise ConfigError(
                    f"ModelSpec.{name} has {len(value)} entries; it needs one per layer "
                    f"({self.num_layers}) or none"
                )

    def group_of(self, layer: int) -> int:
        return self.layer_groups[layer] if self.layer_groups else 0

    def kind_of(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    @property
    def num_groups(self) -> int:
        return max(self.layer_groups) + 1 if self.layer_groups else 1


@frozen(kw_only=True)
class KVRegion:
    """One registered KV region: an array of equally sized, equally spaced blocks."""

    base_addr: int = field(validator=_non_negative)
    block_len: int = field(validator=_positive)
    """Bytes transferred per block."""
    block_stride: int = field(validator=_positive)
    """Bytes between the starts of consecutive blocks (>= block_len)."""
    num_blocks: int = field(validator=_positive)
    mem_type: MemType = "DRAM"
    device_id: int = 0
    layer_names: tuple[str, ...] = field(converter=tuple)
    kv_group: int = 0
    component: Component = "KV"
    replicate: bool = False
    """True when every TP rank holds the same bytes (MLA latent); False when heads are split."""
    attention_kind: AttentionKind = "full"
    num_heads: int = 1
    """Heads this rank holds in the region (1 for a replicated latent)."""
    block_order: BlockOrder = "unspecified"
    """How a block is laid out inside (see docs/architecture.md, "In-block order"):
    ``heads_outer`` (HND, ``[heads, tokens, head_dim]``: a head slice is one byte range),
    ``tokens_outer`` (NHD, ``[tokens, heads, head_dim]``: a head slice is one range per token)
    or ``unspecified`` (whole blocks only: heterogeneous TP is refused at handshake)."""
    block_tokens: int = field(default=0, validator=_non_negative)
    """Tokens per block; required (> 0) for ``tokens_outer``."""

    def __attrs_post_init__(self) -> None:
        if self.block_stride < self.block_len:
            raise ConfigError(
                f"region of {self.layer_names}: block_stride {self.block_stride} is smaller "
                f"than block_len {self.block_len}; blocks would overlap"
            )
        if self.block_order not in BLOCK_ORDERS:
            raise ConfigError(
                f"region of {self.layer_names}: block_order {self.block_order!r} is not one of {BLOCK_ORDERS}"
            )
        if self.block_order == "tokens_outer" and (
            self.block_tokens <= 0 or self.block_len % (self.block_tokens * self.num_heads)
        ):
            raise ConfigError(
                f"region of {self.layer_names}: a tokens_outer block needs block_tokens > 0 with "
                f"block_len ({self.block_len}) a multiple of block_tokens ({self.block_tokens}) x "
                f"num_heads ({self.num_heads}); set block_tokens to the tokens per block"
            )
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ConfigError(f"mem_type must be 'DRAM' or 'VRAM', got {self.mem_type!r}")

    @property
    def semantic_key(self) -> tuple[tuple[str, ...], int, str]:
        """What the region *is*, independent of where it lives: layers, group, component."""
        return (self.layer_names, self.kv_group, self.component)

    @property
    def end_addr(self) -> int:
        return self.base_addr + (self.num_blocks - 1) * self.block_stride + self.block_len

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's row of a ``tokens_outer`` block (all heads of the region)."""
        return self.block_len // self.block_tokens if self.block_tokens else self.block_len


@frozen(kw_only=True)
class AgentMetadata:
    """What one rank publishes about itself on the side channel (the handshake payload)."""

    engine_id: str
    role: Role
    parallel: ParallelConfig
    model: ModelSpec
    layout: str
    transport: str
    agent_name: str
    agent_blob: bytes = field(repr=lambda b: f"<{len(b)} bytes>")
    regions: tuple[KVRegion, ...] = field(converter=tuple)
    incarnation: str = ""
    """Random id of this engine start; a peer seen with a new one is a new peer."""
    extensions: Mapping[str, Any] = field(factory=dict, hash=False)
    """Extra published fields contributed by plugins (``kvpush_metadata_extensions``)."""

    @property
    def rank(self) -> RankKey:
        return self.parallel.rank


_MAX_SIZE = {"remote_port": 65535, "tp_size": 4096, "pp_size": 4096}


@frozen(kw_only=True)
class TransferParams:
    """The ``kv_transfer_params`` a router gives D, with vLLM's field names."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int | None = None
    """P's TP size as the router saw it; None when absent. D checks it against P's published
    ``ParallelConfig`` and fails the request when they disagree (never a default of 1)."""
    pp_size: int | None = None
    """P's PP size as the router saw it; None when absent (checked like ``tp_size``)."""
    remote_block_ids: BlockIds | None = None
    remote_request_id: str | None = None
    transfer_id: str | None = None
    prompt_fingerprint: str | None = field(
        default=None,
        validator=lambda _i, _a, v: check_fingerprint(v, "TransferParams.prompt_fingerprint"),
    )
    """:func:`~kvpush.core.fingerprint.prompt_fingerprint` of *D's own* prompt, or None. Sent
    in D's ``PUSH_REG``; a P that was given its prompt's fingerprint too refuses to pair the
    two when they differ (a key reused for another prompt). None: pairing rests on the key."""

    _REQUIRED = ("remote_engine_id", "remote_host", "remote_port")

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> TransferParams:
        """Validate a ``kv_transfer_params`` dict; errors name the field and what it needs."""
        if not isinstance(params, Mapping):
            raise ConfigError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
        for name in cls._REQUIRED:
            if params.get(name) is None:
                raise ConfigError(f"kv_transfer_params is missing {name!r} (P's coordinates)")
        checks = {
            "remote_engine_id": str,
            "remote_host": str,
            "remote_request_id": str,
            "transfer_id": str,
        }
        for name, kind in checks.items():
            value = params.get(name)
            if value is not None and not isinstance(value, kind):
                raise ConfigError(f"kv_transfer_params[{name!r}] must be a {kind.__name__}, got {value!r}")
        ints: dict[str, int | None] = {}
        for name in ("remote_port", "tp_size", "pp_size"):
            value = params.get(name)
            if value is None and name != "remote_port":
                ints[name] = None  # absent: D takes P's published size, never a default
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= _MAX_SIZE[name]:
                raise ConfigError(
                    f"kv_transfer_params[{name!r}] must be an int in [1, {_MAX_SIZE[name]}], got {value!r}"
                )
            ints[name] = value
        if ints["remote_port"] > 65535:
            raise ConfigError(f"kv_transfer_params['remote_port'] {ints['remote_port']} > 65535")
        block_ids = params.get("remote_block_ids")
        try:
            blocks = None if block_ids is None else to_block_ids(block_ids)
        except ConfigError as err:
            raise ConfigError(f"kv_transfer_params['remote_block_ids']: {err}") from None
        fingerprint = check_fingerprint(
            params.get("prompt_fingerprint"), "kv_transfer_params['prompt_fingerprint']"
        )
        return cls(
            remote_engine_id=params["remote_engine_id"],
            remote_host=canonical_host(params["remote_host"], "kv_transfer_params['remote_host']"),
            remote_port=ints["remote_port"],
            tp_size=ints["tp_size"],
            pp_size=ints["pp_size"],
            remote_block_ids=blocks,
            remote_request_id=params.get("remote_request_id"),
            transfer_id=params.get("transfer_id"),
            prompt_fingerprint=fingerprint,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
        }
        if self.tp_size is not None:
            out["tp_size"] = self.tp_size
        if self.pp_size is not None:
            out["pp_size"] = self.pp_size
        if self.remote_block_ids is not None:
            out["remote_block_ids"] = [list(g) for g in self.remote_block_ids]
        if self.remote_request_id is not None:
            out["remote_request_id"] = self.remote_request_id
        if self.transfer_id is not None:
            out["transfer_id"] = self.transfer_id
        if self.prompt_fingerprint is not None:
            out["prompt_fingerprint"] = self.prompt_fingerprint
        return out

    @property
    def match_key(self) -> str:
        """The key P matches D's registration on: ``transfer_id``, else P's request id."""
        key = self.transfer_id or self.remote_request_id
        if not key:
            raise ConfigError(
                "kv_transfer_params needs 'transfer_id' or 'remote_request_id' so P can match "
                "D's registration to its finished prefill"
            )
        return key


MAX_BLOCK_START = (1 << 31) - 1
"""Largest block index a side may state as where its blocks start (a block id's bound)."""
MAX_PROMPT_TOKENS = 1 << 40
"""Largest prompt length (tokens) a side may state."""


def to_block_start(value: Any) -> tuple[int, ...] | None:
    """``block_start`` as a tuple of per-group block indices, or None (not stated). An int is
    one group's start; any ordered iterable of ints is one start per KV group."""
    if value is None:
        return None
    if _is_int(value):
        value = (value,)
    value = _array_ids(value)
    if isinstance(value, (str, bytes, Mapping, AbstractSet)) or not isinstance(value, Iterable):
        raise ConfigError(
            f"block_start must be an int (one KV group) or one int per KV group, got {value!r:.200}"
        )
    starts = tuple(value)
    if not starts or not all(_is_int(s) and 0 <= int(s) <= MAX_BLOCK_START for s in starts):
        raise ConfigError(
            f"block_start must be an int (one KV group) or one int per KV group, each in "
            f"[0, {MAX_BLOCK_START}], got {value!r:.200}"
        )
    return tuple(int(s) for s in starts)


def check_num_tokens(value: Any, what: str) -> int | None:
    """A stated prompt length: None, or an int in [0, ``MAX_PROMPT_TOKENS``]."""
    if value is not None and (not _is_int(value) or not 0 <= int(value) <= MAX_PROMPT_TOKENS):
        raise ConfigError(f"{what} must be a non-negative int (or None), got {value!r:.80}")
    return None if value is None else int(value)


@frozen(kw_only=True)
class RequestMetadata:
    """A request D receives: its own id, its blocks per group, and where P is."""

    request_id: str
    block_ids: BlockIds = field(converter=to_block_ids)
    params: TransferParams
    block_start: tuple[int, ...] | None = field(default=None, converter=to_block_start)
    """Per KV group, the index of the first registered block in the request's block sequence
    of that group (block ``j`` holds tokens ``[j x block_size, (j + 1) x block_size)``): the
    blocks of D's prefix-cache hit that it skipped, 0 with no hit. Sent in ``PUSH_REG``; P
    pairs D's ``i``-th block with its own block ``block_start + i``. None: not stated, and P
    then pairs only when D registered as many blocks as P holds in every group
    (docs/engine-api.md, "Which block ids each leg passes")."""
    num_tokens: int | None = field(
        default=None, converter=lambda v: check_num_tokens(v, "RequestMetadata.num_tokens")
    )
    """The prompt's length in tokens as D sees it, or None. Sent in ``PUSH_REG``; P refuses
    the push when its own stated length differs."""


@frozen(kw_only=True)
class PushRegistration:
    """The ``PUSH_REG`` payload D sends every relevant agent of P."""

    request_id: str
    """D's request id, echoed back in completion notifications."""
    match_key: str
    """``transfer_id`` (or P's request id) that P matches against its finished prefill."""
    decode_engine_id: str
    decode_host: str
    decode_port: int
    decode_tp_size: int
    block_ids: BlockIds = field(converter=to_block_ids)
    remote_engine_id: str
    """P's engine id, as D knows it."""
    decode_tp_rank: int = 0
    """The D rank that sent this registration."""
    staging_offset: int = -1
    """Where D reserved this request's packed bytes in its staging area; -1: none (direct)."""
    decode_incarnation: str = ""
    """The D engine start this registration belongs to (a restarted D is a new peer)."""
    grant: float | None = None
    """Freshness grant: the newest stamp D had from this P agent when it sent the message
    (P's own clock, echoed back), or None. P may post into the blocks only until
    ``grant + fresh_s`` on its clock (docs/reliability.md, "Fencing")."""
    fresh_s: float = 0.0
    """The freshness window D grants (D keeps the blocks at least that long plus P's WRITE
    deadline after the last message that named them)."""
    prompt_fingerprint: str | None = None
    """The fingerprint of D's prompt (``TransferParams.prompt_fingerprint``), or None: P
    refuses to write a registration whose fingerprint differs from its prefill's."""
    block_start: tuple[int, ...] | None = None
    """Per KV group, where D's registered blocks start in the request's block sequence
    (``RequestMetadata.block_start``), or None: not stated (a D of an earlier release, or an
    engine that cannot tell)."""
    num_tokens: int | None = None
    """The prompt's length D expects (``RequestMetadata.num_tokens``), or None."""
    attempt: int | None = None
    """D's id of this registration attempt (since notification format 2.7): unique within the D
    incarnation, never reused, the same in every PUSH_REG and CANCEL of the attempt; P echoes it
    in each DONE, FAIL and CANCEL_ACK answering it. None: not stated (an earlier release)."""


@frozen(kw_only=True)
class ReadSpec:
    """What one destination rank receives from one producer rank.

    ``local_part`` and ``remote_part`` are ``(index, count)``: the descriptor of a block covers
    bytes ``[index * block_len / count, (index + 1) * block_len / count)`` of that side's block.
    Head slicing for heterogeneous TP is expressed this way; ``(0, 1)`` is the whole block.
    """

    dst_tp_rank: int
    local_block_ids: BlockIds = field(converter=to_block_ids)
    remote_block_ids: BlockIds = field(converter=to_block_ids)
    local_part: tuple[int, int] = (0, 1)
    remote_part: tuple[int, int] = (0, 1)


@frozen(kw_only=True)
class RegionAlignment:
    """For each local region i, ``remote_indices[i]`` is the peer region it pairs with."""

    remote_indices: tuple[int, ...] = field(converter=tuple)
    source: str = "identity"
    """Which plugin produced the alignment (provenance for logs and errors)."""


class NotificationKind(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    CANCEL = "cancel"
    CANCEL_ACK = "cancel_ack"
    HEARTBEAT = "heartbeat"
    PUSH_REG = "push_reg"
    HELLO = "hello"
    """D → P after the notif-only handshake: proves the notification path both ways."""
    GOODBYE = "goodbye"
    """P → D when a P worker closed: that incarnation posts nothing more and nothing it posted
    is in flight (``unsettled``: a WRITE of it to this D rank ended without completing)."""


@frozen(kw_only=True)
class PackManifest:
    """What one producer's packed WRITE holds (see :mod:`kvpush.core.packing`)."""

    staging_offset: int
    """D's reservation for the request in its staging area."""
    regions: tuple[int, ...] = field(converter=tuple)
    """D region indices written, in order."""
    part: tuple[int, int] = (0, 1)
    """Byte slice ``(index, count)`` of each D block written (the read spec's remote part)."""
    chunk: int = 0
    chunks: int = 1
    """This WRITE is chunk ``chunk`` of the producer's ``chunks``; D counts the producer once
    it has scattered all of them."""


@frozen(kw_only=True)
class Notification:
    """A decoded notification."""

    kind: NotificationKind
    request_id: str = ""
    producer: RankKey | None = None
    producer_tp_size: int = 1
    reason: str = ""
    registration: PushRegistration | None = None
    request_ids: tuple[str, ...] = field(default=(), converter=tuple)
    write_in_flight: bool = False
    """CANCEL_ACK: a WRITE of the request was in flight when the cancel arrived (now settled)."""
    unsettled: bool = False
    """FAILED / CANCEL_ACK: a WRITE P posted to this D rank ended without completing (aborted at
    its deadline, or an error), so some of its bytes may still be on their way: D fences P's
    connections before it releases the blocks. A P that does not say is taken to mean True."""
    packing: PackManifest | None = None
    """DONE of a packed WRITE: where in D's staging the producer's bytes are, to scatter."""
    stamp: float | None = None
    """P → D heartbeat answer: P's clock when it sent it (D echoes it back as a grant)."""
    incarnation: str = ""
    """The sending engine's incarnation (HB, HELLO and their answers, BYE; since 2.5 DONE, FAIL
    and CANCEL_ACK); empty when not stated."""
    want: tuple[str, ...] = field(default=(), converter=tuple)
    """P → D heartbeat answer: match keys P needs a fresh grant for before it may post."""
    failed_keys: tuple[str, ...] = field(default=(), converter=tuple)
    """P → D heartbeat answer: keys D asked about that P knows failed."""
    settled_keys: tuple[str, ...] = field(default=(), converter=tuple)
    """P → D heartbeat answer: those of ``failed_keys`` no WRITE of which ended unsettled."""
    unknown_keys: tuple[str, ...] = field(default=(), converter=tuple)
    """P → D heartbeat answer: keys D asked about that P has never heard of."""
    delivered: tuple[str, ...] = field(default=(), converter=tuple)
    """P → D goodbye: D request ids whose WRITE to this D rank completed lately; their DONE may
    arrive after the goodbye (UCX can deliver a later notification first)."""
    hello_id: int | None = None
    """D → P HELLO: the id of that HELLO attempt; P → D FAIL of ``(hello)``: the id of the HELLO
    it answers (since 2.6). None: not stated (an earlier release)."""
    attempt: int | None = None
    """P → D DONE, FAIL, CANCEL_ACK: the registration attempt it answers, echoed from D's
    PUSH_REG or CANCEL (since 2.7). None: not stated (an earlier release, or D stated none)."""
    request_attempts: tuple[int | None, ...] | None = None
    """D → P heartbeat: the registration attempt of each key of ``request_ids`` (since 2.8).
    None: not stated (an earlier release)."""
    want_attempts: tuple[int | None, ...] | None = None
    """P → D heartbeat answer: the registration attempt each entry of ``want`` speaks of (since
    2.8; None in it: none known). None: not stated (an earlier release)."""
    failed_attempts: tuple[int | None, ...] | None = None
    """P → D heartbeat answer: the attempt each entry of ``failed_keys`` speaks of (as above)."""
    unknown_attempts: tuple[int | None, ...] | None = None
    """P → D heartbeat answer: the attempt each entry of ``unknown_keys`` speaks of (as above)."""


@frozen(kw_only=True)
class PushJob:
    """What the read-spec hook is asked to plan: one request from one producer rank."""

    local: AgentMetadata
    decode_tp_size: int
    local_block_ids: BlockIds = field(converter=to_block_ids)
    remote_block_ids: BlockIds = field(converter=to_block_ids)


@frozen(kw_only=True, eq=False)
class TransportProvider:
    """A transport offered by a plugin, selected by ``name``."""

    name: str
    create: Callable[..., Any]
    """``create(config: TransportConfig) -> Transport``."""
    description: str = ""


@frozen(kw_only=True, eq=False)
class LayoutProvider:
    """A KV layout offered by a plugin, selected by ``name``.

    The regions a layout describes must follow the layout rules (``layer_names``, region order,
    components, in-block order; :mod:`kvpush.layouts.regions`). :meth:`describe` checks them.
    """

    name: str
    describe_regions: Callable[..., Sequence[KVRegion]]
    """``describe_regions(kv_caches, parallel, model) -> [KVRegion, ...]`` in model-layer order."""
    description: str = ""
    allocate: Callable[..., Mapping[str, Any]] | None = None
    """Optional: ``allocate(model, parallel, blocks_per_group, device) -> kv_caches``, zeroed
    caches in this layout for the layers a rank owns (``blocks_per_group[g]`` blocks in KV group
    ``g``). ``kvpush demo --layout NAME`` and ``kvpush.testing.run_cluster`` need it."""
    demo_model: ModelSpec | None = None
    """Optional: a small model this layout describes, used by ``kvpush demo --layout NAME``
    and the test cluster when no model is given."""

    def describe(
        self, kv_caches: Mapping[str, Any], parallel: ParallelConfig, model: ModelSpec
    ) -> tuple[KVRegion, ...]:
        """``describe_regions`` checked against the layout rules; a broken rule is a ``ConfigError``."""
        from kvpush.layouts.regions import check_regions, check_tensors

        regions = tuple(self.describe_regions(kv_caches, parallel, model))
        check_regions(regions, parallel, model, layout=self.name)
        check_tensors(kv_caches, regions, model, layout=self.name)
        return regions
