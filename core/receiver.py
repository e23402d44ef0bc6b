"""The D side: register blocks with P (``PUSH_REG``) and count completion notifications.

For each request D does a notif-only handshake with P (it loads the agents of every PP stage
and every P TP rank that writes into this D rank, and builds no descriptors), then sends
``PUSH_REG`` to each of them. The request is done once the expected number of *distinct*
producers ``(pp_rank, tp_rank)`` have reported (``kvpush_expected_notifications``); a
duplicate from one producer never counts twice. A failure notification fails the request at
once with P's reason; a request that does not complete within ``request_timeout_s`` fails with
a reason naming the producers still missing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import attrs
from kvpush.core import wire
from kvpush.core.errors import ConfigError, KvpushError, WaitTimeout
from kvpush.core.peers import PeerEngine
from kvpush.core.planning import producer_ranks_for
from kvpush.core.types import (
    HandshakeMode,
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


@attrs.frozen
class ReceiveResults:
    """What :meth:`PushReceiver.get_finished` returns since its last call."""

    done: tuple[str, ...]
    failed: dict[str, str] = attrs.field(hash=False)


class PushReceiver(RankWorker):
    """One D rank (a TP rank of a non-PP decode engine)."""

    role = Role.DECODE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, PendingReceive] = {}
        self._early: dict[str, list[tuple[float, Notification]]] = {}
        self._results_lock = threading.Lock()
        self._results_ready = threading.Condition(self._results_lock)
        self._done: list[str] = []
        self._failed: dict[str, str] = {}
        self.completion_times: dict[str, float] = {}
        self.stats = {"duplicate_notifications": 0, "unknown_notifications": 0, "push_regs_sent": 0}

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

    def get_finished(self) -> ReceiveResults:
        """Requests whose KV has fully landed, and those that failed (with the reason)."""
        with self._results_lock:
            done, self._done = tuple(self._done), []
            failed, self._failed = self._failed, {}
        return ReceiveResults(done=done, failed=failed)

    def wait_finished(self, timeout_s: float) -> ReceiveResults:
        """Block until something finished or failed, at most ``timeout_s``; raises
        ``WaitTimeout`` naming the requests still pending."""
        with self._results_ready:
            if not self._results_ready.wait_for(lambda: self._done or self._failed, timeout_s):
                raise WaitTimeout(
                    f"no request finished on {self.agent_name} within {timeout_s}s; pending: "
                    f"{sorted(self._pending)[:10]}"
                )
        return self.get_finished()

    # ------------------------------------------------------------------ writer thread

    def _report(self, request_id: str, failure: str | None) -> None:
        with self._results_ready:
            if failure is None:
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
            params.remote_engine_id, params.remote_host, params.remote_port, ranks, HandshakeMode.NOTIF_ONLY
        )
        future.add_done_callback(
            lambda f: self.run_on_writer(lambda: self._after_handshake(f, request, ranks))
        )

    def _after_handshake(
        self, future: Future[PeerEngine], request: RequestMetadata, ranks: list[RankKey]
    ) -> None:
        if request.request_id not in self._pending:
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
        )
        message = wire.encode_push_reg(reg)
        errors = []
        for rank in ranks:
            try:
                self.transport.send_notif(engine.ranks[rank].agent, message)
                self.stats["push_regs_sent"] += 1
            except KvpushError as err:
                errors.append(f"{rank}: {err}")
                logger.warning("PUSH_REG of %s to P rank %s failed: %s", request.request_id, rank, err)
        if len(errors) == len(ranks):
            self._fail(request.request_id, "PUSH_REG reached no P rank: " + "; ".join(errors))

    def _on_notification(self, peer: str, notification: Notification) -> None:
        kind = notification.kind
        if kind not in (NotificationKind.DONE, NotificationKind.FAILED):
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
        if kind is NotificationKind.FAILED:
            self._fail(rid, f"P rank {notification.producer} reported: {notification.reason}")
            return
        assert notification.producer is not None
        if notification.producer in pending.producers:
            self.stats["duplicate_notifications"] += 1
            return
        pending.producers.add(notification.producer)
        if len(pending.producers) >= pending.expected:
            del self._pending[rid]
            self._report(rid, None)

    def _fail(self, request_id: str, reason: str) -> None:
        if self._pending.pop(request_id, None) is not None:
            logger.warning("request %s failed: %s", request_id, reason)
            self._report(request_id, reason)

    def _tick(self, now: float) -> None:
        for rid, pending in list(self._pending.items()):
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

    def _busy(self) -> bool:
        return bool(self._pending)

    @property
    def pending_requests(self) -> int:
        return len(self._pending)
