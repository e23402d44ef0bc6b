"""The P side's driver: feeds a :class:`~kvpush.core.prefill_core.PrefillCore` and executes its actions.

The protocol (matching D's per-rank registrations with finished prefills, freshness fencing,
WRITE deadlines, cancels, tombstones, one exit per request) lives in the pure core. This driver
owns the transport, the writer thread and the handshakes: it plans (through the read-spec hook),
posts WRITEs (direct or packed, through the strategy hook) right after ``confirm_post`` says the
registration is still fresh, polls them, and reports results to the engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from kvpush.core import ended_workers
from kvpush.core import notifications as wire
from kvpush.core.actions import Abort, AskStart, Connect, DropPeer, Post, Report, Send
from kvpush.core.errors import ConfigError, KvpushError, PeerProcessExited, TransferError, WaitTimeout
from kvpush.core.peers import PeerEngine
from kvpush.core.planning import descriptor_id_grid, descriptor_ids, pair_blocks
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.sidechannel import SideChannelUnanswered, fetch_metadata
from kvpush.core.transport import TransferState
from kvpush.core.types import (
    BlockIds,
    BlockIdsLike,
    HandshakeMode,
    Notification,
    PushJob,
    PushRegistration,
    RankKey,
    ReadSpec,
    Role,
    read_only,
)
from kvpush.core.worker import FRESH_WINDOW_S, RankWorker, keep_for_process_life, lease_clock

logger = logging.getLogger(__name__)


@attrs.frozen
class PushResults:
    """What :meth:`PushSender.get_finished` returns since its last call (immutable)."""

    sent: tuple[str, ...]
    failed: Mapping[str, str] = attrs.field(hash=False, converter=read_only)
    """Request id -> why it failed (read-only)."""


@attrs.frozen
class _Finished:
    """A ``request_finished`` call, as the writer thread receives it."""

    key: str
    request_id: str
    blocks: BlockIds
    decode_engine_id: str
    ready: Any
    """None, or what says the KV is written (``query()``)."""
    prompt_fingerprint: str | None = None
    """The prompt's fingerprint (checked against D's registration), or None."""

    def to_core(self, core: Any) -> Any:
        """The core event telling ``core`` that this prefill finished."""
        return lambda now: core.finished(
            self.key,
            self.request_id,
            self.blocks,
            self.decode_engine_id,
            now,
            fingerprint=self.prompt_fingerprint,
        )


MAX_TOLD_AGENTS = 64
"""Refused D ranks' agents held notify-only at a time (the oldest is removed first)."""

SLOW_READY_S = 2e-3
"""A ``ready.query()`` answering slower than this is counted and logged (it blocks the writer)."""


class PushSender(RankWorker):
    """One P rank (one PP stage × TP rank)."""

    role = Role.PREFILL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core: PrefillCore | None = None
        self._packed: dict[Any, Any] = {}
        """Packed WRITEs in flight by transfer handle (:class:`kvpush.core.packing.PackedWrite`)."""
        self._unabortable: dict[Any, bool] = {}
        """Handles posted ``abortable=False`` (kernel copies) -> whether a raising poll of it was
        logged: only the transport's own answer ends them; a ``poll`` that raises says nothing
        about whether the copy still runs."""
        self._deferred: list[Any] = []
        self._unready: dict[str, tuple[_Finished, float]] = {}
        """Match key -> finished prefills whose ``ready`` has not turned True yet, and since when
        (writer thread; the core does not know them yet)."""
        self._sent: list[str] = []
        self._failed: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        """Match key -> request id of prefills finished and not yet reported (a second finish of
        a key is refused; close() reports what is left)."""
        self._ids: dict[str, str] = {}
        """Request id -> match key of the same prefills: a request id still held is refused under
        another key too (``get_finished`` reports by request id: two prefills under one id could
        not be told apart, and the engine would free one's blocks on the other's outcome)."""
        self._uncollected: set[str] = set()
        """Request ids reported since the last ``get_finished``: refused too until collected
        (the next ``get_finished`` would name the id for the earlier prefill)."""
        self._inflight_at_close: set[str] = set()
        """Match keys with a WRITE still in flight when close() stopped waiting: their blocks
        are reported NOT released (the WRITE may still read them)."""
        self._packing_stats = {"packed_writes": 0, "packed_fallbacks": 0, "slow_ready_queries": 0}
        self._region_groups: tuple[Any, tuple[int, ...]] | None = None
        self._block_bytes: dict[int, tuple[Any, dict[int, int]]] = {}
        self._aligned_regions: dict[int, tuple[Any, Any, Any, tuple[Any, ...]]] = {}
        """id(peer rank) -> (the peer rank, its metadata, its alignment, its aligned regions)."""
        self._told: dict[str, tuple[str, int, str]] = {}
        """Agents of D ranks whose metadata this rank refused, loaded notify-only to tell them
        why (writer thread): agent -> (D engine, D rank, the incarnation it published)."""
        self._telling: ThreadPoolExecutor | None = None
        """Reads a refused D rank's agent off its side channel (never on the writer)."""
        self._asking: ThreadPoolExecutor | None = None
        """Asks a D rank's side channel which start of it runs (``AskStart``; never on the writer)."""

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the core (pushes, writes, rejected notifications, ...) plus packing's."""
        out = dict(self.core.stats) if self.core is not None else {}
        out.update(self._packing_stats)
        return out

    def _make_core(self) -> None:
        cfg = self.config
        self.core = PrefillCore(
            PrefillSettings(
                engine_id=cfg.engine_id,
                incarnation=self.incarnation,
                rank=cfg.parallel.rank,
                tp_size=cfg.parallel.tp_size,
                lease_s=cfg.lease_s,
                registration_ttl_s=cfg.registration_ttl_s,
                write_deadline_s=cfg.write_deadline_s,
            ),
            plan=self._plan,
        )

    # ------------------------------------------------------------------ engine API

    def request_finished(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        match_key: str | None = None,
        decode_engine_id: str | None = None,
        ready: Any = None,
        prompt_fingerprint: str | None = None,
        num_tokens: int | None = None,
        block_start: int | Sequence[int] | None = None,
    ) -> None:
        """Prefill of ``request_id`` finished; its KV sits in ``block_ids`` (per group).

        ``match_key`` is the ``transfer_id`` the router gave both legs (default: the request id,
        which D knows as ``remote_request_id``). ``decode_engine_id``, when the router knows it,
        binds the push to that D engine: registrations from any other engine are refused. The
        blocks stay reserved until the request is reported sent or failed by :meth:`get_finished`;
        a request with no blocks is reported sent at once.

        The KV must be complete when this is called, or ``ready`` must say when it is: an object
        whose ``query()`` turns True once the KV is written (a ``torch.cuda.Event`` recorded on
        the stream that wrote it, after the prefill's last write). The writer thread polls it
        (so ``query()`` must not block) and posts nothing of the request before; if it is not
        ready within ``lease_s``, or ``query()`` raises, the request fails and D is told.

        ``prompt_fingerprint`` (optional): :func:`kvpush.engine.prompt_fingerprint` of the
        prompt's token ids. A D registration stating another prompt's fingerprint is never
        written: it and this request fail, naming the key (a router reused it for another
        prompt). None, or a D that states none: pairing rests on the match key alone.

        ``num_tokens`` (optional, one-KV-group models): the prompt's length. P then pushes only
        the first ``ceil(num_tokens / block_size)`` blocks, the prompt's: a block table holding
        more (a block allocated ahead for decode, a lookahead) would otherwise shift every
        block of a D that does not state where its blocks start (docs/engine-api.md). It is
        also compared with the prompt length D states: a push whose two lengths differ fails.

        ``block_start`` (optional): where ``block_ids`` start in the request's blocks, per KV
        group (an int for one group); default 0, the blocks from the prompt's first token. An
        engine that passes a group's tail only (a sliding-window group cut to its window)
        states its start. P pairs D's registered blocks by the start D states, never from the
        end, and fails the request when its blocks do not hold all of D's.

        Raises ``ConfigError`` naming the argument for an empty or non-string id, negative,
        repeated or out-of-range block ids, a match key already in progress, a ``ready``
        without ``query()``, a worker that is not running or is closing (``close()`` began on
        another thread: nothing will be pushed, the blocks are the engine's), or a ``kv_caches``
        tensor replaced since ``start()`` (naming it: restart the worker with the new caches).
        """
        self._check_accepting("request_finished")
        self._check_caches("request_finished")
        blocks = self._check_blocks(request_id, block_ids, "block_ids")
        if num_tokens is not None:
            blocks = self._prompt_blocks(blocks, num_tokens, block_start)
        if num_tokens is not None or block_start is not None:
            blocks = self._stated(blocks, block_start, num_tokens)
        key = request_id if match_key is None else match_key
        if not isinstance(key, str) or not key:
            raise ConfigError(f"match_key must be a non-empty string (or None), got {match_key!r}")
        if decode_engine_id is not None and (not isinstance(decode_engine_id, str) or not decode_engine_id):
            raise ConfigError(
                f"decode_engine_id must be a non-empty string (or None), got {decode_engine_id!r}"
            )
        if ready is not None and not callable(getattr(ready, "query", None)):
            raise ConfigError(
                f"ready must have a query() method that turns True once the KV is written (e.g. a "
                f"torch.cuda.Event recorded after the prefill's last KV write), got {ready!r}"
            )
        from kvpush.core.fingerprint import check_fingerprint  # here: an edit local to this method

        fingerprint = check_fingerprint(prompt_fingerprint, "prompt_fingerprint")
        finished = _Finished(key, request_id, blocks, decode_engine_id or "", ready, fingerprint)
        with self._results_lock:
            # Checked again under the lock: a close() on another thread sets _closing under it
            # and later reports what _keys holds; a finish registered after close() began would
            # be failed by the closing core at best, queued to no writer at worst.
            self._check_accepting("request_finished")
            if key in self._keys:
                raise ConfigError(f"match_key {key!r} is already being pushed by this rank; finish it once")
            held = self._ids.get(request_id)
            if held is not None:
                raise ConfigError(
                    f"request_id {request_id!r} is still being pushed by this rank under match key "
                    f"{held!r}; get_finished() reports by request id, so a second prefill under it "
                    f"could not be told apart: use a fresh request id, or finish once the first is "
                    f"reported"
                )
            if request_id in self._uncollected:
                raise ConfigError(
                    f"request_id {request_id!r} has a result get_finished() has not returned yet "
                    f"(an earlier prefill of that id, sent or failed); results name only the id, "
                    f"so it would be read as this prefill's: call get_finished() first"
                )
            self._keys[key] = request_id
            self._ids[request_id] = key
            # Queued under the lock: an abort() that saw this key held (on another thread) is
            # queued after it, never ahead of the finish it names (the core would drop it).
            self.run_on_writer(lambda: self._finished(finished))

    def _prompt_blocks(self, blocks: BlockIds, num_tokens: Any, block_start: Any = None) -> BlockIds:
        """The prompt's blocks of a one-group block table: its first ``ceil(num_tokens /
        block_size) - start`` (the table holds the request's blocks from ``block_start`` on;
        ``ConfigError`` for a bad count, one past the table, or several groups, whose windows a
        token count does not place)."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ConfigError(f"num_tokens must be a non-negative int (or None), got {num_tokens!r}")
        if self.config.model.num_groups > 1:
            raise ConfigError(
                "num_tokens trims a one-group block table; this model has "
                f"{self.config.model.num_groups} KV groups: pass each group's prompt blocks exactly"
            )
        from kvpush.core.types import to_block_start

        start = to_block_start(block_start)
        first = start[0] if start else 0
        total = -(-num_tokens // self.config.model.block_size)
        need = total - first
        ids = blocks[0] if blocks else ()
        if ids and need <= 0:
            raise ConfigError(
                f"block_start={first} is past the last block of a {num_tokens}-token prompt "
                f"({total} blocks of {self.config.model.block_size} tokens)"
            )
        if need > len(ids):
            where = f" from block_start={first}" if first else ""
            raise ConfigError(
                f"num_tokens={num_tokens} needs {need} blocks of {self.config.model.block_size} "
                f"tokens{where}; block_ids hold {len(ids)}"
            )
        need = max(need, 0)
        return (tuple(ids[:need]),)

    def _stated(self, blocks: BlockIds, block_start: Any, num_tokens: int | None) -> BlockIds:
        """``blocks`` with what the engine stated about them, for :func:`pair_blocks`."""
        from kvpush.core.planning import PromptBlocks
        from kvpush.core.types import to_block_start

        start = to_block_start(block_start)
        if start is not None and any(blocks) and len(start) != len(blocks):
            raise ConfigError(
                f"block_start gives {len(start)} start(s), block_ids {len(blocks)} KV group(s): "
                f"pass one start per group (an int for one group)"
            )
        return PromptBlocks(blocks, getattr(blocks, "held", None), start, num_tokens)

    def abort(self, request_id: str, match_key: str | None = None) -> None:
        """Abort a finished prefill (the engine wants its blocks back): nothing more is posted,
        D fails the request at once instead of at its watchdog, and the request is reported in
        ``get_finished().failed`` once no WRITE of it is in flight. Unknown ids are ignored, and so
        is a prefill already reported (another prefill finished since under its key is not it)."""
        self._check_running("abort")
        key = request_id if match_key is None else match_key
        with self._results_lock:
            if self._keys.get(key) != request_id:
                return  # not the prefill held under the key (reported already, or a retry's)
            self.run_on_writer(lambda: self._abort(key, request_id))  # after the finish it saw

    def request_abandoned(
        self, request_id: str, match_key: str | None = None, reason: str = "the prefill was abandoned"
    ) -> None:
        """The engine will never call :meth:`request_finished` for this prefill (aborted or
        failed before it finished): D's registrations of its key are answered FAIL at once,
        and so are later ones, instead of D waiting for its registration timeout. Nothing is
        reported (there are no blocks). A key this rank is pushing or already ended is left
        alone; an unknown key is remembered as failed."""
        self._check_running("request_abandoned")
        key = request_id if match_key is None else match_key
        if not isinstance(key, str) or not key:
            raise ConfigError(f"match_key must be a non-empty string (or None), got {match_key!r}")
        with self._results_lock:
            if key in self._keys:
                return  # finished here: its push (or failure) reaches D as usual
        why = f"the prefill of {key!r} on P ended without a push: {reason}"
        self.run_on_writer(
            lambda: self._guarded(key, lambda now: self.core.abandoned(key, why, now, request_id=request_id))
        )

    def get_finished(self) -> PushResults:
        """Requests pushed (every WRITE done) or failed (with the reason) since the last call."""
        with self._results_lock:
            sent, self._sent = tuple(self._sent), []
            failed, self._failed = self._failed, {}
            self._uncollected.clear()
        return PushResults(sent=sent, failed=failed)

    # ------------------------------------------------------------------ feeding the core

    def _finished(self, finished: _Finished) -> None:
        """A prefill finished: to the core now, or once its ``ready`` says the KV is written."""
        if finished.ready is None:
            self._guarded(finished.key, finished.to_core(self.core), finished.request_id)
            return
        self._unready[finished.key] = (finished, lease_clock())
        self._check_ready(lease_clock())

    def _check_ready(self, now: float) -> None:
        """Hand each prefill whose KV became ready to the core; fail those whose ``ready`` raised
        or did not turn True within ``lease_s`` (D is told, nothing is posted)."""
        for key, (finished, since) in list(self._unready.items()):
            failure = ""
            try:
                asked = time.perf_counter()
                state = finished.ready.query()
                took = time.perf_counter() - asked
                if took > SLOW_READY_S:
                    self._slow_ready(took)
                if not isinstance(state, bool):  # e.g. a CUresult: 600 (not ready) is truthy
                    raise TypeError(f"query() returned {state!r}, not True or False")
                if not state:
                    if now - since <= self.config.lease_s:
                        continue
                    failure = (
                        f"its KV was not ready within lease_s={self.config.lease_s}s (the `ready` "
                        f"passed to request_finished never turned True; is the engine's stream stuck?)"
                    )
            except BaseException as err:  # SystemExit too: it would end the writer thread
                failure = f"the `ready` passed to request_finished raised {type(err).__name__}: {err}"
            del self._unready[key]
            if failure:
                self._end_unready(finished, lambda now, k=key, why=failure: self.core.fail(k, why, now))
            else:
                self._guarded(key, finished.to_core(self.core), finished.request_id)

    def _slow_ready(self, took: float) -> None:
        """A ``ready.query()`` that blocked: every post and poll of this rank waited for it."""
        self._packing_stats["slow_ready_queries"] += 1
        if self._packing_stats["slow_ready_queries"] in (1, 10, 100, 1000):
            logger.warning(
                "%s: a `ready` passed to request_finished took %.1f ms to answer query(); it must "
                "not block (the writer thread waits, and with it every push of this rank); "
                "%d slow answers so far (stats['slow_ready_queries'])",
                self.agent_name,
                1e3 * took,
                self._packing_stats["slow_ready_queries"],
            )

    def _end_unready(self, finished: _Finished, ending: Any) -> None:
        """Give the core a prefill that must not be posted, ended at once by ``ending`` (fail or
        abort), so D is told as for any other failure. Any post the core asks for meanwhile is
        refused by ``confirm_post`` (the request has failed by then)."""
        start = finished.to_core(self.core)
        self._guarded(finished.key, lambda now: start(now) + ending(now), finished.request_id)

    def _abort(self, key: str, request_id: str) -> None:
        unready = self._unready.get(key)
        if unready is not None and unready[0].request_id == request_id:
            del self._unready[key]
            self._end_unready(unready[0], lambda now: self.core.abort(key, now, request_id=request_id))
            return
        self._guarded(key, lambda now: self.core.abort(key, now, request_id=request_id))

    def _guarded(self, key: str, event: Any, request_id: str | None = None) -> None:
        """Run one core event and its actions; any exception fails ``key``'s request only
        (``request_id``: the finished prefill the event carries, reported failed even when the
        error struck before the core recorded it)."""
        assert self.core is not None
        now = lease_clock()
        try:
            actions = event(now)
        except Exception as err:
            logger.exception("handling an event of %s failed", key)
            reason = f"internal error: {type(err).__name__}: {err}"
            actions = self.core.fail(key, reason, now, request_id=request_id)
        self._execute(actions)

    def _on_notification(self, peer: str, notification: Notification) -> None:
        assert self.core is not None
        key = notification.registration.match_key if notification.registration else notification.request_id
        now = lease_clock()
        try:
            actions = self.core.notification(peer, notification, now)
        except Exception as err:
            logger.exception("handling a %s from %s failed", notification.kind.value, peer)
            actions = self.core.fail(key, f"internal error: {type(err).__name__}: {err}", now)
        self._deferred.extend(actions)  # posts wait until the whole batch was drained

    def _flush(self) -> None:
        actions, self._deferred = self._deferred, []
        self._execute(actions)

    def _execute(self, actions: Sequence[Any]) -> None:
        for action in actions:
            try:
                self._run(action)
            except Exception as err:  # contained: fail the request the action belonged to
                logger.exception("action %s failed", type(action).__name__)
                key = getattr(action, "key", None)
                if key is not None and self.core is not None:
                    self._execute(
                        self.core.fail(key, f"internal error: {type(err).__name__}: {err}", lease_clock())
                    )

    def _run(self, action: Any) -> None:
        assert self.core is not None and self.peers is not None
        if isinstance(action, Send):
            error = self._send(action.agent, action.message)
            if error:
                self._execute(self.core.unreachable(action.agent, error, lease_clock()))
        elif isinstance(action, Post):
            self._post(action)
        elif isinstance(action, Report):
            self._report(action)
        elif isinstance(action, Connect):
            self._connect(action)
        elif isinstance(action, DropPeer):
            logger.info("dropping D engine %s %s: %s", action.engine_id, action.ranks or "", action.reason)
            self.peers.remove(action.engine_id, action.ranks)
            self._forget_told(action.engine_id, set(action.ranks) or None)
        elif isinstance(action, Abort):
            for handle in action.handles:
                self._release_handle(handle)
        elif isinstance(action, AskStart):
            self._ask_start(action)
        else:
            raise TypeError(f"unknown action {action!r}")

    def _report(self, report: Report) -> None:
        with self._results_lock:
            self._keys.pop(report.key, None)
            if self._ids.get(report.request_id) == report.key:
                del self._ids[report.request_id]
            self._uncollected.add(report.request_id)
            if report.outcome == "sent":
                self._sent.append(report.request_id)
            else:
                self._failed[report.request_id] = report.reason

    def _connect(self, action: Connect) -> None:
        assert self.peers is not None
        # A rank told of a refusal is handshaken afresh: its notify-only agent goes first (the
        # full handshake loads the agent under the same name).
        self._forget_told(action.engine_id, {rank.tp_rank for rank in action.ranks})
        future = self.peers.ensure(
            action.engine_id, action.host, action.port, action.ranks, HandshakeMode.FULL
        )
        future.add_done_callback(lambda f: self.run_on_writer(lambda: self._connected(action, f)))

    def _connected(self, action: Connect, future: Future[PeerEngine]) -> None:
        assert self.core is not None
        error = future.exception()
        # Not a refusal: D's side channel did not answer, or names a D process that has exited
        # (a D rank restarting: its new start would be told "refused" and fail every request).
        restarting = isinstance(error, (SideChannelUnanswered, PeerProcessExited))
        if error is not None and not restarting and self._running:
            # D's side channel answered and P refused what it read: load D's agent notify-only
            # (off the writer first), so the core can answer D's HELLO and registrations FAIL
            # with the reason instead of leaving D to its HELLO bound.
            if self._telling is None:
                self._telling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpush-refusal")
            try:
                self._telling.submit(self._read_refused, action, error)
                return
            except RuntimeError:  # shut down: fall through, D is not told
                pass
        for rank in action.ranks:
            if error is not None:
                actions = self.core.connected(
                    action.engine_id, rank.tp_rank, "", "", 0, str(error), lease_clock()
                )
            else:
                peer = future.result().ranks[rank]
                actions = self.core.connected(
                    action.engine_id,
                    rank.tp_rank,
                    peer.agent,
                    peer.meta.incarnation,
                    peer.meta.parallel.tp_size,
                    "",
                    lease_clock(),
                )
            self._execute(actions)

    def _ask_start(self, action: AskStart) -> None:
        """Writer: ask D's side channel which start of the rank runs, on a small executor (a
        handshake round trip, bounded by ``handshake_timeout_s``); the core is answered on the
        writer. Shut down: the core is not answered (nothing waits for it)."""
        if self._asking is None:
            self._asking = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpush-ask-start")
        with contextlib.suppress(RuntimeError):  # shut down
            self._asking.submit(self._read_start, action)

    def _read_start(self, action: AskStart) -> None:
        """Executor: one side-channel round trip for D rank ``action.rank``'s published start."""
        rank, incarnation, error = RankKey(0, action.rank), "", ""
        try:
            peer = self._fetch_identity(action.host, action.port, action.engine_id, rank)
            if peer.engine_id != action.engine_id or peer.rank != rank:
                error = f"the side channel serves engine {peer.engine_id!r} rank {peer.rank}"
            else:
                incarnation = peer.incarnation
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        self.run_on_writer(
            lambda: (
                self._execute(
                    self.core.start_served(action.engine_id, action.rank, incarnation, error, lease_clock())
                )
                if self.core is not None
                else None
            )
        )

    def _fetch_identity(self, host: str, port: int, engine_id: str, rank: RankKey) -> Any:
        """Executor: the identity (engine, rank, agent, incarnation) D rank ``rank`` publishes on
        its side channel: one round trip, bounded by ``handshake_timeout_s``."""
        from kvpush.core.wire import decode_identity

        payload = fetch_metadata(
            host, port, rank, timeout_s=self.config.handshake_timeout_s, engine_id=engine_id
        )
        return decode_identity(payload, source=f"engine {engine_id!r} rank {rank}")

    def _read_refused(self, action: Connect, error: BaseException) -> None:
        """Executor: read the refused D ranks' agents off their side channel (one round trip
        each, bounded by ``handshake_timeout_s``; never the geometry P refused)."""
        found: dict[int, Any] = {}
        for rank in action.ranks:
            try:
                peer = self._fetch_identity(action.host, action.port, action.engine_id, rank)
            except Exception as err:
                logger.warning(
                    "cannot tell D rank %s of %r why it was refused: %s", rank, action.engine_id, err
                )
                continue
            if peer.engine_id == action.engine_id and peer.rank == rank:
                found[rank.tp_rank] = peer
        self.run_on_writer(lambda: self._tell_refused(action, error, found))

    def _tell_refused(self, action: Connect, error: BaseException, found: Mapping[int, Any]) -> None:
        """Writer: load each refused D rank's agent notify-only and hand the refusal to the core,
        which answers that agent's HELLO and registrations FAIL with the reason."""
        assert self.core is not None and self.transport is not None
        for rank in action.ranks:
            peer, agent = found.get(rank.tp_rank), ""
            if peer is not None and self.peers is not None and self.peers.incarnation_of(peer.agent_name):
                peer = None  # loaded for WRITEs meanwhile (another handshake): never replaced here
            if peer is not None:
                self._forget_told(action.engine_id, {rank.tp_rank})
                if peer.agent_name in self._told:  # the same name under another engine id
                    self._remove_told(peer.agent_name)
                try:
                    agent = self.transport.load_peer(peer.agent_blob)
                except Exception as err:
                    logger.warning("cannot load refused D agent %s to tell it why: %s", peer.agent_name, err)
                    agent = ""
                if agent:
                    while len(self._told) >= MAX_TOLD_AGENTS:
                        self._remove_told(next(iter(self._told)))
                    self._told[agent] = (action.engine_id, rank.tp_rank, peer.incarnation)
            incarnation = peer.incarnation if agent and peer is not None else ""
            self._execute(
                self.core.connected(
                    action.engine_id, rank.tp_rank, agent, incarnation, 0, str(error), lease_clock()
                )
            )

    def _forget_told(self, engine_id: str, ranks: set[int] | None = None) -> None:
        """Remove the notify-only agents of an engine's refused ranks (all, or ``ranks``)."""
        for agent, (engine, rank, _) in list(self._told.items()):
            if engine == engine_id and (ranks is None or rank in ranks):
                self._remove_told(agent)

    def _remove_told(self, agent: str) -> None:
        assert self.transport is not None
        self._told.pop(agent, None)
        try:
            self.transport.remove_peer(agent)
        except Exception as err:
            logger.warning("removing refused D agent %s failed: %r", agent, err)

    def _sealed(self, agent: str, message: bytes) -> bytes:
        """A refused D rank's agent is not in the registry: its MAC names the incarnation it
        published (read with the refusal)."""
        told = self._told.get(agent)
        if told is None or self._mac_key is None:
            return super()._sealed(agent, message)
        from kvpush.core import notif_auth

        return notif_auth.seal(self._mac_key, self.agent_name, agent, told[2], message)

    # ------------------------------------------------------------------ planning and posting

    def _plan(self, blocks: BlockIds, reg: PushRegistration) -> list[ReadSpec]:
        """Pair P's blocks with D's by where D's start (:func:`pair_blocks`), ask the read-spec
        hook, and check the plan against the rule D counts producers by
        (``kvpush_expected_producers``)."""
        assert self.metadata is not None
        local_ids = pair_blocks(
            blocks,
            reg.block_ids,
            reg.request_id,
            decode_start=reg.block_start,
            decode_tokens=reg.num_tokens,
        )
        job = PushJob(
            local=self.metadata,
            decode_tp_size=reg.decode_tp_size,
            local_block_ids=local_ids,
            remote_block_ids=reg.block_ids,
        )
        specs = self.pm.build_read_specs(job)
        me = self.config.parallel
        want = sorted(
            d
            for d in range(reg.decode_tp_size)
            if me.rank in self.pm.expected_producers(me, d, reg.decode_tp_size)
        )
        planned = [spec.dst_tp_rank for spec in specs]
        if sorted(planned) != want:
            raise ConfigError(
                f"the read-spec plan of P rank {me.rank} writes D ranks {sorted(planned)}, but the D "
                f"ranks that count this producer (kvpush_expected_producers) are {want}"
            )
        return specs

    def _post(self, post: Post) -> None:
        assert self.core is not None and self.transport is not None and self.peers is not None
        now = lease_clock()
        if not self.core.confirm_post(post.key, post.dst, now):
            self._execute(self.core.refresh(post.key, post.dst, now))
            return
        try:
            handles, nbytes = self._post_writes(post)
        except Exception as err:
            reason = str(err) if isinstance(err, KvpushError) else f"{type(err).__name__}: {err}"
            running = getattr(err, "posted", None)  # packing.PackedPostFailed
            if running:
                self._keep_running_chunks(post, running, reason)
                return
            sent = getattr(err, "maybe_sent", True)  # unknown errors: bytes may have gone out
            self._execute(self.core.post_failed(post.key, post.dst, reason, lease_clock(), maybe_sent=sent))
            return
        self._fresh_until = time.monotonic() + FRESH_WINDOW_S
        abortable = getattr(self.transport, "abortable", None)  # optional: kernel copies are not
        try:
            if abortable is None:  # no per-WRITE answer: what the transport publishes for all
                can_abort = bool(getattr(self.transport, "writes_abortable", True))
            else:
                can_abort = all(bool(abortable(handle)) for handle in handles)
        except Exception as err:  # the WRITE is posted: it is tracked whatever this says
            logger.warning("abortable() of a posted WRITE raised %r; it is waited for, not aborted", err)
            can_abort = False
        if not can_abort:
            self._unabortable.update(dict.fromkeys(handles, False))
        now = lease_clock()
        self._execute(self.core.posted(post.key, post.dst, handles, nbytes, now, abortable=can_abort))

    def _keep_running_chunks(self, post: Post, running: list[Any], reason: str) -> None:
        """A packed push failed after chunks were posted as copies nothing takes back: they
        stay in flight (polled, never aborted, their staging kept) and the push is reported
        failed once the last of them ended, as a failed WRITE is."""
        assert self.core is not None
        handles = [chunk.handle for chunk in running]
        for chunk in running:
            self._packed[chunk.handle] = chunk
        self._unabortable.update(dict.fromkeys(handles, False))
        now = lease_clock()
        self._execute(self.core.posted(post.key, post.dst, handles, 0, now, abortable=False))
        self._execute(self.core.write_settled(post.key, post.dst, None, False, lease_clock(), reason))

    def _post_writes(self, post: Post) -> tuple[list[Any], int]:
        assert self.transport is not None and self.peers is not None and self.metadata is not None
        spec, reg = post.spec, post.registration
        engine = self.peers.engines.get(post.engine_id)
        rank = RankKey(0, post.dst)
        if engine is None or rank not in engine.ranks:
            raise TransferError(
                f"D rank {post.dst} of {post.engine_id!r} is not loaded any more", maybe_sent=False
            )
        agreed = engine.ranks[rank].parts
        if agreed is not None and (tuple(spec.local_part), tuple(spec.remote_part)) not in agreed:
            raise TransferError(
                f"the read-spec plan writes part {spec.local_part} of P's blocks into part "
                f"{spec.remote_part} of D rank {post.dst}'s, but the plan checked at the handshake "
                f"wrote {sorted(agreed)}: a kvpush_build_read_specs plugin answers differently per "
                f"request; it must answer by the ranks' metadata alone",
                maybe_sent=False,
            )
        regions = self.metadata.regions
        groups = self._groups(regions)
        aligned = self._aligned(engine.ranks[rank])
        post_grid = getattr(self.transport, "post_write_grid", None)  # optional: ids factored
        local_ids: Any = None
        if post_grid is not None:
            local_ids = descriptor_id_grid(regions, groups, spec.local_block_ids)
            remote_ids: Any = None
            if local_ids is not None:
                remote_ids = descriptor_id_grid(aligned, groups, spec.remote_block_ids)
            if remote_ids is None:
                local_ids = None
        if local_ids is None:
            post_grid = None
            local_ids = descriptor_ids(regions, groups, spec.local_block_ids)
            remote_ids = descriptor_ids(aligned, groups, spec.remote_block_ids)
        if len(local_ids) != len(remote_ids):
            raise TransferError(
                f"{len(local_ids)} local descriptors vs {len(remote_ids)} remote ones", maybe_sent=False
            )
        job = PushJob(
            local=self.metadata,
            decode_tp_size=reg.decode_tp_size,
            local_block_ids=spec.local_block_ids,
            remote_block_ids=spec.remote_block_ids,
        )
        handles = None
        if self.pm.transfer_strategy(job, spec, len(local_ids)) == "packed" and self.staging is not None:
            handles = self._post_packed(reg, spec, engine, rank)
        if handles is None:
            notif = self._sealed(
                engine.ranks[rank].agent,
                wire.encode_done(
                    reg.request_id,
                    self.metadata.rank,
                    self.config.parallel.tp_size,
                    incarnation=self.incarnation,
                    attempt=reg.attempt,
                ),
            )
            post = post_grid or self.transport.post_write
            handles = [
                post(
                    self.local_list(spec.local_part),
                    local_ids,
                    self.peers.remote_list(engine, rank, spec.remote_part),
                    remote_ids,
                    notif,
                )
            ]
        nbytes = sum(
            size * len(spec.local_block_ids[group])
            for group, size in self._group_bytes(regions, spec.local_part[1]).items()
        )
        return handles, nbytes

    def _groups(self, regions: tuple[Any, ...]) -> tuple[int, ...]:
        """Each local region's KV group (the regions never change after start)."""
        cached = self._region_groups
        if cached is None or cached[0] is not regions:
            cached = self._region_groups = (regions, tuple(r.kv_group for r in regions))
        return cached[1]

    def _group_bytes(self, regions: tuple[Any, ...], count: int) -> dict[int, int]:
        """KV group -> bytes one block id of the group moves over all regions, for slices of
        ``count`` per block (the request's byte count is this times its ids, per group)."""
        cached = self._block_bytes.get(count)
        if cached is None or cached[0] is not regions:
            sizes: dict[int, int] = {}
            for r in regions:
                sizes[r.kv_group] = sizes.get(r.kv_group, 0) + r.block_len // count
            cached = self._block_bytes[count] = (regions, sizes)
        return cached[1]

    def _aligned(self, peer: Any) -> tuple[Any, ...]:
        """A peer rank's aligned regions, one tuple per loaded peer rank (planning's tables are
        cached per region tuple, so a list rebuilt per post would miss them)."""
        hit = self._aligned_regions.get(id(peer))
        if hit is None or hit[0] is not peer or hit[1] is not peer.meta or hit[2] is not peer.alignment:
            if len(self._aligned_regions) >= 256:
                self._aligned_regions.clear()
            regions = tuple(peer.aligned_regions)
            hit = self._aligned_regions[id(peer)] = (peer, peer.meta, peer.alignment, regions)
        return hit[3]

    def _post_packed(
        self, reg: PushRegistration, spec: ReadSpec, engine: PeerEngine, rank: RankKey
    ) -> list[Any] | None:
        """Post one destination's blocks as packed WRITEs (chunks) into the staging range that
        this D rank reserved in its own PUSH_REG; None means go direct."""
        from kvpush.core import packing

        assert self.transport is not None and self.metadata is not None
        peer = engine.ranks[rank]
        assert peer.alignment is not None
        producer, ptp = self.metadata.rank, self.config.parallel.tp_size
        written = packing.post_packed(
            transport=self.transport,
            pool=self.staging,
            packer=self.packer,
            local_regions=self.metadata.regions,
            peer_meta=peer.meta,
            peer_agent=peer.agent,
            remote_indices=peer.alignment.remote_indices,
            decode_block_ids=reg.block_ids,
            decode_offset=reg.staging_offset,
            spec=spec,
            encode_notif=lambda manifest: self._sealed(
                peer.agent,
                wire.encode_done(
                    reg.request_id, producer, ptp, manifest, self.incarnation, attempt=reg.attempt
                ),
            ),
        )
        if written is None:
            self._packing_stats["packed_fallbacks"] += 1
            return None
        for chunk in written:
            self._packed[chunk.handle] = chunk
        self._packing_stats["packed_writes"] += 1
        return [chunk.handle for chunk in written]

    # ------------------------------------------------------------------ polling and timers

    def _poll(self, now: float) -> None:
        assert self.core is not None and self.transport is not None
        if self._unready:
            self._check_ready(now)
        for handle, (key, dst) in list(self.core.inflight_handles().items()):
            error = ""
            try:
                state = self.transport.poll(handle)
            except Exception as err:  # contained: a raising poll is a failed WRITE ...
                if handle in self._unabortable:
                    # ... unless nothing takes the WRITE back (a kernel copy): it may still run,
                    # and D, told it ended, would fence (which does not stop it) and release the
                    # blocks under it. It stays in flight (its deadline waits, counted overdue).
                    if not self._unabortable[handle]:
                        self._unabortable[handle] = True
                        logger.warning("polling a copy of %s raised %r; it is still waited for", key, err)
                    continue
                logger.warning("polling a WRITE of %s raised %r; taking it as failed", key, err)
                state, error = TransferState.FAILED, f"{type(err).__name__}: {err}"
            if state is TransferState.PENDING:
                continue
            self._release_handle(handle)
            self._execute(self.core.write_settled(key, dst, handle, state is TransferState.DONE, now, error))

    def _release_handle(self, handle: Any) -> None:
        """Release a WRITE handle and, for a packed WRITE, its lists and staging bytes."""
        assert self.transport is not None
        self._unabortable.pop(handle, None)
        try:
            self.transport.release(handle)
        except Exception as err:
            logger.warning("releasing a WRITE handle failed: %r", err)
        written = self._packed.pop(handle, None)
        if written is not None:
            for lst in (written.local_list, written.remote_list):
                try:
                    self.transport.release_list(lst)
                except Exception as err:
                    logger.warning("releasing a packed descriptor list failed: %r", err)
            written.group.remaining -= 1
            if written.group.remaining == 0:
                self.staging.free(written.group.offset)

    def _timers(self, now: float) -> None:
        assert self.core is not None
        self._execute(self.core.handle_timer(now))

    def _next_deadline(self) -> float | None:
        return self.core.next_deadline() if self.core is not None else None

    def _busy(self) -> bool:
        # A WRITE in flight belongs to a finished prefill, so busy() covers it too.
        return bool(self._unready) or (self.core is not None and self.core.busy())

    def _before_stop(self) -> None:
        """Tell D before going: the core stops posting and answers every registration FAIL,
        at once where nothing was posted, else once the WRITE settled; this waits for WRITEs in
        flight (at most ``close_timeout_s``) so that their outcome reaches D too. Once none is
        in flight, every loaded D rank is told this incarnation ended (``BYE``); with a WRITE
        still in flight at the bound, it is not (D's quarantine or hold decides)."""
        core = self.core
        assert core is not None
        deadline = time.monotonic() + self.config.close_timeout_s
        reason = "the prefill worker closed before the push finished"
        try:
            self.call_on_writer(lambda: self._execute(core.shutdown(reason, lease_clock())))
            while self.call_on_writer(lambda: len(core.inflight_handles())):
                if time.monotonic() >= deadline:
                    self.call_on_writer(self._keep_what_is_still_read)
                    logger.warning(
                        "%s closing with WRITEs still in flight after %gs: D decides their "
                        "requests at its own deadline",
                        self.agent_name,
                        self.config.close_timeout_s,
                    )
                    return
                time.sleep(0.002)
            # Nothing of this incarnation is in flight any more: D may let go of what it still
            # holds for it (a worker re-created in this process is a new incarnation).
            self.call_on_writer(self._say_goodbye)
        except WaitTimeout as err:
            logger.warning("%s could not tell D it is closing: %s", self.agent_name, err)

    def _keep_what_is_still_read(self) -> None:
        """close() stops waiting with WRITEs in flight (on the writer thread, or on the closing
        thread once the writer stopped): their prefills are reported NOT released, and a packed
        one's staging pool and the registered storages are kept for the process's life."""
        assert self.core is not None
        self._inflight_at_close = {key for key, _ in self.core.inflight_handles().values()}
        if self._packed and self.staging is not None:
            keep_for_process_life(self.staging)
        if self._inflight_at_close and self.registered_caches is not None:
            # The WRITEs read the memory registered at start, whatever the engine does with
            # its tensors now.
            keep_for_process_life(self.registered_caches.storages)

    def _say_goodbye(self) -> None:
        """``BYE`` to every loaded D rank, and remember in this process that the incarnation
        ended (a worker created here later tells D in its handshake, should a ``BYE`` be lost)."""
        core = self.core
        assert core is not None
        actions = core.goodbye(lease_clock())
        if core.said_goodbye:
            ended_workers.record(self.agent_name, self.incarnation, core.wrote_unsettled)
        self._execute(actions)

    def _release_resources(self) -> None:
        if self._telling is not None:
            self._telling.shutdown(wait=False, cancel_futures=True)
        if self._asking is not None:
            self._asking.shutdown(wait=False, cancel_futures=True)
        super()._release_resources()

    def _closed(self) -> None:
        """Report every prefill still held as failed: the engine may free its blocks."""
        if self.core is not None and not self._inflight_at_close:
            # ``_before_stop`` may have given up before recording the WRITEs in flight (its
            # writer commands timed out: a stalled writer that stopped within the join since).
            # The writer is stopped now: what is still in flight is read here, reported NOT
            # released and its memory kept (a WRITE, and the DONE it carries, may still read it).
            self._keep_what_is_still_read()
        with self._results_lock:
            pending = list(self._keys.items())  # in the core, or still queued for the writer
        if pending:
            logger.warning(
                "%s closed with %d prefill(s) unreported; reporting them failed",
                self.agent_name,
                len(pending),
            )
        still_read = (
            f"the prefill worker closed with a WRITE of this request still in flight after "
            f"close_timeout_s={self.config.close_timeout_s}s; its blocks are NOT released (the "
            f"WRITE may still read them: do not reuse them, and keep the cache tensors allocated "
            f"while the process lives)"
        )
        for key, request_id in pending:
            reason = (
                still_read
                if key in self._inflight_at_close
                else "the prefill worker closed before the push finished"
            )
            self._report(Report(request_id, "failed", reason, key))
