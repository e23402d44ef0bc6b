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
    Notification,
    NotificationKind,
    PackManifest,
    ParallelConfig,
    PushRegistration,
    RankKey,
    Role,
    to_block_ids,
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

PUSH_REG_PREFIX = b"PUSH_REG:"
DONE_PREFIX = b"DONE:"
FAIL_PREFIX = b"FAIL:"
CANCEL_PREFIX = b"CANCEL:"
CANCEL_ACK_PREFIX = b"CANCEL_ACK:"
HEARTBEAT_PREFIX = b"HB:"


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
    try:
        return AgentMetadata(
            engine_id=inner["engine_id"],
            role=Role(inner["role"]),
            parallel=ParallelConfig(**inner["parallel"]),
            model=ModelSpec(**inner["model"]),
            layout=inner["layout"],
            transport=inner["transport"],
            agent_name=inner["agent_name"],
            agent_blob=inner["agent_blob"],
            regions=_decode_regions(inner["regions"], f"regions from {source}"),
            extensions=inner.get("extensions", {}),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise WireError(f"agent metadata from {source} is malformed: {err}") from None


def _decode_regions(value: Any, what: str) -> tuple[KVRegion, ...]:
    if isinstance(value, list):  # the map-per-region form of earlier payloads
        return tuple(KVRegion(**r) for r in value)
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


def encode_push_reg(reg: PushRegistration) -> bytes:
    return PUSH_REG_PREFIX + pack(
        {
            "request_id": reg.request_id,
            "match_key": reg.match_key,
            "decode_engine_id": reg.decode_engine_id,
            "decode_host": reg.decode_host,
            "decode_port": reg.decode_port,
            "decode_tp_size": reg.decode_tp_size,
            "local_block_ids": [list(g) for g in reg.block_ids],
            "remote_engine_id": reg.remote_engine_id,
            "dtp": reg.decode_tp_rank,
            "staging": reg.staging_offset,
        }
    )


def encode_done(
    request_id: str, producer: RankKey, producer_tp_size: int, packing: PackManifest | None = None
) -> bytes:
    body: dict[str, Any] = {
        "request_id": request_id,
        "pp": producer.pp_rank,
        "tp": producer.tp_rank,
        "ptp": producer_tp_size,
    }
    if packing is not None:
        body["pk"] = [
            packing.staging_offset,
            list(packing.regions),
            *packing.part,
            packing.chunk,
            packing.chunks,
        ]
    return DONE_PREFIX + pack(body)


def _manifest(body: Mapping[str, Any], what: str) -> PackManifest | None:
    value = body.get("pk")
    if value is None:
        return None
    try:
        offset, regions, index, count, chunk, chunks = value
        if not (isinstance(offset, int) and offset >= 0 and 0 <= index < count and 0 <= chunk < chunks):
            raise ValueError(f"bad offset, part or chunk {value!r}")
        return PackManifest(
            staging_offset=offset,
            regions=[int(r) for r in regions],
            part=(index, count),
            chunk=chunk,
            chunks=chunks,
        )
    except (TypeError, ValueError) as err:
        raise WireError(f"{what} field 'pk' (packing manifest) is malformed: {err}") from None


def encode_failed(request_id: str, producer: RankKey, reason: str) -> bytes:
    return FAIL_PREFIX + pack(
        {"request_id": request_id, "pp": producer.pp_rank, "tp": producer.tp_rank, "reason": reason[:2000]}
    )


def _coordinates(reg: PushRegistration, decode_tp_rank: int) -> dict[str, Any]:
    """The fields that tell P where a D rank is (read back by ``_decode_coordinates``)."""
    return {
        "decode_engine_id": reg.decode_engine_id,
        "decode_host": reg.decode_host,
        "decode_port": reg.decode_port,
        "decode_tp_size": reg.decode_tp_size,
        "remote_engine_id": reg.remote_engine_id,
        "tp": decode_tp_rank,
    }


def encode_cancel(match_key: str, reg: PushRegistration | None = None, decode_tp_rank: int = 0) -> bytes:
    """CANCEL by match key; with ``reg`` (blocks not needed) P can reach the cancelling D rank."""
    body: dict[str, Any] = {"request_id": match_key}
    if reg is not None:
        body.update(_coordinates(reg, decode_tp_rank), d_request_id=reg.request_id)
    return CANCEL_PREFIX + pack(body)


def encode_cancel_ack(request_id: str, producer: RankKey, write_in_flight: bool) -> bytes:
    return CANCEL_ACK_PREFIX + pack(
        {
            "request_id": request_id,
            "pp": producer.pp_rank,
            "tp": producer.tp_rank,
            "inflight": write_in_flight,
        }
    )


def encode_heartbeat(
    match_keys: list[str], reg: PushRegistration | None = None, decode_tp_rank: int = 0
) -> bytes:
    """HB with match keys; from a D rank also its coordinates (``reg``, blocks not needed) so P
    can answer with an empty HB, which is P's liveness signal."""
    body: dict[str, Any] = {"request_ids": list(match_keys)}
    if reg is not None:
        body.update(_coordinates(reg, decode_tp_rank), d_request_id="(heartbeat)")
    return HEARTBEAT_PREFIX + pack(body)


def _str_field(body: Mapping[str, Any], name: str, what: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise WireError(f"{what} field {name!r} must be a non-empty string, got {value!r}")
    return value


def _int_field(body: Mapping[str, Any], name: str, what: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WireError(f"{what} field {name!r} must be a non-negative int, got {value!r}")
    return value


def _decode_coordinates(
    body: Mapping[str, Any], what: str, *, request_id: str, match_key: str
) -> PushRegistration:
    """D's coordinates carried by a heartbeat or a cancel, as a block-less registration."""
    try:
        return PushRegistration(
            request_id=request_id,
            match_key=match_key,
            decode_engine_id=_str_field(body, "decode_engine_id", what),
            decode_host=_str_field(body, "decode_host", what),
            decode_port=_int_field(body, "decode_port", what),
            decode_tp_size=_int_field(body, "decode_tp_size", what) or 1,
            block_ids=(),
            remote_engine_id=_str_field(body, "remote_engine_id", what),
        )
    except ValueError as err:
        raise WireError(f"{what} is malformed: {err}") from None


_PREFIXES = (
    (PUSH_REG_PREFIX, NotificationKind.PUSH_REG),
    (DONE_PREFIX, NotificationKind.DONE),
    (FAIL_PREFIX, NotificationKind.FAILED),
    (CANCEL_PREFIX, NotificationKind.CANCEL),
    (CANCEL_ACK_PREFIX, NotificationKind.CANCEL_ACK),
    (HEARTBEAT_PREFIX, NotificationKind.HEARTBEAT),
)


def decode_notification(message: bytes) -> Notification | None:
    """Decode a kvpush notification; None if the prefix is not kvpush's. Raises WireError on a
    kvpush prefix with a malformed body."""
    match = next(((p, k) for p, k in _PREFIXES if message.startswith(p)), None)
    if match is None:
        return None
    prefix, kind = match
    what = prefix.decode().rstrip(":")
    body = unpack(message[len(prefix) :], what)
    if not isinstance(body, Mapping):
        raise WireError(f"{what} body must be a map, got {type(body).__name__}")
    if kind is NotificationKind.PUSH_REG:
        try:
            reg = PushRegistration(
                request_id=_str_field(body, "request_id", what),
                match_key=_str_field(body, "match_key", what),
                decode_engine_id=_str_field(body, "decode_engine_id", what),
                decode_host=_str_field(body, "decode_host", what),
                decode_port=_int_field(body, "decode_port", what),
                decode_tp_size=_int_field(body, "decode_tp_size", what) or 1,
                block_ids=to_block_ids(body.get("local_block_ids")),
                remote_engine_id=_str_field(body, "remote_engine_id", what),
                decode_tp_rank=int(body.get("dtp", 0)),
                staging_offset=int(body.get("staging", -1)),
            )
        except (TypeError, ValueError) as err:
            raise WireError(f"{what} is malformed: {err}") from None
        return Notification(kind=kind, request_id=reg.request_id, registration=reg)
    if kind is NotificationKind.HEARTBEAT:
        ids = body.get("request_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise WireError(f"{what} field 'request_ids' must be a list of strings")
        if "decode_engine_id" not in body:
            return Notification(kind=kind, request_ids=ids)
        reg = _decode_coordinates(body, what, request_id="(heartbeat)", match_key="(heartbeat)")
        return Notification(
            kind=kind, request_ids=ids, registration=reg, producer=RankKey(0, _int_field(body, "tp", what))
        )
    request_id = _str_field(body, "request_id", what)
    if kind is NotificationKind.CANCEL:
        if "d_request_id" not in body:
            return Notification(kind=kind, request_id=request_id)
        reg = _decode_coordinates(
            body, what, request_id=_str_field(body, "d_request_id", what), match_key=request_id
        )
        return Notification(
            kind=kind,
            request_id=request_id,
            registration=reg,
            producer=RankKey(0, _int_field(body, "tp", what)),
        )
    producer = RankKey(_int_field(body, "pp", what), _int_field(body, "tp", what))
    if kind is NotificationKind.CANCEL_ACK:
        return Notification(
            kind=kind, request_id=request_id, producer=producer, write_in_flight=bool(body.get("inflight"))
        )
    if kind is NotificationKind.DONE:
        return Notification(
            kind=kind,
            request_id=request_id,
            producer=producer,
            producer_tp_size=_int_field(body, "ptp", what) or 1,
            packing=_manifest(body, what),
        )
    reason = body.get("reason")
    return Notification(kind=kind, request_id=request_id, producer=producer, reason=str(reason or "unknown"))
