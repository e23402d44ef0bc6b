"""Issue 10: KV lands only where each D rank offered it, and only while the offer is fresh.

Each test reproduces one finding of the protocol-safety issue on the loopback transport (bytes
really copied) or wraps it in the fault-injecting transport; the real-NIXL versions of the same
paths run in test_reliability.py, test_fencing.py and the soak.
"""

from __future__ import annotations

import torch
from cluster import Cluster, kv_bytes, wait_until
from test_push_flow import assert_pushed

from kvpush.core.types import RankKey

P0 = RankKey(0, 0)


def faulty(**options: object) -> dict[str, object]:
    return {"transport": "faulty", "transport_options": {"inner": "loopback", **options}}


def test_p_writes_a_decode_rank_only_on_that_ranks_own_registration() -> None:
    """Finding 2: the first PUSH_REG used to fan out to every D rank. Rank 1 never registers
    (its handshake failed): P must not touch its blocks."""
    with Cluster(decode_tp=2, lease_s=0.5, request_timeout_s=60) as cluster:
        before = {layer: kv_bytes(t).clone() for layer, t in cluster.d_caches[1].items()}
        cluster.add("d-1", [[3, 4]], "x-1", ranks=[0])  # only D rank 0 registers
        cluster.finish("p-1", [[5, 6]], "x-1")
        assert cluster.wait_decode("d-1", ranks=[0]) == {0: None}
        reason = cluster.wait_prefill("p-1", timeout_s=5)[P0]
        assert reason is not None and "D rank(s) [1] never registered" in reason
        for layer, tensor in cluster.d_caches[1].items():
            assert torch.equal(kv_bytes(tensor), before[layer]), f"rank 1's {layer} was written"
        assert cluster.senders[P0].stats["writes"] == 1


def test_each_decode_rank_gets_its_own_block_ids() -> None:
    """Per-rank registrations: two D ranks that (unusually) registered different blocks each
    receive their own."""
    with Cluster(decode_tp=2) as cluster:
        cluster.add("d-1", [[3, 4]], "x-1", ranks=[0])
        cluster.add("d-1", [[9, 10]], "x-1", ranks=[1])
        cluster.finish("p-1", [[5, 6]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None, 1: None}
        for tp, d_ids in ((0, [3, 4]), (1, [9, 10])):
            sub = Cluster.__new__(Cluster)
            sub.__dict__.update(cluster.__dict__)
            sub.d_caches = {tp: cluster.d_caches[tp]}
            assert_pushed(sub, [5, 6], d_ids)


def test_a_stale_registration_is_not_written_until_decode_renews_it() -> None:
    """Finding 3: P posts only within the freshness grant D echoed; a PUSH_REG that reached P
    late (here: delayed past the window) makes P ask D for a fresh grant first. D renews it by
    sending the PUSH_REG again (a heartbeat renews no grant), which is not delayed."""
    with Cluster(
        heartbeat_interval_s=0.5,
        fresh_s=0.1,
        **faulty(delay_notifs=1.0, delay_prefixes=["PUSH_REG:"], delay_s=0.3),
    ) as cluster:
        sender = cluster.senders[P0]
        cluster.finish("p-1", [[5, 6]], "x-1")
        cluster.add("d-1", [[3, 4]], "x-1")
        wait_until(lambda: sender.transport.injected["delay"] >= 1, what="the PUSH_REG delayed")
        sender.transport.rates["delay_notifs"] = 0.0  # the renewal is not
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [5, 6], [3, 4])
        assert sender.stats["stale_registrations"] >= 1  # it waited for D's renewal


def test_a_write_past_its_deadline_is_aborted_decode_told_and_connection_dropped() -> None:
    """Finding 3: every WRITE in flight has a deadline; on expiry P releases the handle, tells D
    and drops D's agents, so the next push opens a fresh connection."""
    with Cluster(
        write_deadline_s=0.2, request_timeout_s=60, **faulty(slow_writes=1.0, write_delay_s=5.0)
    ) as cluster:
        sender = cluster.senders[P0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        reason = cluster.wait_prefill("p-1", timeout_s=5)[P0]
        assert reason is not None and "did not complete within 0.2s" in reason
        d_reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert d_reason is not None and "did not complete within 0.2s" in d_reason
        assert sender.stats["write_deadline_expiries"] == 1
        assert sender.transport.outstanding_handles == 0
        wait_until(lambda: "D" not in sender.peers.engines, what="D's agents dropped")
        sender.transport.rates["slow_writes"] = 0.0
        cluster.add("d-2", [[7]], "x-2")  # a fresh connection works
        cluster.finish("p-2", [[8]], "x-2")
        assert cluster.wait_decode("d-2") == {0: None}


def _prefill_core():
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import ReadSpec

    def plan(blocks, reg):
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    settings = PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1)
    return PrefillCore(settings, plan=plan)


def _registration(**overrides):
    from kvpush.core.types import PushRegistration

    fields = {
        "request_id": "d-1",
        "match_key": "x-1",
        "decode_engine_id": "D",
        "decode_host": "127.0.0.1",
        "decode_port": 5601,
        "decode_tp_size": 1,
        "block_ids": [[3]],
        "remote_engine_id": "P",
        "decode_incarnation": "d1",
        "grant": 100.0,
        "fresh_s": 10.0,
    }
    return PushRegistration(**{**fields, **overrides})


def _note(message: bytes):
    from kvpush.core.notifications import decode_notification

    return decode_notification(message)


def test_cancel_in_the_same_batch_as_the_registration_is_seen_before_the_post() -> None:
    """P drains notifications before it runs queued posts and checks for a cancel immediately
    before every post (``confirm_post``): a CANCEL in the same batch as the registration that
    triggers the push wins, and nothing is written."""
    from kvpush.core import notifications as wire
    from kvpush.core.actions import Post

    core = _prefill_core()
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    core.notification("D-agent", _note(wire.encode_hello(_registration(), 0)), 100.0)
    core.connected("D", 0, "D-agent", "d1", 1, "", 100.0)
    reg = _registration()
    batch = core.notification("D-agent", _note(wire.encode_push_reg(reg)), 100.1)
    batch += core.notification("D-agent", _note(wire.encode_cancel("x-1", reg, 0)), 100.1)
    posts = [a for a in batch if isinstance(a, Post)]
    assert len(posts) == 1  # the registration alone would push ...
    assert not core.confirm_post(posts[0].key, posts[0].dst, 100.1)  # ... but the cancel came first


def test_a_registration_past_its_grant_is_refused_right_before_the_post() -> None:
    from kvpush.core import notifications as wire
    from kvpush.core.actions import Post

    core = _prefill_core()
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    core.notification("D-agent", _note(wire.encode_hello(_registration(), 0)), 100.0)
    core.connected("D", 0, "D-agent", "d1", 1, "", 100.0)
    actions = core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 100.0)
    post = next(a for a in actions if isinstance(a, Post))
    assert not core.confirm_post(post.key, post.dst, 110.0)  # grant 100 + fresh 10: stale now
    assert core.stats["stale_registrations"] == 1
    assert core.confirm_post(post.key, post.dst, 109.9) is False  # no longer a pending post


def test_cancel_of_a_registration_p_never_received_is_acknowledged_and_refuses_it_later() -> None:
    """D cancels a request whose PUSH_REG was lost: P has nothing for the key, so it acknowledges
    at once (no quarantine, P's connection kept) and refuses the registration if it shows up."""
    with Cluster(request_timeout_s=60, **faulty(drop_notifs=1.0, drop_prefixes=["PUSH_REG:"])) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 1, what="D's PUSH_REG")
        receiver.cancel("d-1")
        cluster.wait_released("d-1")
        assert receiver.stats["quarantine_expiries"] == 0 and "P" in receiver.peers.engines
        state = sender.call_on_writer(sender.core.state_sizes)
        # the refusal, and the cancel of a registration P never held, until they expire
        assert state["tombstones"] == 2


def _wants(actions) -> set[str]:
    from kvpush.core.actions import Send

    keys: set[str] = set()
    for action in actions:
        if isinstance(action, Send):
            keys.update(_note(action.message).want or ())
    return keys


def test_stale_registrations_arriving_together_each_get_a_fresh_grant_asked() -> None:
    """Two registrations with a stale grant (D's last stamp from P is older than the freshness
    window, e.g. after 10 s without traffic) arrive within the want rate limit. The second's
    want used to be dropped, so it waited for D's next heartbeat (5 s by default: measured as a
    5.0 s request on the H200 serve bench); it is now sent when the rate limit allows."""
    from kvpush.core import notifications as wire
    from kvpush.core.actions import Post

    core = _prefill_core()
    core.notification("D-agent", _note(wire.encode_hello(_registration(), 0)), 200.0)
    core.connected("D", 0, "D-agent", "d1", 1, "", 200.0)
    for n in (1, 2):
        core.finished(f"x-{n}", f"p-{n}", ((5 + n,),), "", 200.0)
    first = core.notification("D-agent", _note(wire.encode_push_reg(_registration())), 200.0)
    reg2 = _registration(request_id="d-2", match_key="x-2", block_ids=[[9]])
    second = core.notification("D-agent", _note(wire.encode_push_reg(reg2)), 200.001)
    assert _wants(first) == {"x-1"} and not any(isinstance(a, Post) for a in first + second)
    later = core.handle_timer(200.001 + core.s.want_interval_s)
    assert "x-2" in _wants(second) | _wants(later), "x-2 waits for D's next heartbeat"
    assert core.next_deadline() is not None


def test_an_idle_decode_keeps_its_grant_fresh_so_the_next_request_is_not_stale() -> None:
    """After D was idle longer than the freshness window, its next registration used to carry a
    stale grant: P had to ask for a fresh one first (a round trip between idle writers, a few
    ms). D now renews its grant while idle (every heartbeat, once it is half the window old),
    so the registration is fresh on arrival."""
    import time

    with Cluster(heartbeat_interval_s=0.2, fresh_s=0.4) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        time.sleep(1.2)  # three freshness windows without a request
        cluster.add("d-2", [[4]], "x-2")
        cluster.finish("p-2", [[6]], "x-2")
        assert cluster.wait_decode("d-2") == {0: None}
        assert sender.stats["stale_registrations"] == 0
        assert receiver.stats["keepalives_sent"] >= 2


def test_keepalive_off_leaves_an_idle_decodes_grant_to_go_stale() -> None:
    """``keepalive_s=0``: no keyless heartbeats, so the registration after the pause is stale
    and P asks for a fresh grant first (still pushed); a negative value is refused."""
    import time

    import pytest

    from kvpush.core.errors import ConfigError
    from kvpush.core.types import ParallelConfig
    from kvpush.core.worker import WorkerConfig

    with Cluster(heartbeat_interval_s=0.2, fresh_s=0.4, keepalive_s=0) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        time.sleep(1.2)
        cluster.add("d-2", [[4]], "x-2")
        cluster.finish("p-2", [[6]], "x-2")
        assert cluster.wait_decode("d-2") == {0: None}
        assert sender.stats["stale_registrations"] >= 1 and receiver.stats["keepalives_sent"] == 0
    with pytest.raises(ConfigError, match="keepalive_s must be >= 0"):
        WorkerConfig(
            engine_id="D", parallel=ParallelConfig(tp_size=1, num_layers=1), model=None, keepalive_s=-1
        )
