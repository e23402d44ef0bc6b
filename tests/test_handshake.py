"""Handshakes over the side channel, full (P -> D) and notif-only (D -> P), with real NIXL.

An "engine process" (spawned) runs real kvpush ranks (``PushSender``/``PushReceiver``) and
serves their payloads on its own side channel. The test process plays the other engine: a real
``PushReceiver`` for end-to-end pushes, or a ``PeerRegistry`` on a real NIXL transport with a
one-thread writer (the registry's threading contract) for handshake-level checks. Invalid
peers are served as encoded payloads of made-up ranks: validation fails before any agent is
loaded. Every wait is bounded; nothing asserts on speed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvpush.core import wire
from kvpush.core.errors import ConfigError, HandshakeError
from kvpush.core.manager import KvpushPluginManager
from kvpush.core.peers import PeerEngine, PeerRegistry
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.transport import Transport, TransportConfig
from kvpush.core.types import (
    AgentMetadata,
    HandshakeMode,
    ModelSpec,
    ParallelConfig,
    RankKey,
    RequestMetadata,
    Role,
    TransferParams,
)
from kvpush.demo import processes
from kvpush.testing import make_agent_metadata

torch = pytest.importorskip("torch")

WAIT_S = 60.0
MODEL = ModelSpec(name="hs-test", num_layers=4, num_kv_heads=2, head_dim=8, block_size=4)
NUM_BLOCKS = 16


# ---------------------------------------------------------------------------- engine process


def _fill(caches: dict[str, Any], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensor in caches.values():
        bits = torch.randint(-30000, 30000, tensor.shape, dtype=torch.int16, generator=gen)
        tensor.view(torch.int16).copy_(bits)


def _engine_main(conn: Connection, role: str, engine_id: str, pp_size: int, tp_size: int) -> None:
    """Real ranks of one engine and its side channel, driven over ``conn``."""
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    workers: list[Any] = []
    server = None
    try:
        from kvpush.core.receiver import PushReceiver
        from kvpush.core.sender import PushSender
        from kvpush.core.worker import WorkerConfig
        from kvpush.layouts.uniform import allocate_kv_caches

        server = SideChannelServer(engine_id)
        caches: dict[str, Any] = {}
        for pp in range(pp_size):
            for tp in range(tp_size):
                parallel = ParallelConfig.for_stage(
                    num_layers=MODEL.num_layers, pp_size=pp_size, pp_rank=pp, tp_size=tp_size, tp_rank=tp
                )
                rank_caches = allocate_kv_caches(MODEL, parallel, NUM_BLOCKS)
                _fill(rank_caches, seed=100 * pp + tp + 1)
                caches.update(rank_caches)
                cls = PushSender if role == "prefill" else PushReceiver
                config = WorkerConfig(
                    engine_id=engine_id, parallel=parallel, model=MODEL, side_channel_port=server.port
                )
                worker = cls(config, rank_caches)
                workers.append(worker)
                worker.start()
                server.publish(parallel.rank, worker.handshake_payload())
        conn.send(("ok", server.port))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        for worker in workers:
            worker.close()
        if server is not None:
            server.close()
        return
    sent: dict[str, set[str]] = {w.agent_name: set() for w in workers}
    try:
        while conn.poll(300):
            cmd, *args = conn.recv()
            if cmd == "stop":
                conn.send(("ok", None))
                break
            try:
                if cmd == "finish":
                    rid, block_ids, match_key = args
                    for worker in workers:
                        worker.request_finished(rid, block_ids, match_key=match_key)
                    conn.send(("ok", None))
                elif cmd == "wait_sent":
                    rid, timeout_s = args
                    deadline = time.monotonic() + timeout_s
                    failed: dict[str, str] = {}
                    while time.monotonic() < deadline:
                        for worker in workers:
                            results = worker.get_finished()
                            sent[worker.agent_name].update(results.sent)
                            failed.update(results.failed)
                        if failed or all(rid in s for s in sent.values()):
                            break
                        time.sleep(0.005)
                    conn.send(("ok", {"sent": {k: sorted(v) for k, v in sent.items()}, "failed": failed}))
                elif cmd == "caches":
                    conn.send(("ok", {k: v.view(torch.int16).numpy().copy() for k, v in caches.items()}))
                elif cmd == "stats":
                    stats = {
                        "requests_served": server.requests_served,
                        "requests_rejected": server.requests_rejected,
                        "ranks": {
                            w.agent_name: {
                                "counters": w.transport.counters.as_dict(),
                                "handshake_ms": w.peers.handshake_ms,
                            }
                            for w in workers
                        },
                    }
                    conn.send(("ok", stats))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for worker in workers:
            worker.close()
        server.close()


class EngineProcess:
    def __init__(self, role: str, engine_id: str, pp_size: int = 1, tp_size: int = 1) -> None:
        self.engine_id = engine_id
        self.process, self.conn = processes.start(
            _engine_main, lambda conn: (conn, role, engine_id, pp_size, tp_size), name=f"engine-{engine_id}"
        )
        self.port: int = self._reply("start", 120)

    def _reply(self, what: str, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"engine {self.engine_id} did not answer {what!r} within {timeout_s}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.engine_id} failed on {what!r}:\n{value}")
        return value

    def call(self, *message: Any, timeout_s: float = WAIT_S) -> Any:
        self.conn.send(message)
        return self._reply(message[0], timeout_s)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.call("stop", timeout_s=30)
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()


@pytest.fixture
def prefill_pp2() -> Iterator[EngineProcess]:
    engine = EngineProcess("prefill", "prefill-0", pp_size=2)
    try:
        yield engine
    finally:
        engine.stop()


# ---------------------------------------------------------------------------- local side


class Writer:
    """The single thread that owns a transport (what RankWorker's writer thread is)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-writer")

    def run(self, command: Any) -> None:
        self._pool.submit(command)

    def call(self, command: Any) -> Any:
        return self._pool.submit(command).result(timeout=WAIT_S)

    def pause(self) -> threading.Event:
        gate = threading.Event()
        self._pool.submit(gate.wait, WAIT_S)
        return gate

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def nixl() -> Iterator[Transport]:
    from kvpush.transports.nixl import NixlTransport

    transport = NixlTransport(TransportConfig(agent_name="hs-test-local"))
    try:
        yield transport
    finally:
        transport.close()


@pytest.fixture
def writer() -> Iterator[Writer]:
    w = Writer()
    try:
        yield w
    finally:
        w.close()


def _local_rank(pm: KvpushPluginManager, role: Role, engine_id: str, transport: Transport) -> AgentMetadata:
    from kvpush.layouts.uniform import allocate_kv_caches

    parallel = ParallelConfig(tp_size=1, num_layers=MODEL.num_layers)
    caches = allocate_kv_caches(MODEL, parallel, NUM_BLOCKS)
    regions = pm.layout("uniform").describe_regions(caches, parallel, MODEL)
    return AgentMetadata(
        engine_id=engine_id,
        role=role,
        parallel=parallel,
        model=MODEL,
        layout="uniform",
        transport="nixl",
        agent_name=transport.agent_name,
        agent_blob=transport.metadata(),
        regions=regions,
    )


def _registry(
    pm: KvpushPluginManager, local: AgentMetadata, transport: Transport, writer: Writer, timeout_s: float = 30
) -> PeerRegistry:
    return PeerRegistry(
        pm=pm, local=local, transport=transport, run_on_writer=writer.run, timeout_s=timeout_s
    )


def _error_of(future: Future[PeerEngine]) -> str:
    error = future.exception(timeout=WAIT_S)
    assert isinstance(error, HandshakeError), f"expected a HandshakeError, got {error!r}"
    return str(error)


# ---------------------------------------------------------------------------- end to end


def test_pp2_prefill_pushes_into_decode_byte_for_byte(prefill_pp2: EngineProcess) -> None:
    """D (this process) handshakes notif-only with both P stages, sends PUSH_REG to each; each
    stage handshakes back in full and writes its layers; D verifies every byte."""
    from kvpush.core.receiver import PushReceiver
    from kvpush.core.worker import WorkerConfig
    from kvpush.layouts.uniform import allocate_kv_caches

    d_server = SideChannelServer("decode-0")
    parallel = ParallelConfig(tp_size=1, num_layers=MODEL.num_layers)
    d_caches = allocate_kv_caches(MODEL, parallel, NUM_BLOCKS)
    receiver = PushReceiver(
        WorkerConfig(engine_id="decode-0", parallel=parallel, model=MODEL, side_channel_port=d_server.port),
        d_caches,
    )
    try:
        receiver.start()
        d_server.publish(parallel.rank, receiver.handshake_payload())
        params = TransferParams(
            remote_engine_id="prefill-0",
            remote_host="127.0.0.1",
            remote_port=prefill_pp2.port,
            pp_size=2,
            tp_size=1,
        )
        pushes = [("req-a", [1, 3, 5], [7, 8, 9]), ("req-b", [0, 15], [2, 14])]
        for rid, p_ids, d_ids in pushes:
            prefill_pp2.call("finish", rid, [p_ids], f"xfer-{rid}")
            request_params = TransferParams(**{**params.to_dict(), "transfer_id": f"xfer-{rid}"})
            receiver.add_request(RequestMetadata(request_id=rid, block_ids=[d_ids], params=request_params))
            results = receiver.wait_finished(WAIT_S)
            assert results.failed == {}
            assert results.done == (rid,)
            outcome = prefill_pp2.call("wait_sent", rid, WAIT_S, timeout_s=WAIT_S + 30)
            assert outcome["failed"] == {}
            assert all(rid in sent for sent in outcome["sent"].values()), outcome

        p_caches = prefill_pp2.call("caches")
        assert sorted(p_caches) == sorted(d_caches) == [f"layers.{i}" for i in range(MODEL.num_layers)]
        written = {d for _, _, d_ids in pushes for d in d_ids}
        for name, source in p_caches.items():
            dest = d_caches[name].view(torch.int16).numpy()
            for _, p_ids, d_ids in pushes:
                np.testing.assert_array_equal(dest[:, d_ids], source[:, p_ids], err_msg=name)
            untouched = [b for b in range(NUM_BLOCKS) if b not in written]
            assert not dest[:, untouched].any(), f"{name}: blocks outside the requests were written"

        # D: one notif-only handshake loaded both stages' agents, prepared no descriptors.
        counters = receiver.transport.counters
        assert counters.peers_loaded == 2
        assert counters.remote_lists_prepared == 0
        assert counters.notifs_sent == 6  # HELLO x 2 stages, then PUSH_REG x 2 stages x 2 requests
        assert counters.writes_posted == 0
        assert len(receiver.peers.handshake_ms["notif_only"]) == 1
        assert receiver.peers.handshake_ms["full"] == []
        assert receiver.stats["push_regs_sent"] == 4

        # P: each stage received both PUSH_REGs, handshook with D once in full, and wrote.
        stats = prefill_pp2.call("stats")
        assert stats["requests_served"] == 2  # D asked once per stage, not once per request
        assert d_server.requests_served == 2  # each stage asked D once
        for name, rank in stats["ranks"].items():
            assert rank["counters"]["notifs_received"] == 3, name  # HELLO + 2 PUSH_REGs
            assert rank["counters"]["peers_loaded"] == 1, name
            assert rank["counters"]["remote_lists_prepared"] >= 1, name
            assert rank["counters"]["writes_posted"] == 2, name
            assert len(rank["handshake_ms"]["full"]) == 1, name
            assert rank["handshake_ms"]["notif_only"] == [], name
    finally:
        receiver.close()
        d_server.close()


def test_demo_harness_pushes_and_verifies() -> None:
    from kvpush.demo.runner import RunConfig, run_config

    row = run_config(
        RunConfig(
            layout="mha",
            prefill_pp=1,
            prefill_tp=1,
            decode_tp=1,
            requests=4,
            max_blocks=4,
            num_layers=4,
            timeout_s=WAIT_S,
        )
    )
    assert row["failures"] == {}
    assert row["verified_requests"] == row["requests"] == 4
    assert row["remote_lists_prepared_by_decode"] == 0
    assert row["handshake_ms_full"] is not None
    assert row["handshake_ms_notif_only"] is not None


# ---------------------------------------------------------------------------- registry level


def test_notif_only_loads_every_stage_and_prepares_nothing(
    kvpush_pm: KvpushPluginManager, prefill_pp2: EngineProcess, writer: Writer
) -> None:
    from kvpush.transports.nixl import NixlTransport

    transport = NixlTransport(TransportConfig(agent_name="decode-0-notif-test"))
    local = _local_rank(kvpush_pm, Role.DECODE, "decode-0", transport)
    registry = _registry(kvpush_pm, local, transport, writer)
    try:
        ranks = [RankKey(0, 0), RankKey(1, 0)]
        engine = registry.ensure("prefill-0", "127.0.0.1", prefill_pp2.port, ranks, HandshakeMode.NOTIF_ONLY)
        engine = engine.result(timeout=WAIT_S)
        assert engine.mode is HandshakeMode.NOTIF_ONLY
        assert sorted(engine.ranks) == ranks
        assert engine.pp_size == 2 and engine.tp_size == 1
        assert all(r.alignment is None and not r.remote_lists for r in engine.ranks.values())
        assert transport.counters.peers_loaded == 2
        assert transport.counters.remote_lists_prepared == 0
        with pytest.raises(HandshakeError, match="loaded notif-only; it has no descriptors"):
            writer.call(lambda: registry.remote_list(engine, RankKey(0, 0), (0, 1)))
        assert transport.counters.remote_lists_prepared == 0
        # Notif-only is enough to notify: a PUSH_REG with no finished prefill is simply held by P.
        for rank in ranks:
            writer.call(lambda r=rank: transport.send_notif(engine.ranks[r].agent, wire.encode_heartbeat([])))
        assert transport.counters.notifs_sent == 2
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            received = [r["counters"]["notifs_received"] for r in prefill_pp2.call("stats")["ranks"].values()]
            if received == [1, 1]:
                break
            time.sleep(0.02)
        assert received == [1, 1]
        writer.call(lambda: registry.remove("prefill-0"))
        assert transport.counters.peers_removed == 2
        assert "prefill-0" not in registry.engines
    finally:
        registry.close()
        writer.call(transport.close)


def test_concurrent_handshakes_to_one_engine_share_one_fetch(
    kvpush_pm: KvpushPluginManager, prefill_pp2: EngineProcess, writer: Writer
) -> None:
    from kvpush.transports.nixl import NixlTransport

    transport = NixlTransport(TransportConfig(agent_name="decode-0-dedupe-test"))
    local = _local_rank(kvpush_pm, Role.DECODE, "decode-0", transport)
    registry = _registry(kvpush_pm, local, transport, writer)
    try:
        gate = writer.pause()  # hold the load half, so both calls surely overlap
        args = ("prefill-0", "127.0.0.1", prefill_pp2.port)
        first = registry.ensure(*args, [RankKey(0, 0), RankKey(1, 0)], HandshakeMode.NOTIF_ONLY)
        second = registry.ensure(
            *args, [RankKey(1, 0), RankKey(0, 0), RankKey(1, 0)], HandshakeMode.NOTIF_ONLY
        )
        assert second is first
        other = registry.ensure(*args, [RankKey(0, 0)], HandshakeMode.NOTIF_ONLY)  # other ranks: own future
        assert other is not first
        gate.set()
        engine = first.result(timeout=WAIT_S)
        assert other.result(timeout=WAIT_S) is engine
        assert prefill_pp2.call("stats")["requests_served"] == 3  # 2 ranks once, plus rank 0 alone
        assert transport.counters.peers_loaded == 2
        assert len(registry.handshake_ms["notif_only"]) == 2
        # Once connected, ensure() answers from memory: no round trip at all.
        third = registry.ensure(*args, [RankKey(0, 0), RankKey(1, 0)], HandshakeMode.NOTIF_ONLY)
        assert third.done() and third.result() is engine
        assert registry.connected("prefill-0", [RankKey(1, 0)]) is engine
        assert prefill_pp2.call("stats")["requests_served"] == 3
    finally:
        registry.close()
        writer.call(transport.close)


def test_full_handshake_aligns_and_prepares_remote_lists(
    kvpush_pm: KvpushPluginManager, writer: Writer
) -> None:
    from kvpush.transports.nixl import NixlTransport

    decode = EngineProcess("decode", "decode-0")
    transport = NixlTransport(TransportConfig(agent_name="prefill-0-full-test"))
    local = _local_rank(kvpush_pm, Role.PREFILL, "prefill-0", transport)
    registry = _registry(kvpush_pm, local, transport, writer)
    try:
        future = registry.ensure("decode-0", "127.0.0.1", decode.port, [RankKey(0, 0)], HandshakeMode.FULL)
        engine = future.result(timeout=WAIT_S)
        peer_rank = engine.ranks[RankKey(0, 0)]
        assert engine.mode is HandshakeMode.FULL
        assert peer_rank.alignment is not None
        assert len(peer_rank.aligned_regions) == len(local.regions) == 2 * MODEL.num_layers
        handle = writer.call(lambda: registry.remote_list(engine, RankKey(0, 0), (0, 1)))
        assert writer.call(lambda: registry.remote_list(engine, RankKey(0, 0), (0, 1))) == handle  # cached
        assert transport.counters.peers_loaded == 1
        assert transport.counters.remote_lists_prepared == 1
        assert registry.handshake_ms["full"] and registry.handshake_ms["notif_only"] == []
        writer.call(lambda: registry.remove("decode-0"))
        assert transport.counters.peers_removed == 1
    finally:
        registry.close()
        writer.call(transport.close)
        decode.stop()


# ---------------------------------------------------------------------------- validation errors


@pytest.fixture
def fake_engine() -> Iterator[SideChannelServer]:
    """A side channel serving whatever payloads a test publishes (made-up ranks)."""
    server = SideChannelServer("fake")
    try:
        yield server
    finally:
        server.close()


def _serve(server: SideChannelServer, **kwargs: Any) -> None:
    meta = make_agent_metadata(**kwargs)
    server.publish(meta.rank, wire.encode_metadata(meta))


def _try(
    pm: KvpushPluginManager,
    nixl: Transport,
    server: SideChannelServer,
    *,
    role: str,
    engine_id: str,
    mode: HandshakeMode,
    ranks: list[RankKey] | None = None,
    port: int | None = None,
    timeout_s: float = 30,
    **local_kwargs: Any,
) -> str:
    writer = Writer()
    local = make_agent_metadata(role=role, **local_kwargs)
    registry = PeerRegistry(pm=pm, local=local, transport=nixl, run_on_writer=writer.run, timeout_s=timeout_s)
    try:
        future = registry.ensure(engine_id, "127.0.0.1", port or server.port, ranks or [RankKey(0, 0)], mode)
        message = _error_of(future)
        assert registry._pending == {}, "a failed handshake must not stay pending"
        assert registry.engines == {}
        assert nixl.counters.peers_loaded == 0
        return message
    finally:
        registry.close()
        writer.close()


def test_compat_hash_mismatch_names_both_values(kvpush_pm: KvpushPluginManager, nixl: Transport) -> None:
    server = SideChannelServer("decode-x")
    try:
        _serve(server, role="decode", engine_id="decode-x", head_dim=16)
        message = _try(kvpush_pm, nixl, server, role="prefill", engine_id="decode-x", mode=HandshakeMode.FULL)
    finally:
        server.close()
    peer_hash = wire.compatibility_hash(make_agent_metadata(head_dim=16).model, "uniform", "nixl")
    local_hash = wire.compatibility_hash(make_agent_metadata().model, "uniform", "nixl")
    assert peer_hash != local_hash
    assert f"peer {peer_hash!r}, local {local_hash!r}" in message
    assert "compatibility hash mismatch with engine 'decode-x' rank (pp=0, tp=0)" in message


def test_wrong_engine_id_is_a_clear_error(
    kvpush_pm: KvpushPluginManager, nixl: Transport, fake_engine: SideChannelServer
) -> None:
    _serve(fake_engine, role="prefill", engine_id="prefill-B")
    message = _try(
        kvpush_pm, nixl, fake_engine, role="decode", engine_id="prefill-A", mode=HandshakeMode.NOTIF_ONLY
    )
    assert f"127.0.0.1:{fake_engine.port} serves engine 'prefill-B', but 'prefill-A' was expected" in message


def test_decode_side_pp_is_rejected(
    kvpush_pm: KvpushPluginManager, nixl: Transport, fake_engine: SideChannelServer
) -> None:
    _serve(fake_engine, role="decode", engine_id="decode-pp", pp_size=2, pp_rank=0)
    message = _try(
        kvpush_pm, nixl, fake_engine, role="prefill", engine_id="decode-pp", mode=HandshakeMode.FULL
    )
    assert "decode engine 'decode-pp' runs PP=2; only the prefill side may be pipeline-parallel" in message


def test_decode_worker_with_pp_refuses_to_start() -> None:
    from kvpush.core.receiver import PushReceiver
    from kvpush.core.worker import WorkerConfig

    parallel = ParallelConfig.for_stage(
        num_layers=MODEL.num_layers, pp_size=2, pp_rank=0, tp_size=1, tp_rank=0
    )
    receiver = PushReceiver(WorkerConfig(engine_id="decode-pp", parallel=parallel, model=MODEL), {})
    with pytest.raises(ConfigError, match="decode engine 'decode-pp' has PP=2"):
        receiver.start()


def test_same_role_is_rejected(
    kvpush_pm: KvpushPluginManager, nixl: Transport, fake_engine: SideChannelServer
) -> None:
    _serve(fake_engine, role="prefill", engine_id="prefill-other")
    message = _try(
        kvpush_pm, nixl, fake_engine, role="prefill", engine_id="prefill-other", mode=HandshakeMode.FULL
    )
    assert "both sides are prefill engines" in message


def test_payload_wire_version_mismatch_is_named(
    kvpush_pm: KvpushPluginManager, nixl: Transport, fake_engine: SideChannelServer
) -> None:
    fake_engine.publish(
        RankKey(0, 0), wire.pack({"wire_version": wire.WIRE_VERSION + 1, "compat_hash": "x", "meta": b""})
    )
    message = _try(
        kvpush_pm, nixl, fake_engine, role="decode", engine_id="fake", mode=HandshakeMode.NOTIF_ONLY
    )
    assert f"speaks kvpush wire version {wire.WIRE_VERSION + 1}, this side {wire.WIRE_VERSION}" in message


def test_unknown_rank_names_the_ranks_served(
    kvpush_pm: KvpushPluginManager, nixl: Transport, fake_engine: SideChannelServer
) -> None:
    _serve(fake_engine, role="prefill", engine_id="fake")
    message = _try(
        kvpush_pm,
        nixl,
        fake_engine,
        role="decode",
        engine_id="fake",
        mode=HandshakeMode.NOTIF_ONLY,
        ranks=[RankKey(1, 0)],
    )
    assert "has no rank (pp=1, tp=0); it serves (pp=0, tp=0)" in message


def test_unreachable_peer_fails_within_the_timeout(kvpush_pm: KvpushPluginManager, nixl: Transport) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = SideChannelServer("unused")
    try:
        message = _try(
            kvpush_pm,
            nixl,
            server,
            role="decode",
            engine_id="prefill-gone",
            mode=HandshakeMode.NOTIF_ONLY,
            ranks=[RankKey(0, 1)],
            port=port,
            timeout_s=0.5,
            tp_size=2,
        )
    finally:
        server.close()
    assert f"tcp://127.0.0.1:{port}" in message
    assert "rank (pp=0, tp=1)" in message and "'prefill-gone'" in message


def test_failed_handshake_can_be_retried(
    kvpush_pm: KvpushPluginManager, nixl: Transport, fake_engine: SideChannelServer, writer: Writer
) -> None:
    registry = PeerRegistry(
        pm=kvpush_pm,
        local=make_agent_metadata(role="decode"),
        transport=nixl,
        run_on_writer=writer.run,
        timeout_s=30,
    )
    try:
        args = ("fake", "127.0.0.1", fake_engine.port, [RankKey(0, 0)], HandshakeMode.NOTIF_ONLY)
        first = registry.ensure(*args)
        assert "it serves none yet" in _error_of(first)
        second = registry.ensure(*args)
        assert second is not first
        assert "it serves none yet" in _error_of(second)
        assert fake_engine.requests_rejected == 2
    finally:
        registry.close()


def test_ensure_after_close_fails_at_once(
    kvpush_pm: KvpushPluginManager, nixl: Transport, writer: Writer
) -> None:
    registry = PeerRegistry(
        pm=kvpush_pm,
        local=make_agent_metadata(role="decode"),
        transport=nixl,
        run_on_writer=writer.run,
        timeout_s=30,
    )
    registry.close()
    future = registry.ensure("p", "127.0.0.1", 1, [RankKey(0, 0)], HandshakeMode.NOTIF_ONLY)
    assert future.done()
    assert "peer registry closed; no handshake with 'p'" in _error_of(future)
    assert registry._pending == {}
