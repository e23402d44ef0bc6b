"""Probe of 2026-12-03: a CANCEL from one D rank of a key not bound yet, where every D rank is
a process of its own (its own incarnation): TP > 1 decode, MLA fan-out to every D rank.

Before the router's finish binds a key, P holds the registrations of every D engine that
registered it (``_Request.others``; the first registrant's in ``regs``, tentatively). A CANCEL
from one D rank drops that rank's registration, and the engine's other ranks' registrations
*of the same D request* were to be told FAIL (nothing posted), as a cancel of a bound key tells
every rank. P picked them by comparing each one's D incarnation with the cancelling rank's: so
it fired only where the ranks share one incarnation (the core tests), never with real rank
processes. Their registrations stayed held: a finish naming the engine (or, for the key's first
registrant, a finish naming none) wrote the ranks that had not cancelled yet and waited for
the cancelled rank's registration until the lease (``lease_s``) or those ranks' own CANCELs;
and the first registrant kept an unbound key another engine's registration was waiting for
(that engine was told FAIL at the finish, its push lost).

Now each registration is judged against the start P loaded for *its own* rank (the
incarnation its handshake named): the cancel acts on the others only when it came from the
start P loaded for the cancelling rank, and tells each other rank's registration of the same D
request when that registration came from the start P loaded for that rank (or, its rank not
loaded yet, once P loads that very start: the FAIL is owed to it alone).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_protocol_safety import _note, _registration

from kvpush.core import notifications as wire
from kvpush.core.actions import Post, Report, Send
from kvpush.core.types import NotificationKind, RankKey, ReadSpec

P0 = RankKey(0, 0)
X = {"decode_engine_id": "X", "decode_port": 5700, "request_id": "x-req", "decode_incarnation": "x1"}
"""Another D engine (TP 1) that registers the same key."""


def _core() -> Any:
    """A P core whose plan writes every D rank of the registration's TP size (MLA fan-out)."""
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings

    def plan(blocks: Any, reg: Any) -> list[ReadSpec]:
        return [
            ReadSpec(dst_tp_rank=rank, local_block_ids=blocks, remote_block_ids=reg.block_ids)
            for rank in range(reg.decode_tp_size)
        ]

    return PrefillCore(PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1), plan=plan)


def _d(rank: int, **overrides: Any) -> dict[str, Any]:
    """D engine D's rank ``rank``: TP 2, its own process (incarnation ``d1-<rank>``)."""
    return {"decode_tp_rank": rank, "decode_tp_size": 2, "decode_incarnation": f"d1-{rank}", **overrides}


def _send(core: Any, agent: str, message: bytes, now: float) -> list[Any]:
    return core.notification(agent, _note(message), now)


def _register(core: Any, agent: str, now: float, **fields: Any) -> list[Any]:
    return _send(core, agent, wire.encode_push_reg(_registration(**fields)), now)


def _cancel(core: Any, agent: str, now: float, **fields: Any) -> list[Any]:
    reg = _registration(**fields)
    return _send(core, agent, wire.encode_cancel(reg.match_key, reg, reg.decode_tp_rank), now)


def _told(actions: list[Any], kind: NotificationKind) -> list[tuple[str, str]]:
    """(agent, D request id) of each message of ``kind`` sent."""
    return [
        (a.agent, note.request_id)
        for a in actions
        if isinstance(a, Send) and (note := _note(a.message)).kind is kind
    ]


def _posts(actions: list[Any]) -> list[tuple[str, int, str]]:
    return [(a.engine_id, a.dst, a.registration.request_id) for a in actions if isinstance(a, Post)]


def _reports(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.request_id, a.outcome) for a in actions if isinstance(a, Report)]


def _load_x(core: Any, now: float) -> None:
    core.notification("X-agent", _note(wire.encode_hello(_registration(**X), 0)), now)
    core.connected("X", 0, "X-agent", "x1", 1, "", now)


def _load_d(core: Any, rank: int, now: float) -> list[Any]:
    core.notification(f"D{rank}", _note(wire.encode_hello(_registration(**_d(rank)), rank)), now)
    return core.connected("D", rank, f"D{rank}", f"d1-{rank}", 2, "", now)


def _x_first_then_d() -> Any:
    """x-1 not bound: engine X registered first (the key's tentative engine), then D's ranks 0
    and 1 registered d-1 (held for D, which the router may name); every rank loaded."""
    core = _core()
    _load_x(core, 100.0)
    _register(core, "X-agent", 100.05, **X)
    for rank in (0, 1):
        _load_d(core, rank, 100.0)
        _register(core, f"D{rank}", 100.1, **_d(rank))
    return core


def _d_first_then_x() -> Any:
    """x-1 not bound: D's ranks 0 and 1 registered d-1 first (D is the key's tentative
    engine), then engine X registered it (held for X); every rank loaded."""
    core = _core()
    for rank in (0, 1):
        _load_d(core, rank, 100.0)
        _register(core, f"D{rank}", 100.05, **_d(rank))
    _load_x(core, 100.0)
    _register(core, "X-agent", 100.1, **X)
    return core


# ---------------------------------------------------------------------------------------------
# the cancelling rank's D request, on the engine's other rank processes
# ---------------------------------------------------------------------------------------------


def test_a_held_d_request_cancelled_on_one_rank_is_told_on_the_other_rank_process() -> None:
    """D rank 0 cancels d-1 (held for D): rank 1's d-1 is told FAIL at once, and the router's
    finish naming D writes nothing into rank 1's blocks (D's request ended)."""
    core = _x_first_then_d()
    out = _cancel(core, "D0", 100.2, **_d(0))
    assert _told(out, NotificationKind.CANCEL_ACK) == [("D0", "d-1")]
    assert _told(out, NotificationKind.FAILED) == [("D1", "d-1")], (
        "D rank 1's registration of the cancelled d-1 was kept (its rank's incarnation differs)"
    )
    finish = core.finished("x-1", "p-1", ((5,),), "D", 100.3)
    assert _posts(finish) == [], "P wrote a D rank whose request the engine cancelled"
    assert ("X-agent", "x-req") in _told(finish, NotificationKind.FAILED)  # the router chose D


def test_the_first_registrants_request_cancelled_on_one_rank_leaves_the_key_to_the_next_engine() -> None:
    """D registered x-1 first (its tentative engine), X after it. D rank 0 cancels d-1: rank
    1's d-1 is told FAIL, D's offer ends, and a finish naming no engine pushes X."""
    core = _d_first_then_x()
    out = _cancel(core, "D0", 100.2, **_d(0))
    assert _told(out, NotificationKind.FAILED) == [("D1", "d-1")], out
    finish = core.finished("x-1", "p-1", ((5,),), "", 100.3)
    assert _posts(finish) == [("X", 0, "x-req")], (
        "the key stayed with the engine that cancelled (its rank 1 written, rank 0 awaited until "
        f"the lease) and X, whose registration was waiting, was told FAIL: {finish}"
    )
    assert _told(finish, NotificationKind.FAILED) == []


def test_rank_one_cancelling_first_tells_rank_zero() -> None:
    """The same from the other side: D rank 1's CANCEL reaches P first."""
    for setup in (_x_first_then_d, _d_first_then_x):
        core = setup()
        out = _cancel(core, "D1", 100.2, **_d(1))
        assert _told(out, NotificationKind.FAILED) == [("D0", "d-1")], (setup.__name__, out)


def test_the_other_ranks_own_cancel_is_still_acknowledged() -> None:
    """Rank 1's own CANCEL of d-1, after rank 0's told it FAIL, is acknowledged (D rank 1
    waits for it), nothing more."""
    for setup in (_x_first_then_d, _d_first_then_x):
        core = setup()
        _cancel(core, "D0", 100.2, **_d(0))
        out = _cancel(core, "D1", 100.25, **_d(1))
        assert _told(out, NotificationKind.CANCEL_ACK) == [("D1", "d-1")], (setup.__name__, out)
        assert _told(out, NotificationKind.FAILED) == [] and _reports(out) == [], (setup.__name__, out)


def test_a_rank_not_loaded_yet_is_told_once_p_loads_that_start() -> None:
    """Rank 1's d-1 came while P's handshake with rank 1 ran: the FAIL is owed to the start
    that registered and sent when P loads it; a handshake that loads another start of rank 1
    gets nothing (that start may hold a d-1 of its own)."""
    for loaded, told in (("d1-1", [("D1", "d-1")]), ("d2-1", [])):
        core = _core()
        _load_x(core, 100.0)
        _register(core, "X-agent", 100.05, **X)
        _load_d(core, 0, 100.0)
        _register(core, "D0", 100.1, **_d(0))
        _register(core, "D1", 100.1, **_d(1))  # P connects to rank 1
        out = _cancel(core, "D0", 100.2, **_d(0))
        assert _told(out, NotificationKind.FAILED) == [], out
        out = core.connected("D", 1, "D1", loaded, 2, "", 100.25)
        assert _told(out, NotificationKind.FAILED) == told, (loaded, out)
        assert _posts(core.finished("x-1", "p-1", ((5,),), "D", 100.3)) == []


def test_the_routers_finish_naming_an_engine_that_cancelled_its_held_request_ends_at_once() -> None:
    """D cancelled d-1 (held for it, on each rank) before P finished; the router's finish then
    names D. Nothing of D is left to write: the finish is reported failed at once (it waited
    for the lease, ``lease_s``), X told FAIL, nothing posted; a single rank's cancel (rank 1
    told FAIL at it) ends it too. Whether D was the key's first registrant or not."""
    for setup in (_x_first_then_d, _d_first_then_x):
        for cancelling in ((0, 1), (0,), (1,)):
            core = setup()
            for rank in cancelling:
                _cancel(core, f"D{rank}", 100.2, **_d(rank))
            finish = core.finished("x-1", "p-1", ((5,),), "D", 100.3)
            where = (setup.__name__, cancelling, finish)
            assert _reports(finish) == [("p-1", "failed")], where
            (report,) = [a for a in finish if isinstance(a, Report)]
            assert "cancelled by D rank" in report.reason and "before P finished" in report.reason, where
            assert _posts(finish) == [] and _told(finish, NotificationKind.FAILED) == [
                ("X-agent", "x-req")
            ], where
            assert core.state_sizes()["requests"] == 0 and core.handle_timer(100.3 + core.s.lease_s) == []


def test_a_held_cancel_does_not_end_a_new_request_of_the_engine() -> None:
    """D cancelled d-1 (held) and registered d-2 under the key on both ranks (the request added
    again): the router's finish naming D pushes d-2."""
    core = _x_first_then_d()
    for rank in (0, 1):
        _cancel(core, f"D{rank}", 100.2, **_d(rank))
        _register(core, f"D{rank}", 100.25, **_d(rank, request_id="d-2", block_ids=[[6]], grant=100.2))
    finish = core.finished("x-1", "p-1", ((5,),), "D", 100.3)
    assert sorted(_posts(finish)) == [("D", 0, "d-2"), ("D", 1, "d-2")] and _reports(finish) == [], finish


# ---------------------------------------------------------------------------------------------
# what the cancel must leave alone
# ---------------------------------------------------------------------------------------------


def test_another_d_request_of_the_other_rank_is_left_alone() -> None:
    """Rank 1 holds d-2 (the request added again under the key): rank 0's CANCEL of d-1
    leaves it, and it is pushed once rank 0's d-2 comes and the router names D."""
    core = _core()
    _load_x(core, 100.0)
    _register(core, "X-agent", 100.05, **X)
    for rank in (0, 1):
        _load_d(core, rank, 100.0)
    _register(core, "D0", 100.1, **_d(0))
    _register(core, "D1", 100.1, **_d(1, request_id="d-2", block_ids=[[6]]))
    out = _cancel(core, "D0", 100.2, **_d(0))
    assert _told(out, NotificationKind.FAILED) == [], out
    _register(core, "D0", 100.25, **_d(0, request_id="d-2", block_ids=[[6]], grant=100.2))
    posts = _posts(core.finished("x-1", "p-1", ((5,),), "D", 100.3))
    assert sorted(posts) == [("D", 0, "d-2"), ("D", 1, "d-2")]


def test_a_cancel_of_an_earlier_attempt_leaves_the_held_registration_alone() -> None:
    """D's ranks hold d-1 of attempt 9 (the engine gave d-1 again once D forgot it); a late
    CANCEL of d-1's earlier attempt 3 from rank 0 is acknowledged and changes nothing: neither
    rank's attempt 9 is dropped or told, and the router's finish naming D pushes both ranks.
    (Rank 0's held registration used to be dropped unanswered, and the push waited for the
    lease.) The same while P has not loaded the ranks (the finish waits for the handshakes)."""
    for setup in (_x_first_then_d, _d_first_then_x):
        core = _core()
        if setup is _x_first_then_d:
            _load_x(core, 100.0)
            _register(core, "X-agent", 100.05, **X)
        for rank in (0, 1):
            _load_d(core, rank, 100.0)
            _register(core, f"D{rank}", 100.1, **_d(rank, attempt=9))
        if setup is _d_first_then_x:
            _load_x(core, 100.0)
            _register(core, "X-agent", 100.15, **X)
        out = _cancel(core, "D0", 100.2, **_d(0, attempt=3))
        assert _told(out, NotificationKind.CANCEL_ACK) == [("D0", "d-1")], (setup.__name__, out)
        assert _told(out, NotificationKind.FAILED) == [], (setup.__name__, out)
        posts = _posts(core.finished("x-1", "p-1", ((5,),), "D", 100.3))
        assert sorted(posts) == [("D", 0, "d-1"), ("D", 1, "d-1")], (setup.__name__, posts)
    core = _core()
    for rank in (0, 1):
        _register(core, f"D{rank}", 100.1, **_d(rank, attempt=9))  # P connects to both ranks
    core.finished("x-1", "p-1", ((5,),), "", 100.15)
    out = _cancel(core, "D0", 100.2, **_d(0, attempt=3))
    assert _reports(out) == [], "a cancel of another attempt ended the push of the registration held"
    out = _load_d(core, 0, 100.25) + _load_d(core, 1, 100.25)
    assert _told(out, NotificationKind.CANCEL_ACK) == [("D0", "d-1")], out  # owed until rank 0 loaded
    assert sorted(_posts(out)) == [("D", 0, "d-1"), ("D", 1, "d-1")], out


def test_a_cancel_from_a_start_p_has_not_loaded_for_its_rank_tells_no_other_rank() -> None:
    """A CANCEL through rank 0's agent stating another start of rank 0 (a restart P has not
    handshaken yet) names a d-1 of that start, which may be another D request than the d-1
    rank 1's loaded start registered: rank 1's registration is left alone."""
    for setup in (_x_first_then_d, _d_first_then_x):
        core = setup()
        out = _cancel(core, "D0", 100.2, **_d(0, decode_incarnation="d2-0"))
        assert _told(out, NotificationKind.FAILED) == [], (setup.__name__, out)


def test_another_engines_registration_of_the_same_request_id_is_left_alone() -> None:
    """Engine X registered x-1 under the same D request id d-1: D rank 0's CANCEL of d-1
    tells D's rank 1, never X."""
    for x_first in (True, False):
        core = _core()
        x = {**X, "request_id": "d-1"}
        if x_first:
            _load_x(core, 100.0)
            _register(core, "X-agent", 100.05, **x)
        for rank in (0, 1):
            _load_d(core, rank, 100.0)
            _register(core, f"D{rank}", 100.1, **_d(rank))
        if not x_first:
            _load_x(core, 100.0)
            _register(core, "X-agent", 100.15, **x)
        out = _cancel(core, "D0", 100.2, **_d(0))
        assert _told(out, NotificationKind.FAILED) == [("D1", "d-1")], (x_first, out)
        posts = _posts(core.finished("x-1", "p-1", ((5,),), "X", 100.3))
        assert posts == [("X", 0, "d-1")], (x_first, posts)


# ---------------------------------------------------------------------------------------------
# over real workers: every rank its own incarnation
# ---------------------------------------------------------------------------------------------


def test_over_real_nixl_a_cancel_on_one_d_rank_tells_the_other_rank_and_x_is_pushed() -> None:
    """Real NIXL workers (each D rank its own incarnation). D (TP 2, MLA: P writes both ranks)
    registers x-1 first, engine X after it; the engine's cancel reaches D rank 0 only (rank 1's
    is late). P tells rank 1 at once, and its finish (no router choice) pushes X."""
    pytest.importorskip("nixl")
    from cluster import MLA, Cluster, kv_bytes, wait_until

    from kvpush.core.receiver import PushReceiver
    from kvpush.core.sidechannel import SideChannelServer
    from kvpush.core.types import ParallelConfig, RequestMetadata, TransferParams
    from kvpush.core.worker import WorkerConfig
    from kvpush.layouts.uniform import allocate_kv_caches

    slow = {"request_timeout_s": 60, "heartbeat_interval_s": 5.0, "lease_s": 30.0}
    with Cluster(MLA, transport="nixl", decode_tp=2, **slow) as cluster:
        sender = cluster.senders[P0]
        server = SideChannelServer("X")
        parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=cluster.model.num_layers)
        caches = allocate_kv_caches(cluster.model, parallel, 64, device="cpu")
        config = WorkerConfig(
            engine_id="X",
            parallel=parallel,
            model=cluster.model,
            transport="nixl",
            side_channel_port=server.port,
            **slow,
        )
        x = PushReceiver(config, caches, pm=cluster.pm)
        try:
            x.start()
            server.publish(parallel.rank, x.handshake_payload())
            assert cluster.receivers[0].incarnation != cluster.receivers[1].incarnation
            cluster.add("d-1", [[3]], "x-1")
            wait_until(lambda: _held(sender) == 2, what="both D ranks' PUSH_REG of d-1 held on P")
            params = TransferParams.from_dict(cluster.params("x-1"))
            x.add_request(RequestMetadata(request_id="x-req", block_ids=[[7]], params=params))
            wait_until(lambda: _held(sender) == 3, what="X's PUSH_REG held on P")
            started = time.monotonic()
            cluster.receivers[0].cancel("d-1")
            reason = cluster.wait_decode("d-1", ranks=[1], timeout_s=10)[1]
            assert reason is not None and "cancelled by D rank 0" in reason, reason
            assert time.monotonic() - started < 5, "rank 1 learned of the cancel only at a bound"
            cluster.wait_released("d-1", ranks=[0, 1])
            cluster.finish("p-1", [[5]], "x-1")
            got = x.wait_finished(10)
            assert got.done == ("x-req",), got
            for layer, tensor in caches.items():
                assert torch_equal(kv_bytes(tensor)[7], kv_bytes(cluster.p_caches[P0][layer])[5]), (
                    layer
                )  # MLA: block first
            for rank in (0, 1):
                for tensor in cluster.d_caches[rank].values():
                    assert not kv_bytes(tensor)[3].any(), f"D rank {rank}'s block of d-1 was written"
            assert cluster.wait_prefill("p-1")[P0] is None
        finally:
            x.close()
            server.close()


def _held(sender: Any) -> int:
    """Registrations P's core holds (bound, tentative or held for an engine), read on its writer."""
    return sender.call_on_writer(
        lambda: sum(len(r.regs) + sum(map(len, r.others.values())) for r in sender.core._requests.values())
    )


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))
