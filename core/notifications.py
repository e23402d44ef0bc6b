"""Notification formats: ``PREFIX + msgpack(map)``, versioned, bounded, never pickle.

Prefixes: ``PUSH_REG:``, ``DONE:``, ``FAIL:``, ``CANCEL:``, ``CANCEL_ACK:``, ``HB:``,
``HELLO:`` and ``BYE:``. Every body carries ``"v": [major, minor]``; a peer with another *major* version is
refused with a ``WireError`` naming both, unknown fields are ignored (so one minor version apart
interoperates). Every value from a peer is range-checked here, when decoded, with an error
naming the field: block ids below 2**31, distinct within a group and not all groups empty;
ranks below the advertised sizes, sizes at most ``MAX_PARALLEL``, staging offsets non-negative
(or -1); a packing manifest names at least one region and no region twice; clock values
(stamps, grants, windows) finite and in ``[0, MAX_CLOCK_S]``; reasons truncated to
``MAX_REASON``. A DONE's producer is checked against the producers P published by D's core
(which counts the refusal), not here.

Direction and meaning (docs/reliability.md):

- ``PUSH_REG`` D → P: D's request id, the match key, D's coordinates, incarnation, TP rank, its
  block ids, staging reservation, and a freshness *grant* (the newest stamp D had from this P
  agent) with the window ``fresh_s``; optionally ``pf``, the fingerprint of D's prompt (absent:
  not given; P then pairs on the match key alone); since 2.2 optionally ``bs``, where D's
  blocks start in the request's block sequence (one index per KV group: the blocks of a
  prefix hit D skipped), and ``nt``, the prompt's length D expects (absent: not stated; P then
  pairs only equal block counts, docs/engine-api.md).
- ``HB`` D → P: the match keys D still waits for at this P agent and its coordinates; P keeps
  their leases and answers, but a heartbeat renews no grant (D sends a registration's PUSH_REG
  again when P wants its key).
  ``HB`` P → D (answer): P's ``stamp`` (its clock), incarnation, the keys it ``want``s a fresh
  grant for, and the keys it no longer holds (``failed``); since 2.4 optionally ``fs``, those of
  them no WRITE of which ended unsettled (absent: not stated, D fences before it releases).
- ``HELLO`` D → P: sent once after D's notif-only handshake; P answers with an ``HB`` stamp,
  which proves the notification path works both ways before any request depends on it. Since
  2.6 optionally ``h``, the id of that HELLO attempt (resends of it carry the same id; a
  later attempt a larger one, within one D incarnation); absent: not stated.
- ``DONE`` / ``FAIL`` P → D: one producer ``(pp, tp)`` (and its TP size) finished or failed a
  request; a packed DONE carries the manifest D scatters from.
- ``CANCEL`` D → P and ``CANCEL_ACK`` P → D: see docs/reliability.md, "Cancel".
- Since 2.5 ``DONE``, ``FAIL`` and ``CANCEL_ACK`` optionally carry ``inc``, the sending P
  worker's incarnation: D counts them only for a request that registered with that incarnation
  of the agent (an old process still alive under a restarted worker's name cannot complete or
  settle the new registration; absent: not stated, the agent's name alone decides).
- Since 2.6 a ``FAIL`` answering a HELLO (request id ``(hello)``: P refused D's handshake
  metadata) optionally carries ``h``, the id of the HELLO it answers: D takes it only while
  that HELLO is the one it waits on (a refusal of an earlier attempt, held in the network
  past an outage, is dropped); absent, as from a 2.5 P or to a D that stated no id, it
  answers whatever HELLO D waits on.
- Since 2.7 ``PUSH_REG`` and ``CANCEL`` (with D's coordinates) optionally carry ``a``, D's
  registration attempt id (unique within D's incarnation, never reused; the same in every
  message of one attempt), and P echoes it in each ``DONE``, ``FAIL`` and ``CANCEL_ACK``
  answering them: D counts a result only for the attempt it names (a replay of a result for an
  earlier request of a reused D request id names another); absent: not stated (D then judges
  without it, unless that P stated ``result_attempts`` in its handshake).
- Since 2.8 D's ``HB`` optionally carries ``ra``, the registration attempt of each key it
  names (one per entry of ``request_ids``), and P's answer ``wa``, ``fa`` and ``ua``, the
  attempt each entry of ``want``, ``failed`` and ``unknown`` speaks of (one per entry; nil:
  none known): the attempt D named for that key, or for ``want`` the one P holds. D acts on
  an entry only for the request of that attempt (an answer about an earlier request of the
  key, delayed or replayed, acts on nothing), and refuses entries naming none from a P that
  stated ``answer_attempts`` in its handshake; absent: not stated (D then acts on keys, as
  before). P ends only the attempts it named ``failed`` to a D that named them.
- ``BYE`` P → D (since 2.3): a P worker closed (its producer rank and incarnation): it posts nothing more
  and every WRITE it posted to this D rank ended (``unsettled``: one ended without completing).
  Since 2.4 optionally ``done``: the D request ids whose WRITE (and so its DONE) to this D rank
  completed lately (at most ``MAX_KEYS``): their DONE may still be on its way, since UCX can
  deliver the BYE first (absent: none named).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import msgpack

from kvpush.core.errors import WireError
from kvpush.core.fingerprint import MAX_FINGERPRINT_CHARS
from kvpush.core.region_codec import MAX_KV_GROUPS
from kvpush.core.types import (
    Notification,
    NotificationKind,
    PackManifest,
    PushRegistration,
    RankKey,
)
from kvpush.core.wire import MAX_PARALLEL as WIRE_MAX_PARALLEL
from kvpush.core.wire import pack, unpack

NOTIF_VERSION = (2, 8)
"""(major, minor) of the notification format; only the major must match."""
MAX_BLOCK_ID = (1 << 31) - 1
MAX_PARALLEL = WIRE_MAX_PARALLEL
"""Largest TP or PP size a peer may state."""
MAX_CLOCK_S = float(1 << 40)
"""Largest stamp, grant or freshness window (seconds) a peer may state."""
MAX_KEYS = 4096
"""Most match keys one heartbeat may carry."""
MAX_ID_CHARS = 1024
MAX_GOODBYE_ID_CHARS = 64 * 1024
"""Most characters of request ids one goodbye names (the newest ones first)."""
MAX_REASON = 2000
MAX_STAGING_OFFSET = 1 << 48
MAX_TOKENS = 1 << 40
"""Largest prompt length (tokens) a PUSH_REG may state."""
MAX_HELLO_ID = (1 << 63) - 1
"""Largest HELLO id (``h``) a HELLO, or the FAIL answering it, may state (ids start at 1)."""
MAX_ATTEMPT = (1 << 63) - 1
"""Largest registration attempt id (``a``) a PUSH_REG, CANCEL or result may state (from 1)."""

PUSH_REG_PREFIX = b"PUSH_REG:"
DONE_PREFIX = b"DONE:"
FAIL_PREFIX = b"FAIL:"
CANCEL_PREFIX = b"CANCEL:"
CANCEL_ACK_PREFIX = b"CANCEL_ACK:"
HEARTBEAT_PREFIX = b"HB:"
HELLO_PREFIX = b"HELLO:"
GOODBYE_PREFIX = b"BYE:"

_V = list(NOTIF_VERSION)
_unpackb = msgpack.unpackb


def _msg(prefix: bytes, body: dict[str, Any]) -> bytes:
    body["v"] = _V
    return prefix + pack(body)


# ------------------------------------------------------------------------------ encoders


def _coordinates(reg: PushRegistration, decode_tp_rank: int) -> dict[str, Any]:
    """The fields that tell P where a D rank is (read back by ``_decode_coordinates``)."""
    return {
        "decode_engine_id": reg.decode_engine_id,
        "decode_host": reg.decode_host,
        "decode_port": reg.decode_port,
        "decode_tp_size": reg.decode_tp_size,
        "remote_engine_id": reg.remote_engine_id,
        "tp": decode_tp_rank,
        "inc": reg.decode_incarnation,
    }


def encode_push_reg(reg: PushRegistration) -> bytes:
    body = _coordinates(reg, reg.decode_tp_rank)
    body.update(
        request_id=reg.request_id,
        match_key=reg.match_key,
        local_block_ids=[list(g) for g in reg.block_ids],
        dtp=reg.decode_tp_rank,
        staging=reg.staging_offset,
        grant=reg.grant,
        fresh=reg.fresh_s,
    )
    if reg.prompt_fingerprint is not None:  # optional: absent means "not given"
        body["pf"] = reg.prompt_fingerprint
    if reg.block_start is not None:  # optional (2.2): absent means "not stated"
        body["bs"] = list(reg.block_start)
    if reg.num_tokens is not None:
        body["nt"] = reg.num_tokens
    if reg.attempt is not None:  # optional (2.7): absent means "not stated"
        body["a"] = reg.attempt
    return _msg(PUSH_REG_PREFIX, body)


def _result(
    request_id: str, producer: RankKey, incarnation: str, attempt: int | None, **fields: Any
) -> dict[str, Any]:
    """The body of a P result (DONE, FAIL, CANCEL_ACK): request, producer, ``fields`` and,
    when stated, the sending worker's incarnation (since 2.5) and the registration attempt it
    answers (since 2.7)."""
    body: dict[str, Any] = {"request_id": request_id, "pp": producer.pp_rank, "tp": producer.tp_rank}
    body.update(fields)
    if incarnation:
        body["inc"] = incarnation
    if attempt is not None:
        body["a"] = attempt
    return body


def encode_done(
    request_id: str,
    producer: RankKey,
    producer_tp_size: int,
    packing: PackManifest | None = None,
    incarnation: str = "",
    *,
    attempt: int | None = None,
) -> bytes:
    """``incarnation``: the sending P worker's (since 2.5; empty: not stated). ``attempt``: the
    registration attempt it answers, from D's PUSH_REG (since 2.7; None: D stated none)."""
    body = _result(request_id, producer, incarnation, attempt, ptp=producer_tp_size)
    if packing is not None:
        body["pk"] = [
            packing.staging_offset,
            list(packing.regions),
            *packing.part,
            packing.chunk,
            packing.chunks,
        ]
    return _msg(DONE_PREFIX, body)


def encode_failed(
    request_id: str,
    producer: RankKey,
    reason: str,
    unsettled: bool = True,
    incarnation: str = "",
    *,
    hello_id: int | None = None,
    attempt: int | None = None,
) -> bytes:
    """``unsettled``: a WRITE posted to this D rank ended without completing (bytes may follow);
    True unless P knows otherwise. ``incarnation``: the sending P worker's (since 2.5).
    ``hello_id``: for a FAIL answering a HELLO, the id that HELLO stated (since 2.6; None: it
    stated none). ``attempt``: the registration attempt it answers (since 2.7; None: D stated
    none)."""
    body = _result(
        request_id, producer, incarnation, attempt, reason=reason[:MAX_REASON], unsettled=unsettled
    )
    if hello_id is not None:
        body["h"] = hello_id
    return _msg(FAIL_PREFIX, body)


def encode_cancel(match_key: str, reg: PushRegistration | None = None, decode_tp_rank: int = 0) -> bytes:
    """CANCEL by match key; with ``reg`` (blocks not needed) P can reach the cancelling D rank,
    and P's CANCEL_ACK echoes the registration attempt it names (since 2.7)."""
    body: dict[str, Any] = {"request_id": match_key}
    if reg is not None:
        body.update(_coordinates(reg, decode_tp_rank), d_request_id=reg.request_id)
        if reg.attempt is not None:
            body["a"] = reg.attempt
    return _msg(CANCEL_PREFIX, body)


def encode_cancel_ack(
    request_id: str,
    producer: RankKey,
    write_in_flight: bool,
    unsettled: bool = True,
    incarnation: str = "",
    *,
    attempt: int | None = None,
) -> bytes:
    """``unsettled``: a WRITE posted to this D rank ended without completing (bytes may follow);
    True unless P knows otherwise. ``incarnation``: the sending P worker's (since 2.5).
    ``attempt``: the registration attempt the CANCEL named (since 2.7; None: it named none)."""
    body = _result(request_id, producer, incarnation, attempt, inflight=write_in_flight, unsettled=unsettled)
    return _msg(CANCEL_ACK_PREFIX, body)


def _entry_attempts(keys: Sequence[str], attempts: Sequence[int | None] | None, what: str) -> list[Any]:
    """The attempts of a heartbeat list's entries (one per key, cut where the keys are)."""
    if attempts is None or len(attempts) != len(keys):
        raise ValueError(f"{what}: one attempt (or None) per key, got {attempts!r} for {len(keys)} keys")
    return list(attempts)[:MAX_KEYS]


def encode_heartbeat(
    match_keys: list[str],
    reg: PushRegistration | None = None,
    decode_tp_rank: int = 0,
    *,
    attempts: Sequence[int | None] | None = None,
) -> bytes:
    """D → P: the keys D still waits for; with ``reg`` (blocks not needed) its coordinates, so P
    can keep their leases and answer (the grant it carries renews nothing). ``attempts``: the
    registration attempt of each key (since 2.8; None: not stated)."""
    body: dict[str, Any] = {"request_ids": list(match_keys)}
    if reg is not None:
        body.update(_coordinates(reg, decode_tp_rank), grant=reg.grant, fresh=reg.fresh_s)
    if attempts is not None:
        body["ra"] = _entry_attempts(match_keys, attempts, "heartbeat")
    return _msg(HEARTBEAT_PREFIX, body)


def encode_heartbeat_answer(
    producer: RankKey,
    stamp: float,
    incarnation: str,
    want: list[str] = (),  # type: ignore[assignment]
    failed: list[str] = (),  # type: ignore[assignment]
    unknown: list[str] = (),  # type: ignore[assignment]
    settled: list[str] = (),  # type: ignore[assignment]
    *,
    want_attempts: Sequence[int | None] | None = None,
    failed_attempts: Sequence[int | None] | None = None,
    unknown_attempts: Sequence[int | None] | None = None,
) -> bytes:
    """P → D: P's stamp (its clock), the keys it needs a fresh grant for, the keys it knows
    failed (``settled``: those of them no WRITE of which ended unsettled, so D need not fence),
    and the keys it has never heard of (D fails one reported unknown twice). ``*_attempts``
    (since 2.8): the registration attempt each entry of that list speaks of (None in it: none
    known; None for the list: not stated)."""
    body: dict[str, Any] = {
        "request_ids": [],
        "pp": producer.pp_rank,
        "tp": producer.tp_rank,
        "stamp": stamp,
        "inc": incarnation,
        "want": list(want)[:MAX_KEYS],
        "failed": list(failed)[:MAX_KEYS],
        "unknown": list(unknown)[:MAX_KEYS],
    }
    for name, keys, attempts in (
        ("wa", want, want_attempts),
        ("fa", failed, failed_attempts),
        ("ua", unknown, unknown_attempts),
    ):
        if attempts is not None:
            body[name] = _entry_attempts(keys, attempts, f"heartbeat answer {name!r}")
    if settled:
        body["fs"] = list(settled)[:MAX_KEYS]
    return _msg(HEARTBEAT_PREFIX, body)


def encode_hello(reg: PushRegistration, decode_tp_rank: int, *, hello_id: int | None = None) -> bytes:
    """D → P after the notif-only handshake (``reg`` carries D's coordinates only).
    ``hello_id``: the id of this HELLO attempt, echoed by P's refusal (since 2.6; None: not
    stated)."""
    body = _coordinates(reg, decode_tp_rank)
    if hello_id is not None:
        body["h"] = hello_id
    return _msg(HELLO_PREFIX, body)


def encode_goodbye(
    producer: RankKey, incarnation: str, unsettled: bool = True, *, delivered: Sequence[str] = ()
) -> bytes:
    """P → D once a closing P worker has nothing in flight: ``incarnation`` ended. ``unsettled``:
    a WRITE it posted to this D rank ended without completing (bytes may follow: D fences).
    ``delivered``: D request ids whose WRITE to this D rank completed lately (the newest, at
    most ``MAX_KEYS`` of them and ``MAX_GOODBYE_ID_CHARS`` characters in all): their DONE may
    arrive after this BYE."""
    body: dict[str, Any] = {"pp": producer.pp_rank, "tp": producer.tp_rank, "inc": incarnation}
    body["unsettled"] = unsettled
    newest: list[str] = []
    chars = 0
    for rid in reversed(delivered):
        chars += len(rid)
        if len(newest) == MAX_KEYS or chars > MAX_GOODBYE_ID_CHARS:
            break
        newest.append(rid)
    if newest:
        body["done"] = newest[::-1]
    return _msg(GOODBYE_PREFIX, body)


# ------------------------------------------------------------------------------ field checks


def _str_field(body: Mapping[str, Any], name: str, what: str, *, optional: bool = False) -> str:
    value = body.get(name)
    if optional and value in (None, ""):
        return ""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise WireError(
            f"{what} field {name!r} must be a non-empty string of at most {MAX_ID_CHARS} chars, "
            f"got {str(value)[:80]!r}"
        )
    return value


def _int_field(
    body: Mapping[str, Any], name: str, what: str, *, low: int = 0, high: int = MAX_BLOCK_ID
) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise WireError(f"{what} field {name!r} must be an int in [{low}, {high}], got {str(value)[:80]!r}")
    return value


def _attempt(body: Mapping[str, Any], what: str) -> int | None:
    """A registration attempt id (``a``, since 2.7): None when absent."""
    if body.get("a") is None:
        return None
    return _int_field(body, "a", what, low=1, high=MAX_ATTEMPT)


def _attempt_list(body: Mapping[str, Any], name: str, keys: int, what: str) -> tuple[int | None, ...] | None:
    """The attempts of a heartbeat list's entries (``ra``, ``wa``, ``fa``, ``ua``, since 2.8):
    one per entry of the list (``keys`` long), each nil or an int in ``[1, MAX_ATTEMPT]``; None
    when absent."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != keys:
        raise WireError(
            f"{what} field {name!r} must be a list of {keys} attempts (one per key), got {str(value)[:80]!r}"
        )
    for attempt in value:
        if attempt is not None and (
            not isinstance(attempt, int) or isinstance(attempt, bool) or not 1 <= attempt <= MAX_ATTEMPT
        ):
            raise WireError(
                f"{what} field {name!r} holds {str(attempt)[:40]!r}; attempts must be nil or ints in "
                f"[1, {MAX_ATTEMPT}]"
            )
    return tuple(value)


def _hello_id(body: Mapping[str, Any], what: str) -> int | None:
    """A HELLO's id, or the one a FAIL answering it echoes (``h``, since 2.6): None when absent."""
    if body.get("h") is None:
        return None
    return _int_field(body, "h", what, low=1, high=MAX_HELLO_ID)


def _float_field(body: Mapping[str, Any], name: str, what: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 <= value <= MAX_CLOCK_S
    ):
        raise WireError(
            f"{what} field {name!r} must be a finite number of seconds in [0, 2**40] or absent, "
            f"got {str(value)[:80]!r}"
        )
    return float(value)


def _str_list(body: Mapping[str, Any], name: str, what: str) -> tuple[str, ...]:
    value = body.get(name, [])
    if (
        not isinstance(value, list)
        or len(value) > MAX_KEYS
        or not all(isinstance(i, str) and 0 < len(i) <= MAX_ID_CHARS for i in value)
    ):
        raise WireError(f"{what} field {name!r} must be a list of at most {MAX_KEYS} non-empty strings")
    return tuple(value)


def _block_ids(value: Any, what: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_KV_GROUPS:
        raise WireError(
            f"{what} field 'local_block_ids' must be a list of 1 to {MAX_KV_GROUPS} per-group lists"
        )
    groups = []
    for group in value:
        if not isinstance(group, list):
            raise WireError(f"{what} field 'local_block_ids' must hold one list per KV group")
        for block in group:
            if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block <= MAX_BLOCK_ID:
                raise WireError(
                    f"{what} field 'local_block_ids' holds {str(block)[:40]}; block ids must be ints "
                    f"in [0, {MAX_BLOCK_ID}]"
                )
        if len(set(group)) != len(group):
            raise WireError(f"{what} field 'local_block_ids' repeats a block id within a group")
        groups.append(tuple(group))
    if not any(groups):  # D reports a request with no blocks done at once, never registers it
        raise WireError(f"{what} field 'local_block_ids' names no block in any group")
    return tuple(groups)


def _block_start(value: Any, groups: int, what: str) -> tuple[int, ...] | None:
    """A PUSH_REG's ``bs``: absent (not stated), or one block index per KV group."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != groups
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_BLOCK_ID for s in value)
    ):
        raise WireError(
            f"{what} field 'bs' (where D's blocks start) must be one int in [0, {MAX_BLOCK_ID}] per "
            f"KV group of 'local_block_ids' ({groups}), got {str(value)[:80]}"
        )
    return tuple(value)


def _decode_coordinates(
    body: Mapping[str, Any], what: str, *, request_id: str, match_key: str, block_ids: Any = ()
) -> PushRegistration:
    """D's coordinates carried by a registration, heartbeat, hello or cancel."""
    return PushRegistration(
        request_id=request_id, match_key=match_key, block_ids=block_ids, **_coordinate_fields(body, what)
    )


def _coordinate_fields(body: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The checked coordinate fields of a :class:`PushRegistration` (checked in this order)."""
    size = _int_field(body, "decode_tp_size", what, low=1, high=MAX_PARALLEL)
    return {
        "decode_engine_id": _str_field(body, "decode_engine_id", what),
        "decode_host": _str_field(body, "decode_host", what),
        "decode_port": _int_field(body, "decode_port", what, low=1, high=65535),
        "decode_tp_size": size,
        "remote_engine_id": _str_field(body, "remote_engine_id", what),
        "decode_tp_rank": _int_field(body, "tp", what, high=size - 1),
        "decode_incarnation": _str_field(body, "inc", what, optional=True),
        "grant": _float_field(body, "grant", what),
        "fresh_s": _float_field(body, "fresh", what) or 0.0,
    }


def _manifest(body: Mapping[str, Any], what: str) -> PackManifest | None:
    value = body.get("pk")
    if value is None:
        return None
    try:
        offset, regions, index, count, chunk, chunks = value
        ints = (offset, index, count, chunk, chunks)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
            raise ValueError(f"non-integer in {value!r}")
        if not (
            0 <= offset < MAX_STAGING_OFFSET and 0 <= index < count <= MAX_PARALLEL and 0 <= chunk < chunks
        ):
            raise ValueError(f"bad offset, part or chunk {value!r}")
        if chunks > 1 << 20 or not isinstance(regions, list) or len(regions) > 1 << 20:
            raise ValueError("too many chunks or regions")
        if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 31 for r in regions):
            raise ValueError("region indices must be non-negative ints")
        if not regions or len(set(regions)) != len(regions):
            raise ValueError(f"regions must name at least one region and none twice, got {regions[:16]!r}")
        return PackManifest(
            staging_offset=offset, regions=regions, part=(index, count), chunk=chunk, chunks=chunks
        )
    except (TypeError, ValueError) as err:
        raise WireError(f"{what} field 'pk' (packing manifest) is malformed: {str(err)[:200]}") from None


def _producer(body: Mapping[str, Any], what: str) -> RankKey:
    return RankKey(
        _int_field(body, "pp", what, high=MAX_PARALLEL - 1),
        _int_field(body, "tp", what, high=MAX_PARALLEL - 1),
    )


# ------------------------------------------------------------------------------ decoder

_PREFIXES = (
    (DONE_PREFIX, NotificationKind.DONE),  # the hot path first
    (PUSH_REG_PREFIX, NotificationKind.PUSH_REG),
    (FAIL_PREFIX, NotificationKind.FAILED),
    (CANCEL_ACK_PREFIX, NotificationKind.CANCEL_ACK),
    (CANCEL_PREFIX, NotificationKind.CANCEL),
    (HEARTBEAT_PREFIX, NotificationKind.HEARTBEAT),
    (HELLO_PREFIX, NotificationKind.HELLO),
    (GOODBYE_PREFIX, NotificationKind.GOODBYE),
)


def _check_version(body: Mapping[str, Any], what: str) -> None:
    version = body.get("v")
    if (
        not isinstance(version, list)
        or len(version) < 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in version[:2])
    ):
        raise WireError(
            f"{what} carries no notification version (field 'v'); the peer runs an older kvpush. "
            f"Run the same major release on both sides (this side speaks {NOTIF_VERSION[0]}.x)"
        )
    if version[0] != NOTIF_VERSION[0]:
        raise WireError(
            f"{what} is notification format {version[0]}.{version[1]}, this side speaks "
            f"{NOTIF_VERSION[0]}.{NOTIF_VERSION[1]}; run the same major release on both sides"
        )


def decode_notification(message: bytes) -> Notification | None:
    """Decode a kvpush notification; None if the prefix is not kvpush's. Raises ``WireError``
    (naming the field) on a kvpush prefix with a malformed or out-of-range body."""
    if message.startswith(DONE_PREFIX):  # the hot path: a direct DONE, every check inline
        note = _direct_done(message)
        if note is not None:
            return note
    match = next(((p, k) for p, k in _PREFIXES if message.startswith(p)), None)
    if match is None:
        return None
    prefix, kind = match
    what = prefix.decode().rstrip(":")
    body = unpack(message[len(prefix) :], what)
    if not isinstance(body, Mapping):
        raise WireError(f"{what} body must be a map, got {type(body).__name__}")
    _check_version(body, what)
    if kind is NotificationKind.DONE:
        return Notification(
            kind=kind,
            request_id=_str_field(body, "request_id", what),
            producer=_producer(body, what),
            producer_tp_size=_int_field(body, "ptp", what, low=1, high=MAX_PARALLEL),
            packing=_manifest(body, what),
            incarnation=_str_field(body, "inc", what, optional=True),
            attempt=_attempt(body, what),
        )
    if kind is NotificationKind.PUSH_REG:
        rid = _str_field(body, "request_id", what)
        match_key = _str_field(body, "match_key", what)
        block_ids = _block_ids(body.get("local_block_ids"), what)
        coordinates = _coordinate_fields(body, what)
        staging = body.get("staging", -1)
        if (
            not isinstance(staging, int)
            or isinstance(staging, bool)
            or not -1 <= staging < MAX_STAGING_OFFSET
        ):
            raise WireError(f"{what} field 'staging' must be -1 or an offset in [0, 2**48), got {staging!r}")
        fingerprint = body.get("pf")
        if fingerprint is not None and (
            not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= MAX_FINGERPRINT_CHARS
        ):
            raise WireError(
                f"{what} field 'pf' (prompt fingerprint) must be a non-empty string of at most "
                f"{MAX_FINGERPRINT_CHARS} chars or absent, got {str(fingerprint)[:80]!r}"
            )
        reg = PushRegistration(
            request_id=rid,
            match_key=match_key,
            block_ids=block_ids,
            staging_offset=staging,
            prompt_fingerprint=fingerprint,
            block_start=_block_start(body.get("bs"), len(block_ids), what),
            num_tokens=None if body.get("nt") is None else _int_field(body, "nt", what, high=MAX_TOKENS),
            attempt=_attempt(body, what),
            **coordinates,
        )
        return Notification(kind=kind, request_id=rid, registration=reg)
    if kind is NotificationKind.HEARTBEAT:
        ids = _str_list(body, "request_ids", what)
        if "stamp" in body:  # P's answer
            stamp = _float_field(body, "stamp", what)
            want = _str_list(body, "want", what)
            failed = _str_list(body, "failed", what)
            unknown = _str_list(body, "unknown", what)
            return Notification(
                kind=kind,
                producer=_producer(body, what),
                stamp=stamp,
                incarnation=_str_field(body, "inc", what, optional=True),
                want=want,
                failed_keys=failed,
                settled_keys=_str_list(body, "fs", what),
                unknown_keys=unknown,
                want_attempts=_attempt_list(body, "wa", len(want), what),
                failed_attempts=_attempt_list(body, "fa", len(failed), what),
                unknown_attempts=_attempt_list(body, "ua", len(unknown), what),
            )
        if "decode_engine_id" not in body:
            return Notification(kind=kind, request_ids=ids)
        reg = _decode_coordinates(body, what, request_id="(heartbeat)", match_key="(heartbeat)")
        return Notification(
            kind=kind,
            request_ids=ids,
            request_attempts=_attempt_list(body, "ra", len(ids), what),
            registration=reg,
            producer=RankKey(0, reg.decode_tp_rank),
            incarnation=reg.decode_incarnation,
        )
    if kind is NotificationKind.HELLO:
        reg = _decode_coordinates(body, what, request_id="(hello)", match_key="(hello)")
        return Notification(
            kind=kind,
            registration=reg,
            producer=RankKey(0, reg.decode_tp_rank),
            incarnation=reg.decode_incarnation,
            hello_id=_hello_id(body, what),
        )
    if kind is NotificationKind.GOODBYE:
        return Notification(
            kind=kind,
            producer=_producer(body, what),
            incarnation=_str_field(body, "inc", what),
            unsettled=body.get("unsettled", True) is not False,
            delivered=_str_list(body, "done", what),
        )
    request_id = _str_field(body, "request_id", what)
    if kind is NotificationKind.CANCEL:
        if "d_request_id" not in body:
            return Notification(kind=kind, request_id=request_id)
        reg = attrs.evolve(
            _decode_coordinates(
                body, what, request_id=_str_field(body, "d_request_id", what), match_key=request_id
            ),
            attempt=_attempt(body, what),
        )
        return Notification(
            kind=kind, request_id=request_id, registration=reg, producer=RankKey(0, reg.decode_tp_rank)
        )
    producer = _producer(body, what)
    # A P that does not say whether a WRITE ended unsettled may have left bytes on the way.
    unsettled = body.get("unsettled", True) is not False
    if kind is NotificationKind.CANCEL_ACK:
        return Notification(
            kind=kind,
            request_id=request_id,
            producer=producer,
            write_in_flight=bool(body.get("inflight")),
            unsettled=unsettled,
            incarnation=_str_field(body, "inc", what, optional=True),
            attempt=_attempt(body, what),
        )
    reason = body.get("reason")
    reason = reason[:MAX_REASON] if isinstance(reason, str) else "unknown"
    if kind is NotificationKind.FAILED:
        return Notification(
            kind=kind,
            request_id=request_id,
            producer=producer,
            reason=reason,
            unsettled=unsettled,
            incarnation=_str_field(body, "inc", what, optional=True),
            hello_id=_hello_id(body, what),
            attempt=_attempt(body, what),
        )
    return Notification(kind=kind, request_id=request_id, producer=producer, reason=reason)


_DONE = NotificationKind.DONE
_MAJOR = NOTIF_VERSION[0]
_DONE_BODY = len(DONE_PREFIX)
_new_rank = tuple.__new__


def _direct_done(message: bytes) -> Notification | None:
    """A direct (not packed) DONE with every field in range, decoded with the checks of the
    general path (version major, request id, producer ranks, P's TP size) inline; None for
    anything else, which the general path then decodes or refuses with its error."""
    try:
        body = _unpackb(message[_DONE_BODY:], raw=False, strict_map_key=False)
    except Exception:
        return None
    if type(body) is not dict or "pk" in body:
        return None
    version, rid = body.get("v"), body.get("request_id")
    pp, tp, ptp = body.get("pp"), body.get("tp"), body.get("ptp")
    inc = body.get("inc", "")
    attempt = body.get("a")
    if (
        type(version) is list
        and len(version) >= 2
        and type(version[0]) is int
        and type(version[1]) is int
        and version[0] == _MAJOR
        and type(rid) is str
        and 0 < len(rid) <= MAX_ID_CHARS
        and type(pp) is int
        and type(tp) is int
        and type(ptp) is int
        and 0 <= pp < MAX_PARALLEL
        and 0 <= tp < MAX_PARALLEL
        and 1 <= ptp <= MAX_PARALLEL
        and type(inc) is str
        and len(inc) <= MAX_ID_CHARS
        and (attempt is None or (type(attempt) is int and 1 <= attempt <= MAX_ATTEMPT))
    ):
        # RankKey's own checks (non-negative plain ints) hold: skip its constructor
        producer = _new_rank(RankKey, (pp, tp))
        return Notification(
            kind=_DONE,
            request_id=rid,
            producer=producer,
            producer_tp_size=ptp,
            incarnation=inc,
            attempt=attempt,
        )
    return None
