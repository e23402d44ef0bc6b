"""Probe: a peer restarts under the same name (agent name, side-channel address, engine id)
with a DIFFERENT configuration while the other side keeps running with requests registered
or in flight.

Every rank is a real process (:mod:`kvpush.demo.rank`) over real NIXL; this process serves
both engines' side channels, as a scheduler would, and publishes a restarted rank's payload
under the same rank key (the side channel keeps serving a rank nobody republished). What must
hold for every request on every live D rank: done with every byte right, or failed (or
cancelled) with its blocks released; and no byte anywhere in a D rank outside the blocks a
request added there named (``check_untouched``), nor in blocks freed after a failure
(``check_freed``). The surviving side must take the new incarnation's metadata (regions,
geometry, parallel sizes) before any WRITE or completion, never facts cached from the old one.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import attrs
import pytest

from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ModelSpec, ParallelConfig, RankKey
from kvpush.demo.rank import RankSpec
from kvpush.demo.runner import _Rank, _start_ranks, _stop

BEHIND = "0000000000000001" + "00000000"
"""An incarnation whose start time sorts before every real one (a clock behind)."""
BASE = ModelSpec(name="reconfig-gqa", num_layers=4, num_kv_heads=2, head_dim=32, block_size=8)
FAST = {
    "heartbeat_interval_s": 0.25,
    "write_deadline_s": 1.5,
    "handshake_timeout_s": 2.0,
}
"""Short timers (as the soak's): a silent P is dead after 3 heartbeats + the handshake bound."""


@attrs.frozen
class Side:
    """One engine's configuration: model, layout, parallel sizes and blocks per KV group."""

    model: ModelSpec = BASE
    layout: str = "uniform"
    pp: int = 1
    tp: int = 1
    blocks: int | tuple[int, ...] = 64
    """Blocks of every KV group, or per group."""

    def parallel(self, pp: int, tp: int) -> ParallelConfig:
        return ParallelConfig.for_stage(
            num_layers=self.model.num_layers, pp_size=self.pp, pp_rank=pp, tp_size=self.tp, tp_rank=tp
        )


class Rig:
    """P engine ``prefill-0`` and D engine ``decode-0``, each rank a process; either side can
    be killed and started again under the same names with another :class:`Side`."""

    def __init__(self, p: Side, d: Side, *, strategy: str | None = None, **worker: Any) -> None:
        self.worker = {**FAST, **worker}
        self.strategy = strategy
        self.p_server = SideChannelServer("prefill-0")
        self.d_server = SideChannelServer("decode-0")
        self.all: list[_Rank] = []
        self.p_side, self.d_side = p, d
        self.p_ranks: list[_Rank] = []
        self.d_ranks: list[_Rank] = []
        self.d_gen = 0
        """How many times D was (re)started: a D rank's results are kept per start."""
        self.results: dict[tuple[int, RankKey], dict[str, tuple[str, Any]]] = {}
        self.released: set[tuple[int, RankKey, str]] = set()
        self.p_results: dict[str, dict[RankKey, str | None]] = {}
        self.added: dict[tuple[int, RankKey], list[str]] = {}
        try:
            self.start_p(p)
            self.start_d(d)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ processes

    def _spec(
        self, role: str, side: Side, pp: int, tp: int, parallel: ParallelConfig | None = None, **extra: Any
    ) -> RankSpec:
        prefill = role == "prefill"
        return RankSpec(
            role=role,
            engine_id="prefill-0" if prefill else "decode-0",
            parallel=parallel
            if parallel is not None
            else side.parallel(pp, tp)
            if prefill
            else ParallelConfig(tp_size=side.tp, tp_rank=tp, num_layers=side.model.num_layers),
            model=side.model,
            layout=side.layout,
            blocks_per_group=side.blocks
            if isinstance(side.blocks, tuple)
            else (side.blocks,) * side.model.num_groups,
            side_channel_port=(self.p_server if prefill else self.d_server).port,
            request_timeout_s=12.0,
            lease_s=4.0,
            worker_options={**self.worker, **extra},
            strategy=self.strategy,
            log_level=os.environ.get("KVPUSH_TEST_RANK_LOG", "ERROR"),
        )

    def start_p(self, side: Side, **extra: Any) -> None:
        specs = [
            self._spec("prefill", side, pp, tp, **extra) for pp in range(side.pp) for tp in range(side.tp)
        ]
        ranks, payloads = _start_ranks(specs, timeout_s=120)
        self.all += ranks
        self.p_ranks, self.p_side = ranks, side
        self.p_server.publish_all(payloads)

    def start_d(self, side: Side, **extra: Any) -> None:
        specs = [self._spec("decode", side, 0, tp, **extra) for tp in range(side.tp)]
        ranks, payloads = _start_ranks(specs, timeout_s=120)
        self.all += ranks
        self.d_gen += 1
        self.d_ranks, self.d_side = ranks, side
        for rank in ranks:
            self.results[(self.d_gen, rank.key)] = {}
            self.added[(self.d_gen, rank.key)] = []
        self.d_server.publish_all(payloads)

    @staticmethod
    def kill(ranks: list[_Rank]) -> None:
        for rank in ranks:
            if rank.process.is_alive():
                os.kill(rank.process.pid, signal.SIGKILL)
            rank.process.join(timeout=10)

    def restart_d(self, side: Side, **extra: Any) -> None:
        """SIGKILL every D rank and start D again under the same names with ``side``
        (``extra``: more ``WorkerConfig`` fields for the new start)."""
        self.poll()
        self.kill(self.d_ranks)
        self.start_d(side, **extra)

    def restart_p(self, side: Side, **extra: Any) -> None:
        self.poll()
        self.kill(self.p_ranks)
        self.start_p(side, **extra)

    def restart_p_stage(self, pp: int, start_layer: int, end_layer: int) -> None:
        """SIGKILL P stage ``pp`` (TP 1) alone and start it again under its name with another
        layer window; the other stages keep running (a staggered restart)."""
        self.poll()
        (old,) = [rank for rank in self.p_ranks if rank.key.pp_rank == pp]
        self.kill([old])
        parallel = attrs.evolve(self.p_side.parallel(pp, 0), start_layer=start_layer, end_layer=end_layer)
        ranks, payloads = _start_ranks([self._spec("prefill", self.p_side, pp, 0, parallel)], timeout_s=120)
        self.all += ranks
        self.p_ranks = [ranks[0] if rank is old else rank for rank in self.p_ranks]
        self.p_server.publish_all(payloads)

    def close(self) -> None:
        _stop(self.all)
        for server in (self.p_server, self.d_server):
            server.close()

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def ids(self, side: Side, first: int, n: int) -> list[list[int]]:
        return [list(range(first, first + n)) for _ in range(side.model.num_groups)]

    def prefill(self, rid: str, seed: int, first: int, n: int) -> None:
        for rank in self.p_ranks:
            rank.call(("prepare", [(rid, seed, self.ids(self.p_side, first, n))]))

    def finish(self, rid: str, first: int, n: int) -> None:
        for rank in self.p_ranks:
            rank.call(("finish", rid, self.ids(self.p_side, first, n), f"key-{rid}"))

    def add(
        self, rid: str, seed: int, first: int, n: int, *, pp: int | None = None, tp: int | None = None
    ) -> None:
        params = {
            "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1",
            "remote_port": self.p_server.port,
            "tp_size": self.p_side.tp if tp is None else tp,
            "pp_size": self.p_side.pp if pp is None else pp,
            "transfer_id": f"key-{rid}",
        }
        for rank in self.d_ranks:
            rank.call(
                (
                    "add",
                    rid,
                    self.ids(self.d_side, first, n),
                    params,
                    seed,
                    [0] * self.d_side.model.num_groups,
                )
            )
            self.added[(self.d_gen, rank.key)].append(rid)

    def push(self, rid: str, seed: int, p_first: int, d_first: int, n: int) -> None:
        self.prefill(rid, seed, p_first, n)
        self.add(rid, seed, d_first, n)
        self.finish(rid, p_first, n)

    def poll(self) -> None:
        for rank in self.d_ranks:
            if not rank.process.is_alive():
                continue
            got = rank.call(("poll",))
            mine = self.results[(self.d_gen, rank.key)]
            for kind in ("done", "failed", "cancelled"):
                for rid, value in got[kind].items():
                    mine[rid] = (kind, value)
            self.released.update((self.d_gen, rank.key, rid) for rid in got["released"])
        for rank in self.p_ranks:
            if not rank.process.is_alive():
                continue
            got = rank.call(("poll",))
            for rid in got["sent"]:
                self.p_results.setdefault(rid, {})[rank.key] = None
            for rid, reason in got["failed"].items():
                self.p_results.setdefault(rid, {})[rank.key] = reason

    def settle(self, rids: list[str], timeout_s: float = 20.0) -> dict[str, dict[RankKey, tuple[str, Any]]]:
        """Wait (bounded) until every live D rank reported each request and released the failed
        ones; return each request's outcome per D rank."""

        def pending() -> list[str]:
            out = []
            for rank in self.d_ranks:
                mine = self.results[(self.d_gen, rank.key)]
                for rid in rids:
                    if rid not in mine:
                        out.append(f"{rid}@{rank.key}: no outcome")
                    elif mine[rid][0] != "done" and (self.d_gen, rank.key, rid) not in self.released:
                        out.append(f"{rid}@{rank.key}: {mine[rid]} but its blocks were not released")
            return out

        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            left = pending()
            if not left:
                break
            assert time.monotonic() < deadline, f"not settled within {timeout_s}s: {left}"
            time.sleep(0.05)
        return {
            rid: {rank.key: self.results[(self.d_gen, rank.key)][rid] for rank in self.d_ranks}
            for rid in rids
        }

    def check_bytes(self, outcomes: dict[str, dict[RankKey, tuple[str, Any]]]) -> None:
        """Every request done on a D rank holds every byte right there; no byte outside named
        blocks or in freed ones on any live D rank."""
        wrong = {
            (rid, key): value
            for rid, per_rank in outcomes.items()
            for key, (kind, value) in per_rank.items()
            if kind == "done" and not value["ok"]
        }
        assert not wrong, f"D reported done with wrong KV: {wrong}"
        for rank in self.d_ranks:
            untouched = rank.call(("check_untouched",))
            freed = rank.call(("check_freed",))
            assert not untouched, f"D rank {rank.key}: bytes outside the named blocks: {untouched}"
            assert not freed, f"D rank {rank.key}: bytes in freed blocks: {freed}"

    def wait_p(self, rids: list[str], timeout_s: float = 15.0) -> dict[str, dict[RankKey, str | None]]:
        deadline = time.monotonic() + timeout_s
        keys = [rank.key for rank in self.p_ranks]
        while True:
            self.poll()
            if all(key in self.p_results.get(rid, {}) for rid in rids for key in keys):
                return {rid: dict(self.p_results[rid]) for rid in rids}
            assert time.monotonic() < deadline, (
                f"P did not report {rids} within {timeout_s}s: {self.p_results}"
            )
            time.sleep(0.05)


def done_everywhere(outcome: dict[RankKey, tuple[str, Any]]) -> bool:
    return all(kind == "done" for kind, _ in outcome.values())


# ---------------------------------------------------------------------------------------------
# D restarts with another configuration while P holds the old start's registration
# ---------------------------------------------------------------------------------------------


SLOW = pytest.mark.slow
"""The long tail of a family (each case starts and kills rank processes, 10-20 s): run with
``-m slow``; one case of each family stays in the default run."""


def _tail(*values: Any, **kw: Any) -> Any:
    return pytest.param(*values, marks=SLOW, **kw)


def outcome_kinds(outcomes: dict[str, dict[RankKey, tuple[str, Any]]]) -> dict[str, list[str]]:
    return {rid: sorted({kind for kind, _ in per.values()}) for rid, per in outcomes.items()}


@pytest.mark.parametrize(
    ("blocks", "strategy", "worker"),
    [
        pytest.param(16, None, {}, id="fewer"),
        _tail(128, None, {}, id="more"),
        _tail(16, "packed", {}, id="fewer-packed"),
        # The old registration's grant is still fresh when P finishes: P posts it at once, to
        # the agent it loaded for the rank (the dead start), before the new start said a word.
        pytest.param(16, None, {"fresh_s": 6.0, "peer_silence_s": 8.0}, id="fewer-fresh-grant"),
    ],
)
def test_d_restarted_with_other_block_counts_gets_no_write_of_the_old_registration(
    blocks: int, strategy: str | None, worker: dict[str, Any]
) -> None:
    """Same model (the compatibility hash does not cover block counts): D's regions (and its
    staging pool) are re-allocated with another size and addresses. A registration of the old
    start, held by P when the prefill finishes, must never be written into the new process;
    new requests land byte-exact in the new regions."""
    with Rig(Side(), Side(blocks=64), strategy=strategy, **worker) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)  # registered with P; P has not finished yet
        time.sleep(0.5)
        rig.restart_d(Side(blocks=blocks))
        rig.finish("old", 3, 4)
        for i, first in ((1, 2), (2, 6), (3, 12)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
        outcomes = rig.settle(["new-1", "new-2", "new-3"])
        rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes
        p = rig.wait_p(["old"])
        assert all(reason is not None for reason in p["old"].values()), p


RECONFIGURED = {
    "block_size": (Side(), Side(model=attrs.evolve(BASE, block_size=16))),
    "bf16->fp16": (Side(), Side(model=attrs.evolve(BASE, dtype="float16"))),
    "fp8 format": (
        Side(model=attrs.evolve(BASE, dtype="float8_e4m3fn")),
        Side(model=attrs.evolve(BASE, dtype="float8_e5m2")),
    ),
    "num_layers": (Side(), Side(model=attrs.evolve(BASE, num_layers=6))),
    "kv_heads": (Side(), Side(model=attrs.evolve(BASE, num_kv_heads=4))),
    "head_dim": (Side(), Side(model=attrs.evolve(BASE, head_dim=64))),
    "token_major": (Side(), Side(layout="token_major")),
    "hma": (
        Side(),
        Side(
            model=attrs.evolve(
                BASE,
                layer_groups=[i % 2 for i in range(4)],
                layer_kinds=["full" if i % 2 == 0 else "sliding_window" for i in range(4)],
            ),
            layout="hma",
        ),
    ),
    "mla": (Side(), Side(model=attrs.evolve(BASE, attention="mla", num_kv_heads=1, head_dim=64))),
}


@pytest.mark.parametrize("change", [c if c == "block_size" else _tail(c, id=c) for c in sorted(RECONFIGURED)])
def test_d_restarted_with_another_geometry_is_refused_and_nothing_lands(change: str) -> None:
    """D comes back under its names with a model/layout P does not run. P must read the new
    start's metadata (and refuse it), never write the old start's registration into the new
    process, and D's new requests end failed with their blocks released."""
    before, after = RECONFIGURED[change]
    with Rig(before, before) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)
        time.sleep(0.5)
        rig.restart_d(after)
        rig.finish("old", 3, 4)
        rig.prefill("new", 3, 8, 3)
        rig.add("new", 3, 2, 3)
        rig.finish("new", 8, 3)
        outcomes = rig.settle(["new"])
        rig.check_bytes(outcomes)
        assert outcome_kinds(outcomes) == {"new": ["failed"]}, outcomes
        p = rig.wait_p(["old", "new"])
        assert all(reason is not None for per in p.values() for reason in per.values()), p


@pytest.mark.parametrize(
    ("p_tp", "d_before", "d_after"), [(1, 2, 1), _tail(1, 1, 2), _tail(2, 1, 2), _tail(2, 2, 1)]
)
def test_d_restarted_with_another_tp_size(p_tp: int, d_before: int, d_after: int) -> None:
    """P has loaded D's ranks of the old TP size (a rank the new start no longer has among
    them); requests registered before the restart never land in the new processes, and new
    requests are planned for the new TP size and land byte-exact on every new rank."""
    with Rig(Side(tp=p_tp), Side(tp=d_before)) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)
        time.sleep(0.5)
        rig.restart_d(Side(tp=d_after))
        rig.finish("old", 3, 4)
        for i, first in ((1, 2), (2, 20), (3, 30)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
        outcomes = rig.settle(["new-1", "new-2", "new-3"])
        rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes


# ---------------------------------------------------------------------------------------------
# P restarts with another configuration while D holds registered requests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "d_tp"),
    [
        pytest.param(Side(pp=2), Side(pp=1), 1, id="pp2->pp1"),
        _tail(Side(pp=1), Side(pp=2), 1, id="pp1->pp2"),
        _tail(Side(pp=2), Side(pp=1), 2, id="pp2->pp1 dtp2"),
        _tail(Side(tp=1), Side(tp=2), 2, id="tp1->tp2 dtp2"),
        _tail(Side(tp=2), Side(tp=1), 2, id="tp2->tp1 dtp2"),
        _tail(Side(tp=2, pp=2), Side(tp=1, pp=1), 1, id="pp2tp2->pp1tp1"),
    ],
)
def test_p_restarted_with_other_parallel_sizes(before: Side, after: Side, d_tp: int) -> None:
    """D's registered requests count the old producers: they must end failed and released
    (never done short of a stage, never written by the new processes); new requests count the
    new producers and land byte-exact."""
    with Rig(before, Side(tp=d_tp)) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)
        time.sleep(0.5)
        rig.restart_p(after)
        rig.prefill("old", 2, 3, 4)  # the new process prefills the same prompt again
        rig.finish("old", 3, 4)
        outcomes = rig.settle(["old"])
        rig.check_bytes(outcomes)
        for i, first in ((1, 20), (2, 30), (3, 40)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
        outcomes = rig.settle(["new-1", "new-2", "new-3"])
        rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes


@pytest.mark.parametrize("change", ["block_size", _tail("bf16->fp16"), _tail("token_major"), _tail("mla")])
def test_p_restarted_with_another_geometry_fails_d_requests_and_nothing_lands(change: str) -> None:
    """P comes back with a model/layout D does not run: D's registered request fails and is
    released, new ones fail (refused at D's handshake) and are released; no byte lands."""
    before, after = RECONFIGURED[change]
    with Rig(before, before) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)
        time.sleep(0.5)
        rig.restart_p(after)
        rig.prefill("old", 2, 3, 4)
        rig.finish("old", 3, 4)
        rig.prefill("new", 3, 8, 3)
        rig.add("new", 3, 20, 3)
        rig.finish("new", 8, 3)
        outcomes = rig.settle(["old", "new"])
        rig.check_bytes(outcomes)
        assert outcome_kinds(outcomes) == {"old": ["failed"], "new": ["failed"]}, outcomes


@SLOW
def test_d_restarted_refused_then_restarted_right_is_served() -> None:
    """D comes back with a geometry P refuses (P loads its agent notify-only to tell it), then
    again under the same names with the right one: P must handshake the newest start afresh
    (never keep the refused start's agent or reason) and its requests land byte-exact."""
    with Rig(Side(), Side()) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.restart_d(RECONFIGURED["block_size"][1])
        rig.push("refused", 2, 4, 2, 3)
        outcomes = rig.settle(["refused"])
        rig.check_bytes(outcomes)
        assert outcome_kinds(outcomes) == {"refused": ["failed"]}, outcomes
        rig.restart_d(Side(blocks=32))
        for i, first in ((1, 2), (2, 6), (3, 12)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
        outcomes = rig.settle(["new-1", "new-2", "new-3"])
        rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes


def test_d_restarted_on_a_clock_behind_is_served() -> None:
    """Incarnations sort by start time: a D restarted under the same names on a host whose
    clock is behind (another machine taking over the address, an NTP step) states an
    incarnation older than the one P loaded. It is the live process all the same: its requests
    must be served (or fail named and released), never its registrations written to the dead
    start or the dead start's into it."""
    with Rig(Side(), Side()) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)
        time.sleep(0.5)
        rig.restart_d(Side(blocks=32), incarnation=BEHIND)
        rig.finish("old", 3, 4)
        for i, first in ((1, 2), (2, 6), (3, 12)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
            outcomes = rig.settle([f"new-{i}"])
            rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes


@pytest.mark.parametrize(
    "idle",
    [False, _tail(True, id="idle")],
    ids=["registered", "idle"],
)
def test_p_restarted_on_a_clock_behind_is_found(idle: bool) -> None:
    """The same for P, with another PP size: D drops the new start's heartbeat answers as late
    ones of a replaced start (its incarnation sorts before the loaded one), so it must find the
    restart by the dead start's silence: a registered request fails and is released, later ones
    are served by the new process."""
    with Rig(Side(pp=2), Side()) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        if not idle:
            rig.prefill("old", 2, 3, 4)
            rig.add("old", 2, 10, 4)
            time.sleep(0.5)
        rig.restart_p(Side(pp=1), incarnation=BEHIND)
        if not idle:
            rig.prefill("old", 2, 3, 4)
            rig.finish("old", 3, 4)
            rig.check_bytes(rig.settle(["old"]))
        for i, first in ((1, 20), (2, 30), (3, 40)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
            outcomes = rig.settle([f"new-{i}"])
            rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes


# ---------------------------------------------------------------------------------------------
# The same finding in P's core: which start of a D rank is live is told by identity
# ---------------------------------------------------------------------------------------------


def _core_loaded(incarnation: str) -> Any:
    """A P core that loaded D rank 0 (start ``incarnation``) on its HELLO, with a finished
    prefill that start registered (P posts it)."""
    from test_handshake_refusal import D_AGENT, _hello, _prefill

    from kvpush.core import notifications as wire
    from kvpush.core.actions import Connect, Post

    core = _prefill()
    assert any(isinstance(a, Connect) for a in core.notification(D_AGENT, _hello(incarnation), 100.0))
    core.connected("D", 0, D_AGENT, incarnation, 1, "", 100.1)
    core.finished("x-1", "p-1", ((5,),), "", 100.2)
    reg = wire.encode_push_reg(_coordinates(decode_incarnation=incarnation, grant=100.1))
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, _decoded(reg), 100.3))
    return core


def _decoded(message: bytes) -> Any:
    from kvpush.core import notifications as wire

    note = wire.decode_notification(message)
    assert note is not None
    return note


def _coordinates(**overrides: Any) -> Any:
    from test_protocol_safety import _registration

    return _registration(**{"block_ids": ((3,),), "grant": None, **overrides})


def test_core_a_hello_of_a_d_start_on_a_clock_behind_is_a_restart() -> None:
    """P loaded start "d5"; D restarts as "d1" (it sorts before: a clock behind). Its HELLO
    used to be answered to the dead start's agent (taken for the loaded start's), P never
    loaded the new one. Now it is a restart, once D's side channel says "d1" runs (asked off
    the writer thread, ``AskStart``): the old start's request fails once its WRITE
    settled, the rank is dropped, and P handshakes afresh (D's side channel names the live
    start); its registrations are then served."""
    from test_handshake_refusal import D_AGENT, _hello

    from kvpush.core.actions import AskStart, Connect, DropPeer, Post, Report

    core = _core_loaded("d5")
    handle = object()
    core.posted("x-1", 0, [handle], 8, 100.35)  # the old start's WRITE, in flight
    asked = core.notification(D_AGENT, _hello("d1"), 100.4)
    assert [a for a in asked if isinstance(a, AskStart)] == [AskStart("D", "127.0.0.1", 5601, 0)], asked
    actions = core.start_served("D", 0, "d1", "", 100.45)  # D's side channel: "d1" runs
    assert not any(isinstance(a, DropPeer) for a in actions)  # not under its WRITE
    actions = core.write_settled("x-1", 0, handle, False, 100.5, "peer gone")
    assert any(isinstance(a, Report) and a.outcome == "failed" for a in actions), actions
    assert any(isinstance(a, DropPeer) for a in actions), actions
    assert any(isinstance(a, Connect) for a in actions), actions
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.6)
    core.finished("x-2", "p-2", ((6,),), "", 100.7)
    reg = _decoded(wire_push_reg(decode_incarnation="d1", request_id="d-2", match_key="x-2", grant=100.6))
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, reg, 100.8))
    # A late message of the replaced start "d5" (it sorts after the live one) is stale now.
    late = _decoded(wire_push_reg(decode_incarnation="d5", request_id="d-3", match_key="x-3", grant=100.6))
    assert not core.notification(D_AGENT, late, 100.9)
    assert not core.notification(D_AGENT, _hello("d5"), 101.0)


def wire_push_reg(**overrides: Any) -> bytes:
    from kvpush.core import notifications as wire

    return wire.encode_push_reg(_coordinates(**overrides))


def test_core_a_late_hello_of_a_start_p_never_loaded_costs_one_reload_at_most() -> None:
    """A HELLO of an earlier-sorting start P never loaded is taken for a restart, but when D's
    side channel then serves a later start, that HELLO's start is dead: its further messages
    are stale (no reload per late message)."""
    from test_handshake_refusal import D_AGENT, _hello, _prefill

    from kvpush.core.actions import Connect

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d2", 1, "", 100.1)  # the side channel serves "d2"
    assert not any(isinstance(a, Connect) for a in core.notification(D_AGENT, _hello("d1"), 100.2))


def test_core_a_refused_d_restarted_on_a_clock_behind_skips_the_backoff() -> None:
    from test_handshake_refusal import D_AGENT, WHY, _hello, _prefill

    from kvpush.core.actions import Connect

    core = _prefill()
    core.notification(D_AGENT, _hello("d5"), 100.0)
    core.connected("D", 0, D_AGENT, "d5", 0, WHY, 100.1)  # refused, D told
    fixed = core.notification(D_AGENT, _hello("d1"), 100.5)  # restarted (a clock behind), in backoff
    assert any(isinstance(a, Connect) for a in fixed), fixed


# ---------------------------------------------------------------------------------------------
# A D worker re-created in its live process over the same memory, with another size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lost_cancel", [False, True], ids=["closed", "cancel-lost"])
def test_d_worker_recreated_over_the_same_memory_with_fewer_blocks(lost_cancel: bool) -> None:
    """The engine keeps its KV memory and re-creates its D worker over a smaller part of it:
    the regions start at the same addresses with another size (NIXL registers them again in
    the same process, under the same agent name). P must write through the new start's
    regions only: new requests land byte-exact, and no byte of the memory changes outside the
    blocks a request named. A request registered before the restart is settled by the old
    worker's close() (its CANCEL acknowledged: released, nothing lands) or, when P never got
    the CANCEL (``cancel-lost``), reported failed and NOT released: P still holds it with a
    fresh grant and writes it through the old start's agent, and the bytes do land in this
    process's memory, in exactly its blocks (which the engine must therefore keep)."""
    import torch

    from kvpush.core.manager import get_plugin_manager
    from kvpush.core.receiver import PushReceiver
    from kvpush.core.sender import PushSender
    from kvpush.core.types import RequestMetadata, TransferParams
    from kvpush.core.worker import WorkerConfig
    from kvpush.layouts.uniform import allocate_kv_caches

    model = ModelSpec(name="inproc", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=2)
    pm = get_plugin_manager(load_entrypoints=False)
    p_server, d_server = SideChannelServer("P"), SideChannelServer("D")
    p_caches = allocate_kv_caches(model, parallel, 32)
    for tensor in p_caches.values():
        tensor.view(torch.int16).copy_(torch.randint(-30_000, 30_000, tensor.shape, dtype=torch.int16))
    memory = allocate_kv_caches(model, parallel, 32)  # D's KV memory, kept across the restart

    lossy = {"drop_notifs": 1.0, "notif_prefixes": ["CANCEL:"]} if lost_cancel else {}
    fresh = {"fresh_s": 6.0, "peer_silence_s": 8.0} if lost_cancel else {}

    def config(engine: str, port: int) -> WorkerConfig:
        return WorkerConfig(
            engine_id=engine,
            parallel=parallel,
            model=model,
            side_channel_port=port,
            transport="faulty",
            transport_options={"inner": "nixl", **(lossy if engine == "P" else {})},
            close_timeout_s=1.0,
            **{**FAST, **fresh},
        )

    def decode(blocks: int) -> PushReceiver:
        caches = {name: tensor[:, :blocks] for name, tensor in memory.items()}  # same addresses
        receiver = PushReceiver(config("D", d_server.port), caches, pm=pm)
        receiver.start()
        d_server.publish(parallel.rank, receiver.handshake_payload())
        return receiver

    def add(receiver: PushReceiver, rid: str, blocks: list[int]) -> None:
        params = {
            "remote_engine_id": "P",
            "remote_host": "127.0.0.1",
            "remote_port": p_server.port,
            "tp_size": 1,
            "pp_size": 1,
            "transfer_id": f"key-{rid}",
        }
        receiver.add_request(
            RequestMetadata(request_id=rid, block_ids=[blocks], params=TransferParams.from_dict(params))
        )

    def outcome(receiver: PushReceiver, rid: str) -> str:
        deadline = time.monotonic() + 15
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            got = receiver.get_finished()
            seen.update({r: "done" for r in got.done})
            seen.update({r: f"failed: {why}" for r, why in got.failed.items()})
            seen.update({r: f"cancelled: {why}" for r, why in got.cancelled.items()})
            if rid in seen:
                return seen[rid]
            time.sleep(0.01)
        raise AssertionError(f"{rid}: no outcome within 15s")

    sender = PushSender(config("P", p_server.port), p_caches, pm=pm)
    sender.start()
    p_server.publish(parallel.rank, sender.handshake_payload())
    receiver = decode(32)
    named: set[int] = set()
    try:
        add(receiver, "r1", [1, 2])
        sender.request_finished("p1", [[5, 6]], match_key="key-r1")
        assert outcome(receiver, "r1") == "done"
        named |= {1, 2}
        add(receiver, "r2", [20, 21])  # registered; P has not finished
        time.sleep(0.5)
        receiver.close()  # the engine re-creates its worker over blocks 0-7 of the same memory
        closed = receiver.get_finished()
        assert "r2" in closed.failed and ("r2" in closed.released) is not lost_cancel, closed
        if lost_cancel:
            named |= {20, 21}  # not released: the engine keeps them
        receiver = decode(8)
        sender.request_finished("p2", [[7, 8]], match_key="key-r2")
        add(receiver, "r3", [3, 4])
        sender.request_finished("p3", [[9, 10]], match_key="key-r3")
        r3 = outcome(receiver, "r3")
        add(receiver, "r4", [5, 6])
        sender.request_finished("p4", [[11, 12]], match_key="key-r4")
        assert outcome(receiver, "r4") == "done", r3
        named |= {5, 6} | ({3, 4} if r3 == "done" else set())
        time.sleep(1.0)  # a late WRITE of r2 would land by now
        for name, tensor in memory.items():
            for d_block, p_block in ((1, 5), (2, 6), (5, 11), (6, 12)) + (
                ((3, 9), (4, 10)) if r3 == "done" else ()
            ):
                got, want = tensor[:, d_block].view(torch.int16), p_caches[name][:, p_block].view(torch.int16)
                assert torch.equal(got, want), (name, d_block)
            late = tensor[:, [20, 21]].view(torch.int16)
            if lost_cancel and bool(late.ne(0).any()):  # r2's late WRITE, whole, into r2's blocks
                assert torch.equal(late, p_caches[name][:, [7, 8]].view(torch.int16)), name
            others = [b for b in range(32) if b not in named]
            written = [b for b in others if bool(tensor[:, b].ne(0).any())]
            assert not written, (
                f"{name}: blocks {written} of D's memory were written, no live request named them"
            )
    finally:
        receiver.close()
        sender.close()
        p_server.close()
        d_server.close()


def test_p_stages_restarted_one_by_one_with_another_layer_split() -> None:
    """PP2 (layers 0-1 | 2-3) becomes PP2 (0-2 | 3), one stage at a time, the other one
    running: between the two restarts P's side channel serves a new stage 0 (layers 0-2) and
    the old stage 1 (layers 2-3), whose windows overlap. D must not count that mix as a
    producer set (layer 2 written twice, or by a stage that is gone): requests registered
    before or between the restarts end failed and released, or done with every byte right;
    once both stages run the new split, requests land byte-exact."""
    with Rig(Side(pp=2), Side()) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)
        time.sleep(0.5)
        rig.restart_p_stage(0, 0, 3)
        rig.push("mid", 3, 8, 20, 3)
        outcomes = rig.settle(["old", "mid"])
        rig.check_bytes(outcomes)
        rig.restart_p_stage(1, 3, 4)
        for i, first in ((1, 30), (2, 40), (3, 50)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
            outcomes = rig.settle([f"new-{i}"])
            rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes


HMA = attrs.evolve(
    BASE,
    layer_groups=[i % 2 for i in range(4)],
    layer_kinds=["full" if i % 2 == 0 else "sliding_window" for i in range(4)],
)


def test_hma_d_restarted_with_fewer_blocks_in_one_group() -> None:
    """Hybrid model: D comes back with its sliding-window group cut to 8 blocks (the full group
    keeps 64). A registration of the old start naming blocks 10-13 of both groups must never be
    written (in the new start they are past the group's end); new requests land byte-exact."""
    with Rig(Side(model=HMA, layout="hma"), Side(model=HMA, layout="hma")) as rig:
        rig.push("warm", 1, 0, 0, 3)
        rig.check_bytes(rig.settle(["warm"]))
        rig.prefill("old", 2, 3, 4)
        rig.add("old", 2, 10, 4)
        time.sleep(0.5)
        rig.restart_d(Side(model=HMA, layout="hma", blocks=(64, 8)))
        rig.finish("old", 3, 4)
        for i, first in ((1, 0), (2, 3), (3, 5)):
            rig.push(f"new-{i}", 10 + i, 10 + 4 * i, first, 3)
            outcomes = rig.settle([f"new-{i}"])
            rig.check_bytes(outcomes)
        assert done_everywhere(outcomes["new-3"]), outcomes
        p = rig.wait_p(["old"])
        assert all(reason is not None for reason in p["old"].values()), p
