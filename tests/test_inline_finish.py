"""``request_finished`` inline: the engine's thread plans and, where the transport allows it,
posts the copy itself (``WorkerConfig.inline_finish``), without waiting for the writer thread.

On the loopback transport (``thread_safe_posts`` stands in for ``cuda_ipc``'s kernel launch):
the post runs on the caller's thread only when the transport says it needs no agent, the
writer is not in a round and nothing is queued before it; everything that needs the agent
(notifications, handshakes, packed WRITEs) still runs on the writer thread; and the bytes D
reports done are P's.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from cluster import Cluster, kv_bytes, settle, wait_until

from kvpush.core.errors import ConfigError
from kvpush.core.sender import PushSender
from kvpush.core.types import ParallelConfig
from kvpush.core.worker import WorkerConfig


def _sender(cluster: Cluster) -> PushSender:
    return next(iter(cluster.senders.values()))


def _registered(cluster: Cluster, count: int = 1) -> None:
    """Wait until P holds ``count`` D registrations whose prefill has not finished."""
    sender = _sender(cluster)
    wait_until(
        lambda: sender.call_on_writer(lambda: sender.core.state_sizes()["stashed"]) == count,
        what=f"{count} registration(s) waiting on P",
    )


def _warm(cluster: Cluster) -> None:
    """One full request first: D's engine is handshaken, its descriptor lists prepared."""
    cluster.add("warm", [[0, 1]], "k-warm")
    cluster.finish("warm", [[0, 1]], "k-warm")
    assert cluster.wait_decode("warm") == {0: None}


def _assert_landed(cluster: Cluster, p_blocks: list[int], d_blocks: list[int]) -> None:
    for layer, tensor in cluster.d_caches[0].items():
        source = kv_bytes(next(iter(cluster.p_caches.values()))[layer])
        assert kv_bytes(tensor)[:, d_blocks].equal(source[:, p_blocks]), layer


def _thread_safe(cluster: Cluster, on: bool = True) -> Any:
    transport = _sender(cluster).transport
    transport.thread_safe_posts = on
    return transport


def test_a_finish_whose_registration_waits_is_posted_on_the_engines_thread() -> None:
    with Cluster() as cluster:
        _warm(cluster)
        transport = _thread_safe(cluster)
        cluster.add("r1", [[5, 9, 7]], "k1")
        _registered(cluster)
        posts = len(transport.posts)
        cluster.finish("r1", [[3, 4, 6]], "k1")
        # Posted before request_finished returned, on this thread: no writer round between.
        assert len(transport.posts) == posts + 1
        assert transport.posts[-1]["thread"] == threading.get_ident()
        assert cluster.wait_decode("r1") == {0: None}
        assert cluster.wait_prefill("r1") == {next(iter(cluster.senders)): None}
        _assert_landed(cluster, [3, 4, 6], [5, 9, 7])


def test_a_transport_that_needs_its_agent_is_posted_by_the_writer() -> None:
    with Cluster() as cluster:
        _warm(cluster)
        transport = _thread_safe(cluster, on=False)
        cluster.add("r1", [[5, 9]], "k1")
        _registered(cluster)
        cluster.finish("r1", [[3, 4]], "k1")
        assert cluster.wait_decode("r1") == {0: None}
        writer = _sender(cluster)._thread
        assert writer is not None and transport.posts[-1]["thread"] == writer.ident
        _assert_landed(cluster, [3, 4], [5, 9])


@pytest.mark.parametrize("why", ["writer busy", "inline_finish off"])
def test_a_finish_is_queued_when_the_writer_is_busy_or_inline_is_off(why: str) -> None:
    extra = {"inline_finish": False} if why == "inline_finish off" else {}
    with Cluster(**extra) as cluster:
        _warm(cluster)
        transport = _thread_safe(cluster)
        sender = _sender(cluster)
        cluster.add("r1", [[5, 9]], "k1")
        _registered(cluster)
        posts = len(transport.posts)
        if why == "writer busy":
            with sender._owner:  # a writer round in progress
                cluster.finish("r1", [[3, 4]], "k1")
                assert len(transport.posts) == posts  # queued, not posted
        else:
            cluster.finish("r1", [[3, 4]], "k1")
        assert cluster.wait_decode("r1") == {0: None}
        assert sender._thread is not None and transport.posts[-1]["thread"] == sender._thread.ident
        _assert_landed(cluster, [3, 4], [5, 9])


def test_agent_calls_stay_on_the_writer_thread() -> None:
    """Every transport call but the thread-safe post runs on the writer: the FAIL that a
    mismatched registration earns, the handshake of a new D engine, polls and releases."""
    with Cluster() as cluster:
        _warm(cluster)
        transport = _thread_safe(cluster)
        sender = _sender(cluster)
        callers: dict[str, set[int]] = {}
        for name in ("send_notif", "drain_notifs", "load_peer", "remove_peer", "poll", "release"):
            original = getattr(transport, name)

            def wrapped(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
                callers.setdefault(_name, set()).add(threading.get_ident())
                return _original(*args, **kw)

            setattr(transport, name, wrapped)
        # A finish before any registration, an inline post, and a finish whose D registration
        # names a block count P cannot fill (P's blocks fewer than D's: a FAIL to D).
        cluster.finish("early", [[1, 2]], "k-early")
        cluster.add("early", [[10, 11]], "k-early")
        assert cluster.wait_decode("early") == {0: None}
        cluster.add("r1", [[5, 9]], "k1")
        _registered(cluster)
        cluster.finish("r1", [[3, 4]], "k1")
        assert cluster.wait_decode("r1") == {0: None}
        cluster.add("bad", [[12, 13, 14]], "k-bad", ranks=[0])
        _registered(cluster)
        cluster.finish("bad", [[20]], "k-bad")
        failed = cluster.wait_decode("bad")[0]
        assert failed is not None
        settle(sender)
        writer = sender._thread
        assert writer is not None
        assert callers.get("send_notif"), "no notification was sent at all"
        for name, threads in callers.items():
            assert threads == {writer.ident}, f"{name} ran off the writer thread"
        assert transport.posts[-1]["thread"] == threading.get_ident()  # r1 (bad posted nothing)


def test_a_finish_after_close_is_refused_and_nothing_runs_inline() -> None:
    cluster = Cluster()
    try:
        _warm(cluster)
        _thread_safe(cluster)
        sender = _sender(cluster)
    finally:
        cluster.close()
    with pytest.raises(ConfigError, match="closed"):
        sender.request_finished("late", [[1]])
    assert sender.run_inline(lambda: pytest.fail("ran after close")) is False


def test_inline_finish_must_be_a_bool() -> None:
    from cluster import MHA

    with pytest.raises(ConfigError, match="inline_finish must be a bool"):
        WorkerConfig(
            engine_id="P",
            parallel=ParallelConfig(tp_size=1, num_layers=MHA.num_layers),
            model=MHA,
            inline_finish="yes",  # type: ignore[arg-type]
        )
