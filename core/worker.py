"""What P senders and D receivers share: start-up, the writer thread and its command queue.

The sender and receiver are thin *drivers* around pure protocol cores
(:mod:`kvpush.core.prefill_core`, :mod:`kvpush.core.decode_core`): the writer thread is the only
thread that touches the transport after start-up; each step it drains notifications first, then
runs queued commands (engine calls, handshake results), then polls WRITEs and fires the core's
timers, executing the actions the core returns. Handshakes fetch metadata on another thread and
hand the loading back to it. Every event is handled in isolation: an exception fails the request
it belongs to (never the loop, never the rest of a batch).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvpush.core import ended_workers, notif_auth, wire
from kvpush.core.errors import ConfigError, WaitTimeout, WireError
from kvpush.core.manager import KvpushPluginManager, get_plugin_manager
from kvpush.core.peers import PeerRegistry
from kvpush.core.planning import HeldBlockIds, region_descriptors
from kvpush.core.process_identity import PROCESS_KEY, this_process
from kvpush.core.registered_caches import RegisteredCaches
from kvpush.core.transport import Transport, TransportConfig
from kvpush.core.types import (
    AgentMetadata,
    KVRegion,
    ModelSpec,
    Notification,
    ParallelConfig,
    Role,
    to_block_ids,
)

logger = logging.getLogger(__name__)


def _check_window_block_tokens(value: tuple[Any, ...] | None) -> None:
    """What every peer's metadata check accepts (``wire``): at most ``wire.MAX_PARALLEL`` groups,
    each an int in ``[0, wire.MAX_LAYERS]``; beyond it each handshake with this rank failed."""
    if value is not None and not (
        len(value) <= wire.MAX_PARALLEL
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= wire.MAX_LAYERS for v in value)
    ):
        raise ConfigError(
            f"window_block_tokens must give one block size in tokens (an int in [0, {wire.MAX_LAYERS}], 0 "
            f"for a group kept whole) per KV group, for at most {wire.MAX_PARALLEL} groups, got "
            f"{value!r:.200}"
        )


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
    """Interface whose IPv4 address (else global IPv6 address) is advertised when
    ``side_channel_host`` is a wildcard."""
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
    """D: how often pending requests' match keys are sent to P as ``HB:`` (renewing P's leases,
    granting freshness and probing P's liveness); None means ``lease_s / 6``."""
    fresh_s: float | None = None
    """D: the freshness window granted to P with every PUSH_REG and heartbeat: P may post into a
    request's blocks only this long after the stamp D echoed. None means two heartbeat intervals.
    Must be shorter than ``peer_silence_s``."""
    write_deadline_s: float = 10.0
    """P: a WRITE not settled this long is aborted, D told and D's connection dropped. Published
    to D, which keeps a failed request's blocks quarantined for ``fresh_s`` + this (+1 s) after
    its last grant when P does not acknowledge the cancel."""
    peer_silence_s: float | None = None
    """D: a P agent that answers no heartbeat this long is dead (its requests fail at once);
    None means three heartbeat intervals plus ``handshake_timeout_s``."""
    secret: str | None = None
    """Shared secret of the engines (default: ``KVPUSH_SIDE_CHANNEL_SECRET``). When set, every
    notification carries a MAC bound to sender, receiver and the receiver's incarnation
    (:mod:`kvpush.core.notif_auth`); unauthenticated ones are dropped."""
    incarnation: str = ""
    """Id of this engine start (carried in metadata, PUSH_REG and HB); empty: a fresh one per
    worker (start time, then random bits). Ids must be unique per start and should sort by
    start time: a peer seen with a greater one is a new peer, a message with a smaller one is a
    late one and is dropped, except that P takes a HELLO of a D start it never loaded for a new
    start whatever its id (then D's side channel decides which start is live)."""
    engine_ttl_s: float = 3600.0
    """Remote engines idle this long (and with no request in progress) are evicted; <= 0 never."""
    close_timeout_s: float = 5.0
    """How long ``close()`` waits to part cleanly. P: for WRITEs in flight to settle, so that D
    hears each one's outcome (a registration with nothing in flight is answered FAIL at once); a
    WRITE still in flight then is left to D's own deadline. D: for the producers of its pending
    requests to acknowledge their CANCEL; a request still unacknowledged then is reported failed
    and *not* released."""
    keepalive_s: float = 600.0
    """D: for this long after its last request to a P engine, an idle D keeps that engine's
    grants fresh (a keyless heartbeat once a stamp would be half ``fresh_s`` old by the next
    heartbeat), so the next request's PUSH_REG is not stale on arrival; 0 turns it off."""
    busy_poll_s: float = 0.0002
    idle_poll_s: float = 0.002
    timer_slack_ns: int = 1000
    """Linux: the writer thread's timer slack (``PR_SET_TIMERSLACK``). The kernel may end a
    timed wait this much late; its default, 50 µs, made every 50 µs poll last ~70-130 µs.
    0 leaves the thread's default. Elsewhere ignored."""
    cuda_device: int | None = None
    """CUDA device the writer thread makes current (UCX needs it for CUDA IPC); None on CPU."""
    staging_bytes: int = 64 << 20
    """Registered staging area for packed transfers (P gathers into it, D receives into it);
    0 disables packing. A request that does not fit goes direct."""
    window_block_tokens: tuple[int, ...] | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else tuple(v),
        validator=lambda _inst, _attr, v: _check_window_block_tokens(v),
    )
    """Per KV group, the engine's scheduler block (tokens) of a sliding-window group whose
    out-of-window blocks the engine frees before the push (vLLM: at its ``--block-size``), 0 for
    a group that keeps every block; None: the engine does not say (it frees none). Published
    (``WINDOW_BLOCKS_KEY``) and compared at the handshake: :func:`~kvpush.core.peers.check_window_blocks`."""

    @property
    def heartbeat_s(self) -> float:
        return self.heartbeat_interval_s or self.lease_s / 6

    @property
    def freshness_s(self) -> float:
        return self.fresh_s if self.fresh_s is not None else 2 * self.heartbeat_s

    @property
    def silence_s(self) -> float:
        return self.peer_silence_s or 3 * self.heartbeat_s + self.handshake_timeout_s

    def __attrs_post_init__(self) -> None:
        _check_numbers(self)
        if self.freshness_s >= self.silence_s:
            raise ConfigError(
                f"WorkerConfig.fresh_s ({self.freshness_s:g}s) must be shorter than peer_silence_s "
                f"({self.silence_s:g}s): P must stop writing before D declares it dead"
            )


MAX_SECONDS = float(1 << 40)
"""Largest time bound a ``WorkerConfig`` takes: the wire's bound on a published WRITE deadline
(a finite bound: a deadline of +inf never fires, and one of NaN, in the core's deadline heap,
keeps every later deadline from firing)."""
MAX_POLL_S = 1.0
"""Largest writer poll interval (notifications wait up to one interval to be drained)."""
MAX_TIMER_SLACK_NS = 1_000_000
"""Largest writer timer slack: the kernel may end every timed wait of the writer this much late,
and its polls are 50 µs - 2 ms."""

# field -> (lower bound, lower bound allowed, upper bound, None allowed, what the value means)
_SECONDS: dict[str, tuple[float, bool, float, bool, str]] = {
    "handshake_timeout_s": (0.0, False, MAX_SECONDS, False, ""),
    "request_timeout_s": (0.0, False, MAX_SECONDS, False, ""),
    "lease_s": (0.0, False, MAX_SECONDS, False, ""),
    "registration_ttl_s": (0.0, False, MAX_SECONDS, False, ""),
    "early_notification_ttl_s": (0.0, False, MAX_SECONDS, False, ""),
    "write_deadline_s": (0.0, False, MAX_SECONDS, False, ""),
    "heartbeat_interval_s": (0.0, False, MAX_SECONDS, True, "; None: lease_s / 6"),
    "fresh_s": (0.0, False, MAX_SECONDS, True, "; None: two heartbeat intervals"),
    "peer_silence_s": (0.0, False, MAX_SECONDS, True, "; None: 3 heartbeats + handshake_timeout_s"),
    "engine_ttl_s": (-MAX_SECONDS, True, MAX_SECONDS, False, "; <= 0 never evicts"),
    "close_timeout_s": (0.0, True, MAX_SECONDS, False, ""),
    "keepalive_s": (0.0, True, MAX_SECONDS, False, "; 0 turns it off"),
    "busy_poll_s": (0.0, True, MAX_POLL_S, False, ""),
    "idle_poll_s": (0.0, False, MAX_POLL_S, False, ""),
}
# field -> (lowest, highest, None allowed, what the value means)
_INTS: dict[str, tuple[int, int, bool, str]] = {
    "timer_slack_ns": (0, MAX_TIMER_SLACK_NS, False, "; 0 keeps the default"),
    "staging_bytes": (0, 1 << 40, False, "; 0 disables packing"),
    "side_channel_port": (0, 65535, False, "; a TCP port, 0 only on P"),
    "cuda_device": (0, 1 << 16, True, "; None on CPU"),
}


def _check_numbers(config: WorkerConfig) -> None:
    """Every number of ``config`` of the right type and in its range: a ``ConfigError`` naming
    the field, the value and the range (a bool is no number here, though Python's is an int)."""
    for name, (low, low_ok, high, none_ok, note) in _SECONDS.items():
        value = getattr(config, name)
        if value is None and none_ok:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and (low <= value if low_ok else low < value) and value <= high):
            sign = (">= 0" if low_ok else "positive") if low == 0 else "finite"
            raise ConfigError(
                f"WorkerConfig.{name} must be {sign}: a number of seconds in {'[' if low_ok else '('}"
                f"{low:g}, {high:g}]{note}; got {value!r}"
            )
    for name, (lowest, highest, none_ok, note) in _INTS.items():
        value = getattr(config, name)
        if value is None and none_ok:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= highest:
            raise ConfigError(
                f"WorkerConfig.{name} must be an int in [{lowest}, {highest}]{note}; got {value!r}"
            )


_KEPT_FOR_PROCESS: list[Any] = []


def keep_for_process_life(memory: Any) -> None:
    """Keep ``memory`` (a staging pool) allocated while the process lives: a worker closed with
    a copy that may still read or write it (one no fence or deadline stops) must not hand it
    back to the allocator, whose next allocation of that size would get the same address."""
    _KEPT_FOR_PROCESS.append(memory)


def lease_clock() -> float:
    """Seconds on a clock that keeps counting while the host is suspended (CLOCK_BOOTTIME on
    Linux): a P that wakes from a suspend must see its registrations as stale."""
    return time.clock_gettime(_CLOCK)


_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


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
        """``pm`` is the plugin manager to use (default: :func:`get_plugin_manager`, which loads
        the built-ins and the ``kvpush`` entry points)."""
        self.config = config
        self.pm = pm or get_plugin_manager()
        self._kv_caches = kv_caches
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Lock()
        """Held while no wake-up is pending: :meth:`_signal` releases it, the writer's wait
        takes it back (one C call each way, where an ``Event`` runs a Python condition)."""
        self._wake.acquire()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writer_ready = threading.Event()
        self._writer_error: BaseException | None = None
        self._local_lists: dict[tuple[int, int], int] = {}
        self._results_lock = threading.Lock()
        """Guards what the engine's calls and the writer share (subclasses' results, and
        ``_closing``): a call that starts a request re-checks ``_closing`` under it."""
        self._lifecycle = threading.Lock()
        """Held by ``start()`` and ``close()`` for their whole run: they never interleave."""
        self._lifecycle_holder: tuple[int, str] | None = None
        """(thread id, "start" or "close") holding ``_lifecycle``: a close() on that very thread
        (a signal handler that interrupted it) must not wait for it."""
        self._started = False
        """``start()`` was called (never cleared: a worker starts once)."""
        self._closing = False
        """``close()`` began (set under ``_results_lock``, never cleared): no new request."""
        self._running = False
        self._transport_closed = False
        self._next_eviction = 0.0
        self.core: Any = None
        self.incarnation = config.incarnation or new_incarnation()
        self.transport: Transport | None = None
        self.metadata: AgentMetadata | None = None
        self.peers: PeerRegistry | None = None
        self.dropped_notifications = 0
        self.unauthenticated_notifications = 0
        secret = config.secret if config.secret is not None else os.environ.get("KVPUSH_SIDE_CHANNEL_SECRET")
        self._mac_key = notif_auth.derive_key(secret.encode()) if secret else None
        self._capacity: dict[int, int] | None = None
        self._fresh_until = 0.0
        self._round_started = 0.0
        """``time.monotonic()`` when the writer's current round began (0: between rounds)."""
        self._stall_reported = 0.0
        self.writer_stalls = 0
        """Writer rounds that ran past ``WRITER_STALL_S`` (each logged with the writer's stack)."""
        """``time.monotonic()`` until which the writer polls every ``FRESH_POLL_S`` (P: set by
        each post; a GPU copy is done within a few hundred microseconds, and for ``cuda_ipc``
        D's DONE goes out only at the poll that sees it)."""
        self.staging: Any = None
        """Packed-transfer staging pool (:class:`kvpush.core.packing.StagingPool`), once started."""
        self.packer: Any = None
        self.registered_caches: RegisteredCaches | None = None
        """The ``kv_caches`` tensors registered at start (checked by the calls that start a
        request: a tensor the engine replaced since is refused, never moved silently)."""

    # ------------------------------------------------------------------ start-up

    @property
    def agent_name(self) -> str:
        p = self.config.parallel
        return f"{self.config.engine_id}-{self.role.value}-pp{p.pp_rank}-tp{p.tp_rank}"

    def start(self) -> AgentMetadata:
        """Describe and register the KV regions, create the agent, start the writer thread.

        Everything made so far is released again when a later step fails. A worker starts
        once: a second ``start()`` (after the first, or on another thread while it runs) raises
        ``ConfigError``, and so does a ``start()`` after ``close()`` began. A ``close()`` on
        another thread while this runs makes it stop before the writer starts (releasing what
        it made, ``ConfigError``), or, past that point, waits for it and then closes."""
        if not self._lifecycle.acquire(blocking=False):
            raise ConfigError(
                f"start() of {self.agent_name} refused: another thread is starting or closing this "
                f"worker right now; call start() once, from one thread"
            )
        self._lifecycle_holder = (threading.get_ident(), "start")
        try:
            if self._started:
                closed = " and closed" if self._closing else ""
                raise ConfigError(
                    f"{self.agent_name} was already started{closed}; make a new worker to restart"
                )
            if self._closing:
                raise ConfigError(f"{self.agent_name} was closed; make a new worker to start again")
            self._started = True
            try:
                return self._start()
            except BaseException:  # also a signal handler's exception, wherever it struck
                self._abandon_start()
                raise
        finally:
            self._lifecycle_holder = None
            self._lifecycle.release()

    def _abandon_start(self) -> None:
        """start() failed or was interrupted: stop the writer if it started (never release
        under a live writer: it polls the transport), then release what start() made."""
        self._running = False
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._stop.set()
            self._signal()
            thread.join(timeout=WRITER_STOP_S)
            if thread.is_alive():
                logger.error(
                    "writer of %s did not stop within %gs after start() failed; its transport is left open",
                    self.agent_name,
                    WRITER_STOP_S,
                )
                return
        self._release_resources()

    def _start(self) -> AgentMetadata:
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
        regions = layout.describe(self._kv_caches, self.config.parallel, self.config.model)  # rules checked
        if not regions:
            raise ConfigError(f"layout {layout.name!r} described no KV regions")
        self.registered_caches = RegisteredCaches(self._kv_caches, regions)
        if len({r.mem_type for r in regions}) > 1:
            raise ConfigError("KV caches mix DRAM and VRAM; put every layer on one device type")
        provider = self.pm.transport(self.config.transport)
        self.transport = provider.create(
            TransportConfig(agent_name=self.agent_name, options=dict(self.config.transport_options))
        )
        if self.role is Role.DECODE:
            missing = [m for m in ("fence_peer", "fenced") if not callable(getattr(self.transport, m, None))]
            if missing:
                # D releases a failed request's blocks only once the transport confirmed that
                # nothing P sent can still land; without the fence it has nothing to confirm.
                raise ConfigError(
                    f"transport {self.config.transport!r} has no {' / '.join(missing)}: a decode "
                    f"rank needs the fence (fence_peer, fenced; docs/plugins.md) before it may give "
                    f"back blocks a failed P may have been writing"
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
            incarnation=self.incarnation,
        )
        core_fields = {
            WRITE_DEADLINE_KEY: self.config.write_deadline_s,
            WRITES_ABORTABLE_KEY: bool(getattr(self.transport, "writes_abortable", True)),
            BLOCK_PAIRING_KEY: BLOCK_PAIRING,
            RESULT_ATTEMPTS_KEY: True,
            ANSWER_ATTEMPTS_KEY: True,
            UNREGISTERED_CANCELS_KEY: True,
            PROCESS_KEY: this_process(),
            **staging,
        }
        if self.config.window_block_tokens is not None:
            core_fields[WINDOW_BLOCKS_KEY] = list(self.config.window_block_tokens)
        ended = ended_workers.ended_here(self.transport.agent_name)
        if ended:
            core_fields[ended_workers.ENDED_KEY] = ended
        from kvpush.core.packing import STAGING_KEY

        reserved = {
            *core_fields,
            ended_workers.ENDED_KEY,
            STAGING_KEY,
            WINDOW_BLOCKS_KEY,
        }  # also when not set here
        extra = self.pm.metadata_extensions(meta, reserved=reserved)
        self.metadata = attrs.evolve(meta, extensions={**extra, **core_fields})
        self.peers = PeerRegistry(
            pm=self.pm,
            local=self.metadata,
            transport=self.transport,
            run_on_writer=self.run_on_writer,
            timeout_s=self.config.handshake_timeout_s,
        )
        self._make_core()
        with self._results_lock:  # against close(), which sets _closing under it
            if self._closing:
                raise ConfigError(
                    f"close() of {self.agent_name} was called on another thread while start() ran: "
                    f"nothing was started (what start() made is released); make a new worker"
                )
            self._thread = threading.Thread(
                target=self._writer_loop, name=f"kvpush-writer-{self.agent_name}", daemon=True
            )
            self._running = True
        self._thread.start()
        if not self._writer_ready.wait(WRITER_START_S) or self._writer_error is not None:
            self._running = False
            self._stop.set()
            self._signal()
            err = self._writer_error
            why = f"{type(err).__name__}: {err}" if err else f"it did not start within {WRITER_START_S:g}s"
            raise ConfigError(
                f"the writer thread of {self.agent_name} could not start ({why}); check "
                f"cuda_device={self.config.cuda_device!r} and timer_slack_ns={self.config.timer_slack_ns!r}"
            ) from err
        return self.metadata

    def _make_core(self) -> None:
        raise NotImplementedError

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

    def _check_running(self, call: str) -> None:
        if not self._running:
            if self._closing or self._stop.is_set():
                raise ConfigError(
                    f"{call} on {self.agent_name}, which is closed; make and start a new worker"
                )
            raise ConfigError(f"{call} on {self.agent_name}, which is not started; call start() first")

    def _check_accepting(self, call: str) -> None:
        """A call that starts a request: refused (``ConfigError``) unless the worker runs and no
        ``close()`` began. Called before the work and again under ``_results_lock`` (where
        ``close()`` sets ``_closing``): a request is either held when close() looks (and
        reported by it) or refused, never queued to a writer that is gone."""
        if self._closing and self._running:
            raise ConfigError(
                f"{call} on {self.agent_name}, which is closing (close() runs on another thread): "
                f"the request was not taken; nothing was sent for it, so its blocks are the "
                f"engine's to free"
            )
        self._check_running(call)

    def _check_caches(self, call: str) -> None:
        """``ConfigError`` naming the cache when a tensor registered at start is no longer the
        engine's (:meth:`RegisteredCaches.check`; a few microseconds when nothing changed)."""
        caches = self.registered_caches
        if caches is not None:
            caches.check(call, self.agent_name)

    def _check_blocks(self, request_id: Any, block_ids: Any, what: str) -> Any:
        """Validate an engine's request id and block ids (ConfigError naming the argument)."""
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {request_id!r}")
        blocks = to_block_ids(block_ids)
        assert self.metadata is not None
        capacity = self._capacity
        if capacity is None:  # per KV group: the fewest blocks of its regions (fixed after start)
            capacity = {}
            for region in self.metadata.regions:
                capacity[region.kv_group] = min(
                    capacity.get(region.kv_group, region.num_blocks), region.num_blocks
                )
            self._capacity = capacity
        if any(blocks) and max(capacity) >= len(blocks):
            raise ConfigError(
                f"{what} of {request_id!r} give ids of {len(blocks)} KV group(s), and this rank holds "
                f"KV groups {sorted(capacity)}: pass one id list per KV group of the model, "
                f"((ids of group 0), (ids of group 1), ...) (a flat list is group 0 alone)"
            )
        unheld = False
        for group, ids in enumerate(blocks):
            if len(set(ids)) != len(ids):
                raise ConfigError(
                    f"{what} of {request_id!r} repeat a block id in group {group}: {list(ids)[:16]}"
                )
            if group not in capacity:
                # A group of the model this rank holds no layer of (a PP stage of a hybrid
                # model): the engine hands every stage all groups' ids; nothing of it moves here.
                # A rank holding every layer holds every group, and so does a stage whose
                # ModelSpec lists the groups up to their count (vLLM's lists none: unbounded).
                model = self.config.model
                whole = self.config.parallel.pp_size == 1
                if ids and (whole or (model.layer_groups and group >= model.num_groups)):
                    held = len(capacity) if whole else model.num_groups
                    raise ConfigError(f"{what} of {request_id!r} name KV group {group}; the model has {held}")
                unheld = True
                continue
            if ids and max(ids) >= capacity[group]:
                raise ConfigError(
                    f"{what} of {request_id!r}: block id {max(ids)} is beyond group {group}'s "
                    f"{capacity[group]} blocks"
                )
        if unheld and self.role is Role.PREFILL:
            # Tell the trim which groups move from this rank: the ids of a group it holds no
            # layer of are the engine's count (e.g. vLLM's scheduler blocks where D counts
            # kernel blocks), never checked against D's nor used.
            return HeldBlockIds(blocks, frozenset(capacity))
        return blocks

    # ------------------------------------------------------------------ writer thread

    def run_on_writer(self, command: Callable[[], None]) -> None:
        """Queue ``command`` for the writer thread and wake it."""
        self._commands.put(command)
        self._signal()

    def _signal(self) -> None:
        """Wake the writer (at most one wake-up is pending; a second one is the same)."""
        try:  # noqa: SIM105 (contextlib.suppress costs a context manager on every request)
            self._wake.release()
        except RuntimeError:  # already released: a wake-up is pending
            pass

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
        try:
            set_timer_slack(self.config.timer_slack_ns)
            if self.config.cuda_device is not None:
                import torch

                torch.cuda.set_device(self.config.cuda_device)
        except BaseException as err:  # start() reports it; the rank must not look alive
            self._writer_error = err
            return
        finally:
            self._writer_ready.set()
        watch_writer(self)
        while not self._stop.is_set():
            self._round_started = time.monotonic()
            try:
                self._step()
            except BaseException:  # a plugin's SystemExit must not end the rank's only writer
                logger.exception("kvpush writer of %s hit an error; continuing", self.agent_name)
            finally:
                self._round_ended(time.monotonic())
            timeout = self.config.busy_poll_s if self._busy() else self.config.idle_poll_s
            if self._fresh_until and time.monotonic() < self._fresh_until:
                timeout = min(timeout, FRESH_POLL_S)  # a WRITE was just posted: see it end soon
            deadline = self._next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - lease_clock()))
            self._wake.acquire(timeout=timeout)  # a pending wake-up returns at once (consumed)

    def check_stall(self, now: float) -> None:
        """Log (once a round) a writer round running past ``WRITER_STALL_S``, with where the
        writer is: every request of the rank waits behind it, its deadlines too, and a plugin
        hook or transport call that never returns would hang them all without a word."""
        started, thread = self._round_started, self._thread
        if not started or now - started < WRITER_STALL_S or self._stall_reported == started:
            return
        self._stall_reported = started
        self.writer_stalls += 1
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        where = "".join(traceback.format_stack(frame)[-STALL_FRAMES:]) if frame is not None else "?\n"
        logger.error(
            "the writer of %s has been in one round for %.1fs: every request of this rank (its "
            "deadlines too) waits until it returns; it is in:\n%s",
            self.agent_name,
            now - started,
            where.rstrip(),
        )

    def _round_ended(self, now: float) -> None:
        started, self._round_started = self._round_started, 0.0
        if started and self._stall_reported == started:
            logger.warning("the writer of %s went on after a round of %.1fs", self.agent_name, now - started)

    def _step(self) -> None:
        """One round: notifications first (so a CANCEL is seen before a queued post), then
        commands, then WRITE polling and timers; actions run after each input."""
        self._drain_notifications()
        self._run_commands()
        self._poll(lease_clock())
        self._timers(lease_clock())
        now = time.monotonic()
        if now >= self._next_eviction:
            self._next_eviction = now + 1.0
            core = self.core
            for engine_id in self._evict_idle_engines(now, core.busy_engines()):
                core.forget_engine(engine_id)

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
        try:
            batch = self.transport.drain_notifs()
        except Exception as err:  # a transport must not stop the loop
            logger.warning("draining notifications of %s failed: %s", self.agent_name, err)
            return
        for peer, frame in batch:
            message = self._unseal(peer, frame)
            if message is None:
                continue
            try:
                notification = self.pm.decode_notification(message)
            except WireError as err:
                self.dropped_notifications += 1
                logger.warning("dropped a malformed notification from %s: %s", peer, err)
                continue
            except Exception as err:
                self.dropped_notifications += 1
                logger.warning("a notification decoder raised on a message from %s: %r", peer, err)
                continue
            if notification is None:
                self.dropped_notifications += 1
                logger.warning("dropped a notification from %s no plugin understands: %r", peer, message[:64])
                continue
            try:
                self._on_notification(peer, notification)
            except Exception:  # isolated: the rest of the batch is still handled
                logger.exception("handling a %s from %s failed", notification.kind.value, peer)
        self._flush()

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

    def _unseal(self, peer: str, frame: bytes) -> bytes | None:
        """The notification inside ``frame``; None (dropped, counted) when a secret is set and
        its MAC does not prove it came from ``peer`` for this agent and incarnation."""
        if self._mac_key is None:
            return frame
        message = notif_auth.unseal(self._mac_key, peer, self.agent_name, self.incarnation, frame)
        if message is None:
            self.unauthenticated_notifications += 1
            logger.warning("dropped an unauthenticated notification from %s (%d bytes)", peer, len(frame))
        return message

    def _sealed(self, agent: str, message: bytes) -> bytes:
        """``message`` as it goes to ``agent``: with a MAC when a secret is set."""
        if self._mac_key is None:
            return message
        assert self.peers is not None
        incarnation = self.peers.incarnation_of(agent)
        return notif_auth.seal(self._mac_key, self.agent_name, agent, incarnation, message)

    def _send(self, agent: str, message: bytes) -> str:
        """Send one notification; the error text when the transport refused ("" when sent)."""
        assert self.transport is not None
        message = self._sealed(agent, message)
        try:
            self.transport.send_notif(agent, message)
        except Exception as err:
            logger.warning("notification to %s failed: %s", agent, err)
            return f"{type(err).__name__}: {err}"
        return ""

    def _on_notification(self, peer: str, notification: Notification) -> None:
        raise NotImplementedError

    def _poll(self, now: float) -> None:
        raise NotImplementedError

    def _timers(self, now: float) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        """Run actions collected while draining (P posts only after the whole batch)."""

    def _next_deadline(self) -> float | None:
        return None

    def _busy(self) -> bool:
        raise NotImplementedError

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the writer, then release every handle, peer and registration.

        From the moment close() begins, calls that start a request (``request_finished``,
        ``add_request``) raise ``ConfigError``; one that took the results lock before is held
        and reported like every pending request. close() and start() never interleave: a
        close() while start() runs on another thread waits for it (at most
        ``start_wait_s``; a start() that had not started the writer yet stops and releases
        what it made), then closes; a second close() waits for the first and finds it closed.

        Memory is never released under a live writer: if the writer does not stop within
        ``WRITER_STOP_S`` (10 s), the transport is left open (and an error logged) rather than
        freed under it.

        A close() that cannot take the results lock within ``CLOSE_LOCK_WAIT_S`` (held by a
        kvpush call on this very thread that a signal handler interrupted) raises
        ``ConfigError`` and changes nothing, rather than wait for ever.

        A close() on the thread running start() or close() (a signal handler that interrupted
        it) does not wait for it: during start() it raises ``ConfigError``, which abandons that
        start() (its writer stopped first, then everything released); during close() it
        returns, the running close() finishing the job.

        close() on the writer thread itself (from a plugin hook, a transport callback or a
        ``ready.query()``, which run there) raises ``ConfigError`` and changes nothing: it would
        wait for the writer it runs on."""
        if self._thread is not None and threading.current_thread() is self._thread:
            raise ConfigError(
                f"close() of {self.agent_name} was called on its writer thread (from a plugin hook, "
                f"a transport callback or a ready.query()): it would wait for the writer it runs on "
                f"and release nothing; nothing was changed. Call close() from another thread"
            )
        holder = self._lifecycle_holder
        if holder is not None and holder[0] == threading.get_ident():
            # A signal handler interrupted start() or close() on this very thread: waiting for
            # it would wait for ever (bounded only by start_wait_s, then closing nothing).
            if holder[1] == "close":
                logger.warning(
                    "close() of %s called again while it closes on this thread (a signal "
                    "handler): the running close() finishes the job",
                    self.agent_name,
                )
                return
            self._closing = True  # no lock: this thread runs the start() it would order against
            raise ConfigError(
                f"close() of {self.agent_name} interrupted its start() on this thread (a signal "
                f"handler): the start() is abandoned, its writer stopped and what it made "
                f"released; make a new worker to start again"
            )
        if not self._results_lock.acquire(timeout=CLOSE_LOCK_WAIT_S):
            raise ConfigError(
                f"close() of {self.agent_name} could not take the worker's results lock within "
                f"{CLOSE_LOCK_WAIT_S:g}s: it is held by a kvpush call that does not return, most "
                f"likely on this very thread (close() from a signal handler that interrupted "
                f"add_request, request_finished or get_finished); nothing was changed. Call "
                f"close() from another thread, or once the interrupted call returned"
            )
        try:
            self._closing = True
        finally:
            self._results_lock.release()
        wait_s = self.start_wait_s
        if not self._lifecycle.acquire(timeout=wait_s):
            logger.error(
                "close() of %s waited %gs for a start() or close() running on another thread and "
                "returns without closing; a start() still running sees the close and releases what "
                "it made, a close() still running finishes the job",
                self.agent_name,
                wait_s,
            )
            return
        self._lifecycle_holder = (threading.get_ident(), "close")
        try:
            self._close()
        finally:
            self._lifecycle_holder = None
            self._lifecycle.release()

    @property
    def start_wait_s(self) -> float:
        """Bound on close()'s wait for a start() or close() on another thread: a start() past
        its last close check ends within ``WRITER_START_S``, a close() within
        ``close_timeout_s`` plus the writer's 10 s stop bound (plus margin)."""
        return WRITER_START_S + self.config.close_timeout_s + 20.0

    def _close(self) -> None:
        was_running = self._running
        if was_running and self._thread is not None and self._thread.is_alive():
            self._before_stop()
        self._running = False
        self._stop.set()
        self._signal()
        if self._thread is not None:
            self._thread.join(timeout=WRITER_STOP_S)
            if self._thread.is_alive():
                logger.error(
                    "writer of %s did not stop within %gs; its transport is left open",
                    self.agent_name,
                    WRITER_STOP_S,
                )
                return
        if was_running:
            self._closed()
        self._release_resources()

    def _before_stop(self) -> None:
        """Runs in ``close()`` while the writer still runs (bounded): tell peers we are going."""

    def _closed(self) -> None:
        """Report what is still pending as failed (the writer has stopped)."""

    def _release_resources(self) -> None:
        if self.peers is not None:
            self.peers.close()
        if self.transport is not None and not self._transport_closed:
            self._transport_closed = True
            self.transport.close()
        self.registered_caches = None  # its memory is the engine's again (or kept, see _closed)

    def __enter__(self) -> RankWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


PR_SET_TIMERSLACK = 29
PR_GET_TIMERSLACK = 30


def set_timer_slack(ns: int) -> bool:
    """Set the calling thread's timer slack to ``ns`` nanoseconds (Linux; ``ns`` <= 0 or
    another system: nothing). Returns whether it was set."""
    if ns <= 0 or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl in this libc
        return False


def new_incarnation() -> str:
    """A fresh incarnation id: start time first (so later starts sort after earlier ones and a
    late message of a replaced start is recognised as stale), then random bits."""
    return f"{time.time_ns():016x}{os.urandom(4).hex()}"


WRITER_STALL_S = 2.0
"""A writer round running longer than this is logged with the writer's stack (``check_stall``)."""
STALL_FRAMES = 8
"""Innermost frames of the writer's stack that the stall log shows."""
WATCH_INTERVAL_S = 0.5

_watched: weakref.WeakSet[Any] = weakref.WeakSet()
_watch_lock = threading.Lock()
_watchdog: threading.Thread | None = None


def watch_writer(worker: Any) -> None:
    """Have the process's watchdog thread (one, started on first use) check ``worker``'s
    writer for stalled rounds (:meth:`RankWorker.check_stall`); a worker no one holds any more
    drops out by itself."""
    global _watchdog
    with _watch_lock:
        _watched.add(worker)
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog = threading.Thread(target=_watch_loop, name="kvpush-writer-watchdog", daemon=True)
            _watchdog.start()


def _watch_loop() -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        now = time.monotonic()
        with _watch_lock:
            workers = list(_watched)
        for worker in workers:
            try:
                worker.check_stall(now)
            except Exception:  # the watchdog must outlive any one worker
                logger.exception("kvpush writer watchdog: checking %r failed", worker)
        del workers


WRITER_START_S = 60.0
"""Bound on the writer thread's set-up (timer slack, CUDA device: the first torch import)."""

WRITER_STOP_S = 10.0
"""Bound on the wait for the writer thread to stop (close(), an abandoned start())."""

CLOSE_LOCK_WAIT_S = 5.0
"""Bound on close()'s wait for the results lock (held for microseconds by the engine calls;
held for ever only by a call on close()'s own thread that a signal handler interrupted)."""

FRESH_POLL_S = 50e-6
"""The writer's poll interval for ``FRESH_WINDOW_S`` after a post (instead of ``busy_poll_s``)."""
FRESH_WINDOW_S = 2e-3

WRITE_DEADLINE_KEY = "write_deadline_s"
"""Metadata extension where a P rank publishes its WRITE deadline (D's quarantine needs it)."""
WRITES_ABORTABLE_KEY = "writes_abortable"
"""Metadata extension where a rank says whether its transport can take back a posted WRITE
(False for kernel copies, ``cuda_ipc``): D holds such a P's failed requests until it
acknowledges or its process exited, instead of fencing and releasing (a fence does not stop a
launched copy)."""
BLOCK_PAIRING_KEY = "block_pairing"
"""Metadata extension where a rank states how it pairs a request's blocks with D's:
``BLOCK_PAIRING`` (by the start D states in its PUSH_REG, notification format 2.2). A P that
does not state it is an older release that pairs from the end of its block table and ignores
D's start: D refuses its handshake rather than let it write another position's KV."""
BLOCK_PAIRING = "start"
WINDOW_BLOCKS_KEY = "window_block_tokens"
"""Metadata extension where a rank states ``WorkerConfig.window_block_tokens``: per KV group,
the block (tokens) at which its engine frees a sliding window's blocks, 0 for a group it keeps
whole. Absent: not stated (an engine that frees no window blocks)."""
RESULT_ATTEMPTS_KEY = "result_attempts"
"""Metadata extension where a P rank states (True) that every DONE, FAIL and CANCEL_ACK it sends
echoes the registration attempt of D's PUSH_REG or CANCEL (notification format 2.7): D then
refuses a result of it that names none. A P that does not state it is an older release, whose
results D takes without one (as before)."""
ANSWER_ATTEMPTS_KEY = "answer_attempts"
"""Metadata extension where a P rank states (True) that each entry of its heartbeat answers'
``want``, ``failed`` and ``unknown`` names the registration attempt it speaks of (notification
format 2.8): D then acts on an entry only for the request of that attempt and refuses one naming
none. A P that does not state it is an older release, whose entries D takes by key (as before)."""
UNREGISTERED_CANCELS_KEY = "unregistered_cancels"
"""Metadata extension where a P rank states (True) that it takes D's CANCEL of a registration it
never held (D's request ended before it registered) as that D request's alone: it ends a
finished prefill only when nothing else is held for the key (notification format 2.8). D sends
such a CANCEL only to a P that states it: an older release judged it as the cancel of the key,
failing another D request of the key held on another rank; it keeps its lease instead."""
