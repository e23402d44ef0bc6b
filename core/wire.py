"""Wire formats: msgpack encoding of handshake payloads and notifications (never pickle).

Handshake payload (two phases, so a version or model mismatch fails with a clear error before
the inner metadata is decoded)::

    outer = {"wire_version": int, "compat_hash": str, "meta": bytes}
    meta  = msgpack map of AgentMetadata (regions column by column: kvpush.core.region_codec)

Notifications are ``PREFIX + msgpack(map)`` with prefixes ``PUSH_REG:``, ``DONE:``, ``FAIL:``,
``CANCEL:``, ``CANCEL_ACK:`` and ``HB:``.

``CANCEL`` (D → P) carries the match key and, from a D rank, its coordinates (so P can reach it
to acknowledge) and its tp rank; ``CANCEL_ACK`` (P → D) names D's request and says whether a
WRITE was in flight when the cancel arrived (it is settled by the time the ack is sent).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import attrs
import msgpack

from kvpush.core import region_codec
from kvpush.core.errors import HandshakeError, WireError
from kvpush.core.types import (
    AgentMetadata,
    KVRegion,
    ModelSpec,
    ParallelConfig,
    RankKey,
    Role,
)

WIRE_VERSION = 1
MAX_FRAME_ENV = "KVPUSH_MAX_FRAME_BYTES"
DEFAULT_MAX_FRAME_BYTES = 1 << 20


def _max_frame_bytes() -> int:
    raw = os.environ.get(MAX_FRAME_ENV)
    if not raw:
        return DEFAULT_MAX_FRAME_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 4096:
        raise ValueError(f"{MAX_FRAME_ENV}={raw!r} must be an int of at least 4096 (bytes)")
    return value


MAX_FRAME_BYTES = _max_frame_bytes()
"""Largest side-channel frame (request or reply) in bytes: ``KVPUSH_MAX_FRAME_BYTES`` when set
(read once, at import; set it alike on every process of both engines), else 1 MiB. Regions are
encoded compactly (:mod:`kvpush.core.region_codec`), so 80 layers x 64 regions use ~2% of it."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack raises several unrelated types
        raise WireError(f"{what} is not valid msgpack ({type(err).__name__}: {err})") from None


def compatibility_hash(model: ModelSpec, layout: str, transport: str) -> str:
    """SHA-256 over what both sides must share. TP/PP sizes and block counts are excluded:
    they may differ and are validated at handshake time."""
    factors = [
        WIRE_VERSION,
        model.name,
        model.num_layers,
        model.attention,
        model.num_kv_heads,
        model.head_dim,
        model.block_size,
        model.dtype,
        list(model.layer_groups),
        list(model.layer_kinds),
        layout,
        transport,
        "push",
    ]
    digest = hashlib.sha256(pack(factors)).hexdigest()[:32]
    if len(_HASHED) < 256:
        _HASHED[digest] = (model, layout, transport)
    return digest


_HASHED: dict[str, tuple[ModelSpec, str, str]] = {}
"""What each locally computed hash covered, so a mismatch can name the differing fields."""


def compatibility_diff(local: tuple[ModelSpec, str, str], peer_inner: Mapping[str, Any]) -> list[str]:
    """``field: peer X, local Y`` for every hashed field where a peer's metadata differs."""
    model, layout, transport = local
    theirs = peer_inner.get("model") if isinstance(peer_inner.get("model"), Mapping) else {}
    diffs = []
    for field in attrs.fields(ModelSpec):
        mine = getattr(model, field.name)
        mine = list(mine) if isinstance(mine, tuple) else mine
        if field.name in theirs and theirs[field.name] != mine:
            diffs.append(f"model.{field.name}: peer {theirs[field.name]!r}, local {mine!r}")
    for name, mine in (("layout", layout), ("transport", transport)):
        if name in peer_inner and peer_inner[name] != mine:
            diffs.append(f"{name}: peer {peer_inner[name]!r}, local {mine!r}")
    return diffs


# ------------------------------------------------------------------------------ metadata


def _model_to_map(model: ModelSpec) -> dict[str, Any]:
    return {
        "name": model.name,
        "num_layers": model.num_layers,
        "attention": model.attention,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "block_size": model.block_size,
        "dtype": model.dtype,
        "layer_groups": list(model.layer_groups),
        "layer_kinds": list(model.layer_kinds),
    }


def _parallel_to_map(p: ParallelConfig) -> dict[str, Any]:
    return {
        "tp_size": p.tp_size,
        "tp_rank": p.tp_rank,
        "pp_size": p.pp_size,
        "pp_rank": p.pp_rank,
        "num_layers": p.num_layers,
        "start_layer": p.start_layer,
        "end_layer": p.end_layer,
    }


def encode_metadata(meta: AgentMetadata) -> bytes:
    """Encode a rank's handshake payload (outer envelope with version and compat hash)."""
    inner = {
        "engine_id": meta.engine_id,
        "role": meta.role.value,
        "parallel": _parallel_to_map(meta.parallel),
        "model": _model_to_map(meta.model),
        "layout": meta.layout,
        "transport": meta.transport,
        "agent_name": meta.agent_name,
        "agent_blob": meta.agent_blob,
        "regions": region_codec.encode_regions(meta.regions),
        "incarnation": meta.incarnation,
        "extensions": dict(meta.extensions),
    }
    outer = {
        "wire_version": WIRE_VERSION,
        "compat_hash": compatibility_hash(meta.model, meta.layout, meta.transport),
        "meta": pack(inner),
    }
    return pack(outer)


def decode_metadata(
    payload: bytes,
    *,
    expected_hash: str | None,
    source: str,
    local: tuple[ModelSpec, str, str] | None = None,
) -> AgentMetadata:
    """Decode a handshake payload in two phases; mismatches name both sides' values.

    On a compatibility-hash mismatch the peer's inner metadata is still read to list every
    differing model, layout and transport field with both values; ``local`` is this side's
    ``(model, layout, transport)`` (default: what ``expected_hash`` was computed from here).
    """
    outer = unpack(payload, f"handshake payload from {source}")
    if not isinstance(outer, Mapping) or "wire_version" not in outer:
        raise WireError(f"handshake payload from {source} has no wire_version; not a kvpush peer?")
    if outer["wire_version"] != WIRE_VERSION:
        raise HandshakeError(
            f"{source} speaks kvpush wire version {outer['wire_version']}, this side "
            f"{WIRE_VERSION}; run the same kvpush release on both sides"
        )
    if expected_hash is not None and outer.get("compat_hash") != expected_hash:
        raise HandshakeError(_mismatch(outer, expected_hash, source, local or _HASHED.get(expected_hash)))
    inner = unpack(outer.get("meta", b""), f"agent metadata from {source}")
    _check_inner(inner, f"agent metadata from {source}")
    try:
        return AgentMetadata(
            engine_id=inner["engine_id"],
            role=Role(inner["role"]),
            parallel=ParallelConfig(**_known(ParallelConfig, inner["parallel"])),
            model=ModelSpec(**_known(ModelSpec, inner["model"])),
            layout=inner["layout"],
            transport=inner["transport"],
            agent_name=inner["agent_name"],
            agent_blob=inner["agent_blob"],
            regions=_decode_regions(inner["regions"], f"regions from {source}"),
            incarnation=str(inner.get("incarnation", "")),
            extensions=inner.get("extensions", {}),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise WireError(f"agent metadata from {source} is malformed: {err}") from None


MAX_PARALLEL = 4096
"""Largest TP or PP size a peer may publish (the notifications' bound too)."""
MAX_LAYERS = 1 << 16
MAX_NAME_CHARS = 1024
_NAMES = ("engine_id", "layout", "transport", "agent_name")
_SIZES = {"tp_size": MAX_PARALLEL, "pp_size": MAX_PARALLEL, "num_layers": MAX_LAYERS}


HELLO_REQUEST_ID = "(hello)"
"""The request id of a D rank's ``HELLO`` (and of heartbeats' coordinates' kin): a ``FAIL`` naming
it answers the HELLO, i.e. P refused this D rank's handshake metadata (docs/handshake.md). A D
rank registers an engine request of this id under an alias."""
RESERVED_REQUEST_IDS = frozenset({HELLO_REQUEST_ID, "(heartbeat)", "(keepalive)"})
"""Request ids the wire uses for messages that are not a request's: never a registration's."""


@attrs.frozen
class PeerIdentity:
    """Who published a handshake payload and how to notify it (no geometry)."""

    engine_id: str
    rank: RankKey
    agent_name: str
    agent_blob: bytes
    incarnation: str


def decode_identity(payload: bytes, *, source: str) -> PeerIdentity:
    """The publisher of a payload and its agent, read without the compatibility-hash check and
    without the regions: what a side needs to *tell* a peer it refused why (it loads the agent
    to send notifications only). Raises ``WireError`` when even that cannot be read."""
    outer = unpack(payload, f"handshake payload from {source}")
    if not isinstance(outer, Mapping):
        raise WireError(f"handshake payload from {source} is not a map")
    inner = unpack(outer.get("meta", b""), f"agent metadata from {source}")
    if not isinstance(inner, Mapping):
        raise WireError(f"agent metadata from {source} is not a map")
    names = [inner.get(name) for name in ("engine_id", "agent_name")]
    if not all(isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS for v in names):
        raise WireError(f"agent metadata from {source} names no engine or agent")
    blob, incarnation = inner.get("agent_blob"), inner.get("incarnation", "")
    if not isinstance(blob, bytes) or not isinstance(incarnation, str) or len(incarnation) > MAX_NAME_CHARS:
        raise WireError(f"agent metadata from {source} carries no agent blob or incarnation")
    parallel = inner.get("parallel")
    ranks = [parallel.get(k) for k in ("pp_rank", "tp_rank")] if isinstance(parallel, Mapping) else []
    if len(ranks) != 2 or not all(_plain_int(r, 0, MAX_PARALLEL - 1) for r in ranks):
        raise WireError(f"agent metadata from {source} names no rank")
    return PeerIdentity(names[0], RankKey(ranks[0], ranks[1]), names[1], blob, incarnation)


def _check_inner(inner: Any, what: str) -> None:
    """Types and ranges of a peer's metadata fields, before anything is built from them: a
    name must be a string, the blob bytes, the extensions a map with string keys, and every
    parallel or model int a plain int within bounds (a TP size of 2**40 would make the peer's
    rank mapping allocate without end). Raises ``WireError`` naming the field."""
    if not isinstance(inner, Mapping):
        raise WireError(f"{what} must be a map, got {type(inner).__name__}")
    for name in _NAMES:
        value = inner.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
            raise WireError(
                f"{what}: field {name!r} must be a string of 1 to {MAX_NAME_CHARS} chars, "
                f"got {str(value)[:80]!r}"
            )
    incarnation = inner.get("incarnation", "")
    if not isinstance(incarnation, str) or len(incarnation) > MAX_NAME_CHARS:
        raise WireError(f"{what}: field 'incarnation' must be a string, got {str(incarnation)[:80]!r}")
    if not isinstance(inner.get("agent_blob"), bytes):
        raise WireError(f"{what}: field 'agent_blob' must be bytes")
    extensions = inner.get("extensions", {})
    if not isinstance(extensions, Mapping) or not all(isinstance(k, str) for k in extensions):
        raise WireError(f"{what}: field 'extensions' must be a map with string keys")
    _check_extensions(extensions, what)
    for section, cls in (("parallel", ParallelConfig), ("model", ModelSpec)):
        fields = inner.get(section)
        if not isinstance(fields, Mapping):
            raise WireError(f"{what}: field {section!r} must be a map")
        for field in attrs.fields(cls):
            value = fields.get(field.name)
            high = _SIZES.get(field.name, 1 << 31)
            if field.type == "int" and field.name in fields and not _plain_int(value, -1, high):
                raise WireError(
                    f"{what}: field {section}.{field.name} must be an int in [-1, {high}], "
                    f"got {str(value)[:80]!r}"
                )
    groups = inner["model"].get("layer_groups", [])
    if not isinstance(groups, list) or not all(_plain_int(g, 0, MAX_PARALLEL - 1) for g in groups):
        raise WireError(f"{what}: field model.layer_groups must be a list of ints in [0, {MAX_PARALLEL})")


def _check_extensions(extensions: Mapping[str, Any], what: str) -> None:
    """kvpush's own metadata extensions, which a peer's safety decisions rest on: P's WRITE
    deadline (D's quarantine: NaN or inf would end it at once, or never), whether P's WRITEs
    can be aborted (a bool), P's process identity (D gives held blocks back once that process
    exited: a pid that is not a positive int would read as exited), the incarnations that ended
    in P's process (D settles what it held for them), the block sizes at which each side's
    engine frees a sliding window's blocks (compared at the handshake) and D's staging area."""
    from kvpush.core.ended_workers import ENDED_KEY
    from kvpush.core.ended_workers import MAX_PER_AGENT as MAX_ENDED
    from kvpush.core.packing import staging_area
    from kvpush.core.worker import (
        ANSWER_ATTEMPTS_KEY,
        BLOCK_PAIRING_KEY,
        PROCESS_KEY,
        RESULT_ATTEMPTS_KEY,
        UNREGISTERED_CANCELS_KEY,
        WINDOW_BLOCKS_KEY,
        WRITE_DEADLINE_KEY,
        WRITES_ABORTABLE_KEY,
    )

    deadline = extensions.get(WRITE_DEADLINE_KEY)
    if deadline is not None and (
        not isinstance(deadline, (int, float))
        or isinstance(deadline, bool)
        or not 0 < deadline <= _MAX_SECONDS
    ):
        raise WireError(
            f"{what}: extension {WRITE_DEADLINE_KEY!r} must be a number of seconds in (0, 2**40], "
            f"got {str(deadline)[:80]!r}"
        )
    abortable = extensions.get(WRITES_ABORTABLE_KEY)
    if abortable is not None and not isinstance(abortable, bool):
        raise WireError(
            f"{what}: extension {WRITES_ABORTABLE_KEY!r} must be a bool, got {str(abortable)[:80]!r}"
        )
    for key in (RESULT_ATTEMPTS_KEY, ANSWER_ATTEMPTS_KEY, UNREGISTERED_CANCELS_KEY):
        echoes = extensions.get(key)
        if echoes is not None and not isinstance(echoes, bool):
            raise WireError(f"{what}: extension {key!r} must be a bool, got {str(echoes)[:80]!r}")
    pairing = extensions.get(BLOCK_PAIRING_KEY)
    if pairing is not None and not (isinstance(pairing, str) and len(pairing) <= 32):
        raise WireError(
            f"{what}: extension {BLOCK_PAIRING_KEY!r} must be a short string, got {str(pairing)[:80]!r}"
        )
    process = extensions.get(PROCESS_KEY)
    if process is not None and not (
        isinstance(process, Mapping)
        and isinstance(process.get("host"), str)
        and isinstance(process.get("pidns"), str)
        and _plain_int(process.get("pid"), 1, 1 << 31)
        and _plain_int(process.get("start"), -1, 1 << 62)
    ):
        raise WireError(
            f"{what}: extension {PROCESS_KEY!r} must be a map of host and pidns strings, a pid in "
            f"[1, 2**31] and a start time (int), got {str(process)[:120]!r}"
        )
    ended = extensions.get(ENDED_KEY)
    if ended is not None and not (
        isinstance(ended, Mapping)
        and len(ended) <= MAX_ENDED
        and all(isinstance(i, str) and 0 < len(i) <= 256 and isinstance(u, bool) for i, u in ended.items())
    ):
        raise WireError(
            f"{what}: extension {ENDED_KEY!r} must map at most {MAX_ENDED} incarnations (strings of "
            f"at most 256 chars) to bools, got {str(ended)[:120]!r}"
        )
    window = extensions.get(WINDOW_BLOCKS_KEY)
    if window is not None and not (
        isinstance(window, list)
        and len(window) <= MAX_PARALLEL
        and all(_plain_int(size, 0, MAX_LAYERS) for size in window)
    ):
        raise WireError(
            f"{what}: extension {WINDOW_BLOCKS_KEY!r} must be a list of at most {MAX_PARALLEL} block "
            f"sizes (ints in [0, {MAX_LAYERS}], one per KV group), got {str(window)[:80]!r}"
        )
    staging_area(extensions, what)


_MAX_SECONDS = float(1 << 40)


def _plain_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _known(cls: type, fields: Any) -> dict[str, Any]:
    """The fields of ``cls`` in a peer's map. Fields a newer minor release added are ignored, so
    peers one minor version apart interoperate; a field that changes what the bytes mean comes
    with a new ``WIRE_VERSION`` instead, which the compatibility hash covers."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"expected a map, got {type(fields).__name__}")
    names = {f.name for f in attrs.fields(cls)}
    return {k: v for k, v in fields.items() if k in names}


def _decode_regions(value: Any, what: str) -> tuple[KVRegion, ...]:
    if isinstance(value, list):  # the map-per-region form of earlier payloads
        if len(value) > region_codec.MAX_REGIONS:
            raise WireError(f"{what}: {len(value)} regions, over {region_codec.MAX_REGIONS}")
        regions = tuple(KVRegion(**_known(KVRegion, r)) for r in value)
        region_codec.check_regions(regions, what)
        return regions
    return region_codec.decode_regions(value, what)


def _mismatch(
    outer: Mapping[str, Any], expected_hash: str, source: str, local: tuple[ModelSpec, str, str] | None
) -> str:
    message = (
        f"compatibility hash mismatch with {source}: peer {outer.get('compat_hash')!r}, "
        f"local {expected_hash!r}"
    )
    diffs: list[str] = []
    if local is not None:
        try:
            inner = unpack(outer.get("meta", b""), f"agent metadata from {source}")
            diffs = compatibility_diff(local, inner) if isinstance(inner, Mapping) else []
        except WireError:
            diffs = []
    if diffs:
        return f"{message}; differing: {'; '.join(diffs)}. Run both engines with the same values"
    return (
        f"{message}. Both sides must run the same model, dtype, block size, layout, transport "
        f"and kvpush release"
    )


# ------------------------------------------------------------------------------ notifications


def __getattr__(name: str) -> Any:
    """Notification formats live in :mod:`kvpush.core.notifications`; re-exported here."""
    from kvpush.core import notifications

    try:
        return getattr(notifications, name)
    except AttributeError:
        raise AttributeError(f"module 'kvpush.core.wire' has no attribute {name!r}") from None
