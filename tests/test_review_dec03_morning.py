"""Review of 2026-12-03 (morning) of the previous session's changes: the owed CANCEL_ACK rules,
the side channel's answer (``AskStart``), the lifecycle and the caches check.

Findings:

(1) An owed CANCEL_ACK (the cancel D asks again before a key's next request registers) was
    found by D request id through a map holding one entry per id. An engine that reuses the id
    (vLLM re-adds a preempted request under its id) lost the ack: (a) the new request of the id
    and key waits for that ack, and P's ack, naming the id, was held as an early result of the
    new request instead (it waited ``hello_timeout_s`` and failed, every retry); (b) the id
    released again under another key pointed the map at the newer entry, so the first key's ack
    was refused as "another attempt" and every request of that key failed the same way. Fixed:
    the map holds every owed entry of an id (``DecodeCore._owed_ack_of`` picks the one the ack
    answers), and an ack echoing an owed attempt, not the live request's, settles that cancel.
(2) A plugin's cache object with ``__slots__`` (an ``attrs.define`` class) was not walked by
    ``RegisteredCaches``: a tensor replaced in it passed the check silently (wrong KV).
(3) ``WorkerConfig.window_block_tokens`` accepted sizes and group counts every peer's metadata
    check refuses: each handshake with the rank failed far from the setting.
(4) P took the side channel's answer (``AskStart``) as the newest word although a handshake
    loaded another start of the rank while the question was out: a stale answer failed the
    loaded start's requests.
(5) An exception ending ``start()`` after its writer started released the transport under the
    live writer; ``close()`` in a signal handler that interrupted ``start()`` waited 85 s for
    its own thread and closed nothing.
(6) P's close() whose writer commands timed out recorded no WRITE in flight: a prefill whose
    WRITE still ran was reported failed as released, its memory not kept.
See docs/reliability.md, "Probe of 2026-12-03 (morning)".
"""

from __future__ import annotations

from typing import Any

import pytest
from test_probe_attempts import _add_connected, _decoded, _kinds, _released_unanswered


def _owed_ack(rid: str, attempt: int, agent_rank: Any = None) -> Any:
    from test_handshake_refusal import P0

    from kvpush.core import notifications as wire

    return _decoded(
        wire.encode_cancel_ack(
            rid, agent_rank or P0, False, unsettled=False, incarnation="p1", attempt=attempt
        )
    )


def _released_again(core: Any, rid: str, key: str, at: float) -> int:
    """``rid`` (``key``) added to ``core`` (handshaking again), registered, cancelled, P silent:
    released on a fence, its cancel owed. Returns the attempt the owed cancel names."""
    from test_probe_clock_identity import _attempt

    from kvpush.core.actions import Fence, Release

    attempt = _attempt(_add_connected(core, rid, key, at))
    core.cancel(rid, at + 0.1)
    fences = [a for a in core.handle_timer(at + 60.0) if isinstance(a, Fence)]
    assert fences, "the quarantine fences the silent producer"
    released = core.fenced(fences[0].fence_id, at + 60.1)
    assert any(isinstance(a, Release) and a.request_id == rid for a in released), released
    return attempt


# ---------------------------------------------------------------------------------------------
# (1) The owed CANCEL_ACK of a reused request id
# ---------------------------------------------------------------------------------------------


def test_the_owed_ack_settles_the_cancel_when_the_engine_re_adds_the_request_under_its_id() -> None:
    """r (x-1) released on a fence, its cancel owed; the engine adds r (x-1) again (a preempted
    request re-added). D asks the cancel again; P's ack names r and the owed attempt: it settles
    the cancel and r registers (a fresh stamp asked for), not held as an early result of the new
    r (which then failed after ``hello_timeout_s``)."""
    from test_handshake_refusal import P_AGENT

    from kvpush.core.types import NotificationKind

    core, owed_attempt = _released_unanswered(None, "r", "x-1", 1.0)
    asked = _add_connected(core, "r", "x-1", 70.0)
    assert NotificationKind.CANCEL in _kinds(asked), asked
    out = core.notification(P_AGENT, _owed_ack("r", owed_attempt), 70.2)
    assert _kinds(out) == [NotificationKind.HEARTBEAT], out


def test_an_owed_ack_is_found_after_the_id_was_released_again_under_another_key() -> None:
    """r (x-1) released on a fence, its cancel owed; r comes back as x-2 and is released on a
    fence too (owed as well). A new request of x-1 asks x-1's cancel again: P's ack (r, x-1's
    attempt) settles it. The map from id to owed entry pointed at x-2's only: the ack was
    refused as naming another attempt, and every request of x-1 failed."""
    from test_handshake_refusal import P_AGENT

    from kvpush.core.types import NotificationKind

    core, first = _released_unanswered(None, "r", "x-1", 1.0)
    second = _released_again(core, "r", "x-2", 70.0)
    assert first != second
    asked = _add_connected(core, "n", "x-1", 140.0)
    assert NotificationKind.CANCEL in _kinds(asked), asked
    out = core.notification(P_AGENT, _owed_ack("r", first), 140.2)
    assert _kinds(out) == [NotificationKind.HEARTBEAT], out
    # x-2's cancel is still owed: its own ack settles it for x-2's next request.
    asked = _add_connected(core, "m", "x-2", 140.5)
    assert NotificationKind.CANCEL in _kinds(asked), asked
    out = core.notification(P_AGENT, _owed_ack("r", second), 140.7)
    assert _kinds(out) == [NotificationKind.HEARTBEAT], out


# ---------------------------------------------------------------------------------------------
# (2) Caches in a slotted object's attributes
# ---------------------------------------------------------------------------------------------


class _SlottedKV:
    """A layout plugin's cache object with ``__slots__`` (as an ``attrs.define`` class has)."""

    __slots__ = ("k", "unset", "v")

    def __init__(self) -> None:
        import torch

        self.k = torch.zeros(2, 8)
        self.v = torch.zeros(2, 8)


def _attrs_kv() -> Any:
    import attrs
    import torch

    @attrs.define
    class KV:
        k: Any = attrs.field(factory=lambda: torch.zeros(2, 8))
        v: Any = attrs.field(factory=lambda: torch.zeros(2, 8))

    return KV


def _registered_objects(make: Any) -> tuple[dict[str, Any], Any]:
    from test_probe_lifecycle_caches import _regions

    from kvpush.core.registered_caches import RegisteredCaches

    caches = {f"layers.{i}": make() for i in range(2)}
    named = [(f"layers.{i}", getattr(caches[f"layers.{i}"], part)) for i in range(2) for part in "kv"]
    return caches, RegisteredCaches(caches, _regions(named))


@pytest.mark.parametrize("kind", ["__slots__", "attrs.define"])
def test_a_tensor_replaced_in_a_slotted_objects_attributes_is_refused(kind: str) -> None:
    """A plugin's ``KV(k, v)`` with slots (no ``__dict__``): the walk did not enter it, so no
    tensor of it was registered for the check and ``obj.v`` replaced passed silently (wrong
    KV). Now its slots are walked and compared like a plain object's attributes."""
    import torch
    from test_probe_lifecycle_caches import _check, _refused

    caches, registered = _registered_objects(_SlottedKV if kind == "__slots__" else _attrs_kv())
    assert set(registered.registered) == {"layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"}
    _check(registered)
    caches["layers.1"].v = torch.zeros(2, 8)
    _refused(registered, "'layers.1.v'", "replaced")


def test_a_slot_set_deleted_or_left_unset_is_told_apart() -> None:
    """An unset slot is no cache; one set later (state) is taken as the new snapshot; a
    registered slot deleted is refused as gone."""
    import torch
    from test_probe_lifecycle_caches import _check, _refused

    caches, registered = _registered_objects(_SlottedKV)
    caches["layers.0"].unset = torch.zeros(1)
    _check(registered)
    _check(registered)
    del caches["layers.0"].k
    _refused(registered, "'layers.0.k'", "gone")


# ---------------------------------------------------------------------------------------------
# (3) window_block_tokens out of the range the peers accept
# ---------------------------------------------------------------------------------------------


def _config(window_block_tokens: Any) -> Any:
    from cluster import MHA

    from kvpush.core.types import ParallelConfig
    from kvpush.core.worker import WorkerConfig

    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MHA.num_layers)
    return WorkerConfig(engine_id="P", parallel=parallel, model=MHA, window_block_tokens=window_block_tokens)


@pytest.mark.parametrize(
    "sizes",
    [(-16,), (True,), (16.0,), ("16",), ((1 << 16) + 1,), (16,) * 4097],
    ids=["negative", "bool", "float", "str", "over-MAX_LAYERS", "over-MAX_PARALLEL-groups"],
)
def test_window_block_tokens_out_of_what_peers_accept_is_refused_naming_the_field(sizes: Any) -> None:
    """A size or a group count the peers' metadata check refuses (``wire.MAX_LAYERS``,
    ``wire.MAX_PARALLEL``) was accepted here: the rank started and every handshake with it
    failed on a malformed-extension error far from the setting. Now refused at config."""
    from kvpush.core.errors import ConfigError

    with pytest.raises(ConfigError, match="window_block_tokens"):
        _config(sizes)


def test_window_block_tokens_in_range_is_accepted_and_published_as_peers_accept() -> None:
    from kvpush.core import wire
    from kvpush.core.worker import WINDOW_BLOCKS_KEY

    config = _config([0, 16, 1 << 16])
    assert config.window_block_tokens == (0, 16, 1 << 16)
    wire._check_extensions({WINDOW_BLOCKS_KEY: list(config.window_block_tokens)}, "test")


# ---------------------------------------------------------------------------------------------
# (4) The side channel's answer to a question asked before a handshake loaded another start
# ---------------------------------------------------------------------------------------------


def test_an_answer_to_a_question_a_handshake_overtook_is_asked_again() -> None:
    """P serves d1. d3 says HELLO: P asks D's side channel (AskStart). Before the answer, d1's
    endpoint breaks and D's live start d2 (a clock behind: it sorts before d3) handshakes and
    is loaded, serving a request. Then the answer comes: "d3", read at some moment while that
    handshake ran, so it may be older than the handshake's. P took it as the newest word: d3's
    held HELLO was a restart, d2's live request failed and the rank was reloaded. Now an answer
    whose question a handshake overtook is not trusted: d3 is asked about again, d2's request
    goes on; the new answer ("d2") drops d3's messages."""
    from test_handshake_refusal import D_AGENT, _prefill
    from test_probe_attempts import _hello, _push_reg

    from kvpush.core.actions import AskStart, Connect, DropPeer, Post, Report

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    assert any(isinstance(a, AskStart) for a in core.notification(D_AGENT, _hello("d3"), 101.0))
    core.unreachable(D_AGENT, "endpoint broken", 101.1)  # d1 died
    assert any(isinstance(a, Connect) for a in core.notification(D_AGENT, _hello("d2"), 101.2))
    core.connected("D", 0, D_AGENT, "d2", 1, "", 101.3)
    core.finished("x-2", "p-2", ((6,),), "", 101.4)
    reg = _push_reg(decode_incarnation="d2", request_id="d-2", match_key="x-2", grant=101.35)
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, reg, 101.5))
    late = core.start_served("D", 0, "d3", "", 101.6)
    assert not [a for a in late if isinstance(a, Report | DropPeer | Connect)], late
    assert [a for a in late if isinstance(a, AskStart)], "d3 is asked about again"
    again = core.start_served("D", 0, "d2", "", 101.7)
    assert not [a for a in again if isinstance(a, Report | DropPeer | Connect | AskStart)], again


# ---------------------------------------------------------------------------------------------
# (5) start() interrupted after it started the writer (a signal handler's exception)
# ---------------------------------------------------------------------------------------------


def _start_interrupted_by_a_signal(worker: Any, handler: Any) -> BaseException | None:
    """Run ``worker.start()`` on this (main) thread while a signal arrives once its writer
    thread began its set-up (which then takes 0.5 s, as a first CUDA initialization does):
    ``handler`` runs as the signal handler. What start() raised (None: it returned)."""
    import signal
    import threading
    import time

    main = threading.get_ident()
    fired = threading.Event()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if not fired.is_set() and threading.current_thread().name.startswith("kvpush-writer"):
            fired.set()
            signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.5)

    earlier = signal.signal(signal.SIGUSR1, handler)
    threading.setprofile(profile)
    try:
        worker.start()
    except BaseException as err:  # what the test asserts on
        return err
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        signal.signal(signal.SIGUSR1, earlier)
    return None


def test_an_exception_interrupting_start_after_the_writer_started_stops_the_writer_first() -> None:
    """A signal handler raising (an engine's SIGTERM handler calling ``sys.exit``, a Ctrl-C)
    while start() waits for its writer's set-up: start() released the transport and
    registrations under the live writer and left ``_running`` True; the writer then ran its
    rounds for ever over a closed transport. Now start() stops the writer first, then releases."""
    from cluster import Cluster
    from test_probe_lifecycle_caches import P0, SLOW_SILENCE

    from kvpush.core.sender import PushSender

    class Interrupted(Exception):
        pass

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise Interrupted("a signal handler's exception")

    with Cluster(**SLOW_SILENCE) as cluster:
        sender = PushSender(cluster.senders[P0].config, cluster.p_caches[P0], pm=cluster.pm)
        raised = _start_interrupted_by_a_signal(sender, raise_interrupted)
        assert isinstance(raised, Interrupted), raised
        writer = sender._thread
        assert writer is not None
        released_under_writer = sender._transport_closed and writer.is_alive()
        writer.join(5.0)
        alive = writer.is_alive()
        sender.close()
        assert not released_under_writer, "the transport was released while the writer lived"
        assert not alive, "the writer of a start that raised runs on"
        assert sender._running is False


def test_close_in_a_signal_handler_interrupting_start_abandons_the_start_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine's SIGTERM handler calls close() while the main thread it interrupted is in
    start() (which holds the lifecycle lock): close() waited ``start_wait_s`` (85 s by default)
    for the lock its own thread held, then returned without closing; start() then went on and
    returned a running worker nobody closes. Now close() there raises ``ConfigError`` at once,
    which ends the start() it interrupted: the writer stopped, everything released."""
    import time

    from cluster import Cluster
    from test_probe_lifecycle_caches import P0, SLOW_SILENCE

    from kvpush.core.errors import ConfigError
    from kvpush.core.sender import PushSender

    monkeypatch.setattr(PushSender, "start_wait_s", 3.0)  # bounded, should the fix regress
    with Cluster(**SLOW_SILENCE) as cluster:
        sender = PushSender(cluster.senders[P0].config, cluster.p_caches[P0], pm=cluster.pm)
        took: list[float] = []

        def close_on_signal(signum: int, frame: Any) -> None:
            began = time.monotonic()
            try:
                sender.close()
            finally:
                took.append(time.monotonic() - began)

        raised = _start_interrupted_by_a_signal(sender, close_on_signal)
        assert took and took[0] < 1.5, f"close() in the handler took {took}"
        assert isinstance(raised, ConfigError) and "start()" in str(raised), raised
        writer = sender._thread
        assert writer is None or not writer.is_alive()
        assert sender._transport_closed and sender._running is False
        with pytest.raises(ConfigError, match="closed"):
            sender.request_finished("p-1", [[5]], match_key="x-1")
        sender.close()  # a second close returns


# ---------------------------------------------------------------------------------------------
# (6) P's close() whose writer commands time out, with a WRITE in flight
# ---------------------------------------------------------------------------------------------


class _StallsOnce:
    """A ``ready`` whose first ``query()`` (on the writer thread) takes ``stall_s``."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.stalled = False

    def query(self) -> bool:
        import time

        if not self.stalled:
            self.stalled = True
            time.sleep(self.stall_s)
        return False


def test_a_close_whose_writer_commands_time_out_still_keeps_what_a_write_in_flight_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P closes while its writer is stalled (a ``ready.query()`` taking 1 s, past the command
    bound, shortened here to 0.3 s from 10 s) and a WRITE of p-1 is in flight (it lands in
    30 s). ``_before_stop`` gave up on ``WaitTimeout`` before it recorded the WRITEs in flight:
    the writer then stopped within the join, and p-1 was reported failed as "closed before the
    push finished", its blocks the engine's to reuse while the WRITE (and the DONE it carries)
    may still read them, and the registered storages were not kept. Now what is still in flight
    once the writer stopped is reported NOT released and its memory kept."""
    import functools

    from cluster import Cluster
    from test_close_tells_decode import _wait_posted
    from test_probe_lifecycle_caches import P0, SLOW_SILENCE

    from kvpush.core import worker as worker_module
    from kvpush.core.worker import RankWorker

    options = {"inner": "loopback", "slow_writes": 1.0, "write_delay_s": 30.0}
    with Cluster(
        transport="faulty", transport_options=options, close_timeout_s=0.3, **SLOW_SILENCE
    ) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        sender.request_finished("p-2", [[6]], match_key="x-2", ready=_StallsOnce(1.0))
        monkeypatch.setattr(
            type(sender), "call_on_writer", functools.partialmethod(RankWorker.call_on_writer, timeout_s=0.3)
        )
        kept_before = len(worker_module._KEPT_FOR_PROCESS)
        storages = sender.registered_caches.storages
        sender.close()
        got = sender.get_finished()
        reason = got.failed.get("p-1", "")
        assert "NOT released" in reason, got
        kept = worker_module._KEPT_FOR_PROCESS[kept_before:]
        assert any(k is storages for k in kept), "the registered storages a WRITE reads were not kept"


def test_close_in_a_signal_handler_interrupting_close_returns_at_once_and_the_close_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGTERM handler calls close() while the main thread it interrupted is itself in
    close() (P waiting for a WRITE in flight to settle): the inner close() returns at once
    (it waited ``start_wait_s`` for the lifecycle lock its own thread held, 85 s by default)
    and the outer close finishes the job: the WRITE lands, D finishes, the transport closes."""
    import signal
    import threading
    import time

    from cluster import Cluster
    from test_close_tells_decode import _wait_posted
    from test_probe_lifecycle_caches import P0, SLOW_SILENCE

    from kvpush.core.sender import PushSender

    monkeypatch.setattr(PushSender, "start_wait_s", 3.0)  # bounded, should the fix regress
    options = {"inner": "loopback", "slow_writes": 1.0, "write_delay_s": 0.6}
    with Cluster(transport="faulty", transport_options=options, **SLOW_SILENCE) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        took: list[float] = []

        def close_on_signal(signum: int, frame: Any) -> None:
            began = time.monotonic()
            sender.close()
            took.append(time.monotonic() - began)

        main = threading.get_ident()

        def signal_during_close() -> None:
            deadline = time.monotonic() + 5.0
            while sender._lifecycle_holder is None and time.monotonic() < deadline:
                time.sleep(0.001)
            signal.pthread_kill(main, signal.SIGUSR1)

        earlier = signal.signal(signal.SIGUSR1, close_on_signal)
        helper = threading.Thread(target=signal_during_close)
        try:
            helper.start()
            sender.close()
        finally:
            helper.join(5.0)
            signal.signal(signal.SIGUSR1, earlier)
        assert took and took[0] < 1.5, f"close() in the handler took {took}"
        assert sender._transport_closed and sender._running is False
        assert cluster.wait_decode("d-1", timeout_s=5) == {0: None}
