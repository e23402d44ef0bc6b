"""Every decoder of what crosses the wire, fuzzed: notifications (each kind), handshake
metadata and its region codec, side-channel frames and the two MAC envelopes.

For arbitrary bytes, arbitrary msgpack bodies and mutations of valid encodings, a decoder
returns a valid object (every field within the bounds :func:`assert_sane` states) or raises
the documented error (``WireError``; ``HandshakeError`` for a handshake a peer refused) and
nothing else; valid objects round-trip; hostile payloads decode within bounded memory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import struct
import tracemalloc
from typing import Any
from unittest import mock

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.core import notif_auth, region_codec, sidechannel, sidechannel_auth, wire
from kvpush.core import notifications as notes
from kvpush.core.errors import HandshakeError, WireError
from kvpush.core.fingerprint import MAX_FINGERPRINT_CHARS
from kvpush.core.types import (
    AgentMetadata,
    KVRegion,
    Notification,
    NotificationKind,
    PackManifest,
    PushRegistration,
    RankKey,
)
from kvpush.testing import make_agent_metadata

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PREFIXES = (
    notes.PUSH_REG_PREFIX,
    notes.DONE_PREFIX,
    notes.FAIL_PREFIX,
    notes.CANCEL_PREFIX,
    notes.CANCEL_ACK_PREFIX,
    notes.HEARTBEAT_PREFIX,
    notes.HELLO_PREFIX,
    notes.GOODBYE_PREFIX,
)

# ------------------------------------------------------------------ strategies

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
clock = st.floats(0, 1e9, allow_nan=False)
ranks = st.integers(0, 7)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from([-1, 0, 1, 2**31, 2**48, 4096, 4097, "", "v", math.nan, math.inf])
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=24,
)


@st.composite
def registrations(draw: st.DrawFn, blocks: bool = True) -> PushRegistration:
    size = draw(st.integers(1, 8))
    groups = draw(
        st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6, unique=True), min_size=1, max_size=3)
    )
    if blocks and not any(groups):
        groups[0] = [draw(st.integers(0, 2**31 - 1))]
    return PushRegistration(
        request_id=draw(names),
        match_key=draw(names),
        decode_engine_id=draw(names),
        decode_host=draw(names),
        decode_port=draw(st.integers(1, 65535)),
        decode_tp_size=size,
        block_ids=groups if blocks else (),
        remote_engine_id=draw(names),
        decode_tp_rank=draw(st.integers(0, size - 1)),
        staging_offset=draw(st.integers(-1, 2**48 - 1)),
        decode_incarnation=draw(st.text(max_size=8)),
        grant=draw(st.none() | clock),
        fresh_s=draw(clock),
        prompt_fingerprint=draw(st.none() | st.text(min_size=1, max_size=MAX_FINGERPRINT_CHARS)),
    )


@st.composite
def manifests(draw: st.DrawFn) -> PackManifest:
    count = draw(st.integers(1, 8))
    chunks = draw(st.integers(1, 8))
    return PackManifest(
        staging_offset=draw(st.integers(0, 2**48 - 1)),
        regions=draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8, unique=True)),
        part=(draw(st.integers(0, count - 1)), count),
        chunk=draw(st.integers(0, chunks - 1)),
        chunks=chunks,
    )


@st.composite
def producers(draw: st.DrawFn) -> tuple[RankKey, int]:
    size = draw(st.integers(1, 8))
    return RankKey(draw(ranks), draw(st.integers(0, size - 1))), size


keys = st.lists(names, max_size=4)
attempt_ids = st.none() | st.integers(1, (1 << 63) - 1)


@st.composite
def entry_attempts(draw: st.DrawFn, entries: list[str]) -> list[int | None] | None:
    """Not stated, or one attempt (or None) per entry of a heartbeat list (since 2.8)."""
    if draw(st.booleans()):
        return None
    return draw(st.lists(attempt_ids, min_size=len(entries), max_size=len(entries)))


@st.composite
def valid_messages(draw: st.DrawFn) -> bytes:
    """A valid encoding of any kind, from the real encoders."""
    (producer, size), rid = draw(producers()), draw(names)
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return notes.encode_push_reg(draw(registrations()))
    if kind == 1:
        return notes.encode_done(rid, producer, size, draw(st.none() | manifests()))
    if kind == 2:
        return notes.encode_failed(rid, producer, draw(st.text(max_size=40)), draw(st.booleans()))
    if kind == 3:
        reg = draw(st.none() | registrations(blocks=False))
        return notes.encode_cancel(rid, reg, 0 if reg is None else reg.decode_tp_rank)
    if kind == 4:
        return notes.encode_cancel_ack(rid, producer, draw(st.booleans()), draw(st.booleans()))
    if kind == 5:
        return notes.encode_heartbeat(draw(keys))
    if kind == 6:
        reg, ids = draw(registrations(blocks=False)), draw(keys)
        return notes.encode_heartbeat(ids, reg, reg.decode_tp_rank, attempts=draw(entry_attempts(ids)))
    if kind == 7:
        want, failed, unknown = draw(st.tuples(keys, keys, keys))
        return notes.encode_heartbeat_answer(
            producer,
            draw(clock),
            draw(st.text(max_size=8)),
            want,
            failed,
            unknown,
            want_attempts=draw(entry_attempts(want)),
            failed_attempts=draw(entry_attempts(failed)),
            unknown_attempts=draw(entry_attempts(unknown)),
        )
    if kind == 8:
        return notes.encode_goodbye(producer, draw(names), draw(st.booleans()))
    reg = draw(registrations(blocks=False))
    return notes.encode_hello(reg, reg.decode_tp_rank)


# ------------------------------------------------------------------ what a valid object is


def _finite_clock(value: float | None) -> bool:
    return value is None or (
        type(value) is float and math.isfinite(value) and 0 <= value <= notes.MAX_CLOCK_S
    )


def _id(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= notes.MAX_ID_CHARS


def assert_sane(note: Notification | None) -> None:
    """Every field a receiver acts on is within the bounds the decoder documents."""
    if note is None:
        return
    assert isinstance(note, Notification) and isinstance(note.kind, NotificationKind)
    assert _id(note.request_id) and _id(note.incarnation) and _finite_clock(note.stamp)
    assert isinstance(note.reason, str) and len(note.reason) <= notes.MAX_REASON
    for keys_ in (note.request_ids, note.want, note.failed_keys, note.unknown_keys):
        assert len(keys_) <= notes.MAX_KEYS and all(_id(k) and k for k in keys_)
    for keys_, attempts in (
        (note.request_ids, note.request_attempts),
        (note.want, note.want_attempts),
        (note.failed_keys, note.failed_attempts),
        (note.unknown_keys, note.unknown_attempts),
    ):  # one attempt (or None) per entry, each a valid attempt id (since 2.8)
        assert attempts is None or len(attempts) == len(keys_)
        assert all(a is None or (type(a) is int and 1 <= a <= notes.MAX_ATTEMPT) for a in attempts or ())
    if note.producer is not None:
        assert type(note.producer) is RankKey
        assert all(type(r) is int and 0 <= r < notes.MAX_PARALLEL for r in note.producer)
    if note.kind is NotificationKind.DONE:
        # a producer at or past its stated TP size is refused by D's core (not one P published)
        assert note.producer is not None and 1 <= note.producer_tp_size <= notes.MAX_PARALLEL
    manifest = note.packing
    if manifest is not None:
        index, count = manifest.part
        assert 0 <= manifest.staging_offset < notes.MAX_STAGING_OFFSET
        assert manifest.regions and len(set(manifest.regions)) == len(manifest.regions)
        assert all(type(j) is int and 0 <= j < 2**31 for j in manifest.regions)
        assert 0 <= index < count <= notes.MAX_PARALLEL and 0 <= manifest.chunk < manifest.chunks <= 1 << 20
    reg = note.registration
    if reg is not None:
        assert 0 <= reg.decode_tp_rank < reg.decode_tp_size <= notes.MAX_PARALLEL
        assert 1 <= reg.decode_port <= 65535 and -1 <= reg.staging_offset < notes.MAX_STAGING_OFFSET
        assert _finite_clock(reg.grant) and _finite_clock(reg.fresh_s)
        assert all(_id(s) for s in (reg.decode_engine_id, reg.decode_host, reg.remote_engine_id))
        assert reg.prompt_fingerprint is None or 0 < len(reg.prompt_fingerprint) <= MAX_FINGERPRINT_CHARS
        for group in reg.block_ids:
            assert len(set(group)) == len(group)
            assert all(type(b) is int and 0 <= b <= notes.MAX_BLOCK_ID for b in group)
        if note.kind is NotificationKind.PUSH_REG:
            assert any(reg.block_ids) and len(reg.block_ids) <= region_codec.MAX_KV_GROUPS


def decode(message: bytes) -> Notification | None:
    """decode_notification, allowed to raise only WireError; the result checked sane."""
    try:
        note = notes.decode_notification(message)
    except WireError:
        return None
    assert_sane(note)
    return note


# ------------------------------------------------------------------ notifications


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    decode(data)


@FUZZ
@given(st.sampled_from(PREFIXES), st.binary(max_size=200))
def test_a_kvpush_prefix_before_arbitrary_bytes(prefix: bytes, data: bytes) -> None:
    decode(prefix + data)


@FUZZ
@given(st.sampled_from(PREFIXES), msgpack_values)
def test_a_kvpush_prefix_before_any_msgpack_value(prefix: bytes, value: Any) -> None:
    decode(prefix + msgpack.packb(value, use_bin_type=True))


@FUZZ
@given(valid_messages(), st.data())
def test_a_valid_body_with_fields_replaced_removed_or_added(message: bytes, data: st.DataObject) -> None:
    prefix = next(p for p in sorted(PREFIXES, key=len, reverse=True) if message.startswith(p))
    body = msgpack.unpackb(message[len(prefix) :], raw=False)
    fields = [
        *sorted(body),
        "pk",
        "stamp",
        "pf",
        "staging",
        "d_request_id",
        "decode_engine_id",
        "ra",
        "fa",
        "x",
    ]
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(fields))
        if data.draw(st.booleans()):
            body.pop(name, None)
        else:
            body[name] = data.draw(msgpack_values)
    decode(prefix + msgpack.packb(body, use_bin_type=True))


@FUZZ
@given(valid_messages(), st.data())
def test_byte_mutations_of_valid_encodings(message: bytes, data: st.DataObject) -> None:
    buf = bytearray(message)
    for _ in range(data.draw(st.integers(1, 4))):
        op, at = data.draw(st.integers(0, 2)), data.draw(st.integers(0, len(buf)))
        if op == 0 and at < len(buf):
            buf[at] = data.draw(st.integers(0, 255))
        elif op == 1:
            buf[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del buf[at : at + data.draw(st.integers(1, 8))]
    decode(bytes(buf))


@FUZZ
@given(valid_messages())
def test_every_valid_encoding_decodes_sane(message: bytes) -> None:
    assert decode(message) is not None


@FUZZ
@given(registrations())
def test_push_reg_round_trips(reg: PushRegistration) -> None:
    note = decode(notes.encode_push_reg(reg))
    assert note is not None and note.kind is NotificationKind.PUSH_REG
    grant = None if reg.grant is None else float(reg.grant)
    assert note.registration == PushRegistration(
        **{**_fields(reg), "grant": grant, "fresh_s": float(reg.fresh_s), "block_ids": reg.block_ids}
    )


def _fields(obj: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(obj, recurse=False)


@FUZZ
@given(producers(), names, st.none() | manifests())
def test_done_round_trips_with_and_without_a_manifest(
    producer: tuple[RankKey, int], rid: str, manifest: PackManifest | None
) -> None:
    rank, size = producer
    note = decode(notes.encode_done(rid, rank, size, manifest))
    assert note is not None and (note.kind, note.request_id, note.producer) == (
        NotificationKind.DONE,
        rid,
        rank,
    )
    assert note.producer_tp_size == size and note.packing == manifest


@FUZZ
@given(producers(), names, st.text(max_size=3000), st.booleans(), st.booleans())
def test_fail_and_cancel_ack_round_trip(
    producer: tuple[RankKey, int], rid: str, reason: str, unsettled: bool, inflight: bool
) -> None:
    rank = producer[0]
    failed = decode(notes.encode_failed(rid, rank, reason, unsettled))
    assert failed is not None and (failed.kind, failed.producer, failed.unsettled) == (
        NotificationKind.FAILED,
        rank,
        unsettled,
    )
    assert failed.reason == reason[: notes.MAX_REASON]
    ack = decode(notes.encode_cancel_ack(rid, rank, inflight, unsettled))
    assert ack is not None and (ack.kind, ack.write_in_flight, ack.unsettled) == (
        NotificationKind.CANCEL_ACK,
        inflight,
        unsettled,
    )


@FUZZ
@given(producers(), names, st.booleans(), st.lists(names, max_size=8))
def test_goodbye_round_trips(
    producer: tuple[RankKey, int], incarnation: str, unsettled: bool, delivered: list[str]
) -> None:
    bye = decode(notes.encode_goodbye(producer[0], incarnation, unsettled, delivered=delivered))
    assert bye is not None and (bye.kind, bye.producer, bye.incarnation, bye.unsettled, bye.delivered) == (
        NotificationKind.GOODBYE,
        producer[0],
        incarnation,
        unsettled,
        tuple(delivered),
    )


@FUZZ
@given(names, registrations(blocks=False), keys, producers(), clock, st.tuples(keys, keys, keys), st.data())
def test_cancel_heartbeat_answer_and_hello_round_trip(
    key: str,
    reg: PushRegistration,
    ids: list[str],
    producer: tuple[RankKey, int],
    stamp: float,
    lists: tuple[list[str], list[str], list[str]],
    data: st.DataObject,
) -> None:
    rank = reg.decode_tp_rank
    bare = decode(notes.encode_cancel(key))
    assert bare is not None and (bare.kind, bare.request_id, bare.registration) == (
        NotificationKind.CANCEL,
        key,
        None,
    )
    cancel = decode(notes.encode_cancel(key, reg, rank))
    assert cancel is not None and cancel.registration is not None
    assert (cancel.registration.request_id, cancel.registration.decode_tp_rank) == (reg.request_id, rank)
    asked = data.draw(entry_attempts(ids))
    heartbeat = decode(notes.encode_heartbeat(ids, reg, rank, attempts=asked))
    assert (
        heartbeat is not None
        and heartbeat.request_ids == tuple(ids)
        and heartbeat.producer == RankKey(0, rank)
        and heartbeat.request_attempts == (None if asked is None else tuple(asked))
    )
    named = [data.draw(entry_attempts(k)) for k in lists]
    answer = decode(
        notes.encode_heartbeat_answer(
            producer[0],
            stamp,
            "inc",
            *lists,
            want_attempts=named[0],
            failed_attempts=named[1],
            unknown_attempts=named[2],
        )
    )
    assert answer is not None and answer.stamp == stamp and answer.producer == producer[0]
    assert (answer.want, answer.failed_keys, answer.unknown_keys) == tuple(tuple(k) for k in lists)
    assert (answer.want_attempts, answer.failed_attempts, answer.unknown_attempts) == tuple(
        None if a is None else tuple(a) for a in named
    )
    hello = decode(notes.encode_hello(reg, rank))
    assert hello is not None and hello.kind is NotificationKind.HELLO
    assert hello.registration is not None and hello.registration.decode_engine_id == reg.decode_engine_id


@FUZZ
@given(
    st.fixed_dictionaries(
        {}, optional={k: msgpack_values | ranks for k in ("v", "request_id", "pp", "tp", "ptp")}
    )
)
def test_the_done_hot_path_agrees_with_the_general_path(body: dict[str, Any]) -> None:
    """A direct DONE the hot path accepts is exactly what the checked general path decodes."""
    body.setdefault("v", list(notes.NOTIF_VERSION))
    message = notes.DONE_PREFIX + msgpack.packb(body, use_bin_type=True)
    fast = notes._direct_done(message)
    with mock.patch.object(notes, "_direct_done", return_value=None):
        try:
            slow = notes.decode_notification(message)
        except WireError:
            slow = None
    if fast is not None:
        assert slow == fast
        assert_sane(fast)


@pytest.mark.parametrize(
    "message",
    [
        notes.DONE_PREFIX + b"\xdd\xff\xff\xff\xff",  # an array claiming 2**32 - 1 items
        notes.DONE_PREFIX + b"\x91" * 200_000 + b"\xc0",  # nested 200k deep
        notes.PUSH_REG_PREFIX + msgpack.packb({"v": [2, 1], "local_block_ids": [[]] * 100_000}),
        notes.HEARTBEAT_PREFIX + msgpack.packb({"v": [2, 1], "request_ids": ["k" * 2000] * 100}),
        notes.HEARTBEAT_PREFIX
        + msgpack.packb({"v": [2, 1], "request_ids": [], "stamp": 1.0, "want": [{}] * 100_000}),
    ],
    ids=["huge-array-header", "deep-nesting", "100k-groups", "long-keys", "100k-maps"],
)
def test_hostile_notifications_decode_in_bounded_memory(message: bytes) -> None:
    """Memory is bounded by the message size (a NIXL notification's own bound): never by a
    count the message states."""
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            notes.decode_notification(message)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * len(message) + (1 << 20), f"{peak} bytes for a {len(message)}-byte message"


# ------------------------------------------------------------------ handshake metadata


_META = make_agent_metadata(num_layers=4)
_OUTER = msgpack.unpackb(wire.encode_metadata(_META), raw=False)
_INNER = msgpack.unpackb(_OUTER["meta"], raw=False)


def decode_meta(payload: bytes) -> AgentMetadata | None:
    try:
        meta = wire.decode_metadata(payload, expected_hash=None, source="fuzz")
    except (WireError, HandshakeError):
        return None
    assert isinstance(meta.engine_id, str) and isinstance(meta.agent_blob, bytes)
    assert isinstance(meta.extensions, dict) and all(isinstance(k, str) for k in meta.extensions)
    assert meta.parallel.tp_size <= wire.MAX_PARALLEL and meta.parallel.pp_size <= wire.MAX_PARALLEL
    region_codec.check_regions(meta.regions)  # every region in bounds
    return meta


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for key, value in obj.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out += _paths(value, (*prefix, i))
    return out


_INNER_PATHS = _paths(_INNER)


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_handshake_payloads_raise_wire_or_handshake_errors(data: bytes) -> None:
    decode_meta(data)


@FUZZ
@given(st.data())
def test_handshake_metadata_with_fields_replaced(data: st.DataObject) -> None:
    inner = copy.deepcopy(_INNER)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_INNER_PATHS))
        node = inner
        try:
            for step in path[:-1]:
                node = node[step]
            if isinstance(node, dict) and data.draw(st.booleans()):
                node.pop(path[-1], None)
            else:
                node[path[-1]] = data.draw(msgpack_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier replacement removed this path
    outer = {**_OUTER, "meta": msgpack.packb(inner, use_bin_type=True)}
    decode_meta(msgpack.packb(outer, use_bin_type=True))


region_fields = st.builds(
    KVRegion,
    base_addr=st.integers(0, 2**56),
    block_len=st.integers(1, 4096),
    block_stride=st.just(4096),
    num_blocks=st.integers(1, 1 << 20),
    mem_type=st.sampled_from(["DRAM", "VRAM"]),
    device_id=st.integers(0, 7),
    layer_names=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=2),
    kv_group=st.integers(0, 3),
    component=st.sampled_from(["K", "V", "KV", "latent"]),
    replicate=st.booleans(),
    num_heads=st.integers(1, 8),
)


@FUZZ
@given(st.lists(region_fields, max_size=12))
def test_metadata_round_trips_with_any_regions(regions: list[KVRegion]) -> None:
    import attrs

    meta = attrs.evolve(_META, regions=regions)
    assert decode_meta(wire.encode_metadata(meta)) == meta


@FUZZ
@given(msgpack_values, st.integers(-2, 20))
def test_region_codec_on_arbitrary_columns(cols: Any, n: int) -> None:
    try:
        regions = region_codec.decode_regions({"n": n, "cols": cols})
    except WireError:
        return
    assert len(regions) == n
    region_codec.check_regions(regions)


@pytest.mark.parametrize(
    "encoded",
    [
        {"n": 1 << 40, "cols": {"base_addr": {"i": [0, 1, 1 << 40]}}},
        {"n": region_codec.MAX_REGIONS, "cols": {"base_addr": {"i": [0, 0, 1 << 40]}}},
        {"n": 4, "cols": {"layer_names": {"v": ["x" * 10, 1 << 40]}}},
        {"n": 2, "cols": {"base_addr": {"i": [2**64 - 1, 1, 2]}}},
    ],
    ids=["count-2**40", "run-past-count", "value-run-2**40", "address-past-2**64"],
)
def test_region_bombs_are_refused_before_anything_is_expanded(encoded: dict[str, Any]) -> None:
    """A 40-byte column stated 2**40 regions: it was expanded (MemoryError, or the OOM killer)."""
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            region_codec.decode_regions(encoded)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("section", "field", "value", "match"),
    [
        ("parallel", "tp_size", 1 << 40, "parallel.tp_size must be an int in \\[-1, 4096\\]"),
        ("parallel", "pp_size", True, "parallel.pp_size"),
        ("model", "num_layers", 1 << 40, "model.num_layers"),
        (None, "engine_id", 5, "'engine_id' must be a string"),
        (None, "agent_blob", "text", "'agent_blob' must be bytes"),
        (None, "extensions", [1], "'extensions' must be a map"),
        ("regions", "kv_group", -1, "field 'kv_group' must be an int"),
        ("regions", "device_id", -1, "field 'device_id' must be an int"),
        ("regions", "replicate", "yes", "field 'replicate' must be a bool"),
        ("regions", "layer_names", "abc", "'layer_names' must be a list"),
        ("extensions", "write_deadline_s", math.nan, "'write_deadline_s' must be a number of seconds"),
        ("extensions", "write_deadline_s", math.inf, "'write_deadline_s' must be a number of seconds"),
        ("extensions", "write_deadline_s", True, "'write_deadline_s' must be a number of seconds"),
        ("extensions", "writes_abortable", "yes", "'writes_abortable' must be a bool"),
        ("extensions", "result_attempts", 1, "'result_attempts' must be a bool"),
        ("extensions", "answer_attempts", "yes", "'answer_attempts' must be a bool"),
        ("extensions", "unregistered_cancels", 1, "'unregistered_cancels' must be a bool"),
        ("extensions", "process", {"host": "h", "pidns": "n", "pid": -5, "start": 1}, "'process' must be"),
        ("extensions", "ended_incarnations", {"inc": "no"}, "'ended_incarnations' must map"),
        ("extensions", "ended_incarnations", {f"i{n}": False for n in range(17)}, "at most 16"),
        ("extensions", "ended_incarnations", ["inc"], "'ended_incarnations' must map"),
        ("extensions", "kvpush.staging", {"addr": -1, "len": 4096}, "field 'addr' must be an int"),
        ("extensions", "kvpush.staging", {"addr": 2**64 - 4096, "len": 8192}, "ends past the 64-bit"),
        ("extensions", "window_block_tokens", [16, -1], "'window_block_tokens' must be a list"),
        ("extensions", "window_block_tokens", [True], "'window_block_tokens' must be a list"),
        ("extensions", "window_block_tokens", {"0": 16}, "'window_block_tokens' must be a list"),
    ],
)
def test_metadata_fields_a_peer_would_act_on_are_typed_and_bounded(
    section: str | None, field: str, value: Any, match: str
) -> None:
    inner = copy.deepcopy(_INNER)
    if section == "regions":
        inner["regions"]["cols"][field] = {"v": [value, inner["regions"]["n"]]}
    elif section == "extensions":
        inner["extensions"] = {**inner["extensions"], field: value}
    elif section is not None:
        inner[section][field] = value
    else:
        inner[field] = value
    outer = {**_OUTER, "meta": msgpack.packb(inner, use_bin_type=True)}
    with pytest.raises(WireError, match=match):
        wire.decode_metadata(msgpack.packb(outer, use_bin_type=True), expected_hash=None, source="fuzz")


# ------------------------------------------------------------------ side channel and MACs


@pytest.fixture(scope="module")
def servers() -> Any:
    plain = sidechannel.SideChannelServer("fuzz")
    sealed = sidechannel.SideChannelServer("fuzz-sealed", secret=b"s" * 32)
    for server in (plain, sealed):
        server.publish(RankKey(0, 0), b"payload")
    yield plain, sealed
    plain.close()
    sealed.close()


def _check_reply(reply: bytes, error: str | None) -> None:
    body = sidechannel._unpack(reply, "reply", dict(sidechannel._REPLY_LIMITS, max_bin_len=len(reply)))
    assert isinstance(body, dict)
    if error is None:
        assert body["payload"] == b"payload" and not body.get("error")  # the published payload
    else:
        assert body == {"payload": None, "error": error} and isinstance(error, str)


def _sealed_request(frame: bytes) -> bytes:
    return sidechannel_auth.seal(b"s" * 32, b"req", b"n" * sidechannel_auth.NONCE_BYTES, frame)


@FUZZ
@given(
    st.binary(max_size=200)
    | st.builds(lambda v: msgpack.packb(v, use_bin_type=True), msgpack_values)
    | st.builds(
        lambda v, p, t: msgpack.packb([sidechannel.GET_META, v, p, t]),
        st.integers(-(2**63), 2**63) | st.just(wire.WIRE_VERSION),
        st.integers(-(2**63), 2**63),
        st.integers(-(2**63), 2**63),
    )
)
def test_side_channel_requests_get_a_reply_never_an_exception(servers: Any, frame: bytes) -> None:
    plain, sealed = servers
    _check_reply(*plain._reply_for(frame))
    _check_reply(*sealed._reply_for(frame))
    _check_reply(*sealed._reply_for(_sealed_request(frame)))


@FUZZ
@given(st.binary(max_size=200) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_side_channel_replies_decode_or_raise_wire_error(reply: bytes) -> None:
    with contextlib.suppress(WireError):
        sidechannel._unpack(reply, "reply", dict(sidechannel._REPLY_LIMITS, max_bin_len=len(reply)))


@FUZZ
@given(st.binary(max_size=120), st.booleans())
def test_mac_envelopes_refuse_anything_not_sealed_with_the_secret(frame: bytes, magic: bool) -> None:
    if magic:
        frame = sidechannel_auth.AUTH_MAGIC + frame
    try:
        sidechannel_auth.unseal(b"s" * 32, b"req", frame)
    except HandshakeError:
        pass
    else:
        raise AssertionError("an unsealed frame passed")
    key = notif_auth.derive_key(b"s" * 32)
    assert notif_auth.unseal(key, "a", "b", "i", notif_auth.MAC_PREFIX + frame) is None
    sealed = notif_auth.seal(key, "a", "b", "i", frame)
    assert notif_auth.unseal(key, "a", "b", "i", sealed) == frame
    assert notif_auth.unseal(key, "a", "b", "other", sealed) is None


# ------------------------------------------------------------------ a router's kv_transfer_params

_PARAM_KEYS = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "pp_size",
    "remote_block_ids",
    "remote_request_id",
    "transfer_id",
    "prompt_fingerprint",
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)


@FUZZ
@given(
    st.fixed_dictionaries(
        {"remote_engine_id": names, "remote_host": names, "remote_port": st.integers(1, 65535)}
    ),
    st.dictionaries(st.sampled_from(_PARAM_KEYS), json_values, max_size=4),
)
def test_kv_transfer_params_from_a_router_validate_or_raise_config_error(
    base: dict[str, Any], overrides: dict[str, Any]
) -> None:
    """A router's JSON reaches D as ``kv_transfer_params``: a valid object, or ConfigError."""
    from kvpush.core.errors import ConfigError
    from kvpush.core.types import TransferParams

    params = {**base, **overrides}
    try:
        parsed = TransferParams.from_dict(params)
    except ConfigError:
        return
    assert 1 <= parsed.remote_port <= 65535
    for size in (parsed.tp_size, parsed.pp_size):
        assert size is None or 1 <= size <= 4096
    for group in parsed.remote_block_ids or ():
        assert all(type(b) is int and b >= 0 for b in group)


@pytest.mark.parametrize("blocks", [5, 1.5, b"\x03\x04"], ids=["int", "float", "bytes"])
def test_remote_block_ids_that_are_not_a_list_raise_config_error(blocks: Any) -> None:
    from kvpush.core.errors import ConfigError
    from kvpush.core.types import TransferParams

    params = {"remote_engine_id": "P", "remote_host": "h", "remote_port": 1, "remote_block_ids": blocks}
    with pytest.raises(ConfigError, match="remote_block_ids"):
        TransferParams.from_dict(params)


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["accept", "handshake", "disconnect", "request", "enforce", "idle"]),
        st.integers(0, 12),
    ),
    max_size=60,
)


@FUZZ
@given(_EVENTS, st.integers(1, 5))
def test_the_connection_tracker_stays_within_its_cap_whatever_the_events(events: list[Any], cap: int) -> None:
    """Socket-monitor events and requests in any order (fds reused, events for unknown fds,
    requests before accepts): after ``enforce`` at most ``cap`` connections are tracked,
    connections that never asked go first, and no fd is shut down twice without a new accept."""
    import logging

    from kvpush.core import sidechannel_bounds as bounds

    warnings = bounds.RateLimitedWarnings(logging.getLogger("fuzz"), "fuzz: ")
    tracker = bounds.ConnectionTracker(port=1, max_connections=cap, idle_timeout_s=60.0, warnings=warnings)
    shut: list[int] = []
    open_fds: set[int] = set()
    asked: set[int] = set()
    clock = [1000.0]

    def shut_down(fd: int) -> bool:
        assert fd in open_fds, f"fd {fd} shut down but not open"
        open_fds.discard(fd)
        shut.append(fd)
        return True

    with (
        mock.patch.object(tracker, "_shut_down", shut_down),
        mock.patch.object(bounds.time, "monotonic", lambda: clock[0]),
    ):
        for kind, fd in events:
            if kind == "accept":
                if fd in open_fds:
                    continue  # the kernel does not hand out an open fd twice
                open_fds.add(fd)
                asked.discard(fd)
                tracker.on_event(bounds.zmq.EVENT_ACCEPTED, fd)
            elif kind == "handshake":
                tracker.on_event(bounds.zmq.EVENT_HANDSHAKE_SUCCEEDED, fd)
            elif kind == "disconnect":
                tracker.on_event(bounds.zmq.EVENT_DISCONNECTED, fd)
                open_fds.discard(fd)
            elif kind == "request":
                tracker.touch(fd, request=True)
                if fd in open_fds:
                    asked.add(fd)
            elif kind == "idle":
                clock[0] += 61.0
            else:
                waiting_before = open_fds - asked
                shut.clear()
                tracker.enforce()
                assert len(tracker) <= cap
                if clock[0] == 1000.0 and any(f in asked for f in shut):  # over the cap, none idle
                    assert not waiting_before & open_fds, "one that asked went before one that never did"
            tracked = set(tracker._waiting) | set(tracker._asked)
            assert tracked == open_fds and set(tracker._asked) == asked & open_fds


# ------------------------------------------------------------------ transports' agent blobs


@FUZZ
@given(st.binary(max_size=200) | st.builds(lambda v: json.dumps(v).encode(), json_values))
def test_a_peers_blob_header_unframes_or_raises_transfer_error(header: bytes) -> None:
    """The NIXL transport's header (UCX TCP listeners the fence connects to) and cuda_ipc's:
    the inner blob and a JSON object, or ``TransferError``."""
    from kvpush.core.errors import TransferError
    from kvpush.transports import framing
    from kvpush.transports.nixl import _listeners

    blob = b"MAGC" + struct.pack("<I", len(header)) + header + b"inner"
    try:
        inner, info = framing.unframe(b"MAGC", blob, "fuzz")
        listeners = _listeners(info)
    except TransferError:
        return
    assert inner == b"inner" and isinstance(info, dict)
    assert listeners is None or all(isinstance(h, str) and 0 < p < 65536 for h, p in listeners)


@pytest.mark.parametrize("decoder", ["nixl", "cuda_ipc"])
def test_a_deeply_nested_blob_header_raises_transfer_error(decoder: str) -> None:
    from kvpush.core.errors import TransferError
    from kvpush.transports import cuda_ipc, framing

    header = b"[" * 100_000
    if decoder == "nixl":
        blob = b"MAGC" + struct.pack("<I", len(header)) + header
        with pytest.raises(TransferError):
            framing.unframe(b"MAGC", blob, "fuzz")
    else:
        blob = cuda_ipc.MAGIC + struct.pack("<I", len(header)) + header
        with pytest.raises(TransferError):
            cuda_ipc.decode_blob(blob)
