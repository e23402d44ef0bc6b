"""Probe (probeP2): P's engine API used from several threads, the way engines call it (an API
thread aborting while the scheduler finishes, a shutdown thread closing while the scheduler
still finishes prefills), and close() with a WRITE still in flight: can the engine free blocks a
WRITE still reads, be told about a prefill never, or have an abort silently dropped?

Findings (each test fails on main 2026-12-02, marked xfail(strict=True)):
1. close() with a WRITE that cannot be taken back (a kernel copy; a NIXL RDMA whose release
   does not stop it) still in flight at ``close_timeout_s`` reports the prefill failed with
   the generic "closed before the push finished": the engine frees and reuses the blocks while
   the WRITE still reads them (its completion notification is D's DONE), unlike D's close(),
   which says its blocks are NOT released.
2. request_finished() racing close() from another thread: the finish passes the running check,
   close() stops the writer and reports what it holds, then the finish registers its key and
   queues a command no writer will run. The prefill is never reported: its blocks never given
   back (and get_finished() refuses nothing, the id stays "being pushed" for ever).
3. abort() racing request_finished() from another thread: abort sees the key held (the finish
   registered it under the lock) but its command reaches the writer before the finish's, so the
   core does not know the key yet and drops the abort. The prefill is pushed and reported sent,
   D is written from blocks the engine asked back (and a D that never registers holds them
   until lease_s).
Checked and held: get_finished() from two threads (each result once); ready.query() raising
BaseException / answering a non-bool / abort while unready; abort after the push was reported.
Real NIXL (faulty wrapper) for 1, loopback for 2 and 3.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from cluster import Cluster, wait_until

from kvpush.core.errors import ConfigError
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)
SLOW_SILENCE = {"request_timeout_s": 60, "heartbeat_interval_s": 5.0}


def _wait_posted(sender: Any) -> None:
    wait_until(lambda: sender.call_on_writer(lambda: len(sender.core.inflight_handles())) == 1, what="post")


# ---------------------------------------------------------------------------- finding 1


def test_close_with_a_write_still_in_flight_does_not_tell_the_engine_to_free_its_blocks() -> None:
    """A kernel copy stalled past P's ``close_timeout_s`` (the ``faulty`` transport publishes it
    cannot be taken back): close() returns, and the engine collects the prefill in ``.failed``.
    Per the API, a reported prefill's blocks may be freed; these are still being read. The
    reason must say they are not released (as D's close() does), so the engine keeps them."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 30.0, "kernel_copies": True}
    config = {"transport_options": options, "close_timeout_s": 0.3, **SLOW_SILENCE}
    with Cluster(transport="faulty", **config) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        handle = sender.call_on_writer(lambda: next(iter(sender.core.inflight_handles())))
        assert not sender.transport.abortable(handle)  # a kernel copy: nothing takes it back
        sender.close()
        failed = sender.get_finished().failed
        assert "p-1" in failed, failed
        reason = failed["p-1"]
        assert "NOT released" in reason or "do not reuse" in reason, reason


def test_close_with_nothing_in_flight_still_reports_a_plain_failure() -> None:
    """The counterpart (holds today, must keep holding with finding 1's fix): a prefill never
    posted (its D never registered) is reported failed at close() and may be freed."""
    with Cluster(close_timeout_s=0.3, **SLOW_SILENCE) as cluster:
        sender = cluster.senders[P0]
        sender.request_finished("p-1", [[5]], match_key="x-1")
        sender.close()
        reason = sender.get_finished().failed["p-1"]
        assert "closed before the push finished" in reason and "NOT released" not in reason, reason


# ---------------------------------------------------------------------------- finding 2


def test_a_finish_racing_close_on_another_thread_is_refused_or_reported() -> None:
    """The scheduler thread finishes a prefill while the shutdown thread closes the worker. The
    finish passed the running check; close() then ran to the end (nothing held yet); the finish
    goes on. It must either raise (the engine keeps its blocks and knows it) or be reported by
    get_finished(); on main it is neither, and the id is refused as 'still being pushed' for
    the rest of the process."""
    with Cluster(close_timeout_s=0.3, **SLOW_SILENCE) as cluster:
        sender = cluster.senders[P0]
        checked, go = threading.Event(), threading.Event()
        real_check = sender._check_blocks

        def check_then_stall(*args: Any) -> Any:  # runs right after _check_running
            out = real_check(*args)
            if threading.current_thread().name == "scheduler":
                checked.set()
                go.wait(5.0)
            return out

        sender._check_blocks = check_then_stall
        outcome: dict[str, Any] = {}

        def finish() -> None:
            try:
                sender.request_finished("p-1", [[5]], match_key="x-1")
                outcome["raised"] = None
            except ConfigError as err:
                outcome["raised"] = err

        thread = threading.Thread(target=finish, name="scheduler", daemon=True)
        thread.start()
        try:
            assert checked.wait(5.0)
            sender.close()  # the shutdown thread: returns, nothing held yet
        finally:
            go.set()
            thread.join(5.0)
        assert not thread.is_alive()
        if outcome["raised"] is not None:
            return  # refused: the engine keeps its blocks and knows
        deadline = time.monotonic() + 1.0
        got: dict[str, Any] = {}
        while time.monotonic() < deadline and "p-1" not in got:
            results = sender.get_finished()
            got.update({rid: None for rid in results.sent}, **results.failed)
            time.sleep(0.05)
        assert "p-1" in got, "accepted by request_finished, never reported: its blocks never come back"


# ---------------------------------------------------------------------------- finding 3


def test_an_abort_that_saw_the_finish_is_not_overtaken_by_it_on_the_writer() -> None:
    """The scheduler thread finishes p-1; an API thread aborts it (the client went away) after
    request_finished registered the key, before the finish's command was queued. abort()
    accepted it (the key holds p-1), so p-1 must end failed 'aborted', D must not be written."""
    with Cluster(**SLOW_SILENCE) as cluster:
        sender = cluster.senders[P0]
        registered, go = threading.Event(), threading.Event()
        real_run = sender.run_on_writer

        def run_late(command: Any) -> None:
            if threading.current_thread().name == "scheduler":
                registered.set()  # request_finished holds the key now, its command not queued
                go.wait(1.0)  # (a fix that queues under the lock makes the abort wait instead)
            real_run(command)

        sender.run_on_writer = run_late

        def finish() -> None:
            sender.request_finished("p-1", [[5]], match_key="x-1")

        thread = threading.Thread(target=finish, name="scheduler", daemon=True)
        thread.start()
        try:
            assert registered.wait(5.0)
            sender.abort("p-1", match_key="x-1")  # the API thread: accepted (the key holds p-1)
        finally:
            go.set()
            thread.join(5.0)
        assert not thread.is_alive()
        del sender.run_on_writer
        cluster.add("d-1", [[3]], "x-1")  # D registers after the abort
        outcome = cluster.wait_prefill("p-1")[P0]
        assert outcome is not None and "aborted" in outcome, outcome
        d = cluster.wait_decode("d-1")[0]
        assert d is not None, "D reported done a push the engine aborted"


# ---------------------------------------------------------------------------- held


def test_get_finished_from_two_threads_reports_each_prefill_once() -> None:
    """Two threads poll get_finished() while prefills complete: each id reaches exactly one."""
    with Cluster() as cluster:
        sender = cluster.senders[P0]
        seen: list[list[str]] = [[], []]
        stop = threading.Event()

        def poll(i: int) -> None:
            while not stop.is_set():
                got = sender.get_finished()
                seen[i] += [*got.sent, *got.failed]

        threads = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        try:
            for n in range(20):
                cluster.add(f"d-{n}", [[n + 1]], f"x-{n}")
                sender.request_finished(f"p-{n}", [[n + 1]], match_key=f"x-{n}")
            wait_until(lambda: len(seen[0]) + len(seen[1]) >= 20, what="20 reports")
        finally:
            stop.set()
            for t in threads:
                t.join(5.0)
        both = seen[0] + seen[1]
        assert sorted(both) == sorted(f"p-{n}" for n in range(20)), both


class _Ready:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers

    def query(self) -> Any:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer


@pytest.mark.parametrize(
    "answers", [[False, KeyboardInterrupt("stop")], [False, 1], [False, None]], ids=["raises", "int", "none"]
)
def test_a_ready_that_turns_bad_after_false_fails_once_and_never_posts(answers: list[Any]) -> None:
    """query() answers False, then misbehaves: the prefill fails once (D told), nothing posted."""
    with Cluster(**SLOW_SILENCE) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        sender.request_finished("p-1", [[5]], match_key="x-1", ready=_Ready(list(answers)))
        outcome = cluster.wait_prefill("p-1")[P0]
        assert outcome is not None and "ready" in outcome, outcome
        assert cluster.wait_decode("d-1")[0] is not None
        assert sender.stats["pushes"] == 0
        time.sleep(0.2)
        cluster.poll()
        assert "p-1" not in sender.get_finished().failed  # told once
