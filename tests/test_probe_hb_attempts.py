"""Probe of 2026-12-03: heartbeat answers name keys, not registration attempts.

Since notification format 2.7 every DONE, FAIL and CANCEL_ACK names the registration attempt it
answers and D counts it only for the live attempt. P's heartbeat answer named keys only: its
``failed`` (and ``want``, ``unknown``) entries acted on whatever request of the key D held when
the answer arrived. An answer about an earlier request of the key, arriving after D registered
the next one (delayed behind it, or replayed under the MAC), acted on the next one:

- ``failed``: D failed the new request when the answer's stamp was newer than its grant
  (the grant rule tells registrations apart only by the order of P's clock: a stamp issued
  before the answer, reaching D after the key ended, is the new request's grant), and P, which
  had marked every registration older than its answer as ended (``told``), failed the new
  request's PUSH_REG too: an honest, delayed answer failed a request P never spoke of.
- ``unknown``: two of them struck the new request out ("its PUSH_REG was lost").
- ``want``: D sent the new request's PUSH_REG again (no harm to safety: D holds that request,
  and a PUSH_REG is judged by P as any; a message per request of the key).

Fixed (notification format 2.8): D's heartbeat names the attempt of each key it asks about
(``ra``); P's answer names one per entry (``wa``, ``fa``, ``ua``), and states
``answer_attempts`` in its handshake; D acts on an entry only for the attempt it names (refusing
entries naming none from a P that states it) and P marks as ended only the attempts it named.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from test_handshake_refusal import P0, P_AGENT, _decode, _info, _request
from test_protocol_safety import _prefill_core as _prefill
from test_protocol_safety import _registration

from kvpush.core import notifications as wire
from kvpush.core.actions import Report, Send
from kvpush.core.types import NotificationKind

D_AGENT = "D-decode-pp0-tp0"


def _decoded(message: bytes) -> Any:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _sent(actions: list[Any]) -> list[Any]:
    return [_decoded(a.message) for a in actions if isinstance(a, Send)]


def _reports(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.request_id, a.outcome) for a in actions if isinstance(a, Report)]


def _push_regs(actions: list[Any]) -> list[Any]:
    return [n.registration for n in _sent(actions) if n.kind is NotificationKind.PUSH_REG]


def _answer(stamp: float, **entries: Any) -> Any:
    return _decoded(wire.encode_heartbeat_answer(P0, stamp, "p1", **entries))


# ---------------------------------------------------------------------------------------------
# D: an answer acts only on the attempt it names
# ---------------------------------------------------------------------------------------------


def _next_request_registered(*, binds: bool = True) -> tuple[Any, int, int]:
    """r (key x-1, attempt a1) registered, then failed by P's FAIL; n of the same key asks a
    fresh stamp (the key ended here) and registers (attempt a2) with a stamp P issued at 3.0,
    before it answered an earlier heartbeat (naming r) at 5.0. ``binds``: P states
    ``answer_attempts``. Returns the core and both attempts."""
    core = _decode()
    info = attrs.evolve(_info(), echo_attempts=frozenset({P_AGENT}))
    if binds:
        info = attrs.evolve(info, answer_attempts=frozenset({P_AGENT}))
    core.add(_request("r", "x-1"), 0.0)
    core.connected("P", info, "", 0.01)
    (reg,) = _push_regs(core.notification(P_AGENT, _answer(0.02), 0.02))
    first = reg.attempt
    fail = wire.encode_failed("r", P0, "prefill failed", unsettled=False, incarnation="p1", attempt=first)
    assert ("r", "failed") in _reports(core.notification(P_AGENT, _decoded(fail), 0.1))
    asked = core.add(_request("n", "x-1"), 1.0)
    assert [n.kind for n in _sent(asked)] == [NotificationKind.HEARTBEAT], "a fresh stamp is asked"
    (reg,) = _push_regs(core.notification(P_AGENT, _answer(3.0), 1.1))
    assert reg.request_id == "n" and reg.grant == 3.0 and reg.attempt != first
    return core, first, reg.attempt


def test_a_late_failed_answer_about_the_earlier_request_of_the_key_does_not_fail_the_next() -> None:
    """P's answer (stamped 5.0) said x-1 failed, speaking of r's attempt; it reaches D after n
    registered with an older grant (3.0). It named r's attempt: n goes on. Nor does an entry
    naming no attempt from a P that states ``answer_attempts``. An answer naming n's attempt
    fails n."""
    core, first, second = _next_request_registered()
    late = _answer(5.0, failed=["x-1"], failed_attempts=[first])
    assert _reports(core.notification(P_AGENT, late, 1.2)) == [], "an answer about r failed n"
    keys_only = _answer(5.1, failed=["x-1"])
    assert _reports(core.notification(P_AGENT, keys_only, 1.3)) == [], "an entry naming no attempt counted"
    about_n = _answer(5.2, failed=["x-1"], failed_attempts=[second], settled=["x-1"])
    assert _reports(core.notification(P_AGENT, about_n, 1.4)) == [("n", "failed")]


def test_a_p_that_does_not_state_answer_attempts_is_judged_as_before() -> None:
    """From a P of 2.7 or earlier, an answer's keys act on every registration older than it."""
    core, _, _ = _next_request_registered(binds=False)
    late = _answer(5.0, failed=["x-1"])
    assert _reports(core.notification(P_AGENT, late, 1.2)) == [("n", "failed")]


def test_a_late_unknown_answer_about_the_earlier_request_of_the_key_strikes_nothing() -> None:
    """Two answers saying P never heard of x-1, speaking of r's attempt (D asked while r's
    PUSH_REG was on its way), reaching D after n registered, do not strike n out."""
    core, first, second = _next_request_registered()
    for at in (1.2, 1.8):
        late = _answer(at + 4.0, unknown=["x-1"], unknown_attempts=[first])
        assert _reports(core.notification(P_AGENT, late, at)) == [], "answers about r struck n out"
    for at in (2.4, 3.0):
        out = core.notification(P_AGENT, _answer(at + 4.0, unknown=["x-1"], unknown_attempts=[second]), at)
    assert _reports(out) == [("n", "failed")]


def test_a_late_want_about_the_earlier_request_of_the_key_sends_no_push_reg() -> None:
    """A want naming r's attempt does not make D send n's PUSH_REG again; one naming n's does."""
    core, first, second = _next_request_registered()
    assert (
        _push_regs(core.notification(P_AGENT, _answer(5.0, want=["x-1"], want_attempts=[first]), 1.2)) == []
    )
    assert _push_regs(core.notification(P_AGENT, _answer(5.1, want=["x-1"]), 1.3)) == []
    (renewed,) = _push_regs(
        core.notification(P_AGENT, _answer(5.2, want=["x-1"], want_attempts=[second]), 1.4)
    )
    assert renewed.request_id == "n" and renewed.attempt == second and renewed.grant == 5.2


@pytest.mark.parametrize("binds", [True, False])
def test_d_names_the_attempt_of_each_key_its_heartbeat_asks_a_p_stating_answer_attempts(binds: bool) -> None:
    """To a P that does not state ``answer_attempts`` D names none: that P ends every
    registration of the key older than its ``failed`` answer, as D then does."""
    core, _, second = _next_request_registered(binds=binds)
    heartbeats = [
        n for n in _sent(core.handle_timer(1.6)) if n.kind is NotificationKind.HEARTBEAT and n.request_ids
    ]
    named = (second,) if binds else None
    assert [(h.request_ids, h.request_attempts) for h in heartbeats] == [(("x-1",), named)]


# ---------------------------------------------------------------------------------------------
# P: an answer names the attempt D asked about, and ends only that one
# ---------------------------------------------------------------------------------------------


def _failed_key(core: Any) -> None:
    """D request d-1 (key x-1, attempt 11) registered with P core ``core``, whose prefill of
    the key then failed: the key's tombstone says failed."""
    reg = _registration(request_id="d-1", attempt=11, grant=98.0)
    core.notification(D_AGENT, _decoded(wire.encode_push_reg(reg)), 99.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 99.1)
    core.finished("x-1", "p-1", ((7,),), "D", 100.1)
    core.fail("x-1", "prefill failed", 100.2)


def _heartbeat(keys: list[str], attempts: list[int] | None) -> Any:
    reg = _registration(request_id="(heartbeat)", match_key="(heartbeat)", block_ids=())
    return _decoded(wire.encode_heartbeat(keys, reg, 0, attempts=attempts))


def test_p_names_in_its_answer_the_attempt_d_asked_about_and_ends_only_that_one() -> None:
    """D asks about x-1 naming attempt 11 (d-1): P answers failed naming 11. D's next request
    of the key, d-2 (attempt 12), registers with a stamp P issued (100.5) before that answer
    (101.0): P takes it (a new attempt); before, P took every registration older than its
    answer for the ended attempt's and failed it. Asked about attempt 13 (d-3) before its
    PUSH_REG arrives, P answers failed naming 13 and refuses d-3's PUSH_REG when it comes."""
    core = _prefill()
    _failed_key(core)
    (answer,) = _sent(core.notification(D_AGENT, _heartbeat(["x-1"], [11]), 101.0))
    assert (answer.failed_keys, answer.failed_attempts) == (("x-1",), (11,))
    retry = _registration(request_id="d-2", attempt=12, grant=100.5)
    out = core.notification(D_AGENT, _decoded(wire.encode_push_reg(retry)), 101.1)
    assert not [n for n in _sent(out) if n.kind is NotificationKind.FAILED], (
        "P failed a request it never spoke of"
    )
    core.fail("x-1", "prefill failed again", 101.2)
    (answer,) = _sent(core.notification(D_AGENT, _heartbeat(["x-1"], [13]), 102.0))
    assert (answer.failed_keys, answer.failed_attempts) == (("x-1",), (13,))
    late = _registration(request_id="d-3", attempt=13, grant=101.5)
    fails = _sent(core.notification(D_AGENT, _decoded(wire.encode_push_reg(late)), 102.1))
    assert [(n.kind, n.request_id, n.attempt) for n in fails] == [(NotificationKind.FAILED, "d-3", 13)]


def test_p_answering_a_d_that_names_no_attempt_ends_every_older_registration_as_before() -> None:
    """A 2.7 D names keys only, and fails every registration of the key older than P's answer:
    P refuses those (``told``) as before."""
    core = _prefill()
    _failed_key(core)
    (answer,) = _sent(core.notification(D_AGENT, _heartbeat(["x-1"], None), 101.0))
    assert answer.failed_keys == ("x-1",) and answer.failed_attempts == (None,)
    retry = _registration(request_id="d-2", attempt=12, grant=100.5)
    out = _sent(core.notification(D_AGENT, _decoded(wire.encode_push_reg(retry)), 101.1))
    assert [(n.kind, n.request_id) for n in out] == [(NotificationKind.FAILED, "d-2")]


@pytest.mark.parametrize("entries", ["want", "failed", "unknown"])
def test_answer_attempts_round_trip_and_are_range_checked(entries: str) -> None:
    message = wire.encode_heartbeat_answer(
        P0, 1.0, "p1", **{entries: ["a", "b"], f"{entries}_attempts": [3, None]}
    )
    note = _decoded(message)
    field = {"want": "want_attempts", "failed": "failed_attempts", "unknown": "unknown_attempts"}[entries]
    assert getattr(note, field) == (3, None)
    short = wire.encode_heartbeat_answer(P0, 1.0, "p1", **{entries: ["a", "b"]})
    assert getattr(_decoded(short), field) is None  # not stated
    from kvpush.core.errors import WireError
    from kvpush.core.wire import pack

    body = wire._unpackb(message[len(wire.HEARTBEAT_PREFIX) :], raw=False)
    for bad in ([3], [0, 1], [True, 1], [1.0, 1], "x"):
        body[{"want": "wa", "failed": "fa", "unknown": "ua"}[entries]] = bad
        with pytest.raises(WireError):
            wire.decode_notification(wire.HEARTBEAT_PREFIX + pack(body))


def test_p_asks_a_fresh_grant_naming_the_attempt_of_the_registration_it_holds() -> None:
    """A registration whose grant is not fresh waits for one: P's ``want`` names its attempt (D
    renews that request only, not a later one of the key)."""
    core = _prefill()
    reg = _registration(request_id="d-1", attempt=11, grant=None)
    core.notification(D_AGENT, _decoded(wire.encode_push_reg(reg)), 99.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 99.1)
    wants = [n for n in _sent(core.finished("x-1", "p-1", ((7,),), "D", 100.0)) if n.want]
    assert [(n.want, n.want_attempts) for n in wants] == [(("x-1",), (11,))]


def test_a_heartbeat_states_one_attempt_per_key_or_none() -> None:
    from kvpush.core.errors import WireError
    from kvpush.core.wire import pack

    reg = _registration(request_id="(heartbeat)", match_key="(heartbeat)", block_ids=())
    with pytest.raises(ValueError, match="one attempt"):
        wire.encode_heartbeat(["a", "b"], reg, 0, attempts=[1])
    message = wire.encode_heartbeat(["a", "b"], reg, 0, attempts=[1, None])
    assert _decoded(message).request_attempts == (1, None)
    body = wire._unpackb(message[len(wire.HEARTBEAT_PREFIX) :], raw=False)
    for bad in ([1], [1, 1 << 63], [1, -1], {"a": 1}):
        body["ra"] = bad
        with pytest.raises(WireError, match="'ra'"):
            wire.decode_notification(wire.HEARTBEAT_PREFIX + pack(body))


def test_a_p_worker_states_answer_attempts_and_d_reads_it_from_the_handshake() -> None:
    """Over the real handshake (NIXL between workers): every P rank of this release states
    ``answer_attempts``, and D's core binds its heartbeat answers to attempts."""
    from cluster import Cluster

    with Cluster() as cluster:
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        receiver = cluster.receivers[0]
        agents = {sender.transport.agent_name for sender in cluster.senders.values()}
        stated = receiver.call_on_writer(lambda: receiver.core._engines["P"].info.answer_attempts)
        assert stated == agents
