"""P refuses D's handshake metadata: D fails its requests promptly with P's reason.

When P's full handshake with a D rank refuses D's metadata (a plugin P runs and D does not, a
geometry or layout P cannot accept, a model that contradicts its hash, regions that do not
tile), D used to fail its requests only at its HELLO bound, with a reason that blamed the
network ("P did not answer this rank's HELLO ..."), and only P's log named the real cause.
P now loads D's agent notify-only even when it refuses, answers the HELLO (or a PUSH_REG) with
a FAIL carrying its reason, and D fails every request waiting on that producer with it, backs
off (no tight retry loop), and handshakes again once restarted (a new incarnation).

Real NIXL agents in this process (P and D workers with their own plugin managers), plus the
pure cores for the adversarial cases (a FAIL-at-handshake from an agent D is not handshaking
with, a refusal while requests are registered).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from cluster import kv_bytes, wait_until
from test_protocol_safety import _registration

import kvpush.transports.loopback
from kvpush import hookimpl
from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Post, Release, Report, Send
from kvpush.core.manager import KvpushPluginManager, get_plugin_manager
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import (
    HandshakeMode,
    ModelSpec,
    NotificationKind,
    ParallelConfig,
    RankKey,
    RequestMetadata,
    TransferParams,
)
from kvpush.core.worker import WorkerConfig
from kvpush.layouts.uniform import allocate_kv_caches

MODEL = ModelSpec(name="refusal", num_layers=2, num_kv_heads=2, head_dim=4, block_size=2)
BROKEN = "test_refusal_broken"
PROBLEM = "D publishes test_refusal_broken; restart the decode engine without the broken plugin"
HANDSHAKE_TIMEOUT_S = 20.0
"""Far above what a prompt refusal takes: a D that only learns of it at its HELLO bound fails
these tests."""


class Broken:
    """On D: publishes a field P refuses (stands for any metadata P cannot accept)."""

    @hookimpl
    def kvpush_metadata_extensions(self, local: Any) -> dict[str, Any]:
        return {BROKEN: True}


class Refuser:
    """On P only: refuses, in its full handshake, a D rank that publishes ``BROKEN``."""

    @hookimpl
    def kvpush_validate_peer(self, local: Any, peer: Any, mode: HandshakeMode) -> list[str]:
        if mode is HandshakeMode.FULL and peer.extensions.get(BROKEN):
            return [PROBLEM]
        return []


def _pm(*plugins: tuple[str, object]) -> KvpushPluginManager:
    return get_plugin_manager(
        load_entrypoints=False, env={}, plugins=[("loopback", kvpush.transports.loopback), *plugins]
    )


class Pair:
    """One P rank and one D rank over real NIXL (each with its own plugin manager); D can be
    closed and started again under the same engine id and port (a new incarnation)."""

    def __init__(self, *, broken: bool = True, **config: Any) -> None:
        self.config = {"handshake_timeout_s": HANDSHAKE_TIMEOUT_S, "request_timeout_s": 60, **config}
        self.p_server, self.d_server = SideChannelServer("P"), SideChannelServer("D")
        parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MODEL.num_layers)
        self.p_caches = allocate_kv_caches(MODEL, parallel, 8)
        for tensor in self.p_caches.values():
            kv_bytes(tensor).copy_(torch.randint(-30_000, 30_000, kv_bytes(tensor).shape, dtype=torch.int16))
        self.sender = PushSender(
            self._config("P", self.p_server.port), self.p_caches, pm=_pm(("refuser", Refuser()))
        )
        self.sender.start()
        self.p_server.publish(parallel.rank, self.sender.handshake_payload())
        self.receiver: PushReceiver | None = None
        self.start_decode(broken=broken)
        self.results: dict[str, str | None] = {}
        self.released: set[str] = set()

    def _config(self, engine: str, port: int) -> WorkerConfig:
        return WorkerConfig(
            engine_id=engine,
            parallel=ParallelConfig(tp_size=1, tp_rank=0, num_layers=MODEL.num_layers),
            model=MODEL,
            transport="nixl",
            side_channel_port=port,
            **self.config,
        )

    def start_decode(self, *, broken: bool) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.d_caches = allocate_kv_caches(MODEL, ParallelConfig(tp_size=1, tp_rank=0, num_layers=2), 8)
        pm = _pm(("broken", Broken())) if broken else _pm()
        self.receiver = PushReceiver(self._config("D", self.d_server.port), self.d_caches, pm=pm)
        self.receiver.start()
        self.d_server.publish(RankKey(0, 0), self.receiver.handshake_payload())

    def add(self, rid: str, blocks: list[int], key: str) -> None:
        params = TransferParams.from_dict(
            {
                "remote_engine_id": "P",
                "remote_host": "127.0.0.1",
                "remote_port": self.p_server.port,
                "transfer_id": key,
            }
        )
        assert self.receiver is not None
        self.receiver.add_request(RequestMetadata(request_id=rid, block_ids=(tuple(blocks),), params=params))

    def wait(self, rid: str, timeout_s: float) -> str | None:
        def ended() -> bool:
            assert self.receiver is not None
            got = self.receiver.get_finished()
            self.results.update({r: None for r in got.done})
            self.results.update(got.failed)
            self.released.update(got.released)
            return rid in self.results

        wait_until(ended, timeout_s, f"D to end {rid}")
        return self.results[rid]

    def close(self) -> None:
        for worker in (self.sender, self.receiver):
            if worker is not None:
                worker.close()
        self.p_server.close()
        self.d_server.close()


@pytest.fixture
def pair() -> Any:
    pair = Pair()
    try:
        yield pair
    finally:
        pair.close()


def test_d_fails_promptly_with_ps_reason_when_p_refuses_its_metadata(pair: Pair) -> None:
    started = time.monotonic()
    pair.add("d-1", [1, 2], "x-1")
    reason = pair.wait("d-1", timeout_s=HANDSHAKE_TIMEOUT_S + 5)
    took = time.monotonic() - started
    assert reason is not None and PROBLEM in reason, reason
    assert "HELLO" not in reason, reason  # not blamed on the network
    assert "refused" in reason, reason
    assert took < 5, f"D learned of P's refusal after {took:.1f}s (its HELLO bound is {HANDSHAKE_TIMEOUT_S}s)"
    wait_until(lambda: pair.wait("d-1", 1) is not None and "d-1" in pair.released, 5, "release")
    assert pair.sender.stats["writes"] == 0


def test_later_requests_fail_at_once_and_d_does_not_retry_in_a_tight_loop(pair: Pair) -> None:
    pair.add("d-1", [1], "x-1")
    assert PROBLEM in (pair.wait("d-1", timeout_s=HANDSHAKE_TIMEOUT_S + 5) or "")
    fetches = pair.d_server.stats()["requests_served"]
    started = time.monotonic()
    for i in range(2, 12):
        pair.add(f"d-{i}", [i % 8], f"x-{i}")
        reason = pair.wait(f"d-{i}", timeout_s=5)
        assert reason is not None and PROBLEM in reason, reason
    assert time.monotonic() - started < 5
    # Within D's backoff no request triggers a new handshake (P fetches D's metadata at most
    # once more, when D's first backoff passed).
    assert pair.d_server.stats()["requests_served"] - fetches <= 2, pair.d_server.stats


def test_a_fixed_and_restarted_decode_handshakes_again(pair: Pair) -> None:
    pair.add("d-1", [1, 2], "x-1")
    assert PROBLEM in (pair.wait("d-1", timeout_s=HANDSHAKE_TIMEOUT_S + 5) or "")
    pair.start_decode(broken=False)  # fixed; a new incarnation under the same name and port
    started = time.monotonic()
    pair.add("d-2", [3, 4], "x-2")
    pair.sender.request_finished("p-2", ((5, 6),), match_key="x-2")
    assert pair.wait("d-2", timeout_s=HANDSHAKE_TIMEOUT_S + 5) is None, pair.results
    assert time.monotonic() - started < 5
    for layer, got in pair.d_caches.items():
        want = kv_bytes(pair.p_caches[layer])[:, [5, 6]]
        assert torch.equal(kv_bytes(got)[:, [3, 4]], want), layer


# ------------------------------------------------------------------------------ the pure cores

P0 = RankKey(0, 0)
P_AGENT, D_AGENT = "P-prefill-pp0-tp0", "D-decode-pp0-tp0"
WHY = "engine 'D' rank (pp=0, tp=0) is not compatible: - regions do not tile; run the same layout"


def _note(message: bytes) -> Any:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _sent(actions: list[Any]) -> list[tuple[str, Any]]:
    return [(a.agent, _note(a.message)) for a in actions if isinstance(a, Send)]


def _fails(actions: list[Any]) -> list[tuple[str, str, str, bool]]:
    return [
        (agent, note.request_id, note.reason, note.unsettled)
        for agent, note in _sent(actions)
        if note.kind is NotificationKind.FAILED
    ]


def _prefill() -> Any:
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import ReadSpec

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    return PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)


def _coordinates(**overrides: Any) -> Any:
    return _registration(**{"block_ids": ((3,),), "grant": None, **overrides})


def _hello(incarnation: str = "d1") -> Any:
    return _note(wire.encode_hello(_coordinates(decode_incarnation=incarnation), 0))


def _refused_core() -> Any:
    """A P core whose handshake with D rank 0 (asked for by D's HELLO) was refused, D's agent
    loaded notify-only."""
    core = _prefill()
    assert any(isinstance(a, Connect) for a in core.notification(D_AGENT, _hello(), 100.0))
    return core


def test_p_answers_the_hello_fail_with_its_reason_and_writes_nothing() -> None:
    core = _refused_core()
    actions = core.connected("D", 0, D_AGENT, "d1", 0, WHY, 100.1)
    fails = _fails(actions)
    assert [(a, rid, unsettled) for a, rid, _, unsettled in fails] == [(D_AGENT, "(hello)", False)]
    assert WHY in fails[0][2] and "refused this D rank's handshake metadata" in fails[0][2]
    assert not any(isinstance(a, Post) for a in actions)
    # A finished prefill and a registration from the refused agent: FAIL (nothing posted).
    core.finished("x-1", "p-1", ((5,),), "", 100.2)
    reg = _note(wire.encode_push_reg(_coordinates(grant=100.1)))
    actions = core.notification(D_AGENT, reg, 100.3)
    assert [(a, rid, u) for a, rid, _, u in _fails(actions)] == [(D_AGENT, "d-1", False)]
    assert not any(isinstance(a, (Post, Connect)) for a in actions)  # in backoff: no new handshake


def test_p_tells_a_refusal_only_to_the_agent_it_read_from_ds_side_channel() -> None:
    """A HELLO naming D's rank from another agent (an impostor, or the same name from another
    incarnation) gets nothing: the reason goes only to the agent P loaded from D's side channel,
    for the incarnation D published."""
    core = _prefill()
    core.notification("impostor", _hello(), 100.0)
    assert _fails(core.connected("D", 0, D_AGENT, "d1", 0, WHY, 100.1)) == []
    assert _fails(core.notification("impostor", _hello(), 100.2)) == []
    assert _fails(core.notification(D_AGENT, _hello("d0"), 100.3)) == []  # an older incarnation


def test_p_without_ds_agent_cannot_tell_and_says_nothing() -> None:
    """D's side channel gave nothing to read (unreachable): no agent, no FAIL (D's HELLO bound
    names the side channel)."""
    core = _refused_core()
    assert _fails(core.connected("D", 0, "", "", 0, "no answer from the side channel", 100.1)) == []


def test_a_restarted_decode_skips_ps_backoff_but_a_repeat_does_not() -> None:
    core = _refused_core()
    core.connected("D", 0, D_AGENT, "d1", 0, WHY, 100.1)
    again = core.notification(D_AGENT, _hello("d1"), 100.2)  # same incarnation, in backoff
    assert not any(isinstance(a, Connect) for a in again)
    assert [rid for _, rid, _, _ in _fails(again)] == ["(hello)"]
    restarted = core.notification(D_AGENT, _hello("d2"), 100.3)  # a new incarnation: at once
    assert any(isinstance(a, Connect) for a in restarted) and not _fails(restarted)
    core.connected("D", 0, D_AGENT, "d2", 0, WHY, 100.4)  # refused again (not fixed)
    flood = core.notification(D_AGENT, _hello("d3"), 100.5)  # within retry_backoff_s: no
    assert not any(isinstance(a, Connect) for a in flood)
    assert _fails(flood) == []  # and not told d2's reason either
    fixed = core.notification(D_AGENT, _hello("d4"), 101.6)
    assert any(isinstance(a, Connect) for a in fixed)
    answer = core.connected("D", 0, D_AGENT, "d4", 1, "", 101.7)
    assert [n.kind for _, n in _sent(answer)] == [NotificationKind.HEARTBEAT]  # HELLO answered


def _decode(**overrides: Any) -> Any:
    from kvpush.core.decode_core import DecodeCore, DecodeSettings

    fields = {
        "engine_id": "D",
        "incarnation": "d1",
        "tp_rank": 0,
        "tp_size": 1,
        "host": "127.0.0.1",
        "port": 5601,
        "hello_timeout_s": 5.0,
        "heartbeat_interval_s": 0.5,
        "peer_silence_s": 2.0,
        "fresh_s": 1.0,
    }
    return DecodeCore(DecodeSettings(**{**fields, **overrides}))


def _info() -> Any:
    from kvpush.core.decode_core import ProducerInfo

    return ProducerInfo(
        prefill_pp=1, prefill_tp=1, agents={P0: P_AGENT}, incarnations={P_AGENT: "p1"}, write_deadline_s=1.0
    )


def _request(rid: str, key: str) -> RequestMetadata:
    params = {"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(request_id=rid, block_ids=((1,),), params=TransferParams.from_dict(params))


def _hello_fail(reason: str = "P refused: " + WHY, producer: RankKey = P0) -> Any:
    return _note(wire.encode_failed("(hello)", producer, reason, unsettled=False))


def test_d_fails_waiting_requests_with_ps_reason_and_backs_off() -> None:
    core = _decode()
    core.add(_request("d-1", "x-1"), 0.0)
    core.connected("P", _info(), "", 0.1)
    actions = core.notification(P_AGENT, _hello_fail(), 0.2)
    reports = [a for a in actions if isinstance(a, Report)]
    assert [(r.request_id, r.outcome) for r in reports] == [("d-1", "failed")]
    assert WHY in reports[0].reason and "HELLO" not in reports[0].reason
    assert any(isinstance(a, Release) and a.request_id == "d-1" for a in actions)  # nothing registered
    # A request within the backoff fails at once with the same reason, no new handshake.
    later = core.add(_request("d-2", "x-2"), 0.3)
    assert not any(isinstance(a, Connect) for a in later)
    assert next(r.reason for r in later if isinstance(r, Report)).startswith("P refused: ")
    assert any(isinstance(a, Connect) for a in core.add(_request("d-3", "x-3"), 1.5))  # after it


@pytest.mark.parametrize(
    "why",
    ["another agent", "another producer rank", "a ready engine", "no handshake"],
)
def test_d_accepts_a_refusal_only_from_the_agent_it_is_handshaking_with(why: str) -> None:
    core = _decode()
    core.add(_request("d-1", "x-1"), 0.0)
    agent, note = P_AGENT, _hello_fail()
    if why != "no handshake":
        core.connected("P", _info(), "", 0.1)
    if why == "another agent":
        agent = "stranger"
    elif why == "another producer rank":
        note = _hello_fail(producer=RankKey(0, 1))
    elif why == "a ready engine":
        core.notification(P_AGENT, _note(wire.encode_heartbeat_answer(P0, 0.1, "p1")), 0.15)
    actions = core.notification(agent, note, 0.2)
    assert not any(isinstance(a, (Report, Release)) for a in actions), actions
    assert core.stats["rejected_notifications"] == 1
    assert core.holds("d-1")


def test_a_refusal_during_a_reconnect_releases_no_registered_request() -> None:
    """A request already registered (PUSH_REG sent: P may have written) when the engine
    reconnects and P then refuses: it fails with the reason, but its blocks stay held until
    its producers settled (here P's CANCEL_ACK), never on the refusal itself."""
    core = _decode()
    core.add(_request("d-1", "x-1"), 0.0)
    core.connected("P", _info(), "", 0.1)
    core.notification(P_AGENT, _note(wire.encode_heartbeat_answer(P0, 0.1, "p1")), 0.15)  # ready
    assert core._requests["d-1"].phase.value == "registered"
    engine = core._engines["P"]
    core._reconnect(engine, "test: a fence went out")
    core.connected("P", _info(), "", 0.3)  # HELLO state again, d-1 still registered
    actions = core.notification(P_AGENT, _hello_fail(), 0.4)
    assert [(r.request_id, r.outcome) for r in actions if isinstance(r, Report)] == [("d-1", "failed")]
    assert not any(isinstance(a, Release) for a in actions)
    assert core.holds("d-1")
    ack = _note(wire.encode_cancel_ack("d-1", P0, False, unsettled=False))
    assert any(isinstance(a, Release) for a in core.notification(P_AGENT, ack, 0.5))


def test_refusal_reaches_d_with_a_shared_secret() -> None:
    """With a secret every notification carries a MAC bound to the receiver's incarnation: P
    seals its FAIL with the incarnation it read from D's refused metadata."""
    pair = Pair(secret="refusal-test-secret")
    try:
        started = time.monotonic()
        pair.add("d-1", [1], "x-1")
        reason = pair.wait("d-1", timeout_s=HANDSHAKE_TIMEOUT_S + 5)
        assert reason is not None and PROBLEM in reason, reason
        assert time.monotonic() - started < 5
        assert pair.receiver is not None and pair.receiver.unauthenticated_notifications == 0
    finally:
        pair.close()


def test_an_engine_request_named_like_the_hello_is_registered_under_an_alias() -> None:
    """A FAIL naming "(hello)" is P's refusal; an engine request of that id is registered as
    "(hello)#n", so P's FAIL for it can never be taken for a refusal (and the reverse)."""
    pair = Pair(broken=False)
    try:
        pair.add("(hello)", [1], "x-1")
        pair.sender.request_finished("p-1", ((2,),), match_key="x-1")
        assert pair.wait("(hello)", timeout_s=10) is None, pair.results
        for layer, got in pair.d_caches.items():
            assert torch.equal(kv_bytes(got)[:, [1]], kv_bytes(pair.p_caches[layer])[:, [2]]), layer
    finally:
        pair.close()


# ------------------------------------------------------------------------------ rank processes


def test_across_processes_d_hears_ps_refusal_of_a_payload_contradicting_its_hash() -> None:
    """P and D as separate rank processes over real NIXL. D's side channel serves a payload
    whose model contradicts its compatibility hash (mixed builds, a tampered payload): D's own
    handshake (of P) passes, P's full handshake of D refuses it. D's request fails within a
    round trip naming P's check, not at its HELLO bound; D restarted with a sound payload (a new
    incarnation) is pushed byte for byte."""
    import msgpack
    from rank_engines import Engines

    from kvpush.core.sidechannel import fetch_metadata

    with Engines(request_timeout_s=60, handshake_timeout_s=HANDSHAKE_TIMEOUT_S) as engines:
        payload = fetch_metadata("127.0.0.1", engines.d_server.port, RankKey(0, 0))
        outer = msgpack.unpackb(payload, raw=False)
        inner = msgpack.unpackb(outer["meta"], raw=False)
        inner["model"]["head_dim"] *= 2  # the hash stays the sound model's
        outer["meta"] = msgpack.packb(inner, use_bin_type=True)
        engines.d_server.publish(RankKey(0, 0), msgpack.packb(outer, use_bin_type=True))
        engines.plan("r-1", [1, 2], [3, 4])
        engines.add("r-1")
        took = engines.wait_decode(["r-1"], timeout_s=HANDSHAKE_TIMEOUT_S + 10)
        kind, reason = engines.decode_outcome("r-1")[RankKey(0, 0)]
        assert kind == "failed" and "refused this D rank's handshake metadata" in reason, reason
        assert "publishes a model that differs" in reason and "head_dim" in reason, reason
        assert took < 5, f"D learned of P's refusal after {took:.1f}s"
        engines.restart_decode()  # sound metadata, a new incarnation under the same names
        engines.plan("r-2", [5, 6], [7, 8])
        engines.add("r-2")
        engines.finish("r-2")
        engines.wait_decode(["r-2"], timeout_s=20)
        kind, verified = engines.decode_outcome("r-2")[RankKey(0, 0)]
        assert kind == "done" and verified["ok"], verified
