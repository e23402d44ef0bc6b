"""probeD2: D's engine API used the way engines do, races and misuses included.

Findings (each test failed before its fix, 2026-12-02: ``add_request`` refuses an id whose
earlier results ``get_finished()`` has not returned; ``DecodeCore._finish_close`` reports
``cancelled`` before the release):

1. A request id reused while an earlier request of that id has results ``get_finished()`` has
   not returned yet: ``add_request`` accepts it (the earlier one is no longer active), and the
   next ``get_finished()`` names the id in ``done`` / ``cancelled`` / ``released`` for the
   *earlier* registration. Results carry only the engine's id, so the engine applies them to the
   request it holds under that id now: it decodes the new request from blocks nothing wrote
   (wrong KV reported done), or it frees the new request's blocks on the old one's ``released``
   and P's WRITE for the new one lands in them (a WRITE into blocks the engine was told it may
   reuse). The alias (``rid#n``) keeps the core and the wire apart, not the engine's results.

2. A cancel that settles through P's acknowledgement reaches the engine as two results written
   apart: ``Release`` first, ``Report(cancelled)`` after it (``DecodeCore._finish_close``), each
   under its own hold of the results lock. ``get_finished()`` (any thread, per the docs) can
   return ``released`` alone; the engine frees the blocks and adds the id again (it is no longer
   active, and nothing is left uncollected), and the next ``get_finished()`` says ``cancelled``
   for it: the engine takes the new request as cancelled and frees its blocks while P's WRITE
   for it is on its way. The docs promise ``.cancelled`` and ``.released`` together.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cluster import Cluster, kv_bytes, wait_until

from kvpush.core.actions import Release
from kvpush.core.errors import ConfigError
from kvpush.core.types import RankKey

FINDING_2 = (
    "finding 2: a cancel acknowledged by P is reported as Release then Report(cancelled), in two "
    "lock holds (DecodeCore._finish_close): get_finished() between them returns released without "
    "cancelled, and the late 'cancelled' is read as the re-added request's"
)
FINDING_1 = (
    "finding 1: add_request accepts a request id whose earlier registration's results "
    "get_finished() has not returned; results name only the engine's id, so the earlier "
    "registration's done/released are read as the new request's (core/receiver.py add_request)"
)


def _block(cluster: Cluster, d_block: int, p_block: int) -> bool:
    """D's block ``d_block`` holds P's block ``p_block`` in every layer."""
    for name, tensor in cluster.d_caches[0].items():
        dst, src = kv_bytes(tensor), kv_bytes(cluster.p_caches[RankKey(0, 0)][name])
        if not torch.equal(dst[:, d_block], src[:, p_block]):
            return False
    return True


def _readd(cluster: Cluster, rid: str, blocks: list[list[int]], key: str) -> bool:
    """The engine adds ``rid`` again; True when accepted. A refusal (the fix: collect the
    earlier results first) is what an engine handles by draining and adding again."""
    try:
        cluster.add(rid, blocks, key)
    except ConfigError as err:
        assert "get_finished" in str(err), err
        return False
    return True


def test_a_reused_id_is_never_reported_done_for_its_earlier_registration() -> None:
    """An SGLang-style engine keyed by the client's request id: 'a' landed (not collected yet),
    the client aborts and retries 'a' on this D with other blocks before the engine's next
    poll. Every 'done' for 'a' the engine reads after that must mean the retry's KV landed."""
    with Cluster(request_timeout_s=30) as cluster:
        rx = cluster.receivers[0]
        cluster.add("a", [[1]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        wait_until(lambda: rx.pending_requests == 0, 10, "'a' to land")
        rx.cancel("a")  # the client's abort: a done request is not affected
        if not _readd(cluster, "a", [[2]], "x-2"):
            got = rx.get_finished()  # the fix's path: collect, then add again
            assert got.done == ("a",) and _block(cluster, 1, 5)
            assert _readd(cluster, "a", [[2]], "x-2")
        got = rx.get_finished()
        if "a" in got.done:
            assert _block(cluster, 2, 6), "'a' reported done, but its blocks hold no KV of P"
        cluster.finish("p-2", [[6]], "x-2")
        assert cluster.wait_decode("a") == {0: None}
        assert _block(cluster, 2, 6)


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_a_reused_id_s_blocks_are_not_written_after_the_engine_was_told_released(transport: str) -> None:
    """'a' cancelled and released (not collected yet); the engine retries 'a' with block 2 at
    once. The next poll says 'a' cancelled and released, so the engine frees what it holds for
    'a' (block 2) and writes its own data there; P's push for the retry must not land in it
    (over real NIXL too: P's WRITE lands in the block the engine was told is free)."""
    with Cluster(transport=transport, request_timeout_s=30) as cluster:
        rx = cluster.receivers[0]
        cluster.add("a", [[1]], "x-1")
        rx.cancel("a")
        wait_until(lambda: rx.pending_requests == 0, 10, "'a' to be released")
        if not _readd(cluster, "a", [[2]], "x-2"):
            got = rx.get_finished()
            assert "a" in got.released
            assert _readd(cluster, "a", [[2]], "x-2")
        got = rx.get_finished()
        reused = "a" in got.released
        if reused:  # the engine frees 'a''s blocks and reuses block 2 for its own KV
            for tensor in cluster.d_caches[0].values():
                kv_bytes(tensor)[:, 2] = 7
        cluster.finish("p-2", [[6]], "x-2")
        cluster.wait_prefill("p-2")
        if reused:
            for name, tensor in cluster.d_caches[0].items():
                assert bool((kv_bytes(tensor)[:, 2] == 7).all()), f"P wrote released block 2 ({name})"
        else:
            assert cluster.wait_decode("a") == {0: None} and _block(cluster, 2, 6)


def test_cancelled_and_released_reach_the_engine_in_one_get_finished() -> None:
    """The engine's poller runs right after D's writer executed the Release of cancelled 'a'
    (the hook stands in for that thread's timing), sees 'a' released, frees block 1 and
    re-adds 'a' with block 2. Nothing the engine reads afterwards may end the new 'a' before
    its own KV landed."""
    with Cluster(request_timeout_s=30) as cluster:
        rx = cluster.receivers[0]
        seen: list[Any] = []
        run = rx._run

        def engine_polls_between_actions(action: Any) -> None:
            run(action)
            if isinstance(action, Release) and action.request_id == "a" and not seen:
                got = rx.get_finished()  # the engine's poller, right here
                seen.append(got)
                if "a" in got.released and "a" not in got.cancelled:
                    cluster.add("a", [[2]], "x-2")  # retry of 'a' with other blocks

        rx._run = engine_polls_between_actions  # type: ignore[method-assign]
        cluster.add("a", [[1]], "x-1")
        wait_until(lambda: rx.call_on_writer(lambda: _phase(rx, "a")) == "registered", 10, "PUSH_REG")
        rx.cancel("a")
        wait_until(lambda: bool(seen), 10, "'a' to be released")
        rx.call_on_writer(lambda: None)
        got = rx.get_finished()
        if "a" in seen[0].released and "a" not in seen[0].cancelled:
            # 'a' (the retry) is live: no end of 'a' may be reported before P pushed x-2
            assert "a" not in got.cancelled and "a" not in got.released, got
            cluster.finish("p-2", [[6]], "x-2")
            assert cluster.wait_decode("a") == {0: None} and _block(cluster, 2, 6)
        else:
            assert "a" in seen[0].cancelled and "a" in seen[0].released


def _phase(rx: Any, core_id: str) -> str | None:
    receive = rx.core._requests.get(core_id)
    return None if receive is None else receive.phase.value


def test_a_cancel_racing_the_last_done_reports_done_and_never_cancelled() -> None:
    """Held: a cancel that reaches the writer after the last DONE leaves the request done (the
    KV landed whole): 'a' is in done once, never in cancelled or released, and its blocks hold
    P's KV. (An engine waiting for 'released' after a cancel must take 'done' as its end.)"""
    with Cluster(request_timeout_s=30) as cluster:
        rx = cluster.receivers[0]
        cluster.add("a", [[1]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        wait_until(lambda: rx.pending_requests == 0, 10, "'a' to land")
        rx.cancel("a")
        rx.cancel("a")
        rx.call_on_writer(lambda: None)
        got = rx.get_finished()
        assert got.done == ("a",) and not got.cancelled and not got.released and not got.failed
        assert _block(cluster, 1, 5)
        rx.call_on_writer(lambda: None)
        later = rx.get_finished()
        assert not (later.done or later.cancelled or later.released or later.failed)


def test_cancel_of_an_id_never_added_does_not_touch_a_later_request_of_that_id() -> None:
    """Held: a cancel of an id the rank never had (an engine aborting before it added) is not
    remembered: the id added afterwards is received whole."""
    with Cluster(request_timeout_s=30) as cluster:
        rx = cluster.receivers[0]
        rx.cancel("b")
        rx.call_on_writer(lambda: None)
        cluster.add("b", [[3]], "x-3")
        cluster.finish("p-3", [[9]], "x-3")
        assert cluster.wait_decode("b") == {0: None}
        assert _block(cluster, 3, 9) and "b" not in cluster.released[0]


def test_a_cancel_from_another_thread_is_never_queued_before_the_add_it_cancels() -> None:
    """The engine's scheduler adds ``a`` while another thread (an abort handler) cancels it.
    ``add_request`` queued the add for the writer after releasing the results lock, and
    ``cancel`` resolved the id and queued under its own hold: a cancel could reach the core
    before the add it names (ignored as unknown), and the request ran on though the engine
    had cancelled it. The add is now queued under the lock, so the cancel follows it."""
    import threading
    import time

    with Cluster(transport="loopback", request_timeout_s=30.0) as cluster:
        receiver = cluster.receivers[0]
        queue = receiver.run_on_writer
        calls: list[str] = []

        def racing(command: Any) -> None:
            if not calls:  # the add: a cancel from another thread tries to go first
                calls.append("add")
                threading.Thread(target=receiver.cancel, args=("a",), daemon=True).start()
                time.sleep(0.2)
            queue(command)

        receiver.run_on_writer = racing  # type: ignore[method-assign]
        cluster.add("a", [[3]], "x-a")  # P never finishes x-a: only the cancel can end it
        receiver.run_on_writer = queue  # type: ignore[method-assign]
        deadline = time.monotonic() + 10.0
        cancelled, released = {}, ()
        while time.monotonic() < deadline and "a" not in released:
            results = receiver.get_finished()
            cancelled, released = {**cancelled, **results.cancelled}, (*released, *results.released)
            time.sleep(0.05)
        assert "a" in cancelled and "a" in released, (cancelled, released)
