"""Finding 11: a D rank refuses a request whose blocks another request still holds.

A request holds its blocks from ``add_request`` until it is done or (failed or cancelled)
released. Before this check, D accepted an overlapping request, so the earlier request's WRITE
(or a late one, after its failure) could land in the new request's block: wrong KV, no error.

The pure :class:`~kvpush.core.block_claims.BlockClaims` is tested alone (and by hypothesis against
a model); the refusal runs through real NIXL agents (an in-process :class:`cluster.Cluster` on
``transport="nixl"``) and across rank processes (:class:`engines.Engines`).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from cluster import Cluster, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_engines import Engines
from test_hma import hybrid_model
from test_push_flow import assert_pushed

from kvpush.core.block_claims import BlockClaims, GroupSpace, group_spaces
from kvpush.core.errors import ConfigError
from kvpush.core.types import KVRegion, RankKey

HELD = "still holds"


def region(base: int, stride: int, blocks: int, group: int, name: str = "L0") -> KVRegion:
    return KVRegion(
        base_addr=base,
        block_len=stride,
        block_stride=stride,
        num_blocks=blocks,
        layer_names=(name,),
        kv_group=group,
    )


# ---------------------------------------------------------------------------- the pure class


def test_disjoint_requests_are_claimed_and_an_overlap_is_refused_naming_blocks_and_holder() -> None:
    claims = BlockClaims()
    claims.claim("a", ((5, 6),))
    claims.claim("b", ((7, 8),))
    with pytest.raises(ConfigError) as info:
        claims.claim("c", ((1, 6, 8),))
    message = str(info.value)
    assert "'c'" in message and HELD in message, message
    assert "group 0 block ids [6] held by 'a'" in message, message
    assert "group 0 block ids [8] held by 'b'" in message and "done or released" in message, message
    assert "c" not in claims and claims.claimed_units == {0: frozenset({5, 6, 7, 8})}  # nothing claimed


def test_release_gives_the_blocks_back_and_unknown_ids_are_ignored() -> None:
    claims = BlockClaims()
    claims.claim("a", ((5, 6),))
    claims.release("a")
    claims.release("a")
    claims.release("never")
    claims.claim("b", ((6, 7),))
    assert len(claims) == 1 and claims.claimed_units == {0: frozenset({6, 7})}
    claims.clear()
    assert len(claims) == 0 and claims.claimed_units == {}


def test_a_refused_claim_keeps_nothing_of_its_other_groups_and_an_id_holds_one_claim() -> None:
    claims = BlockClaims((GroupSpace(0), GroupSpace(1)))
    claims.claim("a", ((), (4,)))
    with pytest.raises(ConfigError, match=r"group 1 block ids \[4\] held by 'a'"):
        claims.claim("b", ((1, 2), (4,)))  # group 0 was free: it must not stay claimed
    assert claims.claimed_units == {1: frozenset({4})}
    with pytest.raises(ConfigError, match="'a' already holds blocks"):
        claims.claim("a", ((9,), ()))
    claims.claim("b", ((1, 2), (5,)))


def test_groups_on_their_own_memory_may_use_the_same_ids() -> None:
    claims = BlockClaims(group_spaces([region(0, 64, 16, 0), region(4096, 64, 16, 1, "L1")]))
    claims.claim("a", ((5,), (6,)))
    claims.claim("b", ((6,), (5,)))  # the same ids, each in the other group
    with pytest.raises(ConfigError, match=r"group 1 block ids \[6\] held by 'a'"):
        claims.claim("c", ((), (6,)))


def test_groups_viewing_one_tensor_share_their_ids() -> None:
    """vLLM's hybrid allocator: every group views one tensor, so block 5 of group 1 is block 5
    of group 0."""
    spaces = group_spaces([region(0, 64, 16, 0), region(0, 64, 16, 1, "L1"), region(9999, 64, 16, 0, "L2")])
    assert spaces == (GroupSpace(0, 1), GroupSpace(0, 1))
    claims = BlockClaims(spaces)
    claims.claim("a", ((5,), (6,)))
    with pytest.raises(ConfigError, match=r"group 0 block ids \[6\] held by 'a'"):
        claims.claim("b", ((6,), ()))
    with pytest.raises(ConfigError, match="same memory in two KV groups"):
        claims.claim("c", ((9,), (9,)))


def test_groups_with_other_block_widths_on_one_tensor_are_compared_by_bytes() -> None:
    """A group of 64-byte blocks and one of 32-byte (kernel) blocks on one tensor: block 3 of the
    first is blocks 6 and 7 of the second."""
    spaces = group_spaces([region(0, 64, 16, 0), region(0, 32, 32, 1, "L1")])
    assert spaces == (GroupSpace(0, 2), GroupSpace(0, 1))
    claims = BlockClaims(spaces)
    claims.claim("a", ((3,), ()))
    with pytest.raises(ConfigError, match=r"group 1 block ids \[7\] held by 'a'"):
        claims.claim("b", ((), (7,)))
    claims.claim("c", ((), (5, 8)))
    with pytest.raises(ConfigError, match=r"group 0 block ids \[4\] held by 'c'"):
        claims.claim("d", ((4,), ()))


def test_vllm_layout_groups_on_one_tensor_share_ids_by_bytes() -> None:
    """The regions the vllm layout describes for a hybrid model (each tensor viewed by a full and
    a sliding-window layer; the sliding group's kernel blocks half as big)."""
    import torch

    from kvpush.core.types import ModelSpec, ParallelConfig
    from kvpush.layouts.vllm import VllmLayerCache, describe_vllm

    kinds = ("full", "sliding_window", "full", "sliding_window")
    model = ModelSpec(
        name="hybrid", num_layers=4, num_kv_heads=4, head_dim=8, block_size=16,
        layer_groups=(0, 1, 0, 1), layer_kinds=kinds,
    )  # fmt: skip
    tensors = [torch.zeros(64, 4, 16, 16), torch.zeros(64, 4, 16, 16)]
    caches = {
        f"model.layers.{i}.self_attn.attn": VllmLayerCache(
            tensor=tensors[i // 2] if i % 2 == 0 else tensors[i // 2].view(128, 4, 8, 16),
            group=i % 2,
            attention_kind=kinds[i],
            blocks_per_logical=1 + i % 2,
        )
        for i in range(4)
    }
    regions = describe_vllm(caches, ParallelConfig(tp_size=1, tp_rank=0, num_layers=4), model)
    assert group_spaces(regions) == (GroupSpace(0, 2), GroupSpace(0, 1))
    claims = BlockClaims.for_regions(regions)
    claims.claim("a", ((3,), ()))
    with pytest.raises(ConfigError, match=r"group 1 block ids \[7\] held by 'a'"):
        claims.claim("b", ((), (5, 7)))
    claims.claim("b", ((), (5, 8)))


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("claim"),
            st.sampled_from("abcd"),
            st.tuples(
                st.frozensets(st.integers(0, 12), max_size=4), st.frozensets(st.integers(0, 12), max_size=4)
            ),
        ),
        st.tuples(st.just("release"), st.sampled_from("abcd"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, shared=st.booleans())
def test_claims_match_a_model(ops: list[tuple[str, str, Any]], shared: bool) -> None:
    """A claim succeeds iff none of its (id space, block) pairs is held; it then holds exactly
    those until released. ``shared``: both groups view one tensor (one id space)."""
    claims = BlockClaims((GroupSpace(0), GroupSpace(0 if shared else 1)))
    held: dict[str, set[tuple[int, int]]] = {}
    for op, rid, blocks in ops:
        if op == "release":
            claims.release(rid)
            held.pop(rid, None)
            continue
        wanted = [(0 if group == 0 or shared else 1, b) for group, ids in enumerate(blocks) for b in ids]
        taken = set().union(*held.values())
        ok = rid not in held and len(set(wanted)) == len(wanted) and not taken & set(wanted)
        block_ids = tuple(tuple(sorted(ids)) for ids in blocks)
        if rid in held:
            continue  # the receiver refuses a second add of an id before it claims
        if ok:
            claims.claim(rid, block_ids)
            held[rid] = set(wanted)
        else:
            with pytest.raises(ConfigError):
                claims.claim(rid, block_ids)
        expected: dict[int, set[int]] = {}
        for space, block in set().union(*held.values()):
            expected.setdefault(space, set()).add(block)
        assert claims.claimed_units == {s: frozenset(b) for s, b in expected.items()}


# ---------------------------------------------------------------------------- real NIXL, in process


def _refused(cluster: Cluster, rid: str, blocks: Any, key: str, holder: str, tp: int = 0) -> str:
    receiver = cluster.receivers[tp]
    pending = receiver.pending_requests
    with pytest.raises(ConfigError) as info:
        cluster.add(rid, blocks, key, ranks=[tp])
    message = str(info.value)
    assert HELD in message and f"{holder!r}" in message and "released" in message, message
    assert receiver.pending_requests == pending  # the refused request was never taken
    return message


@pytest.mark.parametrize("staging_bytes", [0, 1 << 20], ids=["direct", "packed"])
def test_a_request_overlapping_a_pending_one_is_refused_and_accepted_once_that_is_done(
    staging_bytes: int,
) -> None:
    with Cluster(transport="nixl", staging_bytes=staging_bytes, request_timeout_s=30) as cluster:
        cluster.add("d-a", [[5, 6]], "k-a")
        message = _refused(cluster, "d-b", [[6, 7]], "k-b", "d-a")
        assert "group 0 block ids [6] held by 'd-a'" in message, message
        cluster.finish("p-a", [[20, 21]], "k-a")
        assert cluster.wait_decode("d-a") == {0: None}
        assert_pushed(cluster, [20, 21], [5, 6])  # A's KV, not overwritten
        cluster.add("d-b", [[6, 7]], "k-b")  # A is done: the engine owns block 6 again
        cluster.finish("p-b", [[30, 31]], "k-b")
        assert cluster.wait_decode("d-b") == {0: None}
        assert_pushed(cluster, [30, 31], [6, 7])


def test_a_request_reusing_a_failed_request_s_blocks_is_refused_until_they_are_released() -> None:
    """A fails (D's watchdog) while P's WRITE into its blocks is still in flight: the failure is
    reported at once, the blocks are released only after that WRITE settled; until then a request
    naming them is refused."""
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 3.0}
    with Cluster(transport="faulty", transport_options=options, request_timeout_s=1.5) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        cluster.add("d-a", [[5, 6]], "k-a")
        cluster.finish("p-a", [[20, 21]], "k-a")
        wait_until(lambda: sender.stats["writes"] == 1, what="A's WRITE to be posted")
        reason = cluster.wait_decode("d-a", timeout_s=5)[0]
        assert reason is not None and "no completion within 1.5s" in reason
        assert "d-a" not in cluster.released[0]  # the WRITE is still in flight
        _refused(cluster, "d-b", [[1, 6]], "k-b", "d-a")
        cluster.wait_released("d-a", timeout_s=10)
        cluster.add("d-b", [[1, 6]], "k-b")
        cluster.receivers[0].cancel("d-b")
        cluster.wait_released("d-b", timeout_s=10)


def test_a_cancelled_request_holds_its_blocks_until_released() -> None:
    options = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 0.6}
    with Cluster(transport="faulty", transport_options=options, request_timeout_s=30) as cluster:
        sender, receiver = cluster.senders[RankKey(0, 0)], cluster.receivers[0]
        cluster.add("d-a", [[5, 6]], "k-a")
        cluster.finish("p-a", [[20, 21]], "k-a")
        wait_until(lambda: sender.stats["writes"] == 1, what="A's WRITE to be posted")
        receiver.cancel("d-a")
        _refused(cluster, "d-b", [[5]], "k-b", "d-a")  # the WRITE is in flight: not released
        cluster.wait_released("d-a")
        cluster.add("d-b", [[5]], "k-b")
        cluster.finish("p-b", [[40]], "k-b")
        assert cluster.wait_decode("d-b") == {0: None}
        assert_pushed(cluster, [40], [5])


def test_each_d_rank_checks_its_own_blocks() -> None:
    with Cluster(transport="nixl", decode_tp=2, request_timeout_s=30) as cluster:
        cluster.add("d-a", [[5]], "k-a", ranks=[0])
        cluster.add("d-b", [[5]], "k-b", ranks=[1])  # another rank's memory: no overlap
        _refused(cluster, "d-c", [[5]], "k-c", "d-a", tp=0)
        _refused(cluster, "d-c", [[5]], "k-c", "d-b", tp=1)
        for rid in ("d-a", "d-b"):
            cluster.receivers[0 if rid == "d-a" else 1].cancel(rid)
        cluster.wait_released("d-a", ranks=[0])
        cluster.wait_released("d-b", ranks=[1])
        cluster.add("d-c", [[5]], "k-c")
        cluster.finish("p-c", [[9]], "k-c")
        assert cluster.wait_decode("d-c") == {0: None, 1: None}
        assert_pushed(cluster, [9], [5])


def test_kv_groups_of_their_own_overlap_only_within_a_group() -> None:
    with Cluster(hybrid_model(), transport="nixl", request_timeout_s=30) as cluster:
        cluster.add("d-a", [[5], [6]], "k-a")
        cluster.add("d-b", [[6], [5]], "k-b")  # the same ids, each in the other group
        message = _refused(cluster, "d-c", [[1], [6]], "k-c", "d-a")
        assert "group 1 block ids [6] held by 'd-a'" in message, message
        cluster.finish("p-a", [[10], [11]], "k-a")
        cluster.finish("p-b", [[12], [13]], "k-b")
        assert cluster.wait_decode("d-a") == {0: None}
        assert cluster.wait_decode("d-b") == {0: None}
        cluster.add("d-c", [[1], [6]], "k-c")
        cluster.finish("p-c", [[14], [15]], "k-c")
        assert cluster.wait_decode("d-c") == {0: None}


# ---------------------------------------------------------------------------- across processes


def test_an_overlapping_request_is_refused_in_a_decode_process() -> None:
    with Engines(decode_tp=2, lease_s=10.0, request_timeout_s=30.0) as engines:
        engines.plan("a", [1, 2], [5, 6])
        engines.add("a")
        engines.plan("b", [3, 4], [6, 7])
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=HELD) as info:
            engines.add("b")
        assert "group 0 block ids [6] held by 'a'" in str(info.value), str(info.value)
        engines.finish("a")
        engines.wait_decode(["a"])
        for kind, result in engines.decode_outcome("a").values():
            assert kind == "done" and result["ok"], result  # A's KV, nothing of B's
        engines.add("b")
        engines.finish("b")
        engines.wait_decode(["b"])
        for kind, result in engines.decode_outcome("b").values():
            assert kind == "done" and result["ok"], result
        assert time.monotonic() - started < 30
