"""Probe (threads): the engine API called the way real engines call it, from several threads at
once, in unexpected orders, and during start()/close().

Findings (each test failed on main 2026-12-02; fixed 2026-12-03, see "Fixed" below):
1. D: an ``add_request`` made while ``close()`` runs on another thread (the shutdown thread waits
   up to ``close_timeout_s`` for the producers of pending requests to acknowledge) is accepted:
   ``close()`` failed and cancelled only the requests pending when it began, so the new one is
   registered with P (PUSH_REG) and never cancelled. ``close()`` then waits its whole
   ``close_timeout_s`` for it and reports it failed "NOT released": the engine loses its blocks
   for the life of the process, and P, never told, keeps the registration and writes into the
   closed D's blocks when its prefill finishes (seen: P reported it sent, D's close() had
   returned; over NIXL in one process the memory is still there and the bytes land). And an
   add that passed the running check just before close() and takes the results lock after
   close() ended is accepted with no writer left to run it: never reported, its blocks claimed
   for ever (P's request_finished re-checks under its lock; D's add_request did not).
2. close() on another thread while start() is between creating the transport and starting the
   writer: close() sees no writer, releases the transport and returns; start() then sets the
   worker running and returns its metadata. The worker looks started (calls are accepted) but
   its writer exited at once: a ``request_finished`` is accepted and never reported (the
   engine's blocks never come back), with no error anywhere. Likewise start() on two threads
   at once: both pass the "already started" check and build two transports and two writers.
3. A ``kv_caches`` tensor the engine replaced after ``start()`` (a re-allocated pool put in the
   dict it handed the worker) is not noticed: P moves the KV into the memory registered at
   start (freed once the engine drops the old tensor) and D reports the request done while the
   engine's tensor holds none of P's bytes: wrong KV, silently.
Fixed (2026-12-03): 1. ``close()`` marks the worker closing under the results lock before
anything else, and ``add_request`` (and P's ``request_finished``) re-check it under that lock:
an add that got in before is held and failed/cancelled like every pending request, a later one
raises ``ConfigError`` naming the close. 2. One lifecycle lock spans ``start()`` and ``close()``:
a second start (or one after close began, also of a worker never started: a further defect of
the same class, it returned a worker whose writer had exited) raises; a close waits for a
running start (bounded), and a start that sees the close before its writer starts raises and
releases what it made. 3. The worker holds the tensors it registered (and their storages) and
the calls that start a request compare the engine's ``kv_caches`` with them (identity and
``data_ptr``): a replaced, removed or re-pointed cache raises ``ConfigError`` naming it.
Checked and held: many threads finishing / adding / cancelling / collecting distinct and the
same ids (each result once, none lost); the same key finished from many threads at once (one
accepted); block id lists mutated by the engine after the call returned (kvpush copied them:
D receives P's original blocks, over real NIXL). Seen, by design: a D cancel that wins the race
with its own PUSH_REG (the handshake still running) never reaches P, which holds that prefill's
blocks until ``lease_s`` and then reports it failed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from cluster import Cluster, kv_bytes, wait_until

from kvpush.core.errors import ConfigError
from kvpush.core.sender import PushSender
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)
SLOW_SILENCE = {"request_timeout_s": 60, "heartbeat_interval_s": 5.0}


def _wait_posted(sender: Any) -> None:
    wait_until(lambda: sender.call_on_writer(lambda: len(sender.core.inflight_handles())) == 1, what="post")


def _block(cluster: Cluster, d_block: int, p_block: int) -> bool:
    """D's block ``d_block`` holds P's block ``p_block`` in every layer."""
    for name, tensor in cluster.d_caches[0].items():
        dst, src = kv_bytes(tensor), kv_bytes(cluster.p_caches[P0][name])
        if not torch.equal(dst[:, d_block], src[:, p_block]):
            return False
    return True


# ---------------------------------------------------------------------------- finding 1


def test_an_add_while_decode_closes_is_refused_or_cancelled_at_p() -> None:
    """The shutdown thread closes D while a WRITE into d-1 is in flight (close() waits for P's
    acknowledgement); the scheduler thread adds d-2 meanwhile. It must either be refused
    (ConfigError: the engine keeps its blocks and knows) or be cancelled at P and released
    like every request close() found pending."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 1.0}
    with Cluster(
        transport="faulty", transport_options=options, close_timeout_s=3.0, **SLOW_SILENCE
    ) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        started = time.monotonic()
        closer = threading.Thread(target=receiver.close, name="shutdown", daemon=True)
        closer.start()

        def close_began() -> bool:
            with receiver._results_lock:  # peek: close() failed d-1 (not collected here)
                return "d-1" in receiver._failed

        wait_until(close_began, what="close() to fail d-1")
        try:
            cluster.add("d-2", [[4]], "x-2")
        except ConfigError as err:
            closer.join(10.0)
            assert "clos" in str(err), err
            return
        closer.join(10.0)
        assert not closer.is_alive()
        took = time.monotonic() - started
        results = receiver.get_finished()
        # Accepted: it must have been treated like every request close() found pending.
        assert "d-2" in results.released, (took, dict(results.failed), results.released)


def test_an_add_racing_a_whole_close_is_refused_or_reported() -> None:
    """The D analog of P's finish racing close(): the scheduler thread's add passed the
    running check, close() runs to the end on the shutdown thread, then the add goes on."""
    with Cluster(close_timeout_s=0.3, **SLOW_SILENCE) as cluster:
        receiver = cluster.receivers[0]
        checked, go = threading.Event(), threading.Event()
        real_check = receiver._check_blocks

        def check_then_stall(*args: Any) -> Any:  # runs right after _check_running
            out = real_check(*args)
            if threading.current_thread().name == "scheduler":
                checked.set()
                go.wait(5.0)
            return out

        receiver._check_blocks = check_then_stall  # type: ignore[method-assign]
        outcome: dict[str, Any] = {}

        def add() -> None:
            try:
                cluster.add("d-1", [[3]], "x-1")
                outcome["raised"] = None
            except ConfigError as err:
                outcome["raised"] = err

        thread = threading.Thread(target=add, name="scheduler", daemon=True)
        thread.start()
        try:
            assert checked.wait(5.0)
            receiver.close()
        finally:
            go.set()
            thread.join(5.0)
        assert not thread.is_alive()
        if outcome["raised"] is not None:
            return  # refused: the engine keeps its blocks and knows
        deadline = time.monotonic() + 1.0
        got: dict[str, Any] = {}
        while time.monotonic() < deadline and "d-1" not in got:
            results = receiver.get_finished()
            got.update({rid: None for rid in results.done}, **results.failed, **results.cancelled)
            time.sleep(0.05)
        assert "d-1" in got, "accepted by add_request, never reported: its blocks never come back"


def test_a_finish_while_prefill_closes_is_refused() -> None:
    """P mirrors D (the same rule for both): once close() began on the shutdown thread (here
    waiting for a WRITE in flight), a request_finished on the scheduler thread is refused
    naming the close; it is never reported, and its blocks are the engine's to free."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 1.0}
    with Cluster(
        transport="faulty", transport_options=options, close_timeout_s=3.0, **SLOW_SILENCE
    ) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        closer = threading.Thread(target=sender.close, name="shutdown", daemon=True)
        closer.start()
        wait_until(lambda: sender._closing, what="close() to begin")
        with pytest.raises(ConfigError, match="which is closing"):
            sender.request_finished("p-2", [[6]], match_key="x-2")
        closer.join(10.0)
        assert not closer.is_alive()
        results = sender.get_finished()
        assert "p-2" not in results.failed and "p-2" not in results.sent, results
        assert "p-1" in results.sent or "p-1" in results.failed, results


def test_two_closes_at_once_both_return_and_report_each_request_once() -> None:
    """Two shutdown paths close D at once (an atexit hook and the engine's own shutdown): the
    second waits for the first and finds the worker closed; the pending request is reported
    failed once."""
    with Cluster(close_timeout_s=0.3, **SLOW_SILENCE) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")  # P never finishes it
        closers = [threading.Thread(target=receiver.close, daemon=True) for _ in range(2)]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(10.0)
        assert not any(closer.is_alive() for closer in closers)
        results = receiver.get_finished()
        assert list(results.failed) == ["d-1"] and "worker closed" in results.failed["d-1"], results
        assert receiver.get_finished().failed == {}


# ---------------------------------------------------------------------------- finding 2


def test_a_close_racing_start_leaves_no_worker_that_accepts_calls_it_never_reports() -> None:
    with Cluster(**SLOW_SILENCE) as cluster:
        model_sender = cluster.senders[P0]
        sender = PushSender(model_sender.config, cluster.p_caches[P0], pm=cluster.pm)
        entered, go = threading.Event(), threading.Event()
        real_make_core = sender._make_core

        def stalled_make_core() -> None:  # start(): transport made, writer not started yet
            real_make_core()
            entered.set()
            go.wait(5.0)

        sender._make_core = stalled_make_core  # type: ignore[method-assign]
        outcome: dict[str, Any] = {}

        def start() -> None:
            try:
                outcome["meta"] = sender.start()
            except ConfigError as err:
                outcome["error"] = err

        starter = threading.Thread(target=start, name="init", daemon=True)
        starter.start()
        closer = threading.Thread(target=sender.close, name="shutdown", daemon=True)
        try:
            assert entered.wait(5.0)
            closer.start()  # the shutdown thread, while start() is still running
            time.sleep(0.3)
            assert closer.is_alive(), "close() returned while start() was still running"
        finally:
            go.set()
            starter.join(5.0)
            closer.join(5.0)
        assert not starter.is_alive() and not closer.is_alive()
        try:
            sender.request_finished("p-1", [[5]], match_key="x-1")
        except ConfigError:
            # Refused: the engine keeps its blocks and knows. start() saw the close before it
            # started the writer: it raised, and released what it made.
            assert "close()" in str(outcome.get("error")), outcome
            assert sender._transport_closed
            return
        deadline = time.monotonic() + 1.0
        got: dict[str, Any] = {}
        while time.monotonic() < deadline and "p-1" not in got:
            results = sender.get_finished()
            got.update({rid: None for rid in results.sent}, **results.failed)
            time.sleep(0.05)
        sender.close()
        assert "p-1" in got, ("accepted after start() returned, never reported", outcome)


def test_start_on_two_threads_at_once_starts_one_worker() -> None:
    with Cluster(**SLOW_SILENCE) as cluster:
        sender = PushSender(cluster.senders[P0].config, cluster.p_caches[P0], pm=cluster.pm)
        entered, go = threading.Event(), threading.Event()
        real_make_core = sender._make_core
        made: list[Any] = []

        def stalled_make_core() -> None:
            real_make_core()
            made.append(sender.transport)
            entered.set()
            go.wait(1.0)

        sender._make_core = stalled_make_core  # type: ignore[method-assign]
        outcomes: list[Any] = []

        def start() -> None:
            try:
                sender.start()
                outcomes.append("started")
            except Exception as err:
                outcomes.append(err)

        first = threading.Thread(target=start, daemon=True)
        first.start()
        assert entered.wait(5.0)
        second = threading.Thread(target=start, daemon=True)
        second.start()
        time.sleep(0.3)
        go.set()
        first.join(10.0)
        second.join(10.0)
        sender.close()
        assert len(made) == 1 and outcomes.count("started") == 1, (made, outcomes)


def test_a_worker_closed_before_it_started_refuses_start() -> None:
    """A further defect of finding 2's class: close() of a worker never started (the engine's
    shutdown ran before its init finished), then start(). On main start() returned the metadata
    of a 'running' worker whose writer had exited at once (close() had set its stop flag):
    request_finished was accepted and never reported. Now start() is refused."""
    with Cluster(**SLOW_SILENCE) as cluster:
        sender = PushSender(cluster.senders[P0].config, cluster.p_caches[P0], pm=cluster.pm)
        sender.close()
        with pytest.raises(ConfigError, match="was closed; make a new worker"):
            sender.start()
        with pytest.raises(ConfigError, match="which is closed"):
            sender.request_finished("p-1", [[5]], match_key="x-1")


def test_a_close_waiting_for_a_hung_start_returns_at_its_bound_and_start_releases_what_it_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """start() hangs (a transport's memory registration that takes long) while the shutdown
    thread closes: close() waits at most ``start_wait_s`` and returns; the start() that goes
    on later sees the close before it starts the writer, raises and releases its transport."""
    monkeypatch.setattr(PushSender, "start_wait_s", 0.3)
    with Cluster(**SLOW_SILENCE) as cluster:
        sender = PushSender(cluster.senders[P0].config, cluster.p_caches[P0], pm=cluster.pm)
        entered, go = threading.Event(), threading.Event()
        real_make_core = sender._make_core

        def stalled_make_core() -> None:
            real_make_core()
            entered.set()
            go.wait(10.0)

        sender._make_core = stalled_make_core  # type: ignore[method-assign]
        outcome: dict[str, Any] = {}

        def start() -> None:
            try:
                outcome["meta"] = sender.start()
            except ConfigError as err:
                outcome["error"] = err

        starter = threading.Thread(target=start, name="init", daemon=True)
        starter.start()
        try:
            assert entered.wait(5.0)
            began = time.monotonic()
            sender.close()
            took = time.monotonic() - began
            assert 0.25 <= took < 3.0, took
            assert not sender._transport_closed  # start() still runs: close() left it alone
        finally:
            go.set()
            starter.join(5.0)
        assert not starter.is_alive()
        assert "meta" not in outcome and "close()" in str(outcome["error"]), outcome
        assert sender._transport_closed and sender._thread is None
        with pytest.raises(ConfigError, match="which is closed"):
            sender.request_finished("p-1", [[5]], match_key="x-1")


# ---------------------------------------------------------------------------- finding 3


def test_a_kv_cache_tensor_replaced_after_start_is_refused_not_silently_unwritten() -> None:
    """The engine re-allocates one layer's cache after start() (a re-initialised pool) and puts
    the new tensor in the dict it handed the worker. kvpush registered the old memory: a
    request must be refused naming the layer (or the KV must land where the engine reads it)."""
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        caches = cluster.d_caches[0]
        name = next(iter(caches))
        old = caches[name]
        caches[name] = torch.zeros_like(old)  # the engine's new tensor; old kept alive here
        try:
            cluster.add("d-1", [[3]], "x-1")
        except ConfigError as err:
            assert name in str(err), err
            return
        cluster.finish("p-1", [[5]], "x-1")
        outcome = cluster.wait_decode("d-1")
        assert outcome != {0: None} or _block(cluster, 3, 5), (
            "reported done, but the engine's tensor of that layer never received P's bytes"
        )


def test_a_kv_cache_tensor_replaced_at_prefill_is_refused_naming_it() -> None:
    """P's side of finding 3: a replaced tensor would have P push the registered (old) memory,
    not the KV the engine now writes. request_finished is refused naming the cache and saying
    to restart the worker; the old tensor's memory stays allocated while the worker lives."""
    with Cluster(**SLOW_SILENCE) as cluster:
        caches = cluster.p_caches[P0]
        name = sorted(caches)[-1]
        old = caches[name]
        caches[name] = old.clone()
        with pytest.raises(ConfigError, match="start a new one with the new caches") as err:
            cluster.finish("p-1", [[5]], "x-1")
        assert repr(name) in str(err.value) and "replaced" in str(err.value), err.value
        sender = cluster.senders[P0]
        assert sender.registered_caches is not None
        assert sender.registered_caches.registered[name][0] is old
        caches[name] = old  # the engine puts the registered tensor back: accepted again
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert _block(cluster, 3, 5)


def test_a_kv_cache_storage_swapped_in_place_at_decode_is_refused() -> None:
    """The same tensor object re-pointed at new memory (``tensor.data = ...``): its identity
    holds, its address does not; add_request is refused naming the cache."""
    with Cluster(**SLOW_SILENCE) as cluster:
        caches = cluster.d_caches[0]
        name = next(iter(caches))
        tensor = caches[name]
        tensor.data = torch.zeros_like(tensor)
        with pytest.raises(ConfigError, match="not at the 0x") as err:
            cluster.add("d-1", [[3]], "x-1")
        assert repr(name) in str(err.value), err.value


# ---------------------------------------------------------------------------- checked and held


def test_block_id_lists_mutated_after_the_call_do_not_change_what_moves() -> None:
    """The engine reuses its block-table lists (and tensors) after the call returned: kvpush
    must have copied them, so P reads the blocks it was given and D receives into its own."""
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        p_ids, d_ids = [5, 6], torch.tensor([3, 4])
        cluster.finish("p-1", p_ids, "x-1")
        p_ids[:] = [9, 10]  # mutated before D registered: P must still push blocks 5 and 6
        cluster.add("d-1", d_ids, "x-1")
        d_ids[0], d_ids[1] = 20, 21
        assert cluster.wait_decode("d-1") == {0: None}
        assert _block(cluster, 3, 5) and _block(cluster, 4, 6)
        for tensor in cluster.d_caches[0].values():
            assert not kv_bytes(tensor)[:, 20:22].any()


def test_one_key_finished_from_many_threads_at_once_is_accepted_once() -> None:
    """Eight scheduler threads finish prefills under one key (and eight D threads add one id):
    exactly one of each is accepted, the rest refused; the one result arrives once."""
    with Cluster(**SLOW_SILENCE) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        barrier = threading.Barrier(8)
        accepted: list[str] = []
        refused: list[str] = []

        def finish(i: int) -> None:
            barrier.wait(5.0)
            try:
                sender.request_finished(f"p-{i}", [[10 + i]], match_key="x-1")
                accepted.append(f"p-{i}")
            except ConfigError as err:
                refused.append(str(err))

        def add(i: int) -> None:
            barrier.wait(5.0)
            try:
                cluster.add("d-1", [[30 + i]], "x-1")
                accepted.append(f"d-{30 + i}")
            except ConfigError as err:
                refused.append(str(err))

        for target in (finish, add):
            threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(10.0)
            barrier.reset()
        assert len(accepted) == 2 and len(refused) == 14, (accepted, refused)
        p_id, d_block = accepted[0], int(accepted[1].split("-")[1])
        assert cluster.wait_decode("d-1") == {0: None}
        assert _block(cluster, d_block, 10 + int(p_id.split("-")[1]))
        assert cluster.wait_prefill(p_id) == {P0: None}
        time.sleep(0.1)
        cluster.poll()
        assert receiver.get_finished().done == () and sender.get_finished().sent == ()


@pytest.mark.parametrize(("transport", "per_thread"), [("loopback", 24), ("nixl", 9)])
def test_many_threads_adding_finishing_cancelling_and_collecting_report_each_request_once(
    transport: str, per_thread: int
) -> None:
    """Four scheduler threads run requests (add on D, finish on P; a third cancelled on D
    before P finished, a third cancelled by another thread while P finishes), reusing their
    blocks once the result came back; two collector threads
    drain both sides at once (get_finished and wait_finished). Every request is reported
    exactly once (done, or cancelled and released), never to two collectors, none lost, and a
    done block holds P's bytes. Bounded: a few seconds."""
    threads_n = 4
    # lease_s: a cancel that wins the race before D's PUSH_REG went out (the first of each thread,
    # while the handshake runs) never reaches P, which holds that prefill until its lease.
    config = {"request_timeout_s": 20.0, "heartbeat_interval_s": 0.5, "lease_s": 2.0}
    with Cluster(transport=transport, **config) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        seen = threading.Condition()
        d_seen: dict[str, list[str]] = {}
        p_seen: dict[str, list[str]] = {}
        stop = threading.Event()
        errors: list[BaseException] = []

        def record(into: dict[str, list[str]], rid: str, what: str) -> None:
            with seen:
                into.setdefault(rid, []).append(what)
                seen.notify_all()

        def collect(use_wait: bool) -> None:
            try:
                while not stop.is_set():
                    if use_wait:
                        try:
                            got = receiver.wait_finished(0.05)
                        except Exception:
                            got = receiver.get_finished()
                    else:
                        got = receiver.get_finished()
                    for rid in got.done:
                        record(d_seen, rid, "done")
                    for rid in got.failed:
                        record(d_seen, rid, "failed")
                    for rid in got.cancelled:
                        record(d_seen, rid, "cancelled")
                    for rid in got.released:
                        record(d_seen, rid, "released")
                    sent = sender.get_finished()
                    for rid in sent.sent:
                        record(p_seen, rid, "sent")
                    for rid in sent.failed:
                        record(p_seen, rid, "failed")
                    time.sleep(0.001)
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)

        def ended(rid: str) -> bool:
            return any(what in ("done", "released") for what in d_seen.get(rid, []))

        def schedule(t: int) -> None:
            try:
                for i in range(per_thread):
                    rid, block = f"r{t}-{i}", 1 + t * 8 + i % 4
                    cluster.add(f"d-{rid}", [[block]], f"x-{rid}")
                    if i % 3 == 0:
                        receiver.cancel(f"d-{rid}")
                    else:  # i % 3 == 1: an abort handler cancels while P finishes and writes
                        racer = threading.Thread(target=receiver.cancel, args=(f"d-{rid}",), daemon=True)
                        if i % 3 == 1:
                            racer.start()
                        sender.request_finished(f"p-{rid}", [[block + 32]], match_key=f"x-{rid}")
                        racer.join(5.0) if i % 3 == 1 else None
                    with seen:
                        assert seen.wait_for(lambda rid=rid: ended(f"d-{rid}"), 10.0), rid
                        outcome = list(d_seen[f"d-{rid}"])
                    if "done" in outcome:
                        assert _block(cluster, block, block + 32), rid
            except BaseException as err:
                errors.append(err)

        collectors = [threading.Thread(target=collect, args=(w,), daemon=True) for w in (False, True)]
        schedulers = [threading.Thread(target=schedule, args=(t,), daemon=True) for t in range(threads_n)]
        for thread in collectors + schedulers:
            thread.start()
        for thread in schedulers:
            thread.join(60.0)
        expected = {f"p-r{t}-{i}" for t in range(threads_n) for i in range(per_thread) if i % 3}
        with seen:  # the cancelled-first requests' P legs are never finished: nothing to wait for
            seen.wait_for(lambda: len(p_seen) >= len(expected), 10.0)
        stop.set()
        for thread in collectors:
            thread.join(5.0)
        assert not errors, errors
        assert len(d_seen) == threads_n * per_thread
        for rid, outcomes in d_seen.items():
            i = int(rid.rsplit("-", 1)[1])
            assert sorted(outcomes) in (["done"], ["cancelled", "released"]), (rid, outcomes)
            if i % 3 == 2:
                assert outcomes == ["done"], (rid, outcomes)
            if i % 3 == 0:
                assert outcomes != ["done"], (rid, outcomes)
        assert set(p_seen) == expected, sorted(expected - set(p_seen))
        for rid, outcomes in p_seen.items():
            i = int(rid.rsplit("-", 1)[1])
            assert len(outcomes) == 1 and (i % 3 == 1 or outcomes == ["sent"]), (rid, outcomes)
