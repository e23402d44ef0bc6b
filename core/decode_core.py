"""The D protocol core: a pure state machine for one decode rank (no I/O, no threads, no clock).

Events in (each takes ``now``, seconds on the driver's clock): :meth:`DecodeCore.add`,
:meth:`~DecodeCore.cancel`, :meth:`~DecodeCore.connected`, :meth:`~DecodeCore.notification`,
:meth:`~DecodeCore.scattered`, :meth:`~DecodeCore.unreachable`, :meth:`~DecodeCore.handle_timer`.
Actions out: :mod:`kvpush.core.actions`. :meth:`~DecodeCore.next_deadline` says when to call
``handle_timer`` next; deadlines sit in a heap, so a timer costs O(expired).

The rules it keeps (docs/reliability.md):

- **Completion from the plan.** A request waits for exactly the producer set P's published
  ``ParallelConfig`` gives this rank (``kvpush_expected_producers``). Sizes the router passed that
  disagree with P's fail the request at once, naming both. A DONE counts only when its producer is
  in the set, it came from that producer's agent, and it states P's TP size; anything else is
  dropped and counted in ``stats["rejected_notifications"]``.
- **One exit.** Every request is reported exactly once (done, failed or cancelled) and its blocks
  released exactly once (a done request's blocks belong to the engine).
- **Quarantine, then a fence; never a timer alone.** A failed or cancelled request is reported at
  once, but its blocks are released only when no byte of P's can land in them any more: every
  producer that may have written acknowledged with its WRITE complete (DONE, or a FAIL/CANCEL_ACK
  saying nothing it posted is unsettled), or P's connections were *fenced*: the transport tore
  down every connection that can carry their data and confirmed it (:class:`Fence`, answered by
  :meth:`DecodeCore.fenced`). A producer that says a WRITE ended unsettled (aborted, failed) is
  fenced at once; a silent one once ``last grant + fresh_s + P's WRITE deadline`` (+ a margin) has
  passed, when P may not post any more. A timer alone never releases blocks: TCP keeps a
  partitioned sender's bytes for minutes and delivers them when the network returns.
- **Copies no fence stops.** A P whose transport copies with kernels (``cuda_ipc``) publishes
  ``writes_abortable: false``: neither its WRITE deadline nor D's fence stops a launched copy.
  Such a producer's requests are held, not fenced: their blocks go back only once it
  acknowledged (P keeps waiting for an overdue copy and answers when it ended) or its process
  is seen to have exited.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import attrs

from kvpush.core import notifications as wire
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
from kvpush.core.addresses import host_port
from kvpush.core.deadlines import Deadlines, RateLimit, RecentIds
from kvpush.core.types import (
    Notification,
    NotificationKind,
    PackManifest,
    PushRegistration,
    RankKey,
    RequestMetadata,
)
from kvpush.core.wire import HELLO_REQUEST_ID

logger = logging.getLogger(__name__)

_DONE = NotificationKind.DONE
HEARTBEAT_KEYS_PER_MESSAGE = 256
ENDED_MEMORY = 4096
"""How many ended request ids D remembers, to tell late duplicates from early notifications."""
MAX_UNTOLD_CANCELS = 1024
"""Cancels of requests that never registered kept per P engine until its handshake is done
(the oldest dropped first: P's lease then releases what it holds for them)."""
ENGINE_PROBE = "\0engine:"
"""``ProbeExit`` request id prefix of a probe of a P engine's silent agents (not a request's)."""


@attrs.frozen(kw_only=True)
class DecodeSettings:
    """The D rank's identity and the bounds the core enforces (seconds)."""

    engine_id: str
    incarnation: str
    tp_rank: int
    tp_size: int
    host: str
    port: int
    request_timeout_s: float = 120.0
    heartbeat_interval_s: float = 5.0
    peer_silence_s: float = 20.0
    fresh_s: float = 10.0
    """Freshness window granted to P with each PUSH_REG/HB (shorter than ``peer_silence_s``)."""
    hello_timeout_s: float = 5.0
    keepalive_s: float = 600.0
    """How long after its last request a P engine's grants are kept fresh while idle."""
    early_ttl_s: float = 30.0
    early_cap_per_peer: int = 1024
    quarantine_margin_s: float = 1.0
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 30.0


@attrs.frozen(kw_only=True)
class ProducerInfo:
    """What D's notif-only handshake learned about a P engine (from P's published metadata)."""

    prefill_pp: int
    prefill_tp: int
    agents: Mapping[RankKey, str]
    """The agent of every producer that writes into this D rank."""
    incarnations: Mapping[str, str]
    """Incarnation of each producer agent (every P rank process has its own)."""
    write_deadline_s: float
    """P's bound on a WRITE in flight (published by P)."""
    writes_abortable: bool = True
    """False when P's WRITEs may be kernel copies that neither P's deadline nor a fence stops
    (published by P; the receiver reads a P that does not say as False)."""
    processes: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    """Process identity of each producer agent (published by P; empty when it does not say):
    what D checks to learn that a process whose copies no fence stops has exited."""
    shares: Mapping[RankKey, frozenset[tuple[int, Any, Any]]] = attrs.field(factory=dict)
    """Per producer, the ``(D region, block slice start, end)`` pieces (fractions of a block)
    its plan writes into this rank, as the handshake checked them: its packed DONEs must name
    exactly these (a producer missing here is not checked)."""
    ended: Mapping[str, Mapping[str, bool]] = attrs.field(factory=dict)
    """Per producer agent, earlier incarnations of it that ended in its process with nothing
    in flight (each said goodbye) -> whether a WRITE of it ever ended unsettled (published by
    P; a goodbye's ``BYE`` may have been lost)."""
    echo_attempts: frozenset[str] = frozenset()
    """The producer agents that stated (``result_attempts``) that each of their results echoes
    the registration attempt it answers: a result of theirs that names none is refused."""
    answer_attempts: frozenset[str] = frozenset()
    """The producer agents that stated (``answer_attempts``) that each entry of their heartbeat
    answers names the attempt it speaks of: D acts on one only for that attempt's request, and
    refuses one naming none."""
    unregistered_cancels: frozenset[str] = frozenset()
    """The producer agents that stated (``unregistered_cancels``) that they take the CANCEL of a
    registration they never held as that D request's alone: only they are told of a request
    that ended before it registered (an older P judged it as the cancel of the key)."""


class _EngineState(enum.Enum):
    CONNECTING = "connecting"
    HELLO = "hello"
    READY = "ready"
    FAILED = "failed"


@attrs.define(eq=False)
class _Producer:
    """A P engine as this D rank sees it."""

    engine_id: str
    host: str
    port: int
    state: _EngineState = _EngineState.CONNECTING
    info: ProducerInfo | None = None
    fenced_while_connecting: bool = False
    """A fence went out while a handshake ran: its result may be the fenced agents; redo it."""
    waiting: list[str] = attrs.field(factory=list)
    """Requests waiting for the engine to be ready."""
    hello_pending: set[str] = attrs.field(factory=set)
    hello_id: int = 0
    """The id of the HELLO attempt running (or last made): a refusal echoing another is late."""
    stamps: dict[str, float] = attrs.field(factory=dict)
    """Newest stamp per P agent (P's clock, opaque here): echoed back as the grant."""
    stamped: dict[str, float] = attrs.field(factory=dict)
    """When each agent's newest stamp arrived (D's clock): an idle agent's is renewed."""
    stamp_seq: dict[str, int] = attrs.field(factory=dict)
    """The core's event sequence number when each agent's newest stamp arrived."""
    last_request: float = float("-inf")
    """When a request last registered with this engine (D's clock)."""
    heard: dict[str, float] = attrs.field(factory=dict)
    """When each agent was last heard from (D's clock), while D asks it about requests."""
    asked: dict[str, float] = attrs.field(factory=dict)
    """When D sent each idle agent the oldest keepalive it has not answered (D's clock)."""
    requests: set[str] = attrs.field(factory=set)
    error: str = ""
    failures: int = 0
    failed_at: float = 0.0
    dead: Mapping[str, str] = attrs.field(factory=dict)
    """The incarnations of the agents loaded when it last failed: a handshake loading them
    again does not lengthen the backoff (P's side channel still serves a process that stopped
    answering, e.g. while a restarted rank starts); one loading a new incarnation resets it."""
    previous: ProducerInfo | None = None
    """While reconnecting: what the engine's agents were (to spot a P restart)."""
    refused: bool = False
    """The last handshake failed because a producer refused this rank's metadata."""
    answering: Mapping[str, str] = attrs.field(factory=dict)
    """The incarnations a refused handshake loaded (no producer set; see :meth:`DecodeCore.
    connected`): while the engine has no ``info``, who answers under each agent name."""
    restarting: str = ""
    """Why a loaded incarnation ended (it said goodbye, or its process exited); "" when none
    did. Until the engine is ready again, but at most ``peer_silence_s``, a handshake that
    fails (P's side channel still names the old process, or does not answer while the rank
    starts) fails no request: the next attempt comes after the backoff."""
    restart_expired: bool = False
    """``peer_silence_s`` passed since the restart was seen: the attempt running or made now
    is the last; if it fails too, the requests waiting fail (:meth:`DecodeCore._on_restart_timeout`)."""
    untold: OrderedDict[str, bytes] = attrs.field(factory=OrderedDict)
    """Request id -> the CANCEL of a request that ended before it registered, made while the
    engine was not ready: sent to its producers once it is (at most ``MAX_UNTOLD_CANCELS``), so
    that P lets go of a finished prefill it holds for the request instead of waiting for its
    lease."""


class _Phase(enum.Enum):
    WAITING = "waiting"
    """Added; waiting for P's engine (handshake, HELLO)."""
    REGISTERED = "registered"
    """PUSH_REG sent; counting producers."""
    CLOSING = "closing"
    """Failed or cancelled and reported; blocks quarantined until no WRITE can land."""


@attrs.define(eq=False)
class _Receive:
    meta: RequestMetadata
    key: str
    engine_id: str
    phase: _Phase = _Phase.WAITING
    expected: frozenset[RankKey] = frozenset()
    reported: set[RankKey] = attrs.field(factory=set)
    settled: set[RankKey] = attrs.field(factory=set)
    """Producers that can no longer write (DONE, FAIL or CANCEL_ACK)."""
    chunks: dict[RankKey, set[int]] = attrs.field(factory=dict)
    arrived: dict[RankKey, set[int]] = attrs.field(factory=dict)
    """Packed chunks whose DONE arrived, per producer (scattered or not)."""
    manifests: dict[RankKey, list[PackManifest]] = attrs.field(factory=dict)
    """Each producer's packed DONEs so far, checked against each other (``check_chunks``)."""
    staging_offset: int = -1
    last_grant: float | None = None
    """When D last sent a message carrying a grant for this request (D's clock)."""
    cancelled: bool = False
    write_in_flight: bool = False
    agents: Mapping[RankKey, str] = attrs.field(factory=dict)
    """The expected producers' agents (from the handshake), for the DONE hot path."""
    prefill_tp: int = 0
    write_deadline_s: float = 0.0
    writes_abortable: bool = True
    """From P's handshake: False when a fence does not stop P's WRITEs (kernel copies)."""
    """P's published WRITE deadline (the quarantine bound needs it after P is gone)."""
    processes: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    """The producers' process identities (from the handshake), checked while held."""
    incarnations: Mapping[str, str] = attrs.field(factory=dict)
    """The producers' incarnations when it registered: while held, only they can answer."""
    held: bool = False
    """Quarantined past its end, waiting for a producer whose copies no fence stops."""
    settle_seq: int = -1
    """The fence sequence number when one of its producers last settled: only a fence issued
    after that covers the WRITEs they may have posted until then."""
    unknown_strikes: dict[str, int] = attrs.field(factory=dict)
    """Per producer agent, heartbeat answers in which it said it never heard of the request
    (two from one agent: its PUSH_REG was lost)."""
    reason: str = ""
    """Why the request is closing (the cancel report names it once the blocks are released)."""
    unsettled: set[RankKey] = attrs.field(factory=set)
    """Producers that said a WRITE of theirs ended unsettled: their connections must be fenced."""
    fence_id: int | None = None
    """The fence this request's blocks wait for (released when the driver confirms it)."""
    grants: dict[str, float | None] = attrs.field(factory=dict)
    """The grant its PUSH_REG carried to each producer agent: P's ``failed`` answer stamped
    earlier than it is not about this registration (P holds it as a new attempt's)."""
    awaiting: set[str] = attrs.field(factory=set)
    """Producer agents whose fresh stamp it waits for before registering (its key ended here)."""
    refreshed: bool = False
    unanswered: set[str] = attrs.field(factory=set)
    """Producer agents silent when its quarantine ended (released on a fence, not an answer):
    P may still hold its registration (stale: nothing renews it), acknowledged before the key
    registers again here (:meth:`DecodeCore._owed_cancels`)."""
    acks: set[str] = attrs.field(factory=set)
    """Producer agents whose acknowledgement of an earlier registration's CANCEL it waits for
    before registering (see :meth:`DecodeCore._owed_cancels`)."""
    acks_asked: bool = False
    shares: Mapping[RankKey, frozenset[tuple[int, Any, Any]]] = attrs.field(factory=dict)
    """Each producer's pieces of this rank when it registered (``ProducerInfo.shares``): a
    re-registration needs the same ones (another split would leave gaps or overlaps)."""
    gone: dict[str, str] = attrs.field(factory=dict)
    """Producer agents a send to raised (:meth:`DecodeCore.unreachable`) -> why: unless their
    DONE or ``BYE`` settles them within a heartbeat interval, the request fails."""
    done_coming: bool = False
    """A producer that closed said its DONE was sent (its ``BYE`` named the request, or the DONE
    arrived): the request waits for its DONEs or the watchdog, also when the engine's agents
    are dropped afterwards (:meth:`DecodeCore._engine_down`)."""
    echoing: frozenset[str] = frozenset()
    """Its producer agents that echo the attempt in every result (``ProducerInfo.echo_attempts``)."""
    attempt: int = 0
    """This registration attempt's id (``PushRegistration.attempt``): each PUSH_REG and CANCEL
    of it states it, and only a result echoing it (or stating none: an earlier P) counts."""
    rereg: set[RankKey] = attrs.field(factory=set)
    """Producers whose process exited before they wrote (a P rank restarted under its name):
    registered again with the process that serves now, once the old one's connections are
    fenced (``fence_id``) and the engine is handshaken afresh."""


@attrs.define(eq=False)
class _Fence:
    engine_id: str
    issued_at: float
    agents: frozenset[str]
    waiting: set[str] = attrs.field(factory=set)
    why: str = ""


_REGISTERED = _Phase.REGISTERED


class DecodeCore:
    """Protocol state of one D rank. Not thread-safe: one driver thread feeds it."""

    def __init__(
        self, settings: DecodeSettings, *, reserve_staging: Callable[[RequestMetadata], int] | None = None
    ) -> None:
        """``reserve_staging(request)`` reserves the request's packed bytes (-1: none). The
        producer set comes with :class:`ProducerInfo` (the driver asks the plan hook)."""
        self.s = settings
        self._reserve_staging = reserve_staging
        self._requests: dict[str, _Receive] = {}
        self._engines: dict[str, _Producer] = {}
        self._agent_engine: dict[str, str] = {}
        self._early: dict[str, list[tuple[str, Notification]]] = {}
        self._early_count: dict[str, int] = {}
        self._unreachable_errors: dict[str, str] = {}
        """Agent -> the error its send raised, while its exit probe's verdict is awaited."""
        self._exited: dict[str, str] = {}
        """Agent whose send raised and whose process was seen exited -> that incarnation
        (judged a heartbeat interval later: :meth:`_on_exited`)."""
        self._timers = Deadlines()
        self._heartbeat_armed = False
        self._ended = RecentIds(ENDED_MEMORY)
        """Requests that ended here lately: a late DONE for one is a duplicate, not an early one."""
        self._warned = RateLimit(per_s=10)
        self._fences: dict[int, _Fence] = {}
        self._fence_seq = 0
        self._hello_seq = _hello_seed(settings.incarnation)
        """The id of the newest HELLO attempt (to any engine): each attempt's HELLOs carry it.
        It starts from this start's incarnation, so a refusal of a HELLO an earlier process
        under the same agent name sent does not echo a current id."""
        self._attempt_seq = _attempt_seed(settings.incarnation)
        """The id of the newest registration attempt (one per request added): never reused
        within this start, so a result P sent for an earlier request of a reused id, replayed
        (the MAC covers the id it echoes), names another attempt and counts for nothing."""
        self._seq = 0
        """Counts stamps and ends: orders "a stamp arrived" against "a key ended" here."""
        self._unanswered: OrderedDict[tuple[str, str], dict[str, _Owed]] = OrderedDict()
        """(P engine, match key) -> agent -> the CANCEL it owes an ack for (:class:`_Owed`) of
        registrations released on a fence with that producer silent (at most ENDED_MEMORY)."""
        self._unanswered_ids: dict[str, set[tuple[str, str]]] = {}
        """Request id -> the entries of ``_unanswered`` owing a cancel of it (a late CANCEL_ACK
        finds them): several when the engine reused the id under other keys."""
        self._closed: OrderedDict[tuple[str, str], None] = OrderedDict()
        """(P agent, incarnation) of P workers that said goodbye (``BYE``; at most
        ENDED_MEMORY): a handshake loading one again (P's side channel still names the closed
        worker) waits for the next attempt instead of greeting it."""
        self._ended_keys: OrderedDict[tuple[str, str], int] = OrderedDict()
        """(P engine, match key) of requests that ended here lately -> ``_seq`` then: a request
        registering such a key again first gets a stamp issued after it ended."""
        self.stats: dict[str, int] = {
            "push_regs_sent": 0,
            "duplicate_notifications": 0,
            "unknown_notifications": 0,
            "rejected_notifications": 0,
            "cancels": 0,
            "cancel_acks": 0,
            "quarantine_expiries": 0,
            "held_for_kernel_copies": 0,
            "heartbeats_sent": 0,
            "registrations_renewed": 0,
            "keepalives_sent": 0,
            "dead_peers": 0,
            "quarantined": 0,
            "fences": 0,
            "exited_producers": 0,
            "reregistered": 0,
            "reregistrations_refused": 0,
            "late_refusals": 0,
        }

    # ------------------------------------------------------------------ queries

    @property
    def pending(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def busy_engines(self) -> set[str]:
        """P engines some request still needs (never evicted)."""
        return {r.engine_id for r in self._requests.values()}

    def forget_engine(self, engine_id: str) -> None:
        """The driver evicted an idle engine: the next request handshakes again."""
        engine = self._engines.get(engine_id)
        if engine is None or engine.requests:
            return
        if engine.info is not None:
            for agent in engine.info.agents.values():
                self._agent_engine.pop(agent, None)
        del self._engines[engine_id]
        self._timers.disarm(("hello", engine_id))
        self._timers.disarm(("hello_resend", engine_id))

    def holds(self, request_id: str) -> bool:
        """Whether this core has ``request_id`` (added and not yet ended)."""
        return request_id in self._requests

    def state_sizes(self) -> dict[str, int]:
        """Counts of everything the core tracks (flat under load; tests assert it drains)."""
        return {
            "requests": len(self._requests),
            "engines": len(self._engines),
            "early": len(self._early),
            "timers": len(self._timers),
            "quarantined": sum(1 for r in self._requests.values() if r.phase is _Phase.CLOSING),
            "fences": len(self._fences),
        }

    # ------------------------------------------------------------------ engine events

    def add(self, request: RequestMetadata, now: float) -> list[Any]:
        """Start receiving ``request`` (the driver validated it and its id is new)."""
        rid = request.request_id
        params = request.params
        self._attempt_seq += 1
        receive = _Receive(
            meta=request, key=params.match_key, engine_id=params.remote_engine_id, attempt=self._attempt_seq
        )
        self._requests[rid] = receive
        self._timers.arm(("watchdog", rid), now + self.s.request_timeout_s)
        out = self._engine_wanted(request, now)
        engine = self._engines[params.remote_engine_id]
        engine.requests.add(rid)
        if (engine.host, engine.port) != (params.remote_host, params.remote_port):
            # Registered with the engine known under this id, it would never be pushed (another
            # P engine holds the key): fail now, naming both addresses.
            return out + self._close(
                rid,
                f"P engine {engine.engine_id!r} is known here at {host_port(engine.host, engine.port)} with "
                f"requests or a handshake in progress, and this request names it at "
                f"{host_port(params.remote_host, params.remote_port)}: two P engines share one "
                f"engine_id (give each its own), or P moved while this D still works with its old "
                f"address (requests succeed once that work ended)",
                now,
            )
        if engine.state is _EngineState.FAILED and engine.refused:
            return out + self._close(rid, engine.error, now)
        if engine.state is _EngineState.FAILED:
            # In the engine's backoff: wait for the next attempt (at the backoff's end; bounded
            # by the watchdog), which fails it with its reason or registers it. Failing it at
            # once failed every request of a burst that came while a restarted P was starting.
            engine.waiting.append(rid)
            self._timers.arm(("retry", engine.engine_id), self._retry_at(engine))
            return out
        if engine.state is _EngineState.READY:
            return out + self._register(rid, now)
        engine.waiting.append(rid)
        return out

    def _engine_wanted(self, request: RequestMetadata, now: float) -> list[Any]:
        """Make sure ``request``'s P engine is known; a failed one is handshaken afresh once its
        backoff passed (its failure count carries over)."""
        params = request.params
        engine = self._engines.get(params.remote_engine_id)
        moved: list[Any] = []
        address = (params.remote_host, params.remote_port)
        settled = engine is not None and engine.state in (_EngineState.READY, _EngineState.FAILED)
        if settled and (engine.host, engine.port) != address and not engine.requests:
            # Named at another address, and nothing here uses the old one (no request, no
            # handshake in flight): P moved, or another engine shares its id (one request at a
            # time works). Handshake afresh where it is named.
            why = (
                f"P engine {engine.engine_id!r} is named at {host_port(*address)}, not "
                f"{host_port(engine.host, engine.port)} any more"
            )
            self.forget_engine(engine.engine_id)
            moved.append(DropPeer(params.remote_engine_id, why))
            engine = None
        silent = self._silent_agents(engine, now) if engine is not None and self._only_closing(engine) else []
        if silent and engine is not None and engine.requests:
            # Its requests all closing, held for producers that answered nothing (keepalive or
            # CANCEL) for longer than peer_silence_s: a worker may have been re-created under
            # their names. Handshake afresh: P's side channel names the process that serves
            # now, and its handshake states which incarnations ended there
            # (:meth:`_ended_in_process`). Fails nothing (every request is closing already).
            why = (
                f"P agent(s) {silent} of engine {engine.engine_id!r} answered nothing for "
                f"{self.s.peer_silence_s:g}s while it held requests for them; handshaking afresh"
            )
            moved += self._engine_failed(engine, why, now)
        elif silent:
            # Idle, and its keepalives went unanswered for longer than peer_silence_s: P may
            # have restarted under the same agent names. Handshake afresh (P's side channel
            # names the process that serves now) instead of registering with what was loaded.
            # No failure is counted and nothing fails: the request waits for the handshake.
            assert engine is not None
            why = (
                f"P agent(s) {silent} of idle engine {engine.engine_id!r} answered no keepalive for "
                f"{self.s.peer_silence_s:g}s; handshaking afresh"
            )
            self.forget_engine(engine.engine_id)
            moved.append(DropPeer(params.remote_engine_id, why))
            engine = None
        retry = engine is not None and engine.state is _EngineState.FAILED and engine.info is None
        if engine is not None and not (retry and now >= self._retry_at(engine)):
            return moved
        failed = engine
        engine = _Producer(params.remote_engine_id, params.remote_host, params.remote_port)
        if failed is not None:
            # Its closing requests stay the engine's: the engine is not forgotten under them,
            # and a new request of their key first asks P again for their unanswered CANCELs.
            engine.failures, engine.requests = failed.failures, failed.requests
            engine.dead, engine.waiting = failed.dead, failed.waiting
            engine.previous = failed.previous  # a reconnect's: a P restart is still spotted
            engine.restarting, engine.restart_expired = failed.restarting, failed.restart_expired
            engine.untold = failed.untold
            self._timers.disarm(("retry", engine.engine_id))
        self._engines[engine.engine_id] = engine
        return [*moved, Connect(engine.engine_id, engine.host, engine.port)]

    def cancel(self, request_id: str, now: float) -> list[Any]:
        """The engine aborts ``request_id``; reported in ``cancelled`` once its blocks are free."""
        self.stats["cancels"] += 1
        receive = self._requests.get(request_id)
        if receive is None:
            logger.info("cancel of %s: not pending here (done, failed or unknown); ignored", request_id)
            return []
        if receive.phase is _Phase.CLOSING:
            return []  # reported (failed) once already; its id comes in ``released`` when safe
        return self._close(request_id, "cancelled", now, cancelled=True)

    def fail(self, request_id: str, reason: str, now: float) -> list[Any]:
        """Fail ``request_id`` (the driver caught an error while handling it)."""
        receive = self._requests.get(request_id)
        if receive is None or receive.phase is _Phase.CLOSING:
            return []
        return self._close(request_id, reason, now)

    # ------------------------------------------------------------------ handshake results

    def connected(
        self, engine_id: str, info: ProducerInfo | None, error: str, now: float, *, exited: bool = False
    ) -> list[Any]:
        """D's notif-only handshake with P ended (``info`` or ``error``). ``exited``: it failed
        because P's side channel names a process that has exited (a rank restarting under its
        name, :class:`~kvpush.core.errors.PeerProcessExited`), which is waited for as any P
        restart is, not counted as P failing."""
        engine = self._engines.get(engine_id)
        if exited and info is None and engine is not None and engine.state is _EngineState.CONNECTING:
            self.stats["exited_producers"] += 1
            self._restarting(
                engine,
                f"P's side channel named a process that had exited, and no new process was "
                f"published within {self.s.peer_silence_s:g}s: {error}",
                now,
            )
        out = self._connected(engine_id, info, error, now)
        engine = self._engines.get(engine_id)
        if info is not None and info.ended and engine is not None:
            out += self._ended_in_process(engine, info, now)
        return out

    def _connected(self, engine_id: str, info: ProducerInfo | None, error: str, now: float) -> list[Any]:
        engine = self._engines.get(engine_id)
        if engine is None or engine.state is not _EngineState.CONNECTING:
            return [DropPeer(engine_id, "handshake result for an engine no longer wanted")] if info else []
        if engine.fenced_while_connecting:  # the fence may have removed what this handshake loaded
            engine.fenced_while_connecting = False
            return [
                DropPeer(engine_id, "a fence went out while this handshake ran; handshaking again"),
                Connect(engine.engine_id, engine.host, engine.port),
            ]
        asks: list[Any] = []
        if info is not None and error:
            # Loaded, but no producer set this rank may register with (P's side channel names
            # a mix, e.g. one stage restarted with another layer split, the other not yet). A
            # producer among them that still runs the process a closing request registered
            # with is asked for its answer now (its CANCEL needs a loaded agent, and no
            # handshake succeeds until the mix is gone); the agents stay loaded for it.
            asks = self._ask_closing(engine, info)
            info = None
        if info is None and engine.restarting:
            out = self._engine_down(engine, f"handshake with P failed while a P rank restarts: {error}", now)
            return [*asks, *out] + ([] if asks else [DropPeer(engine_id, "handshake failed")])
        if info is None:
            why = f"handshake with P failed: {error}"
            return asks + self._engine_failed(engine, why, now, spare=self._done_coming(engine))
        closed = sorted(a for a, inc in info.incarnations.items() if (a, inc) in self._closed)
        if closed:
            # P's side channel still names a worker that said goodbye (its replacement is not
            # published yet): nothing to greet; try again after the backoff.
            engine.dead = dict(info.incarnations)
            out = self._engine_down(engine, f"P agent(s) {closed} closed; not published afresh yet", now)
            return [*out, DropPeer(engine_id, f"P agent(s) {closed} closed")]
        out: list[Any] = []
        previous, engine.previous = engine.previous, None
        restarted = False
        if previous is not None:  # a reconnect: did P restart meanwhile?
            restarted = previous.incarnations != {a: info.incarnations.get(a) for a in previous.incarnations}
            seq = self._fence_seq  # the old processes stopped posting before this handshake
            gone = {a for a, inc in previous.incarnations.items() if info.incarnations.get(a) != inc}
            for rid in sorted(engine.requests):
                receive = self._requests[rid]
                if receive.phase is not _Phase.REGISTERED or receive.rereg:
                    continue  # (registered again once fenced and ready)
                if restarted:
                    # The restarted ranks' old processes are gone, but bytes their kernels queued
                    # may still be on the way (TCP delivers them after the process died): fence
                    # before release. The ranks that did not restart still hold the request's
                    # grant and may post: they settle as for any failure (an answer, or the
                    # quarantine). Copies no fence stops are held until the old process exited.
                    dead = {r for r in receive.expected - receive.settled if receive.agents.get(r) in gone}
                    if not dead:
                        # Every restarted rank had written it whole (its DONE): the others
                        # carry on; nothing is asked of the new processes.
                        _take_agents(receive, info)
                        continue
                    if receive.writes_abortable and dead:
                        receive.unsettled |= dead
                        receive.settled |= dead
                        receive.settle_seq = seq
                    out += self._close(
                        rid, f"P engine {engine_id!r} restarted while this rank reconnected", now
                    )
                else:
                    _take_agents(receive, info)
        if any(isinstance(action, Fence) for action in out):
            # The old processes' connections share the agent names with the new ones: fence
            # them (the fence removes what was just loaded), then handshake afresh.
            engine.fenced_while_connecting = False  # this Connect comes after the fence
            return [*out, Connect(engine.engine_id, engine.host, engine.port)]
        engine.info = info
        if engine.dead and any(engine.dead.get(a) not in (None, inc) for a, inc in info.incarnations.items()):
            engine.failures = 0  # a new P process: its own failures count from here
        for agent in info.agents.values():
            self._agent_engine[agent] = engine_id
        engine.state = _EngineState.HELLO
        engine.hello_pending = set(info.agents.values())
        self._hello_seq += 1
        engine.hello_id = self._hello_seq
        self._timers.arm(("hello", engine_id), now + self.s.hello_timeout_s)
        return out + self._send_hellos(engine, now)

    def _ask_closing(self, engine: _Producer, info: ProducerInfo) -> list[Any]:
        """CANCELs of the engine's closing requests to their silent producers that ``info``
        (a refused handshake's) loaded under the agent and incarnation they registered with:
        the process that may still copy into the blocks, and the only one whose answer settles
        a held request (:meth:`_same_incarnation` reads ``engine.answering`` meanwhile)."""
        engine.answering = dict(info.incarnations)
        out: list[Any] = []
        for rid in sorted(engine.requests):
            receive = self._requests.get(rid)
            if receive is None or receive.phase is not _Phase.CLOSING:
                continue
            ranks = [
                r
                for r in sorted(receive.expected - receive.settled)
                if (agent := receive.agents.get(r)) is not None
                and info.agents.get(r) == agent
                and info.incarnations.get(agent) == receive.incarnations.get(agent)
            ]
            if ranks:
                message = wire.encode_cancel(receive.key, self._coordinates(rid, receive), self.s.tp_rank)
                out += [Send(receive.agents[r], message) for r in ranks]
        return out

    def _send_hellos(self, engine: _Producer, now: float) -> list[Any]:
        """HELLO to every agent that has not answered; resent until the HELLO timeout (a lost
        HELLO must not fail every request waiting for the engine)."""
        resend = min(self.s.heartbeat_interval_s, self.s.hello_timeout_s / 4)
        self._timers.arm(("hello_resend", engine.engine_id), now + resend)
        hello = wire.encode_hello(self._coordinates(""), self.s.tp_rank, hello_id=engine.hello_id)
        return [Send(agent, hello) for agent in sorted(engine.hello_pending)]

    def _probe_unanswered(self, engine: _Producer) -> list[Any]:
        """Has the process of an agent that has not answered this rank's HELLO exited (a P
        rank killed while D greets it)? Then D handshakes afresh at once rather than waiting
        out the HELLO timeout and failing every request waiting for the engine
        (:meth:`_agents_exited`)."""
        info = engine.info
        if info is None:
            return []
        processes = tuple(
            (agent, identity)
            for agent in sorted(engine.hello_pending)
            if (identity := info.processes.get(agent)) is not None
        )
        return [ProbeExit(ENGINE_PROBE + engine.engine_id, processes)] if processes else []

    def unreachable(self, agent: str, error: str, now: float) -> list[Any]:
        """Sending to ``agent`` raised. An agent whose process is known (this host), of an
        engine greeting it or ready, is probed first: killed, the rank is restarting
        (:meth:`_greeted_exited`, :meth:`_exited_after_send`). It is judged unreachable right
        after, unless the probe found its process exited. Otherwise at once:
        :meth:`_unreachable`."""
        engine = self._probed_engine(agent)
        identity = engine.info.processes.get(agent) if engine is not None and engine.info else None
        if engine is not None and identity is not None:
            self._unreachable_errors[agent] = error
            self._timers.arm(("unreachable", agent), now)
            return [ProbeExit(ENGINE_PROBE + engine.engine_id, ((agent, identity),))]
        return self._unreachable(agent, error, now)

    def _probed_engine(self, agent: str) -> _Producer | None:
        """The engine greeting ``agent`` (its HELLO unanswered) or ready with it loaded, if any."""
        engine_id = self._agent_engine.get(agent)
        engine = self._engines.get(engine_id) if engine_id else None
        if engine is None or engine.info is None:
            return None
        if engine.state is _EngineState.HELLO:
            return engine if agent in engine.hello_pending else None
        if engine.state is _EngineState.READY:
            return engine if agent in engine.info.agents.values() else None
        return None

    def _on_unreachable_probed(self, agent: str, now: float) -> list[Any]:
        """The exit probe of an agent whose send raised found it running (or could not tell):
        unreachable after all, unless the probe found it exited or its engine moved on."""
        if agent not in self._unreachable_errors:
            return []  # its exit was seen (:meth:`_exited_after_send`)
        error = self._unreachable_errors.pop(agent)
        if self._probed_engine(agent) is None:
            return []
        return self._unreachable(agent, error, now)

    def _exited_after_send(self, engine: _Producer, agents: set[str], now: float) -> None:
        """A ready engine's agents whose send raised run in processes that have exited. A
        worker that closed says so in a ``BYE`` sent before its agent went away, which may be
        a moment behind: the exit is judged a heartbeat interval later (``exited``), as a
        killed process's (:meth:`_agents_exited`) unless that ``BYE`` came (its requests
        settle by it, and no live stage's connection is fenced)."""
        assert engine.info is not None
        for agent in sorted(agents):
            if self._unreachable_errors.pop(agent, None) is None or agent in self._exited:
                continue  # judged at the first exit's deadline: later raised sends do not delay it
            self._exited[agent] = engine.info.incarnations.get(agent, "")
            self._timers.arm(("exited", agent), now + self.s.heartbeat_interval_s)

    def _on_exited(self, agent: str, now: float) -> list[Any]:
        """A heartbeat interval after a raised send found ``agent``'s process exited: no ``BYE``
        of that incarnation came, so it was killed (:meth:`_agents_exited`), if the engine still
        has it loaded."""
        incarnation = self._exited.pop(agent, None)
        engine_id = self._agent_engine.get(agent)
        engine = self._engines.get(engine_id) if engine_id else None
        info = engine.info if engine is not None else None
        if (
            incarnation is None
            or engine is None
            or info is None
            or info.incarnations.get(agent, "") != incarnation
            or (agent, incarnation) in self._closed
        ):
            return []
        return self._agents_exited(engine.engine_id, {agent}, now)

    def _unreachable(self, agent: str, error: str, now: float) -> list[Any]:
        """Sending to ``agent`` raised: its engine is dead to this rank. A closing worker's
        agent goes away right after its ``BYE``, which may still be on its way with DONEs it
        overtook, so a registered request is not failed with the engine: one whose producers
        there all reported (or were named by their ``BYE``) waits for its other producers'
        DONEs, through a handshake afresh, or its watchdog; one that still waits for a producer
        there gets a heartbeat interval for that producer's DONE or ``BYE`` (then it fails)."""
        engine_id = self._agent_engine.get(agent)
        engine = self._engines.get(engine_id) if engine_id else None
        if engine is None:
            return []
        self.stats["dead_peers"] += 1
        reason = f"P agent {agent} is unreachable: {error}"
        spare = set()
        for rid in sorted(engine.requests):
            receive = self._requests.get(rid)
            if receive is None or receive.phase is not _Phase.REGISTERED:
                continue
            there = {r for r in receive.expected if receive.agents.get(r) == agent}
            if not there:
                continue
            spare.add(rid)
            if there <= receive.settled:  # reported, or its BYE said the DONE is coming
                receive.done_coming = True
            else:
                receive.gone[agent] = reason
                self._timers.arm(("gone", rid), now + self.s.heartbeat_interval_s)
        return self._engine_failed(engine, reason, now, spare=spare)

    def _on_gone(self, rid: str, now: float) -> list[Any]:
        """A registered request's producer agent went away (:meth:`unreachable`) a heartbeat
        interval ago: fail it unless that producer's DONE or ``BYE`` settled it meanwhile."""
        receive = self._requests.get(rid)
        if receive is None or receive.phase is not _Phase.REGISTERED:
            return []
        owed = [
            reason
            for agent, reason in sorted(receive.gone.items())
            if any(receive.agents.get(r) == agent for r in receive.expected - receive.settled)
        ]
        receive.gone = {}
        return self._close(rid, owed[0], now) if owed else []

    # ------------------------------------------------------------------ notifications

    def notification(self, agent: str, note: Notification, now: float) -> list[Any]:
        kind = note.kind
        if kind is _DONE and note.packing is None:  # the hot path: one direct DONE, all checks inline
            receive = self._requests.get(note.request_id)
            producer = note.producer
            if (
                receive is not None
                and receive.phase is _REGISTERED
                and receive.agents.get(producer) == agent  # in the set, from its own agent
                and note.producer_tp_size == receive.prefill_tp
                and producer not in receive.arrived  # after packed chunks: checked below
                and (
                    note.attempt == receive.attempt or (note.attempt is None and agent not in receive.echoing)
                )
                and (
                    not note.incarnation
                    or note.incarnation == receive.incarnations.get(agent, note.incarnation)
                )
            ):
                reported = receive.reported
                if producer in reported:
                    self.stats["duplicate_notifications"] += 1
                    return []
                reported.add(producer)  # type: ignore[arg-type]
                receive.settled.add(producer)  # type: ignore[arg-type]
                if len(reported) != len(receive.expected):  # reported is a subset of expected
                    return []
                return self._end(note.request_id, receive, Report(note.request_id, "done"), release=False)
        engine_id = self._agent_engine.get(agent)
        engine = self._engines.get(engine_id) if engine_id else None
        if engine is not None:
            engine.heard[agent] = now
            engine.asked.pop(agent, None)
        if kind is NotificationKind.FAILED and note.request_id == HELLO_REQUEST_ID:
            return self._on_refused(agent, engine, note, now)
        if kind is NotificationKind.DONE or kind is NotificationKind.FAILED:
            return self._on_result(agent, engine, note, now)
        if kind is NotificationKind.CANCEL_ACK:
            self.stats["cancel_acks"] += 1
            return self._on_result(agent, engine, note, now)
        if kind is NotificationKind.HEARTBEAT and note.stamp is not None:
            return self._on_stamp(agent, engine, note, now)
        if kind is NotificationKind.GOODBYE:
            return self._on_goodbye(agent, engine, note, now)
        self._reject(agent, note, "not a notification a decode rank accepts")
        return []

    def scattered(
        self, request_id: str, producer: RankKey, chunk: int, chunks: int, error: str, now: float
    ) -> list[Any]:
        """The driver scattered a packed chunk (``error`` empty on success)."""
        receive = self._requests.get(request_id)
        if receive is None or receive.phase is not _Phase.REGISTERED:
            return []
        if error:
            return self._close(
                request_id, f"scattering the packed bytes of P rank {producer} failed: {error}", now
            )
        seen = receive.chunks.setdefault(producer, set())
        seen.add(chunk)
        if len(seen) < chunks:
            return []
        left = self._share_left(receive, producer)
        if left:
            return self._close(request_id, left, now)
        return self._count(request_id, receive, producer, now)

    # ------------------------------------------------------------------ timers

    def handle_timer(self, now: float) -> list[Any]:
        out: list[Any] = []
        for key in self._timers.pop_expired(now):
            kind, name = key
            if kind == "watchdog":
                out += self._on_watchdog(name, now)
            elif kind == "quarantine":
                out += self._on_quarantine_expired(name, now)
            elif kind == "hello":
                out += self._on_hello_timeout(name, now)
            elif kind == "stamp":
                out += self._stamp_awaited(name, None, now)
            elif kind == "acks":
                out += self._on_acks_timeout(name, now)
            elif kind == "gone":
                out += self._on_gone(name, now)
            elif kind == "unreachable":
                out += self._on_unreachable_probed(name, now)
            elif kind == "exited":
                out += self._on_exited(name, now)
            elif kind == "restart":
                out += self._on_restart_timeout(name, now)
            elif kind == "forget_failed":
                self._on_forget_failed(name, now)
            elif kind == "retry":
                engine = self._engines.get(name)
                waiting = self._wanting(engine) if engine is not None else []
                if engine is not None and engine.state is _EngineState.FAILED and waiting:
                    out += self._engine_wanted(self._requests[waiting[0]].meta, now)
            elif kind == "hello_resend":
                engine = self._engines.get(name)
                if engine is not None and engine.state is _EngineState.HELLO and engine.hello_pending:
                    out += self._send_hellos(engine, now)
                    out += self._probe_unanswered(engine)
            elif kind == "early":
                dropped = self._early.pop(name, [])
                for agent, _ in dropped:
                    self._early_count[agent] = self._early_count.get(agent, 1) - 1
                    if self._early_count[agent] <= 0:
                        del self._early_count[agent]
                if dropped:
                    logger.warning("dropped %d notification(s) for unknown request %s", len(dropped), name)
            elif kind == "heartbeat":
                self._heartbeat_armed = False
                out += self._heartbeat(now)
        return out

    # ------------------------------------------------------------------ internals: requests

    def _register(self, rid: str, now: float) -> list[Any]:
        receive = self._requests[rid]
        engine = self._engines[receive.engine_id]
        info = engine.info
        assert info is not None
        params = receive.meta.params
        mismatch = [
            f"{name} {given} (router) vs {actual} (P's published config)"
            for name, given, actual in (
                ("pp_size", params.pp_size, info.prefill_pp),
                ("tp_size", params.tp_size, info.prefill_tp),
            )
            if given is not None and given != actual
        ]
        if mismatch:
            return self._close(rid, "kv_transfer_params disagree with P: " + "; ".join(mismatch), now)
        if not receive.acks_asked:
            receive.acks_asked = True
            owed = self._owed_cancels(receive.engine_id, receive.key, info)
            if owed:
                receive.acks = set(owed)
                self._timers.arm(("acks", rid), now + self.s.hello_timeout_s)
                return [Send(agent, message) for agent, message in sorted(owed.items())]
        if receive.acks:
            return []  # registers once they are acknowledged
        ended = self._ended_keys.get((receive.engine_id, receive.key))
        if ended is not None and not receive.refreshed:
            # A retry under a key that ended here: P answers a registration whose grant is not
            # newer than the key's end as the ended attempt's. Ask each producer whose newest
            # stamp is older for a fresh one first (bounded: registered anyway at the bound).
            receive.refreshed = True
            stale = {a for a in info.agents.values() if engine.stamp_seq.get(a, -1) <= ended}
            if stale:
                receive.awaiting = stale
                self._timers.arm(("stamp", rid), now + self.s.hello_timeout_s)
                out: list[Any] = []
                for agent in sorted(stale):
                    reg = self._coordinates("(keepalive)", None, grant=engine.stamps.get(agent))
                    out.append(Send(agent, wire.encode_heartbeat([], reg, self.s.tp_rank)))
                return out
        receive.expected = frozenset(info.agents)
        receive.agents, receive.prefill_tp = info.agents, info.prefill_tp
        receive.shares = info.shares
        receive.write_deadline_s = info.write_deadline_s
        receive.writes_abortable = info.writes_abortable
        receive.processes = info.processes
        receive.incarnations = info.incarnations
        receive.echoing = info.echo_attempts
        receive.phase = _Phase.REGISTERED
        engine.last_request = now
        if self._reserve_staging is not None:
            receive.staging_offset = self._reserve_staging(receive.meta)
        out = self._send_push_regs(rid, receive, engine, info, sorted(receive.expected), now)
        out += self._arm_heartbeat(now)
        for agent, note in self._early.pop(rid, []):
            self._early_count[agent] = self._early_count.get(agent, 1) - 1
            out += self.notification(agent, note, now)
        self._timers.disarm(("early", rid))
        return out

    def _owed_cancels(self, engine_id: str, key: str, info: ProducerInfo) -> dict[str, bytes]:
        """CANCELs of ``key``'s earlier registrations on this rank that were released on a fence
        with a producer silent (its CANCEL lost): that producer may still hold the registration.
        Asked again, and acknowledged, before the new request registers; only for the
        incarnations that could hold it. (Since P renews a registration only on its own
        PUSH_REG and never writes one another registration of the rank replaced, no grant of a
        new request can revive it; this settles P's side before the key is reused.)"""
        owed = self._unanswered.get((engine_id, key), {})
        agents = set(info.agents.values())
        return {
            agent: message
            for agent, (incarnation, _, message, _, _) in owed.items()
            if agent in agents and info.incarnations.get(agent) == incarnation
        }

    def _owed_ack_of(self, agent: str, note: Notification) -> tuple[str, str] | None:
        """The entry of ``_unanswered`` whose cancel ``note`` (a CANCEL_ACK from ``agent``)
        acknowledges, or None. Only the ack of that registration: from the start it was
        cancelled with, echoing the attempt the CANCEL named (a replayed ack of an earlier
        request of the id names another; from a P that echoes attempts, one naming none is
        refused)."""
        for where in sorted(self._unanswered_ids.get(note.request_id, ())):
            entry = self._unanswered.get(where, {}).get(agent)
            if (
                entry is not None
                and entry.request_id == note.request_id
                and not (note.incarnation and entry.incarnation and note.incarnation != entry.incarnation)
                and (note.attempt == entry.attempt or (note.attempt is None and not entry.echoes))
            ):
                return where
        return None

    def _forget_owed(self, where: tuple[str, str], agent: str) -> None:
        """``agent`` owes the cancel of ``where`` no more (its ack came, or its start ended)."""
        owed = self._unanswered.get(where)
        entry = owed.pop(agent, None) if owed is not None else None
        if owed is not None and not owed:
            del self._unanswered[where]
        if entry is not None:
            self._unindex_owed(entry.request_id, where)

    def _unindex_owed(self, rid: str, where: tuple[str, str]) -> None:
        """Drop ``where`` from ``rid``'s owed entries once none of its producers owes ``rid``."""
        if any(o.request_id == rid for o in self._unanswered.get(where, {}).values()):
            return
        wheres = self._unanswered_ids.get(rid)
        if wheres is not None:
            wheres.discard(where)
            if not wheres:
                del self._unanswered_ids[rid]

    def _on_owed_ack(self, agent: str, note: Notification, now: float) -> list[Any]:
        """A CANCEL_ACK for a request that ended here: one of :meth:`_owed_cancels` answered?"""
        where = self._owed_ack_of(agent, note)
        if where is None:
            if note.request_id in self._unanswered_ids:
                self._reject(agent, note, "not the ack of a cancel this rank owes (another attempt or start)")
            return []
        engine_id, key = where
        self._forget_owed(where, agent)
        # P ended the key only now: a registration of it needs a stamp issued after this.
        self._seq += 1
        self._ended_keys[(engine_id, key)] = self._seq
        self._ended_keys.move_to_end((engine_id, key))
        if len(self._ended_keys) > ENDED_MEMORY:
            self._ended_keys.popitem(last=False)
        engine = self._engines.get(engine_id)
        out: list[Any] = []
        for rid in sorted(engine.requests if engine is not None else ()):
            receive = self._requests[rid]
            if receive.key != key or agent not in receive.acks:
                continue
            receive.acks.discard(agent)
            if receive.acks or receive.phase is not _Phase.WAITING:
                continue
            self._timers.disarm(("acks", rid))
            if engine is not None and engine.state is _EngineState.READY:
                out += self._register(rid, now)
            elif engine is not None and rid not in engine.waiting:
                engine.waiting.append(rid)
        return out

    def _on_acks_timeout(self, rid: str, now: float) -> list[Any]:
        receive = self._requests.get(rid)
        if receive is None or receive.phase is not _Phase.WAITING or not receive.acks:
            return []
        return self._close(
            rid,
            f"P agent(s) {sorted(receive.acks)} did not acknowledge within {self.s.hello_timeout_s:g}s "
            f"the cancel of an earlier registration of match key {receive.key!r} on this rank, which "
            f"they may still hold (its blocks were released on a fence); retry under a fresh "
            f"transfer_id",
            now,
        )

    def _on_result(self, agent: str, engine: _Producer | None, note: Notification, now: float) -> list[Any]:
        rid = note.request_id
        receive = self._requests.get(rid)
        if (
            note.kind is NotificationKind.CANCEL_ACK
            and receive is not None
            and rid in self._unanswered_ids
            and note.attempt != receive.attempt
            and self._owed_ack_of(agent, note) is not None
        ):
            # The ack of a cancel owed for an earlier request of this id, which the engine
            # re-added or gave to a new request after D forgot it: the attempt it echoes tells
            # them apart. One naming none (a P that echoes no attempts cannot say which request
            # of the id it answers) settles the owed cancel first: the live request then settles
            # only on a second ack, so an ack of the earlier request never releases blocks P may
            # still write.
            out = self._on_owed_ack(agent, note, now)
            producer = note.producer
            closing = receive.phase is _Phase.CLOSING
            if note.attempt is None and closing and producer is not None and producer in receive.expected:
                # Which of the two cancels it answers cannot be told: what it says of this rank's
                # WRITEs (one ended unsettled, one was in flight) is kept for the live request
                # too, which then fences before release whatever the other ack says.
                receive.write_in_flight |= note.write_in_flight
                if note.unsettled:
                    receive.unsettled.add(producer)
            return out
        if receive is None:
            if note.kind is NotificationKind.CANCEL_ACK and self._unanswered:
                return self._on_owed_ack(agent, note, now)
            if note.kind is NotificationKind.CANCEL_ACK or rid in self._ended:
                self.stats["duplicate_notifications"] += note.kind is NotificationKind.DONE
                return []  # late: the request already ended here
            return self._hold_early(agent, note, now)
        if receive.phase is _Phase.WAITING:
            return self._hold_early(agent, note, now)
        producer = note.producer
        problem = self._identity_problem(agent, receive, note)
        if problem:
            self._reject(agent, note, problem)
            return []
        assert producer is not None
        manifest = note.packing if note.kind is NotificationKind.DONE else None
        if note.kind is NotificationKind.DONE:
            problem = self._packing_problem(receive, producer, manifest) or self._share_problem(
                receive, producer, manifest
            )
            if problem and receive.phase is _Phase.CLOSING:
                # settled only by its CANCEL_ACK or the quarantine: its bytes may still land
                self._reject(agent, note, problem)
                return []
            if problem:
                return self._close(rid, f"P rank {producer} {problem}", now)
        if manifest is not None:
            receive.arrived.setdefault(producer, set()).add(manifest.chunk)
        if receive.phase is _Phase.CLOSING:
            receive.unanswered.discard(agent)
            if receive.held and not self._same_incarnation(receive, agent):
                # A process that took over the agent's name never had this request: only the
                # one that could copy into it (or its exit) settles it.
                self._reject(agent, note, "an answer for a held request from a later P incarnation")
                return []
            if note.kind is NotificationKind.DONE and producer not in receive.settled:
                receive.write_in_flight = True  # it landed after the cancel went out
                if manifest is not None and len(receive.arrived[producer]) < manifest.chunks:
                    # One chunk of a packed push: the producer's other chunks may still be in
                    # flight into the staging range, which must not go back before they land.
                    return []
            if note.kind is NotificationKind.CANCEL_ACK:
                receive.write_in_flight |= note.write_in_flight
            if note.kind is not NotificationKind.DONE and note.unsettled:
                receive.unsettled.add(producer)
            receive.settled.add(producer)
            receive.settle_seq = self._fence_seq
            return self._maybe_release(rid, receive, now)
        if note.kind is NotificationKind.CANCEL_ACK:
            return []  # an ack for a request this rank never cancelled
        if note.kind is NotificationKind.FAILED:
            receive.settled.add(producer)
            receive.settle_seq = self._fence_seq
            if note.unsettled:
                receive.unsettled.add(producer)
            return self._close(rid, f"P rank {producer} reported: {note.reason}", now)
        if producer in receive.reported:
            self.stats["duplicate_notifications"] += 1
            return []
        if manifest is not None:
            if manifest.staging_offset != receive.staging_offset or receive.staging_offset < 0:
                return self._close(
                    rid, f"P rank {producer} packed into a staging range D did not reserve", now
                )
            return [Scatter(rid, producer, manifest, receive.meta.block_ids)]
        return self._count(rid, receive, producer, now)

    def _same_incarnation(self, receive: _Receive, agent: str) -> bool:
        """Whether ``agent``'s loaded incarnation is the one ``receive`` registered with."""
        engine = self._engines.get(receive.engine_id)
        if engine is None:
            return False
        if engine.info is not None:
            return engine.info.incarnations.get(agent) == receive.incarnations.get(agent)
        return agent in engine.answering and engine.answering[agent] == receive.incarnations.get(agent)

    @staticmethod
    def _packing_problem(receive: _Receive, producer: RankKey, manifest: PackManifest | None) -> str:
        """Why a producer's DONE disagrees with its earlier packed DONEs ("" when it does not):
        a direct DONE after packed chunks (the rest may still be landing in the staging range),
        or chunks that disagree or overlap (:func:`kvpush.core.packing.check_chunks`)."""
        earlier = receive.manifests.get(producer)
        if manifest is None:
            return "sent a direct DONE after packed chunks (the others may still land)" if earlier else ""
        if earlier and manifest in earlier:
            return ""  # a duplicate DONE
        from kvpush.core.errors import WireError
        from kvpush.core.packing import check_chunks

        try:
            check_chunks([*(earlier or ()), manifest])
        except WireError as err:
            return f"sent inconsistent packed chunks: {err}"
        receive.manifests.setdefault(producer, []).append(manifest)
        return ""

    @staticmethod
    def _share(receive: _Receive, producer: RankKey) -> frozenset[tuple[int, Any, Any]] | None:
        """The pieces ``producer`` agreed at the handshake to write into this rank (None: unknown).
        The request's own record (``_Receive.shares``, kept by a re-registration): the engine's
        info is gone while it reconnects or after a BYE, and may be a later layout's."""
        return receive.shares.get(producer)

    def _share_problem(self, receive: _Receive, producer: RankKey, manifest: PackManifest | None) -> str:
        """Why a packed DONE writes outside its producer's share ("" when it does not): a D
        region or block slice the handshake gave another producer, or none at all. Checked
        before its bytes are scattered."""
        share = self._share(receive, producer)
        if manifest is None or not share:
            return ""
        wrote = _pieces(manifest.regions, manifest.part)
        outside = sorted(j for j, _, _ in wrote - share)
        if outside:
            return (
                f"packed D regions {outside[:8]} (block slice {manifest.part}), outside the share its "
                f"plan agreed at the handshake"
            )
        return ""

    def _share_left(self, receive: _Receive, producer: RankKey) -> str:
        """Once every packed chunk of ``producer`` was scattered: the pieces of its share no
        chunk named ("" when none), which would otherwise stay unwritten, the request done."""
        share = self._share(receive, producer)
        if not share:
            return ""
        wrote: set[tuple[int, Any, Any]] = set()
        for manifest in receive.manifests.get(producer, ()):
            wrote |= _pieces(manifest.regions, manifest.part)
        left = sorted({j for j, _, _ in share - wrote})
        if left:
            return (
                f"P rank {producer}'s packed chunks left D regions {left[:8]} of its share unwritten "
                f"({len(left)} region(s) its plan agreed at the handshake)"
            )
        return ""

    @staticmethod
    def _identity_problem(agent: str, receive: _Receive, note: Notification) -> str:
        """Why a producer's notification must not count for ``receive`` ("" when it may): the
        producers, their agents, the agents' incarnations (where the notification states one)
        and P's TP size are the ones the request registered with."""
        producer = note.producer
        if producer is None or not receive.agents:
            return "no handshake with the request's P engine"
        if producer not in receive.expected:
            return (
                f"producer {producer} is not one this rank waits for ({sorted(map(str, receive.expected))})"
            )
        if receive.agents.get(producer) != agent:
            return f"producer {producer} must speak through agent {receive.agents.get(producer)!r}"
        if note.kind is NotificationKind.DONE and note.producer_tp_size != receive.prefill_tp:
            return f"DONE states P TP {note.producer_tp_size}, P published {receive.prefill_tp}"
        registered = receive.incarnations.get(agent)
        if note.incarnation and registered and note.incarnation != registered:
            # Another process under the agent's name (one that restarted, or its old process
            # still alive): it never had this registration, whatever it says of it.
            return (
                f"sent by incarnation {note.incarnation!r} of {agent}; this request registered with "
                f"incarnation {registered!r}"
            )
        if note.attempt is None and agent in receive.echoing:
            return f"it names no registration attempt, and {agent} stated that each of its results echoes one"
        if note.attempt is not None and note.attempt != receive.attempt:
            # P's answer to another registration of this request id (an earlier request the
            # engine gave the same id, or a replay of one): it says nothing of this one.
            return f"it answers registration attempt {note.attempt}; this request's is {receive.attempt}"
        return ""

    def _count(self, rid: str, receive: _Receive, producer: RankKey, now: float) -> list[Any]:
        receive.reported.add(producer)
        receive.settled.add(producer)
        if len(receive.reported) != len(receive.expected):  # reported is a subset of expected
            return []
        return self._end(rid, receive, Report(rid, "done"), release=False)

    def _close(self, rid: str, reason: str, now: float, *, cancelled: bool = False) -> list[Any]:
        """Stop a request: report a failure at once; release its blocks once nothing can land."""
        receive = self._requests[rid]
        self._timers.disarm(("watchdog", rid))
        engine = self._engines.get(receive.engine_id)
        if receive.phase is _Phase.WAITING:
            if engine is not None and rid in engine.waiting:
                engine.waiting.remove(rid)
            outcome = "cancelled" if cancelled else "failed"
            why = f"{reason} before any PUSH_REG was sent; nothing to settle"
            told = self._tell_unregistered(rid, receive, engine) if engine is not None else []
            return told + self._end(rid, receive, Report(rid, outcome, why), release=True)
        logger.warning("request %s stops: %s", rid, reason)
        if receive.rereg:
            # Not registered again yet: its exited producers settle through a fence of their
            # own, issued once every producer settled (the pending one may predate a live
            # producer's last post).
            receive.settled |= receive.rereg
            receive.unsettled |= receive.rereg
            receive.rereg = set()
            pending = self._fences.get(receive.fence_id) if receive.fence_id is not None else None
            if pending is not None:
                pending.waiting.discard(rid)
            receive.fence_id = None
            receive.settle_seq = self._fence_seq
        receive.phase = _Phase.CLOSING
        receive.cancelled = cancelled
        out: list[Any] = []
        if not cancelled:
            out.append(Report(rid, "failed", reason))
        if engine is not None:
            out += self._cancels(rid, receive, engine, receive.expected - receive.settled)
        receive.reason = reason
        return out + self._maybe_release(rid, receive, now)

    def _tell_unregistered(self, rid: str, receive: _Receive, engine: _Producer) -> list[Any]:
        """``rid`` ends before it registered: nothing of P's can land in its blocks (P writes
        only on a PUSH_REG), but P may hold a finished prefill for it until its lease. Its
        CANCEL goes to every producer of the engine stating ``unregistered_cancels`` now if it
        is ready, else once it is (``_Producer.untold``); an older P keeps its lease. Not to an
        engine known at another address than the request names (another P engine under that
        id)."""
        params = receive.meta.params
        if (engine.host, engine.port) != (params.remote_host, params.remote_port):
            return []
        message = wire.encode_cancel(receive.key, self._coordinates(rid, receive), self.s.tp_rank)
        if engine.state is _EngineState.READY and engine.info is not None:
            return [Send(agent, message) for agent in _told_unregistered(engine.info)]
        engine.untold[rid] = message
        while len(engine.untold) > MAX_UNTOLD_CANCELS:
            engine.untold.popitem(last=False)
        return []

    def _maybe_release(self, rid: str, receive: _Receive, now: float) -> list[Any]:
        if receive.fence_id is not None:
            return []  # released when the fence is confirmed
        if receive.expected - receive.settled:
            if self._timers.when(("quarantine", rid)) is None:
                self.stats["quarantined"] += 1
                self._timers.arm(("quarantine", rid), self._quarantine_end(receive, now))
            return []
        if receive.unsettled:
            ranks = ", ".join(str(r) for r in sorted(receive.unsettled))
            return self._await_fence(
                rid, receive, receive.unsettled, f"P rank(s) {ranks} ended a WRITE unsettled", now
            )
        how = (
            "a WRITE was in flight and settled before the blocks were released"
            if receive.write_in_flight
            else "no WRITE in flight; every producer acknowledged or had reported"
        )
        return self._finish_close(rid, receive, how)

    def _finish_close(self, rid: str, receive: _Receive, how: str) -> list[Any]:
        if receive.unanswered:
            owed = self._unanswered.setdefault((receive.engine_id, receive.key), {})
            self._unanswered.move_to_end((receive.engine_id, receive.key))
            message = wire.encode_cancel(receive.key, self._coordinates(rid, receive), self.s.tp_rank)
            where = (receive.engine_id, receive.key)
            for agent in receive.unanswered:
                replaced = owed.get(agent)
                owed[agent] = _Owed(
                    receive.incarnations.get(agent, ""),
                    rid,
                    message,
                    receive.attempt,
                    agent in receive.echoing,
                )
                if replaced is not None and replaced.request_id != rid:
                    self._unindex_owed(replaced.request_id, where)
            self._unanswered_ids.setdefault(rid, set()).add(where)
            if len(self._unanswered) > ENDED_MEMORY:
                evicted_at, evicted = self._unanswered.popitem(last=False)
                for old in evicted.values():
                    self._unindex_owed(old.request_id, evicted_at)
        # The report goes first: the driver writes each action's result under its own hold of
        # the results lock, and an engine polling in between must never see ``released``
        # without ``cancelled`` (it may add the id again at once, and a late ``cancelled``
        # would then be read as the new request's).
        report = [Report(rid, "cancelled", f"{receive.reason} ({how})")] if receive.cancelled else []
        out = report + self._end(rid, receive, None, release=True)
        engine = self._engines.get(receive.engine_id)
        return out + (self._maybe_forget(engine) if engine is not None else [])

    def _quarantine_end(self, receive: _Receive, now: float) -> float:
        """When no WRITE of P's can land any more: the grant window plus P's WRITE deadline."""
        deadline = receive.write_deadline_s
        if receive.last_grant is None:
            return now  # P never had a grant, so it could never post
        # The margin covers P's writer running late at a WRITE's deadline (a GIL stall, a long
        # prepare): as long as the deadline itself, and at least quarantine_margin_s.
        margin = max(self.s.quarantine_margin_s, deadline)
        return max(now, receive.last_grant + self.s.fresh_s + deadline + margin)

    def _on_quarantine_expired(self, rid: str, now: float) -> list[Any]:
        receive = self._requests.get(rid)
        if receive is None or receive.fence_id is not None:
            return []
        self.stats["quarantine_expiries"] += 1
        silent = receive.expected - receive.settled
        names = ", ".join(str(r) for r in sorted(silent))
        if not receive.writes_abortable:
            return self._hold(rid, receive, silent, names, now)
        receive.unanswered = {receive.agents[r] for r in silent if r in receive.agents}
        # P may not post any more (the grant window and its WRITE deadline passed), but a WRITE
        # it posted may still sit in the network: fence P's connections, then release.
        return self._await_fence(
            rid,
            receive,
            silent | receive.unsettled,
            f"no acknowledgement from P rank(s) {names} within the freshness window and P's WRITE deadline",
            now,
        )

    def _hold(
        self, rid: str, receive: _Receive, silent: frozenset[RankKey], names: str, now: float
    ) -> list[Any]:
        """Keep ``rid``'s blocks until each silent producer acknowledged or its process exited:
        their copies are kernels no fence stops (``writes_abortable`` false), so releasing on a
        fence would let a late copy land in blocks the engine reused. Every heartbeat interval
        the request's cancel goes out again (the first may have been lost; P answers once its
        copy ended) and the driver checks whether the processes have exited (``ProbeExit``).
        Counted in ``held_for_kernel_copies``."""
        if not receive.held:
            receive.held = True
            self.stats["held_for_kernel_copies"] += 1
            if self._warned.allow():
                logger.warning(
                    "request %s: no acknowledgement from P rank(s) %s; P's copies cannot be fenced, "
                    "so its blocks stay held until P acknowledges or its process has exited",
                    rid,
                    names,
                )
        self._timers.arm(("quarantine", rid), now + self.s.heartbeat_interval_s)
        silent_agents = sorted({receive.agents[r] for r in silent if r in receive.agents})
        out: list[Any] = []
        probes = tuple((a, receive.processes[a]) for a in silent_agents if a in receive.processes)
        if probes:
            out.append(ProbeExit(rid, probes))
        # The cancel needs a connection P accepts it on: a failed engine is handshaken afresh
        # (P loads this rank again at the HELLO; a restarted P acknowledges a key it never had).
        out += self._engine_wanted(receive.meta, now)
        engine = self._engines[receive.engine_id]
        if engine.state is _EngineState.READY:
            out += self._cancels(rid, receive, engine, silent)
            for agent in silent_agents:  # answered by any message of theirs (``notification``)
                engine.asked.setdefault(agent, now)
        return out

    def _cancels(
        self, rid: str, receive: _Receive, engine: _Producer, ranks: set[RankKey] | frozenset[RankKey]
    ) -> list[Any]:
        """A CANCEL of ``rid`` to each of ``ranks`` whose agent the engine has loaded."""
        info = engine.info
        if info is None:
            return []
        message = wire.encode_cancel(receive.key, self._coordinates(rid, receive), self.s.tp_rank)
        return [Send(info.agents[rank], message) for rank in sorted(ranks) if rank in info.agents]

    def producers_exited(self, rid: str, agents: Iterable[str], now: float) -> list[Any]:
        """The driver saw these producer processes of held request ``rid`` exit (``ProbeExit``):
        their copies ended with them. Once every silent producer has, the blocks go back (after
        a fence, for whatever else their connections carried). A probe of an engine's silent
        agents (``ENGINE_PROBE``): :meth:`_agents_exited`."""
        receive = self._requests.get(rid)
        if receive is None and rid.startswith(ENGINE_PROBE):
            return self._agents_exited(rid[len(ENGINE_PROBE) :], set(agents), now)
        if receive is None or not receive.held or receive.fence_id is not None:
            return []
        exited = set(agents)
        silent = receive.expected - receive.settled
        if any(receive.agents.get(r) not in exited for r in silent):
            return []
        names = ", ".join(str(r) for r in sorted(silent))
        # The engine may still use those processes for its registered requests: their exit is
        # theirs too (registered again with the new process, as a heartbeat's probe would);
        # the held request then joins that fence.
        out = self._agents_exited(receive.engine_id, self._loaded_as_registered(receive, exited), now)
        return out + self._await_fence(
            rid, receive, silent | receive.unsettled, f"P rank(s) {names} exited while held", now
        )

    def _loaded_as_registered(self, receive: _Receive, agents: set[str]) -> set[str]:
        """Those of ``agents`` that ``receive``'s engine has loaded in the incarnation the
        request registered with (not a newer process loaded under the name since)."""
        engine = self._engines.get(receive.engine_id)
        info = engine.info if engine is not None else None
        if info is None:
            return set()
        loaded = set(info.agents.values())
        return {a for a in agents if a in loaded and info.incarnations.get(a) == receive.incarnations.get(a)}

    def _agents_exited(self, engine_id: str, exited: set[str], now: float) -> list[Any]:
        """Agents of a ready engine that missed a heartbeat answer run in processes that have
        exited: those incarnations are gone (a P rank killed, maybe already back under its
        name), whatever ``peer_silence_s`` says. Each registered request whose producer there
        had not reported is registered again, with the process that serves now, once the old
        one's connections are fenced (its copies ended with it; bytes its kernel queued end at
        the fence); the engine is handshaken afresh meanwhile. A handshake that loads an exited
        incarnation again (the rank is still starting) waits for the next attempt."""
        engine = self._engines.get(engine_id)
        info = engine.info if engine is not None else None
        if engine is not None and info is not None and engine.state is _EngineState.HELLO:
            return self._greeted_exited(engine, info, exited, now)
        if engine is None or info is None or engine.state is not _EngineState.READY:
            return []
        after_send = exited & set(self._unreachable_errors)
        if after_send:  # a closed worker's BYE may be a moment behind
            self._exited_after_send(engine, after_send, now)
            exited = exited - after_send
        gone = {a: info.incarnations.get(a, "") for a in exited if a in info.agents.values()}
        if not gone:
            return []
        self.stats["exited_producers"] += len(gone)
        for agent, incarnation in gone.items():
            self._mark_closed(agent, incarnation)
        fence_id = self._fence_seq + 1
        # The fence cuts every connection of the engine (over TCP, every one from the P host),
        # so a live producer's registration may be lost with it too (P drops one it has posted
        # nothing for when its endpoint breaks): each producer the fence cuts that had not
        # reported is registered again, a live one as a renewal if P still holds it. (Not a
        # live one whose copies no fence stops: it is settled by its answer or exit, not here.)
        cut = {a: info.incarnations.get(a, "") for a in info.agents.values()}
        rids = []
        for rid in sorted(engine.requests):
            receive = self._requests[rid]
            if receive.phase is not _Phase.REGISTERED:
                continue
            again = {
                r
                for r in receive.expected - receive.settled - receive.reported
                if (agent := receive.agents.get(r, "")) in cut
                and cut[agent] == receive.incarnations.get(agent)
                and (agent in gone or receive.writes_abortable)
            }
            if not again:
                continue
            receive.rereg |= again
            for r in again:  # a packed push starts again from its first chunk
                receive.arrived.pop(r, None)
                receive.chunks.pop(r, None)
                receive.manifests.pop(r, None)
            receive.fence_id = fence_id
            rids.append(rid)
        why = f"P agent(s) {sorted(gone)} exited (their process is gone); handshaking afresh"
        self._restarting(
            engine,
            f"P agent(s) {sorted(gone)} answered no heartbeat and exited, and no new process of "
            f"theirs answered within {self.s.peer_silence_s:g}s",
            now,
        )
        logger.warning("P engine %s: %s", engine_id, why)
        self._fence_seq = fence_id
        self.stats["fences"] += 1
        agents = frozenset(info.agents.values())
        self._fences[fence_id] = _Fence(engine_id, now, agents, set(rids), why)
        return self._reconnect(engine, why, Fence(fence_id, engine_id, tuple(sorted(agents)), why))

    def _greeted_exited(
        self, engine: _Producer, info: ProducerInfo, exited: set[str], now: float
    ) -> list[Any]:
        """Agents this rank's HELLO went to run in processes that have exited (killed as D
        greeted them, or before D loaded them): the rank is restarting. The engine is dropped
        and handshaken afresh after the backoff; requests waiting for it keep waiting, bounded
        by the restart timeout (``peer_silence_s``) and their own watchdogs (:meth:`_engine_down`)."""
        gone = {a: info.incarnations.get(a, "") for a in exited if a in engine.hello_pending}
        if not gone:
            return []
        self.stats["exited_producers"] += len(gone)
        for agent, incarnation in gone.items():
            self._mark_closed(agent, incarnation)
        for rid in sorted(engine.requests):  # (a reconnect's) as :meth:`_unreachable` spares them
            receive = self._requests.get(rid)
            if receive is None or receive.phase is not _Phase.REGISTERED:
                continue
            there = {r for r in receive.expected if receive.agents.get(r) in gone}
            if there and there <= receive.settled:  # written whole, or its BYE said so
                receive.done_coming = True
        why = f"P agent(s) {sorted(gone)} exited before answering this rank's HELLO; handshaking afresh"
        self._restarting(
            engine,
            f"P agent(s) {sorted(gone)} exited before answering this rank's HELLO, and no new process "
            f"of theirs answered within {self.s.peer_silence_s:g}s",
            now,
        )
        logger.warning("P engine %s: %s", engine.engine_id, why)
        out = self._engine_down(engine, why, now)
        return out if any(isinstance(a, DropPeer) for a in out) else [*out, DropPeer(engine.engine_id, why)]

    def _mark_closed(self, agent: str, incarnation: str) -> None:
        self._closed[(agent, incarnation)] = None
        self._closed.move_to_end((agent, incarnation))
        if len(self._closed) > ENDED_MEMORY:
            self._closed.popitem(last=False)

    def _reregister(self, rid: str, now: float) -> list[Any]:
        """Register ``rid`` again with the producers that replaced exited ones (see
        :meth:`_agents_exited`), once their fence is confirmed and the engine is ready."""
        receive = self._requests.get(rid)
        engine = self._engines.get(receive.engine_id) if receive is not None else None
        info = engine.info if engine is not None else None
        if (
            receive is None
            or engine is None
            or info is None
            or not receive.rereg
            or receive.fence_id is not None
            or receive.phase is not _Phase.REGISTERED
            or engine.state is not _EngineState.READY
        ):
            return []
        # The exited producers' connections were fenced (confirmed) and their processes are
        # gone: nothing of theirs can land any more.
        receive.settled |= receive.rereg
        changed = _layout_change(receive, info)
        if changed:
            # The request counts the old producers and their windows: the new processes cannot
            # complete it. Its silent old producers settle through their own agents (kept).
            receive.rereg = set()
            self.stats["reregistrations_refused"] += 1
            return self._close(
                rid,
                f"P engine {receive.engine_id!r} came back with {changed}; this request was "
                f"registered with the old layout and cannot complete",
                now,
            )
        # A producer the handshake shows restarted too (its exit not seen yet) lost the
        # registration with its old process, which the same fence covered: registered again.
        # Not where a fence does not stop the old process's copies (kernel copies): that one
        # waits for its exit or answer, as any silent producer, and the request fails.
        restarted = {
            r
            for r in receive.expected - receive.settled - receive.reported
            if receive.writes_abortable
            and info.incarnations.get(info.agents[r]) != receive.incarnations.get(receive.agents.get(r, ""))
        }
        # A producer whose DONE was read since its exit was seen wrote it whole (its WRITE
        # completed before the process went: a DONE follows its bytes) and is counted: it is
        # not registered again, or the request could be done while the new process holds a
        # registration of it and writes into blocks (or a staging range) D gave back.
        ranks = sorted((receive.rereg | restarted) - receive.reported)
        receive.rereg = set()
        receive.settled -= set(ranks)
        for r in ranks:  # a packed push starts again from its first chunk: an old chunk read
            # since the exit was seen (before the fence was confirmed) or one of a producer found
            # restarted only now must not count with the new process's
            receive.arrived.pop(r, None)
            receive.chunks.pop(r, None)
            receive.manifests.pop(r, None)
        new_agents = {info.agents[r] for r in ranks}
        receive.agents = {**receive.agents, **{r: info.agents[r] for r in ranks}}
        receive.incarnations = {
            **receive.incarnations,
            **{a: info.incarnations[a] for a in new_agents if a in info.incarnations},
        }
        receive.echoing = (receive.echoing - new_agents) | (info.echo_attempts & new_agents)
        kept = {a: p for a, p in receive.processes.items() if a not in new_agents}
        receive.processes = {**kept, **{a: info.processes[a] for a in new_agents if a in info.processes}}
        # Conservative across the incarnations the request now spans.
        receive.writes_abortable = receive.writes_abortable and info.writes_abortable
        receive.write_deadline_s = max(receive.write_deadline_s, info.write_deadline_s)
        receive.unknown_strikes = {}
        self.stats["reregistered"] += len(ranks)
        return self._send_push_regs(rid, receive, engine, info, ranks, now)

    def _await_fence(
        self, rid: str, receive: _Receive, producers: set[RankKey] | frozenset[RankKey], why: str, now: float
    ) -> list[Any]:
        """Release ``rid``'s blocks once ``producers``' connections are fenced (a pending fence of
        the same engine issued from now on covers it too)."""
        self._timers.disarm(("quarantine", rid))
        agents = frozenset(receive.agents[p] for p in producers if p in receive.agents)
        if not agents:  # no handshake, so nothing was ever written
            return self._finish_close(rid, receive, f"{why}; no connection to fence")
        for fence_id, fence in self._fences.items():
            # A pending fence covers this request's WRITEs only if it went out after its
            # producers stopped posting (one issued at the same instant may predate that).
            if (
                fence.engine_id == receive.engine_id
                and fence.issued_at >= now
                and fence_id > receive.settle_seq
                and agents <= fence.agents
            ):
                fence.waiting.add(rid)
                receive.fence_id = fence_id
                return []
        self._fence_seq += 1
        self.stats["fences"] += 1
        engine = self._engines.get(receive.engine_id)
        current = (
            frozenset(engine.info.agents.values()) if engine is not None and engine.info else frozenset()
        )
        whole = bool(agents & current)
        if whole:
            agents |= current  # one connection per engine: fence it whole
        fence = _Fence(receive.engine_id, now, agents, {rid}, why)
        self._fences[self._fence_seq] = fence
        receive.fence_id = self._fence_seq
        action = Fence(self._fence_seq, receive.engine_id, tuple(sorted(agents)), why)
        if engine is not None and engine.state is _EngineState.CONNECTING:
            engine.fenced_while_connecting = True
        if engine is not None and whole:
            if engine.state is _EngineState.FAILED:
                self._forget_agents(engine)
                return [action]
            # The engine's other requests carry on over a fresh connection.
            return self._reconnect(engine, why, action)
        return [action]

    def fenced(self, fence_id: int, now: float) -> list[Any]:
        """The driver confirmed fence ``fence_id``: nothing its agents sent before can land."""
        fence = self._fences.pop(fence_id, None)
        if fence is None:
            return []
        out: list[Any] = []
        for rid in sorted(fence.waiting):
            receive = self._requests.get(rid)
            if receive is None or receive.fence_id != fence_id:
                continue
            if receive.phase is _Phase.REGISTERED:  # nothing of the exited producers can land
                receive.fence_id = None
                out += self._reregister(rid, now)
                continue
            out += self._finish_close(
                rid, receive, f"released after P's connections were fenced ({fence.why})"
            )
        return out

    def _forget_agents(self, engine: _Producer) -> None:
        """Forget the engine's agents (dropped or fenced): what was heard from them goes too."""
        assert engine.info is not None
        for agent in engine.info.agents.values():
            self._agent_engine.pop(agent, None)
        engine.info = None
        engine.answering = {}
        engine.stamps.clear()
        engine.stamped.clear()
        engine.stamp_seq.clear()
        engine.heard.clear()
        engine.asked.clear()
        engine.hello_pending.clear()

    def _reconnect(self, engine: _Producer, reason: str, fence: Fence | None = None) -> list[Any]:
        """Drop the engine's agents (its connection; ``fence`` when a fence does it) and
        handshake afresh; registered requests keep waiting (their producers' names are
        unchanged unless P restarted)."""
        engine.previous = engine.info
        self._forget_agents(engine)
        engine.state = _EngineState.CONNECTING
        self._timers.disarm(("hello", engine.engine_id))
        self._timers.disarm(("hello_resend", engine.engine_id))
        drop = fence if fence is not None else DropPeer(engine.engine_id, reason)
        return [drop, Connect(engine.engine_id, engine.host, engine.port)]

    def _end(self, rid: str, receive: _Receive, report: Report | None, *, release: bool) -> list[Any]:
        """Forget a request: the one place request state is deleted."""
        del self._requests[rid]
        self._ended.add(rid)
        for kind in ("watchdog", "quarantine", "stamp", "acks", "gone"):
            self._timers.disarm((kind, rid))
        ended = (receive.engine_id, receive.key)
        self._seq += 1
        self._ended_keys[ended] = self._seq
        self._ended_keys.move_to_end(ended)
        if len(self._ended_keys) > ENDED_MEMORY:
            self._ended_keys.popitem(last=False)
        engine = self._engines.get(receive.engine_id)
        if engine is not None:
            engine.requests.discard(rid)
        out: list[Any] = [report] if report is not None else []
        if release:
            out.append(Release(rid))
        if receive.staging_offset >= 0:
            out.append(FreeStaging(receive.staging_offset))
        return out

    def _on_watchdog(self, rid: str, now: float) -> list[Any]:
        receive = self._requests.get(rid)
        if receive is None or receive.phase is _Phase.CLOSING:
            return []
        missing = sorted(receive.expected - receive.reported)
        return self._close(
            rid,
            f"no completion within {self.s.request_timeout_s:g}s: {len(receive.reported)} of "
            f"{len(receive.expected) or '?'} producer notifications arrived; missing "
            f"{', '.join(str(r) for r in missing) or 'the handshake with P'}",
            now,
        )

    def _hold_early(self, agent: str, note: Notification, now: float) -> list[Any]:
        """A result for a request not added (or not registered) yet: hold it, bounded per agent."""
        self.stats["unknown_notifications"] += 1
        if self._early_count.get(agent, 0) >= self.s.early_cap_per_peer:
            self._reject(agent, note, f"more than {self.s.early_cap_per_peer} early notifications held")
            return []
        self._early_count[agent] = self._early_count.get(agent, 0) + 1
        held = self._early.setdefault(note.request_id, [])
        if not held:
            self._timers.arm(("early", note.request_id), now + self.s.early_ttl_s)
        held.append((agent, note))
        return []

    def _reject(self, agent: str, note: Notification, why: str) -> None:
        self.stats["rejected_notifications"] += 1
        if self._warned.allow():
            logger.warning(
                "dropped %s for %r from %s: %s", note.kind.value, note.request_id or "-", agent, why
            )

    # ------------------------------------------------------------------ internals: engines

    def _on_stamp(self, agent: str, engine: _Producer | None, note: Notification, now: float) -> list[Any]:
        if engine is None or engine.info is None or agent not in engine.info.agents.values():
            self._reject(agent, note, "heartbeat answer from an agent this rank did not load")
            return []
        known = engine.info.incarnations.get(agent, "")
        if note.incarnation and note.incarnation < known:
            self._reject(agent, note, "a late message of a P incarnation this rank already replaced")
            return []
        if note.incarnation and note.incarnation != known and (agent, note.incarnation) in self._closed:
            # A start this rank saw end (its BYE, or its process exited): a late message, not a
            # restart, whatever its clock (the live start may sort before it: a clock behind).
            self._reject(agent, note, "a late message of a P incarnation that ended")
            return []
        if note.incarnation and note.incarnation != known:
            return self._engine_failed(
                engine,
                f"P engine {engine.engine_id!r} restarted ({agent}: incarnation {known} -> "
                f"{note.incarnation}); its requests are lost",
                now,
            )
        assert note.stamp is not None
        out: list[Any] = []
        if note.stamp >= engine.stamps.get(agent, note.stamp):  # not a late, older answer
            engine.stamps[agent] = note.stamp
            engine.stamped[agent] = now
            self._seq += 1
            engine.stamp_seq[agent] = self._seq
            for rid in sorted(r for r in engine.requests if agent in self._requests[r].awaiting):
                out += self._stamp_awaited(rid, agent, now)
        if agent in engine.hello_pending:
            engine.hello_pending.discard(agent)
            if not engine.hello_pending:
                out += self._engine_ready(engine, now)
        binds = agent in engine.info.answer_attempts
        failed = self._entries(agent, note, note.failed_keys, note.failed_attempts, binds)
        settled = set(note.settled_keys)
        if failed:
            ranks = {r for r, a in engine.info.agents.items() if a == agent}
            for rid in sorted(r for r in engine.requests if self._requests[r].key in failed):
                receive = self._requests.get(rid)
                if receive is None:
                    continue
                if binds:  # about the attempt it names, whatever the order of P's clock
                    about = receive.attempt in failed[receive.key]
                else:  # by key: about registrations older than the answer (P ends those)
                    grant = receive.grants.get(agent)
                    about = grant is None or grant < note.stamp  # else P holds it as a new attempt's
                if receive.phase is _Phase.REGISTERED and ranks & receive.expected and about:
                    # P stopped; unless the answer says no WRITE of the key ended unsettled
                    # (``settled``; an older P does not say), one may have (aborted at its
                    # deadline, with bytes still on the way; its FAIL, which says so, was lost):
                    # fenced before the blocks go back. (The fence may reset the engine: see
                    # below; it cuts the other producers' WRITEs on it too.)
                    if receive.key not in settled:
                        receive.unsettled.update(ranks & (receive.expected - receive.settled))
                    receive.settled.update(ranks)
                    receive.settle_seq = self._fence_seq
                    out += self._close(
                        rid, "P no longer holds this request (it failed, expired or P restarted)", now
                    )
        if engine.info is None:
            return out  # a fence above reset the engine: the rest of the answer is about old agents
        if note.unknown_keys:
            unknown = self._entries(agent, note, note.unknown_keys, note.unknown_attempts, binds)
            out += self._on_unknown(engine, agent, unknown, now)
        if note.want:
            out += self._renew(
                engine, agent, self._entries(agent, note, note.want, note.want_attempts, binds), now
            )
        return out

    def _entries(
        self,
        agent: str,
        note: Notification,
        keys: tuple[str, ...],
        attempts: tuple[int | None, ...] | None,
        binds: bool,
    ) -> dict[str, set[int] | None]:
        """A heartbeat answer's list: key -> the registration attempts its entries name (None:
        any request of the key, from a P that does not state ``answer_attempts``). From a P that
        does, an entry naming no attempt is refused: a late or replayed answer about an earlier
        request of the key must not act on the next one."""
        if not binds:
            return dict.fromkeys(keys)
        out: dict[str, set[int] | None] = {}
        refused = 0
        for i, key in enumerate(keys):
            attempt = attempts[i] if attempts is not None else None
            if attempt is None:
                refused += 1
                continue
            named = out.setdefault(key, set())
            assert named is not None
            named.add(attempt)
        if refused:
            self._reject(agent, note, f"{refused} heartbeat answer entries name no registration attempt")
        return out

    def _on_goodbye(self, agent: str, engine: _Producer | None, note: Notification, now: float) -> list[Any]:
        """A P worker closed (``BYE``): its incarnation ``note.incarnation`` posts nothing more
        and every WRITE it posted to this rank ended (unsettled ones: ``note.unsettled``). Each
        request that registered with that incarnation settles that producer now: a registered
        one fails at once, a closing or held one is released (after a fence when a WRITE ended
        unsettled), instead of waiting for P's silence or, for copies no fence stops, the exit
        of a process that may live on (a worker re-created in it). If the engine still has that
        incarnation loaded its agents are dropped and it is handshaken afresh at once, failing
        no request waiting for it; a handshake that loads the closed incarnation again (P's side
        channel still serves it) waits for the next attempt (:meth:`_engine_down`)."""
        producer, incarnation = note.producer, note.incarnation
        if producer is None:
            return []
        out = self._settle_ended(agent, producer, incarnation, note.unsettled, set(note.delivered), now)
        self._mark_closed(agent, incarnation)
        info = engine.info if engine is not None else None
        if engine is not None and info is not None and info.incarnations.get(agent) == incarnation:
            self._restarting(
                engine,
                f"P agent {agent} closed (incarnation {incarnation} ended) and no new worker of it "
                f"answered within {self.s.peer_silence_s:g}s",
                now,
            )
            # Its requests with that incarnation were settled above; those still waiting wait
            # for a handshake afresh (at once: P's side channel names the worker that serves now).
            reason = f"P agent {agent} closed (incarnation {incarnation} ended)"
            out += self._engine_down(engine, reason, now)
            engine.failed_at = float("-inf")
            if engine.waiting or any(_needs_agents(self._requests[r]) for r in engine.requests):
                self._timers.arm(("retry", engine.engine_id), now)
        return out

    def _settle_ended(
        self,
        agent: str,
        producer: RankKey,
        incarnation: str,
        unsettled: bool,
        delivered: set[str],
        now: float,
    ) -> list[Any]:
        """Producer ``producer``'s incarnation ``incarnation`` (through ``agent``) ended with
        nothing in flight: settle it for every request registered with it. A registered one
        fails at once, unless its DONE arrived or is on its way (``delivered``: it waits for
        its DONEs, ``done_coming``); a closing or held one is released (after a fence when
        ``unsettled``)."""
        out: list[Any] = []
        for rid in sorted(self._requests):
            receive = self._requests.get(rid)
            if receive is None or receive.agents.get(producer) != agent:
                continue
            registered = receive.phase is _Phase.REGISTERED
            # Written whole (by this or an earlier incarnation): nothing is owed, whoever ended.
            coming = registered and producer in receive.reported
            receive.done_coming |= coming
            if receive.incarnations.get(agent) != incarnation:
                continue
            receive.acks.discard(agent)
            receive.awaiting.discard(agent)
            coming = coming or (registered and rid in delivered)
            receive.done_coming |= coming
            if receive.phase is _Phase.WAITING or producer in receive.settled:
                continue
            receive.unanswered.discard(agent)
            receive.settled.add(producer)
            receive.settle_seq = self._fence_seq
            if unsettled:
                receive.unsettled.add(producer)
            if coming:
                continue  # its DONE was sent before the BYE: counted when it arrives (or the watchdog)
            if receive.phase is _Phase.REGISTERED:
                out += self._close(rid, f"P rank {producer} closed (its worker ended) before it pushed", now)
            else:
                out += self._maybe_release(rid, receive, now)
        for where, owed in list(self._unanswered.items()):  # nothing of it is held any more
            entry = owed.get(agent)
            if entry is not None and entry.incarnation == incarnation:
                self._forget_owed(where, agent)
                out += self._acks_moot(where, agent, incarnation, now)
        return out

    def _acks_moot(self, where: tuple[str, str], agent: str, incarnation: str, now: float) -> list[Any]:
        """Requests of P engine and match key ``where`` waiting for ``agent``'s acknowledgement
        of an earlier CANCEL, whose incarnation ended: they wait for the engine instead, to
        register with the worker that serves now (never the closed one)."""
        out: list[Any] = []
        engine = self._engines.get(where[0])
        for rid in sorted(engine.requests if engine is not None else ()):
            receive = self._requests[rid]
            if receive.key != where[1] or agent not in receive.acks:
                continue
            receive.acks.discard(agent)
            if receive.acks or receive.phase is not _Phase.WAITING:
                continue
            assert engine is not None
            self._timers.disarm(("acks", rid))
            loaded = engine.info.incarnations.get(agent) if engine.info is not None else None
            if engine.state is _EngineState.READY and loaded not in (None, incarnation):
                out += self._register(rid, now)
            elif rid not in engine.waiting:
                engine.waiting.append(rid)
                self._timers.arm(("retry", engine.engine_id), now)
        return out

    def _ended_in_process(self, engine: _Producer, info: ProducerInfo, now: float) -> list[Any]:
        """P's handshake states, per producer agent, the earlier incarnations that ended in the
        same process with nothing in flight (``ProducerInfo.ended``: each said goodbye, but
        that ``BYE`` may have been lost). The process D registered a request with says so
        itself, so it settles that incarnation as its ``BYE`` would: a worker re-created in a
        live process would otherwise leave a request held for the closed one's copies (which
        no fence stops) until a process exit that never comes."""
        out: list[Any] = []
        for producer, agent in sorted(info.agents.items()):
            process = info.processes.get(agent)
            for incarnation, unsettled in sorted(info.ended.get(agent, {}).items()):
                if not process or (agent, incarnation) in self._closed:
                    continue
                for rid in sorted(engine.requests):
                    receive = self._requests.get(rid)
                    if (
                        receive is not None
                        and receive.incarnations.get(agent) == incarnation
                        and receive.processes.get(agent) != process
                    ):
                        break  # another process ran it: only that one can vouch for its copies
                else:
                    self._mark_closed(agent, incarnation)
                    out += self._settle_ended(agent, producer, incarnation, unsettled, set(), now)
        return out

    def _restarting(self, engine: _Producer, reason: str, now: float) -> None:
        """A loaded incarnation of ``engine`` ended: wait up to ``peer_silence_s`` for a new
        one (then its requests fail with ``reason``, as for a silent P)."""
        if not engine.restarting:
            self._timers.arm(("restart", engine.engine_id), now + self.s.peer_silence_s)
        engine.restarting = reason

    def _on_restart_timeout(self, engine_id: str, now: float) -> list[Any]:
        """``peer_silence_s`` since a restart was seen and the engine is not ready. Its
        handshakes run a backoff apart, so a new process published just before now would be
        missed: one more attempt decides, made now (or the one running), and only when it fails
        too do the requests waiting fail (:meth:`_restart_failed`)."""
        engine = self._engines.get(engine_id)
        if engine is None or not engine.restarting or engine.state is _EngineState.READY:
            return []
        if engine.restart_expired:
            return self._restart_failed(engine, now)
        engine.restart_expired = True
        if engine.state is not _EngineState.FAILED:
            return []  # the handshake or HELLO running is the last attempt
        waiting = self._wanting(engine)
        if not waiting:
            return self._restart_failed(engine, now)
        engine.failed_at = now - self.s.retry_backoff_max_s - self.s.request_timeout_s  # due now
        return self._engine_wanted(self._requests[waiting[0]].meta, now)

    def _wanting(self, engine: _Producer) -> list[str]:
        """Requests that need a handshake with ``engine``: those waiting for it, then the
        registered ones that need its agents (to register again, or kept at a BYE)."""
        waiting = [r for r in engine.waiting if r in self._requests]
        return waiting + sorted(r for r in engine.requests if _needs_agents(self._requests[r]))

    def _restart_failed(self, engine: _Producer, now: float) -> list[Any]:
        """No new process of a restarting engine answered within ``peer_silence_s`` and a last
        attempt: fail as for a silent P, with the restart's reason."""
        reason, engine.restarting, engine.restart_expired = engine.restarting, "", False
        self._timers.disarm(("restart", engine.engine_id))
        self.stats["dead_peers"] += 1
        return self._engine_failed(engine, reason, now)

    def _engine_down(self, engine: _Producer, reason: str, now: float) -> list[Any]:
        """The engine's loaded agents are no P worker any more (one closed or exited): drop
        them and handshake afresh after the backoff, failing no request waiting for it (unlike
        :meth:`_engine_failed`; bounded by the restart timeout, :meth:`_restarting`). Requests
        registered with those agents fail, except those to be registered again and those a
        closed producer's DONE of theirs is on its way to (``done_coming``: their other
        producers' DONEs, their BYEs or the watchdog end them). After the restart bound it was
        the last attempt: :meth:`_restart_failed`."""
        if engine.restart_expired and engine.restarting:
            return self._restart_failed(engine, now)
        engine.state = _EngineState.FAILED
        engine.error = reason
        engine.refused = False
        if engine.info is not None:
            engine.dead = dict(engine.info.incarnations)
        engine.failed_at = now
        self._timers.disarm(("hello", engine.engine_id))
        self._timers.disarm(("hello_resend", engine.engine_id))
        out: list[Any] = []
        for rid in sorted(engine.requests):  # registered with the agents dropped below
            receive = self._requests.get(rid)
            if receive is None or receive.rereg or receive.done_coming:
                continue
            if receive.phase is _Phase.REGISTERED:
                out += self._close(rid, reason, now)
        if engine.waiting or any(_needs_agents(self._requests[r]) for r in engine.requests):
            self._timers.arm(("retry", engine.engine_id), self._retry_at(engine))
        return out + self._maybe_forget(engine)

    def _on_refused(self, agent: str, engine: _Producer | None, note: Notification, now: float) -> list[Any]:
        """A producer answered this rank's HELLO with FAIL: it refused this rank's handshake
        metadata (the reason names the cause and the fix). Accepted only from a producer
        agent of the engine this rank is handshaking with, for its own rank, while its HELLO is
        unanswered, and only when it echoes that HELLO (or, from a P of an earlier release, names
        none): a refusal of an earlier HELLO, held in the network past an outage, is dropped
        and counted (``late_refusals``). The engine fails like any other
        (:meth:`_engine_failed`): requests that sent no PUSH_REG end at once (nothing was
        registered, so nothing can be written), registered ones (a reconnect) go through the
        quarantine as usual, since the refusal settles nothing; the next handshake waits for
        the backoff."""
        info = engine.info if engine is not None else None
        if (
            engine is None
            or info is None
            or engine.state is not _EngineState.HELLO
            or agent not in engine.hello_pending
            or note.producer is None
            or info.agents.get(note.producer) != agent
        ):
            self._reject(agent, note, "a refusal of a handshake this rank is not running with that agent")
            return []
        if note.hello_id is not None and note.hello_id != engine.hello_id:
            self.stats["late_refusals"] += 1
            logger.debug(
                "dropped %s's refusal of HELLO %d from %s: this rank's HELLO now is %d",
                engine.engine_id,
                note.hello_id,
                agent,
                engine.hello_id,
            )
            return []
        engine.dead = {}  # a refusal is no dead process: the backoff grows as for any failure
        out = self._engine_failed(engine, note.reason, now)
        engine.refused = True
        return out

    def _stamp_awaited(self, rid: str, agent: str | None, now: float) -> list[Any]:
        """A fresh stamp came from ``agent`` for a request waiting to register (None: its bound
        passed); it registers once none is awaited, or queues until its engine is ready."""
        receive = self._requests.get(rid)
        if receive is None or receive.phase is not _Phase.WAITING or not receive.awaiting:
            return []
        if agent is None:
            receive.awaiting.clear()
        else:
            receive.awaiting.discard(agent)
        if receive.awaiting:
            return []
        self._timers.disarm(("stamp", rid))
        engine = self._engines.get(receive.engine_id)
        if engine is None or engine.state is not _EngineState.READY:
            if engine is not None and rid not in engine.waiting:
                engine.waiting.append(rid)
            return []
        return self._register(rid, now)

    def _on_unknown(
        self, engine: _Producer, agent: str, keys: Mapping[str, set[int] | None], now: float
    ) -> list[Any]:
        """A producer never heard of these registered requests. Once could be a PUSH_REG still
        on its way; twice from one agent (a heartbeat interval apart) means it was lost: fail
        at once."""
        out: list[Any] = []
        assert engine.info is not None
        ranks = {r for r, a in engine.info.agents.items() if a == agent}
        for rid in sorted(engine.requests):  # every request of such a key, not one per key
            receive = self._requests.get(rid)
            if receive is None or receive.key not in keys or receive.phase is not _Phase.REGISTERED:
                continue
            if not (receive.expected - receive.settled) & ranks or receive.rereg:
                continue  # (a rank that wrote it whole may have restarted since)
            if not _names(keys[receive.key], receive):
                continue  # about another request of the key
            strikes = receive.unknown_strikes[agent] = receive.unknown_strikes.get(agent, 0) + 1
            if strikes >= 2:
                out += self._close(
                    rid, f"P agent {agent} does not hold this request (its PUSH_REG was lost)", now
                )
        return out

    def _agents_of(self, receive: _Receive) -> set[str]:
        engine = self._engines.get(receive.engine_id)
        if engine is None or engine.info is None:
            return set()
        return {engine.info.agents[r] for r in receive.expected}

    def _engine_ready(self, engine: _Producer, now: float) -> list[Any]:
        engine.state = _EngineState.READY
        engine.restarting, engine.restart_expired = "", False
        self._timers.disarm(("restart", engine.engine_id))
        engine.failures = 0
        self._timers.disarm(("hello", engine.engine_id))
        self._timers.disarm(("hello_resend", engine.engine_id))
        out: list[Any] = []
        untold, engine.untold = engine.untold, OrderedDict()
        if engine.info is not None:  # cancels of requests that never registered, first
            agents = _told_unregistered(engine.info)
            out += [Send(agent, message) for message in untold.values() for agent in agents]
        for rid in sorted(engine.requests):
            if self._requests[rid].rereg:
                out += self._reregister(rid, now)
        out += self._arm_heartbeat(now)  # also renews idle agents' grants
        waiting, engine.waiting = engine.waiting, []
        for rid in waiting:
            if rid in self._requests:
                out += self._register(rid, now)
        return out

    def _on_hello_timeout(self, engine_id: str, now: float) -> list[Any]:
        engine = self._engines.get(engine_id)
        if engine is None or engine.state is not _EngineState.HELLO:
            return []
        if engine.restarting:  # the side channel may still name the process that ended
            why = "P did not answer this rank's HELLO while a P rank restarts"
            return self._engine_down(engine, why, now)
        return self._engine_failed(
            engine,
            f"P did not answer this rank's HELLO within {self.s.hello_timeout_s:g}s: P could not reach "
            f"this engine's side channel at {host_port(self.s.host, self.s.port)} (check the "
            f"advertised address), or notifications between the engines are lost (check the UCX "
            f"transports, e.g. UCX_TLS)",
            now,
            spare=self._done_coming(engine),
        )

    def _done_coming(self, engine: _Producer) -> set[str]:
        """Registered requests of ``engine`` whose producers that ended had all written (or
        said their DONE is on its way): a failed handshake afresh does not fail them; their
        live producers' DONEs, their BYEs or the watchdog end them."""
        return {
            rid
            for rid in engine.requests
            if (r := self._requests.get(rid)) is not None and r.phase is _Phase.REGISTERED and r.done_coming
        }

    def _engine_failed(
        self, engine: _Producer, reason: str, now: float, *, spare: set[str] | frozenset[str] = frozenset()
    ) -> list[Any]:
        """An engine failed or died: fail its requests now (but ``spare``: registered ones that
        wait for the DONEs of live producers, handshaken afresh), forget its agents, back off."""
        out: list[Any] = []
        had_agents = engine.info is not None
        engine.state = _EngineState.FAILED
        engine.error = reason
        engine.refused = False
        loaded = dict(engine.info.incarnations) if engine.info is not None else None
        if loaded is None or loaded != engine.dead:
            engine.failures += 1  # the same dead processes again: the backoff stays as it is
        if loaded is not None:
            engine.dead = loaded
        engine.failed_at = now
        self._timers.disarm(("hello", engine.engine_id))
        self._timers.disarm(("hello_resend", engine.engine_id))
        self._timers.arm(("forget_failed", engine.engine_id), now + self._forget_failed_after())
        for rid in sorted(engine.requests):
            receive = self._requests.get(rid)
            if receive is None:
                continue
            if receive.phase is _Phase.CLOSING:
                continue  # quarantine runs its course (bounded)
            if rid in spare:
                continue
            out += self._close(rid, reason, now)  # CANCELs go out before the agents are dropped
        if spare & engine.requests:  # handshaken afresh for them after the backoff
            self._timers.arm(("retry", engine.engine_id), self._retry_at(engine))
        # Tear the connection down now, before any quarantined block is released: a WRITE stuck
        # in the network (TCP retransmitting through a partition) must find no connection here.
        return out + (self._maybe_forget(engine) if had_agents else [])

    def _forget_failed_after(self) -> float:
        return self.s.retry_backoff_max_s + self.s.request_timeout_s

    def _on_forget_failed(self, engine_id: str, now: float) -> None:
        """A failed engine no request used since (and none will wait for: its backoff is long
        over) is forgotten, as the driver's eviction forgets a loaded one: nothing else did, so
        every P engine id D ever failed (vLLM gives each P start a fresh one) stayed for D's life."""
        engine = self._engines.get(engine_id)
        if engine is None or engine.state is not _EngineState.FAILED:
            return
        if engine.info is not None:
            return  # loaded: the driver's eviction forgets it
        if engine.requests or engine.waiting:
            self._timers.arm(("forget_failed", engine_id), now + self._forget_failed_after())
            return
        if now < engine.failed_at + self._forget_failed_after():
            self._timers.arm(("forget_failed", engine_id), engine.failed_at + self._forget_failed_after())
            return
        self.forget_engine(engine_id)

    def _maybe_forget(self, engine: _Producer) -> list[Any]:
        """Drop a failed engine's agents (its requests keep their producers' identities)."""
        if engine.state is not _EngineState.FAILED or engine.info is None:
            return []
        self._forget_agents(engine)
        return [DropPeer(engine.engine_id, engine.error)]

    def _only_closing(self, engine: _Producer) -> bool:
        """Every request of ``engine`` is closing (or it has none)."""
        return all(
            (r := self._requests.get(rid)) is None or r.phase is _Phase.CLOSING for rid in engine.requests
        )

    def _silent_agents(self, engine: _Producer, now: float) -> list[str]:
        """The agents of a ready engine that answered no keepalive for ``peer_silence_s``."""
        if engine.state is not _EngineState.READY:
            return []
        return sorted(a for a, asked in engine.asked.items() if now - asked > self.s.peer_silence_s)

    def _retry_at(self, engine: _Producer) -> float:
        """When a failed engine is handshaken afresh (only ever for a request that needs it):
        after ``retry_backoff_s``, doubled per failure since its last success, up to
        ``retry_backoff_max_s`` and at most a quarter of ``request_timeout_s`` (a request that
        waits for the attempt gets one well within its watchdog, and a request held for P's
        answer is released soon after P is reachable again, also after a long outage grew the
        backoff). A held request's engine retried at ``retry_backoff_s`` alone broke P restarts
        (its handshakes afresh kept loading the exited process while P restarted: the soak with
        one P kill lost the 20 requests after it)."""
        grown = self.s.retry_backoff_s * 2 ** max(0, engine.failures - 1)
        cap = min(self.s.retry_backoff_max_s, max(self.s.retry_backoff_s, self.s.request_timeout_s / 4))
        return engine.failed_at + min(cap, grown)

    # ------------------------------------------------------------------ heartbeats

    def _arm_heartbeat(self, now: float) -> list[Any]:
        if not self._heartbeat_armed:
            self._heartbeat_armed = True
            self._timers.arm(("heartbeat", ""), now + self.s.heartbeat_interval_s)
        return []

    def _heartbeat(self, now: float) -> list[Any]:
        """Renew every registered request's grant at its P agents; declare silent agents dead."""
        out: list[Any] = []
        for engine in list(self._engines.values()):
            if engine.info is None or engine.state is not _EngineState.READY:
                continue
            probes: list[tuple[str, Mapping[str, Any]]] = []
            probe_at = 0
            for agent in sorted(set(engine.info.agents.values())):
                keys = self._keys_for(engine, agent)
                if not keys:
                    # Nothing is asked of an idle agent (a keepalive is no liveness check): its
                    # silence counts from the next heartbeat naming a key, not from before.
                    engine.heard.pop(agent, None)
                    out += self._keepalive(engine, agent, now)
                    continue
                heard = engine.heard.get(agent, now)
                if now - heard > self.s.peer_silence_s:
                    self.stats["dead_peers"] += 1
                    out += self._engine_failed(
                        engine, f"P agent {agent} answered no heartbeat for {self.s.peer_silence_s:g}s", now
                    )
                    break
                identity = engine.info.processes.get(agent)
                if now - heard > self.s.heartbeat_interval_s and identity is not None:
                    # A heartbeat answer missed: has its process exited (killed, maybe already
                    # back under its name)? Then D need not wait for peer_silence_s.
                    probe_at = probe_at if probes else len(out)  # before its renewal, as sent
                    probes.append((agent, identity))
                engine.heard.setdefault(agent, now)
                out += self._send_renewal(engine, agent, keys, now)
            else:
                if probes:  # one probe per engine: exits seen together are handled together
                    # (one at a time, the first reconnected the engine and the next was dropped)
                    out.insert(probe_at, ProbeExit(ENGINE_PROBE + engine.engine_id, tuple(probes)))
        if any(r.phase is not _Phase.CLOSING for r in self._requests.values()) or any(
            self._kept_alive(e, now) for e in self._engines.values()
        ):
            out += self._arm_heartbeat(now)
        return out

    def _kept_alive(self, engine: _Producer, now: float) -> bool:
        """A ready engine used within ``keepalive_s``: its idle agents' grants are renewed."""
        return engine.state is _EngineState.READY and now - engine.last_request <= self.s.keepalive_s

    def _keepalive(self, engine: _Producer, agent: str, now: float) -> list[Any]:
        """An idle P agent's stamp, once it would be half the freshness window old by the next
        heartbeat, is renewed by a heartbeat without keys (P answers every heartbeat with a
        stamp): the next PUSH_REG then carries a grant at most about half a window old, and P
        need not ask for one first (a round trip). (Checked against this tick alone, an answer
        arriving just after the tick was skipped at the next one and the grant aged to a whole
        window.) Only for ``keepalive_s`` after the engine's last request. An idle agent's
        silence fails nothing; an idle engine whose keepalives went unanswered for
        ``peer_silence_s`` is handshaken afresh at its next request (P may have restarted under
        the same agent names: :meth:`_engine_wanted`)."""
        half_old_at = engine.stamped.get(agent, float("-inf")) + self.s.fresh_s / 2
        if not self._kept_alive(engine, now) or now + self.s.heartbeat_interval_s < half_old_at:
            return []
        self.stats["keepalives_sent"] += 1
        engine.asked.setdefault(agent, now)
        reg = self._coordinates("(keepalive)", None, grant=engine.stamps.get(agent))
        return [Send(agent, wire.encode_heartbeat([], reg, self.s.tp_rank))]

    def _keys_for(self, engine: _Producer, agent: str) -> dict[str, str]:
        """Match key -> request id of the registered requests this agent writes into."""
        assert engine.info is not None
        ranks = {r for r, a in engine.info.agents.items() if a == agent}
        out = {}
        for rid in engine.requests:
            receive = self._requests[rid]
            if receive.phase is _Phase.REGISTERED and receive.expected & ranks and not receive.rereg:
                out[receive.key] = rid
        return out

    def _renew(
        self, engine: _Producer, agent: str, want: Mapping[str, set[int] | None], now: float
    ) -> list[Any]:
        """P asked ``agent``'s registrations of ``want`` for a fresh grant: each registered
        request of those keys whose producer there has not settled sends its own PUSH_REG
        again, with the newest stamp. P renews a registration only on a message naming it (a
        heartbeat names keys: with two requests of this rank under one key, P would renew
        whichever it holds), so a request's grant moves only with its own PUSH_REGs and a
        closing request's quarantine runs from its own last one."""
        assert engine.info is not None
        ranks = {r for r, a in engine.info.agents.items() if a == agent}
        grant = engine.stamps.get(agent)
        out: list[Any] = []
        for rid in sorted(engine.requests):
            receive = self._requests[rid]
            if receive.key not in want or receive.phase is not _Phase.REGISTERED:
                continue
            if not (receive.expected - receive.settled) & ranks or not _names(want[receive.key], receive):
                continue
            if grant is not None:
                receive.last_grant = now
            out.append(Send(agent, wire.encode_push_reg(self._coordinates(rid, receive, grant=grant))))
            self.stats["registrations_renewed"] += 1
        return out

    def _send_renewal(self, engine: _Producer, agent: str, keys: dict[str, str], now: float) -> list[Any]:
        """The keys D still waits for at ``agent``: P keeps their leases and answers with its
        stamp (a liveness check) and what it wants, failed or never heard of. It renews no
        registration's grant (see :meth:`_renew`). To a P that states ``answer_attempts`` it
        names the attempt of each key (``ra``): P's answer names it back, D acts on it only for
        that attempt, and P ends only the attempts it answered failed. To one that does not it
        names none: P then ends every registration of a key older than its ``failed`` answer,
        as D does (:meth:`_on_stamp`)."""
        reg = self._coordinates("(heartbeat)", None, grant=engine.stamps.get(agent))
        binds = engine.info is not None and agent in engine.info.answer_attempts
        names = sorted(keys)
        out = []
        for start in range(0, len(names), HEARTBEAT_KEYS_PER_MESSAGE):
            chunk = names[start : start + HEARTBEAT_KEYS_PER_MESSAGE]
            attempts = [self._requests[keys[k]].attempt or None for k in chunk] if binds else None
            out.append(Send(agent, wire.encode_heartbeat(chunk, reg, self.s.tp_rank, attempts=attempts)))
            self.stats["heartbeats_sent"] += 1
        return out

    def _send_push_regs(
        self, rid: str, receive: _Receive, engine: Any, info: Any, ranks: Any, now: float
    ) -> list[Any]:
        """A PUSH_REG of ``rid`` to each of ``ranks``, with the newest grant of its agent."""
        out: list[Any] = []
        for rank in ranks:
            agent = info.agents[rank]
            reg = self._coordinates(rid, receive, grant=engine.stamps.get(agent))
            receive.grants[agent] = reg.grant
            if reg.grant is not None:
                receive.last_grant = now
            out.append(Send(agent, wire.encode_push_reg(reg)))
            self.stats["push_regs_sent"] += 1
        return out

    def _coordinates(
        self, rid: str, receive: _Receive | None = None, grant: float | None = None
    ) -> PushRegistration:
        return PushRegistration(
            request_id=rid or "(hello)",
            match_key=receive.key if receive is not None else "(none)",
            decode_engine_id=self.s.engine_id,
            decode_host=self.s.host,
            decode_port=self.s.port,
            decode_tp_size=self.s.tp_size,
            block_ids=receive.meta.block_ids if receive is not None else (),
            remote_engine_id=receive.engine_id if receive is not None else "(any)",
            decode_tp_rank=self.s.tp_rank,
            staging_offset=receive.staging_offset if receive is not None else -1,
            decode_incarnation=self.s.incarnation,
            grant=grant,
            fresh_s=self.s.fresh_s,
            prompt_fingerprint=receive.meta.params.prompt_fingerprint if receive is not None else None,
            block_start=receive.meta.block_start if receive is not None else None,
            num_tokens=receive.meta.num_tokens if receive is not None else None,
            attempt=receive.attempt if receive is not None else None,
        )


def _told_unregistered(info: ProducerInfo) -> list[str]:
    """The producer agents told of a request that ended before it registered: those stating
    ``unregistered_cancels`` (an older P would take that CANCEL for the cancel of the key)."""
    return sorted(set(info.agents.values()) & info.unregistered_cancels)


def _names(attempts: set[int] | None, receive: _Receive) -> bool:
    """Does a heartbeat answer's entry (the attempts it names; None: any) speak of ``receive``?"""
    return attempts is None or receive.attempt in attempts


class _Owed(NamedTuple):
    """A CANCEL a silent producer owes an ack for (its registration released on a fence)."""

    incarnation: str
    """The producer's incarnation the request registered with."""
    request_id: str
    message: bytes
    """The CANCEL, sent again before the key's next request registers."""
    attempt: int
    """The registration attempt it names: the ack must echo it."""
    echoes: bool
    """The producer stated that its results echo the attempt: an ack naming none is refused."""


def _attempt_seed(incarnation: str) -> int:
    """Where a start's registration attempt ids begin: 60 bits of a hash of its incarnation, so
    that a result for an earlier process under the same agent name (without a MAC) names an
    id this start does not use; it starts below 2**60, so more than 2**62 ids stay below
    ``notifications.MAX_ATTEMPT``."""
    digest = hashlib.blake2b(b"attempt\0" + incarnation.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 4


def _hello_seed(incarnation: str) -> int:
    """Where a start's HELLO ids begin: 48 bits of a hash of its incarnation, times 4096, so
    two starts under one agent name count their attempts in different ranges (below 2**63)."""
    digest = hashlib.blake2b(incarnation.encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big") << 12


def _needs_agents(receive: _Receive) -> bool:
    """Whether a request of a failed engine needs its agents loaded again: one to register
    again, or one kept registered at a BYE (its live producers are renewed through them)."""
    return bool(receive.rereg) or receive.phase is _Phase.REGISTERED


def _take_agents(receive: _Receive, info: ProducerInfo) -> None:
    """Record ``info``'s agents and incarnations for ``receive``'s producers that ``info``
    names; a producer it does not name (P came back with another layout) keeps its old
    agent, the one its cancel, exit probe or fence must reach."""
    mine = {r: a for r, a in info.agents.items() if r in receive.expected}
    receive.agents = {**receive.agents, **mine}
    receive.incarnations = {
        **receive.incarnations,
        **{a: info.incarnations[a] for a in mine.values() if a in info.incarnations},
    }
    taken = frozenset(mine.values())
    receive.echoing = (receive.echoing - taken) | (info.echo_attempts & taken)


def _layout_change(receive: _Receive, info: ProducerInfo) -> str:
    """How ``info``'s producers differ from those ``receive`` registered with ("" when they
    are the same ranks writing the same pieces of this rank)."""

    def names(ranks: Iterable[RankKey]) -> str:
        return ", ".join(str(r) for r in sorted(ranks)) or "none"

    if frozenset(info.agents) != receive.expected:
        return (
            f"producers {names(info.agents)} (PP {info.prefill_pp}, TP {info.prefill_tp}) where it "
            f"registered with {names(receive.expected)}"
        )
    if info.prefill_tp != receive.prefill_tp:
        # The same producers and pieces (D TP >= both sizes), but their DONEs state P's new TP
        # size, which the request's check (``prefill_tp``) would drop.
        return f"P TP {info.prefill_tp} where it registered with P TP {receive.prefill_tp}"
    moved = [r for r in sorted(receive.expected) if info.shares.get(r) != receive.shares.get(r)]
    if moved:
        return f"another split of this rank's layers or heads among {names(moved)}"
    return ""


def _pieces(regions: Iterable[int], part: tuple[int, int]) -> set[tuple[int, Any, Any]]:
    """A packed manifest's ``(D region, block slice start, end)`` pieces (fractions of a block)."""
    from fractions import Fraction

    index, count = part
    start, end = Fraction(index, count), Fraction(index + 1, count)
    return {(j, start, end) for j in regions}
