"""Review findings on D's and P's cores (goodbye ``delivered``, re-registration, shares).

Each test drives the cores directly (no transport, an injected clock), as
``tests/test_goodbye_overtakes_done.py`` and ``tests/test_reregister_after_layout_change.py``
do. A test here fails until the fix it names lands (see the review report).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import attrs

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Fence, Release, Report, Scatter, Send
from kvpush.core.decode_core import ENGINE_PROBE, DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.types import Notification, PackManifest, RankKey, RequestMetadata, TransferParams

P0, P1 = RankKey(0, 0), RankKey(1, 0)
A0, A1 = "P-prefill-pp0-tp0", "P-prefill-pp1-tp0"
TIMEOUT_S = 12.0
STAGING = 4096
WHOLE = (Fraction(0), Fraction(1))


def _note(message: bytes) -> Notification:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _settings(tp_size: int = 1) -> DecodeSettings:
    return DecodeSettings(
        engine_id="D",
        incarnation="d1",
        tp_rank=0,
        tp_size=tp_size,
        host="d.example",
        port=5700,
        heartbeat_interval_s=0.25,
        fresh_s=0.5,
        peer_silence_s=3.0,
        request_timeout_s=TIMEOUT_S,
    )


def _info(
    shares: dict[RankKey, list[int]] | None = None,
    *,
    stages: int = 1,
    prefill_tp: int = 1,
    incarnation: str = "a",
) -> ProducerInfo:
    """P's producers for D rank 0; ``shares``: the D regions each producer writes whole."""
    agents = {r: a for r, a in [(P0, A0), (P1, A1)][:stages]}
    return ProducerInfo(
        prefill_pp=stages,
        prefill_tp=prefill_tp,
        agents=agents,
        incarnations={a: f"{incarnation}-{a}" for a in agents.values()},
        write_deadline_s=1.0,
        processes={a: {"host": "h", "pid": 10 + r.pp_rank} for r, a in agents.items()},
        shares={r: frozenset((j, *WHOLE) for j in regions) for r, regions in (shares or {}).items()},
    )


def _registered(info: ProducerInfo, *rids: str, tp_size: int = 1) -> DecodeCore:
    """D with each of ``rids`` registered with ``info``'s producers (packed bytes reserved)."""
    d = DecodeCore(_settings(tp_size), reserve_staging=lambda _: STAGING)
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600}
    for n, rid in enumerate(rids):
        meta = RequestMetadata(
            request_id=rid,
            block_ids=((n + 1,),),
            params=TransferParams.from_dict({**params, "transfer_id": f"k-{rid}"}),
        )
        d.add(meta, 0.0)
    d.connected("P", info, "", 0.0)
    for rank, agent in info.agents.items():
        d.notification(agent, _note(wire.encode_heartbeat_answer(rank, 0.0, info.incarnations[agent])), 0.0)
    assert d.stats["push_regs_sent"] == len(rids) * len(info.agents)
    return d


def _bye(rank: RankKey, agent: str, incarnation: str, delivered: list[str]) -> Notification:
    return _note(wire.encode_goodbye(rank, incarnation, False, delivered=delivered))


def _reports(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.request_id, a.outcome) for a in actions if isinstance(a, Report)]


def _packed_done(d: DecodeCore, rid: str, producer: RankKey, agent: str, regions: tuple[int, ...], t: float):
    """``producer``'s one packed chunk of ``rid`` naming D ``regions``: its DONE, then (when D
    asks for it) its scatter."""
    manifest = PackManifest(staging_offset=STAGING, regions=regions, part=(0, 1), chunk=0, chunks=1)
    out = d.notification(agent, _note(wire.encode_done(rid, producer, 1, manifest)), t)
    if any(isinstance(a, Scatter) for a in out):
        out += d.scattered(rid, producer, 0, 1, "", t)
    return out


# ------------------------------------------------------------------ 1. shares after a goodbye


def test_control_a_packed_done_leaving_a_region_of_the_share_out_fails_the_request() -> None:
    """The handshake's share check (tests/test_packed_share.py), with P's engine loaded."""
    d = _registered(_info({P0: [0, 1]}), "r1")
    out = _packed_done(d, "r1", P0, A0, (0,), 1.0)
    assert _reports(out) == [("r1", "failed")], out


def test_a_packed_done_the_goodbye_overtook_is_still_checked_against_the_share() -> None:
    """The BYE names r1 (its WRITE completed), so D keeps it registered; the BYE also drops the
    engine's agents, and with them ``engine.info``, which ``_share`` reads the share from. The
    packed DONE that arrives next is then checked against nothing: a packer that left region 1
    out gets r1 reported done with region 1 never written."""
    d = _registered(_info({P0: [0, 1]}), "r1")
    assert _reports(d.notification(A0, _bye(P0, A0, f"a-{A0}", ["r1"]), 1.0)) == []
    out = _packed_done(d, "r1", P0, A0, (0,), 1.001)
    assert _reports(out) != [("r1", "done")], "done with D region 1 never written"
    assert _reports(out) == [("r1", "failed")], out


def test_a_packed_done_the_goodbye_overtook_may_not_scatter_over_another_stages_layers() -> None:
    """PP2: stage 0 writes region 0, stage 1 region 1. Stage 0's overtaken DONE names region 1
    too; once the BYE dropped the engine's info it is scattered over stage 1's layers."""
    d = _registered(_info({P0: [0], P1: [1]}, stages=2), "r1")
    assert _reports(d.notification(A0, _bye(P0, A0, f"a-{A0}", ["r1"]), 1.0)) == []
    manifest = PackManifest(staging_offset=STAGING, regions=(0, 1))
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 1, manifest)), 1.001)
    assert not [a for a in out if isinstance(a, Scatter)], "stage 0's bytes scattered over stage 1's region"
    assert _reports(out) == [("r1", "failed")], out


# ------------------------------------------------------------------ 2. re-registration, P's TP size


def _restarted_under_its_name(d: DecodeCore, new: ProducerInfo, t: float) -> list[Any]:
    """P rank 0's process exits (D's probe sees it), its fence is confirmed and D handshakes
    afresh with ``new`` (P back under the same agent name)."""
    out = d.producers_exited(ENGINE_PROBE + "P", [A0], t)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    assert any(isinstance(a, Connect) for a in out)
    out = d.fenced(fence.fence_id, t + 0.1)
    out += d.connected("P", new, "", t + 0.2)
    for rank, agent in new.agents.items():
        answer = wire.encode_heartbeat_answer(rank, t + 0.2, new.incarnations[agent])
        out += d.notification(agent, _note(answer), t + 0.2)
    return out


def test_a_request_registered_again_with_p_at_another_tp_size_counts_the_new_done() -> None:
    """D TP4, rank 0. P ran TP2 and comes back TP4 (an operator resized it): D rank 0's
    producer is P rank (0, 0) in both, writing the same pieces of rank 0 (the same D heads),
    so ``_layout_change`` sees no change and r1 is registered again with the new process. Its
    DONE states P TP 4, but ``_reregister`` kept the TP size r1 registered with (2), so the
    DONE is dropped as from another layout ("DONE states P TP 4, P published 2"): r1 waits
    for a completion that arrived, then fails at its watchdog (its blocks held till then).
    Either it counts (P's new TP size recorded) or r1 fails at once naming both layouts."""
    d = _registered(_info({P0: [0, 1]}, prefill_tp=2), "r1", tp_size=4)
    out = _restarted_under_its_name(d, _info({P0: [0, 1]}, prefill_tp=4, incarnation="b"), 1.0)
    pushed = [a for a in out if isinstance(a, Send) and _note(a.message).kind.value == "push_reg"]
    if not pushed:  # refused as another layout: fine, if it fails at once
        assert _reports(out) == [("r1", "failed")], out
        return
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 4)), 1.5)  # the new P rank wrote it
    assert d.stats["rejected_notifications"] == 0, "the new process's DONE was dropped"
    assert _reports(out) == [("r1", "done")], out


# ------------------------------------------------------------------ 3. a goodbye and owed cancels


def _add(d: DecodeCore, rid: str, key: str, block: int, t: float) -> list[Any]:
    params = {"remote_engine_id": "P", "remote_host": "p", "remote_port": 5600, "transfer_id": key}
    meta = RequestMetadata(request_id=rid, block_ids=((block,),), params=TransferParams.from_dict(params))
    return d.add(meta, t)


def test_a_request_waiting_for_a_closed_workers_cancel_ack_is_registered_not_failed() -> None:
    """r0 (key k) is cancelled; P rank 0 never answers, so r0's blocks go back on a fence and
    its CANCEL is owed. r1 retries key k: D first asks P rank 0 (the same incarnation) to
    acknowledge r0's CANCEL. That worker then closes: its BYE says it holds nothing any more,
    and D drops the owed CANCEL, but r1 keeps waiting for the acknowledgement (``_on_goodbye``
    discards it only from requests registered with that incarnation, and r1 registered with
    none yet), and nothing puts it in the engine's queue: no handshake is started (the BYE
    retries at once only for ``engine.waiting``), and r1 fails at the restart timeout ("no new
    worker of it answered", none was asked) or the acks timeout (``hello_timeout_s``, "retry
    under a fresh transfer_id"), although nothing holds k any more and a new worker serves."""
    info = _info({P0: [0]})
    d = DecodeCore(_settings())
    _add(d, "r0", "k", 1, 0.0)
    d.connected("P", info, "", 0.0)
    d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 0.0, f"a-{A0}")), 0.0)
    d.cancel("r0", 0.1)
    out: list[Any] = []
    t = 0.1
    while not any(isinstance(a, Release) for a in out):  # P silent: quarantine, fence, release
        t += 0.25
        assert t < 20.0, d.stats
        out = d.handle_timer(t)
        for fence in [a for a in out if isinstance(a, Fence)]:
            out += d.fenced(fence.fence_id, t)
    d.connected("P", info, "", t)  # the fence reset the engine: handshaken again (same worker)
    d.notification(A0, _note(wire.encode_heartbeat_answer(P0, t, f"a-{A0}")), t)
    out = _add(d, "r1", "k", 2, t)
    assert [_note(a.message).kind.value for a in out if isinstance(a, Send)] == ["cancel"], out
    # The worker closes: nothing of it is held any more; a new worker serves under its name.
    out = d.notification(A0, _bye(P0, A0, f"a-{A0}", []), t + 0.1)
    new = _info({P0: [0]}, incarnation="b")
    for _ in range(80):
        t += 0.25
        for action in out:
            if isinstance(action, Connect):
                out += d.connected("P", new, "", t)
                out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, t, f"b-{A0}")), t)
        if any(isinstance(a, Send) and _note(a.message).kind.value == "push_reg" for a in out):
            break
        assert _reports(out) == [], out
        out = d.handle_timer(t)
    else:
        raise AssertionError("r1 never registered with the worker that serves now")


# ------------------------------------------------------------------ 4. P's goodbye after a D rank restart


def _prefill_core_for_d_tp2():
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import ReadSpec

    def plan(blocks, reg):
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    return PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)


def _d_reg(rank: int, incarnation: str, **fields: Any):
    from kvpush.core.types import PushRegistration

    base = {
        "request_id": "d-1",
        "match_key": "x-1",
        "decode_engine_id": "D",
        "decode_host": "127.0.0.1",
        "decode_port": 5601,
        "decode_tp_size": 2,
        "decode_tp_rank": rank,
        "block_ids": [[3]],
        "remote_engine_id": "P",
        "decode_incarnation": incarnation,
        "grant": 100.0,
        "fresh_s": 10.0,
    }
    return PushRegistration(**{**base, **fields})


def test_p_goodbye_names_no_request_id_of_a_d_rank_start_that_is_gone() -> None:
    """D runs TP2. P wrote D request d-1 to rank 0 (``delivered``). Rank 0 restarts under the
    same agent name (a new incarnation; rank 1 lives on, so P keeps the D engine and with it
    ``delivered[0]``, keyed by the agent name alone). P then closes: its BYE to the new start
    names d-1, an id of the old start. The new start's ids begin afresh (d-1 again, or an
    alias counter from 1): a request of it that P never wrote is kept registered on the BYE's
    word, instead of failing at once, until its watchdog (120 s by default) fails it with
    'no completion'."""
    from kvpush.core.actions import Post

    p = _prefill_core_for_d_tp2()
    for rank in (0, 1):
        p.notification(f"D-r{rank}", _note(wire.encode_hello(_d_reg(rank, "d1"), rank)), 100.0)
        p.connected("D", rank, f"D-r{rank}", "d1", 2, "", 100.0)
    p.notification("D-r0", _note(wire.encode_push_reg(_d_reg(0, "d1"))), 100.0)
    (post,) = [a for a in p.finished("x-1", "p-1", ((5,),), "", 100.0) if isinstance(a, Post)]
    assert p.confirm_post(post.key, post.dst, 100.0)
    p.posted(post.key, post.dst, ["h1"], 64, 100.0)
    p.write_settled("x-1", 0, "h1", True, 100.1)  # delivered to rank 0's first start
    # Rank 0 restarts (incarnation d2 sorts after d1) and P loads the new start.
    p.notification("D-r0", _note(wire.encode_hello(_d_reg(0, "d2"), 0)), 101.0)
    p.start_served("D", 0, "d2", "", 101.0)  # D's side channel: "d2" runs (a restart)
    p.connected("D", 0, "D-r0", "d2", 2, "", 101.0)
    assert p._engines["D"].incarnations == {0: "d2", 1: "d1"}
    p.shutdown("closing", 102.0)
    byes = {
        a.agent: note
        for a in p.goodbye(102.0)
        if isinstance(a, Send) and (note := _note(a.message)).kind.value == "goodbye"
    }
    assert set(byes) == {"D-r0", "D-r1"}, byes
    assert byes["D-r0"].delivered == (), "the new start is told d-1 (the old start's) was delivered"


# ------------------------------------------------------------------ 5. a goodbye after a re-registration


def test_a_goodbye_of_a_stage_that_already_wrote_keeps_a_request_registered_again_elsewhere() -> None:
    """PP2. Stage 0 wrote r1 (its DONE counted). Stage 1's process exits; D fences, handshakes
    afresh (both stages restarted: new incarnations) and registers r1 again with the new
    stage 1 only (stage 0 had reported, so r1 keeps stage 0's old incarnation). The new stage
    0 worker later closes (BYE). Since b3a7ace a request whose closed producer had already
    reported stays registered (its other stage ends it), but r1 is matched against the BYE by
    the incarnation it registered stage 0 with (the old one), so the BYE's ``_engine_down``
    fails it: the new stage 1, which is writing it, is told to cancel."""
    d = _registered(_info({P0: [0], P1: [1]}, stages=2), "r1")
    assert _reports(d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 0.5)) == []
    out = d.producers_exited(ENGINE_PROBE + "P", [A1], 1.0)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    out = d.fenced(fence.fence_id, 1.1)
    new = _info({P0: [0], P1: [1]}, stages=2, incarnation="b")
    out += d.connected("P", new, "", 1.2)
    for rank, agent in new.agents.items():
        out += d.notification(agent, _note(wire.encode_heartbeat_answer(rank, 1.2, f"b-{agent}")), 1.2)
    pushed = [a.agent for a in out if isinstance(a, Send) and _note(a.message).kind.value == "push_reg"]
    assert pushed == [A1], out
    out = d.notification(A0, _bye(P0, A0, f"b-{A0}", []), 2.0)  # the new stage 0 closes
    assert _reports(out) == [], "failed although stage 0 had written it and stage 1 is writing it"
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 2.1)
    assert _reports(out) == [("r1", "done")], out


# ------------------------------------------------------------------ 6. a kept request, the handshake


def test_a_request_kept_after_a_goodbye_gets_the_engine_handshaken_again() -> None:
    """PP2. Stage 0 wrote r1 and its worker closes (BYE; r1 kept: stage 1 still computes its
    layers). reliability.md: at a BYE D "drops its agents ... and handshakes afresh at once".
    It does so only for requests in ``engine.waiting``; r1 is registered, so no handshake is
    started, stage 1 gets no heartbeat (its lease on r1 runs out) and no fresh grant (its
    ``want`` is dropped: no agent loaded), and at ``peer_silence_s`` r1 fails as "no new worker
    of it answered", though none was asked. Here stage 0's new worker would have answered at
    once, and stage 1's DONE comes 3.5 s after the BYE (within r1's watchdog)."""
    d = _registered(_info({P0: [0], P1: [1]}, stages=2), "r1")
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 0.5)
    out += d.notification(A0, _bye(P0, A0, f"a-{A0}", ["r1"]), 1.0)
    new = _info({P0: [0], P1: [1]}, stages=2, incarnation="b")
    new = attrs.evolve(new, incarnations={A0: f"b-{A0}", A1: f"a-{A1}"})
    ranks = {a: r for r, a in new.agents.items()}
    t = 1.0
    while t < 4.5:
        for action in list(out):  # P answers: stage 0's new worker, stage 1's old one
            if isinstance(action, Connect):
                out += d.connected("P", new, "", t)
                for rank, agent in new.agents.items():
                    answer = wire.encode_heartbeat_answer(rank, t, new.incarnations[agent])
                    out += d.notification(agent, _note(answer), t)
            elif isinstance(action, Send) and _note(action.message).kind.value == "heartbeat":
                agent = action.agent
                answer = wire.encode_heartbeat_answer(ranks[agent], t, new.incarnations[agent])
                out += d.notification(agent, _note(answer), t)
        assert _reports(out) == [], out
        t += 0.25
        out = d.handle_timer(t)
    assert _reports(out) == [], out
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 4.5)
    assert _reports(out) == [("r1", "done")], out


# ------------------------------------------------------------------ 7. packed chunks across a re-registration


def test_a_stage_registered_again_starts_its_packed_chunks_afresh() -> None:
    """PP2, stage 0 packs its share in two chunks. Its old process's chunk 0 arrived and was
    scattered; then P restarted: D's probe sees stage 1's process exit, and the handshake
    shows stage 0 restarted too (exit not seen yet), so ``_reregister`` registers r1 again
    with both new processes. ``_agents_exited`` forgets the packed chunks of the producers it
    saw exit (a packed push starts again from its first chunk), but ``_reregister`` keeps
    those of a producer it finds restarted: the new stage 0's chunk 1 then completes it with
    the old process's chunk 0, and r1 is reported done (its staging range freed) while the
    new process's chunk 0 may still be landing in that range, where the next request's packed
    bytes go."""
    d = _registered(_info({P0: [0, 1], P1: [2]}, stages=2), "r1")

    def chunk(n: int, t: float) -> list[Any]:
        manifest = PackManifest(staging_offset=STAGING, regions=(n,), part=(0, 1), chunk=n, chunks=2)
        out = d.notification(A0, _note(wire.encode_done("r1", P0, 1, manifest)), t)
        if any(isinstance(a, Scatter) for a in out):
            out += d.scattered("r1", P0, n, 2, "", t)
        return out

    assert _reports(chunk(0, 0.5)) == []  # the old stage 0's first chunk, scattered
    out = d.producers_exited(ENGINE_PROBE + "P", [A1], 1.0)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    out = d.fenced(fence.fence_id, 1.1)
    new = _info({P0: [0, 1], P1: [2]}, stages=2, incarnation="b")
    out += d.connected("P", new, "", 1.2)
    for rank, agent in new.agents.items():
        out += d.notification(agent, _note(wire.encode_heartbeat_answer(rank, 1.2, f"b-{agent}")), 1.2)
    pushed = sorted(a.agent for a in out if isinstance(a, Send) and _note(a.message).kind.value == "push_reg")
    assert pushed == [A0, A1], out
    out = d.notification(A1, _note(wire.encode_done("r1", P1, 1)), 1.5)  # the new stage 1 wrote
    out += chunk(1, 1.6)  # the new stage 0's second chunk lands first
    assert _reports(out) == [], "done (staging freed) before the new stage 0's first chunk arrived"
    out = chunk(0, 1.7)
    assert _reports(out) == [("r1", "done")], out


# ------------------------------------------------------------------ 8. a kept request and the next handshake


def test_a_request_kept_at_a_goodbye_survives_the_next_handshake_finding_the_closed_worker() -> None:
    """The BYE names r1 (its DONE is on its way), so D keeps it. The next request r2 comes at
    once and D handshakes afresh; P's side channel still names the closed worker (its
    replacement is not published yet), so ``connected`` calls ``_engine_down``, which fails
    every registered request but those to be registered again: r1 fails after all, although
    its bytes landed and its DONE arrives a moment later (what b3a7ace set out to fix, under
    load: any request arriving between the BYE and the DONE does it)."""
    info = _info({P0: [0]})
    d = _registered(info, "r1")
    assert _reports(d.notification(A0, _bye(P0, A0, f"a-{A0}", ["r1"]), 1.0)) == []
    out = _add(d, "r2", "k-r2", 2, 1.001)
    assert any(isinstance(a, Connect) for a in out), out
    out = d.connected("P", info, "", 1.002)  # still the closed worker: "not published afresh yet"
    assert _reports(out) == [], "the kept request failed at the next handshake"
    out = d.notification(A0, _note(wire.encode_done("r1", P0, 1)), 1.003)  # the overtaken DONE
    assert _reports(out) == [("r1", "done")], out


def test_an_exited_stages_chunk_read_before_its_fence_is_confirmed_does_not_count_afterwards() -> None:
    """Stage 0 (one stage) packs its share in two chunks. D's probe sees its process exit;
    ``_agents_exited`` forgets its packed chunks and fences. The DONE of the old process's
    chunk 0 (its WRITE completed before the process died) is read before the fence is
    confirmed, and scattered: chunk 0 is recorded again. ``_reregister`` does not forget it,
    so the new process's chunk 1 completes r1: done, staging freed, while the new chunk 0
    may still be landing in that range."""
    d = _registered(_info({P0: [0, 1]}), "r1")

    def chunk(n: int, t: float) -> list[Any]:
        manifest = PackManifest(staging_offset=STAGING, regions=(n,), part=(0, 1), chunk=n, chunks=2)
        out = d.notification(A0, _note(wire.encode_done("r1", P0, 1, manifest)), t)
        if any(isinstance(a, Scatter) for a in out):
            out += d.scattered("r1", P0, n, 2, "", t)
        return out

    out = d.producers_exited(ENGINE_PROBE + "P", [A0], 1.0)
    (fence,) = [a for a in out if isinstance(a, Fence)]
    assert _reports(chunk(0, 1.05)) == []  # the old process's chunk 0, read before the fence ends
    out = d.fenced(fence.fence_id, 1.1)
    new = _info({P0: [0, 1]}, incarnation="b")
    out += d.connected("P", new, "", 1.2)
    out += d.notification(A0, _note(wire.encode_heartbeat_answer(P0, 1.2, f"b-{A0}")), 1.2)
    assert [a.agent for a in out if isinstance(a, Send) and _note(a.message).kind.value == "push_reg"] == [A0]
    out = chunk(1, 1.6)  # the new process's second chunk lands first
    assert _reports(out) == [], "done (staging freed) before the new process's first chunk arrived"
    assert _reports(chunk(0, 1.7)) == [("r1", "done")]
