"""Issue 10.5: every integer from a peer is range-checked when decoded, with a WireError naming
the field; notifications carry a version; a peer one minor version ahead interoperates."""

from __future__ import annotations

import msgpack
import pytest

from kvpush.core import notifications as wire
from kvpush.core.errors import WireError
from kvpush.core.types import NotificationKind, PushRegistration, RankKey

REG = PushRegistration(
    request_id="d-1",
    match_key="x-1",
    decode_engine_id="D",
    decode_host="127.0.0.1",
    decode_port=5601,
    decode_tp_size=2,
    block_ids=[[3, 4]],
    remote_engine_id="P",
    decode_tp_rank=1,
    staging_offset=4096,
    decode_incarnation="abc",
    grant=12.5,
    fresh_s=10.0,
)


def body(message: bytes, prefix: bytes) -> dict:
    return msgpack.unpackb(message[len(prefix) :], raw=False)


def with_body(prefix: bytes, fields: dict) -> bytes:
    return prefix + msgpack.packb(fields, use_bin_type=True)


def test_push_reg_round_trips_every_field() -> None:
    note = wire.decode_notification(wire.encode_push_reg(REG))
    assert note is not None and note.kind is NotificationKind.PUSH_REG
    assert note.registration == REG


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("local_block_ids", [[2**31]], "block ids must be ints in \\[0, 2147483647\\]"),
        ("local_block_ids", [[1, 1]], "repeats a block id"),
        ("local_block_ids", [[-1]], "block ids must be ints"),
        ("decode_tp_size", 3_000_000, "field 'decode_tp_size' must be an int in \\[1, 4096\\]"),
        ("tp", 2, "field 'tp' must be an int in \\[0, 1\\]"),  # rank below the advertised size
        ("staging", 2**60, "field 'staging' must be -1 or an offset"),
        ("decode_port", 70000, "field 'decode_port'"),
        ("grant", float("nan"), "field 'grant' must be a finite number"),
        ("request_id", "x" * 5000, "field 'request_id' must be a non-empty string of at most"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object, match: str) -> None:
    fields = body(wire.encode_push_reg(REG), wire.PUSH_REG_PREFIX)
    fields[field] = value
    with pytest.raises(WireError, match=match):
        wire.decode_notification(with_body(wire.PUSH_REG_PREFIX, fields))


def test_done_ranks_and_manifest_are_bounded() -> None:
    fields = body(wire.encode_done("d-1", RankKey(0, 1), 2), wire.DONE_PREFIX)
    with pytest.raises(WireError, match="field 'ptp'"):
        wire.decode_notification(with_body(wire.DONE_PREFIX, {**fields, "ptp": 0}))
    with pytest.raises(WireError, match="'pk'"):
        wire.decode_notification(with_body(wire.DONE_PREFIX, {**fields, "pk": [2**60, [0], 0, 1, 0, 1]}))


def test_a_long_failure_reason_is_truncated_when_decoded() -> None:
    fields = body(wire.encode_failed("d-1", RankKey(0, 0), "short"), wire.FAIL_PREFIX)
    note = wire.decode_notification(with_body(wire.FAIL_PREFIX, {**fields, "reason": "x" * 1_000_000}))
    assert note is not None and len(note.reason) == wire.MAX_REASON


@pytest.mark.parametrize("prefix", [wire.FAIL_PREFIX, wire.CANCEL_ACK_PREFIX])
def test_an_unsettled_write_is_assumed_unless_p_says_otherwise(prefix: bytes) -> None:
    """Issue 12: FAIL and CANCEL_ACK say whether a WRITE P posted ended without completing (D
    must fence before releasing). A P that does not say is taken to mean it may have."""
    if prefix == wire.FAIL_PREFIX:
        settled = wire.encode_failed("d-1", RankKey(0, 0), "why", unsettled=False)
    else:
        settled = wire.encode_cancel_ack("d-1", RankKey(0, 0), False, unsettled=False)
    fields = body(settled, prefix)
    assert wire.decode_notification(settled).unsettled is False
    assert wire.decode_notification(with_body(prefix, {**fields, "unsettled": True})).unsettled is True
    silent = {k: v for k, v in fields.items() if k != "unsettled"}
    assert wire.decode_notification(with_body(prefix, silent)).unsettled is True


def test_a_peer_one_minor_version_ahead_interoperates() -> None:
    """A synthetic newer peer: the next minor version and fields this side has never heard of."""
    fields = body(wire.encode_push_reg(REG), wire.PUSH_REG_PREFIX)
    newer = {
        **fields,
        "v": [wire.NOTIF_VERSION[0], wire.NOTIF_VERSION[1] + 1],
        "priority": 3,
        "trace": {"id": "t"},
    }
    note = wire.decode_notification(with_body(wire.PUSH_REG_PREFIX, newer))
    assert note is not None and note.registration == REG


@pytest.mark.parametrize(
    ("version", "match"),
    [(None, "carries no notification version"), ([3, 0], "is notification format 3.0, this side speaks 2")],
)
def test_another_major_version_is_refused_naming_both(version: object, match: str) -> None:
    fields = body(wire.encode_done("d-1", RankKey(0, 0), 1), wire.DONE_PREFIX)
    if version is None:
        del fields["v"]
    else:
        fields["v"] = version
    with pytest.raises(WireError, match=match):
        wire.decode_notification(with_body(wire.DONE_PREFIX, fields))


def test_heartbeat_answer_and_hello_round_trip() -> None:
    answer = wire.decode_notification(wire.encode_heartbeat_answer(RankKey(1, 0), 3.5, "inc", ["k"], ["f"]))
    assert answer is not None and (answer.stamp, answer.want, answer.failed_keys) == (3.5, ("k",), ("f",))
    hello = wire.decode_notification(wire.encode_hello(REG, 1))
    assert hello is not None and hello.kind is NotificationKind.HELLO
    assert hello.registration is not None and hello.registration.decode_incarnation == "abc"


def test_the_registration_attempt_round_trips_and_is_bounded() -> None:
    """Since 2.7: D's PUSH_REG and CANCEL state the attempt ``a``, P's DONE (direct and packed
    paths), FAIL and CANCEL_ACK echo it; absent means not stated; out of range is refused."""
    import attrs

    from kvpush.core.types import PackManifest

    reg = attrs.evolve(REG, attempt=(1 << 63) - 1)
    assert wire.decode_notification(wire.encode_push_reg(reg)).registration == reg
    assert wire.decode_notification(wire.encode_push_reg(REG)).registration.attempt is None
    cancel = wire.decode_notification(wire.encode_cancel("x-1", reg, 1))
    assert cancel.registration.attempt == reg.attempt and cancel.registration.request_id == "d-1"
    manifest = PackManifest(staging_offset=0, regions=[0], part=(0, 1), chunk=0, chunks=1)
    results = [
        wire.encode_done("d-1", RankKey(0, 0), 1, attempt=7),
        wire.encode_done("d-1", RankKey(0, 0), 1, manifest, attempt=7),
        wire.encode_failed("d-1", RankKey(0, 0), "x", attempt=7),
        wire.encode_cancel_ack("d-1", RankKey(0, 0), False, attempt=7),
    ]
    assert [wire.decode_notification(m).attempt for m in results] == [7, 7, 7, 7]
    assert wire.decode_notification(wire.encode_done("d-1", RankKey(0, 0), 1)).attempt is None
    for prefix, message in zip(
        (wire.DONE_PREFIX, wire.DONE_PREFIX, wire.FAIL_PREFIX, wire.CANCEL_ACK_PREFIX), results, strict=True
    ):
        for bad in (0, 1 << 63, -1, "7", True):
            with pytest.raises(WireError, match="'a'"):
                wire.decode_notification(with_body(prefix, {**body(message, prefix), "a": bad}))
    for bad in (0, 1 << 63):
        with pytest.raises(WireError, match="'a'"):
            wire.decode_notification(
                with_body(
                    wire.PUSH_REG_PREFIX, {**body(wire.encode_push_reg(reg), wire.PUSH_REG_PREFIX), "a": bad}
                )
            )
