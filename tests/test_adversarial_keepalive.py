"""Adversarial review of D's keepalive (a keyless heartbeat to idle P agents) and of D's silence
check around it: what a keepalive may refresh, whom it goes to, how long, and what an idle
agent's silence may fail.

The cores are driven directly (no transport, no threads, an injected clock); the end-to-end
form of the silence finding runs over real NIXL agents (:class:`cluster.Cluster`).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from cluster import Cluster, wait_until

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, DropPeer, Fence, Post, Report, Send
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.types import (
    Notification,
    PushRegistration,
    RankKey,
    ReadSpec,
    RequestMetadata,
    TransferParams,
)

P0 = RankKey(0, 0)
P_AGENT = "P-prefill-pp0-tp0"
D_AGENT = "D-decode-pp0-tp0"
HEARTBEAT_S, FRESH_S, SILENCE_S, KEEPALIVE_S = 5.0, 10.0, 20.0, 600.0


def _decode(**overrides: Any) -> DecodeCore:
    fields: dict[str, Any] = {
        "engine_id": "D",
        "incarnation": "d1",
        "tp_rank": 0,
        "tp_size": 1,
        "host": "d.example",
        "port": 5700,
        "heartbeat_interval_s": HEARTBEAT_S,
        "fresh_s": FRESH_S,
        "peer_silence_s": SILENCE_S,
        "keepalive_s": KEEPALIVE_S,
    }
    return DecodeCore(DecodeSettings(**{**fields, **overrides}))


def _info(incarnation: str = "p1") -> ProducerInfo:
    return ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={P0: P_AGENT},
        incarnations={P_AGENT: incarnation},
        write_deadline_s=10.0,
    )


def _meta(rid: str, key: str) -> RequestMetadata:
    params = {"remote_engine_id": "P", "remote_host": "p.example", "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(request_id=rid, block_ids=((1,),), params=TransferParams.from_dict(params))


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _answer(stamp: float, incarnation: str = "p1") -> Notification:
    return _note(wire.encode_heartbeat_answer(P0, stamp, incarnation))


def _sent(actions: list[Any]) -> list[Notification]:
    return [_note(a.message) for a in actions if isinstance(a, Send)]


def _reports(actions: list[Any]) -> list[Report]:
    return [a for a in actions if isinstance(a, Report)]


def _ready_decode_after_one_request(**overrides: Any) -> DecodeCore:
    """D with P's engine ready; request r1 (key k1) registered at t=0 and done at t=0.1."""
    d = _decode(**overrides)
    d.add(_meta("r1", "k1"), 0.0)
    assert [n.kind.value for n in _sent(d.connected("P", _info(), "", 0.0))] == ["hello"]
    assert [n.kind.value for n in _sent(d.notification(P_AGENT, _answer(0.0), 0.0))] == ["push_reg"]
    done = d.notification(P_AGENT, _note(wire.encode_done("r1", P0, 1)), 0.1)
    assert [r.outcome for r in _reports(done)] == ["done"]
    return d


def _idle(d: DecodeCore, until: float, t: float = 0.1, answer_until: float = -1.0) -> float:
    """Run D's timers every heartbeat interval until ``until``; P answers what D sends until
    ``answer_until`` (after that P is silent: its answers are lost, or it stopped answering)."""
    while t + HEARTBEAT_S <= until:
        t += HEARTBEAT_S
        for note in _sent(d.handle_timer(t)):
            assert note.kind.value == "heartbeat" and not note.request_ids, note
            if t <= answer_until:
                d.notification(P_AGENT, _answer(t), t)
    return t


# ------------------------------------------------------------------ finding: idle silence


@pytest.mark.parametrize(
    ("keepalive_s", "answer_until", "idle_until"),
    [
        (0.0, -1.0, 100.0),  # no keepalive: nothing was asked of P while D was idle
        (KEEPALIVE_S, KEEPALIVE_S, 1000.0),  # keepalives ended after keepalive_s; P answered all
        (KEEPALIVE_S, 30.0, 200.0),  # P stopped answering keepalives: handshaken afresh
    ],
    ids=["keepalive-off", "past-keepalive", "keepalives-unanswered"],
)
def test_a_request_after_an_idle_pause_is_not_failed_for_the_silence_before_it(
    keepalive_s: float, answer_until: float, idle_until: float
) -> None:
    """D used to measure an agent's silence from the last thing it heard, even across a pause
    in which it asked that agent nothing (or only keepalives, which "fail nothing"): the first
    heartbeat after the next registration declared P dead ("answered no heartbeat for 20s")
    and failed the request, before P had been asked anything about it (its prefill still
    running, so P sends nothing yet). The silence now counts from D's first heartbeat that
    names a key; a P that stays silent after that is still declared dead, one window later."""
    d = _ready_decode_after_one_request(keepalive_s=keepalive_s)
    t = _idle(d, idle_until, answer_until=answer_until)
    assert not d._requests
    added = d.add(_meta("r2", "k2"), t)
    if 0 < answer_until < keepalive_s:
        # Its keepalives went unanswered for longer than peer_silence_s: P may have restarted
        # under its agents' names, so D handshakes afresh (tests/test_probe_restart_liveness.py);
        # nothing fails, the request waits for it.
        assert [type(a) for a in added] == [DropPeer, Connect] and not _reports(added)
        assert [n.kind.value for n in _sent(d.connected("P", _info(), "", t))] == ["hello"]
        added = d.notification(P_AGENT, _answer(t), t)
    assert [n.kind.value for n in _sent(added)] == ["push_reg"]
    first = d.handle_timer(t + HEARTBEAT_S)
    assert not _reports(first), f"r2 failed for the silence before it: {_reports(first)}"
    assert [n.request_ids for n in _sent(first)] == [("k2",)]  # P is asked about k2 now
    # P answers within the window: r2 lives on.
    d.notification(P_AGENT, _answer(t + HEARTBEAT_S + 1.0), t + HEARTBEAT_S + 1.0)
    assert not _reports(d.handle_timer(t + 2 * HEARTBEAT_S))
    # From here P is silent: it is declared dead once SILENCE_S passed since it was last heard.
    failed: list[Report] = []
    now = t + 2 * HEARTBEAT_S
    while not failed and now < t + 10 * SILENCE_S:
        now += HEARTBEAT_S
        failed = _reports(d.handle_timer(now))
    assert [r.outcome for r in failed] == ["failed"] and "answered no heartbeat" in failed[0].reason
    assert now - (t + HEARTBEAT_S + 1.0) <= SILENCE_S + HEARTBEAT_S


def test_a_dead_agent_is_still_declared_dead_under_steady_traffic() -> None:
    """The silence clock restarts only when an agent had nothing to answer for: a P that dies
    while requests keep registering is declared dead one window after its last answer."""
    d = _ready_decode_after_one_request(keepalive_s=0.0)
    d.add(_meta("r2", "k2"), 1.0)
    t, n, failed = 1.0, 3, []
    while not failed and t < 200.0:
        t += 1.0
        d.add(_meta(f"r{n}", f"k{n}"), t)  # one request a second, P never answers
        n += 1
        failed = _reports(d.handle_timer(t))
    assert failed and all("answered no heartbeat" in r.reason for r in failed)
    assert t <= 0.1 + HEARTBEAT_S + SILENCE_S + HEARTBEAT_S


def test_a_prefill_slower_than_a_heartbeat_after_an_idle_pause_is_still_pushed() -> None:
    """End to end over NIXL: D idles past P's silence bound (keepalive off), then a request
    registers whose prefill finishes after D's next heartbeat. D used to fail it ("P agent ...
    answered no heartbeat for 0.8s") as soon as that heartbeat went out; P answers it (it holds
    the registration) and the push completes."""
    with Cluster(
        transport="nixl",
        heartbeat_interval_s=0.2,
        fresh_s=0.4,
        peer_silence_s=0.8,
        keepalive_s=0,
        request_timeout_s=30,
    ) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        time.sleep(1.5)  # idle: nothing asked of P, nothing heard from it
        sent = receiver.stats["heartbeats_sent"]
        cluster.add("d-2", [[4]], "x-2")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, 5, "D's PUSH_REG of x-2")
        time.sleep(0.6)  # the prefill runs through D's next heartbeats (three intervals)
        cluster.finish("p-2", [[6]], "x-2")
        assert cluster.wait_decode("d-2") == {0: None}
        assert cluster.wait_prefill("p-2") == {P0: None}
        assert receiver.stats["heartbeats_sent"] > sent  # P was asked about x-2 meanwhile
        assert receiver.stats["dead_peers"] == 0


# ------------------------------------------------------------------ probes found sound


def test_keepalives_are_bounded_and_go_only_to_agents_of_a_ready_engine() -> None:
    d = _ready_decode_after_one_request()
    t = _idle(d, KEEPALIVE_S + 100.0, answer_until=KEEPALIVE_S + 100.0)
    # one every other heartbeat (a stamp is renewed once half the window old), then none
    assert d.stats["keepalives_sent"] <= KEEPALIVE_S / (FRESH_S / 2) + 1
    assert d.next_deadline() is None, "the heartbeat timer keeps running after keepalive_s"
    # Fenced: the engine reconnects; nothing goes to its agents until the handshake is done.
    d = _ready_decode_after_one_request()
    d.add(_meta("r2", "k2"), 1.0)
    d.cancel("r2", 1.0)  # the CANCEL is lost: the quarantine ends in a fence and a reconnect
    t, fenced = 1.0, False
    while not fenced:
        t += HEARTBEAT_S
        actions = d.handle_timer(t)
        fenced = any(isinstance(a, Fence) for a in actions)
        assert not fenced or not _sent(actions), "a keepalive went out next to the fence"
    for _ in range(4):
        t += HEARTBEAT_S
        assert not _sent(d.handle_timer(t)), "a message went to a fenced engine's agents"


def test_a_keepalive_answer_from_a_new_p_incarnation_fails_the_engine_not_refreshes_it() -> None:
    d = _ready_decode_after_one_request()
    t = _idle(d, 20.0, answer_until=20.0)
    actions = d.notification(P_AGENT, _answer(t, incarnation="p2"), t)  # P restarted, same name
    assert any(isinstance(a, DropPeer) for a in actions)
    engine = d._engines["P"]
    assert engine.state.value == "failed" and not engine.stamps
    assert not _sent(d.handle_timer(t + 3 * HEARTBEAT_S)), "keepalive to a restarted P's old agent"
    # A late answer of the replaced start is dropped, not taken as a grant.
    d2 = _ready_decode_after_one_request()
    d2._engines["P"].info = _info("p3")
    before = dict(d2._engines["P"].stamps)
    d2.notification(P_AGENT, _answer(50.0, incarnation="p1"), 50.0)
    assert d2._engines["P"].stamps == before and d2.stats["rejected_notifications"] == 1


def _prefill() -> PrefillCore:
    def plan(blocks: Any, reg: PushRegistration) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    return PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)


def _reg(**overrides: Any) -> PushRegistration:
    fields: dict[str, Any] = {
        "request_id": "r1",
        "match_key": "k1",
        "decode_engine_id": "D",
        "decode_host": "d.example",
        "decode_port": 5700,
        "decode_tp_size": 1,
        "block_ids": [[3]],
        "remote_engine_id": "P",
        "decode_incarnation": "d1",
        "grant": 100.0,
        "fresh_s": FRESH_S,
    }
    return PushRegistration(**{**fields, **overrides})


def _keepalive(grant: float | None, **overrides: Any) -> Notification:
    reg = _reg(request_id="(keepalive)", match_key="(none)", block_ids=(), grant=grant, **overrides)
    return _note(wire.encode_heartbeat([], reg, 0))


def test_a_keepalive_grant_renews_no_registration_on_p() -> None:
    """A keepalive names no key: its grant must not make a stale registration postable (only a
    heartbeat naming the key, or a PUSH_REG, may); P answers it with a stamp and nothing else."""
    p = _prefill()
    p.notification(D_AGENT, _note(wire.encode_hello(_reg(), 0)), 100.0)
    p.connected("D", 0, D_AGENT, "d1", 1, "", 100.0)
    p.finished("k1", "p-1", ((5,),), "", 120.0)
    stale = p.notification(D_AGENT, _note(wire.encode_push_reg(_reg(grant=100.0))), 120.0)
    assert not any(isinstance(a, Post) for a in stale) and p.stats["stale_registrations"] == 1
    actions = p.notification(D_AGENT, _keepalive(grant=119.9), 120.2)
    assert not any(isinstance(a, Post) for a in actions), "a keyless heartbeat renewed k1"
    (answer,) = _sent(actions)
    assert answer.stamp == 120.2 and not answer.want and not answer.failed_keys and not answer.unknown_keys
    assert p.stats["heartbeat_renewals"] == 0


def test_p_does_not_answer_a_keepalive_it_cannot_attribute() -> None:
    """From an agent P has not loaded for that D rank, from another engine id, or from an older
    D start: dropped unanswered (no stamp for D to echo), counted."""
    p = _prefill()
    p.notification(D_AGENT, _note(wire.encode_hello(_reg(), 0)), 100.0)
    p.connected("D", 0, D_AGENT, "d2", 1, "", 100.0)
    assert not p.notification("mallory", _keepalive(grant=None, decode_incarnation="d2"), 100.0)
    assert not p.notification(D_AGENT, _keepalive(grant=None, decode_engine_id="E"), 100.0)
    assert not p.notification(D_AGENT, _keepalive(grant=None, decode_incarnation="d1"), 100.0)
    assert p.stats["rejected_notifications"] == 3
    assert _sent(p.notification(D_AGENT, _keepalive(grant=None, decode_incarnation="d2"), 100.0))


def test_a_prefill_restarted_under_its_name_while_decode_keeps_it_alive() -> None:
    """Real processes: P's rank is killed and started again under the same agent name while D
    idles and sends keepalives to the old one. Whatever D's keepalives reach (nothing, or a
    send error), the requests after it are either pushed with the right KV or fail naming why,
    and one of them is pushed once D has reloaded P."""
    from rank_engines import Engines

    with Engines(heartbeat_interval_s=0.2, fresh_s=0.4, peer_silence_s=1.0, keepalive_s=60.0) as engines:
        engines.plan("warm", [0], [0])
        engines.add("warm")
        engines.finish("warm")
        engines.wait_decode(["warm"])
        for rank in engines.p_ranks:
            engines.kill(rank)
        engines.p_ranks = engines._start(engines.p_specs, engines.p_server)
        engines.p_results = {r.key: {} for r in engines.p_ranks}
        time.sleep(1.0)  # keepalives go to the dead start's agent
        outcomes: list[tuple[str, Any]] = []
        for n in range(8):
            rid = f"after-{n}"
            engines.plan(rid, [10 + n], [10 + n])
            engines.add(rid)
            engines.finish(rid)
            engines.wait_decode([rid], timeout_s=20)
            kind, result = engines.decode_outcome(rid)[RankKey(0, 0)]
            outcomes.append((kind, result))
            if kind == "done":
                break
            assert kind == "failed" and isinstance(result, str) and result, result
            time.sleep(1.0)  # past D's retry backoff
        kind, result = outcomes[-1]
        assert kind == "done" and result["ok"], outcomes
        for health in engines.health(engines.d_ranks):
            assert health["stats"]["keepalives_sent"] >= 1


def test_a_late_older_answer_does_not_pass_for_a_fresh_stamp() -> None:
    """``stamped`` says when the newest stamp arrived: a delayed (or duplicated) older answer
    arriving later used to move it, so D skipped the keepalives while the grant it echoes aged
    (the next registration then stale: a want round trip)."""
    d = _ready_decode_after_one_request()
    d.notification(P_AGENT, _answer(1000.0), 1.0)  # P's newest stamp (P's clock)
    d.notification(P_AGENT, _answer(990.0), 4.0)  # an older answer, delayed
    assert d._engines["P"].stamps[P_AGENT] == 1000.0
    keepalives = [n for n in _sent(d.handle_timer(1.0 + FRESH_S / 2 + 0.1)) if not n.request_ids]
    assert keepalives, "the newest stamp is half a window old: a keepalive is due"


def test_an_idle_grant_is_kept_within_half_the_window() -> None:
    """A stamp "renewed once half a window old" was checked only at D's heartbeat ticks, with the
    answer arriving just after the tick: at the next tick the stamp was a hair younger than half
    the window and skipped, so the grant a PUSH_REG echoes aged to a whole window (stale on
    arrival at the end of each cycle, nearly stale for a tenth of it with the defaults). A stamp
    that would pass half the window before the next tick is renewed at this one."""
    d = _ready_decode_after_one_request()
    t, worst = 0.1, 0.0
    while t < 200.0:
        t = round(t + 0.25, 6)
        for note in _sent(d.handle_timer(t)):
            assert not note.request_ids
            d.notification(P_AGENT, _answer(t + 0.0005), t + 0.001)  # P answers at once
        if t > 20.0:
            worst = max(worst, t - d._engines["P"].stamps[P_AGENT])  # the grant's age now
    assert worst <= FRESH_S / 2 + 0.01, f"the grant D would echo reached {worst:.3f}s of {FRESH_S}s"
    assert d.stats["keepalives_sent"] <= 200.0 / HEARTBEAT_S + 1
