"""The P side: match D's registrations with finished prefills and push the KV with WRITEs.

Matching is symmetric: whichever of "D registered" (a ``PUSH_REG`` notification) and "prefill
finished" (:meth:`PushSender.request_finished`) arrives second triggers the push. The push does
a full handshake with D if needed (off the writer thread), builds read specs through the
read-spec hook, posts one WRITE per destination rank with the completion notification
attached, and reports the request sent once every WRITE is done. A WRITE that fails sends D a
failure notification naming the request, so D fails it at once instead of waiting.

Lifecycle (docs/reliability.md): D's ``HB:`` heartbeats (match keys) renew the lease of
finished-but-unclaimed blocks, stashed registrations and tombstones. A ``CANCEL`` from D drops the
stash or the finished entry and tombstones the key (a later prefill or registration for it is
refused), and is answered with ``CANCEL_ACK`` once no WRITE of the request is in flight (at once,
or when the in-flight WRITEs settle). A WRITE or notification error probes the D agent; a dead D
engine is removed once its WRITEs settled, so a restarted D can be loaded again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import attrs

from kvpush.core import wire
from kvpush.core.errors import KvpushError
from kvpush.core.peers import PeerEngine
from kvpush.core.planning import descriptor_ids, trim_for_prefix_hit
from kvpush.core.transport import TransferState
from kvpush.core.types import (
    BlockIds,
    HandshakeMode,
    Notification,
    NotificationKind,
    PushJob,
    PushRegistration,
    RankKey,
    ReadSpec,
    Role,
    to_block_ids,
)
from kvpush.core.worker import RankWorker

logger = logging.getLogger(__name__)


@attrs.define
class FinishedPrefill:
    request_id: str
    block_ids: BlockIds
    lease_deadline: float


@attrs.define
class StashedRegistration:
    registration: PushRegistration
    expires: float


@attrs.define
class InflightPush:
    """The WRITEs of one request; published as a whole once all are posted."""

    request_id: str
    registration: PushRegistration
    handles: list[tuple[Any, int, str]]
    """``(transfer handle, destination TP rank, destination agent)``."""
    failure: str | None = None
    bytes: int = 0
    started: float = 0.0
    cancel_acks: list[tuple[PushRegistration, int]] = attrs.field(factory=list)
    """``(D's coordinates, D tp rank)`` of cancels to acknowledge once every WRITE settled."""


@attrs.frozen
class PushResults:
    """What :meth:`PushSender.get_finished` returns since its last call."""

    sent: tuple[str, ...]
    failed: dict[str, str] = attrs.field(hash=False)


class PushSender(RankWorker):
    """One P rank (one PP stage × TP rank)."""

    role = Role.PREFILL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._finished: dict[str, FinishedPrefill] = {}
        self._registrations: dict[str, StashedRegistration] = {}
        self._tombstones: dict[str, float] = {}
        self._waiting_handshake: set[str] = set()
        self._inflight: dict[str, InflightPush] = {}
        self._staging_offsets: dict[str, dict[int, int]] = {}
        """D's staging reservation per match key and D TP rank (packed strategy)."""
        self._packed: dict[Any, Any] = {}
        """Packed WRITEs in flight by transfer handle (:class:`kvpush.core.packing.PackedWrite`)."""
        self._cancelled: dict[str, float] = {}
        """Match keys D cancelled (until expiry): a prefill finishing for one is released at once."""
        self._dead_engines: set[str] = set()
        self._next_eviction = 0.0
        self._results_lock = threading.Lock()
        self._sent: list[str] = []
        self._failed: dict[str, str] = {}
        self.stats = {
            "pushes": 0,
            "bytes": 0,
            "duplicate_registrations": 0,
            "writes": 0,
            "cancels": 0,
            "cancels_during_write": 0,
            "heartbeat_renewals": 0,
            "dead_engines": 0,
        }

    # ------------------------------------------------------------------ engine API

    def request_finished(self, request_id: str, block_ids: Any, match_key: str | None = None) -> None:
        """Prefill of ``request_id`` finished; its KV sits in ``block_ids`` (per group).

        ``match_key`` is the ``transfer_id`` the router gave both legs (default: the request id,
        which D knows as ``remote_request_id``). The blocks stay reserved until the request is
        reported sent or failed by :meth:`get_finished`.
        """
        blocks = to_block_ids(block_ids)
        key = match_key or request_id
        self.run_on_writer(lambda: self._on_finished(key, request_id, blocks))

    def get_finished(self) -> PushResults:
        """Requests pushed (every WRITE done) or failed (with the reason) since the last call."""
        with self._results_lock:
            sent, self._sent = tuple(self._sent), []
            failed, self._failed = self._failed, {}
        return PushResults(sent=sent, failed=failed)

    # ------------------------------------------------------------------ writer thread

    def _report(self, request_id: str, failure: str | None) -> None:
        with self._results_lock:
            if failure is None:
                self._sent.append(request_id)
            else:
                self._failed[request_id] = failure

    def _on_finished(self, key: str, request_id: str, blocks: BlockIds) -> None:
        if key in self._cancelled:
            self._report(request_id, "cancelled by D before the prefill finished; blocks released")
            return
        if key in self._finished or key in self._inflight or key in self._waiting_handshake:
            logger.warning("request %s (key %s) finished twice; ignoring the second", request_id, key)
            return
        self._finished[key] = FinishedPrefill(request_id, blocks, time.monotonic() + self.config.lease_s)
        stashed = self._registrations.pop(key, None)
        if stashed is not None:
            self._start_push(key, stashed.registration)

    def _on_notification(self, peer: str, notification: Notification) -> None:
        if notification.kind is NotificationKind.PUSH_REG:
            assert notification.registration is not None
            self._on_registration(notification.registration)
        elif notification.kind is NotificationKind.CANCEL:
            self._on_cancel(peer, notification)
        elif notification.kind is NotificationKind.HEARTBEAT:
            self._on_heartbeat(notification.request_ids)
            reg, tp = notification.registration, notification.producer
            if reg is not None and tp is not None:  # answer: P's liveness signal for D
                self._send_to_decode(reg, tp.tp_rank, wire.encode_heartbeat([]))
        else:
            self.dropped_notifications += 1
            logger.warning(
                "prefill rank got an unexpected %s notification from %s", notification.kind.value, peer
            )

    def _on_heartbeat(self, keys: tuple[str, ...]) -> None:
        """Renew the lease of everything P holds for these match keys (D still waits for them)."""
        now = time.monotonic()
        for key in keys:
            renewed = False
            finished = self._finished.get(key)
            if finished is not None:
                finished.lease_deadline = max(finished.lease_deadline, now + self.config.lease_s)
                renewed = True
            stashed = self._registrations.get(key)
            if stashed is not None:
                stashed.expires = max(stashed.expires, now + self.config.registration_ttl_s)
                renewed = True
            if key in self._tombstones:
                self._tombstones[key] = max(self._tombstones[key], now + self.config.registration_ttl_s)
                renewed = True
            self.stats["heartbeat_renewals"] += renewed

    def _on_cancel(self, peer: str, notification: Notification) -> None:
        """D cancelled a request: never write into its blocks again; ack once nothing is in flight."""
        key = notification.request_id
        now = time.monotonic()
        self.stats["cancels"] += 1
        self._cancelled[key] = now + self.config.registration_ttl_s
        self._tombstones[key] = now + self.config.registration_ttl_s
        self._registrations.pop(key, None)
        finished = self._finished.pop(key, None)
        if finished is not None:
            self._report(finished.request_id, "cancelled by D before the push started; blocks released")
        reg, tp = notification.registration, notification.producer
        push = self._inflight.get(key)
        if push is not None:
            self.stats["cancels_during_write"] += 1
            push.failure = (
                push.failure or "cancelled by D while a WRITE was in flight (settled before the ack)"
            )
            if reg is not None and tp is not None:
                push.cancel_acks.append((reg, tp.tp_rank))
            return
        # Waiting for a handshake: _after_handshake sees the cancel and posts nothing.
        if reg is not None and tp is not None:
            self._send_to_decode(
                reg, tp.tp_rank, wire.encode_cancel_ack(reg.request_id, self.config.parallel.rank, False)
            )
        else:
            logger.info("cancel of %s from %s carries no coordinates; not acknowledged", key, peer)

    def _send_to_decode(self, reg: PushRegistration, tp_rank: int, message: bytes) -> None:
        """Send one notification to a D rank, loading its agent first if needed (never blocks)."""
        assert self.transport is not None and self.peers is not None
        rank = RankKey(0, tp_rank)
        engine = self.peers.engines.get(reg.decode_engine_id)

        def send(agent: str) -> None:
            try:
                self.transport.send_notif(agent, message)
            except KvpushError as err:
                logger.warning("could not reach D rank %s of %s: %s", tp_rank, reg.decode_engine_id, err)

        if engine is not None and rank in engine.ranks:
            send(engine.ranks[rank].agent)
            return
        # FULL: P will write to this D anyway, and a notif-only engine must not shadow a full one.
        future = self.peers.ensure(
            reg.decode_engine_id, reg.decode_host, reg.decode_port, [rank], HandshakeMode.FULL
        )

        def after(done: Future[PeerEngine]) -> None:
            if done.exception() is None:
                send(done.result().ranks[rank].agent)

        future.add_done_callback(lambda f: self.run_on_writer(lambda: after(f)))

    def _probe_decode(self, engine_id: str, agent: str) -> None:
        """After a WRITE or notification error: is that D agent still there? If not, mark its
        engine dead (removed once none of its WRITEs is in flight)."""
        assert self.transport is not None
        if engine_id in self._dead_engines:
            return
        try:
            self.transport.send_notif(agent, wire.encode_heartbeat([]))
        except KvpushError as err:
            logger.warning("D engine %s looks dead (%s); dropping it once its WRITEs settle", engine_id, err)
            self._dead_engines.add(engine_id)
            self.stats["dead_engines"] += 1
            for key, stashed in list(self._registrations.items()):
                if stashed.registration.decode_engine_id == engine_id:
                    del self._registrations[key]

    def _on_registration(self, reg: PushRegistration) -> None:
        key = reg.match_key
        if reg.staging_offset >= 0:  # every D rank reserves its own staging; keep each offset
            self._staging_offsets.setdefault(key, {})[reg.decode_tp_rank] = reg.staging_offset
        if key in self._tombstones or key in self._inflight or key in self._waiting_handshake:
            # Every D rank registers; the first registration already fans out to all of them.
            self.stats["duplicate_registrations"] += 1
            return
        if key in self._finished:
            self._start_push(key, reg)
            return
        if key in self._registrations:
            self.stats["duplicate_registrations"] += 1
        self._registrations[key] = StashedRegistration(reg, time.monotonic() + self.config.registration_ttl_s)

    def _start_push(self, key: str, reg: PushRegistration) -> None:
        assert self.metadata is not None and self.peers is not None
        finished = self._finished.pop(key)
        self._tombstones[key] = time.monotonic() + self.config.registration_ttl_s
        try:
            local_ids = trim_for_prefix_hit(finished.block_ids, reg.block_ids, finished.request_id)
            job = PushJob(
                local=self.metadata,
                decode_tp_size=reg.decode_tp_size,
                local_block_ids=local_ids,
                remote_block_ids=reg.block_ids,
            )
            specs = self.pm.build_read_specs(job)
        except KvpushError as err:
            self._fail_before_write(finished.request_id, reg, f"planning failed: {err}")
            return
        ranks = [RankKey(0, spec.dst_tp_rank) for spec in specs]
        engine = self.peers.connected(reg.decode_engine_id, ranks)
        if engine is not None and engine.mode is HandshakeMode.FULL:  # not just notif-loaded
            self._post(finished.request_id, reg, job, specs, engine)
            return
        self._waiting_handshake.add(key)
        future = self.peers.ensure(
            reg.decode_engine_id,
            reg.decode_host,
            reg.decode_port,
            ranks,
            self.pm.handshake_mode(Role.PREFILL, Role.DECODE),
        )
        future.add_done_callback(
            lambda f: self.run_on_writer(lambda: self._after_handshake(f, key, finished, reg, job, specs))
        )

    def _after_handshake(
        self,
        future: Future[PeerEngine],
        key: str,
        finished: FinishedPrefill,
        reg: PushRegistration,
        job: PushJob,
        specs: list[ReadSpec],
    ) -> None:
        self._waiting_handshake.discard(key)
        if key in self._cancelled:
            self._report(finished.request_id, "cancelled by D before the WRITE was posted; blocks released")
            return
        error = future.exception()
        if error is not None:
            self._fail_before_write(finished.request_id, reg, f"handshake with D failed: {error}")
            return
        self._post(finished.request_id, reg, job, specs, future.result())

    def _post(
        self, request_id: str, reg: PushRegistration, job: PushJob, specs: list[ReadSpec], engine: PeerEngine
    ) -> None:
        assert self.transport is not None and self.peers is not None and self.metadata is not None
        regions = self.metadata.regions
        groups = [r.kv_group for r in regions]
        push = InflightPush(request_id=request_id, registration=reg, handles=[], started=time.monotonic())
        producer = self.metadata.rank
        notif = wire.encode_done(reg.request_id, producer, self.config.parallel.tp_size)
        for spec in specs:
            rank = RankKey(0, spec.dst_tp_rank)
            agent = engine.ranks[rank].agent
            try:
                local_ids = descriptor_ids(regions, groups, spec.local_block_ids)
                remote_ids = descriptor_ids(engine.ranks[rank].aligned_regions, groups, spec.remote_block_ids)
                if len(local_ids) != len(remote_ids):
                    raise KvpushError(f"{len(local_ids)} local descriptors vs {len(remote_ids)} remote ones")
                handles = None
                strategy = self.pm.transfer_strategy(job, spec, len(local_ids))
                if strategy == "packed" and self.staging is not None:
                    handles = self._post_packed(reg, spec, engine, rank)
                if handles is None:
                    handles = [
                        self.transport.post_write(
                            self.local_list(spec.local_part),
                            local_ids,
                            self.peers.remote_list(engine, rank, spec.remote_part),
                            remote_ids,
                            notif,
                        )
                    ]
            except KvpushError as err:
                push.failure = f"WRITE to D rank {spec.dst_tp_rank} failed: {err}"
                self._notify_failure(reg, producer, push.failure, [agent])
                self._probe_decode(reg.decode_engine_id, agent)
                continue
            push.handles.extend((handle, spec.dst_tp_rank, agent) for handle in handles)
            push.bytes += sum(
                r.block_len // spec.local_part[1] * len(spec.local_block_ids[r.kv_group]) for r in regions
            )
        self.stats["writes"] += len(push.handles)
        self._staging_offsets.pop(reg.match_key, None)
        self._inflight[reg.match_key] = push  # all handles of the request at once
        self._settle(reg.match_key, push)

    # ------------------------------------------------------------------ packed strategy

    def _post_packed(
        self, reg: PushRegistration, spec: ReadSpec, engine: PeerEngine, rank: RankKey
    ) -> list[Any] | None:
        """Post one destination's blocks as packed WRITEs (chunks); None means go direct."""
        from kvpush.core import packing

        assert self.transport is not None and self.metadata is not None
        peer = engine.ranks[rank]
        offset = self._staging_offsets.get(reg.match_key, {}).get(spec.dst_tp_rank, -1)
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
            decode_offset=offset,
            spec=spec,
            encode_notif=lambda manifest: wire.encode_done(reg.request_id, producer, ptp, manifest),
        )
        if written is None:
            self.stats["packed_fallbacks"] = self.stats.get("packed_fallbacks", 0) + 1
            return None
        for chunk in written:
            self._packed[chunk.handle] = chunk
        self.stats["packed_writes"] = self.stats.get("packed_writes", 0) + 1
        return [chunk.handle for chunk in written]

    def _packed_settled(self, handle: Any) -> None:
        """A WRITE settled: release a packed WRITE's descriptor lists and staging bytes."""
        written = self._packed.pop(handle, None)
        if written is not None:
            assert self.transport is not None
            self.transport.release_list(written.local_list)
            self.transport.release_list(written.remote_list)
            written.group.remaining -= 1
            if written.group.remaining == 0:
                self.staging.free(written.group.offset)

    def _fail_before_write(self, request_id: str, reg: PushRegistration, reason: str) -> None:
        """Report a push that failed before any WRITE, and tell every D rank why.

        If D's agents are not loaded yet (planning failed before the handshake), a notif-only
        handshake loads them first, so D fails the request at once instead of on its watchdog.
        """
        logger.warning("push of %s failed: %s", request_id, reason)
        assert self.peers is not None and self.metadata is not None
        self._report(request_id, reason)
        ranks = [RankKey(0, tp) for tp in range(reg.decode_tp_size)]
        engine = self.peers.engines.get(reg.decode_engine_id)
        if engine is not None:
            agents = [r.agent for r in engine.ranks.values()]
            self._notify_failure(reg, self.metadata.rank, reason, agents)
            return
        future = self.peers.ensure(
            reg.decode_engine_id, reg.decode_host, reg.decode_port, ranks, HandshakeMode.NOTIF_ONLY
        )

        def tell(done: Future[PeerEngine]) -> None:
            if done.exception() is None:
                agents = [r.agent for r in done.result().ranks.values()]
                self._notify_failure(reg, self.metadata.rank, reason, agents)

        future.add_done_callback(lambda f: self.run_on_writer(lambda: tell(f)))

    def _notify_failure(
        self, reg: PushRegistration, producer: RankKey, reason: str, agents: list[str]
    ) -> None:
        assert self.transport is not None
        message = wire.encode_failed(reg.request_id, producer, reason)
        for agent in agents:
            try:
                self.transport.send_notif(agent, message)
            except KvpushError as err:
                logger.warning("could not tell %s that %s failed: %s", agent, reg.request_id, err)

    def _settle(self, key: str, push: InflightPush) -> None:
        """Poll a push's WRITEs; report it once none is pending."""
        assert self.transport is not None and self.metadata is not None
        pending = []
        for handle, dst, agent in push.handles:
            state = self.transport.poll(handle)
            if state is TransferState.PENDING:
                pending.append((handle, dst, agent))
                continue
            self.transport.release(handle)
            self._packed_settled(handle)
            if state is TransferState.FAILED:
                push.failure = push.failure or f"WRITE to D rank {dst} ended in error"
                self._notify_failure(push.registration, self.metadata.rank, push.failure, [agent])
                self._probe_decode(push.registration.decode_engine_id, agent)
        push.handles = pending
        if pending:
            return
        del self._inflight[key]
        for reg, tp_rank in push.cancel_acks:  # every WRITE settled: D may free its blocks now
            self._send_to_decode(
                reg, tp_rank, wire.encode_cancel_ack(reg.request_id, self.metadata.rank, True)
            )
        if push.failure is None:
            self.stats["pushes"] += 1
            self.stats["bytes"] += push.bytes
        self._report(push.request_id, push.failure)

    def _tick(self, now: float) -> None:
        for key, push in list(self._inflight.items()):
            self._settle(key, push)
        for key, finished in list(self._finished.items()):
            if finished.lease_deadline <= now:
                del self._finished[key]
                self._report(
                    finished.request_id,
                    f"lease of {self.config.lease_s:g}s expired before D registered its blocks",
                )
        for key, stashed in list(self._registrations.items()):
            if stashed.expires <= now:
                del self._registrations[key]
                logger.warning(
                    "dropped D's registration %s: no prefill finished within %ss",
                    key,
                    self.config.registration_ttl_s,
                )
        for key, expires in list(self._tombstones.items()):
            if expires <= now:
                del self._tombstones[key]
        for key, expires in list(self._cancelled.items()):
            if expires <= now:
                del self._cancelled[key]
        busy = {p.registration.decode_engine_id for p in self._inflight.values()}
        for engine_id in list(self._dead_engines):
            if engine_id not in busy and not self._waiting_handshake:
                assert self.peers is not None
                self.peers.remove(engine_id)
                self._dead_engines.discard(engine_id)
        if now >= self._next_eviction and not self._waiting_handshake:
            self._next_eviction = now + 1.0
            stashed = {s.registration.decode_engine_id for s in self._registrations.values()}
            self._evict_idle_engines(now, busy | stashed)

    def _busy(self) -> bool:
        return bool(self._inflight or self._finished or self._waiting_handshake)
