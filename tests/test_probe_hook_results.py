"""Third-party plugins that misbehave: what every hook *returns* (and how it fails), on P and D.

tests/test_plugin_author_probe.py covers a hook that raises ZeroDivisionError or returns None,
and a read-spec plugin that edits block ids or moves the wrong heads. Here:

- a read-spec plugin whose slices start at the right head but cover only part of what the
  producer must write into a D rank (P only, or answering the handshake's replay otherwise
  than a request): D reported the request done with heads nobody wrote;
- a decoder returning something that is not a ``Notification``: the rest of the writer's
  batch (another request's DONE) was lost, and that request failed at its deadline;
- a hook raising a ``BaseException`` that is not an ``Exception`` (a plugin's own abort class,
  ``SystemExit``): it escaped the writer's round, and an unrelated request failed with it;
- a hook returning the wrong type: a bare ``TypeError``/``AttributeError`` naming no plugin;
- a metadata field named like one of kvpush's own: silently replaced, or trusted as kvpush's;
- a decoder slower than D's deadlines: they wait for it (no fix offered);
- values out of range, and a P-side plugin slower than D's deadline, which hold (passing tests).

Loopback for pure logic (it copies the bytes too), real NIXL agents where the bytes matter.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from cluster import Cluster, kv_bytes
from test_coverage_adversarial import Push, with_plugins

from kvpush import hookimpl
from kvpush.core.errors import KvpushError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.types import HandshakeMode, PushJob, ReadSpec, Role
from kvpush.testing import make_agent_metadata

# ------------------------------------------------------------------------------ helpers


def run_push(**kwargs: Any) -> tuple[dict[int, str | None], Push]:
    """One request PP1 through ``Push``; D's outcome per rank, checked: a D rank that reported
    done holds exactly P's bytes (AssertionError otherwise)."""
    push = Push(pp=1, **kwargs)
    try:
        outcome = push.push(timeout_s=30)
        push.assert_exact_or_failed(outcome)
    finally:
        push.close()
    return outcome, push


def untouched(push: Push) -> bool:
    return not any(t.view(torch.int8).any() for caches in push.d_caches.values() for t in caches.values())


def inject_first(receiver: Any, frame: bytes, when: Any) -> list[int]:
    """Put ``frame`` first in the first batch D drains that ``when`` picks (a foreign message
    arriving with a DONE); returns a list that holds 1 once it was injected."""
    real = receiver.transport.drain_notifs
    injected: list[int] = []

    def drain() -> list[tuple[str, bytes]]:
        batch = real()
        if batch and not injected and any(when(message) for _, message in batch):
            injected.append(1)
            batch = [(batch[0][0], frame), *batch]
        return batch

    receiver.transport.drain_notifs = drain
    return injected


def is_done(message: bytes) -> bool:
    return message.startswith(b"DONE:")


# ------------------------------------------------------------------------------ read specs: a part of a share


class FirstHalfOfShare:
    """A read-spec plugin writing the first half of the heads this P rank owes each D rank, at
    the right place: every slice starts at the right model head and its two sides are equally
    long, so it passes P's wrong-heads check; the other half is written by nobody. With
    ``replay_ok`` it answers the handshake's replay (block ids ``(0,)`` into ``(1,)``) as the
    built-in does and only requests otherwise: a plugin whose answer depends on the request."""

    def __init__(self, replay_ok: bool = False) -> None:
        self.replay_ok = replay_ok

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> list[ReadSpec] | None:
        if self.replay_ok and job.local_block_ids == ((0,),):
            return None
        me, d_tp = job.local.parallel, job.decode_tp_size
        ids = {"local_block_ids": job.local_block_ids, "remote_block_ids": job.remote_block_ids}
        if me.tp_size == d_tp:  # the first half of the whole block
            return [ReadSpec(dst_tp_rank=me.tp_rank, local_part=(0, 2), remote_part=(0, 2), **ids)]
        if me.tp_size == 2 * d_tp:  # the first half of its block into the first half of its slot
            slot = me.tp_rank % 2
            return [
                ReadSpec(dst_tp_rank=me.tp_rank // 2, local_part=(0, 2), remote_part=(2 * slot, 4), **ids)
            ]
        return None


@pytest.mark.parametrize(
    ("transport", "p_tp"),
    [("loopback", 1), ("nixl", 1), ("loopback", 2)],
    ids=["loopback", "nixl", "tp2-to-1"],
)
def test_a_read_spec_plugin_on_p_only_writing_half_its_share_never_delivers(
    transport: str, p_tp: int
) -> None:
    outcome, _ = run_push(
        p_tp=p_tp, d_tp=1, transport=transport, p_pm=with_plugins(("half", FirstHalfOfShare()))
    )
    assert all(outcome.values()), outcome
    assert "written by no producer" in str(outcome), outcome


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_a_read_spec_plugin_planning_requests_unlike_its_handshake_never_delivers(transport: str) -> None:
    pm = with_plugins(("half", FirstHalfOfShare(replay_ok=True)))
    outcome, _ = run_push(p_tp=1, d_tp=1, transport=transport, p_pm=pm, d_pm=pm)
    assert all(outcome.values()), outcome
    assert "kvpush_build_read_specs" in str(outcome), outcome


class OutOfRange:
    """A read-spec plugin on P only returning one bad value (equal TP)."""

    def __init__(self, **change: Any) -> None:
        self.change = change

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> list[ReadSpec] | None:
        me = job.local.parallel
        spec = {"dst_tp_rank": me.tp_rank, **self.change}
        ids = {"local_block_ids": job.local_block_ids, "remote_block_ids": job.remote_block_ids}
        return [ReadSpec(**spec, **ids)] * (2 if self.change.get("dst_tp_rank") == "twice" else 1)


@pytest.mark.parametrize(
    "change",
    [
        {"remote_part": (2, 2)},  # past the end of D's block
        {"remote_part": (0, 0)},
        {"local_part": (-1, 2)},
        {"remote_part": (0, 2)},  # a whole block into half of one: longer source than destination
        {"local_part": (0, 2)},  # half a block into a whole one
        {"dst_tp_rank": 5},  # a D rank that does not exist
    ],
    ids=["past-end", "count-0", "negative", "longer-source", "shorter-source", "unknown-rank"],
)
def test_read_spec_values_out_of_range_fail_the_request_and_write_nothing(change: dict[str, Any]) -> None:
    """Holds: each is refused (P's handshake, or its plan check) before a byte moves."""
    outcome, push = run_push(p_tp=1, d_tp=1, p_pm=with_plugins(("bad", OutOfRange(**change))))
    assert all(outcome.values()), outcome
    assert untouched(push), "D's blocks were written"


# ------------------------------------------------------------------------------ notification decoders


class ForeignDecoder:
    """A decoder for another format that answers a dict (not a Notification), or raises."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    @hookimpl
    def kvpush_decode_notification(self, message: bytes) -> Any:
        if not message.startswith(b"MYFMT:"):
            return None
        if self.answer == "abort":
            raise PluginAbort("cannot decode")
        return {"kind": "mine"}


class PluginAbort(BaseException):
    """A plugin's own abort class, outside the Exception hierarchy."""


@pytest.mark.parametrize("answer", ["dict", "abort"])
def test_a_decoder_misbehaving_on_a_foreign_message_loses_no_other_message(answer: str) -> None:
    with Cluster(request_timeout_s=3) as cluster:
        cluster.pm.register(ForeignDecoder(answer), "foreign")
        injected = inject_first(cluster.receivers[0], b"MYFMT:hello", is_done)
        cluster.add("good", [[20, 21]], "x-good")
        cluster.finish("p-good", [[2, 3]], "x-good")
        outcome = cluster.wait_decode("good", timeout_s=10)
        assert injected, "the foreign message was never injected"
        assert outcome == {0: None}, outcome


def test_a_decoder_for_another_format_leaves_kvpushs_own_messages_alone() -> None:
    """Holds: a decoder answering garbage for its own format never sees kvpush's DONE (the
    built-in decoder is asked first), so a batch without a foreign message is unharmed."""
    with Cluster(request_timeout_s=3) as cluster:
        cluster.pm.register(ForeignDecoder("dict"), "foreign")
        cluster.add("good", [[20, 21]], "x-good")
        cluster.finish("p-good", [[2, 3]], "x-good")
        assert cluster.wait_decode("good", timeout_s=10) == {0: None}


# ------------------------------------------------------------------------------ BaseException from a hook


class AbortsOnBlock13:
    """Raises ``PluginAbort`` (a BaseException) from ``hook`` for the request of D block 13."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> None:
        if self.hook == "kvpush_build_read_specs" and 13 in job.remote_block_ids[0]:
            raise PluginAbort("plugin gave up")

    @hookimpl(tryfirst=True)
    def kvpush_transfer_strategy(self, spec: ReadSpec) -> None:
        if self.hook == "kvpush_transfer_strategy" and 13 in spec.remote_block_ids[0]:
            raise PluginAbort("plugin gave up")


@pytest.mark.parametrize("hook", ["kvpush_build_read_specs", "kvpush_transfer_strategy"])
def test_a_plugin_raising_a_base_exception_fails_only_its_own_request(hook: str) -> None:
    with Cluster(request_timeout_s=3) as cluster:
        cluster.pm.register(AbortsOnBlock13(hook), "aborts")
        cluster.add("bad", [[13]], "x-bad")
        cluster.add("good", [[20, 21]], "x-good")
        cluster.finish("p-bad", [[1]], "x-bad")
        cluster.finish("p-good", [[2, 3]], "x-good")
        assert cluster.wait_decode("good", timeout_s=10) == {0: None}
        reason = cluster.wait_decode("bad", timeout_s=10)[0]
        assert reason is not None and f"plugin 'aborts' raised PluginAbort in {hook}" in reason, reason


# ------------------------------------------------------------------------------ wrong types, per hook

HOOK_ARGS = {
    "kvpush_transports": "",
    "kvpush_layouts": "",
    "kvpush_metadata_extensions": "local",
    "kvpush_handshake_mode": "role, peer_role",
    "kvpush_validate_peer": "local, peer, mode",
    "kvpush_align_regions": "local, peer",
    "kvpush_build_read_specs": "job",
    "kvpush_transfer_strategy": "job, spec, num_descriptors",
    "kvpush_expected_producers": "prefill, decode_tp_rank, decode_tp_size",
    "kvpush_decode_notification": "message",
}


def returning(hook: str, body: str) -> object:
    """A plugin whose only hookimpl (``tryfirst``) runs ``body``."""
    args = HOOK_ARGS[hook]
    namespace: dict[str, Any] = {"hookimpl": hookimpl, "ReadSpec": ReadSpec}
    exec(  # one hookimpl per hook, built from the spec's argument names
        f"class Bad:\n    @hookimpl(tryfirst=True)\n    def {hook}(self{', ' if args else ''}{args}):\n"
        f"        {body}\n",
        namespace,
    )
    return namespace["Bad"]()


LOCAL = make_agent_metadata(role="prefill")
PEER = make_agent_metadata(role="decode")
JOB = PushJob(local=LOCAL, decode_tp_size=1, local_block_ids=((1,),), remote_block_ids=((2,),))
SPEC = ReadSpec(dst_tp_rank=0, local_block_ids=((1,),), remote_block_ids=((2,),))
CALLS = {
    "kvpush_transports": lambda pm: pm.transports(),
    "kvpush_layouts": lambda pm: pm.layouts(),
    "kvpush_metadata_extensions": lambda pm: pm.metadata_extensions(LOCAL),
    "kvpush_handshake_mode": lambda pm: pm.handshake_mode(Role.PREFILL, Role.DECODE),
    "kvpush_validate_peer": lambda pm: pm.check_peer(LOCAL, PEER, HandshakeMode.FULL),
    "kvpush_align_regions": lambda pm: pm.align_regions(LOCAL, PEER),
    "kvpush_build_read_specs": lambda pm: pm.build_read_specs(JOB),
    "kvpush_transfer_strategy": lambda pm: pm.transfer_strategy(JOB, SPEC, 4),
    "kvpush_expected_producers": lambda pm: pm.expected_producers(LOCAL.parallel, 0, 1),
    "kvpush_decode_notification": lambda pm: pm.decode_notification(b"MYFMT:x"),
}
WRONG = [
    ("kvpush_transports", "return 5"),
    ("kvpush_transports", "return [5]"),
    ("kvpush_layouts", "return object()"),
    ("kvpush_metadata_extensions", "return 5"),
    ("kvpush_handshake_mode", "return 'full'"),
    ("kvpush_validate_peer", "return 5"),
    ("kvpush_align_regions", "return [0, 1]"),
    ("kvpush_build_read_specs", "return 5"),
    (
        "kvpush_build_read_specs",
        "return [ReadSpec(dst_tp_rank=0, local_block_ids=job.local_block_ids, "
        "remote_block_ids=job.remote_block_ids, local_part=[0, 1])]",
    ),
    ("kvpush_transfer_strategy", "return ['packed']"),
    ("kvpush_expected_producers", "return 5"),
    ("kvpush_decode_notification", "return 'done'"),
]


@pytest.mark.parametrize(
    ("hook", "body"), WRONG, ids=[f"{h.removeprefix('kvpush_')}-{i}" for i, (h, _) in enumerate(WRONG)]
)
def test_a_hook_returning_the_wrong_type_is_an_error_naming_the_plugin_and_hook(hook: str, body: str) -> None:
    pm = get_plugin_manager(load_entrypoints=False, env={}, plugins=[("badplug", returning(hook, body))])
    with pytest.raises(KvpushError) as err:
        CALLS[hook](pm)
    assert "'badplug'" in str(err.value) and hook.removeprefix("kvpush_") in str(err.value), err.value


class PublishesCoreField:
    """A metadata-extension plugin publishing a field under a name kvpush publishes itself."""

    def __init__(self, key: str, value: Any) -> None:
        self.key, self.value = key, value

    @hookimpl
    def kvpush_metadata_extensions(self) -> dict[str, Any]:
        return {self.key: self.value}


@pytest.mark.parametrize("key", ["write_deadline_s", "process", "ended_incarnations", "window_block_tokens"])
def test_a_plugin_publishing_a_field_kvpush_owns_is_refused_naming_it(key: str) -> None:
    pm = with_plugins(("ext", PublishesCoreField(key, {"mine": 1})))
    with pytest.raises(KvpushError, match=rf"'ext'.*{key}"):
        Push(pp=1, p_tp=1, d_tp=1, p_pm=pm).close()


# ------------------------------------------------------------------------------ a slow plugin


class SlowOnBlock13:
    """A read-spec plugin that sleeps ``seconds`` on P's writer thread for one request."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    @hookimpl(tryfirst=True)
    def kvpush_build_read_specs(self, job: PushJob) -> None:
        if 13 in job.remote_block_ids[0]:
            time.sleep(self.seconds)


def test_a_plugin_slower_than_ds_deadline_stalls_ps_writer_but_nothing_lands_after_release() -> None:
    """Holds (with a cost): P has one writer thread, so a plugin sleeping past D's deadline stalls
    every request of that P rank; D fails them at its deadline (bounded) but holds their blocks
    until P, awake again, settled its WRITEs: no byte changes in a block after D released it."""
    sleep_s, timeout_s = 3.0, 1.0
    with Cluster(request_timeout_s=timeout_s) as cluster:
        cluster.pm.register(SlowOnBlock13(sleep_s), "slow")
        cluster.add("bad", [[13]], "x-bad")
        cluster.add("good", [[20, 21]], "x-good")
        cluster.finish("p-bad", [[1]], "x-bad")
        time.sleep(0.1)  # the slow plan has begun
        cluster.finish("p-good", [[2, 3]], "x-good")
        started = time.monotonic()
        outcomes = {rid: cluster.wait_decode(rid, timeout_s=timeout_s + 2)[0] for rid in ("bad", "good")}
        assert all(outcomes.values()) and time.monotonic() - started < timeout_s + 1, outcomes
        wanted = {"bad": [13], "good": [20, 21]}

        def held(ids: list[int]) -> torch.Tensor:
            return torch.cat([kv_bytes(t)[:, ids].flatten() for t in cluster.d_caches[0].values()])

        at_release: dict[str, torch.Tensor] = {}
        deadline = time.monotonic() + sleep_s + 5
        while len(at_release) < len(wanted) and time.monotonic() < deadline:
            cluster.poll()
            for rid, ids in wanted.items():
                if rid in cluster.released[0] and rid not in at_release:
                    at_release[rid] = held(ids).clone()
            time.sleep(0.001)
        assert len(at_release) == len(wanted), f"D released only {sorted(at_release)}"
        time.sleep(1.0)
        for rid, ids in wanted.items():
            assert torch.equal(held(ids), at_release[rid]), (
                f"bytes landed in {rid}'s blocks after D released them"
            )
        assert all(at_release[rid].any() for rid in wanted)  # P did write them, before the release


class SlowDecoder:
    """A decoder (asked first) that sleeps ``seconds`` on D's writer thread at the first DONE."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.slept = seconds, False

    @hookimpl(tryfirst=True)
    def kvpush_decode_notification(self, message: bytes) -> None:
        if message.startswith(b"DONE:") and not self.slept:
            self.slept = True
            time.sleep(self.seconds)


@pytest.mark.xfail(
    strict=True,
    reason="no fix offered: D's deadlines run on the writer thread that calls the decoder plugin, "
    "so a decoder sleeping past them stalls every request of the rank (a request due at 1 s is "
    "failed at 4 s) and one that never returns hangs them all; the writer watchdog logs where it "
    "is stuck (next test), but Python cannot preempt the plugin",
)
def test_a_slow_decoder_on_d_does_not_hold_back_other_requests_deadlines() -> None:
    with Cluster(request_timeout_s=1) as cluster:
        cluster.pm.register(SlowDecoder(4.0), "slow_decoder")
        cluster.add("done", [[20, 21]], "x-done")
        cluster.add("silent", [[30]], "x-silent")  # P never finishes it: due to fail at 1 s
        cluster.finish("p-done", [[2, 3]], "x-done")
        started = time.monotonic()
        reason = cluster.wait_decode("silent", timeout_s=10)[0]
        took = time.monotonic() - started
        assert cluster.wait_decode("done", timeout_s=10) == {0: None}
        assert reason is not None and took < 2.5, (reason, took)


def test_a_stalled_writer_round_is_logged_with_the_plugin_it_is_in(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The slow decoder above cannot be preempted, but it is not silent: the writer watchdog
    logs a round past ``WRITER_STALL_S`` with the writer's stack (naming the plugin's function),
    and again when the writer goes on."""
    import logging

    from kvpush.core import worker

    monkeypatch.setattr(worker, "WRITER_STALL_S", 0.5)
    caplog.set_level(logging.WARNING, logger="kvpush")
    with Cluster(request_timeout_s=5) as cluster:
        cluster.pm.register(SlowDecoder(2.0), "slow_decoder")
        cluster.add("done", [[20, 21]], "x-done")
        cluster.finish("p-done", [[2, 3]], "x-done")
        assert cluster.wait_decode("done", timeout_s=10) == {0: None}
        stalls = cluster.receivers[0].writer_stalls
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert stalls == 1, text
    assert "has been in one round" in text and "kvpush_decode_notification" in text, text
    assert "time.sleep(self.seconds)" in text and "went on after a round" in text, text
