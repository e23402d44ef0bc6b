"""The D side: register blocks with P (``PUSH_REG``) and count completion notifications.

For each request D does a notif-only handshake with P (it loads the agents of every PP stage
and every P TP rank that writes into this D rank, and builds no descriptors), then sends
``PUSH_REG`` to each of them. The request is done once the expected number of *distinct*
producers ``(pp_rank, tp_rank)`` have reported (``kvpush_expected_notifications``); a
duplicate from one producer never counts twice. A failure notification fails the request at
once with P's reason; a request that does not complete within ``request_timeout_s`` fails with
a reason naming the producers still missing.

Cancellation and failure never free D's blocks while a producer may still write into them
(docs/reliability.md): :meth:`PushReceiver.cancel` (and any failure of a registered request) sends
``CANCEL`` to every P agent the request registered with, and the request is reported (in
``cancelled`` or ``failed``) only once every producer that had not reported has answered with
``CANCEL_ACK`` (sent by P after its in-flight WRITEs settled), or after ``cancel_ack_timeout_s``
(the reason says which). While requests are pending, ``HB:`` heartbeats with their match keys
renew P's leases; a heartbeat that cannot be sent marks that P agent dead and fails its requests.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import attrs

from kvpush.core import wire
from kvpush.core.completion import COMPLETE, DONE_KIND, DUPLICATE, FAILED_KIND, count_producer
from kvpush.core.errors import ConfigError, KvpushError, WaitTimeout
from kvpush.core.peers import PeerEngine
from kvpush.core.planning import producer_ranks_for
from kvpush.core.types import (
    Notification,
    NotificationKind,
    PushRegistration,
    RankKey,
    RequestMetadata,
    Role,
)
from kvpush.core.worker import RankWorker

logger = logging.getLogger(__name__)


@attrs.define
class PendingReceive:
    meta: RequestMetadata
    expected: int
    deadline: float
    producers: set[RankKey] = attrs.field(factory=set)
    added: float = attrs.field(factory=time.monotonic)
    agents: dict[RankKey, str] = attrs.field(factory=dict)
    """P agents this request's PUSH_REG reached, by producer rank."""
    failed_producers: set[RankKey] = attrs.field(factory=set)
    closing: str | None = None
    """Set once cancelled or failed: the reason, reported when the producers have settled."""
    cancelled: bool = False
    awaiting: set[RankKey] = attrs.field(factory=set)
    """Producers whose CANCEL_ACK (or DONE/FAIL) is still awaited before the blocks are freed."""
    ack_deadline: float = 0.0
    write_in_flight: bool = False


@attrs.frozen
class ReceiveResults:
    """What :meth:`PushReceiver.get_finished` returns since its last call."""

    done: tuple[str, ...]
    failed: dict[str, str] = attrs.field(hash=False)
    cancelled: dict[str, str] = attrs.field(factory=dict, hash=False)
    """Requests cancelled with :meth:`PushReceiver.cancel`; their blocks may be freed now."""


class PushReceiver(RankWorker):
    """One D rank (a TP rank of a non-PP decode engine)."""

    role = Role.DECODE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, PendingReceive] = {}
        self._early: dict[str, list[tuple[float, Notification]]] = {}
        self._results_lock = threading.Lock()
        self._staging_reserved: dict[str, int] = {}
        """Staging offset reserved per request (packed strategy)."""
        self._chunks_seen: dict[tuple[str, Any], set[int]] = {}
        """Packed chunks scattered per (request, producer)."""
        self._results_ready = threading.Condition(self._results_lock)
        self._done: list[str] = []
        self._failed: dict[str, str] = {}
        self._cancelled: dict[str, str] = {}
        self._cancel_on_connect: dict[str, RequestMetadata] = {}
        self._next_heartbeat = 0.0
        self._next_eviction = 0.0
        self._unanswered: dict[str, float] = {}
        """P agent -> when the oldest heartbeat it has not answered (by any notification) went out."""
        self.completion_times: dict[str, float] = {}
        self.stats = {
            "duplicate_notifications": 0,
            "unknown_notifications": 0,
            "push_regs_sent": 0,
            "cancels": 0,
            "cancel_acks": 0,
            "cancel_ack_timeouts": 0,
            "heartbeats_sent": 0,
            "dead_peers": 0,
        }

    # ------------------------------------------------------------------ engine API

    def add_request(self, request: RequestMetadata) -> None:
        """Start receiving ``request``: handshake with P if needed, then send ``PUSH_REG``."""
        if not any(request.block_ids):
            raise ConfigError(f"request {request.request_id!r} registers no blocks")
        expected = self.pm.expected_notifications(request, self.config.parallel)
        self.run_on_writer(lambda: self._on_add(request, expected))

    def add_request_params(self, request_id: str, block_ids: Any, kv_transfer_params: dict[str, Any]) -> None:
        """:meth:`add_request` from a router's ``kv_transfer_params`` dict (vLLM field names)."""
        from kvpush.core.types import TransferParams

        self.add_request(
            RequestMetadata(
                request_id=request_id,
                block_ids=block_ids,
                params=TransferParams.from_dict(kv_transfer_params),
            )
        )

    def cancel(self, request_id: str) -> None:
        """Abort ``request_id`` (the engine wants to free its blocks).

        P is told (``CANCEL``) never to write into the blocks; the request is reported in
        ``get_finished().cancelled`` once no WRITE can land any more: when every producer has
        acknowledged, or after ``cancel_ack_timeout_s`` (the reason says which). Free the blocks
        only then. A request already done or failed is not affected.
        """
        self.run_on_writer(lambda: self._on_cancel(request_id))

    def get_finished(self) -> ReceiveResults:
        """Requests whose KV has fully landed, those that failed and those cancelled (with why)."""
        with self._results_lock:
            done, self._done = tuple(self._done), []
            failed, self._failed = self._failed, {}
            cancelled, self._cancelled = self._cancelled, {}
        return ReceiveResults(done=done, failed=failed, cancelled=cancelled)

    def wait_finished(self, timeout_s: float) -> ReceiveResults:
        """Block until something finished or failed, at most ``timeout_s``; raises
        ``WaitTimeout`` naming the requests still pending."""
        with self._results_ready:
            if not self._results_ready.wait_for(
                lambda: self._done or self._failed or self._cancelled, timeout_s
            ):
                raise WaitTimeout(
                    f"no request finished on {self.agent_name} within {timeout_s}s; pending: "
                    f"{sorted(self._pending)[:10]}"
                )
        return self.get_finished()

    # ------------------------------------------------------------------ writer thread

    def _report(self, request_id: str, failure: str | None, cancelled: bool = False) -> None:
        self._release_staging(request_id, failure is None and not cancelled)
        with self._results_ready:
            if cancelled:
                self._cancelled[request_id] = failure or "cancelled"
            elif failure is None:
                self._done.append(request_id)
                self.completion_times[request_id] = time.perf_counter()
            else:
                self._failed[request_id] = failure
            self._results_ready.notify_all()

    def _producer_ranks(self, request: RequestMetadata) -> list[RankKey]:
        tp_ranks = producer_ranks_for(
            self.config.parallel.tp_rank, self.config.parallel.tp_size, request.params.tp_size
        )
        return [RankKey(pp, tp) for pp in range(request.pp_size) for tp in tp_ranks]

    def _on_add(self, request: RequestMetadata, expected: int) -> None:
        assert self.peers is not None
        rid = request.request_id
        if rid in self._pending:
            logger.warning("request %s added twice; ignoring the second", rid)
            return
        self._pending[rid] = PendingReceive(
            meta=request, expected=expected, deadline=time.monotonic() + self.config.request_timeout_s
        )
        for _, notification in self._early.pop(rid, []):
            self._on_notification("(early)", notification)
        if rid not in self._pending:
            return
        params = request.params
        try:
            ranks = self._producer_ranks(request)
        except ConfigError as err:
            self._fail(rid, str(err))
            return
        engine = self.peers.connected(params.remote_engine_id, ranks)
        if engine is not None:
            self._send_registration(request, engine, ranks)
            return
        future = self.peers.ensure(
            params.remote_engine_id,
            params.remote_host,
            params.remote_port,
            ranks,
            self.pm.handshake_mode(Role.DECODE, Role.PREFILL),
        )
        future.add_done_callback(
            lambda f: self.run_on_writer(lambda: self._after_handshake(f, request, ranks))
        )

    def _after_handshake(
        self, future: Future[PeerEngine], request: RequestMetadata, ranks: list[RankKey]
    ) -> None:
        if request.request_id not in self._pending:
            cancelled = self._cancel_on_connect.pop(request.request_id, None)
            if cancelled is not None and future.exception() is None:
                # Cancelled during the handshake: nothing was registered, but P may hold the
                # finished prefill; tell it to release (no ack needed, P cannot write here).
                for rank in ranks:
                    self._send_quietly(
                        future.result().ranks[rank].agent, wire.encode_cancel(cancelled.params.match_key)
                    )
            return
        error = future.exception()
        if error is not None:
            self._fail(request.request_id, f"handshake with P failed: {error}")
            return
        self._send_registration(request, future.result(), ranks)

    def _send_registration(self, request: RequestMetadata, engine: PeerEngine, ranks: list[RankKey]) -> None:
        assert self.transport is not None
        cfg = self.config
        reg = PushRegistration(
            request_id=request.request_id,
            match_key=request.params.match_key,
            decode_engine_id=cfg.engine_id,
            decode_host=cfg.side_channel_host,
            decode_port=cfg.side_channel_port,
            decode_tp_size=cfg.parallel.tp_size,
            block_ids=request.block_ids,
            remote_engine_id=request.params.remote_engine_id,
            decode_tp_rank=cfg.parallel.tp_rank,
            staging_offset=self._reserve_staging(request),
        )
        message = wire.encode_push_reg(reg)
        errors = []
        pending = self._pending[request.request_id]
        for rank in ranks:
            try:
                self.transport.send_notif(engine.ranks[rank].agent, message)
                self.stats["push_regs_sent"] += 1
                pending.agents[rank] = engine.ranks[rank].agent
            except KvpushError as err:
                errors.append(f"{rank}: {err}")
                logger.warning("PUSH_REG of %s to P rank %s failed: %s", request.request_id, rank, err)
        if len(errors) == len(ranks):
            self._fail(request.request_id, "PUSH_REG reached no P rank: " + "; ".join(errors))

    def _on_notification(self, peer: str, notification: Notification) -> None:
        self._unanswered.pop(peer, None)  # any notification shows the P agent is alive
        kind = notification.kind
        if kind is not DONE_KIND and kind is not FAILED_KIND:  # identity: the hot path is DONE
            if kind is NotificationKind.HEARTBEAT:
                return  # P's liveness probe
            if kind is NotificationKind.CANCEL_ACK:
                self._on_cancel_ack(notification)
                return
            self.dropped_notifications += 1
            logger.warning("decode rank got an unexpected %s notification from %s", kind.value, peer)
            return
        rid = notification.request_id
        pending = self._pending.get(rid)
        if pending is None:
            # The request may not have been added yet on this rank: hold it for a while.
            self.stats["unknown_notifications"] += 1
            self._early.setdefault(rid, []).append((time.monotonic(), notification))
            return
        if pending.closing is not None:
            assert notification.producer is not None
            if kind is DONE_KIND and notification.producer in pending.awaiting:
                pending.write_in_flight = True  # it landed after the cancel went out
            self._settled(rid, pending, notification.producer)
            return
        if kind is FAILED_KIND:
            if notification.producer is not None:
                pending.failed_producers.add(notification.producer)
            self._fail(rid, f"P rank {notification.producer} reported: {notification.reason}")
            return
        assert notification.producer is not None
        if notification.packing is not None and not self._unpack(rid, pending, notification):
            return
        outcome = count_producer(pending.producers, pending.expected, notification.producer)
        if outcome == DUPLICATE:
            self.stats["duplicate_notifications"] += 1
        elif outcome == COMPLETE:
            del self._pending[rid]
            self._report(rid, None)

    # ------------------------------------------------------------------ packed strategy

    def _reserve_staging(self, request: RequestMetadata) -> int:
        """Reserve the request's packed bytes in the staging area; -1 when packing is off or
        the area is full (P then writes directly into the blocks)."""
        if self.staging is None or self.metadata is None:
            return -1
        rid = request.request_id
        if rid not in self._staging_reserved:
            from kvpush.core.packing import staging_layout

            _, total = staging_layout(self.metadata.regions, request.block_ids)
            offset = self.staging.alloc(total)
            if offset is None:
                return -1
            self._staging_reserved[rid] = offset
        return self._staging_reserved[rid]

    def _unpack(self, rid: str, pending: Any, notification: Notification) -> bool:
        """Scatter a packed WRITE into the request's blocks; True once the producer's last chunk
        landed (count it), False before that or when the request failed."""
        from kvpush.core.packing import unpack

        manifest = notification.packing
        assert manifest is not None and self.metadata is not None
        if self._staging_reserved.get(rid) != manifest.staging_offset:
            self._fail(rid, f"P rank {notification.producer} packed into a staging range D did not reserve")
            return False
        try:
            unpack(self.packer, self.staging, self.metadata.regions, pending.meta.block_ids, manifest)
        except Exception as err:
            self._fail(rid, f"scattering the packed bytes of P rank {notification.producer} failed: {err}")
            return False
        if manifest.chunks == 1:
            return True
        seen = self._chunks_seen.setdefault((rid, notification.producer), set())
        seen.add(manifest.chunk)
        return len(seen) == manifest.chunks  # the producer counts once all its chunks landed

    def _release_staging(self, rid: str, settled: bool) -> None:
        """Free a request's reservation; after a failure a WRITE may still land, so wait first."""
        offset = self._staging_reserved.pop(rid, None)
        for key in [k for k in self._chunks_seen if k[0] == rid] if self._chunks_seen else ():
            del self._chunks_seen[key]
        if offset is not None:
            if settled:
                self.staging.free(offset)
            else:
                self.staging.free_later(offset, self.config.early_notification_ttl_s)

    def _fail(self, request_id: str, reason: str) -> None:
        pending = self._pending.get(request_id)
        if pending is not None and pending.closing is None:
            logger.warning("request %s failed: %s", request_id, reason)
            self._close(request_id, pending, reason, cancelled=False)

    # ------------------------------------------------------------------ cancel and settle

    def _on_cancel(self, request_id: str) -> None:
        self.stats["cancels"] += 1
        pending = self._pending.get(request_id)
        if pending is None:
            logger.info("cancel of %s: not pending here (done, failed or unknown); ignored", request_id)
            return
        if pending.closing is not None:
            pending.cancelled = True  # already settling after a failure: report it as cancelled
            return
        self._close(request_id, pending, "cancelled", cancelled=True)

    def _close(self, rid: str, pending: PendingReceive, reason: str, *, cancelled: bool) -> None:
        """Stop the request: tell every P agent it registered with, then wait (bounded) until
        no producer can still write into its blocks."""
        assert self.transport is not None
        pending.closing, pending.cancelled = reason, cancelled
        if not pending.agents:
            if cancelled:
                self._cancel_on_connect[rid] = pending.meta  # handshake may still be running
            del self._pending[rid]
            self._report(rid, f"{reason}: before any PUSH_REG was sent; nothing to settle", cancelled)
            return
        reg = self._registration(pending.meta)
        message = wire.encode_cancel(reg.match_key, reg, self.config.parallel.tp_rank)
        pending.awaiting = {
            r for r in pending.agents if r not in pending.producers and r not in pending.failed_producers
        }
        for rank, agent in pending.agents.items():
            if not self._send_quietly(agent, message):
                pending.awaiting.discard(rank)  # unreachable: it cannot write either
        pending.ack_deadline = time.monotonic() + self.config.cancel_ack_timeout_s
        self._maybe_settled(rid, pending)

    def _send_quietly(self, agent: str, message: bytes) -> bool:
        assert self.transport is not None
        try:
            self.transport.send_notif(agent, message)
        except KvpushError as err:
            logger.warning("notification to P agent %s failed: %s", agent, err)
            return False
        return True

    def _on_cancel_ack(self, notification: Notification) -> None:
        self.stats["cancel_acks"] += 1
        pending = self._pending.get(notification.request_id)
        if pending is None or pending.closing is None or notification.producer is None:
            return  # late ack (already freed on timeout) or for a request not cancelled here
        pending.write_in_flight |= notification.write_in_flight
        self._settled(notification.request_id, pending, notification.producer)

    def _settled(self, rid: str, pending: PendingReceive, producer: RankKey) -> None:
        pending.awaiting.discard(producer)
        self._maybe_settled(rid, pending)

    def _maybe_settled(self, rid: str, pending: PendingReceive) -> None:
        if pending.awaiting:
            return
        del self._pending[rid]
        how = (
            "a WRITE was in flight and settled before the blocks were released"
            if pending.write_in_flight
            else "no WRITE in flight; every producer acknowledged or had reported"
        )
        self._report(rid, f"{pending.closing} ({how})", pending.cancelled)

    def _registration(self, request: RequestMetadata) -> PushRegistration:
        cfg = self.config
        return PushRegistration(
            request_id=request.request_id,
            match_key=request.params.match_key,
            decode_engine_id=cfg.engine_id,
            decode_host=cfg.side_channel_host,
            decode_port=cfg.side_channel_port,
            decode_tp_size=cfg.parallel.tp_size,
            block_ids=(),
            remote_engine_id=request.params.remote_engine_id,
        )

    # ------------------------------------------------------------------ heartbeats and liveness

    def _send_heartbeats(self, now: float, interval: float) -> None:
        """Send each P agent the match keys it holds for us; an agent that has answered nothing
        for ``peer_silence_s`` (default 3 heartbeats + a handshake) is taken for dead."""
        keys_by_agent: dict[str, tuple[RequestMetadata, list[str]]] = {}
        for pending in self._pending.values():
            if pending.closing is None:
                for agent in pending.agents.values():
                    entry = keys_by_agent.setdefault(agent, (pending.meta, []))
                    entry[1].append(pending.meta.params.match_key)
        silence = self.config.peer_silence_s or 3 * interval + self.config.handshake_timeout_s
        for agent, (meta, keys) in keys_by_agent.items():
            since = self._unanswered.get(agent)
            if since is not None and now - since > silence:
                self._unanswered.pop(agent, None)
                self._peer_dead(agent, KvpushError(f"no answer to heartbeats for {silence:g}s"))
                continue
            reg = self._registration(meta)
            for start in range(0, len(keys), 256):
                try:
                    assert self.transport is not None
                    chunk = keys[start : start + 256]
                    self.transport.send_notif(
                        agent, wire.encode_heartbeat(chunk, reg, self.config.parallel.tp_rank)
                    )
                    self.stats["heartbeats_sent"] += 1
                    self._unanswered.setdefault(agent, now)
                except KvpushError as err:
                    self._peer_dead(agent, err)
                    break

    def _peer_dead(self, agent: str, error: Exception) -> None:
        """A P agent cannot be reached: fail its requests now (not on the watchdog) and forget
        its engine so a restarted P is loaded afresh."""
        assert self.peers is not None
        self.stats["dead_peers"] += 1
        logger.warning("P agent %s is unreachable (%s); failing its requests", agent, error)
        engines = set()
        for rid, pending in list(self._pending.items()):
            dead = [rank for rank, a in pending.agents.items() if a == agent]
            if not dead:
                continue
            engines.add(pending.meta.params.remote_engine_id)
            pending.failed_producers.update(dead)
            if pending.closing is not None:
                for rank in dead:
                    self._settled(rid, pending, rank)
            else:
                self._fail(rid, f"P agent {agent} (rank {dead[0]}) is unreachable: {error}")
        for engine_id in engines:
            self.peers.remove(engine_id)

    def _tick(self, now: float) -> None:
        for rid, pending in list(self._pending.items()):
            if pending.closing is not None:
                if pending.ack_deadline <= now:
                    self.stats["cancel_ack_timeouts"] += 1
                    del self._pending[rid]
                    silent = ", ".join(str(r) for r in sorted(pending.awaiting))
                    self._report(
                        rid,
                        f"{pending.closing} (freed after {self.config.cancel_ack_timeout_s:g}s without an "
                        f"acknowledgement from P rank(s) {silent})",
                        pending.cancelled,
                    )
                continue
            if pending.deadline <= now:
                missing = sorted(set(self._producer_ranks(pending.meta)) - pending.producers)
                self._fail(
                    rid,
                    f"no completion within {self.config.request_timeout_s:g}s: {len(pending.producers)} "
                    f"of {pending.expected} producer notifications arrived; missing "
                    f"{', '.join(str(r) for r in missing) or 'none'}",
                )
        ttl = self.config.early_notification_ttl_s
        for rid, items in list(self._early.items()):
            if items[0][0] + ttl <= now:
                del self._early[rid]
                logger.warning(
                    "dropped %d notification(s) for unknown request %s (held %ss)", len(items), rid, ttl
                )
        interval = self.config.heartbeat_interval_s or self.config.lease_s / 6
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + interval
            self._send_heartbeats(now, interval)
        if now >= self._next_eviction:
            self._next_eviction = now + 1.0
            busy = {p.meta.params.remote_engine_id for p in self._pending.values()}
            busy |= {m.params.remote_engine_id for m in self._cancel_on_connect.values()}
            self._evict_idle_engines(now, busy)

    def _busy(self) -> bool:
        return bool(self._pending)

    @property
    def pending_requests(self) -> int:
        return len(self._pending)
