"""A P worker that closes tells D: each registration is answered FAIL at once when nothing of it
was posted, and once its WRITE settled when one is in flight, so D neither waits for P's silence
(tens of seconds) nor releases blocks a WRITE may still reach.

Real NIXL between workers on 127.0.0.1, plus the pure core for the orderings a cluster cannot
time (a registration arriving after the shutdown began).
"""

from __future__ import annotations

import time

import torch
from cluster import Cluster, kv_bytes, wait_until
from test_protocol_safety import _note, _prefill_core, _registration

from kvpush.core import notifications as wire
from kvpush.core.actions import Post, Report, Send
from kvpush.core.notifications import NotificationKind
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)
SLOW_SILENCE = {"request_timeout_s": 60, "heartbeat_interval_s": 5.0}
"""D would take 20 s to call a silent P dead: anything faster was told."""


def _connected(cluster: Cluster) -> None:
    """Push one request so P has loaded D's rank (a later FAIL can reach it at once)."""
    cluster.add("d-0", [[1]], "x-0")
    cluster.finish("p-0", [[1]], "x-0")
    assert cluster.wait_decode("d-0") == {0: None}


def _wait_posted(sender) -> None:
    wait_until(lambda: sender.call_on_writer(lambda: len(sender.core.inflight_handles())) == 1, what="post")


def test_closing_p_fails_a_registration_it_never_wrote_at_once() -> None:
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        _connected(cluster)
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")  # P never finishes it
        wait_until(lambda: sender.call_on_writer(sender.core.state_sizes)["stashed"] == 1, what="P's stash")
        closed_at = time.monotonic()
        sender.close()
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        cluster.wait_released("d-1", timeout_s=5)
        assert reason is not None and "prefill worker closed" in reason
        assert time.monotonic() - closed_at < 5  # told, not timed out


def test_closing_p_whose_fail_was_lost_still_lets_d_release_at_its_goodbye() -> None:
    """Every FAIL is lost on its way to D. Once nothing of it is in flight the closing worker
    says goodbye (``BYE``), which settles what D registered with it: D fails the request and
    releases its blocks at once. It used to wait for P's silence and then, P's process living
    on (same host: copies no fence stops), hold the blocks until that process exited."""
    options = {"inner": "nixl", "drop_notifs": 1.0, "drop_prefixes": ["FAIL:"]}
    with Cluster(transport="faulty", transport_options=options, **SLOW_SILENCE) as cluster:
        _connected(cluster)
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")  # P never finishes it
        wait_until(lambda: sender.call_on_writer(sender.core.state_sizes)["stashed"] == 1, what="P's stash")
        closed_at = time.monotonic()
        sender.close()
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        cluster.wait_released("d-1", timeout_s=5)
        assert reason is not None and "closed" in reason, reason
        assert time.monotonic() - closed_at < 5  # told, not timed out
        assert cluster.receivers[0].transport.injected["drop"] >= 1  # the FAIL was lost


def test_closing_p_lets_a_write_in_flight_land_and_d_finish() -> None:
    """A WRITE in flight at close is waited for (bounded): its bytes and DONE reach D, and P
    reports the push sent, not failed."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 0.5}
    with Cluster(transport="faulty", transport_options=options, **SLOW_SILENCE) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3, 4]], "x-1")
        cluster.finish("p-1", [[5, 6]], "x-1")
        _wait_posted(sender)
        sender.close()
        assert cluster.wait_decode("d-1", timeout_s=5) == {0: None}
        cluster.poll()
        assert cluster.p_results[P0] == {"p-1": None}  # sent
        for layer, tensor in cluster.d_caches[0].items():
            src = kv_bytes(cluster.p_caches[P0][layer])
            assert torch.equal(kv_bytes(tensor)[:, [3, 4]], src[:, [5, 6]]), layer


def test_closing_p_with_a_write_past_close_timeout_leaves_d_its_own_deadline() -> None:
    """close() waits at most ``close_timeout_s``; a WRITE still in flight then is not answered
    FAIL (it may still land), so D keeps the blocks until its own deadline decides."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 30.0}
    with Cluster(
        transport="faulty", transport_options=options, close_timeout_s=0.3, **SLOW_SILENCE
    ) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        started = time.monotonic()
        sender.close()
        assert time.monotonic() - started < 3
        time.sleep(0.5)
        cluster.poll()
        assert "d-1" not in cluster.d_results[0] and "d-1" not in cluster.released[0]


def _loaded_core():
    core = _prefill_core()
    core.notification("D-agent", _note(wire.encode_hello(_registration(), 0)), 100.0)
    core.connected("D", 0, "D-agent", "d1", 1, "", 100.0)
    return core


def _fails(actions) -> list[str]:
    return [
        note.request_id
        for a in actions
        if isinstance(a, Send) and (note := _note(a.message)).kind is NotificationKind.FAILED
    ]


def test_a_registration_after_shutdown_is_answered_fail_and_never_written() -> None:
    core = _loaded_core()
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    assert _fails(core.shutdown("closing", 100.0)) == []  # nothing registered yet
    actions = core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.1)
    assert _fails(actions) == ["d-1"]
    assert not any(isinstance(a, Post) for a in actions)


def test_a_finish_after_shutdown_is_reported_failed() -> None:
    core = _loaded_core()
    core.shutdown("closing", 100.0)
    (report,) = core.finished("x-2", "p-2", ((5,),), "", 100.1)
    assert isinstance(report, Report) and report.outcome == "failed" and report.reason == "closing"


def test_shutdown_answers_stashed_registrations_and_keeps_a_write_in_flight() -> None:
    core = _loaded_core()
    core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.0)  # stashed
    reg2 = _registration(request_id="d-2", match_key="x-2")
    core.notification("D-agent", _note(wire.encode_push_reg(reg2)), 100.0)
    (post,) = [a for a in core.finished("x-2", "p-2", ((6,),), "", 100.0) if isinstance(a, Post)]
    assert core.confirm_post(post.key, post.dst, 100.0)
    core.posted(post.key, post.dst, ["h"], 64, 100.0)
    actions = core.shutdown("closing", 100.1)
    assert _fails(actions) == ["d-1"]  # d-2's WRITE is in flight: it is not told yet
    settled = core.write_settled("x-2", 0, "h", True, 100.2)
    assert [a.outcome for a in settled if isinstance(a, Report)] == ["sent"]


# ---------------------------------------------------------------------------- D closes


def test_closing_d_cancels_its_pending_requests_and_p_never_writes_them() -> None:
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        _connected(cluster)
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="D's PUSH_REG")
        receiver.close()
        results = receiver.get_finished()
        assert "decode worker closed" in results.failed["d-1"] and "d-1" in results.released
        cluster.finish("p-1", [[5]], "x-1")  # P acknowledged the cancel: the key is refused
        reason = cluster.wait_prefill("p-1")[P0]
        assert reason is not None and "x-1" in reason
        assert cluster.senders[P0].stats["writes"] == 1  # d-0's only


def test_closing_d_releases_a_request_only_after_its_write_in_flight_settled() -> None:
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 0.6}
    with Cluster(transport="faulty", transport_options=options, **SLOW_SILENCE) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        started = time.monotonic()
        receiver.close()
        results = receiver.get_finished()
        assert time.monotonic() - started > 0.3  # it waited for P's acknowledgement
        assert "d-1" in results.released and "d-1" not in results.done


def test_closing_d_does_not_release_what_an_unacknowledged_producer_may_still_write() -> None:
    """A kernel copy stalled past D's ``close_timeout_s``: the request is reported failed, its
    blocks are not released (the engine must not reuse them while P's process may copy; an
    engine frees a failed request's blocks only when ``released`` names it)."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 30.0, "kernel_copies": True}
    with Cluster(
        transport="faulty", transport_options=options, close_timeout_s=0.3, **SLOW_SILENCE
    ) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        receiver.close()
        results = receiver.get_finished()
        assert "decode worker closed" in results.failed["d-1"] and "d-1" not in results.released


def test_a_request_failed_and_held_then_closed_says_its_blocks_are_not_released() -> None:
    """Failed at D's watchdog while P's kernel copy is stalled (held: no fence stops it), not
    collected by the engine yet, then the worker closes: its reason must say no release will
    follow (it kept the first reason alone, and an engine waited for a release that never came)."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 30.0, "kernel_copies": True}
    with Cluster(
        transport="faulty",
        transport_options=options,
        close_timeout_s=0.3,
        request_timeout_s=1.0,
        heartbeat_interval_s=5.0,
    ) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        _wait_posted(sender)
        wait_until(lambda: receiver.call_on_writer(lambda: "d-1" in receiver._failed), what="watchdog")
        receiver.close()
        results = receiver.get_finished()
        assert "NOT released" in results.failed["d-1"] and "d-1" not in results.released, results


# ---------------------------------------------------------------------------- a broken endpoint


def test_p_forgets_a_decode_it_cannot_send_to_and_handshakes_again_at_its_hello() -> None:
    """P stopped while D fenced its connections: every send to D then raises (the endpoint
    stays broken). P kept answering D's HELLO through it, so D never reached P again (found
    by tests/test_fencing.py over ``ucx_tls=tcp``). P now forgets the engine (failing what it
    posted to it; a registration it posted nothing for is dropped, for D to register again:
    tests/test_fence_cut_live_stage.py); the next HELLO is handshaken afresh."""
    from kvpush.core.actions import Connect, DropPeer

    core = _loaded_core()
    core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.0)  # stashed
    actions = core.unreachable("D-agent", "NIXL_ERR_REMOTE_DISCONNECT", 100.1)
    assert [type(a) for a in actions] == [DropPeer] and not _fails(actions)
    assert core.state_sizes()["engines"] == 0
    assert all(not request.regs for request in core._requests.values())  # the registration went
    again = core.notification("D-agent", _note(wire.encode_hello(_registration(), 0)), 100.2)
    assert any(isinstance(a, Connect) for a in again)
    assert core.unreachable("someone-else", "gone", 100.3) == []


def test_a_goodbye_that_overtakes_the_last_done_does_not_fail_the_request() -> None:
    """UCX may deliver P's ``BYE`` before the DONE of its last WRITE (different lanes; a CI run
    of examples/engine_multiprocess.py saw it). Here D reads every DONE 0.5 s late, so the BYE
    of a P closed right after its WRITE completed always comes first: it names the request
    (``delivered``), and D counts the DONE when it arrives instead of failing a request whose
    bytes landed (tests/test_goodbye_overtakes_done.py has the orderings on the core)."""
    options = {"inner": "nixl", "delay_notifs": 1.0, "delay_prefixes": ["DONE:"], "delay_s": 0.5}
    with Cluster(transport="faulty", transport_options=options, **SLOW_SILENCE) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3, 4]], "x-1")
        cluster.finish("p-1", [[5, 6]], "x-1")
        assert cluster.wait_prefill("p-1") == {P0: None}  # P's WRITE completed: its DONE is on its way
        sender.close()  # says goodbye at once: nothing is in flight
        assert cluster.wait_decode("d-1", timeout_s=5) == {0: None}
        assert cluster.receivers[0].transport.injected["delay"] >= 1
        for layer, tensor in cluster.d_caches[0].items():
            src = kv_bytes(cluster.p_caches[P0][layer])
            assert torch.equal(kv_bytes(tensor)[:, [3, 4]], src[:, [5, 6]]), layer


def test_a_worker_recreated_after_its_goodbye_was_lost_lets_d_release_what_it_held() -> None:
    """P and D share a host, so D cannot fence P's copies: a cancelled request whose
    acknowledgement was lost is held until the incarnation it registered with answers or its
    process exits. That worker closes and its ``BYE`` is lost too; a new worker is created in
    the same (live) process. D used to hold the blocks until that process exited, i.e. for
    ever. The new worker's handshake states the incarnations that ended in its process with
    nothing in flight, and D releases."""
    from kvpush.engine import PushSender

    options = {"inner": "nixl", "drop_notifs": 1.0, "drop_prefixes": ["CANCEL_ACK:", "BYE:"]}
    fast = {"write_deadline_s": 1.0, "heartbeat_interval_s": 0.5, "request_timeout_s": 60}
    with Cluster(transport="faulty", transport_options=options, **fast) as cluster:
        _connected(cluster)
        old, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")  # P never finishes it
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="D's PUSH_REG")
        receiver.cancel("d-1")
        wait_until(lambda: receiver.stats["held_for_kernel_copies"] == 1, timeout_s=15, what="D's hold")
        old.close()  # its BYE is lost
        new = PushSender(old.config, cluster.p_caches[P0], pm=cluster.pm)
        new.start()
        cluster.senders[P0] = new
        cluster.p_server.publish(P0, new.handshake_payload())
        cluster.wait_released("d-1", timeout_s=15)
        assert receiver.transport.injected["drop"] >= 2  # the acknowledgement and the BYE
