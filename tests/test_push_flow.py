"""The push flow as black-box tests of kvpush's API (upstream unit-test scenarios and more).

Most tests run on the in-process loopback transport (pure logic, bytes really copied); the
multi-process runs over real NIXL are in test_push_e2e.py.
"""

from __future__ import annotations

import torch
from cluster import MLA, Cluster, attempt_of, kv_bytes, settle, wait_until

from kvpush.core import wire
from kvpush.core.types import PushRegistration, RankKey, TransferParams


def full_prefill_layer(cluster: Cluster, layer: str) -> torch.Tensor:
    """P's whole layer (all TP ranks' heads concatenated), as int16."""
    parts = [
        kv_bytes(caches[layer])
        for key, caches in sorted(cluster.p_caches.items(), key=lambda kv: kv[0].tp_rank)
        if layer in caches
    ]
    return parts[0] if cluster.model.attention == "mla" else torch.cat(parts, dim=2)


def assert_pushed(cluster: Cluster, p_blocks: list[int], d_blocks: list[int]) -> None:
    for tp, caches in cluster.d_caches.items():
        for layer, tensor in caches.items():
            source = full_prefill_layer(cluster, layer)
            got = kv_bytes(tensor)
            if cluster.model.attention == "mla":
                assert torch.equal(got[d_blocks], source[p_blocks]), (tp, layer)
                continue
            heads = got.shape[2]
            expected = source[:, p_blocks, tp * heads : (tp + 1) * heads]
            assert torch.equal(got[:, d_blocks], expected), (tp, layer)


# ---------------------------------------------------------------------------- completion


def test_completion_needs_one_notification_per_pp_stage() -> None:
    with Cluster(prefill_pp=2) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[1, 2]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="PUSH_REG to both stages")
        transport = receiver.transport
        attempt = attempt_of(receiver, "d-1")  # P echoes it
        transport.inject("P-prefill-pp0-tp0", wire.encode_done("d-1", RankKey(0, 0), 1, attempt=attempt))
        settle(receiver)
        assert receiver.get_finished().done == ()  # first stage counted, not done
        transport.inject("P-prefill-pp0-tp0", wire.encode_done("d-1", RankKey(0, 0), 1, attempt=attempt))
        settle(receiver)
        assert receiver.get_finished().done == ()  # a duplicate never counts twice
        assert receiver.stats["duplicate_notifications"] == 1
        transport.inject("P-prefill-pp1-tp0", wire.encode_done("d-1", RankKey(1, 0), 1, attempt=attempt))
        settle(receiver)
        assert receiver.get_finished().done == ("d-1",)


def test_absent_sizes_come_from_p_published_config_never_a_default() -> None:
    """Issue 10.1: a router that omits pp_size/tp_size must not make D expect one producer."""
    params = {"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600, "transfer_id": "t"}
    assert TransferParams.from_dict(params).pp_size is None
    with Cluster(prefill_pp=2, prefill_tp=2) as cluster:
        cluster.add("d-1", [[1, 2]], "x-1", pp_size=None, tp_size=None)
        stage0 = [s for k, s in cluster.senders.items() if k.pp_rank == 0]
        for sender in stage0:  # only stage 0 pushes: D must keep waiting for stage 1
            sender.request_finished("p-1", [[5, 6]], match_key="x-1")
        wait_until(lambda: all(s.stats["pushes"] == 1 for s in stage0), what="stage 0's pushes")
        settle(cluster.receivers[0])
        cluster.poll()
        assert "d-1" not in cluster.d_results[0], "done with half the layers written"
        for key, sender in cluster.senders.items():
            if key.pp_rank == 1:
                sender.request_finished("p-1", [[5, 6]], match_key="x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [5, 6], [1, 2])


def test_router_sizes_that_disagree_with_p_fail_at_once_naming_both() -> None:
    with Cluster(prefill_pp=2, decode_tp=1, request_timeout_s=60) as cluster:
        cluster.add("d-1", [[1]], "x-1", pp_size=1)
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "pp_size 1 (router) vs 2" in reason


def test_done_from_an_unexpected_producer_or_agent_never_counts() -> None:
    with Cluster(prefill_pp=2) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[1]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="PUSH_REG to both stages")
        inject = receiver.transport.inject
        a = attempt_of(receiver, "d-1")
        inject("P-prefill-pp0-tp0", wire.encode_done("d-1", RankKey(0, 0), 1, attempt=a))
        inject(
            "P-prefill-pp0-tp0", wire.encode_done("d-1", RankKey(1, 0), 1, attempt=a)
        )  # stage 1 from stage 0's agent
        inject("P-prefill-pp1-tp0", wire.encode_done("d-1", RankKey(0, 3), 1, attempt=a))  # no such producer
        inject("P-prefill-pp1-tp0", wire.encode_done("d-1", RankKey(1, 0), 4, attempt=a))  # wrong P TP size
        inject("someone-else", wire.encode_done("d-1", RankKey(1, 0), 1, attempt=a))
        inject(
            "P-prefill-pp1-tp0", wire.encode_done("d-1", RankKey(1, 0), 1, attempt=a + 1)
        )  # another attempt
        inject("P-prefill-pp1-tp0", wire.encode_done("d-1", RankKey(1, 0), 1))  # none: P states it echoes one
        settle(receiver)
        assert receiver.get_finished().done == ()
        assert receiver.stats["rejected_notifications"] == 6
        inject("P-prefill-pp1-tp0", wire.encode_done("d-1", RankKey(1, 0), 1, attempt=a))
        settle(receiver)
        assert receiver.get_finished().done == ("d-1",)


def test_producer_tp_larger_than_decode_needs_one_notification_per_tp_rank() -> None:
    with Cluster(prefill_tp=2, decode_tp=1) as cluster:
        cluster.add("d-1", [[4, 5]], "x-1")
        cluster.finish("p-1", [[7, 8]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [7, 8], [4, 5])
        assert all(reason is None for reason in cluster.wait_prefill("p-1").values())


# ---------------------------------------------------------------------------- matching


def test_registration_first_then_prefill_pushes_once() -> None:
    with Cluster() as cluster:
        cluster.add("d-1", [[10, 11]], "x-1")
        sender = cluster.senders[RankKey(0, 0)]
        wait_until(lambda: sender.core.state_sizes()["stashed"] == 1, what="PUSH_REG at P")
        settle(sender)
        assert sender.stats["pushes"] == 0  # stashed until the prefill finishes
        cluster.finish("p-1", [[3, 4]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert cluster.wait_prefill("p-1") == {RankKey(0, 0): None}
        assert sender.stats["pushes"] == 1
        assert_pushed(cluster, [3, 4], [10, 11])


def test_prefill_first_then_registration_pushes_once() -> None:
    with Cluster() as cluster:
        cluster.finish("p-1", [[3, 4, 5]], "x-1")
        settle(cluster.senders[RankKey(0, 0)])
        cluster.add("d-1", [[20, 21, 22]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [3, 4, 5], [20, 21, 22])


def test_duplicate_push_reg_pushes_once() -> None:
    with Cluster(decode_tp=2) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        cluster.add("d-1", [[1, 2]], "x-1")  # both D ranks register with the one P rank
        wait_until(
            lambda: len(getattr(sender.core._requests.get("x-1"), "regs", {})) == 2,
            what="both PUSH_REGs at P",
        )
        cluster.finish("p-1", [[5, 6]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None, 1: None}
        reg = wire.encode_push_reg(
            PushRegistration(
                request_id="d-1",
                match_key="x-1",
                decode_engine_id="D",
                decode_host="127.0.0.1",
                decode_port=cluster.d_server.port,
                decode_tp_size=2,
                block_ids=[[1, 2]],
                remote_engine_id="P",
                decode_incarnation=cluster.receivers[0].incarnation,
            )
        )
        sender.transport.inject("D-decode-pp0-tp0", reg)  # a late duplicate after the push
        settle(sender)
        assert sender.stats["pushes"] == 1
        assert sender.stats["writes"] == 2  # one WRITE per D rank, each on its own registration
        assert sender.stats["duplicate_registrations"] == 1
        assert_pushed(cluster, [5, 6], [1, 2])


def test_malformed_push_reg_is_dropped_and_writer_keeps_going() -> None:
    with Cluster() as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        for bad in (
            b"PUSH_REG:\xc1\xc1",  # not msgpack
            b"PUSH_REG:" + wire.pack([1, 2, 3]),  # not a map
            b"PUSH_REG:" + wire.pack({"request_id": 7, "match_key": "k"}),  # wrong type
            b"PUSH_REG:" + wire.pack({"match_key": "k"}),  # missing request_id
            b"something else entirely",
        ):
            sender.transport.inject("D-decode-pp0-tp0", bad)
        settle(sender)
        assert sender.dropped_notifications == 5
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[2]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}


# ---------------------------------------------------------------------------- fan-out and TP


def test_mla_writes_to_every_decode_rank_with_handles_published_together() -> None:
    with Cluster(MLA, decode_tp=2) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        cluster.add("d-1", [[8, 9]], "x-1")
        cluster.finish("p-1", [[1, 2]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None, 1: None}
        peers = sorted(post["peer"] for post in sender.transport.posts)
        assert peers == ["D-decode-pp0-tp0", "D-decode-pp0-tp1"]  # real WRITEs to both ranks
        assert not [m for _, m in sender.transport.sent if m.startswith(wire.DONE_PREFIX)]  # no bare DONE
        assert_pushed(cluster, [1, 2], [8, 9])


def test_decode_tp_larger_than_prefill_gets_head_slices() -> None:
    with Cluster(decode_tp=2) as cluster:
        cluster.add("d-1", [[30, 31, 32]], "x-1")
        cluster.finish("p-1", [[0, 1, 2]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None, 1: None}
        assert_pushed(cluster, [0, 1, 2], [30, 31, 32])


def test_pp2_stages_each_write_their_own_layers() -> None:
    with Cluster(prefill_pp=2, decode_tp=2) as cluster:
        cluster.add("d-1", [[40, 41]], "x-1")
        cluster.finish("p-1", [[9, 10]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None, 1: None}
        assert_pushed(cluster, [9, 10], [40, 41])
        for sender in cluster.senders.values():
            assert sender.stats["writes"] == 2  # one per D rank, its own layers only


def test_partial_prefix_hit_pairs_from_the_start_d_states() -> None:
    with Cluster() as cluster:
        cluster.add("d-1", [[500 % 64, 501 % 64]], "x-1", block_start=3)
        cluster.finish("p-1", [[10, 11, 12, 13, 14]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [13, 14], [500 % 64, 501 % 64])  # the tail, not the head


def test_a_block_p_holds_past_the_prompt_stays_unpaired_when_d_states_its_start() -> None:
    with Cluster() as cluster:
        cluster.add("d-1", [[1, 2]], "x-1", block_start=0, num_tokens=2 * cluster.model.block_size)
        cluster.finish("p-1", [[10, 11, 12]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [10, 11], [1, 2])  # P's lookahead block 12 moves nowhere


def test_fewer_blocks_without_a_stated_start_fail_naming_both_counts() -> None:
    """A prefix hit, a registration one block short or a block P holds past the prompt look
    alike without D's start: P refuses to guess; D fails with P's reason and is released."""
    with Cluster() as cluster:
        cluster.add("d-1", [[1, 2]], "x-1")
        cluster.finish("p-1", [[10, 11, 12]], "x-1")
        reason = cluster.wait_decode("d-1")[0]
        assert reason is not None and "without stating where they start" in reason, reason
        assert "D registered 2 blocks" in reason and "(3 blocks)" in reason
        assert "without stating" in cluster.wait_prefill("p-1")[RankKey(0, 0)]


def test_equal_block_counts_are_untouched() -> None:
    with Cluster() as cluster:
        cluster.add("d-1", [[1, 2, 3]], "x-1")
        cluster.finish("p-1", [[4, 5, 6]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert_pushed(cluster, [4, 5, 6], [1, 2, 3])


def test_decode_registering_more_blocks_than_prefill_fails_with_reason() -> None:
    with Cluster() as cluster:
        cluster.add("d-1", [[1, 2, 3]], "x-1")
        cluster.finish("p-1", [[4, 5]], "x-1")
        reason = cluster.wait_decode("d-1")[0]
        assert reason is not None and "D registered 3 blocks" in reason
        assert "D registered 3 blocks" in cluster.wait_prefill("p-1")[RankKey(0, 0)]


# ---------------------------------------------------------------------------- failures


def test_write_ending_in_error_fails_decode_at_once_with_reason() -> None:
    with Cluster(request_timeout_s=60) as cluster:
        cluster.senders[RankKey(0, 0)].transport.fail_writes = 1
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[2]], "x-1")
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "ended in error" in reason
        assert "ended in error" in cluster.wait_prefill("p-1")[RankKey(0, 0)]


def test_failed_post_fails_decode_at_once_with_reason() -> None:
    with Cluster(request_timeout_s=60) as cluster:
        cluster.senders[RankKey(0, 0)].transport.fail_posts = 1
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[2]], "x-1")
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "post refused" in reason


def test_request_never_pushed_fails_on_the_watchdog_naming_missing_producers() -> None:
    with Cluster(prefill_pp=2, request_timeout_s=0.3) as cluster:
        cluster.add("d-1", [[1]], "x-1")
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "0 of 2" in reason and "(pp=1, tp=0)" in reason


def test_prefill_lease_expires_when_decode_never_registers() -> None:
    with Cluster(lease_s=0.2) as cluster:
        cluster.finish("p-1", [[1]], "x-1")
        reason = cluster.wait_prefill("p-1", timeout_s=5)[RankKey(0, 0)]
        assert reason is not None and "lease" in reason


def test_completion_before_add_request_is_held_then_judged_by_its_attempt() -> None:
    """A DONE for an id D does not hold yet is held, and judged once the request registers: one
    sent before D registered cannot answer this registration (it names no attempt, or an
    earlier one: a previous request of the id, or its replay), so it never counts; P's DONE
    echoing the attempt does."""
    with Cluster() as cluster:
        receiver = cluster.receivers[0]
        receiver.transport.inject("P-prefill-pp0-tp0", wire.encode_done("d-1", RankKey(0, 0), 1))
        settle(receiver)
        assert receiver.stats["unknown_notifications"] == 1
        cluster.add("d-1", [[1]], "x-1")
        wait_until(lambda: receiver.stats["rejected_notifications"] == 1, what="the held DONE judged")
        assert receiver.get_finished().done == ()
        done = wire.encode_done("d-1", RankKey(0, 0), 1, attempt=attempt_of(receiver, "d-1"))
        receiver.transport.inject("P-prefill-pp0-tp0", done)
        assert cluster.wait_decode("d-1") == {0: None}


def test_notification_for_unknown_request_is_dropped_after_ttl() -> None:
    with Cluster(early_notification_ttl_s=0.1) as cluster:
        receiver = cluster.receivers[0]
        receiver.transport.inject("P-prefill-pp0-tp0", wire.encode_done("ghost", RankKey(0, 0), 1))
        wait_until(lambda: not receiver.core._early, timeout_s=5, what="the early buffer to expire")
        assert receiver.get_finished().done == ()


def test_handshake_failure_fails_the_request_with_reason() -> None:
    with Cluster(handshake_timeout_s=0.5) as cluster:
        cluster.add("d-1", [[1]], "x-1", remote_port=1)  # nothing listens there
        reason = cluster.wait_decode("d-1", timeout_s=10)[0]
        assert reason is not None and "handshake with P failed" in reason and "127.0.0.1:1" in reason
