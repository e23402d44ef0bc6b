"""A prefill the engine abandons (aborted or failed before it finished) is never pushed: P says
so (``PushSender.request_abandoned``) and D's registrations of its key are answered FAIL, held
ones at once and later ones on arrival, instead of D waiting for its registration timeout."""

from __future__ import annotations

import time

from cluster import Cluster, wait_until
from test_close_tells_decode import _fails, _loaded_core
from test_protocol_safety import _note, _registration

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Post
from kvpush.core.types import RankKey

P0 = RankKey(0, 0)


def test_a_held_registration_and_a_later_one_are_answered_fail() -> None:
    core = _loaded_core()
    core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.0)  # held
    assert _fails(core.abandoned("x-1", "aborted", 100.1)) == ["d-1"]
    late = _registration(request_id="d-2")  # another D request of the same key, later
    actions = core.notification("D-agent", _note(wire.encode_push_reg(late)), 100.2)
    assert _fails(actions) == ["d-2"] and not any(isinstance(a, Post) for a in actions)
    assert core.state_sizes()["requests"] == 0


def test_a_key_being_pushed_is_not_abandoned() -> None:
    core = _loaded_core()
    core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.0)
    posts = [a for a in core.finished("x-1", "p-1", ((5,),), "", 100.0) if isinstance(a, Post)]
    assert len(posts) == 1
    assert core.abandoned("x-1", "aborted", 100.1) == []
    assert core.confirm_post(posts[0].key, posts[0].dst, 100.1)  # still pushed


def test_a_registration_from_an_unloaded_d_rank_is_answered_once_loaded() -> None:
    """A failed key's registration from a D rank P has not loaded yet: P handshakes with it and
    sends the FAIL once loaded (it used to drop it: D then waited for its timeout)."""
    from test_protocol_safety import _prefill_core

    core = _prefill_core()
    core.abandoned("x-1", "aborted", 100.0)
    actions = core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.1)
    assert any(isinstance(a, Connect) for a in actions) and not _fails(actions)
    assert _fails(core.connected("D", 0, "D-agent", "d1", 1, "", 100.2)) == ["d-1"]


def test_d_fails_at_once_when_p_abandons_before_and_after_d_registered() -> None:
    with Cluster(transport="nixl", request_timeout_s=60, registration_ttl_s=60) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        wait_until(lambda: sender.call_on_writer(sender.core.state_sizes)["stashed"] == 1, what="stash")
        started = time.monotonic()
        sender.request_abandoned("p-1", match_key="x-1", reason="client gone")
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "client gone" in reason
        sender.request_abandoned("p-2", match_key="x-2", reason="prefill raised")  # before D
        cluster.add("d-2", [[4]], "x-2")
        reason = cluster.wait_decode("d-2", timeout_s=5)[0]
        assert reason is not None and "prefill raised" in reason
        cluster.wait_released("d-2", timeout_s=5)
        assert time.monotonic() - started < 10
        assert sender.stats["writes"] == 0
