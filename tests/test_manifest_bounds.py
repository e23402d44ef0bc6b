"""Values from the wire that would make a receiver act unsafely are refused, never acted on.

Each test drives one out-of-range or inconsistent value through the real path it would take:
the decoder, then D's core and the packed scatter exactly as :class:`PushReceiver` runs them
(:class:`PackedD`: real KV regions, a real staging pool and packer), or a real worker pair on
the loopback transport (P plans and posts for real). Every refusal names the value, and the KV
blocks (and the staging bytes) are checked unchanged: nothing was scattered or written.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from cluster import Cluster, attempt_of, kv_bytes, settle, wait_until

from kvpush.core import notifications as wire
from kvpush.core import packing
from kvpush.core.actions import FreeStaging, Report, Scatter, Send
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.errors import WireError
from kvpush.core.packing import Packer, StagingPool, check_chunks, scatter_plan, staging_layout
from kvpush.core.types import (
    ModelSpec,
    Notification,
    NotificationKind,
    PackManifest,
    ParallelConfig,
    PushRegistration,
    RankKey,
    RequestMetadata,
    TransferParams,
)
from kvpush.core.worker import lease_clock
from kvpush.layouts.uniform import allocate_kv_caches, describe_uniform

P0 = RankKey(0, 0)
P_AGENT = "P-agent-0"
MODEL = ModelSpec(name="bounds", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BLOCKS = ((3, 9, 5),)
STALE = 0x5A
"""What D's staging reservation holds before any producer wrote: scattering it is wrong KV."""


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _done(manifest: PackManifest | None, producer: RankKey = P0, tp_size: int = 1, rid: str = "r1") -> bytes:
    return wire.encode_done(rid, producer, tp_size, manifest)


class PackedD:
    """D's core with real CPU KV regions, staging pool and packer. ``Scatter`` runs
    :func:`kvpush.core.packing.unpack` and reports back as ``PushReceiver._scatter`` does."""

    def __init__(self) -> None:
        parallel = ParallelConfig(tp_size=1, num_layers=MODEL.num_layers)
        self.caches = allocate_kv_caches(MODEL, parallel, 16)
        self.regions = describe_uniform(self.caches, parallel, MODEL)
        self.pool = StagingPool(1 << 16)
        self.packer = Packer(self.regions)
        settings = DecodeSettings(engine_id="D", incarnation="d1", tp_rank=0, tp_size=1, host="d", port=1)
        self.core = DecodeCore(settings, reserve_staging=self._reserve)
        self.reports: list[Report] = []
        self.scattered = 0
        self.freed: list[int] = []
        self.offsets: dict[str, int] = {}
        self.ready = False

    def _reserve(self, request: RequestMetadata) -> int:
        _, total = staging_layout(self.regions, request.block_ids)
        offset = self.pool.alloc(total)
        assert offset is not None
        self.offsets[request.request_id] = offset
        self.pool.tensor[offset : offset + total] = STALE
        return offset

    def run(self, actions: list[Any]) -> list[Any]:
        out = list(actions)
        for action in actions:
            if isinstance(action, Report):
                self.reports.append(action)
            elif isinstance(action, FreeStaging):
                self.freed.append(action.offset)
                self.pool.free(action.offset)
            elif isinstance(action, Scatter):
                error = ""
                try:
                    self.scattered += packing.unpack(
                        self.packer, self.pool, self.regions, action.block_ids, action.manifest
                    )
                except Exception as err:  # as PushReceiver._scatter
                    error = f"{type(err).__name__}: {err}"
                m = action.manifest
                done = self.core.scattered(action.request_id, action.producer, m.chunk, m.chunks, error, 1.0)
                out += self.run(done)
        return out

    def register(self, rid: str = "r1", key: str = "k1") -> None:
        """Add a request and bring it to REGISTERED (P's engine handshaken and HELLO answered)."""
        params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": key}
        meta = RequestMetadata(request_id=rid, block_ids=BLOCKS, params=TransferParams.from_dict(params))
        sent = self.run(self.core.add(meta, 0.0))
        if not self.ready:
            info = ProducerInfo(
                prefill_pp=1,
                prefill_tp=1,
                agents={P0: P_AGENT},
                incarnations={P_AGENT: "p1"},
                write_deadline_s=10.0,
            )
            self.run(self.core.connected("P", info, "", 0.0))
            answer = wire.encode_heartbeat_answer(P0, 0.0, "p1")
            sent = self.run(self.core.notification(P_AGENT, _note(answer), 0.0))
            self.ready = True
        regs = [_note(a.message) for a in sent if isinstance(a, Send)]
        assert [n.kind for n in regs] == [NotificationKind.PUSH_REG] and rid in self.offsets

    def deliver(self, message: bytes, agent: str = P_AGENT) -> list[Any]:
        return self.run(self.core.notification(agent, _note(message), 0.5))

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: kv_bytes(t).clone() for name, t in self.caches.items()}

    def unchanged(self, before: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(kv_bytes(self.caches[n]), t) for n, t in before.items())

    def manifest(self, rid: str = "r1", **fields: Any) -> PackManifest:
        values: dict[str, Any] = {"staging_offset": self.offsets[rid], "regions": range(len(self.regions))}
        return PackManifest(**{**values, **fields})


@pytest.fixture
def d() -> PackedD:
    node = PackedD()
    node.register()
    for tensor in node.caches.values():
        kv_bytes(tensor).zero_()
    return node


def _outcomes(node: PackedD) -> list[tuple[str, str]]:
    return [(r.outcome, r.reason or "") for r in node.reports]


# ------------------------------------------------------------------ packed manifests, real scatter


def test_a_valid_manifest_scatters_every_region(d: PackedD) -> None:
    """The harness itself: a correct packed DONE scatters the reservation and counts P."""
    d.deliver(_done(d.manifest()))
    assert _outcomes(d) == [("done", "")]
    _, total = staging_layout(d.regions, BLOCKS)
    assert d.scattered == total
    assert d.freed == [d.offsets["r1"]]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"regions": [0, 99]}, "names region 99; this rank has 4"),
        ({"part": (0, 3)}, "part \\(0, 3\\).*cannot be cut|part \\(0, 3\\)"),
    ],
    ids=["region-out-of-range", "part-not-on-a-row"],
)
def test_a_manifest_d_cannot_scatter_fails_the_request_before_any_byte_moves(
    d: PackedD, fields: dict[str, Any], match: str
) -> None:
    before = d.snapshot()
    d.deliver(_done(d.manifest(**fields)))
    [(outcome, reason)] = _outcomes(d)
    assert outcome == "failed" and "WireError" in reason
    assert re.search(match, reason), reason
    assert d.scattered == 0 and d.unchanged(before)


def test_a_manifest_outside_the_reservation_is_refused(d: PackedD) -> None:
    """P packs at an offset that is not D's reservation for this request (another request's,
    or no reservation at all): D never scatters from it."""
    before = d.snapshot()
    d.register("r2", "k2")
    d.deliver(_done(d.manifest(staging_offset=d.offsets["r2"])))  # r2's range, in r1's DONE
    d.deliver(_done(d.manifest(rid="r2", staging_offset=d.offsets["r2"] + 256), rid="r2"))
    reasons = {r.request_id: r.reason for r in d.reports}
    assert "staging range D did not reserve" in reasons["r1"]
    assert "staging range D did not reserve" in reasons["r2"]
    assert d.scattered == 0 and d.unchanged(before)


@pytest.mark.parametrize(
    ("pk", "match"),
    [
        ([0, [0, 0], 0, 1, 0, 1], "none twice"),
        ([0, [], 0, 1, 0, 1], "at least one region"),
        ([0, [0], 1, 1, 0, 1], "bad offset, part or chunk"),
        ([0, [0], 0, 1, 1, 1], "bad offset, part or chunk"),
        ([-256, [0], 0, 1, 0, 1], "bad offset, part or chunk"),
        ([0, [-1], 0, 1, 0, 1], "non-negative ints"),
        ([0, [True], 0, 1, 0, 1], "non-negative ints"),
        ([0, [0], 0, 0, 0, 1], "bad offset, part or chunk"),
        ([0, [0], 0, 1, 0, 2**21], "too many chunks"),
    ],
    ids=[
        "dup-region",
        "no-region",
        "index>=count",
        "chunk>=chunks",
        "neg-offset",
        "neg-region",
        "bool",
        "count0",
        "chunks",
    ],
)
def test_the_decoder_refuses_a_malformed_manifest_naming_it(pk: list[Any], match: str) -> None:
    body = {"request_id": "r1", "pp": 0, "tp": 0, "ptp": 1, "v": list(wire.NOTIF_VERSION), "pk": pk}
    with pytest.raises(WireError, match=f"'pk'.*{match}"):
        wire.decode_notification(wire.DONE_PREFIX + wire.pack(body))


def test_a_duplicate_region_from_a_decoder_plugin_is_still_refused_by_the_scatter(d: PackedD) -> None:
    """Another decoder plugin may hand D a manifest kvpush's decoder would refuse: the scatter
    plan checks it again."""
    before = d.snapshot()
    manifest = d.manifest(regions=[1, 1])
    note = Notification(
        kind=NotificationKind.DONE, request_id="r1", producer=P0, producer_tp_size=1, packing=manifest
    )
    d.run(d.core.notification(P_AGENT, note, 0.5))
    [(outcome, reason)] = _outcomes(d)
    assert outcome == "failed" and re.search("names (D )?region 1 twice", reason), reason
    assert d.unchanged(before)


def test_the_scatter_plan_keeps_every_byte_inside_the_reservation(d: PackedD) -> None:
    regions, offset = d.regions, d.offsets["r1"]
    _, total = staging_layout(regions, BLOCKS)
    plan = scatter_plan(regions, BLOCKS, d.manifest(part=(1, 2)), offset, total)
    share = regions[0].block_len // 2 * len(BLOCKS[0])
    assert plan == [offset + j * 2 * share + share for j in range(len(regions))]
    with pytest.raises(WireError, match="exceed D's reservation"):
        scatter_plan(regions, BLOCKS, d.manifest(), offset, total - 1)
    with pytest.raises(WireError, match="not D's reservation"):
        scatter_plan(regions, BLOCKS, d.manifest(staging_offset=offset + 256), offset, total)
    with pytest.raises(WireError, match="not a reservation in D's staging area"):
        packing.unpack(d.packer, d.pool, regions, BLOCKS, d.manifest(staging_offset=offset + 256))


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([(0, 2, [0, 1], (0, 1)), (1, 2, [1, 2], (0, 1))], "both name D region 1"),
        ([(0, 2, [0], (0, 1)), (1, 3, [1], (0, 1))], "states chunks 3"),
        ([(0, 2, [0], (0, 1)), (1, 2, [1], (1, 2))], "states part"),
        ([(0, 2, [0], (0, 1)), (0, 2, [1], (0, 1))], "announced twice with different regions"),
    ],
    ids=["overlap", "chunk-count", "part", "chunk-twice"],
)
def test_a_producers_chunks_must_agree(chunks: list[Any], match: str) -> None:
    manifests = [
        PackManifest(staging_offset=0, regions=r, part=p, chunk=c, chunks=n) for c, n, r, p in chunks
    ]
    with pytest.raises(WireError, match=match):
        check_chunks(manifests)
    check_chunks([manifests[0], manifests[0]])  # an identical repeat is a duplicate DONE


def test_overlapping_chunks_fail_the_request_instead_of_leaving_regions_unwritten(d: PackedD) -> None:
    """P says its push is two chunks, both naming region 1: regions 2 and 3 would never be
    written, yet D would count the producer once both chunks arrived (wrong KV, silently)."""
    d.deliver(_done(d.manifest(regions=[0, 1], chunk=0, chunks=2)))
    d.deliver(_done(d.manifest(regions=[1], chunk=1, chunks=2)))
    [(outcome, reason)] = _outcomes(d)
    assert outcome == "failed" and "both name D region 1" in reason


def test_a_direct_done_after_a_packed_chunk_does_not_count_the_producer(d: PackedD) -> None:
    """Chunk 0 of 2 arrived; a direct DONE from the same producer must not end the request:
    chunk 1's WRITE is still landing in the staging range, which the end would free."""
    d.deliver(_done(d.manifest(regions=[0, 1], chunk=0, chunks=2)))
    d.deliver(_done(None))
    assert d.offsets["r1"] not in d.freed, "the staging range was freed with chunk 1 in flight"
    assert [o for o, _ in _outcomes(d)] == ["failed"]


# ------------------------------------------------------------------ producers and D's counting


def test_a_done_stating_another_tp_size_or_an_unexpected_rank_counts_nothing(d: PackedD) -> None:
    """D: producers are counted only as P published them (TP size, ranks, agents)."""
    before = d.snapshot()
    rejected = d.core.stats["rejected_notifications"]
    d.deliver(_done(None, RankKey(0, 2), 1))  # a TP rank at or past the stated TP size
    d.deliver(_done(PackManifest(staging_offset=d.offsets["r1"], regions=[0]), RankKey(0, 2), 1))
    d.deliver(_done(None, RankKey(0, 1), 2))  # in range for the stated size, not P's
    d.deliver(_done(None, RankKey(1, 0), 1))  # a PP rank P does not have
    d.deliver(_done(None), agent="P-agent-other")  # P0 through another agent
    assert d.core.stats["rejected_notifications"] == rejected + 5
    assert d.reports == [] and d.unchanged(before)


# ------------------------------------------------------------------ registrations on a real P


def _forged_registration(cluster: Cluster, key: str, block_ids: Any) -> PushRegistration:
    return PushRegistration(
        request_id=f"forged-{key}",
        match_key=key,
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=cluster.d_server.port,
        decode_tp_size=1,
        block_ids=block_ids,
        remote_engine_id="P",
        decode_incarnation=cluster.receivers[0].incarnation,
        grant=lease_clock(),
        fresh_s=30.0,
    )


@pytest.mark.parametrize(
    ("block_ids", "match"),
    [
        ([[3, 64]], "block id 64 of group 0 is outside the region's 64 blocks"),
        ([[3, 2**31 - 1]], "outside the region's 64 blocks"),
        ([[3, 4, 7]], "D registered 3 blocks in KV group 0 without stating where they start"),
        ([[3], [4]], "P has 1 KV-cache groups, D registered 2"),
    ],
    ids=["id-at-capacity", "id-max", "more-blocks-than-p", "more-groups"],
)
def test_p_refuses_a_registration_its_blocks_cannot_match_and_writes_nothing(
    block_ids: Any, match: str
) -> None:
    """A PUSH_REG that passes the decoder (ids in [0, 2**31)) but names blocks D does not have,
    or more blocks or groups than P prefilled: P fails the request naming it, posts nothing."""
    with Cluster(num_blocks=64, staging_bytes=0, request_timeout_s=30) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-0", [[1]], "x-0")  # a real request: P and D know each other
        cluster.finish("p-0", [[1]], "x-0")
        assert cluster.wait_decode("d-0") == {0: None}
        before = {n: kv_bytes(t).clone() for n, t in cluster.d_caches[0].items()}
        posted = sender.transport.counters.writes_posted
        forged = wire.encode_push_reg(_forged_registration(cluster, "x-1", block_ids))
        settle(sender)
        sender.transport.inject(receiver.agent_name, forged)
        cluster.finish("p-1", [[5, 6]], "x-1")
        reason = cluster.wait_prefill("p-1", timeout_s=10)[P0]
        assert reason is not None and match in reason, reason
        assert sender.transport.counters.writes_posted == posted
        for name, tensor in cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(tensor), before[name]), f"D's {name} was written"


def test_a_registration_with_a_future_grant_is_refused_by_the_decoder_only_past_2_40() -> None:
    """Clock values are bounded and non-negative at decode; NaN and inf never pass."""
    base = {
        "request_id": "r",
        "match_key": "k",
        "decode_engine_id": "D",
        "decode_host": "h",
        "decode_port": 1,
        "decode_tp_size": 1,
        "block_ids": [[1]],
        "remote_engine_id": "P",
    }
    for name, bad in (("grant", -1.0), ("grant", math.inf), ("fresh_s", -0.5), ("grant", 2.0**41)):
        with pytest.raises(WireError, match="seconds in \\[0, 2\\*\\*40\\]"):
            wire.decode_notification(wire.encode_push_reg(PushRegistration(**{**base, name: bad})))
    for stamp in (math.nan, -1.0, math.inf, 1e300):
        with pytest.raises(WireError, match="'stamp'"):
            wire.decode_notification(wire.encode_heartbeat_answer(P0, stamp, "p1"))


def test_a_push_reg_with_no_block_or_a_repeated_block_is_refused() -> None:
    reg = {
        "request_id": "r",
        "match_key": "k",
        "decode_engine_id": "D",
        "decode_host": "h",
        "decode_port": 1,
        "decode_tp_size": 2,
        "remote_engine_id": "P",
    }
    for blocks, match in (
        ([[]], "names no block"),
        ([[], []], "names no block"),
        ([[4, 4]], "repeats a block id"),
    ):
        with pytest.raises(WireError, match=match):
            wire.decode_notification(wire.encode_push_reg(PushRegistration(**reg, block_ids=blocks)))
    with pytest.raises(WireError, match="'tp' must be an int in \\[0, 1\\]"):
        wire.decode_notification(
            wire.encode_push_reg(PushRegistration(**reg, block_ids=[[1]], decode_tp_rank=2))
        )


# ------------------------------------------------------------------ freshness grants on P


def test_p_does_not_take_a_grant_from_its_own_future_as_fresh() -> None:
    """A grant is one of P's own stamps, echoed: one later than P's clock now was never issued
    (a stamp from another clock, or forged). Taken as fresh it would let P write into D's
    blocks long after D's window, after D released them: P must ask for a fresh grant."""
    from kvpush.core.actions import Post
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import ReadSpec

    def plan(blocks: Any, reg: PushRegistration) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    p = PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)
    reg = {
        "request_id": "r1",
        "match_key": "k1",
        "decode_engine_id": "D",
        "decode_host": "d.example",
        "decode_port": 5700,
        "decode_tp_size": 1,
        "block_ids": [[3]],
        "remote_engine_id": "P",
        "decode_incarnation": "d1",
        "fresh_s": 10.0,
    }
    p.notification("D-agent", _note(wire.encode_hello(PushRegistration(**reg), 0)), 100.0)
    p.connected("D", 0, "D-agent", "d1", 1, "", 100.0)
    p.finished("k1", "p-1", ((5,),), "", 120.0)
    future = PushRegistration(**reg, grant=1e9)  # within the decoder's bound, far past P's clock
    actions = p.notification("D-agent", _note(wire.encode_push_reg(future)), 120.0)
    assert not any(isinstance(a, Post) for a in actions), "P wrote on a grant from its future"
    assert p.stats["stale_registrations"] == 1


# ------------------------------------------------------------------ packed DONEs on real workers


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
@pytest.mark.parametrize(
    ("change", "match"),
    [
        # Refused against the producer's share (the handshake's plan) before any range check.
        ({"regions": [0, 99]}, "D regions \\[99\\] .*outside the share"),
        ({"part": (0, 3)}, "block slice \\(0, 3\\)\\), outside the share"),
        ({"offset": 256}, "staging range D did not reserve"),
    ],
    ids=["region-out-of-range", "part-off-the-rows", "offset-not-reserved"],
)
def test_a_forged_packed_done_from_ps_own_agent_moves_no_byte_into_ds_blocks(
    transport: str, change: dict[str, Any], match: str
) -> None:
    """Real workers: D registered a request (its staging range reserved); P's own agent then
    sends a packed DONE D cannot honour. D fails the request naming why, scatters nothing, and
    gives the range back only once P settled (its CANCEL_ACK)."""
    with Cluster(transport=transport, num_blocks=64, request_timeout_s=30) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3, 9, 5]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] > 0, what="D's PUSH_REG")
        settle(receiver)
        [offset] = receiver.call_on_writer(lambda: list(receiver.staging._used))
        before = {n: kv_bytes(t).clone() for n, t in cluster.d_caches[0].items()}
        regions = len(receiver.metadata.regions)
        fields: dict[str, Any] = {
            "staging_offset": offset + change.get("offset", 0),
            "regions": range(regions),
        }
        fields.update({k: v for k, v in change.items() if k != "offset"})
        # P's own agent, naming the attempt (a forged DONE naming none is refused before this).
        forged = wire.encode_done("d-1", P0, 1, PackManifest(**fields), attempt=attempt_of(receiver, "d-1"))
        sender.call_on_writer(lambda: sender.transport.send_notif(receiver.agent_name, forged))
        reason = cluster.wait_decode("d-1", timeout_s=15)[0]
        assert reason is not None and re.search(match, reason), reason
        cluster.wait_released("d-1", timeout_s=15)
        for name, tensor in cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(tensor), before[name]), f"D's {name} was written"
        assert receiver.call_on_writer(lambda: receiver.staging.bytes_in_use) == 0


@pytest.mark.parametrize("second", ["overlapping-chunk", "direct-done"])
def test_real_workers_count_no_producer_whose_chunks_disagree(second: str) -> None:
    """Real workers: P's agent says chunk 0 of 2 holds regions 0 and 1, then either chunk 1
    naming region 1 again (regions 2 and 3 never written) or a direct DONE (chunk 1 may still
    be landing). D must fail the request, not report it done."""
    with Cluster(num_blocks=64, request_timeout_s=30) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3, 9, 5]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] > 0, what="D's PUSH_REG")
        settle(receiver)
        [offset] = receiver.call_on_writer(lambda: list(receiver.staging._used))
        first = PackManifest(staging_offset=offset, regions=[0, 1], chunk=0, chunks=2)
        then = PackManifest(staging_offset=offset, regions=[1], chunk=1, chunks=2)
        attempt = attempt_of(receiver, "d-1")
        for message in (
            wire.encode_done("d-1", P0, 1, first, attempt=attempt),
            wire.encode_done("d-1", P0, 1, then if second == "overlapping-chunk" else None, attempt=attempt),
        ):
            sender.call_on_writer(lambda m=message: sender.transport.send_notif(receiver.agent_name, m))
        reason = cluster.wait_decode("d-1", timeout_s=15)[0]
        assert reason is not None, "D reported the request done"


@pytest.mark.parametrize(
    "blocks",
    [[[3, 3]], [[]], [[], []], [[-1]], [[2**31]], [[True]], [[3.0]]],
    ids=["repeated", "empty", "all-groups-empty", "negative", "2**31", "bool", "float"],
)
def test_a_registration_the_decoder_refuses_never_reaches_ps_core(blocks: Any) -> None:
    """Real P: a PUSH_REG with repeated, negative, huge or non-int block ids, or no block at
    all, is dropped at decode (counted, logged with the field); P never plans or posts from it."""
    with Cluster(num_blocks=64, staging_bytes=0, request_timeout_s=30) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-0", [[1]], "x-0")
        cluster.finish("p-0", [[1]], "x-0")
        assert cluster.wait_decode("d-0") == {0: None}
        valid = wire.encode_push_reg(_forged_registration(cluster, "x-1", [[3]]))
        body = wire.unpack(valid[len(wire.PUSH_REG_PREFIX) :], "test")
        forged = wire.PUSH_REG_PREFIX + wire.pack({**body, "local_block_ids": blocks})
        dropped, posted = sender.dropped_notifications, sender.transport.counters.writes_posted
        sender.transport.inject(receiver.agent_name, forged)
        cluster.finish("p-1", [[5]], "x-1")
        wait_until(lambda: sender.dropped_notifications > dropped, what="P dropping the PUSH_REG")
        settle(sender)
        assert sender.call_on_writer(lambda: sender.core.state_sizes())["requests"] >= 1  # p-1 waits
        assert sender.transport.counters.writes_posted == posted


# ------------------------------------------------------------------ P's published safety facts


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("write_deadline_s", math.nan),
        ("write_deadline_s", math.inf),
        ("process", {"host": "h", "pidns": "n", "pid": -5, "start": 1}),
    ],
    ids=["deadline-nan", "deadline-inf", "pid-negative"],
)
def test_d_refuses_a_p_whose_published_safety_facts_are_out_of_range(name: str, value: Any) -> None:
    """D's quarantine rests on P's WRITE deadline (NaN ended it at once: ``max(now, nan)`` is
    ``now``; inf never) and its held blocks on P's process identity (a pid of -5 reads as an
    exited process): a P publishing such values is refused at the handshake, naming the field."""
    import attrs

    from kvpush.core import wire as handshake

    with Cluster(num_blocks=64, request_timeout_s=30) as cluster:
        sender = cluster.senders[P0]
        assert sender.metadata is not None
        tampered = attrs.evolve(sender.metadata, extensions={**sender.metadata.extensions, name: value})
        cluster.p_server.publish(P0, handshake.encode_metadata(tampered))
        cluster.add("d-1", [[3]], "x-1")
        reason = cluster.wait_decode("d-1", timeout_s=15)[0]
        assert reason is not None and f"extension {name!r}" in reason, reason


# ------------------------------------------------------------------ late notifications


def test_a_late_done_of_an_earlier_registration_does_not_complete_a_reused_request_id() -> None:
    """Real workers: d-1 (key x-1) is cancelled, P acknowledges, the blocks go back; the engine
    then reuses the id d-1 for another prompt (key x-2). A DONE of the x-1 push that arrives now
    (late, or duplicated) names d-1 and must not report it done: P never pushed x-2 yet, so D
    would read blocks nobody wrote. D registers a reused id under a fresh alias (``d-1#n``),
    so the late DONE matches nothing; P's push of x-2 then completes it."""
    with Cluster(num_blocks=64, request_timeout_s=30) as cluster:
        sender, receiver = cluster.senders[P0], cluster.receivers[0]
        cluster.add("d-1", [[3]], "x-1")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 1, what="D's PUSH_REG")
        receiver.cancel("d-1")
        cluster.wait_released("d-1")
        assert cluster.d_results[0].pop("d-1").startswith("cancelled")
        cluster.add("d-1", [[9]], "x-2")
        wait_until(lambda: receiver.stats["push_regs_sent"] == 2, what="D's second PUSH_REG")
        late = wire.encode_done("d-1", P0, 1)
        sender.call_on_writer(lambda: sender.transport.send_notif(receiver.agent_name, late))
        settle(receiver)
        cluster.poll()
        assert "d-1" not in cluster.d_results[0], "a DONE of the earlier registration counted"
        cluster.finish("p-2", [[5]], "x-2")
        assert cluster.wait_decode("d-1") == {0: None}
        for name, tensor in cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(tensor)[:, 9], kv_bytes(cluster.p_caches[P0][name])[:, 5]), name
