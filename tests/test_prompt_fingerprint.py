"""Finding 10: a key reused for another prompt must not pair D with that prompt's KV.

P pairs D's PUSH_REG with its finished prefill by the match key. With a prompt fingerprint on
both legs, a registration for another prompt is never written: it and P's leg fail, naming the
key. The pairing rules are tested on P's pure core (every order of finish, registrations from
several D ranks, repeats, a right registration after a wrong one); the wire field, the params
and the engine API on their own; the whole path over real NIXL with D in another process.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.core import notifications as wire
from kvpush.core.actions import Post, Report, Send
from kvpush.core.errors import ConfigError, WireError
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.types import (
    Notification,
    PushRegistration,
    RankKey,
    ReadSpec,
    TransferParams,
)
from kvpush.engine import prompt_fingerprint

P0 = RankKey(0, 0)
A = prompt_fingerprint([1, 2, 3, 4])
B = prompt_fingerprint([1, 2, 3, 5])
NOW = 100.0


# ---------------------------------------------------------------------------- P's core


def make_core(decode_tp: int = 1) -> PrefillCore:
    """A P rank writing to every rank of a D engine of ``decode_tp`` ranks."""

    def plan(blocks: Any, reg: PushRegistration) -> list[ReadSpec]:
        return [
            ReadSpec(dst_tp_rank=r, local_block_ids=blocks, remote_block_ids=reg.block_ids)
            for r in range(reg.decode_tp_size)
        ]

    settings = PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1)
    return PrefillCore(settings, plan=plan)


def reg(
    rid: str = "d-1", fp: str | None = A, rank: int = 0, tp: int = 1, key: str = "x-1"
) -> PushRegistration:
    return PushRegistration(
        request_id=rid,
        match_key=key,
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=5601,
        decode_tp_size=tp,
        block_ids=[[3 + rank]],
        remote_engine_id="P",
        decode_tp_rank=rank,
        decode_incarnation="d1",
        grant=NOW,
        fresh_s=30.0,
        prompt_fingerprint=fp,
    )


def agent(rank: int) -> str:
    return f"D-agent-{rank}"


def connect(core: PrefillCore, tp: int = 1, ranks: Any = None) -> list[Any]:
    """D's ranks say HELLO and P loads them (as before any PUSH_REG in a real run)."""
    out: list[Any] = []
    for rank in range(tp) if ranks is None else ranks:
        out += core.notification(agent(rank), decode(wire.encode_hello(reg(rank=rank, tp=tp), rank)), NOW)
        out += core.connected("D", rank, agent(rank), "d1", tp, "", NOW)
    return out


def decode(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def register(core: PrefillCore, registration: PushRegistration, now: float = NOW) -> list[Any]:
    """D's PUSH_REG, through the wire (so the optional field is encoded and decoded)."""
    return core.notification(
        agent(registration.decode_tp_rank), decode(wire.encode_push_reg(registration)), now
    )


def fails(actions: list[Any]) -> dict[tuple[str, str], Notification]:
    """FAILs sent to D: (agent, D request id) -> the decoded notification."""
    out = {}
    for action in actions:
        if isinstance(action, Send) and action.message.startswith(wire.FAIL_PREFIX):
            note = decode(action.message)
            out[(action.agent, note.request_id)] = note
    return out


def posts(actions: list[Any]) -> list[Post]:
    return [a for a in actions if isinstance(a, Post)]


def reports(actions: list[Any]) -> list[Report]:
    return [a for a in actions if isinstance(a, Report)]


def assert_prompts_differ(reason: str, key: str = "x-1") -> None:
    assert repr(key) in reason and "prompt" in reason and "differ" in reason, reason


def test_a_registration_for_another_prompt_is_refused_after_the_finish() -> None:
    core = make_core()
    connect(core)
    core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    out = register(core, reg(fp=B))
    assert posts(out) == []
    note = fails(out)[(agent(0), "d-1")]
    assert_prompts_differ(note.reason)
    assert note.unsettled is False  # nothing was written into D's blocks
    (report,) = reports(out)
    assert (report.request_id, report.outcome) == ("p-1", "failed")
    assert_prompts_differ(report.reason)
    assert core.state_sizes()["requests"] == 0 and core.stats["prompt_mismatches"] == 1


def test_a_registration_for_another_prompt_is_refused_at_the_finish() -> None:
    core = make_core()
    connect(core)
    assert register(core, reg(fp=B)) == []  # held: P has no prefill for the key yet
    out = core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    assert posts(out) == []
    assert_prompts_differ(fails(out)[(agent(0), "d-1")].reason)
    assert [r.outcome for r in reports(out)] == ["failed"]


@pytest.mark.parametrize(("p_fp", "d_fp"), [(A, A), (A, None), (None, B), (None, None)])
def test_same_prompt_or_a_fingerprint_not_given_pairs_on_the_key(p_fp: str | None, d_fp: str | None) -> None:
    core = make_core()
    connect(core)
    core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=p_fp)
    out = register(core, reg(fp=d_fp))
    assert len(posts(out)) == 1 and fails(out) == {}


def test_every_d_rank_of_a_request_for_another_prompt_is_told() -> None:
    """MLA fan-out / TP 2: every D rank registers. The first wrong one fails P's leg; the other
    rank's registration, arriving after, meets the ended key and is refused alike."""
    core = make_core()
    connect(core, tp=2)
    core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    first = register(core, reg(fp=B, rank=0, tp=2))
    second = register(core, reg(fp=B, rank=1, tp=2))
    assert posts(first + second) == []
    assert_prompts_differ(fails(first)[(agent(0), "d-1")].reason)
    assert_prompts_differ(fails(second)[(agent(1), "d-1")].reason)
    assert [r.outcome for r in reports(first + second)] == ["failed"]


def test_a_right_registration_after_a_wrong_one_is_refused_too() -> None:
    """The key named two prompts: P cannot tell which D is the router's, so once it refused the
    wrong one it writes to neither (the right D fails at once, naming why, instead of waiting)."""
    core = make_core()
    connect(core)
    core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    wrong = register(core, reg("d-wrong", fp=B))
    right = register(core, reg("d-right", fp=A))
    assert posts(wrong + right) == []
    assert_prompts_differ(fails(right)[(agent(0), "d-right")].reason)
    assert len(reports(wrong + right)) == 1


def test_the_same_wrong_registration_twice_is_refused_twice_and_p_reports_once() -> None:
    core = make_core()
    connect(core)
    core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    out = register(core, reg(fp=B)) + register(core, reg(fp=B))
    assert posts(out) == [] and len(reports(out)) == 1
    assert [f for f in out if isinstance(f, Send) and f.message.startswith(wire.FAIL_PREFIX)][1:]


def test_a_wrong_registration_after_the_push_began_is_refused_alone() -> None:
    """P already writes the key to the D request of its own prompt: a later registration of
    another prompt is refused (nothing written to it) and the push in flight goes on."""
    core = make_core()
    connect(core, tp=2)
    core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    (post,) = posts(register(core, reg("d-right", fp=A, rank=0, tp=2)))
    assert core.confirm_post(post.key, post.dst, NOW)
    core.posted(post.key, post.dst, ["h0"], 64, NOW)
    wrong = register(core, reg("d-wrong", fp=B, rank=1, tp=2))
    note = fails(wrong)[(agent(1), "d-wrong")]
    assert_prompts_differ(note.reason) and not note.unsettled
    assert posts(wrong) == [] and reports(wrong) == []
    (post1,) = posts(register(core, reg("d-right", fp=A, rank=1, tp=2)))
    assert post1.registration.request_id == "d-right"
    assert core.confirm_post(post1.key, post1.dst, NOW)
    core.posted(post1.key, post1.dst, ["h1"], 64, NOW)
    out = core.write_settled("x-1", 0, "h0", True, NOW) + core.write_settled("x-1", 1, "h1", True, NOW)
    assert [(r.request_id, r.outcome) for r in reports(out)] == [("p-1", "sent")]
    late = register(core, reg("d-late", fp=B, rank=0, tp=2))  # after the push: the tombstone
    assert_prompts_differ(fails(late)[(agent(0), "d-late")].reason)
    assert register(core, reg("d-right", fp=A, rank=0, tp=2)) == []  # a repeat: ignored as before


def test_two_prompts_registered_on_one_rank_before_the_finish_both_fail() -> None:
    """Before P finished, D rank 0 registered the key for prompt A, then (another D request) for
    prompt B, which replaces it: P decides at the finish, and answers both."""
    core = make_core()
    connect(core)
    register(core, reg("d-a", fp=A))
    register(core, reg("d-b", fp=B))
    out = core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    assert posts(out) == []
    got = fails(out)
    assert set(got) == {(agent(0), "d-a"), (agent(0), "d-b")}
    for note in got.values():
        assert_prompts_differ(note.reason)
    assert [r.outcome for r in reports(out)] == ["failed"]


def test_the_engine_the_router_bound_is_checked_at_the_finish_too() -> None:
    """Before the finish, engine D2 registered first (a tentative binding) and D, the engine the
    router names at the finish, registered for another prompt: P serves D only, and refuses it."""
    import attrs

    core = make_core()
    connect(core)
    other = attrs.evolve(reg("d2-1", fp=A), decode_engine_id="D2", decode_port=5602)
    core.notification("D2-agent-0", decode(wire.encode_hello(other, 0)), NOW)
    core.connected("D2", 0, "D2-agent-0", "d1", 1, "", NOW)
    core.notification("D2-agent-0", decode(wire.encode_push_reg(other)), NOW)
    register(core, reg("d-1", fp=B))  # a candidate: the key is tentatively D2's
    out = core.finished("x-1", "p-1", ((5,),), "D", NOW, fingerprint=A)
    assert posts(out) == []
    assert_prompts_differ(fails(out)[(agent(0), "d-1")].reason)
    assert [r.outcome for r in reports(out)] == ["failed"]


def test_a_wrong_registration_from_a_rank_p_has_not_loaded_is_answered_once_loaded() -> None:
    core = make_core()
    core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=A)
    out = register(core, reg(fp=B))
    assert fails(out) == {} and [a.engine_id for a in out if type(a).__name__ == "Connect"] == ["D"]
    assert [r.outcome for r in reports(out)] == ["failed"]
    loaded = core.connected("D", 0, agent(0), "d1", 1, "", NOW)
    assert_prompts_differ(fails(loaded)[(agent(0), "d-1")].reason)


# ---------------------------------------------------------------------------- every order


class Pairing(RuleBasedStateMachine):
    """One key, one P rank, a D engine of two ranks and two D requests under that key: ``d-A``
    of P's prompt and ``d-B`` of another. Any order of HELLOs, registrations (repeats too),
    P's finish, posts and WRITE completions. P never writes ``d-B`` while P stated its prompt;
    at the end P reported once, and (P's prompt stated) each registration was written or
    refused, ``d-B`` naming the differing prompts."""

    def __init__(self) -> None:
        super().__init__()
        self.core = make_core()
        self.fp: str | None = A
        self.finished = False
        self.loaded: set[int] = set()
        self.registered: dict[tuple[str, int], int] = {}
        self.pending: list[Post] = []
        self.inflight: dict[str, tuple[int, str]] = {}
        self.written: set[tuple[str, int]] = set()
        self.failed: dict[tuple[str, int], str] = {}
        self.reports: list[Report] = []
        self.handles = 0

    @initialize(fp=st.sampled_from([A, None]))
    def start(self, fp: str | None) -> None:
        self.fp = fp

    def _run(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Post):
                self.pending.append(action)
            elif isinstance(action, Report):
                self.reports.append(action)
            elif isinstance(action, Send) and action.message.startswith(wire.FAIL_PREFIX):
                note = decode(action.message)
                rank = int(action.agent.rsplit("-", 1)[1])
                self.failed.setdefault((note.request_id, rank), note.reason)

    @rule(rank=st.sampled_from([0, 1]))
    def hello(self, rank: int) -> None:
        self._run(connect(self.core, tp=2, ranks=[rank]))
        self.loaded.add(rank)

    @precondition(lambda self: self.loaded)
    @rule(rid=st.sampled_from(["d-A", "d-B"]), rank=st.sampled_from([0, 1]))
    def register(self, rid: str, rank: int) -> None:
        if rank not in self.loaded:
            return  # D registers once P answered its HELLO
        self.registered[(rid, rank)] = self.registered.get((rid, rank), 0) + 1
        self._run(register(self.core, reg(rid, fp=A if rid == "d-A" else B, rank=rank, tp=2)))

    @precondition(lambda self: not self.finished)
    @rule()
    def finish(self) -> None:
        self.finished = True
        self._run(self.core.finished("x-1", "p-1", ((5,),), "", NOW, fingerprint=self.fp))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 7))
    def post(self, i: int) -> None:
        post = self.pending.pop(i % len(self.pending))
        if not self.core.confirm_post(post.key, post.dst, NOW):
            return
        self.handles += 1
        handle = f"h{self.handles}"
        self._run(self.core.posted(post.key, post.dst, [handle], 64, NOW))
        self.inflight[handle] = (post.dst, post.registration.request_id)
        self.written.add((post.registration.request_id, post.dst))
        assert self.fp is None or post.registration.prompt_fingerprint in (None, self.fp), post

    @precondition(lambda self: self.inflight)
    @rule(i=st.integers(0, 7))
    def settle(self, i: int) -> None:
        handle = sorted(self.inflight)[i % len(self.inflight)]
        rank, _ = self.inflight.pop(handle)
        self._run(self.core.write_settled("x-1", rank, handle, True, NOW))

    @invariant()
    def reported_at_most_once(self) -> None:
        assert len(self.reports) <= 1, self.reports

    def teardown(self) -> None:
        for rank in (0, 1):
            if rank not in self.loaded:
                self.hello(rank)
        if not self.finished:
            self.finish()
        while self.pending or self.inflight:
            if self.pending:
                self.post(0)
            else:
                self.settle(0)
        self._run(self.core.handle_timer(NOW + 1000))  # the lease of a D rank that never came
        assert len(self.reports) == 1, self.reports
        if self.fp is None:
            return
        for rid, rank in self.registered:
            outcome = (rid, rank) in self.written or (rid, rank) in self.failed
            assert outcome, f"{rid} rank {rank} was neither written nor refused: {self.failed}"
            if rid == "d-B":
                assert_prompts_differ(self.failed[(rid, rank)])


Pairing.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPairing = pytest.mark.timeout(300)(Pairing.TestCase)


# ---------------------------------------------------------------------------- the pieces


def test_the_fingerprint_is_a_stable_digest_of_the_token_ids() -> None:
    import numpy as np

    ids = [151643, 9707, 11, 1879, 0, 2**40]
    assert prompt_fingerprint(ids) == prompt_fingerprint(tuple(ids)) == prompt_fingerprint(np.array(ids))
    assert prompt_fingerprint([1, 2, 3]) == "b7f2baeb4faf5ff667847a0f57979755"  # pinned: both legs
    assert len({prompt_fingerprint(ids), prompt_fingerprint(ids[:-1]), prompt_fingerprint(ids[::-1])}) == 3
    assert prompt_fingerprint([]) != prompt_fingerprint([0])
    for bad in ("1 2 3", b"\x01", [1.5], [2**63], None):
        with pytest.raises(ConfigError, match="token ids"):
            prompt_fingerprint(bad)  # type: ignore[arg-type]


def test_push_reg_carries_the_fingerprint_as_an_optional_field() -> None:
    note = decode(wire.encode_push_reg(reg(fp=A)))
    assert note.registration is not None and note.registration.prompt_fingerprint == A
    absent = wire.encode_push_reg(reg(fp=None))
    assert b"pf" not in absent  # an old P sees nothing new; a new P reads "not given"
    assert decode(absent).registration.prompt_fingerprint is None  # type: ignore[union-attr]
    body = wire.unpack(absent[len(wire.PUSH_REG_PREFIX) :], "test")
    for bad in (7, "", "x" * 129, ["a"]):
        message = wire.PUSH_REG_PREFIX + wire.pack({**body, "pf": bad})
        with pytest.raises(WireError, match="'pf'"):
            wire.decode_notification(message)
    newer = wire.PUSH_REG_PREFIX + wire.pack({**body, "v": [wire.NOTIF_VERSION[0], 0]})
    assert decode(newer).registration.prompt_fingerprint is None  # type: ignore[union-attr]


def test_transfer_params_validate_the_fingerprint_naming_the_field() -> None:
    base = {"remote_engine_id": "P", "remote_host": "h", "remote_port": 1, "transfer_id": "x"}
    params = TransferParams.from_dict({**base, "prompt_fingerprint": A})
    assert params.prompt_fingerprint == A and params.to_dict()["prompt_fingerprint"] == A
    assert TransferParams.from_dict(base).prompt_fingerprint is None
    assert "prompt_fingerprint" not in TransferParams.from_dict(base).to_dict()
    for bad in (12, "", "f" * 129, [A]):
        with pytest.raises(ConfigError, match=r"kv_transfer_params\['prompt_fingerprint'\]"):
            TransferParams.from_dict({**base, "prompt_fingerprint": bad})
    with pytest.raises(ConfigError, match=r"TransferParams\.prompt_fingerprint"):
        TransferParams(remote_engine_id="P", remote_host="h", remote_port=1, prompt_fingerprint=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- whole paths


@pytest.mark.parametrize(
    ("mla", "prefill_pp", "prefill_tp", "decode_tp"),
    [(False, 1, 1, 2), (False, 2, 1, 2), (False, 1, 2, 1), (True, 1, 1, 2)],
    ids=["mha-TP1-to-TP2", "mha-PP2-to-TP2", "mha-TP2-to-TP1", "mla-fan-out"],
)
def test_a_push_for_another_prompt_fails_both_legs_and_writes_nothing(
    mla: bool, prefill_pp: int, prefill_tp: int, decode_tp: int
) -> None:
    """Through the engine API (loopback transport, bytes really copied), every P rank and every
    D rank: D's request for prompt B is refused by P's prefill of prompt A under the same key,
    nothing is written, both legs fail naming the key; the same key and prompt still pair."""
    import torch
    from cluster import MHA, MLA, Cluster, kv_bytes
    from test_push_flow import assert_pushed

    topology = {"prefill_pp": prefill_pp, "prefill_tp": prefill_tp, "decode_tp": decode_tp}
    with Cluster(MLA if mla else MHA, **topology) as cluster:
        before = {tp: {k: kv_bytes(t).clone() for k, t in c.items()} for tp, c in cluster.d_caches.items()}
        for sender in cluster.senders.values():
            with pytest.raises(ConfigError, match="prompt_fingerprint"):
                sender.request_finished("p-0", [[1]], match_key="x-0", prompt_fingerprint=5)  # type: ignore[arg-type]
            sender.request_finished("p-1", [[5, 6]], match_key="x-1", prompt_fingerprint=A)
        cluster.add("d-1", [[3, 4]], "x-1", prompt_fingerprint=B)
        for reason in cluster.wait_decode("d-1").values():
            assert reason is not None
            assert_prompts_differ(reason)
        for p_reason in cluster.wait_prefill("p-1").values():
            assert p_reason is not None
            assert_prompts_differ(p_reason)
        cluster.wait_released("d-1")
        for tp, caches in cluster.d_caches.items():
            for layer, tensor in caches.items():
                assert torch.equal(kv_bytes(tensor), before[tp][layer]), f"D rank {tp} {layer} written"
        for sender in cluster.senders.values():
            assert sender.stats["prompt_mismatches"] >= 1 and sender.stats["writes"] == 0
        for sender in cluster.senders.values():
            sender.request_finished("p-2", [[7]], match_key="x-2", prompt_fingerprint=A)
        cluster.add("d-2", [[9]], "x-2", prompt_fingerprint=A)
        assert set(cluster.wait_decode("d-2").values()) == {None}
        assert_pushed(cluster, [7], [9])


def _decode_process(conn: Any, p_port: int, requests: list[tuple[str, list[int], dict[str, Any]]]) -> None:
    """A D engine of one rank in its own process (real NIXL): receives ``requests`` and sends
    back, per request, (outcome, reason, whether its blocks changed)."""
    import torch
    from cluster import MHA

    from kvpush.core.manager import get_plugin_manager
    from kvpush.core.receiver import PushReceiver
    from kvpush.core.sidechannel import SideChannelServer
    from kvpush.core.types import ParallelConfig
    from kvpush.core.worker import WorkerConfig
    from kvpush.layouts.uniform import allocate_kv_caches

    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MHA.num_layers)
    caches = allocate_kv_caches(MHA, parallel, 16, device="cpu")
    server = SideChannelServer("D")
    config = WorkerConfig(
        engine_id="D", parallel=parallel, model=MHA, transport="nixl", side_channel_port=server.port
    )
    receiver = PushReceiver(config, caches, pm=get_plugin_manager(load_entrypoints=False))
    try:
        receiver.start()
        server.publish(parallel.rank, receiver.handshake_payload())
        results: dict[str, tuple[str, str]] = {}
        for rid, blocks, params in requests:
            before = [t.view(torch.int16)[:, blocks].clone() for t in caches.values()]
            receiver.add_request_params(rid, [blocks], {**params, "remote_port": p_port})
            deadline = time.monotonic() + 60
            while rid not in results and time.monotonic() < deadline:
                got = receiver.get_finished()
                results.update({r: ("done", "") for r in got.done})
                results.update({r: ("failed", why) for r, why in got.failed.items()})
                time.sleep(0.01)
            outcome, reason = results.get(rid, ("timeout", "no outcome within 60 s"))
            after = [t.view(torch.int16)[:, blocks] for t in caches.values()]
            changed = any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
            conn.send((rid, outcome, reason, changed))
    finally:
        receiver.close()
        server.close()
        conn.close()


@pytest.mark.timeout(240)
def test_over_real_nixl_d_in_another_process_refuses_another_prompts_kv() -> None:
    """P here, D in its own process, real NIXL agents: D's request for another prompt under P's
    key fails on both sides naming the key and the differing prompts, its blocks untouched; the
    next request (same prompt, or a D stating no fingerprint) is pushed as before."""
    import multiprocessing

    import torch
    from cluster import MHA

    from kvpush.core.manager import get_plugin_manager
    from kvpush.core.sender import PushSender
    from kvpush.core.sidechannel import SideChannelServer
    from kvpush.core.types import ParallelConfig
    from kvpush.core.worker import WorkerConfig
    from kvpush.layouts.uniform import allocate_kv_caches

    pytest.importorskip("nixl")
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MHA.num_layers)
    caches = allocate_kv_caches(MHA, parallel, 16, device="cpu")
    for tensor in caches.values():
        tensor.view(torch.int16).copy_(torch.randint(1, 30_000, tensor.shape, dtype=torch.int16))
    server = SideChannelServer("P")
    config = WorkerConfig(
        engine_id="P", parallel=parallel, model=MHA, transport="nixl", side_channel_port=server.port
    )
    sender = PushSender(config, caches, pm=get_plugin_manager(load_entrypoints=False))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    base = {"remote_engine_id": "P", "remote_host": "127.0.0.1", "tp_size": 1, "pp_size": 1}
    requests = [
        ("d-1", [3, 4], {**base, "transfer_id": "x-1", "prompt_fingerprint": B}),
        ("d-2", [5, 6], {**base, "transfer_id": "x-2", "prompt_fingerprint": A}),
        ("d-3", [7], {**base, "transfer_id": "x-3"}),
    ]
    process = ctx.Process(target=_decode_process, args=(theirs, server.port, requests), daemon=True)
    try:
        sender.start()
        server.publish(parallel.rank, sender.handshake_payload())
        for rid, key, blocks in (("p-1", "x-1", [[1, 2]]), ("p-2", "x-2", [[8, 9]]), ("p-3", "x-3", [[10]])):
            sender.request_finished(rid, blocks, match_key=key, prompt_fingerprint=A)
        process.start()
        got = {}
        for _ in requests:
            assert ours.poll(120), f"D process sent nothing within 120 s (got {got})"
            rid, outcome, reason, changed = ours.recv()
            got[rid] = (outcome, reason, changed)
        outcome, reason, changed = got["d-1"]
        assert outcome == "failed" and not changed, got["d-1"]
        assert_prompts_differ(reason)
        assert got["d-2"][:1] == ("done",) and got["d-2"][2], got["d-2"]
        assert got["d-3"][:1] == ("done",) and got["d-3"][2], got["d-3"]  # D stated none: the key
        results: dict[str, str | None] = {}
        deadline = time.monotonic() + 30
        while len(results) < 3 and time.monotonic() < deadline:
            finished = sender.get_finished()
            results.update({r: None for r in finished.sent})
            results.update(finished.failed)
            time.sleep(0.01)
        assert results.keys() == {"p-1", "p-2", "p-3"}, results
        assert results["p-2"] is None and results["p-3"] is None
        assert results["p-1"] is not None
        assert_prompts_differ(results["p-1"])
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
        sender.close()
        server.close()
