"""Adversarial review of P's want batching: keys whose registration went stale are asked of D
in one ``want`` once the per-agent rate limit allows, never dropped. What if the engine or its
agent is replaced or dropped while a want is pending, the request ends meanwhile, or very many
keys go stale at once? The P core is driven directly (no transport, injected clock).
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpush.core import notifications as wire
from kvpush.core.actions import DropPeer, Post, Send
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.types import Notification, PushRegistration, RankKey, ReadSpec

P0 = RankKey(0, 0)
D_AGENT = "D-decode-pp0-tp0"
T0 = 200.0
"""P's clock at the start; every registration carries a grant of 100.0 (stale by then)."""


def _core(**overrides: Any) -> PrefillCore:
    def plan(blocks: Any, reg: PushRegistration) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    settings = PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1, **overrides)
    return PrefillCore(settings, plan=plan)


def _reg(n: int, **overrides: Any) -> PushRegistration:
    fields: dict[str, Any] = {
        "request_id": f"d-{n}",
        "match_key": f"x-{n}",
        "decode_engine_id": "D",
        "decode_host": "d.example",
        "decode_port": 5700,
        "decode_tp_size": 1,
        "block_ids": [[n % 1000]],
        "remote_engine_id": "P",
        "decode_incarnation": "d1",
        "grant": 100.0,
        "fresh_s": 10.0,
    }
    return PushRegistration(**{**fields, **overrides})


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)  # what D's decoder accepts
    assert note is not None
    return note


def _wants(actions: list[Any], agent: str = D_AGENT) -> list[str]:
    """Every key asked in the wants of ``actions`` to ``agent`` (in order, with repeats)."""
    return [
        key
        for a in actions
        if isinstance(a, Send) and a.agent == agent
        for key in (_note(a.message).want or ())
    ]


def _loaded(core: PrefillCore, incarnation: str = "d1", now: float = T0) -> None:
    core.notification(D_AGENT, _note(wire.encode_hello(_reg(0, decode_incarnation=incarnation), 0)), now)
    core.connected("D", 0, D_AGENT, incarnation, 1, "", now)


def _stale(core: PrefillCore, n: int, now: float, **overrides: Any) -> list[Any]:
    """Finish ``x-n`` and deliver its registration with a stale grant."""
    core.finished(f"x-{n}", f"p-{n}", ((n % 1000,),), "", now)
    return core.notification(D_AGENT, _note(wire.encode_push_reg(_reg(n, **overrides))), now)


# ------------------------------------------------------------------ finding: very many keys


def test_every_stale_key_is_asked_even_beyond_one_messages_key_limit() -> None:
    """A want is one heartbeat answer, whose key list the encoder cuts at ``MAX_KEYS`` (4096,
    what D's decoder accepts) without a word. Keys batched within the rate limit past that
    were silently never asked (each then waited for D's next heartbeat: the delay the batching
    was built to remove). They now go out in several messages, each within the limit."""
    core = _core(max_stash_per_engine=10_000)
    _loaded(core)
    n_keys = wire.MAX_KEYS + 300
    first = _stale(core, 1, T0)
    assert _wants(first) == ["x-1"]
    for n in range(2, n_keys + 1):
        assert not _wants(_stale(core, n, T0 + 0.001))  # within the rate limit: batched
    later = core.handle_timer(T0 + core.s.want_interval_s)
    asked = _wants(later)
    assert sorted(asked) == sorted(f"x-{n}" for n in range(2, n_keys + 1)), (
        f"{n_keys - 1 - len(set(asked))} stale key(s) never asked"
    )
    assert len(asked) == len(set(asked))
    assert all(len(_note(a.message).want) <= wire.MAX_KEYS for a in later if isinstance(a, Send))
    assert not any(core._engines["D"].want_pending.values())


# ------------------------------------------------------------------ probes found sound


def test_a_want_pending_when_the_request_ends_is_not_sent_and_leaves_nothing_behind() -> None:
    """Aborted, failed by the driver, cancelled by D, or finished a second time while its want
    waits for the rate limit: only keys still waiting for a grant are asked, once."""
    core = _core()
    _loaded(core)
    assert _wants(_stale(core, 1, T0)) == ["x-1"]
    for n in (2, 3, 4, 5):
        assert not _wants(_stale(core, n, T0 + 0.001))
    core.abort("x-2", T0 + 0.002)
    core.fail("x-3", "internal error: boom", T0 + 0.002)
    cancel = wire.encode_cancel("x-4", _reg(4), 0)
    core.notification(D_AGENT, _note(cancel), T0 + 0.002)
    again = core.finished("x-5", "p-5-again", ((9,),), "", T0 + 0.003)
    assert [a.outcome for a in again] == ["failed"]  # a second finish is refused
    later = core.handle_timer(T0 + core.s.want_interval_s)
    assert _wants(later) == ["x-5"]
    assert not any(core._engines["D"].want_pending.values())
    assert core.next_deadline() is not None  # the leases and tombstones, not a want
    assert ("want", "D", D_AGENT) not in core._timers._armed


def test_a_want_pending_when_d_restarts_goes_to_nobody() -> None:
    """D comes back under the same name with a new incarnation while a want waits: the old
    keys fail (D's new start knows nothing of them) and the timer asks the new start nothing."""
    core = _core()
    _loaded(core)
    assert _wants(_stale(core, 1, T0)) == ["x-1"]
    assert not _wants(_stale(core, 2, T0 + 0.001))
    hello = wire.encode_hello(_reg(0, decode_incarnation="d2"), 0)
    core.notification(D_AGENT, _note(hello), T0 + 0.002)  # P asks D's side channel first
    restart = core.start_served("D", 0, "d2", "", T0 + 0.002)  # it serves "d2": a restart
    assert any(isinstance(a, DropPeer) for a in restart)
    assert not _wants(core.handle_timer(T0 + core.s.want_interval_s))
    assert sorted(core.pending_requests()) == []
    # The new start is loaded; its own stale registration is asked at once (its own limit).
    core.connected("D", 0, D_AGENT, "d2", 1, "", T0 + 0.003)
    assert _wants(_stale(core, 3, T0 + 0.004, decode_incarnation="d2")) == ["x-3"]


def test_a_want_pending_when_the_engine_is_dropped_is_asked_again_after_the_reconnect() -> None:
    """A WRITE deadline drops D's engine (a fresh connection for the next push) while another
    request's want waits: the timer finds no engine and sends nothing; D's HELLO on its next
    connection reloads the engine and that request is asked for (and gets) a fresh grant."""
    core = _core(write_deadline_s=1.0)
    _loaded(core)
    core.finished("x-1", "p-1", ((1,),), "", T0)
    fresh = core.notification(D_AGENT, _note(wire.encode_push_reg(_reg(1, grant=T0))), T0)
    (post,) = [a for a in fresh if isinstance(a, Post)]
    assert core.confirm_post(post.key, post.dst, T0)
    core.posted(post.key, post.dst, ["h1"], 64, T0)
    t = T0 + 0.5
    assert _wants(_stale(core, 2, t)) == ["x-2"]
    assert not _wants(_stale(core, 3, t + 0.001))  # pending behind the rate limit
    dropped = core.handle_timer(T0 + 1.0)  # x-1's WRITE deadline: the engine is dropped
    assert any(isinstance(a, DropPeer) for a in dropped) and "D" not in core._engines
    assert not _wants(core.handle_timer(T0 + 1.1))
    again = core.notification(D_AGENT, _note(wire.encode_hello(_reg(0), 0)), T0 + 2.0)
    assert again and "D" in core._engines
    resumed = core.connected("D", 0, D_AGENT, "d1", 1, "", T0 + 2.0)
    assert sorted(_wants(resumed + core.handle_timer(T0 + 2.1))) == ["x-2", "x-3"]
    # D answers with each wanted request's own PUSH_REG again (a heartbeat renews no grant)
    renewals = [wire.encode_push_reg(_reg(n, grant=T0 + 2.1)) for n in (2, 3)]
    acts = [a for renewal in renewals for a in core.notification(D_AGENT, _note(renewal), T0 + 2.2)]
    assert sorted(p.key for p in acts if isinstance(p, Post)) == ["x-2", "x-3"]


def test_wants_to_many_agents_keep_one_timer_each() -> None:
    """State stays bounded: one pending set and one timer per D agent, emptied when it fires."""
    core = _core()
    _loaded(core)
    _stale(core, 1, T0)
    for n in range(2, 200):
        _stale(core, n, T0 + 0.001)
    assert len(core._timers) <= 200 * 2 + 2  # leases, the want timer, no per-key want timers
    assert sum(1 for k in core._timers._armed if k[0] == "want") == 1
    core.handle_timer(T0 + core.s.want_interval_s)
    assert sum(1 for k in core._timers._armed if k[0] == "want") == 0


# ------------------------------------------------------------------ property: never dropped


class WantMachine(RuleBasedStateMachine):
    """One P rank, one D agent; registrations go stale, requests end, D renews or restarts, the
    clock moves in steps around the rate limit. Checked after every step: a key waiting for a
    grant longer than the rate limit was asked since it started waiting (never dropped), each
    want message is one D's decoder accepts, and no key is pending without a timer."""

    def __init__(self) -> None:
        super().__init__()
        self.core = _core(max_stash_per_engine=100_000)
        self.t = T0
        self.inc = 1
        _loaded(self.core, self._inc(), self.t)
        self.n = 0
        self.waiting_since: dict[str, float] = {}
        self.asked_at: dict[str, float] = {}

    def _inc(self) -> str:
        return f"d{self.inc:04d}"  # incarnations sort by start

    def _run(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                note = _note(a.message)  # D's decoder accepts it
                for key in note.want or ():
                    self.asked_at[key] = self.t
            elif isinstance(a, Post):
                # The driver posts at once; a stale one goes back to waiting (and is asked).
                if self.core.confirm_post(a.key, a.dst, self.t):
                    self._run(self.core.posted(a.key, a.dst, [f"h-{a.key}"], 1, self.t))
                    self._run(self.core.write_settled(a.key, a.dst, f"h-{a.key}", True, self.t))
                else:
                    self._run(self.core.refresh(a.key, a.dst, self.t))
        self._observe()

    def _waiting(self) -> set[str]:
        return {
            key
            for key, r in self.core._requests.items()
            if r.dests and any(d.state.name == "WAIT_FRESH" for d in r.dests.values())
        }

    def _observe(self) -> None:
        waiting = self._waiting()
        for key in list(self.waiting_since):
            if key not in waiting:
                del self.waiting_since[key]
        for key in waiting:
            self.waiting_since.setdefault(key, self.t)

    @rule(count=st.sampled_from([1, 1, 2, 5, 40]))
    def stale_registrations(self, count: int) -> None:
        for _ in range(count):
            self.n += 1
            reg = _reg(self.n, decode_incarnation=self._inc())
            self.core.finished(f"x-{self.n}", f"p-{self.n}", ((1,),), "", self.t)
            self._run(self.core.notification(D_AGENT, _note(wire.encode_push_reg(reg)), self.t))

    @rule(data=st.data(), how=st.sampled_from(["abort", "fail", "cancel", "renew"]))
    def end_or_renew(self, data: st.DataObject, how: str) -> None:
        waiting = sorted(self._waiting())
        if not waiting:
            return
        key = data.draw(st.sampled_from(waiting))
        if how == "abort":
            self._run(self.core.abort(key, self.t))
        elif how == "fail":
            self._run(self.core.fail(key, "internal error: boom", self.t))
        else:
            n = int(key.split("-")[1])
            reg = _reg(n, decode_incarnation=self._inc(), grant=self.t)
            if how == "cancel":
                message = wire.encode_cancel(key, reg, 0)
            else:
                message = wire.encode_heartbeat(
                    [key], _reg(0, decode_incarnation=self._inc(), grant=self.t), 0
                )
            self._run(self.core.notification(D_AGENT, _note(message), self.t))

    @rule(dt=st.sampled_from([0.001, 0.01, 0.03, 0.049, 0.05, 0.07, 0.2]))
    def clock(self, dt: float) -> None:
        self.t += dt
        self._run(self.core.handle_timer(self.t))

    @rule()
    def decode_restarts(self) -> None:
        self.inc += 1
        hello = wire.encode_hello(_reg(0, decode_incarnation=self._inc()), 0)
        self._run(self.core.notification(D_AGENT, _note(hello), self.t))
        self._run(self.core.connected("D", 0, D_AGENT, self._inc(), 1, "", self.t))

    @invariant()
    def no_key_is_left_waiting_unasked(self) -> None:
        limit = self.core.s.want_interval_s
        for key, since in self.waiting_since.items():
            if self.t - since >= limit + 1e-9:
                asked = self.asked_at.get(key, float("-inf"))
                assert asked >= since, f"{key} waits for a grant since {since}, never asked (t={self.t})"

    @invariant()
    def nothing_pending_without_a_timer(self) -> None:
        """Pending keys (ended ones are filtered when the timer fires) always have a timer."""
        for engine in self.core._engines.values():
            for agent, keys in engine.want_pending.items():
                armed = self.core._timers.when(("want", engine.engine_id, agent))
                assert not keys or armed is not None, f"{sorted(keys)} pending with no want timer"


TestWantMachine = WantMachine.TestCase
TestWantMachine.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None, derandomize=True, database=None
)
