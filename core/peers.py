"""Handshakes with peer engines: fetch, validate and align off the writer thread; load on it.

A handshake has two halves. The *fetch* half (side-channel round trips, decoding, validation,
region alignment) runs on a small executor so it never blocks the writer. The *load* half
(``transport.load_peer``) touches the transport and therefore runs on the writer thread, as a
queued command. Concurrent handshakes to one engine share one future.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from kvpush.core import wire
from kvpush.core.addresses import host_port
from kvpush.core.block_order import slice_rows
from kvpush.core.errors import HandshakeError, KvpushError, PeerProcessExited, TransferError
from kvpush.core.manager import KvpushPluginManager
from kvpush.core.planning import region_descriptors
from kvpush.core.process_identity import PROCESS_KEY, has_exited
from kvpush.core.sidechannel import fetch_metadata
from kvpush.core.transport import Transport
from kvpush.core.types import (
    AgentMetadata,
    HandshakeMode,
    KVRegion,
    RankKey,
    RegionAlignment,
    Role,
)

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class PeerRank:
    """One loaded rank of a peer engine."""

    meta: AgentMetadata
    agent: str = ""
    alignment: RegionAlignment | None = None
    remote_lists: dict[tuple[int, int], int] = attrs.field(factory=dict)
    """Prepared remote descriptor lists by block part (full handshakes only)."""
    share: frozenset[tuple[int, Any, Any]] | None = None
    """D, of a producer: the ``(D region, block slice start, end)`` pieces its plan writes into
    this rank, as :func:`check_producers` checked them (what its packed DONEs must cover)."""
    parts: frozenset[tuple[Any, Any]] | None = None
    """P, of a D rank: the ``(local_part, remote_part)`` of the read specs its handshake checked
    (:func:`producer_slices`); a request's plan must write exactly these."""

    @property
    def aligned_regions(self) -> list[KVRegion]:
        assert self.alignment is not None
        return [self.meta.regions[i] for i in self.alignment.remote_indices]


@attrs.define(eq=False)
class PeerEngine:
    """What a rank knows about one peer engine."""

    engine_id: str
    host: str
    port: int
    mode: HandshakeMode
    ranks: dict[RankKey, PeerRank] = attrs.field(factory=dict)
    handshake_ms: float = 0.0
    last_active: float = attrs.field(factory=time.monotonic)
    latest: tuple[RankKey, ...] = ()
    """The ranks its latest handshake fetched and checked (``ranks`` may also hold ranks an
    earlier handshake loaded, of another parallel layout: none of them is checked now)."""
    refusal: str = ""
    """D, of its latest handshake: why the producers it loaded are no set it may register with
    (:func:`check_producers`; "" when they are). They are loaded all the same, notif-only, so
    that a producer still holding an earlier registration can be asked for its answer."""

    @property
    def tp_size(self) -> int:
        return next(iter(self.ranks.values())).meta.parallel.tp_size

    @property
    def pp_size(self) -> int:
        return next(iter(self.ranks.values())).meta.parallel.pp_size


def check_geometry(local: AgentMetadata, peer: AgentMetadata, alignment: RegionAlignment) -> list[str]:
    """Per aligned pair: same component and replication, and equal bytes per head per block."""
    problems = []
    groups_differ = 0
    for i, j in enumerate(alignment.remote_indices):
        mine, theirs = local.regions[i], peer.regions[j]
        if mine.kv_group != theirs.kv_group:
            groups_differ += 1
            if groups_differ > 1:
                continue
        if mine.component != theirs.component or mine.replicate != theirs.replicate:
            problems.append(
                f"region {i} ({mine.layer_names}, {mine.component}) pairs with peer region {j} "
                f"({theirs.layer_names}, {theirs.component}); component/replication differ"
            )
            continue
        if mine.kv_group != theirs.kv_group:
            problems.append(
                f"region {i} ({mine.layer_names}, {mine.component}) is in KV-cache group "
                f"{mine.kv_group} on {local.engine_id!r} {local.rank} but its peer region {j} is in "
                f"group {theirs.kv_group} on {peer.engine_id!r} {peer.rank}: block ids are given per "
                f"group, so this layer's KV would be written at the block ids of another group. "
                f"Number KV-cache groups the same way on both engines (KVRegion.kv_group = "
                f"ModelSpec.group_of(layer), and block ids listed in that group order)"
            )
            continue
        if mine.block_len * theirs.num_heads != theirs.block_len * mine.num_heads:
            problems.append(
                f"block length mismatch on {mine.layer_names} {mine.component}: local "
                f"{mine.block_len} B for {mine.num_heads} head(s), peer {theirs.block_len} B for "
                f"{theirs.num_heads} head(s); block size, head size and dtype must match"
            )
    if groups_differ > 1:
        problems.append(f"(and {groups_differ - 1} more regions paired across KV-cache groups)")
    return problems


def check_window_blocks(local: AgentMetadata, peer: AgentMetadata) -> list[str]:
    """P and D may free a sliding window's blocks at granularities that fit: D's block (tokens)
    of every sliding-window KV group must divide P's (both publish theirs:
    ``WINDOW_BLOCKS_KEY``). An engine frees the blocks wholly before its window's first token,
    so with D's block dividing P's every block D keeps of the window P keeps too. With a finer
    P (P 16, D 32 tokens) D's coarser blocks start up to a block of P's earlier than P's: D
    registers a kernel block P freed, and about every other request would fail. D must not
    register less than it keeps either: its engine caches the blocks it received under the
    prompt's hash, and a later request hitting that prefix would read a kernel block nobody
    wrote. A side that states nothing (an engine that frees no window blocks) is not checked:
    the pairing then refuses any block P does not hold, request by request."""
    from kvpush.core.worker import WINDOW_BLOCKS_KEY

    if local.role is Role.PREFILL:
        producer, decode = local, peer
    else:
        producer, decode = peer, local
    p_sizes = producer.extensions.get(WINDOW_BLOCKS_KEY)
    d_sizes = decode.extensions.get(WINDOW_BLOCKS_KEY)
    if p_sizes is None or d_sizes is None:
        return []
    if len(p_sizes) != len(d_sizes):
        return [
            f"P {producer.engine_id!r} states the window blocks of {len(p_sizes)} KV group(s), D "
            f"{decode.engine_id!r} of {len(d_sizes)}: the engines group the model's layers differently"
        ]
    problems = []
    for group, (p_size, d_size) in enumerate(zip(p_sizes, d_sizes)):
        if not p_size and not d_size:
            continue
        if not p_size or not d_size:
            sliding, whole = (producer, decode) if p_size else (decode, producer)
            problems.append(
                f"KV group {group} is a sliding-window group on {sliding.engine_id!r} and keeps every "
                f"block on {whole.engine_id!r}: the engines run different models or configs"
            )
        elif p_size % d_size:
            problems.append(
                f"KV group {group} is a sliding-window group that P {producer.engine_id!r} schedules in "
                f"blocks of {p_size} tokens and D {decode.engine_id!r} in blocks of {d_size}: P's engine "
                f"frees the window's blocks at its own block, so D's blocks (whose size does not "
                f"divide P's) would start where P freed KV and the requests would fail. Give P and D "
                f"the same --block-size (or P a multiple of D's)"
            )
    return problems


HANDSHAKE_SAMPLES = 128
"""Handshake times kept per mode (``PeerRegistry.handshake_ms``): the latest."""


class PeerRegistry:
    """Handshakes and loaded peers of one rank. Loaded state is touched on the writer only."""

    def __init__(
        self,
        *,
        pm: KvpushPluginManager,
        local: AgentMetadata,
        transport: Transport,
        run_on_writer: Callable[[Callable[[], None]], None],
        timeout_s: float,
    ) -> None:
        self._pm = pm
        self._local = local
        self._transport = transport
        self._run_on_writer = run_on_writer
        self._timeout_s = timeout_s
        self._expected_hash = wire.compatibility_hash(local.model, local.layout, local.transport)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpush-handshake")
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, tuple[RankKey, ...], HandshakeMode], Future[PeerEngine]] = {}
        self.engines: dict[str, PeerEngine] = {}
        self._incarnations: dict[str, str] = {}
        """Loaded agent name -> the incarnation its metadata published."""
        self.handshake_ms: dict[str, list[float]] = {m.value: [] for m in HandshakeMode}

    def connected(self, engine_id: str, ranks: Iterable[RankKey]) -> PeerEngine | None:
        engine = self.engines.get(engine_id)
        if engine is not None and all(rank in engine.ranks for rank in ranks):
            engine.last_active = time.monotonic()
            return engine
        return None

    def ensure(
        self,
        engine_id: str,
        host: str,
        port: int,
        ranks: Iterable[RankKey],
        mode: HandshakeMode,
        discover: Callable[[AgentMetadata], Iterable[RankKey]] | None = None,
    ) -> Future[PeerEngine]:
        """A future resolved (on the writer thread) once ``ranks`` of the engine are loaded.

        With ``discover`` (and no ranks), rank (0, 0)'s metadata is fetched first and
        ``discover(it)`` names the ranks to load, so the caller learns the peer's real
        parallel layout from what the peer published, never from a guess."""
        ranks = sorted(set(ranks))
        engine = self.connected(engine_id, ranks) if ranks else None
        if engine is not None and (mode is HandshakeMode.NOTIF_ONLY or engine.mode is HandshakeMode.FULL):
            done: Future[PeerEngine] = Future()
            done.set_result(engine)
            return done
        key = (engine_id, tuple(ranks), mode)
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                return pending
            future: Future[PeerEngine] = Future()
            self._pending[key] = future
        try:
            self._executor.submit(self._fetch, future, key, host, port, mode, discover)
        except RuntimeError as err:  # closed: fail now rather than leave a future nobody resolves
            self._finish(
                key,
                future,
                error=HandshakeError(f"peer registry closed; no handshake with {engine_id!r} ({err})"),
            )
        return future

    def _fetch(
        self,
        future: Future[PeerEngine],
        key: tuple[str, tuple[RankKey, ...], HandshakeMode],
        host: str,
        port: int,
        mode: HandshakeMode,
        discover: Callable[[AgentMetadata], Iterable[RankKey]] | None = None,
    ) -> None:
        engine_id, ranks, _ = key
        started = time.perf_counter()
        refusal = ""
        try:
            fetched = {}
            known: dict[RankKey, AgentMetadata] = {}
            if discover is not None and not ranks:
                first = self._fetch_one(host, port, engine_id, RankKey(0, 0))
                known[first.rank] = first
                ranks = tuple(sorted(set(discover(first))))
            for rank in ranks:
                peer = known.get(rank) or self._fetch_one(host, port, engine_id, rank)
                self._pm.check_peer(self._local, peer, mode)
                alignment = None
                parts: set[tuple[Any, Any]] = set()
                if mode is HandshakeMode.FULL:
                    alignment = self._pm.align_regions(self._local, peer)
                    problems = check_geometry(self._local, peer, alignment)
                    problems += check_window_blocks(self._local, peer)
                    if not problems and self._local.role is Role.PREFILL:
                        problems = producer_slices(self._pm, self._local, peer, parts=parts)[1]
                    if problems:
                        raise HandshakeError(
                            f"engine {engine_id!r} rank {rank} does not fit {self._local.rank}:\n  - "
                            + "\n  - ".join(problems)
                        )
                planned = frozenset(parts) if alignment and self._local.role is Role.PREFILL else None
                fetched[rank] = PeerRank(meta=peer, alignment=alignment, parts=planned)
            if discover is not None and self._local.role is Role.DECODE:
                shares: dict[RankKey, frozenset[tuple[int, Any, Any]]] = {}
                producers = {r: p.meta for r, p in fetched.items()}
                problems = check_producers(self._pm, self._local, producers, shares=shares)
                if problems:
                    # Loaded anyway (the engine comes back with ``refusal`` set): nothing may
                    # register with this mix, but one of its producers may still hold a closing
                    # request's registration and owe D its answer (a staggered restart).
                    refusal = (
                        f"the producers of engine {engine_id!r} that {self._local.rank} waits for "
                        f"would not write each byte of its blocks exactly once:\n  - "
                        + "\n  - ".join(problems)
                    )
                    logger.warning("handshake with %s refused: %s", engine_id, refusal)
                for rank, peer_rank in fetched.items():
                    peer_rank.share = None if refusal else shares.get(rank)
        except Exception as err:
            self._finish(key, future, error=err)
            return
        fetch_ms = (time.perf_counter() - started) * 1e3
        self._run_on_writer(
            lambda: self._load(future, key, host, port, mode, fetched, started, fetch_ms, refusal)
        )

    def _fetch_one(self, host: str, port: int, engine_id: str, rank: RankKey) -> AgentMetadata:
        payload = fetch_metadata(host, port, rank, timeout_s=self._timeout_s, engine_id=engine_id)
        peer = wire.decode_metadata(
            payload, expected_hash=self._expected_hash, source=f"engine {engine_id!r} rank {rank}"
        )
        if peer.engine_id != engine_id:
            raise HandshakeError(
                f"{host_port(host, port)} serves engine {peer.engine_id!r}, but {engine_id!r} was "
                f"expected; check the router's remote_engine_id and port"
            )
        if peer.rank != rank:
            raise HandshakeError(f"asked {engine_id!r} for rank {rank}, got {peer.rank}")
        check_published_hash(peer, self._local)
        refuse_exited(peer)
        return peer

    def _load(
        self,
        future: Future[PeerEngine],
        key: tuple[str, tuple[RankKey, ...], HandshakeMode],
        host: str,
        port: int,
        mode: HandshakeMode,
        fetched: dict[RankKey, PeerRank],
        started: float,
        fetch_ms: float,
        refusal: str = "",
    ) -> None:
        engine_id = key[0]
        latest = tuple(fetched)
        try:
            for peer_rank in fetched.values():
                peer_rank.agent = self._load_agent(peer_rank.meta)
                self._incarnations[peer_rank.agent] = peer_rank.meta.incarnation
        except Exception as err:
            self._finish(key, future, error=err)
            return
        engine = self.engines.get(engine_id)
        if engine is not None and engine.mode is HandshakeMode.FULL and mode is HandshakeMode.NOTIF_ONLY:
            # Never downgrade a fully loaded engine (its descriptor lists are in use).
            fetched = {rank: peer for rank, peer in fetched.items() if rank not in engine.ranks}
        elif engine is None or engine.mode is not mode:
            engine = PeerEngine(engine_id=engine_id, host=host, port=port, mode=mode)
            self.engines[engine_id] = engine
        engine.ranks.update(fetched)
        engine.latest = latest
        engine.refusal = refusal
        engine.handshake_ms = (time.perf_counter() - started) * 1e3
        samples = self.handshake_ms[mode.value]
        samples.append(engine.handshake_ms)
        if len(samples) > 2 * HANDSHAKE_SAMPLES:
            del samples[:-HANDSHAKE_SAMPLES]  # the latest (one per handshake, for the worker's life)
        logger.debug(
            "handshake with %s ranks %s done in %.1f ms (fetch %.1f ms, notif_agents_only=%s)",
            engine_id,
            [str(r) for r in fetched],
            engine.handshake_ms,
            fetch_ms,
            mode is HandshakeMode.NOTIF_ONLY,
        )
        self._finish(key, future, result=engine)

    def _load_agent(self, meta: AgentMetadata) -> str:
        """Load a peer's agent; a peer restarted under a loaded name replaces the stale agent.

        NIXL refuses new metadata under a name it already holds. The side channel serves the
        live peer, so the stale agent (and everything prepared against it) is forgotten and the
        load is tried once more. A load that failed because the peer's process exited after
        its metadata was fetched raises :class:`PeerProcessExited` (a restart, not a failure).
        """
        try:
            return self._transport.load_peer(meta.agent_blob)
        except TransferError as err:
            refuse_exited(meta)  # its process exited since the fetch: nothing to replace
            self._forget_agent(meta.agent_name)
            logger.warning(
                "agent %s of engine %s was loaded from older metadata (%s); replacing it",
                meta.agent_name,
                meta.engine_id,
                err,
            )
            try:
                return self._transport.load_peer(meta.agent_blob)
            except TransferError:
                refuse_exited(meta)
                raise

    def _forget_agent(self, agent: str) -> None:
        """Drop every loaded rank that uses ``agent`` and remove the agent (writer thread)."""
        for engine_id, engine in list(self.engines.items()):
            for rank, peer_rank in list(engine.ranks.items()):
                if peer_rank.agent == agent:
                    del engine.ranks[rank]
            if not engine.ranks:
                del self.engines[engine_id]
        self._incarnations.pop(agent, None)
        self._transport.remove_peer(agent)

    def _finish(
        self,
        key: tuple[str, tuple[RankKey, ...], HandshakeMode],
        future: Future[PeerEngine],
        *,
        result: PeerEngine | None = None,
        error: BaseException | None = None,
    ) -> None:
        engine_id = key[0]
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
        if error is not None:
            if not isinstance(error, KvpushError):
                error = HandshakeError(
                    f"handshake with engine {engine_id!r} failed: {type(error).__name__}: {error}"
                )
            logger.warning("handshake with %s failed: %s", engine_id, error)
            future.set_exception(error)
        else:
            future.set_result(result)

    def remote_list(self, engine: PeerEngine, rank: RankKey, part: tuple[int, int]) -> int:
        """The prepared descriptor list of a peer rank's aligned regions (writer thread)."""
        peer_rank = engine.ranks[rank]
        if engine.mode is not HandshakeMode.FULL or peer_rank.alignment is None:
            raise HandshakeError(
                f"engine {engine.engine_id!r} was loaded notif-only; it has no descriptors to write to"
            )
        handle = peer_rank.remote_lists.get(part)
        if handle is None:
            regions = peer_rank.aligned_regions
            descriptors = region_descriptors(regions, part)
            handle = self._transport.prepare_remote(peer_rank.agent, descriptors, regions[0].mem_type)
            peer_rank.remote_lists[part] = handle
        return handle

    def incarnation_of(self, agent: str) -> str:
        """The incarnation a loaded agent published ("" for an agent not loaded)."""
        return self._incarnations.get(agent, "")

    def remove(self, engine_id: str, tp_ranks: Iterable[int] = ()) -> None:
        """Forget an engine (or only its ``tp_ranks``) and release what was loaded for it
        (writer thread)."""
        engine = self.engines.get(engine_id)
        if engine is None:
            return
        only = set(tp_ranks)
        gone = [rank for rank in engine.ranks if not only or rank.tp_rank in only]
        removed = [engine.ranks.pop(rank) for rank in gone]
        if not engine.ranks:
            del self.engines[engine_id]
        for peer_rank in removed:
            if peer_rank.agent:
                self._incarnations.pop(peer_rank.agent, None)
                self._transport.remove_peer(peer_rank.agent)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------ D's coverage check

MAX_PROBLEMS = 8
"""Problems listed per refused handshake (the first ones; the rest are the same kind)."""


def refuse_exited(meta: AgentMetadata) -> None:
    """Raise :class:`PeerProcessExited` when ``meta`` names a process on this host that has
    exited: a rank killed and not yet published again under its name. Loading it would fail
    (its transport endpoints are gone) or, worse, greet a process that can never answer."""
    identity = meta.extensions.get(PROCESS_KEY)
    if isinstance(identity, Mapping) and has_exited(identity):
        raise PeerProcessExited(
            f"engine {meta.engine_id!r} rank {meta.rank} (agent {meta.agent_name}) is published by "
            f"process {identity.get('pid')}, which has exited: the rank is restarting under its name "
            f"(its side channel serves the new process once it is up) or is gone"
        )


def check_published_hash(peer: AgentMetadata, local: AgentMetadata) -> None:
    """Raise ``HandshakeError`` when the model, layout or transport a peer publishes is not the
    one its compatibility hash stands for here: the publisher computes the hash, so a rank that
    publishes another model under the right hash (mixed builds, a tampered payload) would pass
    the hash check and be counted with the wrong geometry."""
    mine = wire.compatibility_hash(local.model, local.layout, local.transport)
    if wire.compatibility_hash(peer.model, peer.layout, peer.transport) == mine:
        return
    differ = [
        f"{name}: peer {getattr(peer.model, name)!r}, local {getattr(local.model, name)!r}"
        for name in attrs.fields_dict(type(local.model))
        if getattr(peer.model, name) != getattr(local.model, name)
    ]
    differ += [
        f"{name}: peer {getattr(peer, name)!r}, local {getattr(local, name)!r}"
        for name in ("layout", "transport")
        if getattr(peer, name) != getattr(local, name)
    ]
    raise HandshakeError(
        f"engine {peer.engine_id!r} rank {peer.rank} publishes a model that differs from this "
        f"side's under the same compatibility hash ({'; '.join(differ)}); run both engines with "
        f"the same model configuration and kvpush release"
    )


def check_producers(
    pm: KvpushPluginManager,
    local: AgentMetadata,
    producers: Mapping[RankKey, AgentMetadata],
    *,
    shares: dict[RankKey, frozenset[tuple[int, Any, Any]]] | None = None,
) -> list[str]:
    """D's check that the producers it waits for write every byte of its blocks exactly once
    (empty: they do). Run at D's handshake, before any registration, with the hooks P plans by
    (``kvpush_build_read_specs``, ``kvpush_align_regions``) applied to P's published metadata:

    - every producer publishes the same PP/TP sizes, layer count and model;
    - for each P TP rank, the producers' layer windows tile the model's layers (no overlap,
      no gap: a gap is a layer no counted producer writes);
    - every region of this rank is tiled by the producers' head slices, each slice carrying the
      heads this rank holds there (a replicated latent: written whole by replicas of one stage).

    ``shares`` (optional) is filled with each producer's ``(region, slice start, end)`` pieces.
    """
    if not producers:
        return ["no producer to wait for"]
    problems = _same_sizes(local, producers)
    if not problems:
        problems = _layer_windows(producers) or _region_coverage(pm, local, producers, shares)
    return problems[:MAX_PROBLEMS]


def _same_sizes(local: AgentMetadata, producers: Mapping[RankKey, AgentMetadata]) -> list[str]:
    ranks = sorted(producers)
    first = producers[ranks[0]]
    problems = []
    for rank in ranks[1:]:
        meta = producers[rank]
        for name in ("pp_size", "tp_size", "num_layers"):
            mine, theirs = getattr(first.parallel, name), getattr(meta.parallel, name)
            if mine != theirs:
                problems.append(
                    f"P rank {rank} publishes {name}={theirs} but rank {ranks[0]} publishes "
                    f"{name}={mine}; every rank of one engine must publish the same parallel sizes"
                )
    for rank in ranks:
        model = producers[rank].model
        for name in attrs.fields_dict(type(model)):
            theirs, mine = getattr(model, name), getattr(local.model, name)
            if theirs != mine:
                problems.append(
                    f"P rank {rank} publishes model {name}={theirs!r}, this rank runs "
                    f"{name}={mine!r}; both engines must run the same model"
                )
    return problems


def _layer_windows(producers: Mapping[RankKey, AgentMetadata]) -> list[str]:
    problems = []
    by_tp: dict[int, list[RankKey]] = {}
    for rank in sorted(producers):
        by_tp.setdefault(rank.tp_rank, []).append(rank)
    for tp, ranks in sorted(by_tp.items()):
        windows = sorted(
            (producers[r].parallel.start_layer, producers[r].parallel.end_layer, r) for r in ranks
        )
        layers = producers[ranks[0]].parallel.num_layers
        cursor, before = 0, None
        for start, end, rank in windows:
            if start < cursor:
                problems.append(
                    f"P ranks {before} and {rank} publish layer windows that overlap on layers "
                    f"{start}-{min(end, cursor) - 1}: two producers would write them"
                )
            elif start > cursor:
                problems.append(
                    f"a gap: layers {cursor}-{start - 1} are owned by none of the producers this "
                    f"rank waits for from P TP rank {tp} (stages {[r.pp_rank for r in ranks]}); "
                    f"they would never be written"
                )
            cursor, before = max(cursor, end), rank
        if cursor < layers:
            problems.append(
                f"a gap: layers {cursor}-{layers - 1} are owned by none of the producers this rank "
                f"waits for from P TP rank {tp} (stages {[r.pp_rank for r in ranks]}); they would "
                f"never be written"
            )
    return problems


Piece = tuple[Any, Any, RankKey]
"""``(start, end, producer)``: the fraction of each block of a decode region a producer writes."""


def producer_slices(
    pm: KvpushPluginManager,
    producer: AgentMetadata,
    decode: AgentMetadata,
    parts: set[tuple[Any, Any]] | None = None,
) -> tuple[dict[int, list[Piece]], list[str]]:
    """What one producer's plan (the read-spec and alignment hooks, as P runs them) writes
    into one decode rank: per decode region, the block fractions it covers; and the problems
    with that plan (a plugin error, two regions paired with one, a slice carrying other heads
    than the decode rank holds there: head ``h`` of the model is head ``h - tp_rank x heads``
    of the rank holding it). Block ids do not change what is written where in a block."""
    from fractions import Fraction

    from kvpush.core.types import PushJob

    rank, me = producer.rank, decode.parallel
    # Distinct ids on the two sides, so a read-spec plugin that swaps or edits them is refused
    # here (kvpush.core.manager checks a plan's ids against the job's) and not at a request.
    groups = max([producer.model.num_groups, *(r.kv_group + 1 for r in producer.regions)])
    job = PushJob(
        local=producer,
        decode_tp_size=me.tp_size,
        local_block_ids=tuple((0,) for _ in range(groups)),
        remote_block_ids=tuple((1,) for _ in range(groups)),
    )
    try:
        specs = [s for s in pm.build_read_specs(job) if s.dst_tp_rank == me.tp_rank]
        alignment = pm.align_regions(producer, decode)
    except KvpushError as err:
        return {}, [f"P rank {rank} cannot be planned against D rank {me.tp_rank}: {err}"]
    problems = check_geometry(producer, decode, alignment)
    seen: dict[int, int] = {}
    for i, j in enumerate(alignment.remote_indices):
        mine, theirs = producer.regions[i], decode.regions[j]
        if j in seen:
            problems.append(
                f"P rank {rank}'s alignment ({alignment.source}) pairs its regions {seen[j]} and "
                f"{i} with D region {j} ({_name(theirs)}): an overlap"
            )
        elif (mine.layer_names, mine.component) != (theirs.layer_names, theirs.component):
            problems.append(
                f"P rank {rank}'s alignment ({alignment.source}) pairs its {_name(mine)} with D's "
                f"{_name(theirs)}: the wrong layer"
            )
        seen[j] = i
    problems += _heads_per_rank(producer) + _heads_per_rank(decode)
    pieces: dict[int, list[Piece]] = {}
    wrong: list[str] = []
    for spec in specs:
        (li, lc), (ri, rc) = spec.local_part, spec.remote_part
        if parts is not None:
            parts.add((tuple(spec.local_part), tuple(spec.remote_part)))
        for i, j in enumerate(alignment.remote_indices):
            mine, theirs = producer.regions[i], decode.regions[j]
            try:
                cut = slice_rows(mine, spec.local_part, per_token=True)
                into = slice_rows(theirs, spec.remote_part, per_token=True)
            except KvpushError as err:
                wrong.append(str(err))
                continue
            if (cut.rows, cut.size) != (into.rows, into.size):
                wrong.append(
                    f"{cut.rows} x {cut.size} B of its {_name(mine)} into {into.rows} x {into.size} B "
                    f"of {_name(theirs)} (a WRITE's two sides must be equally long)"
                )
            if not (mine.replicate or theirs.replicate):
                src = rank.tp_rank * mine.num_heads + Fraction(li * mine.num_heads, lc)
                dst = me.tp_rank * theirs.num_heads + Fraction(ri * theirs.num_heads, rc)
                # The heads this producer holds of the ones this decode rank holds: its share,
                # which nobody else writes (one spec per decode rank).
                lo = max(rank.tp_rank * mine.num_heads, me.tp_rank * theirs.num_heads)
                hi = min((rank.tp_rank + 1) * mine.num_heads, (me.tp_rank + 1) * theirs.num_heads)
                if src != dst:
                    wrong.append(
                        f"model head {float(src):g} into model head {float(dst):g} of {_name(theirs)}"
                    )
                elif (src, src + Fraction(mine.num_heads, lc)) != (lo, hi):
                    wrong.append(
                        f"model heads [{float(src):g}, {float(src + Fraction(mine.num_heads, lc)):g}) of "
                        f"{_name(theirs)}, but the heads both ranks hold are [{lo}, {hi}): the rest of "
                        f"them would be written by no producer"
                    )
            elif (lc, rc) != (1, 1):
                wrong.append(f"part {spec.local_part} into {spec.remote_part} of replicated {_name(theirs)}")
            pieces.setdefault(j, []).append((Fraction(ri, rc), Fraction(ri + 1, rc), rank))
    if wrong:
        more = f" (and {len(wrong) - 1} more slices)" if len(wrong) > 1 else ""
        problems.append(f"P rank {rank}'s read specs write the wrong heads: {wrong[0]}{more}")
    return pieces, problems


def _heads_per_rank(meta: AgentMetadata) -> list[str]:
    """A head-split region must hold the model's KV heads over the rank's TP size."""
    want = meta.model.num_kv_heads / meta.parallel.tp_size
    for region in meta.regions:
        if not region.replicate and region.num_heads != want:
            return [
                f"{meta.engine_id!r} rank {meta.rank}'s {_name(region)} holds {region.num_heads} "
                f"head(s), but num_kv_heads {meta.model.num_kv_heads} over its published tp_size "
                f"{meta.parallel.tp_size} is {want:g} heads per rank: its head slices would land "
                f"on the wrong heads"
            ]
    return []


def _region_coverage(
    pm: KvpushPluginManager,
    local: AgentMetadata,
    producers: Mapping[RankKey, AgentMetadata],
    shares: dict[RankKey, frozenset[tuple[int, Any, Any]]] | None = None,
) -> list[str]:
    from fractions import Fraction

    problems: list[str] = []
    pieces: dict[int, list[Piece]] = {}
    unplanned = False
    for rank in sorted(producers):
        mine, found = producer_slices(pm, producers[rank], local)
        problems += found
        unplanned = unplanned or (not mine and bool(found))
        if not mine and not found:
            problems.append(
                f"P rank {rank} is a producer this rank waits for, but its read specs write no "
                f"part of this rank (an extra producer: it would never write, or be counted wrongly)"
            )
        for j, parts in mine.items():
            pieces.setdefault(j, []).extend(parts)
        if shares is not None:  # what the producer's packed DONEs must name (D's check)
            shares[rank] = frozenset((j, start, end) for j, parts in mine.items() for start, end, _ in parts)
    if unplanned:
        return problems  # a producer with no plan: every region would read as a gap
    for j, region in enumerate(local.regions):
        parts = sorted(pieces.get(j, []))
        if region.replicate and parts and all(p[:2] == (0, 1) for p in parts):
            if len({p[2].pp_rank for p in parts}) > 1:
                problems.append(
                    f"{_name(region)} is written whole by several stages {[p[2] for p in parts]}: an overlap"
                )
            continue
        cursor: Fraction = Fraction(0)
        for start, end, rank in parts:
            if start < cursor:
                problems.append(
                    f"{_name(region)}: {rank} writes heads {_heads(region, start, end)} that "
                    f"another producer writes too: an overlap"
                )
            elif start > cursor:
                problems.append(
                    f"{_name(region)}: heads {_heads(region, cursor, start)} written by no producer: a gap"
                )
            cursor = max(cursor, end)
        if cursor < 1:
            problems.append(
                f"{_name(region)}: heads {_heads(region, cursor, Fraction(1))} written by no producer: a gap"
            )
    return problems


def _name(region: KVRegion) -> str:
    return f"region {', '.join(region.layer_names)} {region.component}"


def _heads(region: KVRegion, start: Any, end: Any) -> str:
    return (
        f"[{float(start * region.num_heads):g}, {float(end * region.num_heads):g}) of its {region.num_heads}"
    )
