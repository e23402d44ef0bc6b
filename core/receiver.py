"""The D side's driver: feeds a :class:`~kvpush.core.decode_core.DecodeCore` and executes its actions.

The protocol (producer sets from P's published config, PUSH_REG, identity checks on every
DONE/FAIL/CANCEL_ACK, quarantine of failed requests' blocks, heartbeats and freshness grants)
lives in the pure core. This driver owns the transport, the writer thread, the handshakes and
the staging area, and reports results to the engine:

- ``done``: the KV of every expected producer landed (and was scattered, when packed);
- ``failed``: the request cannot complete (reported at once, with the reason);
- ``cancelled``: :meth:`PushReceiver.cancel` settled;
- ``released``: a failed or cancelled request's blocks may be reused — no WRITE into them can
  land any more. Free a failed request's blocks only when its id appears here.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import attrs

from kvpush.core.actions import (
    Connect,
    DropPeer,
    Fence,
    FreeStaging,
    ProbeExit,
    Release,
    Report,
    Scatter,
    Send,
)
from kvpush.core.block_claims import BlockClaims
from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
from kvpush.core.ended_workers import ENDED_KEY
from kvpush.core.errors import ConfigError, HandshakeError, PeerProcessExited, WaitTimeout
from kvpush.core.notifications import MAX_ID_CHARS
from kvpush.core.peers import PeerEngine
from kvpush.core.process_identity import has_exited, may_be_this_host
from kvpush.core.types import (
    AgentMetadata,
    BlockIdsLike,
    Notification,
    RankKey,
    RequestMetadata,
    Role,
    TransferParams,
    read_only,
)
from kvpush.core.wire import RESERVED_REQUEST_IDS
from kvpush.core.worker import (
    ANSWER_ATTEMPTS_KEY,
    BLOCK_PAIRING,
    BLOCK_PAIRING_KEY,
    PROCESS_KEY,
    RESULT_ATTEMPTS_KEY,
    UNREGISTERED_CANCELS_KEY,
    WRITE_DEADLINE_KEY,
    WRITES_ABORTABLE_KEY,
    RankWorker,
    keep_for_process_life,
    lease_clock,
)

logger = logging.getLogger(__name__)

ID_MEMORY = 65536
"""How many request ids a D rank remembers having registered: a reused one is registered under a
fresh alias (``rid#n``), so that a late or duplicated DONE of its earlier registration, which
names the plain id, cannot complete the new one."""
ALIAS_CHARS = 24
"""Characters an alias may add to a request id (``#`` and a serial)."""

FENCE_WARN_S = 1.0
"""A fence the transport has not confirmed is logged this often (its blocks stay held)."""


@attrs.define(eq=False)
class _PendingFence:
    action: Fence
    started_at: float
    warned_at: float = attrs.field()

    @warned_at.default
    def _warned_at(self) -> float:
        return self.started_at


@attrs.frozen
class ReceiveResults:
    """What :meth:`PushReceiver.get_finished` returns since its last call (immutable)."""

    done: tuple[str, ...]
    failed: Mapping[str, str] = attrs.field(hash=False, converter=read_only)
    """Request id -> why it failed (read-only); free its blocks once it is in ``released``."""
    cancelled: Mapping[str, str] = attrs.field(factory=dict, hash=False, converter=read_only)
    """Requests cancelled with :meth:`PushReceiver.cancel`; their blocks may be freed now."""
    released: tuple[str, ...] = ()
    """Failed or cancelled requests whose blocks may be reused now (no WRITE can land)."""
    completed_at: Mapping[str, float] = attrs.field(factory=dict, hash=False, converter=read_only)
    """``time.perf_counter()`` when each done request completed (for latency figures)."""


class PushReceiver(RankWorker):
    """One D rank (a TP rank of a non-PP decode engine)."""

    role = Role.DECODE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core: DecodeCore | None = None
        self._results_ready = threading.Condition(self._results_lock)
        self._active: set[str] = set()
        """Request ids added and not yet done or released (a second add is refused)."""
        self._claims: BlockClaims | None = None
        """The blocks of the requests in ``_active`` (an add naming one of them is refused)."""
        self._used_ids: OrderedDict[str, None] = OrderedDict()
        """Request ids registered on this rank, most recent last (at most ``ID_MEMORY``)."""
        self._alias_of: dict[str, str] = {}
        """Engine request id -> the id its latest registration carries (reused ids only)."""
        self._engine_id_of: OrderedDict[str, str] = OrderedDict()
        """Alias -> the engine's request id (the core and the wire know only aliases)."""
        self._live: dict[str, str] = {}
        """Core id -> engine id of every request the core holds (added, not yet done or
        released). Never trimmed: the memories above are, oldest first, and a request in
        progress may outlive ``ID_MEMORY`` later ones (held for a P's copies, a long prefill):
        its alias must still map back, and no alias may take its id."""
        self._aliases = itertools.count(1)
        self._done: list[str] = []
        self._completed_at: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        self._cancelled: dict[str, str] = {}
        self._released: list[str] = []
        self._uncollected: set[str] = set()
        """Engine ids named in results ``get_finished()`` has not returned yet: an add of one is
        refused (its results name only the id, and would be read as the new request's)."""
        self._fences: dict[int, _PendingFence] = {}
        """Fences the transport has not confirmed yet (checked every writer step)."""

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.core.stats) if self.core is not None else {}

    def _make_core(self) -> None:
        from kvpush.core.addresses import advertised_host

        cfg = self.config
        self.core = DecodeCore(
            DecodeSettings(
                engine_id=cfg.engine_id,
                incarnation=self.incarnation,
                tp_rank=cfg.parallel.tp_rank,
                tp_size=cfg.parallel.tp_size,
                host=advertised_host(
                    cfg.side_channel_host,
                    advertise_host=cfg.side_channel_advertise_host,
                    interface=cfg.network_interface,
                ),
                port=cfg.side_channel_port,
                request_timeout_s=cfg.request_timeout_s,
                heartbeat_interval_s=cfg.heartbeat_s,
                peer_silence_s=cfg.silence_s,
                fresh_s=cfg.freshness_s,
                hello_timeout_s=cfg.handshake_timeout_s,
                early_ttl_s=cfg.early_notification_ttl_s,
                keepalive_s=cfg.keepalive_s,
            ),
            reserve_staging=self._reserve_staging if self.staging is not None else None,
        )

    # ------------------------------------------------------------------ engine API

    def add_request(self, request: RequestMetadata) -> None:
        """Start receiving ``request``: handshake with P if needed, then send ``PUSH_REG``.

        A request with no blocks (a full prefix hit) is done at once. Raises ``ConfigError``
        naming the argument for an empty or non-string id, an id already in progress, an id
        whose earlier request's results ``get_finished()`` has not returned yet, negative,
        repeated or out-of-range block ids, block ids another request on this rank still holds
        (not yet done, or failed/cancelled and not yet released), a missing match key, an
        advertised address P could not reach, a worker that is not running or is closing
        (``close()`` began on another thread: nothing was sent, the blocks are the engine's), or
        a ``kv_caches`` tensor replaced since ``start()`` (naming it: restart the worker with the
        new caches)."""
        self._check_accepting("add_request")
        self._check_caches("add_request")
        if not isinstance(request, RequestMetadata):
            raise ConfigError(f"add_request needs a RequestMetadata, got {type(request).__name__}")
        rid = request.request_id
        if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_CHARS - ALIAS_CHARS:
            raise ConfigError(
                f"request_id must be a non-empty string of at most {MAX_ID_CHARS - ALIAS_CHARS} "
                f"chars, got {rid!r:.80}"
            )
        self._check_blocks(rid, request.block_ids, "block_ids")
        self._check_start(request)
        request.params.match_key  # raises ConfigError naming the missing fields  # noqa: B018
        self._check_advertised(request.params)  # a loopback address for a remote P is refused
        with self._results_lock:
            # Checked again under the lock close() sets _closing under: an add that got here
            # first is in _active when close() fails what is pending; a later one is refused
            # (else P would be registered with a request no one cancels, or it would be queued
            # to a writer that is gone: never reported, its blocks claimed for ever).
            self._check_accepting("add_request")
            if rid in self._active:
                raise ConfigError(f"request_id {rid!r} is already being received on this rank")
            if rid in self._uncollected:
                raise ConfigError(
                    f"request_id {rid!r} has results on this rank that get_finished() has not "
                    f"returned yet (an earlier request of that id: done, failed, cancelled or "
                    f"released); results name only the id, so they would be read as this "
                    f"request's. Call get_finished() first, then add it again"
                )
            if not any(request.block_ids):
                self._uncollected.add(rid)
                self._done.append(rid)
                self._completed_at[rid] = time.perf_counter()
                self._results_ready.notify_all()
                return
            if self._claims is None:
                assert self.metadata is not None
                self._claims = BlockClaims.for_regions(self.metadata.regions)
            self._claims.claim(rid, request.block_ids)  # ConfigError: blocks another request holds
            self._active.add(rid)
            request = self._registered_as(request)
            self._live[request.request_id] = rid
            # Queued under the lock: a cancel of this id from another thread (which resolves
            # the id under it too) is queued after the add, never before it (and lost).
            self.run_on_writer(lambda: self._add_guarded(request))

    def _check_start(self, request: RequestMetadata) -> None:
        """``block_start`` names one start per KV group of ``block_ids``; with ``num_tokens`` too,
        a one-group request's blocks must end at the prompt's last block (``ConfigError`` naming
        both lengths otherwise: P would fill the wrong blocks, or D would miss some)."""
        start, blocks, tokens = request.block_start, request.block_ids, request.num_tokens
        if start is None:
            return
        if len(start) != len(blocks):
            raise ConfigError(
                f"block_start of {request.request_id!r} gives {len(start)} start(s), block_ids "
                f"{len(blocks)} KV group(s): pass one start per group (an int for one group)"
            )
        if tokens is None or len(blocks) != 1:
            return  # several groups: windows (sliding-window groups) end where P's do
        size = self.config.model.block_size
        need = -(-tokens // size)
        if start[0] + len(blocks[0]) != need:
            raise ConfigError(
                f"block_ids of {request.request_id!r} are blocks {start[0]} to "
                f"{start[0] + len(blocks[0]) - 1} of the prompt (block_start={start[0]}, "
                f"{len(blocks[0])} blocks), but its num_tokens={tokens} tokens take blocks 0 to "
                f"{need - 1} of {size} tokens: register the blocks from block_start to the one "
                f"holding the prompt's last token"
            )

    def _registered_as(self, request: RequestMetadata) -> RequestMetadata:
        """``request`` under the id its registration carries: its own the first time, a fresh
        alias when the engine reuses the id (caller holds the results lock)."""
        rid = request.request_id
        used = rid in self._used_ids or rid in self._engine_id_of or rid in self._live  # or an alias
        used = used or rid in RESERVED_REQUEST_IDS  # "(hello)": a FAIL naming it is P's refusal
        self._used_ids[rid] = None
        self._used_ids.move_to_end(rid)
        if len(self._used_ids) > ID_MEMORY:
            forgotten, _ = self._used_ids.popitem(last=False)
            if self._alias_of.get(forgotten) not in self._live:
                # Forgotten with the id (a live alias stays until its request ends: _ended).
                # Kept, it grew by every id ever reused, and a late cancel of the id named its
                # old alias, which may by then be another request's own id.
                self._alias_of.pop(forgotten, None)
        if not used:
            self._alias_of.pop(rid, None)
            return request
        alias = f"{rid}#{next(self._aliases)}"
        while alias in self._used_ids or alias in self._engine_id_of or alias in self._live:
            alias = f"{rid}#{next(self._aliases)}"
        self._alias_of[rid] = alias
        self._engine_id_of[alias] = rid
        if len(self._engine_id_of) > ID_MEMORY:
            self._engine_id_of.popitem(last=False)
        return attrs.evolve(request, request_id=alias)

    def _core_id(self, rid: str) -> str:
        """The id the core knows the engine's request ``rid`` by."""
        with self._results_lock:
            return self._alias_of.get(rid, rid)

    def _engine_id(self, core_id: str) -> str:
        """The engine's request id for an id of the core (an alias maps back)."""
        live = self._live.get(core_id)
        return live if live is not None else self._engine_id_of.get(core_id, core_id)

    def _ended(self, core_id: str) -> str:
        """``core_id`` is done or released: it leaves ``_live``; its alias stays the newest
        remembered (a cancelled report follows its release). Returns the engine's id."""
        rid = self._engine_id(core_id)
        self._live.pop(core_id, None)
        if core_id != rid and rid not in self._used_ids and self._alias_of.get(rid) == core_id:
            del self._alias_of[rid]  # its id was forgotten while it ran
        if core_id != rid:
            self._engine_id_of[core_id] = rid
            self._engine_id_of.move_to_end(core_id)
            if len(self._engine_id_of) > ID_MEMORY:
                self._engine_id_of.popitem(last=False)
        return rid

    def add_request_params(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        kv_transfer_params: Mapping[str, Any],
        *,
        block_start: int | Sequence[int] | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """:meth:`add_request` from a router's ``kv_transfer_params`` dict (vLLM field names).

        ``block_start``: where ``block_ids`` start in the request's blocks (per KV group; an
        int for one group): the number of blocks of D's prefix-cache hit it skipped, 0 with no
        hit. ``num_tokens``: the prompt's length. Both are D's own facts, sent to P, which pairs
        its blocks by them and fails the request rather than guess (``RequestMetadata``)."""
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {request_id!r}")
        self.add_request(
            RequestMetadata(
                request_id=request_id,
                block_ids=block_ids,
                params=TransferParams.from_dict(kv_transfer_params),
                block_start=block_start,
                num_tokens=num_tokens,
            )
        )

    def cancel(self, request_id: str) -> None:
        """Abort ``request_id`` (the engine wants to free its blocks).

        P is told (``CANCEL``) never to write into the blocks; the request is reported in
        ``get_finished().cancelled`` (and ``released``) once no WRITE can land any more: when
        every producer that may write has acknowledged, or once the freshness window and P's
        WRITE deadline have passed and P's connection was dropped. Free the blocks only then.
        A request already done is not affected."""
        self._check_running("cancel")
        with self._results_lock:  # ordered with the add it cancels (see add_request)
            core_id = self._alias_of.get(request_id, request_id)
            self.run_on_writer(lambda: self._guarded(core_id, lambda now: self.core.cancel(core_id, now)))

    def get_finished(self) -> ReceiveResults:
        """Requests done, failed, cancelled and released since the last call."""
        with self._results_lock:
            done, self._done = tuple(self._done), []
            completed = {rid: self._completed_at.pop(rid) for rid in done if rid in self._completed_at}
            failed, self._failed = self._failed, {}
            cancelled, self._cancelled = self._cancelled, {}
            released, self._released = tuple(self._released), []
            self._uncollected.clear()
        return ReceiveResults(
            done=done, failed=failed, cancelled=cancelled, released=released, completed_at=completed
        )

    def wait_finished(self, timeout_s: float) -> ReceiveResults:
        """Block until something finished, failed, was cancelled or released, at most
        ``timeout_s``; raises ``WaitTimeout`` naming the requests still pending."""
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not timeout_s <= threading.TIMEOUT_MAX  # NaN and +inf too: no bound
        ):
            raise ConfigError(
                f"wait_finished(timeout_s={timeout_s!r}): give a finite number of seconds "
                f"(at most {threading.TIMEOUT_MAX:g}; 0 or less: check once without waiting)"
            )
        with self._results_ready:
            if not self._results_ready.wait_for(
                lambda: self._done or self._failed or self._cancelled or self._released, timeout_s
            ):
                raise WaitTimeout(
                    f"no request finished on {self.agent_name} within {timeout_s}s; pending: "
                    f"{sorted(self._active)[:10]}"
                )
        return self.get_finished()

    @property
    def pending_requests(self) -> int:
        with self._results_lock:
            return len(self._active)

    def _check_advertised(self, params: TransferParams) -> None:
        from kvpush.core.addresses import advertise_for_config

        advertise_for_config(self.config, params.remote_host)

    # ------------------------------------------------------------------ feeding the core

    def _guarded(self, rid: str, event: Any) -> None:
        """Run one core event and its actions; an exception fails ``rid`` only."""
        now = lease_clock()
        try:
            actions = event(now)
        except Exception as err:
            logger.exception("handling an event of %s failed", rid)
            actions = self._fail_safely(rid, err, now)
        self._execute(actions)

    def _add_guarded(self, request: RequestMetadata) -> None:
        """Hand ``request`` to the core; an error fails it only. One that struck before the core
        recorded it (nothing was sent for it) is reported failed and released here, or the
        engine would never hear of it and its blocks stay claimed."""
        assert self.core is not None
        rid, now = request.request_id, lease_clock()
        try:
            actions = self.core.add(request, now)
        except Exception as err:
            logger.exception("adding %s failed", rid)
            actions = self._fail_safely(rid, err, now)
            if not self.core.holds(rid):
                reason = f"internal error: {type(err).__name__}: {err}; nothing was sent for it"
                actions = [*actions, Report(rid, "failed", reason), Release(rid)]
        self._execute(actions)

    def _fail_safely(self, rid: str, err: Exception, now: float) -> list[Any]:
        assert self.core is not None
        try:
            return self.core.fail(rid, f"internal error: {type(err).__name__}: {err}", now)
        except Exception:
            logger.exception("failing %s after an internal error failed too", rid)
            return []

    def _on_notification(self, peer: str, notification: Notification) -> None:
        now = lease_clock()
        try:
            actions = self.core.notification(peer, notification, now)
        except Exception as err:
            logger.exception("handling a %s from %s failed", notification.kind.value, peer)
            actions = self._fail_safely(notification.request_id, err, now) if notification.request_id else []
        self._execute(actions)

    def _execute(self, actions: Sequence[Any]) -> None:
        for action in actions:
            try:
                self._run(action)
            except Exception as err:
                logger.exception("action %s failed", type(action).__name__)
                rid = getattr(action, "request_id", None)
                if rid:
                    self._execute(self._fail_safely(rid, err, lease_clock()))

    def _run(self, action: Any) -> None:
        assert self.core is not None and self.peers is not None
        if isinstance(action, Send):
            error = self._send(action.agent, action.message)
            if error:
                self._execute(self.core.unreachable(action.agent, error, lease_clock()))
        elif isinstance(action, Report):
            self._report(action)
        elif isinstance(action, Release):
            with self._results_ready:
                rid = self._ended(action.request_id)
                self._released.append(rid)
                self._uncollected.add(rid)
                self._active.discard(rid)
                if self._claims is not None:
                    self._claims.release(rid)
                self._results_ready.notify_all()
        elif isinstance(action, Scatter):
            self._scatter(action)
        elif isinstance(action, FreeStaging):
            self.staging.free(action.offset)
        elif isinstance(action, Connect):
            self._connect(action)
        elif isinstance(action, DropPeer):
            logger.info("dropping P engine %s: %s", action.engine_id, action.reason)
            self.peers.remove(action.engine_id)
        elif isinstance(action, Fence):
            self._fence(action)
        elif isinstance(action, ProbeExit):
            exited = [agent for agent, identity in action.processes if has_exited(identity)]
            if exited:
                self._execute(self.core.producers_exited(action.request_id, exited, lease_clock()))
        else:
            raise TypeError(f"unknown action {action!r}")

    def _report(self, report: Report) -> None:
        with self._results_ready:
            done = report.outcome == "done"
            rid = self._ended(report.request_id) if done else self._engine_id(report.request_id)
            self._uncollected.add(rid)
            if done:
                self._done.append(rid)
                self._completed_at[rid] = time.perf_counter()
                self._active.discard(rid)
                if self._claims is not None:
                    self._claims.release(rid)
            elif report.outcome == "cancelled":
                self._cancelled[rid] = report.reason
            else:
                self._failed[rid] = report.reason
            self._results_ready.notify_all()

    # ------------------------------------------------------------------ handshakes

    def _connect(self, action: Connect) -> None:
        assert self.peers is not None and self.core is not None
        me = self.config.parallel

        def discover(first: AgentMetadata) -> list[RankKey]:
            return sorted(self.pm.expected_producers(first.parallel, me.tp_rank, me.tp_size))

        try:
            mode = self.pm.handshake_mode(Role.DECODE, Role.PREFILL)
        except Exception as err:  # a plugin's error: the engine's requests fail now, naming it
            self._execute(self.core.connected(action.engine_id, None, str(err), lease_clock()))
            return
        future = self.peers.ensure(action.engine_id, action.host, action.port, (), mode, discover=discover)
        future.add_done_callback(lambda f: self.run_on_writer(lambda: self._connected(action, f)))

    def _connected(self, action: Connect, future: Future[PeerEngine]) -> None:
        assert self.core is not None
        error = future.exception()
        info = None
        refusal = ""
        if error is None:
            try:
                engine = future.result()
                info = self._producer_info(engine)
                refusal = engine.refusal  # loaded, but no producer set to register with
            except Exception as err:
                error = err
        why = refusal if error is None else str(error)
        exited = isinstance(error, PeerProcessExited)
        self._execute(self.core.connected(action.engine_id, info, why, lease_clock(), exited=exited))

    def _producer_info(self, engine: PeerEngine) -> ProducerInfo:
        me = self.config.parallel
        if not engine.latest:
            raise HandshakeError(f"P engine {engine.engine_id!r}: the handshake loaded no rank")
        # Only the ranks this handshake fetched were checked (``check_producers``): an earlier
        # handshake's ranks (another layout, a refused mix) stay loaded but never count.
        first = engine.ranks[engine.latest[0]].meta
        wanted = self.pm.expected_producers(first.parallel, me.tp_rank, me.tp_size)
        missing = sorted(set(wanted) - set(engine.latest))
        if missing:
            raise HandshakeError(f"P engine {engine.engine_id!r}: producers {missing} were not loaded")
        # The request waits for every producer: each one's own WRITE deadline and word on
        # whether a fence stops its WRITEs count (one stage may copy with kernels, another not).
        deadlines = [engine.ranks[r].meta.extensions.get(WRITE_DEADLINE_KEY) for r in wanted]
        if not all(isinstance(d, (int, float)) and d > 0 for d in deadlines):
            raise HandshakeError(
                f"P engine {engine.engine_id!r} publishes no WRITE deadline ({WRITE_DEADLINE_KEY!r}); "
                f"run the same kvpush release on both sides"
            )
        deadline = max(deadlines)
        claims = [engine.ranks[r].meta.extensions.get(WRITES_ABORTABLE_KEY) for r in wanted]
        said = {WRITES_ABORTABLE_KEY: all(claim is True for claim in claims)}
        unpaired = sorted(
            str(r) for r in wanted if engine.ranks[r].meta.extensions.get(BLOCK_PAIRING_KEY) != BLOCK_PAIRING
        )
        if unpaired:
            raise HandshakeError(
                f"P engine {engine.engine_id!r} rank(s) {', '.join(unpaired)} do not state that they pair "
                f"blocks by the start D states ({BLOCK_PAIRING_KEY!r}: {BLOCK_PAIRING!r}): an older kvpush "
                f"release pairs from the end of its block table and ignores D's block_start, so a P "
                f"table longer than the prompt or a D prefix hit would put another position's KV in "
                f"D's blocks. Run the same kvpush release on both sides"
            )
        processes = {
            engine.ranks[r].agent: identity
            for r in wanted
            if isinstance(identity := engine.ranks[r].meta.extensions.get(PROCESS_KEY), Mapping)
        }
        agents = [engine.ranks[r].agent for r in wanted]
        return ProducerInfo(
            prefill_pp=first.parallel.pp_size,
            prefill_tp=first.parallel.tp_size,
            agents={r: engine.ranks[r].agent for r in wanted},
            incarnations={engine.ranks[r].agent: engine.ranks[r].meta.incarnation for r in wanted},
            write_deadline_s=float(deadline),
            writes_abortable=self._writes_abortable(said, agents, processes),
            processes=processes,
            shares={r: share for r in wanted if (share := engine.ranks[r].share)},
            echo_attempts=frozenset(
                engine.ranks[r].agent
                for r in wanted
                if engine.ranks[r].meta.extensions.get(RESULT_ATTEMPTS_KEY) is True
            ),
            answer_attempts=frozenset(
                engine.ranks[r].agent
                for r in wanted
                if engine.ranks[r].meta.extensions.get(ANSWER_ATTEMPTS_KEY) is True
            ),
            unregistered_cancels=frozenset(
                engine.ranks[r].agent
                for r in wanted
                if engine.ranks[r].meta.extensions.get(UNREGISTERED_CANCELS_KEY) is True
            ),
            ended={
                engine.ranks[r].agent: dict(ended)
                for r in wanted
                if isinstance(ended := engine.ranks[r].meta.extensions.get(ENDED_KEY), Mapping)
            },
        )

    def _writes_abortable(
        self, extensions: Mapping[str, Any], agents: Iterable[str], processes: Mapping[str, Any]
    ) -> bool:
        """Whether a fence stops every WRITE of these producers. No when one of them may copy
        into this process's memory by itself: a process on this host, where this rank's
        transport takes same-host copies (NIXL over UCX shared memory or CMA: P's process
        writes, no connection carries it). Else yes when P says so, or when this rank's
        transport can tell none of its agents may copy in. Otherwise (P says no, or does not
        say) its failed requests' blocks are held until it acknowledges or its process exited,
        never released on a fence alone."""
        agents = list(agents)
        same_host = (may_be_this_host(processes.get(agent, {}).get("host")) for agent in agents)
        if bool(getattr(self.transport, "same_host_copies", True)) and any(same_host):
            return False
        if extensions.get(WRITES_ABORTABLE_KEY) is True:
            return True
        may_copy_in = getattr(self.transport, "may_copy_in", None)
        return may_copy_in is not None and not any(may_copy_in(agent) for agent in agents)

    # ------------------------------------------------------------------ packed strategy

    def _reserve_staging(self, request: RequestMetadata) -> int:
        """Reserve the request's packed bytes in the staging area; -1 when packing is off or
        the area is full (P then writes directly into the blocks)."""
        from kvpush.core.packing import staging_layout

        assert self.metadata is not None
        _, total = staging_layout(self.metadata.regions, request.block_ids)
        offset = self.staging.alloc(total)
        return -1 if offset is None else offset

    def _scatter(self, action: Scatter) -> None:
        from kvpush.core.packing import unpack

        assert self.core is not None and self.metadata is not None
        manifest = action.manifest
        error = ""
        try:
            unpack(self.packer, self.staging, self.metadata.regions, action.block_ids, manifest)
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        self._execute(
            self.core.scattered(
                action.request_id, action.producer, manifest.chunk, manifest.chunks, error, lease_clock()
            )
        )

    # ------------------------------------------------------------------ fences

    def _fence(self, action: Fence) -> None:
        """Remove the agents and shut every connection that carries their data; the blocks
        waiting on the fence are released once the transport confirms it (:meth:`_poll`)."""
        assert self.peers is not None and self.transport is not None
        logger.warning(
            "fencing P engine %s (agents %s): %s", action.engine_id, list(action.agents), action.reason
        )
        loaded = self.peers.engines.get(action.engine_id)
        if loaded is not None and {r.agent for r in loaded.ranks.values()} & set(action.agents):
            self.peers.remove(action.engine_id)  # the core reconnects or forgets the engine
        for agent in action.agents:
            self.transport.fence_peer(agent)  # checked at start: a decode transport has the fence
        self._fences[action.fence_id] = _PendingFence(action, time.monotonic())

    def _check_fences(self) -> None:
        assert self.core is not None and self.transport is not None
        fenced = self.transport.fenced  # checked at start: never a confirmation by default
        now = time.monotonic()
        for fence_id, pending in list(self._fences.items()):
            agents = pending.action.agents
            if not all(fenced(agent) for agent in agents):
                if now - pending.warned_at >= FENCE_WARN_S:
                    pending.warned_at = now
                    logger.warning(
                        "fence of P engine %s (agents %s) not confirmed after %.1fs; the blocks "
                        "waiting on it stay held",
                        pending.action.engine_id,
                        list(agents),
                        now - pending.started_at,
                    )
                continue
            del self._fences[fence_id]
            self._execute(self.core.fenced(fence_id, lease_clock()))

    # ------------------------------------------------------------------ timers

    def _poll(self, now: float) -> None:
        if self._fences:
            self._check_fences()

    def _timers(self, now: float) -> None:
        assert self.core is not None
        self._execute(self.core.handle_timer(now))

    def _next_deadline(self) -> float | None:
        return self.core.next_deadline() if self.core is not None else None

    def _busy(self) -> bool:
        return self.core is not None and (self.core.pending > 0 or bool(self._fences))

    def _before_stop(self) -> None:
        """Tell P before going: every pending request fails (its producers are sent CANCEL, as
        for any failure) and this waits up to ``close_timeout_s`` for each to be released, i.e.
        for every producer that may write to acknowledge or settle."""
        core = self.core
        assert core is not None
        reason = "the decode worker closed before the request finished"
        deadline = time.monotonic() + self.config.close_timeout_s

        def fail_pending() -> None:
            with self._results_lock:
                pending = sorted(self._active)
            for rid in pending:
                core_id = self._core_id(rid)
                self._guarded(core_id, lambda now, core_id=core_id: core.fail(core_id, reason, now))

        try:
            self.call_on_writer(fail_pending)
        except WaitTimeout as err:
            logger.warning("%s could not tell P it is closing: %s", self.agent_name, err)
            return
        with self._results_ready:
            self._results_ready.wait_for(lambda: not self._active, max(0.0, deadline - time.monotonic()))

    def _closed(self) -> None:
        """Report every request still pending as failed. Its blocks are *not* released: a
        producer that never acknowledged may still write into them while this process lives
        (a copy made by P's process on this host), so the engine must not reuse them."""
        with self._results_ready:
            pending = sorted(self._active)
            if pending:
                logger.error(
                    "%s closed with %d request(s) whose producers never acknowledged; their blocks "
                    "are not released (a late WRITE may land in them): %s",
                    self.agent_name,
                    len(pending),
                    pending[:10],
                )
            if pending and self.staging is not None:
                # Their producers may still copy into the staging ranges they reserved: keep
                # the pool's memory for the process's life, like the blocks the engine keeps.
                keep_for_process_life(self.staging)
            if pending and self.registered_caches is not None:
                keep_for_process_life(self.registered_caches.storages)  # the blocks' memory too
            closed = (
                "the decode worker closed before the request finished; its blocks are NOT "
                "released (P never acknowledged: do not reuse them while P may write)"
            )
            for rid in pending:
                self._uncollected.add(rid)
                # One failed earlier and not yet collected says so too: no release will follow.
                earlier = self._failed.get(rid)
                self._failed[rid] = f"{earlier}; then {closed}" if earlier else closed
            self._active.clear()
            self._live.clear()
            if self._claims is not None:
                self._claims.clear()
            self._results_ready.notify_all()
