"""Full vs notif-only handshake time, against real engines in another process.

Run (benchmarks are disabled by default in pyproject's addopts)::

    .venv/bin/pytest benchmarks/bench_handshake.py --benchmark-enable -p no:cacheprovider

A spawned process runs a real prefill rank (``PushSender``) and a real decode rank
(``PushReceiver``), each behind its own side channel. This process holds a local P rank and a
local D rank (real NIXL agents, each driven by one writer thread) and times, on a fresh
``PeerRegistry`` per round:

- ``full`` (P -> D): ``ensure(FULL).result()`` plus preparing the remote descriptor list of the
  whole KV cache, which the registry does lazily before P's first WRITE (so it is part of what
  a full handshake costs P);
- ``notif_only`` (D -> P): ``ensure(NOTIF_ONLY).result()``: fetch, validate, load the agent.

Between rounds the peer agent is removed, so every round loads it again (``add_remote_agent``
of already-loaded metadata is a no-op in NIXL). The cache has 32 layers x K/V x 4096 blocks =
262,144 block descriptors, the order of a real model's. The full/notif-only ratio of medians
goes into ``extra_info`` of both benchmarks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import pytest

from kvpush.core.peers import PeerRegistry
from kvpush.core.transport import TransportConfig
from kvpush.core.types import AgentMetadata, HandshakeMode, ModelSpec, ParallelConfig, RankKey, Role

MODEL = ModelSpec(name="bench-hs", num_layers=32, num_kv_heads=1, head_dim=8, block_size=1)
NUM_BLOCKS = 4096
ROUNDS = 30
WAIT_S = 60.0
RANK = RankKey(0, 0)
PARALLEL = ParallelConfig(tp_size=1, num_layers=MODEL.num_layers)

_medians: dict[str, float] = {}
_benchmarks: dict[str, Any] = {}


def _engines_main(conn: Connection) -> None:
    """A prefill rank and a decode rank, each behind its own side channel, until told to stop."""
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        from kvpush.core.receiver import PushReceiver
        from kvpush.core.sender import PushSender
        from kvpush.core.sidechannel import SideChannelServer
        from kvpush.core.worker import WorkerConfig
        from kvpush.layouts.uniform import allocate_kv_caches

        ports, keep = {}, []
        for engine_id, cls in (("prefill-0", PushSender), ("decode-0", PushReceiver)):
            server = SideChannelServer(engine_id)
            worker = cls(
                WorkerConfig(
                    engine_id=engine_id, parallel=PARALLEL, model=MODEL, side_channel_port=server.port
                ),
                allocate_kv_caches(MODEL, PARALLEL, NUM_BLOCKS),
            )
            worker.start()
            server.publish(RANK, worker.handshake_payload())
            ports[engine_id] = server.port
            keep.append((server, worker))
        conn.send(("ok", ports))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        conn.poll(3600)  # any message (or the parent's exit) stops it
    finally:
        for server, worker in keep:
            worker.close()
            server.close()


class LocalRank:
    """A local rank: real NIXL agent with registered caches, and its one writer thread."""

    def __init__(self, pm: Any, role: Role, engine_id: str) -> None:
        from kvpush.layouts.uniform import allocate_kv_caches
        from kvpush.transports.nixl import NixlTransport

        self.pm = pm
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"bench-writer-{role.value}")
        self.caches = allocate_kv_caches(MODEL, PARALLEL, NUM_BLOCKS)
        regions = pm.layout("uniform").describe_regions(self.caches, PARALLEL, MODEL)
        self.transport = NixlTransport(TransportConfig(agent_name=f"bench-{engine_id}"))
        self.transport.register_regions(regions)
        self.meta = AgentMetadata(
            engine_id=engine_id,
            role=role,
            parallel=PARALLEL,
            model=MODEL,
            layout="uniform",
            transport="nixl",
            agent_name=self.transport.agent_name,
            agent_blob=self.transport.metadata(),
            regions=regions,
        )
        self.registry: PeerRegistry | None = None

    def on_writer(self, command: Any) -> Any:
        return self.writer.submit(command).result(timeout=WAIT_S)

    def fresh_registry(self) -> PeerRegistry:
        """Drop the previous registry and what it loaded; a new one knows no peer."""
        self.drop_registry()
        self.registry = PeerRegistry(
            pm=self.pm,
            local=self.meta,
            transport=self.transport,
            run_on_writer=self.writer.submit,
            timeout_s=WAIT_S,
        )
        return self.registry

    def drop_registry(self) -> None:
        registry, self.registry = self.registry, None
        if registry is not None:
            for engine_id in list(registry.engines):
                self.on_writer(lambda e=engine_id: registry.remove(e))
            registry.close()

    def close(self) -> None:
        self.drop_registry()
        self.on_writer(self.transport.close)
        self.writer.shutdown(wait=True)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, int]]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_engines_main, args=(child,), daemon=True)
    process.start()
    child.close()
    try:
        if not conn.poll(120):
            raise TimeoutError("the engine process did not start within 120s")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"the engine process failed to start:\n{value}")
        yield value
    finally:
        if process.is_alive():
            conn.send("stop")
            process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
        conn.close()


@pytest.fixture(scope="module")
def locals_() -> Iterator[dict[HandshakeMode, LocalRank]]:
    from kvpush.core.manager import get_plugin_manager

    pm = get_plugin_manager(load_entrypoints=False, env={})
    ranks = {
        HandshakeMode.FULL: LocalRank(pm, Role.PREFILL, "prefill-0"),  # P handshakes D in full
        HandshakeMode.NOTIF_ONLY: LocalRank(pm, Role.DECODE, "decode-0"),  # D handshakes P notif-only
    }
    try:
        yield ranks
    finally:
        for rank in ranks.values():
            rank.close()


@pytest.mark.parametrize("mode", [HandshakeMode.FULL, HandshakeMode.NOTIF_ONLY], ids=lambda m: m.value)
def test_handshake(
    benchmark: Any, engines: dict[str, int], locals_: dict[HandshakeMode, LocalRank], mode: HandshakeMode
) -> None:
    local = locals_[mode]
    peer_id = "decode-0" if mode is HandshakeMode.FULL else "prefill-0"
    port = engines[peer_id]
    lists_before = local.transport.counters.remote_lists_prepared

    def setup() -> tuple[tuple[PeerRegistry], dict[str, Any]]:
        return (local.fresh_registry(),), {}

    def handshake(registry: PeerRegistry) -> None:
        engine = registry.ensure(peer_id, "127.0.0.1", port, [RANK], mode).result(timeout=WAIT_S)
        if mode is HandshakeMode.FULL:
            local.on_writer(lambda: registry.remote_list(engine, RANK, (0, 1)))

    benchmark.pedantic(handshake, setup=setup, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    registry = local.registry
    assert registry is not None
    internal = list(registry.handshake_ms[mode.value])
    local.drop_registry()

    lists = local.transport.counters.remote_lists_prepared - lists_before
    if mode is HandshakeMode.FULL:
        assert lists >= 1
    else:
        assert lists == 0  # notif-only never builds descriptors
    info = benchmark.extra_info
    info["mode"] = mode.value
    info["descriptors"] = 2 * MODEL.num_layers * NUM_BLOCKS
    info["remote_lists_prepared"] = lists
    info["peers_loaded"] = local.transport.counters.peers_loaded
    info["registry_handshake_ms_last_round"] = internal[-1] if internal else None
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing to compare
        return
    _medians[mode.value] = benchmark.stats.stats.median
    _benchmarks[mode.value] = benchmark
    if len(_medians) == 2:
        ratio = _medians["full"] / _medians["notif_only"]
        for bench in _benchmarks.values():
            bench.extra_info["full_over_notif_only"] = round(ratio, 3)
            bench.extra_info["full_median_ms"] = round(_medians["full"] * 1e3, 3)
            bench.extra_info["notif_only_median_ms"] = round(_medians["notif_only"] * 1e3, 3)
