"""A late refusal of an earlier HELLO is not taken for the answer to D's current one.

P answers a D rank's ``HELLO`` with ``FAIL (hello)`` when it refuses that rank's handshake
metadata (docs/handshake.md, "When P refuses D's metadata, D hears why"). D takes such a FAIL
from a producer agent whose HELLO is unanswered as the answer to its HELLO. A FAIL held in the
network (an outage) can arrive after D gave that HELLO up (its bound) and greeted the engine
afresh after the heal, with the same P agent: D then failed the engine and the requests
waiting for it with P's old reason, although P had since loaded D and answered (found by a
random search of the heal oracle, tests/test_core_heal_liveness.py, about 1 run in 1,500).

Finding 1 (the wire change): every HELLO attempt carries an id (``h``), each resend of it the
same one, and P's ``FAIL (hello)`` echoes the id of the HELLO it answers; D takes it only when
the echo names its current HELLO. A FAIL naming an older one is dropped and counted
(``late_refusals``, logged at debug). A FAIL without the echo (a P of an earlier release) is
taken as before.

Both cores are driven directly; every message D and P exchange is the bytes one core's Send
carries, decoded as the other side's driver does.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Release, Report, Send
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.errors import WireError
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.types import (
    NotificationKind,
    PushRegistration,
    RankKey,
    ReadSpec,
    RequestMetadata,
    TransferParams,
)

P0 = RankKey(0, 0)
P_AGENT, D_AGENT = "P-prefill-pp0-tp0", "D-decode-pp0-tp0"
WHY = "engine 'D' rank (pp=0, tp=0) is not compatible: - regions do not tile; run the same layout"
HELLO_S = 5.0


def _note(message: bytes) -> Any:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _sends(actions: list[Any], kind: NotificationKind) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and _note(a.message).kind is kind]


def _reports(actions: list[Any]) -> list[tuple[str, str, str]]:
    return [(a.request_id, a.outcome, a.reason) for a in actions if isinstance(a, Report)]


def _decode() -> DecodeCore:
    return DecodeCore(
        DecodeSettings(
            engine_id="D",
            incarnation="d1",
            tp_rank=0,
            tp_size=1,
            host="127.0.0.1",
            port=5601,
            hello_timeout_s=HELLO_S,
            heartbeat_interval_s=0.5,
            peer_silence_s=2.0,
            fresh_s=1.0,
            retry_backoff_s=1.0,
        )
    )


def _prefill() -> PrefillCore:
    def plan(blocks: Any, reg: PushRegistration) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    return PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)


def _info() -> ProducerInfo:
    return ProducerInfo(
        prefill_pp=1, prefill_tp=1, agents={P0: P_AGENT}, incarnations={P_AGENT: "p1"}, write_deadline_s=1.0
    )


def _request(rid: str, key: str) -> RequestMetadata:
    params = {"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(request_id=rid, block_ids=((1,),), params=TransferParams.from_dict(params))


def _greet(d: DecodeCore, rid: str, key: str, now: float) -> Send:
    """D adds a request for P, its notif-only handshake succeeds: the HELLO it sends P."""
    assert any(isinstance(a, Connect) for a in d.add(_request(rid, key), now)), "no handshake started"
    (hello,) = _sends(d.connected("P", _info(), "", now + 0.01), NotificationKind.HELLO)
    assert hello.agent == P_AGENT
    return hello


def _refusal_of_first_hello() -> tuple[DecodeCore, PrefillCore, bytes]:
    """D greets P (HELLO h1); P refuses D's metadata and answers FAIL (hello): held in the
    network. D's HELLO bound fails d-1 (P did not answer)."""
    d, p = _decode(), _prefill()
    h1 = _greet(d, "d-1", "x-1", 0.0)
    assert any(isinstance(a, Connect) for a in p.notification(D_AGENT, _note(h1.message), 0.1))
    (refusal,) = _sends(p.connected("D", 0, D_AGENT, "d1", 0, WHY, 0.2), NotificationKind.FAILED)
    assert refusal.agent == D_AGENT and _note(refusal.message).request_id == "(hello)"
    timed_out = _reports(d.handle_timer(0.01 + HELLO_S + 0.01))
    assert [(rid, outcome) for rid, outcome, _ in timed_out] == [("d-1", "failed")]
    assert "did not answer this rank's HELLO" in timed_out[0][2]
    return d, p, refusal.message


def test_a_late_refusal_of_an_earlier_hello_does_not_fail_the_current_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d, p, late = _refusal_of_first_hello()
    # The heal: past D's backoff a new request greets P again (HELLO h2); P, past its own
    # backoff, loads D and answers with its stamp.
    now = 8.0
    h2 = _greet(d, "d-2", "x-2", now)
    loaded = p.notification(D_AGENT, _note(h2.message), now + 0.1)
    assert any(isinstance(a, Connect) for a in loaded)
    (answer,) = _sends(p.connected("D", 0, D_AGENT, "d1", 1, "", now + 0.2), NotificationKind.HEARTBEAT)
    # The refusal of h1, held in the network, arrives first.
    rejected = d.stats["rejected_notifications"]
    with caplog.at_level(logging.DEBUG, logger="kvpush.core.decode_core"):
        actions = d.notification(P_AGENT, _note(late), now + 0.3)
    assert _reports(actions) == [], f"d-2 failed with P's old reason: {_reports(actions)}"
    assert not any(isinstance(a, Release) for a in actions)
    assert d.holds("d-2")
    assert d.stats["late_refusals"] == 1
    assert d.stats["rejected_notifications"] == rejected  # dropped quietly: no warning
    assert any(r.levelno == logging.DEBUG and "HELLO" in r.getMessage() for r in caplog.records)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    # P's answer to h2 then readies the engine: d-2 registers with P.
    ready = d.notification(P_AGENT, _note(answer.message), now + 0.4)
    (reg,) = _sends(ready, NotificationKind.PUSH_REG)
    assert reg.agent == P_AGENT and _note(reg.message).request_id == "d-2"


def test_a_refusal_of_the_current_hello_still_fails_its_requests_with_ps_reason() -> None:
    """The echo names the HELLO D is waiting on (resent meanwhile: the same attempt): taken."""
    d, p = _decode(), _prefill()
    h1 = _greet(d, "d-1", "x-1", 0.0)
    resent = _sends(d.handle_timer(1.3), NotificationKind.HELLO)  # a resend of the same HELLO
    assert [s.message for s in resent] == [h1.message]
    p.notification(D_AGENT, _note(resent[0].message), 1.4)
    (refusal,) = _sends(p.connected("D", 0, D_AGENT, "d1", 0, WHY, 1.5), NotificationKind.FAILED)
    actions = d.notification(P_AGENT, _note(refusal.message), 1.6)
    reports = _reports(actions)
    assert [(rid, outcome) for rid, outcome, _ in reports] == [("d-1", "failed")]
    assert WHY in reports[0][2]
    assert any(isinstance(a, Release) and a.request_id == "d-1" for a in actions)
    assert d.stats.get("late_refusals", 0) == 0


def test_a_refusal_without_an_echo_keeps_todays_behaviour() -> None:
    """A P of an earlier release does not echo the HELLO: its FAIL (hello) answers whatever
    HELLO D is waiting on, late or not (the residual stays with such a P)."""
    d, _, _ = _refusal_of_first_hello()
    _greet(d, "d-2", "x-2", 8.0)
    old_p = wire.encode_failed("(hello)", P0, "P refused: " + WHY, unsettled=False, incarnation="p1")
    assert "h" not in wire.unpack(old_p[len(wire.FAIL_PREFIX) :], "FAIL")
    reports = _reports(d.notification(P_AGENT, _note(old_p), 8.3))
    assert [(rid, outcome) for rid, outcome, _ in reports] == [("d-2", "failed")]
    assert WHY in reports[0][2]


def test_each_hello_attempt_has_its_own_id_and_ps_refusal_echoes_it() -> None:
    d, _, late = _refusal_of_first_hello()
    h2 = _greet(d, "d-2", "x-2", 8.0)
    first = _note(late).hello_id
    second = _note(h2.message).hello_id
    assert isinstance(first, int) and isinstance(second, int) and second > first
    # P refuses h2; a delayed copy of h1 that reached P while its handshake ran does not
    # change what the refusal echoes (D's ids only grow within an incarnation).
    p2 = _prefill()
    assert any(isinstance(a, Connect) for a in p2.notification(D_AGENT, _note(h2.message), 8.1))
    assert p2.notification(D_AGENT, _note(_hello_with_id(first)), 8.15) == []
    (refusal,) = _sends(p2.connected("D", 0, D_AGENT, "d1", 0, WHY, 8.2), NotificationKind.FAILED)
    assert _note(refusal.message).hello_id == second
    # In P's backoff, a HELLO is answered at once, echoing that HELLO's own id.
    (again,) = _sends(p2.notification(D_AGENT, _note(_hello_with_id(first)), 8.3), NotificationKind.FAILED)
    assert _note(again.message).hello_id == first
    # D drops that one (it names an earlier HELLO than the one D waits on) and takes the
    # refusal of h2.
    assert _reports(d.notification(P_AGENT, _note(again.message), 8.4)) == []
    assert d.stats["late_refusals"] == 1 and d.holds("d-2")
    reports = _reports(d.notification(P_AGENT, _note(refusal.message), 8.5))
    assert [(rid, outcome) for rid, outcome, _ in reports] == [("d-2", "failed")]
    assert WHY in reports[0][2]


def _hello_with_id(hello_id: int) -> bytes:
    reg = PushRegistration(
        request_id="(hello)",
        match_key="(none)",
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=5601,
        decode_tp_size=1,
        block_ids=(),
        remote_engine_id="(any)",
        decode_incarnation="d1",
        fresh_s=1.0,
    )
    return wire.encode_hello(reg, 0, hello_id=hello_id)


@pytest.mark.parametrize("value", [0, -1, 1 << 63, "1", 1.5, True, [1]])
def test_the_hello_id_and_its_echo_are_checked_when_decoded(value: object) -> None:
    for prefix, body in (
        (wire.HELLO_PREFIX, wire.unpack(_hello_with_id(7)[len(wire.HELLO_PREFIX) :], "HELLO")),
        (wire.FAIL_PREFIX, {"request_id": "(hello)", "pp": 0, "tp": 0, "reason": "r", "h": 7}),
    ):
        body = {**body, "v": list(wire.NOTIF_VERSION), "h": value}
        with pytest.raises(WireError, match="'h'"):
            wire.decode_notification(prefix + wire.pack(body))
    # In range, both round-trip; absent is None (not stated).
    assert _note(_hello_with_id(wire.MAX_HELLO_ID)).hello_id == wire.MAX_HELLO_ID
    echo = wire.encode_failed("(hello)", P0, "r", False, "p1", hello_id=3)
    assert _note(echo).hello_id == 3
    assert _note(wire.encode_failed("(hello)", P0, "r", False, "p1")).hello_id is None
