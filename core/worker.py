"""What P senders and D receivers share: start-up, the writer thread and its command queue.

The writer thread is the only thread that touches the transport after start-up: it runs queued
commands, drains notifications and lets the subclass poll its own state (``_tick``).
Handshakes fetch metadata on another thread and hand the loading back to it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvpush.core import wire
from kvpush.core.errors import ConfigError, WaitTimeout, WireError
from kvpush.core.manager import KvpushPluginManager, get_plugin_manager
from kvpush.core.peers import PeerRegistry
from kvpush.core.planning import region_descriptors
from kvpush.core.transport import Transport, TransportConfig
from kvpush.core.types import (
    AgentMetadata,
    KVRegion,
    ModelSpec,
    Notification,
    ParallelConfig,
    Role,
)

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class WorkerConfig:
    """Knobs shared by senders and receivers. Times are seconds."""

    engine_id: str
    parallel: ParallelConfig
    model: ModelSpec
    layout: str = "uniform"
    transport: str = "nixl"
    transport_options: dict[str, Any] = attrs.field(factory=dict, hash=False)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    """Where this engine's side channel listens (put in PUSH_REG so P can handshake back)."""
    side_channel_advertise_host: str | None = None
    """The address peers are told to reach this side channel at (D: in PUSH_REG, HB, CANCEL);
    None: ``network_interface``'s address, else ``side_channel_host`` (kvpush.core.addresses)."""
    network_interface: str | None = None
    """Interface whose IPv4 address is advertised when ``side_channel_host`` is a wildcard."""
    handshake_timeout_s: float = 5.0
    """Bound on each side-channel query of a handshake."""
    request_timeout_s: float = 120.0
    """D: a request not completed this long after it was added fails (watchdog)."""
    lease_s: float = 30.0
    """P: finished blocks not claimed by a PUSH_REG this long are released."""
    registration_ttl_s: float = 120.0
    """P: a PUSH_REG with no finished prefill this long is dropped."""
    early_notification_ttl_s: float = 30.0
    """D: completions for requests not added yet are held this long, then dropped."""
    heartbeat_interval_s: float | None = None
    """D: how often pending requests' match keys are sent to P as ``HB:`` (renewing P's leases
    and probing P's liveness); None means ``lease_s / 6``."""
    cancel_ack_timeout_s: float = 5.0
    """D: a cancelled (or failed) request whose producers have not acknowledged (CANCEL_ACK) or
    reported within this long is freed anyway, and its reason says so."""
    peer_silence_s: float | None = None
    """D: a P agent that answers no heartbeat this long is dead (its requests fail at once);
    None means three heartbeat intervals plus ``handshake_timeout_s``."""
    engine_ttl_s: float = 3600.0
    """Remote engines idle this long (and with no request in progress) are evicted; <= 0 never."""
    busy_poll_s: float = 0.0002
    idle_poll_s: float = 0.002
    cuda_device: int | None = None
    """CUDA device the writer thread makes current (UCX needs it for CUDA IPC); None on CPU."""
    staging_bytes: int = 64 << 20
    """Registered staging area for packed transfers (P gathers into it, D receives into it);
    0 disables packing. A request that does not fit goes direct."""


class RankWorker:
    """Base of :class:`PushSender` and :class:`PushReceiver`: one per rank."""

    role: Role

    def __init__(
        self,
        config: WorkerConfig,
        kv_caches: Mapping[str, Any],
        *,
        pm: KvpushPluginManager | None = None,
    ) -> None:
        self.config = config
        self.pm = pm or get_plugin_manager()
        self._kv_caches = kv_caches
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._local_lists: dict[tuple[int, int], int] = {}
        self.transport: Transport | None = None
        self.metadata: AgentMetadata | None = None
        self.peers: PeerRegistry | None = None
        self.dropped_notifications = 0
        self.staging: Any = None
        """Packed-transfer staging pool (:class:`kvpush.core.packing.StagingPool`), once started."""
        self.packer: Any = None

    # ------------------------------------------------------------------ start-up

    @property
    def agent_name(self) -> str:
        p = self.config.parallel
        return f"{self.config.engine_id}-{self.role.value}-pp{p.pp_rank}-tp{p.tp_rank}"

    def start(self) -> AgentMetadata:
        """Describe and register the KV regions, create the agent, start the writer thread."""
        if self.role is Role.DECODE and self.config.parallel.pp_size > 1:
            raise ConfigError(
                f"decode engine {self.config.engine_id!r} has PP={self.config.parallel.pp_size}; "
                f"kvpush pushes into non-PP decoders only"
            )
        if self.role is Role.DECODE and not self.config.side_channel_port:
            raise ConfigError(
                f"decode engine {self.config.engine_id!r} needs side_channel_port: P handshakes "
                f"back to that port before it writes; pass the port of its SideChannelServer"
            )
        layout = self.pm.layout(self.config.layout)
        regions = tuple(layout.describe_regions(self._kv_caches, self.config.parallel, self.config.model))
        if not regions:
            raise ConfigError(f"layout {layout.name!r} described no KV regions")
        if len({r.mem_type for r in regions}) > 1:
            raise ConfigError("KV caches mix DRAM and VRAM; put every layer on one device type")
        provider = self.pm.transport(self.config.transport)
        self.transport = provider.create(
            TransportConfig(agent_name=self.agent_name, options=dict(self.config.transport_options))
        )
        self.transport.register_regions(regions)
        staging = self._start_staging(regions)
        meta = AgentMetadata(
            engine_id=self.config.engine_id,
            role=self.role,
            parallel=self.config.parallel,
            model=self.config.model,
            layout=self.config.layout,
            transport=self.config.transport,
            agent_name=self.transport.agent_name,
            agent_blob=self.transport.metadata(),
            regions=regions,
        )
        self.metadata = attrs.evolve(meta, extensions={**self.pm.metadata_extensions(meta), **staging})
        self.peers = PeerRegistry(
            pm=self.pm,
            local=self.metadata,
            transport=self.transport,
            run_on_writer=self.run_on_writer,
            timeout_s=self.config.handshake_timeout_s,
        )
        self._thread = threading.Thread(
            target=self._writer_loop, name=f"kvpush-writer-{self.agent_name}", daemon=True
        )
        self._thread.start()
        return self.metadata

    def _start_staging(self, regions: tuple[KVRegion, ...]) -> dict[str, Any]:
        """Allocate and register the packed-transfer staging area; its metadata extension."""
        from kvpush.core import packing

        if self.config.staging_bytes <= 0:
            return {}
        first = regions[0]
        device = f"cuda:{first.device_id}" if first.mem_type == "VRAM" else "cpu"
        pool = packing.StagingPool(self.config.staging_bytes, device)
        assert self.transport is not None
        self.transport.register_buffer(pool.addr, pool.size, first.mem_type, first.device_id)
        self.staging, self.packer = pool, packing.Packer(regions)
        return {packing.STAGING_KEY: {"addr": pool.addr, "len": pool.size, "dev": first.device_id}}

    def handshake_payload(self) -> bytes:
        """The bytes this rank's engine serves on its side channel for this rank."""
        if self.metadata is None:
            raise ConfigError("start() the worker before publishing its metadata")
        return wire.encode_metadata(self.metadata)

    def local_list(self, part: tuple[int, int]) -> int:
        """This rank's prepared descriptor list for one block part (writer thread)."""
        handle = self._local_lists.get(part)
        if handle is None:
            assert self.transport is not None and self.metadata is not None
            regions = self.metadata.regions
            handle = self.transport.prepare_local(region_descriptors(regions, part), regions[0].mem_type)
            self._local_lists[part] = handle
        return handle

    # ------------------------------------------------------------------ writer thread

    def run_on_writer(self, command: Callable[[], None]) -> None:
        """Queue ``command`` for the writer thread and wake it."""
        self._commands.put(command)
        self._wake.set()

    def call_on_writer(self, command: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run ``command`` on the writer thread and wait (bounded) for its result."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = command()
            except BaseException as err:
                box["error"] = err
            finally:
                done.set()

        self.run_on_writer(run)
        if not done.wait(timeout_s):
            raise WaitTimeout(
                f"the writer thread of {self.agent_name} did not run a command within {timeout_s}s"
            )
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _writer_loop(self) -> None:
        if self.config.cuda_device is not None:
            import torch

            torch.cuda.set_device(self.config.cuda_device)
        while not self._stop.is_set():
            try:
                self._run_commands()
                self._drain_notifications()
                self._tick(time.monotonic())
            except Exception:
                logger.exception("kvpush writer of %s hit an error; continuing", self.agent_name)
            timeout = self.config.busy_poll_s if self._busy() else self.config.idle_poll_s
            if self._wake.wait(timeout):
                self._wake.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                logger.exception("kvpush writer command of %s failed", self.agent_name)

    def _drain_notifications(self) -> None:
        assert self.transport is not None
        for peer, message in self.transport.drain_notifs():
            try:
                notification = self.pm.decode_notification(message)
            except WireError as err:
                self.dropped_notifications += 1
                logger.warning("dropped a malformed notification from %s: %s", peer, err)
                continue
            if notification is None:
                self.dropped_notifications += 1
                logger.warning("dropped a notification from %s no plugin understands: %r", peer, message[:64])
                continue
            self._on_notification(peer, notification)

    def _evict_idle_engines(self, now: float, busy: set[str]) -> list[str]:
        """Forget remote engines idle longer than ``engine_ttl_s`` that no request uses."""
        ttl = self.config.engine_ttl_s
        if ttl <= 0 or self.peers is None:
            return []
        evicted = [
            engine_id
            for engine_id, engine in list(self.peers.engines.items())
            if engine_id not in busy and now - engine.last_active > ttl
        ]
        for engine_id in evicted:
            logger.info("evicting remote engine %s: idle for more than %ss", engine_id, ttl)
            self.peers.remove(engine_id)
        return evicted

    def _on_notification(self, peer: str, notification: Notification) -> None:
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        raise NotImplementedError

    def _busy(self) -> bool:
        raise NotImplementedError

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the writer, then release every handle, peer and registration."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            if self._thread.is_alive():
                logger.error("writer of %s did not stop within 5s", self.agent_name)
        if self.peers is not None:
            self.peers.close()
        if self.transport is not None:
            self.transport.close()

    def __enter__(self) -> RankWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
