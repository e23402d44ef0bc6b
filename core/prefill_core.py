"""The P protocol core: a pure state machine for one prefill rank (no I/O, no threads, no clock).

Events in (each takes ``now``, seconds on the driver's lease clock): :meth:`PrefillCore.finished`,
:meth:`~PrefillCore.notification` (PUSH_REG, HB, HELLO, CANCEL), :meth:`~PrefillCore.connected`,
:meth:`~PrefillCore.confirm_post`, :meth:`~PrefillCore.posted`, :meth:`~PrefillCore.post_failed`,
:meth:`~PrefillCore.write_settled`, :meth:`~PrefillCore.fail`, :meth:`~PrefillCore.handle_timer`.
Actions out: :mod:`kvpush.core.actions`.

The rules it keeps (docs/reliability.md):

- **Per-rank registrations.** P writes to a D rank only on that rank's own ``PUSH_REG``, with
  that rank's block ids and staging reservation, and only if the PUSH_REG came from the agent P
  loaded for that rank from D's side channel (same engine, same incarnation).
- **Freshness fencing.** A registration may be written only until ``grant + fresh_s`` on P's
  clock, where the grant is a stamp P itself issued (a heartbeat answer) and D echoed back in
  that registration's own PUSH_REG (sent again to renew it; a heartbeat names keys only and
  renews no grant).
- **A registration is named, never a key.** One registration per (key, D rank) is written; a
  CANCEL acts on the registration it names, and every registration P will not write (replaced
  on its rank, refused, cancelled) is answered once and never written afterwards.
  ``confirm_post`` checks it (and for a cancel) immediately before every post, after the driver
  drained notifications; a stale registration makes P ask D for a fresh grant (``want``).
- **WRITE deadlines.** A WRITE not settled within ``write_deadline_s`` is aborted, D is told,
  and D's engine dropped so the next push opens a fresh connection. A WRITE its transport
  cannot abort (a kernel copy already launched, ``posted(abortable=False)``) is not given up:
  P waits for it, counts it (``overdue_kernel_writes``) and answers D only once it ended.
- **One exit.** Every finished prefill is reported exactly once (sent or failed), its state
  deleted in that step; a tombstone answers later messages for the key with FAIL.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvpush.core import notifications as wire
from kvpush.core.actions import Abort, AskStart, Connect, DropPeer, Post, Report, Send
from kvpush.core.addresses import host_port
from kvpush.core.deadlines import Deadlines, RateLimit
from kvpush.core.types import (
    BlockIds,
    Notification,
    NotificationKind,
    PushRegistration,
    RankKey,
    ReadSpec,
)
from kvpush.core.wire import HELLO_REQUEST_ID

logger = logging.getLogger(__name__)

WANT_KEYS_PER_MESSAGE = 256
"""Keys per ``want`` message (as D's heartbeats; far below the wire's ``MAX_KEYS``)."""
MAX_DISPLACED = 16
"""Registrations of another prompt a key keeps (replaced on their D rank before the finish)."""
MAX_OWED = 256
"""FAILs per D engine held until P loads their D rank (refused registrations of unloaded ranks)."""
MAX_DELIVERED = 1024
"""D request ids per D rank whose completed WRITE a goodbye names (the newest ones)."""
MAX_DEFERRED = 1024
"""Messages of a restarted D engine held while its old agents' WRITEs settle (a kernel copy
that does not end can hold them long); past it the oldest is dropped, as a lost message."""


def _grant(reg: PushRegistration, now: float) -> float:
    """The grant a registration carries, for ordering two of one D rank (none, or one later
    than P's clock, which P never issued: older than any)."""
    return float("-inf") if reg.grant is None or reg.grant > now else reg.grant


def _another(current: _Reg | None, reg: PushRegistration) -> bool:
    """Is ``reg`` another registration of the same D start (incarnation) and rank than
    ``current``? (One of another start is sorted out by what P loads for the rank.)"""
    return (
        current is not None
        and current.reg.decode_incarnation == reg.decode_incarnation
        and _ident(current.reg) != _ident(reg)
    )


def _other_attempt(held: PushRegistration, named: PushRegistration) -> bool:
    """Both state a registration attempt, and they differ: the same D request id given to
    two requests (D forgot the first), so not the same registration."""
    return held.attempt is not None and named.attempt is not None and held.attempt != named.attempt


def _differs(fingerprint: str | None, reg: PushRegistration) -> bool:
    """Both sides stated a prompt fingerprint, and they differ."""
    return fingerprint is not None and reg.prompt_fingerprint not in (None, fingerprint)


@attrs.frozen(kw_only=True)
class PrefillSettings:
    """The P rank's identity and the bounds the core enforces (seconds)."""

    engine_id: str
    incarnation: str
    rank: RankKey
    tp_size: int
    lease_s: float = 30.0
    """Finished blocks not claimed by every destination's PUSH_REG this long are released."""
    registration_ttl_s: float = 120.0
    """A PUSH_REG with no finished prefill this long is dropped; tombstones live this long."""
    write_deadline_s: float = 10.0
    """A WRITE not settled this long is aborted (published to D, which adds it to its quarantine)."""
    want_interval_s: float = 0.05
    """At most one request for a fresh grant per D agent this often."""
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 30.0
    max_stash_per_engine: int = 4096
    """Registrations held (no prefill finished yet) per D engine; more are dropped."""


class _Dest(enum.Enum):
    WAIT_REG = "waiting for this D rank's PUSH_REG"
    WAIT_CONNECT = "waiting for the handshake with this D rank"
    WAIT_FRESH = "waiting for a fresh grant from this D rank"
    POSTING = "post requested"
    INFLIGHT = "WRITE in flight"
    DONE = "done"
    FAILED = "failed"


@attrs.define(eq=False)
class _Reg:
    reg: PushRegistration
    agent: str
    fresh_until: float
    grant: float = attrs.field(
        default=attrs.Factory(lambda self: _grant(self.reg, float("inf")), takes_self=True)
    )
    """The newest grant taken for it (its PUSH_REG's, or a renewal's: the same PUSH_REG again)."""


@attrs.define(eq=False)
class _DestState:
    state: _Dest = _Dest.WAIT_REG
    spec: ReadSpec | None = None
    planned_from: PushRegistration | None = None
    """The registration ``spec`` was planned from; the spec is reused only while that
    registration is still the destination's (planned once per registration)."""
    handles: set[Any] = attrs.field(factory=set)
    bytes: int = 0
    error: str = ""
    unsettled: bool = False
    """A WRITE was posted (or a post was attempted) and did not complete: bytes may be on the way."""
    abortable: bool = True
    """Whether the transport can take the WRITE back (a launched kernel copy cannot)."""


@attrs.define(eq=False)
class _Request:
    key: str
    request_id: str = ""
    blocks: BlockIds | None = None
    """Set once the prefill finished."""
    engine_id: str = ""
    """The D engine bound to the key: the router's choice, else (once the prefill finished) the
    first registrant; before that, the first registrant tentatively."""
    bound: bool = False
    regs: dict[int, _Reg] = attrs.field(factory=dict)
    others: dict[str, dict[int, _Reg]] = attrs.field(factory=dict)
    """Registrations of other engines for an unbound key: one of them may be the router's D."""
    dests: dict[int, _DestState] | None = None
    """Planned destinations (once finished and the first registration arrived)."""
    failure: str = ""
    fingerprint: str | None = None
    """P's prompt fingerprint (set at the finish); None: pairing rests on the key alone."""
    displaced: list[_Reg] = attrs.field(factory=list)
    """Registrations replaced on their D rank, before the finish, by one of another prompt:
    checked (and answered) at the finish with the others."""
    cancel_acks: dict[str, tuple[str, int | None]] = attrs.field(factory=dict)
    """D agent -> (D request id, registration attempt) of cancels to acknowledge once nothing is in flight."""
    cut: dict[int, str] = attrs.field(factory=dict)
    """D rank -> the D incarnation of the registration P dropped when the rank's endpoint
    broke, nothing posted to it (:meth:`PrefillCore._rank_gone`): asked for again by the next
    heartbeat naming the key; failed once another start of the rank is loaded."""
    cancelled: bool = False
    write_at_cancel: bool = False
    """A WRITE was in flight when D's CANCEL arrived (settled before the ack is sent)."""
    past: _Tomb | None = None
    """The key's ended attempts when this is a new one (a retry under the same key): their
    registrations are answered as the tombstone would, never written."""
    seen: set[_Ident] = attrs.field(factory=set)
    """The D registrations (PUSH_REG, CANCEL) this attempt saw."""
    gone: set[_Ident] = attrs.field(factory=set)
    """D registrations this attempt will never write: replaced on their D rank by another,
    refused while their rank was written, or cancelled. Each was answered (FAIL or
    CANCEL_ACK) once; a duplicate or late PUSH_REG of one is dropped, never takes its rank back."""
    gone_overflow: bool = False
    """More than ``MAX_SEEN`` of them: every later registration of the key is refused."""
    told: dict[tuple[str, int], float] = attrs.field(factory=dict)
    """(D engine, D rank) -> when P answered its heartbeat that this key failed for it."""
    told_attempts: set[_Told] = attrs.field(factory=set)
    """The D registration attempts P answered ``failed`` for this key (to a D naming them)."""


@attrs.define(eq=False)
class _Decode:
    engine_id: str
    host: str
    port: int
    agents: dict[int, str] = attrs.field(factory=dict)
    connecting: set[int] = attrs.field(factory=set)
    incarnations: dict[int, str] = attrs.field(factory=dict)
    """Incarnation of each loaded D rank (every rank process has its own)."""
    loaded_at: dict[int, float] = attrs.field(factory=dict)
    """P's clock when each D rank's agent was last loaded: only a grant issued since (a stamp
    D can only have had over this load's connection) lets P post to it."""
    tp_size: int = 0
    inflight: int = 0
    drop_when_idle: str = ""
    hellos: dict[int, str] = attrs.field(factory=dict)
    """D ranks whose HELLO awaits the handshake, by the agent the HELLO came from."""
    hello_incarnations: dict[int, str] = attrs.field(factory=dict)
    """The incarnation each of those HELLOs stated."""
    asked_for: dict[int, str] = attrs.field(factory=dict)
    """The incarnation stated by the message that asked for each D rank's handshake in flight."""
    hello_ids: dict[int, int] = attrs.field(factory=dict)
    """The id each of those HELLOs stated (since 2.6; absent: none), echoed by a refusal."""
    last_want: dict[str, float] = attrs.field(factory=dict)
    want_pending: dict[str, set[str]] = attrs.field(factory=dict)
    """Keys per D agent whose fresh grant is to be asked once the rate limit allows."""
    deferred: list[tuple[str, Notification]] = attrs.field(factory=list)
    """Messages of a newer incarnation, handled once the stale agents are dropped."""
    replacing: dict[int, str] = attrs.field(factory=dict)
    """D ranks restarted under the same name whose old agent is dropped (why) once no WRITE
    to it is in flight; their new start's messages wait in ``deferred`` till then."""
    owed: dict[int, list[tuple[str, str, bytes]]] = attrs.field(factory=dict)
    """Per D rank: (agent, incarnation, FAIL or CANCEL_ACK) for registrations answered before P
    loaded that rank, sent once it is loaded from that agent and incarnation (never to a later
    start, which may use the request id again)."""
    delivered: dict[int, tuple[str, deque[str]]] = attrs.field(factory=dict)
    """Per D rank: its agent and the D request ids whose WRITE to it completed lately (at most
    ``MAX_DELIVERED``). The goodbye names them: UCX may deliver the goodbye before a WRITE's
    DONE, and D must not fail a request whose DONE is on its way."""
    touched: float = 0.0
    """P's clock at the last message naming this engine (an engine never loaded is forgotten
    ``registration_ttl_s`` after it: see ``PrefillCore._unloaded``)."""

    def unused(self) -> bool:
        """Nothing loaded, handshaking, in flight or waiting for it."""
        return not (
            self.agents
            or self.connecting
            or self.inflight
            or self.deferred
            or self.replacing
            or self.drop_when_idle
        )


MAX_REPLACED = 4096
"""(D engine, rank) entries of ``PrefillCore._replaced`` kept (oldest forgotten first), each
with the last ``MAX_REPLACED_PER_RANK`` incarnations."""
MAX_REPLACED_PER_RANK = 16

MAX_SEEN = 1024
"""D registrations a key remembers across its attempts; past that, every registration of a new
D request id is taken for an ended attempt's (refused, never written)."""

_Ident = tuple[str, str, int, str]
"""A D registration: (D engine, its incarnation, D rank, D request id)."""


def _ident(reg: PushRegistration) -> _Ident:
    return (reg.decode_engine_id, reg.decode_incarnation, reg.decode_tp_rank, reg.request_id)


def _saw_request(seen: set[_Ident], reg: PushRegistration) -> bool:
    """Did ``seen`` take in ``reg``'s D request on any of its engine's ranks? (Each D rank
    sends its own PUSH_REG and CANCEL, under its own incarnation.)"""
    return any(s[0] == reg.decode_engine_id and s[3] == reg.request_id for s in seen)


_Told = tuple[str, str, int, int | None]
"""A D registration attempt P answered ``failed``: (D engine, its incarnation, D rank, attempt)."""


def _told(reg: PushRegistration) -> _Told:
    return (reg.decode_engine_id, reg.decode_incarnation, reg.decode_tp_rank, reg.attempt)


def _tell_failed(
    told: dict[tuple[str, int], float],
    told_attempts: set[_Told],
    reg: PushRegistration,
    attempt: int | None,
    now: float,
) -> None:
    """P answers D rank ``reg`` (a heartbeat's coordinates) that a key failed: a D that named
    the attempt it asked about (since 2.8) ends that one, which P then never writes; one that
    named none ends every registration of the key older than the answer (``told``). Past
    ``MAX_SEEN`` attempts one more is kept, which marks the overflow (every registration of
    the key is then taken for an ended one's: ``_Tomb.overflow``)."""
    if attempt is None:
        told[(reg.decode_engine_id, reg.decode_tp_rank)] = now
    elif len(told_attempts) <= MAX_SEEN:
        told_attempts.add((reg.decode_engine_id, reg.decode_incarnation, reg.decode_tp_rank, attempt))


@attrs.define(eq=False)
class _Tomb:
    """What P remembers of a key's ended attempts (``registration_ttl_s`` after the last)."""

    outcome: str
    """"sent" or "failed": how the last attempt ended."""
    engine_id: str
    failure: str
    unsettled: bool
    """Whether a WRITE of the last attempt ended unsettled."""
    fingerprint: str | None
    ended_at: float
    """P's clock when the last attempt ended: a grant not newer than this was issued before."""
    seen: set[_Ident] = attrs.field(factory=set)
    """Every D registration an ended attempt saw (PUSH_REG or CANCEL): answered by the tombstone
    in any later attempt too, never written."""
    told: dict[tuple[str, int], float] = attrs.field(factory=dict)
    """(D engine, D rank) -> when P last told it the key had ended (a heartbeat answer's
    ``failed``, which ends D's registrations of the key older than that answer)."""
    told_attempts: set[_Told] = attrs.field(factory=set)
    """The D registration attempts P answered ``failed`` for the key, each to a D that named it
    in its heartbeat (since 2.8): D ended exactly those, so P never writes them (past
    ``MAX_SEEN`` of them: ``overflow``). A D that names none ends every registration of the key
    older than the answer (``told``)."""
    prefills: set[str] = attrs.field(factory=set)
    """P's request ids the ended attempts accounted for (finished or abandoned): a finish by one
    of them is refused; a finish by another prefill is a new attempt."""
    unfinished: bool = False
    """The last attempt ended before P finished or abandoned a prefill for it (D cancelled, its
    registration expired): the next finish (or abandon) is that attempt's own prefill."""
    overflow: bool = False
    """More than ``MAX_SEEN`` registrations: every new D request id is taken for an old one."""
    asked: dict[_Ident, float] = attrs.field(factory=dict)
    """D registrations P asked for a fresh grant (:meth:`renewable`) -> the stamp it sent: a
    renewal granted that stamp or later proves D still holds it (the next attempt's)."""

    def covers(self, reg: PushRegistration, now: float) -> bool:
        """Is ``reg`` (possibly) a registration of an ended attempt? Yes when an ended attempt
        saw it; when its D rank took no part in them (a late leg of the ended attempt, as far
        as P can tell); or when its grant does not prove D sent it after the end: not newer
        than the end, older than what P last told that D rank, absent, or not one P issued."""
        ident = _ident(reg)
        if self.overflow or ident in self.seen or _told(reg) in self.told_attempts:
            return True
        grant = reg.grant
        asked = self.asked.get(ident)
        if asked is not None and grant is not None and asked <= grant <= now:
            return False  # renewed after P asked for it: D holds it now
        if not any(seen[0] == ident[0] and seen[2] == ident[2] for seen in self.seen):
            return True
        told = self.told.get((reg.decode_engine_id, reg.decode_tp_rank), float("-inf"))
        return grant is None or grant <= self.ended_at or grant < told or grant > now

    def renewable(self, reg: PushRegistration, now: float) -> bool:
        """Is ``reg`` covered by a pushed attempt only because its grant is not newer than the
        end on P? D registers a key again once a stamp *reached* it after the end on D, and
        P's writer may poll the last WRITE complete after issuing that stamp (or the stamp may
        reach D after the DONE): a grant fresh on D's side may be older than ``ended_at``.
        Such a registration is asked for a fresh grant instead of being dropped: D renews
        only a registration it still holds, so the renewal is the next attempt's."""
        ident = _ident(reg)
        grant = reg.grant
        return (
            self.outcome == "sent"
            and self.engine_id == reg.decode_engine_id  # the D engine it was pushed to
            and any(seen[0] == ident[0] and seen[2] == ident[2] for seen in self.seen)  # its rank took part
            and not self.overflow
            and ident not in self.seen
            and ident not in self.asked
            and len(self.asked) < MAX_SEEN
            and grant is not None
            and grant <= self.ended_at <= now
        )


@attrs.define(eq=False)
class _Backoff:
    """Failed handshakes at one D address: a negative cache, whatever engine id a message
    claims."""

    until: float
    """Not handshaken again before this (unless a HELLO skips it: :meth:`PrefillCore._connect`)."""
    failures: int
    error: str
    hello_at: float = float("-inf")
    """When a HELLO last skipped the backoff."""


@attrs.define(eq=False)
class _Refusal:
    """P refused a D rank's handshake metadata but loaded its agent notify-only to say why."""

    engine_id: str
    agent: str
    incarnation: str
    reason: str
    retried_at: float = float("-inf")
    """When a newer incarnation of that D rank last skipped the address backoff."""


@attrs.define(eq=False)
class _Asking:
    """A side-channel question about which start of a D rank runs (``AskStart``), in flight."""

    asked_at: float
    held: list[tuple[str, Notification]] = attrs.field(factory=list)
    """Messages of starts P has not loaded, handled once it is answered."""
    overtaken: bool = False
    """A handshake loaded a start of the rank while this was in flight: the answer, read at
    some moment during it, may be older than the handshake's word, so it is not taken."""


Planner = Callable[[BlockIds, PushRegistration], Sequence[ReadSpec]]
"""``plan(local blocks, registration)`` -> read specs (trim, read-spec hook, plan check)."""


class PrefillCore:
    """Protocol state of one P rank. Not thread-safe: one driver thread feeds it."""

    def __init__(self, settings: PrefillSettings, *, plan: Planner) -> None:
        self.s = settings
        self._plan = plan
        self._requests: dict[str, _Request] = {}
        self._tombstones: dict[str, _Tomb] = {}
        """Ended keys (see :class:`_Tomb`)."""
        self._engines: dict[str, _Decode] = {}
        self._timers = Deadlines()
        self._warned = RateLimit(per_s=10)
        self._refused: dict[tuple[str, _Ident], float] = {}
        """(key, D registration) D cancelled before P knew the key: its late PUSH_REG is refused."""
        self._unregistered: dict[str, dict[_Ident, bool]] = {}
        """Key -> D registrations D cancelled that P does not hold, in arrival order: never held
        (D's request ended before it registered), or held for an engine while the key was not
        bound (:meth:`_remember_held_cancel`); at most ``MAX_SEEN`` per key, each key
        ``registration_ttl_s`` after its last. A finished prefill of the key that nothing else is
        held for ends at once instead of waiting for its lease (:meth:`_cancelled_unregistered`).
        Each maps to whether P held it."""
        self._connecting: dict[tuple[str, int], str] = {}
        """Address -> the one engine id being handshaken there."""
        self._address_backoff: dict[tuple[str, int], _Backoff] = {}
        """Address -> its failed handshakes (cleared by one that succeeds)."""
        self._refusals: dict[tuple[tuple[str, int], int], _Refusal] = {}
        """(address, D rank) -> the refusal of that rank's metadata, told through its agent
        (loaded notify-only) to every HELLO and registration from it until the backoff ends."""
        self._replaced: dict[tuple[str, int], list[str]] = {}
        """(D engine, rank) -> the incarnations P loaded for it and dropped since (kept when the
        engine is forgotten): their late messages are stale, whatever their start time says."""
        self._asking: dict[tuple[str, int], _Asking] = {}
        """(D engine, rank) -> the side-channel question in flight about which start of it runs,
        and the messages of the unknown start held until it is answered."""
        self._served: dict[tuple[str, int], str] = {}
        """(D engine, rank) -> the start its side channel said runs, once asked: a message of
        that start is a restart of the rank."""
        self._unserved: OrderedDict[tuple[str, int, str], tuple[float, float]] = OrderedDict()
        """(D engine, rank, incarnation) of starts whose messages came while the side channel
        served another start (at most ``MAX_REPLACED``) -> (until when their messages are
        dropped unasked, the backoff that set it): a dead start's late messages."""
        self._closing = ""
        """Why this rank is shutting down ("" while it is not): see :meth:`shutdown`."""
        self._said_goodbye = False
        """Said goodbye (:meth:`goodbye`): nothing is posted any more."""
        self._unsettled_to: set[tuple[str, int]] = set()
        """(D engine, D rank) to which a WRITE of this incarnation ended without completing."""
        self.stats: dict[str, int] = {
            "pushes": 0,
            "bytes": 0,
            "writes": 0,
            "duplicate_registrations": 0,
            "registrations_cut": 0,
            "rejected_notifications": 0,
            "cancels": 0,
            "cancels_during_write": 0,
            "heartbeat_renewals": 0,
            "registration_renewals": 0,
            "stale_registrations": 0,
            "grants_before_load": 0,
            "grants_asked_after_end": 0,
            "write_deadline_expiries": 0,
            "overdue_kernel_writes": 0,
            "dead_engines": 0,
            "connects_deferred": 0,
            "prompt_mismatches": 0,
            "handshake_refusals": 0,
            "decode_restarts": 0,
            "starts_asked": 0,
            "unserved_starts_dropped": 0,
        }

    # ------------------------------------------------------------------ queries

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def state_sizes(self) -> dict[str, int]:
        return {
            "requests": len(self._requests),
            "stashed": sum(1 for r in self._requests.values() if r.blocks is None),
            "tombstones": len(self._tombstones) + len(self._refused) + len(self._unregistered),
            "engines": len(self._engines),
            "timers": len(self._timers),
            "inflight": sum(e.inflight for e in self._engines.values()),
        }

    def busy_engines(self) -> set[str]:
        """D engines some request still needs (never evicted)."""
        return {r.engine_id for r in self._requests.values() if r.engine_id} | {
            e.engine_id for e in self._engines.values() if e.inflight or e.connecting
        }

    def forget_engine(self, engine_id: str) -> None:
        """The driver evicted an idle engine: a later registration reconnects."""
        engine = self._engines.get(engine_id)
        if engine is not None and not engine.inflight:
            # ``_unsettled_to`` stays: an aborted WRITE's bytes may still land until D fences
            # (the goodbye to that D rank, once loaded again, must still say so), as after
            # ``_drop_engine`` and ``_unloaded``.
            del self._engines[engine_id]

    def pending_requests(self) -> list[tuple[str, str]]:
        """``(match key, request id)`` of every finished prefill not reported yet."""
        return [(r.key, r.request_id) for r in self._requests.values() if r.blocks is not None]

    def busy(self) -> bool:
        return any(r.blocks is not None for r in self._requests.values())

    # ------------------------------------------------------------------ engine events

    def finished(
        self,
        key: str,
        request_id: str,
        blocks: BlockIds,
        decode_engine_id: str,
        now: float,
        *,
        fingerprint: str | None = None,
    ) -> list[Any]:
        """A prefill finished; its KV sits in ``blocks``. ``decode_engine_id`` (optional) is the
        D engine the router chose: only its registrations are served. ``fingerprint`` (optional)
        is the prompt's: a registration stating another is never written (see
        :meth:`_prompts_differ`)."""
        request = self._requests.get(key)
        past = self._tombstones.get(key) or (request.past if request is not None else None)
        if past is not None and (request_id in past.prefills or past.unfinished):
            # A prefill the ended attempt accounted for, or the first finish of an attempt that
            # ended before P finished (D cancelled, its registration expired): that attempt's.
            # A finish by another prefill is a new attempt (a retry under the same key).
            past.prefills.add(request_id)
            past.unfinished = False
            why = past.failure or "it was pushed before"
            return [
                Report(
                    request_id,
                    "failed",
                    f"match key {key!r} already ended on this rank ({why}); blocks released",
                    key,
                )
            ]
        if request is not None and request.blocks is not None:
            return [
                Report(
                    request_id,
                    "failed",
                    f"match key {key!r} is already pushing request "
                    f"{request.request_id!r}; a second finish is refused",
                    key,
                )
            ]
        if not any(blocks):
            return [Report(request_id, "sent", "no blocks to push", key)]
        if self._closing:
            return [Report(request_id, "failed", self._closing, key)]
        if request is None:
            request = self._requests[key] = _Request(key=key, past=self._retire(key))
        self._timers.disarm(("stash", key))
        request.request_id, request.blocks = request_id, blocks
        out: list[Any] = []
        if decode_engine_id and request.engine_id != decode_engine_id:
            if request.engine_id:
                logger.warning(
                    "ignoring registrations of %s from %s: the router chose %s",
                    key,
                    request.engine_id,
                    decode_engine_id,
                )
                # never written now: told at once (nothing was posted to them)
                request.others.setdefault(request.engine_id, {}).update(request.regs)
            request.regs = request.others.pop(decode_engine_id, {})
            request.engine_id = decode_engine_id
        if request.others:
            why = f"match key {key!r} is bound to D engine {request.engine_id!r}; P will not write it"
            for held in request.others.values():
                for entry in held.values():
                    self._gone(request, entry.reg)
            out += self._fail_held(request, why)
        request.bound, request.others = True, {}
        request.fingerprint = fingerprint
        self._timers.arm(("lease", key), now + self.s.lease_s)
        displaced, request.displaced = request.displaced, []
        displaced = [e for e in displaced if e.reg.decode_engine_id == request.engine_id]
        wrong = [e for e in (*request.regs.values(), *displaced) if _differs(fingerprint, e.reg)]
        if wrong:
            return out + self._prompts_differ(request, wrong, now, displaced=displaced)
        out += self._cancelled_unregistered(request, now)
        if request.failure:
            return out
        if request.regs:
            out += self._plan_request(request, now)
        return out

    def abort(self, key: str, now: float, *, request_id: str | None = None) -> list[Any]:
        """The engine aborts a finished prefill: nothing more is posted, D is told (FAIL now, or
        ``failed`` in its next heartbeat answer), and the request is reported failed once nothing
        of it is in flight. ``request_id``: the prefill aborted; another one under the key (a
        retry finished since that prefill was reported) is left alone."""
        request = self._requests.get(key)
        if request is None or request.blocks is None:
            return []
        if request_id is not None and request.request_id != request_id:
            return []
        return self._fail_request(request, "aborted by the prefill engine", now)

    def shutdown(self, reason: str, now: float) -> list[Any]:
        """The worker is closing: nothing more is posted and every request fails with
        ``reason``. A registration whose WRITE never went out is answered FAIL now (D may
        release at once: P will never write); one whose WRITE is in flight hears once that
        WRITE settled (its DONE, or FAIL saying it ended unsettled). Registrations and finishes
        that arrive later are refused the same way."""
        self._closing = reason
        out: list[Any] = []
        for request in list(self._requests.values()):
            dests = request.dests
            if dests and all(d.state in (_Dest.INFLIGHT, _Dest.DONE) for d in dests.values()):
                continue  # every destination is written or being written: it may still end sent
            out += self._fail_held(request, reason)
            out += self._fail_request(request, reason, now)
        return out

    @property
    def said_goodbye(self) -> bool:
        """:meth:`goodbye` ran with nothing in flight: this incarnation posts nothing more."""
        return self._said_goodbye

    @property
    def wrote_unsettled(self) -> bool:
        """A WRITE of this incarnation ended without completing (to any D rank)."""
        return bool(self._unsettled_to)

    def goodbye(self, now: float) -> list[Any]:
        """After :meth:`shutdown`, once no WRITE is in flight: tell every loaded D rank that this
        incarnation ended (``BYE``): it posts nothing more and every WRITE it posted ended, so D
        may settle what it still waits for from it (fencing first where a WRITE to that rank
        ended unsettled) instead of waiting for its silence or, for copies no fence stops, its
        process's exit. Nothing (and no promise) while a WRITE is still in flight."""
        if not self._closing or self.inflight_handles():
            return []
        self._said_goodbye = True
        out: list[Any] = []
        for engine in self._engines.values():
            for rank, agent in sorted(engine.agents.items()):
                unsettled = (engine.engine_id, rank) in self._unsettled_to
                sent_to, ids = engine.delivered.get(rank, ("", ()))
                delivered = list(ids) if sent_to == agent else []
                message = wire.encode_goodbye(self.s.rank, self.s.incarnation, unsettled, delivered=delivered)
                out.append(Send(agent, message))
        return out

    def _fail_held(self, request: _Request, reason: str) -> list[Any]:
        """FAIL the registrations held for D engines the router may still name (the request is
        not bound yet); nothing was posted for them."""
        out: list[Any] = []
        for engine_id, held in request.others.items():
            engine = self._engines.get(engine_id)
            for rank, entry in sorted(held.items()):
                if engine is not None and engine.agents.get(rank) == entry.agent:
                    message = wire.encode_failed(
                        entry.reg.request_id,
                        self.s.rank,
                        reason,
                        False,
                        self.s.incarnation,
                        attempt=entry.reg.attempt,
                    )
                    out.append(Send(entry.agent, message))
        request.others = {}
        return out

    def abandoned(self, key: str, reason: str, now: float, *, request_id: str = "") -> list[Any]:
        """The engine will never finish ``key`` here (its prefill ``request_id`` was aborted or
        failed before it finished): D's registrations of it are answered FAIL, those held now
        and those that arrive later (the key ends as a failure). A key this rank is pushing is
        left alone: its outcome reaches D as usual. So is an ended key when the prefill
        abandoned is an ended attempt's (or, the ended attempt never having finished, the first
        one abandoned), and so is a new attempt's held registration then; a prefill of another
        id under an ended key is a new attempt (a retry under the same X-Request-Id), failed."""
        request = self._requests.get(key)
        tomb = self._tombstones.get(key)
        if request is not None and request.blocks is not None:
            return []
        # As in finished(): the ended attempt's own prefill (or the first one abandoned after an
        # attempt that never finished here) is that attempt's; another prefill is a new attempt
        # under the key (a client's retry under its X-Request-Id), and D's retry is told.
        if tomb is not None and (not request_id or request_id in tomb.prefills or tomb.unfinished):
            if request_id:
                tomb.prefills.add(request_id)
                tomb.unfinished = False
            return []
        past = request.past if request is not None else None
        if past is not None and request_id and (request_id in past.prefills or past.unfinished):
            past.prefills.add(request_id)
            past.unfinished = False
            return []
        if request is None:
            past = self._retire(key)
            if past is not None:
                # A new attempt abandoned: D's registrations of the key are its own from now on,
                # answered FAIL as for a key never pushed here (a D rank that took part in the
                # ended attempt too, whatever its grant); the ended attempts' prefills stay theirs.
                past.seen, past.overflow = set(), False
            request = self._requests[key] = _Request(key=key, past=past)
        if request_id:
            request.request_id = request_id
        return self._fail_held(request, reason) + self._fail_request(request, reason, now)

    def fail(self, key: str, reason: str, now: float, *, request_id: str | None = None) -> list[Any]:
        """Fail whatever P holds for ``key`` (the driver caught an error while handling it).
        ``request_id``: the engine's prefill the error came with (a finish): it is reported
        failed even when the error struck before this core recorded it, and the key ends as a
        failure, so D's registrations for it are answered with FAIL, not left to time out."""
        request = self._requests.get(key)
        if request_id is not None and (request is None or request.blocks is None):
            if request is None:
                request = self._requests[key] = _Request(key=key, past=self._retire(key))
            request.request_id, request.blocks = request_id, ()
        if request is None:
            return []
        return self._fail_request(request, reason, now)

    def unreachable(self, agent: str, error: str, now: float) -> list[Any]:
        """Sending to ``agent`` raised: its endpoint is broken (D's rank died, or it fenced this
        rank's connections while this rank was stopped), and stays so. The requests holding
        that D rank's registration (or a WRITE to it) fail, and its agent is forgotten once no
        WRITE to it is in flight, so that its next HELLO or registration handshakes afresh
        instead of being answered through the broken endpoint for ever. The D engine's other
        ranks (other processes, other endpoints) go on."""
        engine = next((e for e in self._engines.values() if agent in e.agents.values()), None)
        if engine is None:
            return []
        self.stats["dead_engines"] += 1
        reason = f"D agent {agent} is unreachable: {error}"
        out: list[Any] = []
        for rank in sorted(r for r, a in engine.agents.items() if a == agent):
            if not engine.drop_when_idle and rank not in engine.replacing:
                out += self._rank_gone(engine, rank, reason, now, keep_unposted=True)
        return out

    # ------------------------------------------------------------------ notifications

    def notification(self, agent: str, note: Notification, now: float) -> list[Any]:
        kind = note.kind
        reg = note.registration
        if reg is not None:
            engine = self._engines.get(reg.decode_engine_id)
            if engine is not None and self._unserved_now(engine, reg, now):
                self.stats["unserved_starts_dropped"] += 1
                self._reject(agent, note, "a late message of a D start its side channel does not serve")
                return []
            if engine is not None and self._stale(engine, reg, hello=kind is NotificationKind.HELLO):
                self._reject(agent, note, "a late message of a D incarnation P already replaced")
                return []
        if kind is NotificationKind.PUSH_REG:
            return self._on_registration(agent, note, now)
        if kind is NotificationKind.HEARTBEAT and note.registration is not None:
            return self._on_heartbeat(agent, note, now)
        if kind is NotificationKind.CANCEL and note.registration is not None:
            return self._on_cancel(agent, note, now)
        if kind is NotificationKind.HELLO and note.registration is not None:
            return self._on_hello(agent, note, now)
        self._reject(agent, note, "not a notification a prefill rank accepts (or it lacks D's coordinates)")
        return []

    def _on_registration(self, agent: str, note: Notification, now: float) -> list[Any]:
        reg = note.registration
        assert reg is not None
        key, rank = reg.match_key, reg.decode_tp_rank
        if (key, _ident(reg)) in self._refused:
            self.stats["duplicate_registrations"] += 1
            return []  # D cancelled this key before its registration reached P
        tomb = self._tombstones.get(key)
        if tomb is not None and tomb.covers(reg, now):
            return self._answer_ended(tomb, reg, agent, now)
        if self._closing:
            return self._refuse(reg, agent, self._closing, False, now)
        request = self._requests.get(key)
        if request is not None and request.past is not None and request.past.covers(reg, now):
            return self._answer_ended(request.past, reg, agent, now)  # an ended attempt's
        if request is None:
            stashed = sum(
                1 for r in self._requests.values() if r.blocks is None and r.engine_id == reg.decode_engine_id
            )
            if stashed >= self.s.max_stash_per_engine:
                self._reject(
                    agent,
                    note,
                    f"more than {self.s.max_stash_per_engine} registrations held for "
                    f"{reg.decode_engine_id!r}",
                )
                return []
            # A registration proven newer than the key's end (if it ended): the next attempt's.
            request = self._requests[key] = _Request(key=key, past=self._retire(key))
            self._timers.arm(("stash", key), now + self.s.registration_ttl_s)
        ident = _ident(reg)
        if ident in request.gone:
            self.stats["duplicate_registrations"] += 1
            return []  # replaced, refused or cancelled, and answered once: never written
        if len(request.seen) <= MAX_SEEN:  # one more marks the overflow at the end
            request.seen.add(ident)
        candidate = bool(request.engine_id) and request.engine_id != reg.decode_engine_id
        if candidate and request.bound:
            self._reject(agent, note, f"match key {key!r} belongs to D engine {request.engine_id!r}")
            return []
        engine = self._engine_for(reg, now)
        if (reg.decode_host, reg.decode_port) != (engine.host, engine.port):
            self._reject(
                agent,
                note,
                f"PUSH_REG names {host_port(reg.decode_host, reg.decode_port)}, but D engine "
                f"{reg.decode_engine_id!r} was handshaken at {host_port(engine.host, engine.port)}",
            )
            return []
        if engine.agents.get(rank) not in (None, agent):
            self._reject(
                agent,
                note,
                f"D rank {rank} of {reg.decode_engine_id!r} speaks through {engine.agents[rank]!r}",
            )
            return []
        if self._restarted(engine, reg):
            return self._decode_restarted(engine, reg, agent, note, now)
        out: list[Any] = []
        if request.gone_overflow:
            return self._refuse(reg, agent, f"over {MAX_SEEN} registrations of {key!r} replaced", False, now)
        if candidate:  # not bound yet: hold it, the router may name this engine at finish
            held = request.others.setdefault(reg.decode_engine_id, {})
            current = held.get(rank)
            if _another(current, reg):
                keep, out = self._supersede(request, current, reg, agent, now)
                if not keep:
                    return out
            if self._renewed(current, reg, agent, now):
                return out
            held[rank] = _Reg(reg, agent, self._fresh_until(reg, now))
            if rank not in engine.agents:
                out += self._connect(engine, rank, now, reg.decode_incarnation)
            return out
        if request.blocks is not None and _differs(request.fingerprint, reg):
            return self._prompts_differ(request, [_Reg(reg, agent, self._fresh_until(reg, now))], now)
        old = request.regs.get(rank)
        if _another(old, reg) or (old is None and request.failure):
            # Another D registration of this rank under the key (a D request added again, a
            # retry, two D requests of one rank under one key): P writes one per key and rank.
            displace = old is not None and request.blocks is None
            displace = displace and _differs(old.reg.prompt_fingerprint, reg)  # type: ignore[union-attr]
            keep, out = self._supersede(request, old, reg, agent, now, tell=not displace)
            if not keep:
                return out
            if displace:
                # Two prompts registered under one key before P finished: P decides at the finish.
                if len(request.displaced) >= MAX_DISPLACED:
                    request.displaced.pop(0)
                request.displaced.append(old)  # type: ignore[arg-type]
        request.engine_id = reg.decode_engine_id
        if self._renewed(old, reg, agent, now):
            dest = request.dests.get(rank) if request.dests else None
            if dest is not None and dest.state is _Dest.WAIT_FRESH:
                out += self._advance(request, rank, now)
            return out
        if rank in request.regs:
            self.stats["duplicate_registrations"] += 1
            if request.dests is not None and request.dests.get(rank, _DestState()).state not in (
                _Dest.WAIT_REG,
                _Dest.WAIT_CONNECT,
                _Dest.WAIT_FRESH,
            ):
                return out
        request.regs[rank] = _Reg(reg, agent, self._fresh_until(reg, now))
        request.cut.pop(rank, None)
        if rank not in engine.agents:
            out += self._connect(engine, rank, now, reg.decode_incarnation)
        if request.blocks is None:
            return out
        if request.dests is None:
            return out + self._plan_request(request, now)
        if rank not in request.dests:  # as when it registers before the plan
            return out + self._reject_reg(request, rank, "this P rank does not write to that D rank")
        return out + self._advance(request, rank, now)

    def _supersede(
        self,
        request: _Request,
        current: _Reg | None,
        reg: PushRegistration,
        agent: str,
        now: float,
        *,
        tell: bool = True,
    ) -> tuple[bool, list[Any]]:
        """``reg`` is another D registration of a rank for which P holds ``current`` (None: P
        holds none, but the attempt is failing). P writes one registration per key and D rank;
        the one not written is told at once (FAIL, nothing unsettled: nothing was ever posted
        to it), never left to D's watchdog, and is never written afterwards (``gone``).
        ``reg`` is not taken while its rank is being written or the attempt fails, nor over a
        registration with a newer grant (D sent that one later: a late or reordered older one
        must not take the rank back). Returns whether ``reg`` replaces ``current``, and what to
        send. ``tell`` False: the replaced one is answered at the finish (another prompt's)."""
        dest = request.dests.get(reg.decode_tp_rank) if request.dests else None
        waiting = (_Dest.WAIT_REG, _Dest.WAIT_CONNECT, _Dest.WAIT_FRESH)
        writing = dest is not None and dest.state not in waiting
        older = current is not None and _grant(reg, now) < _grant(current.reg, now)
        if current is None or writing or older or request.failure:
            holder = f"D request {current.reg.request_id!r}" if current is not None else "no D request"
            how = "is being written to" if writing else "ended for" if request.failure else "is held for"
            why = (
                f"match key {reg.match_key!r} {how} {holder} of this D rank (P writes one D "
                f"registration per key and D rank); P will not write D request {reg.request_id!r}"
            )
            self.stats["duplicate_registrations"] += 1
            return False, self._gone(request, reg) + self._refuse(reg, agent, why, False, now)
        why = (
            f"D request {reg.request_id!r} of this D rank registered match key {reg.match_key!r} "
            f"after it (P writes one D registration per key and D rank); P will not write D request "
            f"{current.reg.request_id!r}"
        )
        out = self._gone(request, current.reg) if tell else []
        if tell:
            out += self._refuse(current.reg, current.agent, why, False, now)
        return True, out

    def _renewed(self, current: _Reg | None, reg: PushRegistration, agent: str, now: float) -> bool:
        """Is ``reg`` ``current``'s own PUSH_REG again (D sent it with a newer grant, or a
        duplicate)? Then ``current`` keeps its spec and takes the newer grant: the one message
        that renews a registration's grant names it (a heartbeat names keys only)."""
        if current is None or current.agent != agent or _ident(current.reg) != _ident(reg):
            return False
        fresh = self._fresh_until(reg, now)
        if fresh > current.fresh_until:
            current.fresh_until = fresh
            current.grant = _grant(reg, now)
            self.stats["registration_renewals"] += 1
        else:
            self.stats["duplicate_registrations"] += 1
        return True

    @staticmethod
    def _gone(request: _Request, reg: PushRegistration) -> list[Any]:
        """``reg`` will never be written in this attempt (see ``_Request.gone``)."""
        if len(request.gone) < MAX_SEEN:
            request.gone.add(_ident(reg))
        else:
            request.gone_overflow = True
        return []

    def _answer_ended(self, tomb: _Tomb, reg: PushRegistration, agent: str, now: float) -> list[Any]:
        """A registration of an ended attempt of its key: answered as the attempt ended (FAIL
        for a failed one, now or once P loaded that D rank; dropped for one pushed, unless it
        states another prompt), never written."""
        key, rank = reg.match_key, reg.decode_tp_rank
        loaded = self._engines.get(reg.decode_engine_id)
        renewable = tomb.renewable(reg, now) and not _differs(tomb.fingerprint, reg)
        if renewable and loaded and loaded.agents.get(rank) == agent:
            self.stats["grants_asked_after_end"] += 1
            tomb.asked[_ident(reg)] = now
            ask = wire.encode_heartbeat_answer(
                self.s.rank, now, self.s.incarnation, [key], want_attempts=[reg.attempt]
            )
            return [Send(agent, ask)]
        if len(tomb.seen) < MAX_SEEN:  # that D rank now took part: its next request may retry
            tomb.seen.add(_ident(reg))
        else:
            tomb.overflow = True
        if _differs(tomb.fingerprint, reg) and loaded and loaded.agents.get(rank) == agent:
            self.stats["prompt_mismatches"] += 1
            ended = "pushed" if tomb.outcome == "sent" else "failed"
            why = self._differ_reason(key, tomb.fingerprint, reg, f"P's prefill of the key (already {ended})")
            return self._refuse(reg, agent, why, tomb.unsettled, now)
        if tomb.outcome == "failed":  # answered FAIL: now, or once P loaded that D rank
            engine = self._engine_for(reg, now)
            same_address = (reg.decode_host, reg.decode_port) == (engine.host, engine.port)
            if same_address and engine.agents.get(rank) in (None, agent):
                why = f"P no longer holds {key!r}: {tomb.failure or tomb.outcome}"
                return self._refuse(reg, agent, why, tomb.unsettled, now)
        self.stats["duplicate_registrations"] += 1
        return []

    def _retire(self, key: str) -> _Tomb | None:
        """A new attempt of ``key`` begins: its tombstone (if any) becomes the attempt's past."""
        tomb = self._tombstones.pop(key, None)
        if tomb is not None:
            self._timers.disarm(("tomb", key))
        return tomb

    def _plannable(self, request: _Request) -> _Reg | None:
        """A registration to plan from: one whose D rank is loaded, so D's TP size is known."""
        engine = self._engines.get(request.engine_id)
        if engine is None:
            return None
        return next((e for r, e in sorted(request.regs.items()) if self._loaded_from(engine, r, e)), None)

    @staticmethod
    def _loaded_from(engine: _Decode, rank: int, entry: _Reg) -> bool:
        """Did ``entry`` come from the agent, and the start, P loaded for D rank ``rank``?"""
        return (
            rank in engine.agents
            and engine.agents[rank] == entry.agent
            and engine.incarnations.get(rank) == entry.reg.decode_incarnation
        )

    def _dropped_reg(self, key: str, entry: _Reg, engine: _Decode, rank: int) -> None:
        self.stats["rejected_notifications"] += 1
        logger.warning(
            "dropped PUSH_REG of %s: it came from %s (incarnation %s), D rank %s is %s (%s)",
            key,
            entry.agent,
            entry.reg.decode_incarnation,
            rank,
            engine.agents.get(rank),
            engine.incarnations.get(rank),
        )

    def _on_heartbeat(self, agent: str, note: Notification, now: float) -> list[Any]:
        reg = note.registration
        assert reg is not None
        engine = self._engines.get(reg.decode_engine_id)
        rank = reg.decode_tp_rank
        if engine is None or engine.agents.get(rank) != agent:
            self._reject(agent, note, "heartbeat from a D agent this rank has not loaded; not answered")
            return []
        if self._restarted(engine, reg):
            return self._decode_restarted(engine, reg, agent, note, now)
        failed: list[str] = []
        want: list[str] = []
        unknown: list[str] = []
        settled: list[str] = []
        failed_attempts: list[int | None] = []
        want_attempts: list[int | None] = []
        unknown_attempts: list[int | None] = []
        # Since 2.8 D names the attempt of each key it asks about: P's answer names it back, and
        # D acts on an entry only for that attempt (not on a later request of the key).
        asked = note.request_attempts or (None,) * len(note.request_ids)
        for key, attempt in zip(note.request_ids, asked, strict=True):
            request = self._requests.get(key)
            if request is None:
                # Only what P positively knows ended badly for this D: an unknown key may be a
                # PUSH_REG still on its way (a restarted P shows by its new incarnation).
                tomb = self._tombstones.get(key)
                if tomb is None:
                    unknown.append(key)
                    unknown_attempts.append(attempt)
                elif tomb.outcome == "failed" or tomb.engine_id != engine.engine_id:
                    failed.append(key)
                    failed_attempts.append(attempt)
                    if not tomb.unsettled:  # no WRITE of any attempt of it ended unsettled
                        settled.append(key)
                    _tell_failed(tomb.told, tomb.told_attempts, reg, attempt, now)
                    if len(tomb.told_attempts) > MAX_SEEN:
                        tomb.overflow, tomb.told_attempts = True, set()
                continue
            if request.engine_id != engine.engine_id:
                held = request.others.get(engine.engine_id, {}).get(rank)
                if held is not None:  # a candidate for an unbound key: keep its registration
                    if not self._loaded_from(engine, rank, held):
                        continue
                    self._timers.arm(("stash", key), now + self.s.registration_ttl_s)
                elif request.engine_id:  # bound to another D engine: this one was refused
                    failed.append(key)
                    failed_attempts.append(attempt)
                    _tell_failed(request.told, request.told_attempts, reg, attempt, now)
                continue
            self.stats["heartbeat_renewals"] += 1
            if request.blocks is not None:
                self._timers.arm(("lease", key), now + self.s.lease_s)
            else:
                self._timers.arm(("stash", key), now + self.s.registration_ttl_s)
            # A heartbeat names keys, not registrations: it keeps the key's lease and renews no
            # grant (another D request of this rank under the key may be the one P holds). A
            # registration waiting for a fresh grant is asked for: D sends its PUSH_REG again;
            # so is one P dropped when the rank's endpoint broke (D may not know it was lost).
            entry = request.regs.get(rank)
            dest = request.dests.get(rank) if request.dests else None
            stale = dest is not None and dest.state is _Dest.WAIT_FRESH
            stale = stale and entry is not None and self._loaded_from(engine, rank, entry)
            cut = entry is None and rank in request.cut  # dropped when its endpoint broke
            if stale or cut:
                want.append(key)  # the registration P holds; one it dropped: the one D named
                want_attempts.append(entry.reg.attempt if stale and entry is not None else attempt)
        answer = wire.encode_heartbeat_answer(
            self.s.rank,
            now,
            self.s.incarnation,
            want,
            failed,
            unknown,
            settled,
            want_attempts=want_attempts,
            failed_attempts=failed_attempts,
            unknown_attempts=unknown_attempts,
        )
        return [Send(agent, answer)]

    def _on_hello(self, agent: str, note: Notification, now: float) -> list[Any]:
        reg = note.registration
        assert reg is not None
        engine = self._engine_for(reg, now)
        rank = reg.decode_tp_rank
        if self._restarted(engine, reg, hello=True) and engine.agents.get(rank) in (None, agent):
            return self._decode_restarted(engine, reg, agent, note, now)
        if engine.agents.get(rank) == agent:
            return [Send(agent, wire.encode_heartbeat_answer(self.s.rank, now, self.s.incarnation))]
        if rank in engine.agents:
            self._reject(agent, note, f"D rank {rank} speaks through {engine.agents[rank]!r}")
            return []
        # The newest HELLO of that start: within one incarnation D's ids only grow, so a
        # delayed copy of an earlier HELLO does not replace the id a refusal echoes.
        same_start = engine.hello_incarnations.get(rank) == reg.decode_incarnation
        newest = engine.hello_ids.get(rank) if same_start else None
        engine.hellos[rank] = agent
        engine.hello_incarnations[rank] = reg.decode_incarnation
        if note.hello_id is None:
            engine.hello_ids.pop(rank, None)
        elif newest is None or note.hello_id > newest:
            engine.hello_ids[rank] = note.hello_id
        return self._connect(engine, rank, now, reg.decode_incarnation, hello=True)

    def _on_cancel(self, agent: str, note: Notification, now: float) -> list[Any]:
        reg = note.registration
        assert reg is not None
        key, rank = note.request_id, reg.decode_tp_rank
        self.stats["cancels"] += 1
        engine = self._engines.get(reg.decode_engine_id)
        if engine is not None and rank in engine.agents and engine.agents[rank] != agent:
            self._reject(agent, note, "CANCEL from an agent this rank has not loaded for that D rank")
            return []
        if engine is None or rank not in engine.agents:
            return self._cancel_of_unloaded_rank(agent, note, reg, key, now)
        request = self._requests.get(key)
        tomb = self._tombstones.get(key)
        # A WRITE of an ended attempt of the key that ended unsettled (its FAIL saying so may be
        # lost): the ack says so, as for a D rank P has not loaded, so D fences before release.
        ended = tomb or (request.past if request is not None else None)
        ack = wire.encode_cancel_ack(
            reg.request_id,
            self.s.rank,
            False,
            unsettled=bool(ended is not None and ended.unsettled),
            incarnation=self.s.incarnation,
            attempt=reg.attempt,
        )
        past = request.past if request is not None else None
        unheld = not self._held_once(request, tomb, reg)  # before this CANCEL is remembered
        if past is not None and _saw_request(past.seen, reg) and not _saw_request(request.seen, reg):
            # The CANCEL of an ended attempt's registration (resent, duplicated, late; or that
            # D request's CANCEL from another of its ranks) reaching a retry under the same
            # key: acknowledged, the retry left alone (its rank took part in the ended attempt).
            if len(past.seen) < MAX_SEEN:
                past.seen.add(_ident(reg))
            return [Send(agent, ack)]
        if tomb is not None and len(tomb.seen) < MAX_SEEN:
            tomb.seen.add(_ident(reg))  # a late PUSH_REG of it meets the tombstone
        elif tomb is not None:
            tomb.overflow = True
        if request is not None and len(request.seen) <= MAX_SEEN:
            request.seen.add(_ident(reg))
        ident = _ident(reg)
        current = request.regs.get(rank) if request is not None else None
        if request is not None and self._holds_another_attempt(request, reg):
            # The rank holds a later attempt of the same D request id (the engine gave the id
            # again once D forgot it), for the key's engine or held for one the router may
            # name: this CANCEL is of the earlier attempt, which P never held. Acknowledged;
            # the held registration is left alone, and so are its later PUSH_REGs (its renewals).
            return [Send(agent, ack)]
        mine = request is not None and request.engine_id == engine.engine_id
        others_held = False
        if request is not None and mine and current is None:
            others_held = any(e.reg.request_id != reg.request_id for e in request.regs.values())
        if request is None or not mine or _another(current, reg) or others_held:
            # Nothing of this key is being written to this registration: it is held for an
            # engine the router may still name, its rank now holds another registration
            # (replaced, or the CANCEL overtook its PUSH_REG), or P never held it and other
            # ranks hold another D request's (a new request under the key). Refuse it from now
            # on (a PUSH_REG may still be on its way), then acknowledge: the cancel ends this
            # registration, never another's (another D request, other ranks, another engine).
            # One P never held is remembered: a finished prefill nothing else is held for
            # ends now or at its finish (D's request ended before it registered).
            out: list[Any] = []
            if request is not None:
                self._gone(request, reg)
                out = self._cancel_held(request, engine, reg, now)
            self._refused[(key, ident)] = now
            self._timers.arm(("refused", (key, ident)), now + self.s.registration_ttl_s)
            if unheld:
                self._remember_unregistered(key, reg, now)
                if request is not None:
                    out += self._cancelled_unregistered(request, now)
            return [Send(agent, ack), *out]
        if not request.bound and request.others:
            # Not bound, and other engines hold registrations the router may name: the first
            # registrant's cancel ends its own offer, not the key (another engine's push).
            out = self._cancel_tentative(request, engine, reg, now)
            self._refused[(key, ident)] = now
            self._timers.arm(("refused", (key, ident)), now + self.s.registration_ttl_s)
            if unheld:  # its other ranks' registrations of it may stay: the finish decides
                self._remember_unregistered(key, reg, now)
            return [Send(agent, ack), *out]
        request.cancelled = True
        request.cancel_acks[agent] = (reg.request_id, reg.attempt)
        if any(d.state is _Dest.INFLIGHT for d in (request.dests or {}).values()):
            self.stats["cancels_during_write"] += 1
            request.write_at_cancel = True
            why = f"cancelled by D rank {rank} while a WRITE was in flight (settled before the ack)"
        elif request.blocks is None:
            why = f"cancelled by D rank {rank} before the prefill finished"
        else:
            why = f"cancelled by D rank {rank} before the WRITE was posted"
        return self._fail_request(request, why, now)

    def _cancel_held(
        self, request: _Request, engine: _Decode, reg: PushRegistration, now: float
    ) -> list[Any]:
        """D cancelled ``reg``, a registration held for its engine while the key is not bound
        (the router may name that engine at the finish). Only that registration goes; the
        engine's other ranks' held registrations of the same D request are told (FAIL, nothing
        posted), as the cancel of a bound key tells every rank; their registrations of other D
        requests stay (see :meth:`_same_request_on_another_rank`)."""
        held = request.others.get(engine.engine_id)
        if not held or held.get(reg.decode_tp_rank) is None:
            return []
        named = held[reg.decode_tp_rank].reg
        if _ident(named) != _ident(reg) or _other_attempt(named, reg):
            return []  # that rank holds another registration (or attempt) now: left alone
        del held[reg.decode_tp_rank]
        self._remember_held_cancel(request, engine, reg, now)
        out: list[Any] = []
        why = f"cancelled by D rank {reg.decode_tp_rank} before P finished; P will not write it"
        for rank, entry in sorted(held.items()):
            if self._same_request_on_another_rank(engine, reg, rank, entry):
                del held[rank]
                self._gone(request, entry.reg)
                out += self._refuse(entry.reg, entry.agent, why, False, now)
        if not held:
            del request.others[engine.engine_id]
        return out

    def _cancel_tentative(
        self, request: _Request, engine: _Decode, reg: PushRegistration, now: float
    ) -> list[Any]:
        """D cancelled ``reg``, a registration of the engine a not-yet-bound key tentatively
        belongs to (its first registrant), while other engines hold registrations of the key:
        that engine's registrations of the same D request go (its other ranks told FAIL,
        nothing posted: :meth:`_same_request_on_another_rank`); when none of its registrations
        is left, the next engine holding some takes its place (the router's finish may still
        name any of them)."""
        why = f"cancelled by D rank {reg.decode_tp_rank} before P finished; P will not write it"
        out: list[Any] = self._gone(request, reg)
        current = request.regs.get(reg.decode_tp_rank)
        if current is not None and _ident(current.reg) == _ident(reg):
            self._remember_held_cancel(request, engine, reg, now)
        for rank, entry in sorted(request.regs.items()):
            if rank == reg.decode_tp_rank or self._same_request_on_another_rank(engine, reg, rank, entry):
                del request.regs[rank]
                self._gone(request, entry.reg)
                if rank != reg.decode_tp_rank:
                    out += self._refuse(entry.reg, entry.agent, why, False, now)
        if not request.regs:
            request.engine_id = next(iter(request.others))
            request.regs = request.others.pop(request.engine_id)
        return out

    def _remember_held_cancel(
        self, request: _Request, engine: _Decode, reg: PushRegistration, now: float
    ) -> None:
        """D cancelled ``reg``, held for its engine while the key was not bound: remembered as a
        cancel of a registration P does not hold (``_unregistered``), so that a finish the router
        binds to that engine ends at once when P holds nothing else of it
        (:meth:`_cancelled_unregistered`; it waited for the lease). Only a CANCEL from the
        start P loaded for its rank (a fact of that rank's handshake) counts."""
        if self._loaded_start(engine, reg):
            self._remember_unregistered(request.key, reg, now, held=True)

    @staticmethod
    def _loaded_start(engine: _Decode, reg: PushRegistration) -> bool:
        """Did ``reg`` come from the start (incarnation) P loaded for its D rank?"""
        rank = reg.decode_tp_rank
        return rank in engine.agents and engine.incarnations.get(rank) == reg.decode_incarnation

    @classmethod
    def _same_request_on_another_rank(
        cls, engine: _Decode, cancelled: PushRegistration, rank: int, entry: _Reg
    ) -> bool:
        """Is ``entry``, held for D rank ``rank``, a registration of the D request ``cancelled``
        names, on another rank of its engine? Every D rank is a process of its own with its own
        incarnation, so each registration is judged against the start P loaded for *its own*
        rank (the incarnation that rank's handshake named), never against another rank's:
        ``cancelled`` only when it came from the start P loaded for its rank (a CANCEL of a
        start P has not loaded may name another D request of the id); ``entry`` when it came
        from the start P loaded for ``rank``, or, that rank not loaded yet, whichever start it
        states: its FAIL is then owed to that start alone (:meth:`_refuse`), sent only once P
        loads that very start."""
        return (
            rank != cancelled.decode_tp_rank
            and entry.reg.request_id == cancelled.request_id
            and cls._loaded_start(engine, cancelled)
            and (rank not in engine.agents or cls._loaded_from(engine, rank, entry))
        )

    def _cancel_of_unloaded_rank(
        self, agent: str, note: Notification, reg: PushRegistration, key: str, now: float
    ) -> list[Any]:
        """A CANCEL from a D rank this rank has not loaded: nothing is posted to it now (a
        WRITE needs the rank loaded). Its registration of the key is refused from now on, and
        the ack (unsettled when a WRITE of the key ever ended unsettled here) goes out once P
        has loaded the rank (P connects, as for a registration): D holds a request whose
        copies no fence stops until every producer acknowledged, so a dropped cancel held its
        blocks for ever."""
        request, tomb = self._requests.get(key), self._tombstones.get(key)
        # A later attempt of the same D request id held for the rank: this CANCEL is of an
        # earlier one, which P never held. Only its ack is owed; the held registration and its
        # later PUSH_REGs (its renewals: P asks for one once it loads the rank) are left alone.
        earlier = request is not None and self._holds_another_attempt(request, reg)
        if not earlier:
            self._refused[(key, _ident(reg))] = now
            self._timers.arm(("refused", (key, _ident(reg))), now + self.s.registration_ttl_s)
        past = request.past if request is not None else None
        unsettled = bool(tomb is not None and tomb.unsettled) or bool(past is not None and past.unsettled)
        unsettled = unsettled or any(
            d.unsettled for d in ((request.dests or {}).values() if request is not None else ())
        )
        ack = wire.encode_cancel_ack(
            reg.request_id,
            self.s.rank,
            False,
            unsettled=unsettled,
            incarnation=self.s.incarnation,
            attempt=reg.attempt,
        )
        engine = self._engine_for(reg, now)
        if (reg.decode_host, reg.decode_port) != (engine.host, engine.port):
            self._reject(agent, note, f"CANCEL names D engine {engine.engine_id!r} at another address")
            return []
        rank = reg.decode_tp_rank
        out: list[Any] = []
        held = False
        unheld = not earlier and not self._held_once(request, tomb, reg)  # before it is remembered
        took_part = [tomb.seen] if tomb is not None else []  # as a loaded rank's CANCEL
        if earlier:
            request, took_part = None, []
        elif (
            request is not None
            and past is not None
            and _saw_request(past.seen, reg)
            and not _saw_request(request.seen, reg)
        ):
            # That of an ended attempt's D request (another rank's, late) reaching a retry
            # under the key: the retry is left alone (the ack still waits for the rank).
            request, took_part = None, [past.seen]
        elif request is not None:
            took_part.append(request.seen)
        for seen in took_part:
            if len(seen) < MAX_SEEN:
                seen.add(_ident(reg))
        if request is not None:
            # Its PUSH_REG may have arrived first (P connecting to the rank since): it must
            # never be written once acknowledged. Ended as a cancel of a loaded rank ends it.
            self._gone(request, reg)
            out += self._cancel_held(request, engine, reg, now)
            current = request.regs.get(rank)
            if (
                current is not None
                and _ident(current.reg) == _ident(reg)
                and not _other_attempt(current.reg, reg)
            ):
                held = True
                if not request.bound and request.others:
                    out += self._cancel_tentative(request, engine, reg, now)
                else:
                    del request.regs[rank]
                    request.cancelled = True
                    why = f"cancelled by D rank {rank} before P loaded it"
                    out += self._fail_request(request, why, now)
        if not held and unheld:  # as for a loaded rank's
            self._remember_unregistered(key, reg, now)
            if request is not None:
                out += self._cancelled_unregistered(request, now)
        if sum(map(len, engine.owed.values())) >= MAX_OWED:
            logger.warning("dropped a CANCEL ack for %s of an unloaded D rank: %d held", key, MAX_OWED)
            return out
        engine.owed.setdefault(rank, []).append((agent, reg.decode_incarnation, ack))
        return out if self._closing else out + self._connect(engine, rank, now, reg.decode_incarnation)

    @staticmethod
    def _holds_another_attempt(request: _Request, reg: PushRegistration) -> bool:
        """Does ``request`` hold, for ``reg``'s D rank, a registration of the same D start and
        request id but another attempt (the key's engine's, or one held for an engine the
        router may name)? Then ``reg`` (a CANCEL) is of another D request given that id (the
        engine gives an id again once D forgot it), never of the registration held."""
        rank = reg.decode_tp_rank
        for entry in (request.regs.get(rank), request.others.get(reg.decode_engine_id, {}).get(rank)):
            if entry is not None and _ident(entry.reg) == _ident(reg) and _other_attempt(entry.reg, reg):
                return True
        return False

    @staticmethod
    def _held_once(request: _Request | None, tomb: _Tomb | None, reg: PushRegistration) -> bool:
        """Did an attempt of ``reg``'s key (this one, or an ended one) see ``reg``, or can P
        not tell (more registrations than it remembers)?"""
        ident = _ident(reg)
        past = request.past if request is not None else None
        return any(
            ended is not None and (ended.overflow or _saw_request(ended.seen, reg)) for ended in (tomb, past)
        ) or (request is not None and (request.gone_overflow or ident in request.seen))

    def _remember_unregistered(
        self, key: str, reg: PushRegistration, now: float, *, held: bool = False
    ) -> None:
        """D cancelled ``reg``, a registration of ``key`` P does not hold (``held``: held until
        this cancel, for a key not bound yet; see ``_unregistered``)."""
        cancels = self._unregistered.setdefault(key, {})
        if len(cancels) < MAX_SEEN:
            cancels[_ident(reg)] = cancels.get(_ident(reg), False) or held
        self._timers.arm(("unregistered", key), now + self.s.registration_ttl_s)

    def _cancelled_unregistered(self, request: _Request, now: float) -> list[Any]:
        """End a finished prefill D gave up before registering for it: its key's D engine (the
        one bound, or the first registrant, else the first that cancelled) cancelled a D
        request P never held, and P holds no registration of another D request of that engine
        (a new request under the key: its push goes on). Registrations of the cancelled D
        request (other ranks that registered first) are told FAIL. Without this, P held the
        blocks until its lease (``lease_s``): D's request ended before it sent any PUSH_REG
        (its handshake ran). The same for a D request whose registrations P held for its
        engine while the key was not bound, cancelled since (:meth:`_remember_held_cancel`)."""
        cancels = self._unregistered.get(request.key)
        if not cancels or request.blocks is None or request.failure or not request.bound:
            return []
        engine_id = request.engine_id or next(iter(cancels))[0]
        mine = [c for c in cancels if c[0] == engine_id]
        cancelled = {c[3] for c in mine}
        if not mine or any(e.reg.request_id not in cancelled for e in request.regs.values()):
            return []
        del self._unregistered[request.key]
        self._timers.disarm(("unregistered", request.key))
        request.engine_id, request.cancelled = engine_id, True
        _, _, rank, rid = mine[0]
        when = "before P finished" if cancels[mine[0]] else "before it registered"
        why = f"cancelled by D rank {rank} {when} (D request {rid!r})"
        return self._fail_request(request, why, now)

    # ------------------------------------------------------------------ handshakes

    def _engine_for(self, reg: PushRegistration, now: float) -> _Decode:
        engine = self._engines.get(reg.decode_engine_id)
        if engine is None:
            engine = _Decode(reg.decode_engine_id, reg.decode_host, reg.decode_port)
            self._engines[engine.engine_id] = engine
        engine.touched = max(engine.touched, now)
        if engine.unused() and self._timers.when(("unloaded", engine.engine_id)) is None:
            self._timers.arm(("unloaded", engine.engine_id), now + self.s.registration_ttl_s)
        return engine

    def _unloaded(self, engine_id: str, now: float) -> None:
        """An engine P never loaded (its handshake deferred behind another engine id at its
        address, or refused by the address's backoff), named by no message for
        ``registration_ttl_s``, is forgotten: nothing else forgets it (the driver evicts only
        loaded engines), so every such engine id (a D restarted with a fresh id, or anyone
        sending without the shared secret) was remembered for P's life, pinned to the address
        it was first named at."""
        engine = self._engines.get(engine_id)
        if engine is None:
            return
        if not engine.unused():
            return  # loaded (the driver evicts it when idle) or busy; a later message re-arms
        due = engine.touched + self.s.registration_ttl_s
        if now < due:
            self._timers.arm(("unloaded", engine_id), due)
            return
        # What it owed is moot (D's registrations timed out). ``_unsettled_to`` stays: a WRITE
        # to one of its ranks that ended unsettled is still so (the BYE to that D process once
        # loaded again, and ``wrote_unsettled`` for ended_workers), as after ``_maybe_drop_rank``.
        del self._engines[engine_id]

    def _connect(
        self, engine: _Decode, rank: int, now: float, incarnation: str = "", *, hello: bool = False
    ) -> list[Any]:
        """Handshake with one D rank (``incarnation``: the one the message asking for it
        states). Another incarnation of a rank whose metadata P refused skips the address
        backoff (at most once per ``retry_backoff_s``): a D fixed and restarted handshakes
        again at once (also one restarted on a clock behind: told apart by identity). So does
        a ``HELLO`` of a rank P has not refused (at most once per ``retry_backoff_s`` and
        address): D asks to be loaded and waits for the answer only its HELLO timeout (5 s by
        default), which the backoff (up to a quarter of P's lease, 7.5 s by default) outlasts."""
        if rank in engine.connecting or rank in engine.agents:
            return []
        address = (engine.host, engine.port)
        backoff = self._address_backoff.get(address)
        refusal = self._refusals.get((address, rank))
        restarted = (
            refusal is not None
            and bool(incarnation)
            and incarnation != refusal.incarnation
            and now >= refusal.retried_at + self.s.retry_backoff_s
        )
        if restarted:
            assert refusal is not None
            refusal.retried_at = now
        elif backoff is not None and now < backoff.until:  # a negative cache per address
            if hello and refusal is None and now >= backoff.hello_at + self.s.retry_backoff_s:
                backoff.hello_at = now  # D asks to be loaded
            else:
                why = f"{backoff.error} (not retried before {backoff.until - now:.1f}s)"
                return self._connect_failed(engine, rank, why, now)
        busy = self._connecting.get(address)
        if busy is not None and busy != engine.engine_id:
            # One engine id per address at a time: messages naming many ids at one (silent)
            # address cannot fill the handshake pool. This one retries at its next message.
            self.stats["connects_deferred"] += 1
            return []
        self._connecting[address] = engine.engine_id
        engine.connecting.add(rank)
        if incarnation:
            engine.asked_for[rank] = incarnation
        return [Connect(engine.engine_id, engine.host, engine.port, (RankKey(0, rank),))]

    def connected(
        self,
        engine_id: str,
        rank: int,
        agent: str,
        incarnation: str,
        tp_size: int,
        error: str,
        now: float,
    ) -> list[Any]:
        """P's full handshake with one D rank ended: ``agent`` (loaded for WRITEs), or
        ``error``. With both, P refused that rank's metadata and loaded ``agent`` (of
        ``incarnation``) notify-only, so that its HELLO and registrations are answered FAIL
        with the reason (never written: the rank is not loaded for WRITEs)."""
        engine = self._engines.get(engine_id)
        if engine is None or rank not in engine.connecting:
            return []  # no longer wanted (dropped meanwhile); the registry keeps or evicts it
        engine.connecting.discard(rank)
        address = (engine.host, engine.port)
        if not engine.connecting and self._connecting.get(address) == engine_id:
            del self._connecting[address]
        asked = engine.asked_for.pop(rank, "")
        if not error and asked and asked > incarnation:
            # The start whose message asked for this handshake sorts after the one D's side
            # channel serves: a dead one's late message (a D restarted on a clock behind), or a
            # start its side channel does not serve yet. Its further messages are dropped for a
            # backoff, then D's side channel is asked again before they count as a restart.
            self._not_served(engine_id, rank, asked, now)
        if not error and incarnation:
            # What the side channel serves now: an earlier answer about this rank (AskStart)
            # is superseded. Kept, a late message of the start it named (dead since, unloaded:
            # never in ``_replaced``) was taken for a restart unasked, failing the live start.
            self._served.pop((engine_id, rank), None)
            asking = self._asking.get((engine_id, rank))
            if asking is not None:
                asking.overtaken = True  # its answer may predate this handshake: asked again
        if error:
            earlier_backoff = self._address_backoff.get(address)
            failures = earlier_backoff.failures if earlier_backoff is not None else 0
            hello_at = earlier_backoff.hello_at if earlier_backoff is not None else float("-inf")
            # At most a quarter of the lease: a D rank reachable again (its HELLO resent, its
            # registrations waiting) is loaded before the finished prefills' leases run out,
            # however many handshakes failed during an outage (heal oracle).
            cap = min(self.s.retry_backoff_max_s, max(self.s.retry_backoff_s, self.s.lease_s / 4))
            backoff = min(cap, self.s.retry_backoff_s * 2**failures)
            self._address_backoff[address] = _Backoff(now + backoff, failures + 1, error, hello_at)
            self._timers.arm(("backoff", address), now + backoff + self.s.retry_backoff_max_s)
            if agent:  # refused, but its agent was loaded notify-only: tell it why
                self.stats["handshake_refusals"] += 1
                earlier = self._refusals.get((address, rank))
                retried = earlier.retried_at if earlier is not None else float("-inf")
                why = self._refused_why(error)
                self._refusals[(address, rank)] = _Refusal(engine_id, agent, incarnation, why, retried)
                self._timers.arm(("refusal", (address, rank)), now + backoff + self.s.retry_backoff_max_s)
            else:
                self._refusals.pop((address, rank), None)
            out = self._connect_failed(engine, rank, error, now)
            if not engine.agents and not engine.connecting and not engine.inflight:
                # Forget where this engine id was said to live: a message from the real engine
                # (another address) starts afresh instead of being refused as "address differs".
                self._engines.pop(engine_id, None)
            return out
        self._address_backoff.pop(address, None)
        self._refusals.pop((address, rank), None)
        engine.incarnations[rank], engine.tp_size = incarnation, tp_size
        engine.agents[rank] = agent
        engine.loaded_at[rank] = now
        # Only to the start they answer: a FAIL or ack names a D request id, which a restarted
        # D (same agent name, new incarnation) may use again for a request P is about to write.
        owed = engine.owed.pop(rank, ())
        out: list[Any] = [Send(a, m) for a, inc, m in owed if a == agent and inc == incarnation]
        out += self._cut_by_another_start(engine, rank, incarnation, now)
        hello = engine.hellos.pop(rank, None)
        said = engine.hello_incarnations.pop(rank, None)
        engine.hello_ids.pop(rank, None)
        if said is not None and said < incarnation:
            # The HELLO came from a start that sorts before the one D's side channel serves:
            # one that died (its HELLO late), not the live one. Its further messages are stale,
            # so a late one is never taken for a restart (:meth:`_restarted`). A later-sorting
            # one is handshaken again at its next message, as ever (D's side channel may not
            # serve the start that spoke yet).
            self._remember_replaced(engine_id, rank, said)
        if hello is not None:
            if hello == agent:
                out.append(Send(agent, wire.encode_heartbeat_answer(self.s.rank, now, self.s.incarnation)))
            else:
                logger.warning("HELLO for D rank %s came from %s, but its agent is %s", rank, hello, agent)
        for request in list(self._requests.values()):
            held = request.others.get(engine_id, {})
            if rank in held and not self._loaded_from(engine, rank, held[rank]):
                self._dropped_reg(request.key, held.pop(rank), engine, rank)  # as for regs below
            entry = request.regs.get(rank)
            if request.engine_id != engine_id or entry is None:
                continue
            if not self._loaded_from(engine, rank, entry):
                del request.regs[rank]
                self._dropped_reg(request.key, entry, engine, rank)
                continue
            if entry.reg.decode_tp_size != tp_size:
                out += self._fail_request(
                    request, f"PUSH_REG states D TP {entry.reg.decode_tp_size}, D published {tp_size}", now
                )
                continue
            if request.blocks is not None and request.dests is None:
                out += self._plan_request(request, now)
            elif request.dests is not None and rank in request.dests:
                out += self._advance(request, rank, now)
        return out

    def _connect_failed(self, engine: _Decode, rank: int, error: str, now: float) -> list[Any]:
        """The handshake with D rank ``rank`` failed (or is in backoff). Where P refused that
        rank's metadata and holds its agent notify-only, the HELLO and every registration from
        that agent (and incarnation) are answered FAIL with the reason; nothing was posted to
        them (the rank was never loaded for WRITEs), so none of them is unsettled. Otherwise D
        cannot be told: its HELLO bound, or its registration timeout, ends its requests."""
        refusal = self._refusals.get(((engine.host, engine.port), rank))
        told = refusal.agent if refusal is not None and refusal.engine_id == engine.engine_id else ""
        out: list[Any] = []
        why = refusal.reason if told and refusal is not None else ""

        def tell(entry: _Reg, dest: _DestState | None = None) -> None:
            # Nothing is posted to a rank P has not loaded for WRITEs; a destination an earlier
            # load of it wrote (and that ended unsettled) still says so.
            unsettled = dest is not None and (dest.unsettled or dest.state is _Dest.INFLIGHT)
            if told and entry.agent == told and entry.reg.decode_incarnation == refusal.incarnation:  # type: ignore[union-attr]
                message = wire.encode_failed(
                    entry.reg.request_id,
                    self.s.rank,
                    why,
                    unsettled,
                    self.s.incarnation,
                    attempt=entry.reg.attempt,
                )
                out.append(Send(told, message))

        hello, hello_incarnation = engine.hellos.pop(rank, None), engine.hello_incarnations.pop(rank, None)
        hello_id = engine.hello_ids.pop(rank, None)
        if told and hello == told and hello_incarnation == refusal.incarnation:  # type: ignore[union-attr]
            # Echo the HELLO answered: D takes a refusal only for the HELLO it waits on.
            message = wire.encode_failed(
                HELLO_REQUEST_ID, self.s.rank, why, False, self.s.incarnation, hello_id=hello_id
            )
            out.append(Send(told, message))
        owed = engine.owed.pop(rank, ())  # unanswered otherwise: those end at D's timeout
        out += [Send(a, m) for a, inc, m in owed if told and a == told and inc == refusal.incarnation]  # type: ignore[union-attr]
        for request in list(self._requests.values()):
            held = request.others.get(engine.engine_id, {})
            if rank in held:
                tell(held.pop(rank))
            if request.engine_id == engine.engine_id and rank in request.regs:
                tell(request.regs.pop(rank), request.dests.get(rank) if request.dests else None)
                if request.blocks is not None:
                    out += self._fail_request(request, f"handshake with D rank {rank} failed: {error}", now)
        return out

    def _refused_why(self, error: str) -> str:
        """What D is told when P refuses its metadata: what happens next, then the cause (P's
        handshake error, which names what differs and what to run)."""
        return (
            f"P engine {self.s.engine_id!r} rank {self.s.rank} refused this D rank's handshake "
            f"metadata (fix what follows, on P or on D: a D restarted with the fix, a new "
            f"incarnation, handshakes again at once; one not restarted is refused again after its "
            f"backoff): {error}"
        )

    def _decode_restarted(
        self, engine: _Decode, reg: PushRegistration, agent: str, note: Notification, now: float
    ) -> list[Any]:
        """A D rank came back under the same engine id with a new incarnation: a new peer. Its
        message is handled once the rank's stale agent is gone (after its WRITEs settled).
        Only the requests holding a registration (or a WRITE) of the rank's old start fail:
        that process is gone, with its request. The engine's other ranks, and the new start
        once loaded, go on (their requests are served).

        Only once D's side channel says that start runs (:meth:`_ask_start`): a late message
        of a dead start that sorts after the live one (a D restarted on a clock behind) failed
        the live start's requests, once per late message."""
        if self._served.get((engine.engine_id, reg.decode_tp_rank)) != reg.decode_incarnation:
            return self._ask_start(engine, reg.decode_tp_rank, agent, note, now)
        engine.deferred.append((agent, note))
        if len(engine.deferred) > MAX_DEFERRED:
            dropped_agent, dropped = engine.deferred.pop(0)
            self._reject(dropped_agent, dropped, f"over {MAX_DEFERRED} messages held for a restarted D")
        rank = reg.decode_tp_rank
        if engine.drop_when_idle or rank in engine.replacing:
            return []
        self.stats["decode_restarts"] += 1
        reason = (
            f"D engine {engine.engine_id!r} restarted (rank {rank}: incarnation "
            f"{engine.incarnations.get(rank)} -> {reg.decode_incarnation})"
        )
        return self._rank_gone(engine, rank, reason, now)

    def _ask_start(self, engine: _Decode, rank: int, agent: str, note: Notification, now: float) -> list[Any]:
        """A message of a start of D rank ``rank`` P has not loaded: ask D's side channel (the
        authority on which start runs) before taking it for a restart, off the writer thread;
        the message waits for the answer (:meth:`start_served`). One question per rank at a
        time (asked again if unanswered after ``lease_s``)."""
        where = (engine.engine_id, rank)
        asking = self._asking.get(where)
        out: list[Any] = []
        if asking is None or now >= asking.asked_at + self.s.lease_s:
            held = asking.held if asking is not None else []
            asking = self._asking[where] = _Asking(asked_at=now, held=held)
            self.stats["starts_asked"] += 1
            out.append(AskStart(engine.engine_id, engine.host, engine.port, rank))
        if len(asking.held) >= MAX_DEFERRED:
            self._reject(agent, note, f"over {MAX_DEFERRED} messages held for a D start being asked about")
        else:
            asking.held.append((agent, note))
        return out

    def start_served(self, engine_id: str, rank: int, incarnation: str, error: str, now: float) -> list[Any]:
        """The driver's answer to :class:`AskStart`: D rank ``rank``'s side channel serves
        ``incarnation`` (or could not be read: ``error``). Held messages of that start are
        handled as a restart of the rank; those of any other start are a dead start's, late:
        dropped, as are its further messages for a backoff (then asked again, at most once per
        backoff: a side channel behind the start that spoke catches up). Unanswered, nothing is
        known: the held messages are dropped (D sends its HELLO again) and asked again after a
        backoff; the loaded start's requests are never failed on a message alone. An answer
        to a question a handshake of the rank overtook is not taken: the held messages are
        handled again (asked about anew)."""
        asking = self._asking.pop((engine_id, rank), None)
        if asking is None:
            return []
        out: list[Any] = []
        if asking.overtaken:
            # A handshake loaded a start of the rank while the question was out: which word is
            # newer cannot be told, and taken, an older answer failed the loaded start's
            # requests. The held messages are handled again (asked about anew where needed).
            for agent, note in asking.held:
                out += self.notification(agent, note, now)
            return out
        if error or not incarnation:
            logger.warning(
                "cannot tell which start of D engine %r rank %s runs (%s): %d message(s) of a start P "
                "has not loaded dropped",
                engine_id,
                rank,
                error or "no incarnation",
                len(asking.held),
            )
        else:
            self._served[(engine_id, rank)] = incarnation
            while len(self._served) > MAX_REPLACED:
                del self._served[next(iter(self._served))]
            self._unserved.pop((engine_id, rank, incarnation), None)
        for agent, note in asking.held:
            reg = note.registration
            assert reg is not None
            if reg.decode_incarnation == incarnation and not error:
                out += self.notification(agent, note, now)
            else:
                self._not_served(engine_id, rank, reg.decode_incarnation, now)
                self._reject(
                    agent,
                    note,
                    f"a message of D start {reg.decode_incarnation!r}, which its side channel does not serve",
                )
        return out

    def _not_served(self, engine_id: str, rank: int, incarnation: str, now: float) -> None:
        """D's side channel served another start than ``incarnation`` (or could not be read)
        after it spoke: drop its messages for a backoff that doubles each time (up to a quarter
        of the lease)."""
        where = (engine_id, rank, incarnation)
        until, backoff = self._unserved.pop(where, (now, 0.0))
        if now >= until:  # asked again since: a longer backoff
            # At most a quarter of the lease (as the address backoff): a start the side channel
            # names late is loaded before the finished prefills' leases run out.
            cap = min(self.s.retry_backoff_max_s, max(self.s.retry_backoff_s, self.s.lease_s / 4))
            backoff = min(max(2 * backoff, self.s.retry_backoff_s), cap)
            until = now + backoff
        self._unserved[where] = (until, backoff)
        while len(self._unserved) > MAX_REPLACED:
            self._unserved.popitem(last=False)

    def _unserved_now(self, engine: _Decode, reg: PushRegistration, now: float) -> bool:
        """Is ``reg`` of a start D's side channel lately said it does not serve (its backoff not
        over), while P has another start of that rank loaded?"""
        rank, incarnation = reg.decode_tp_rank, reg.decode_incarnation
        entry = self._unserved.get((engine.engine_id, rank, incarnation))
        known = engine.incarnations.get(rank)
        return entry is not None and now < entry[0] and known is not None and known != incarnation

    def _rank_gone(
        self, engine: _Decode, rank: int, reason: str, now: float, *, keep_unposted: bool = False
    ) -> list[Any]:
        """The process P loaded for D rank ``rank`` is gone (restarted, or its endpoint broke):
        the requests holding its registration, or a WRITE to it, fail (it is not told: it
        cannot hear, and its agent's name may be a new start's); the engine's other ranks are
        told. Its agent is dropped once no WRITE to it is in flight.

        ``keep_unposted`` (the endpoint broke, the process may live: D's fence of a P engine
        cuts a live rank's connections too): a registration nothing was posted for is dropped
        instead, and the request waits for D to register that rank again, bounded by its lease
        (D's heartbeats renew it) as any registration P waits for."""
        out: list[Any] = []
        waiting = (_Dest.WAIT_REG, _Dest.WAIT_CONNECT, _Dest.WAIT_FRESH)
        for request in list(self._requests.values()):
            dest = request.dests.get(rank) if request.dests else None
            wrote = dest is not None and (dest.unsettled or dest.state in (_Dest.INFLIGHT, _Dest.DONE))
            # A registration dropped when the rank's endpoint broke was this start's too.
            held = rank in request.regs or (not keep_unposted and rank in request.cut)
            if request.engine_id != engine.engine_id or not (held or wrote):
                continue
            if keep_unposted and not wrote and (dest is None or dest.state in waiting):
                request.cut[rank] = request.regs.pop(rank).reg.decode_incarnation
                if dest is not None and request.dests is not None:
                    request.dests[rank] = _DestState()  # nothing planned from a registration gone
                self.stats["registrations_cut"] += 1
                continue
            # The old start is not told (its agent's name is the new start's now).
            request.cancel_acks.pop(engine.agents.get(rank, ""), None)
            out += self._fail_request(request, reason, now, untold=rank)
        engine.replacing[rank] = reason
        return out + self._maybe_drop_rank(engine, rank, now)

    def _cut_by_another_start(self, engine: _Decode, rank: int, incarnation: str, now: float) -> list[Any]:
        """D rank ``rank`` was loaded as ``incarnation``: a registration P dropped when the
        rank's endpoint broke (:meth:`_rank_gone`) that another start of the rank sent ended
        with it (that start restarted, its request gone): the request fails, as it would had
        P still held the registration when the restart showed."""
        out: list[Any] = []
        for request in list(self._requests.values()):
            cut = request.cut.get(rank)
            if request.engine_id != engine.engine_id or cut is None or cut == incarnation:
                continue
            del request.cut[rank]
            why = f"D rank {rank} restarted (incarnation {cut} -> {incarnation}) after its endpoint broke"
            out += self._fail_request(request, why, now, untold=rank)
        return out

    def _maybe_drop_rank(self, engine: _Decode, rank: int, now: float) -> list[Any]:
        """Drop a restarted D rank's old agent once no WRITE to it is in flight, then handle
        the new start's messages held meanwhile."""
        if rank not in engine.replacing or any(
            request.engine_id == engine.engine_id
            and request.dests is not None
            and rank in request.dests
            and request.dests[rank].state is _Dest.INFLIGHT
            for request in self._requests.values()
        ):
            return []
        reason = engine.replacing.pop(rank)
        agent = engine.agents.pop(rank, None)
        gone = engine.incarnations.pop(rank, None)
        if gone is not None:
            self._remember_replaced(engine.engine_id, rank, gone)
        engine.hellos.pop(rank, None)
        engine.hello_incarnations.pop(rank, None)
        engine.hello_ids.pop(rank, None)
        engine.owed.pop(rank, None)  # as when the whole engine is dropped
        engine.delivered.pop(rank, None)  # the old start's ids: a new start may use them again
        if agent is not None:
            engine.last_want.pop(agent, None)
            engine.want_pending.pop(agent, None)
            self._timers.disarm(("want", engine.engine_id, agent))
        out: list[Any] = [DropPeer(engine.engine_id, reason, (rank,))]
        if not engine.agents and not engine.connecting and self._engines.get(engine.engine_id) is engine:
            del self._engines[engine.engine_id]  # its last rank: forgotten, as a dropped engine
        held = [m for m in engine.deferred if m[1].registration and m[1].registration.decode_tp_rank == rank]
        engine.deferred = [m for m in engine.deferred if all(m is not h for h in held)]
        for held_agent, held_note in held:
            out += self.notification(held_agent, held_note, now)
        return out

    def _remember_replaced(self, engine_id: str, rank: int, incarnation: str) -> None:
        replaced = self._replaced.pop((engine_id, rank), [])
        if incarnation not in replaced:
            replaced.append(incarnation)
        self._replaced[(engine_id, rank)] = replaced[-MAX_REPLACED_PER_RANK:]
        while len(self._replaced) > MAX_REPLACED:
            del self._replaced[next(iter(self._replaced))]

    def _restarted(self, engine: _Decode, reg: PushRegistration, *, hello: bool = False) -> bool:
        """Does ``reg`` come from another start of a D rank P has loaded, one P never replaced?

        A later-sorting start (incarnations begin with the start time) is a restart. So is an
        earlier-sorting one P never loaded when it says HELLO (a start handshaking now): a D
        restarted on a clock behind (a host taking over the address, a clock stepped back)
        was taken for a late message, and P answered its HELLOs to the dead start it kept
        loaded, so none of the new start's requests was served. Either way P loads the rank
        afresh from D's side channel, which names the live start; a start P loaded and
        dropped since is never taken for a restart (its messages are late)."""
        rank, incarnation = reg.decode_tp_rank, reg.decode_incarnation
        known = engine.incarnations.get(rank)
        if known is None or incarnation == known:
            return False
        if incarnation in self._replaced.get((engine.engine_id, rank), ()):
            return False
        return incarnation > known or hello

    def _stale(self, engine: _Decode, reg: PushRegistration, *, hello: bool = False) -> bool:
        """Does ``reg`` come from a start of a D rank that P replaced, or an earlier-sorting one
        that is not a HELLO (see :meth:`_restarted`)?"""
        rank, incarnation = reg.decode_tp_rank, reg.decode_incarnation
        known = engine.incarnations.get(rank)
        if known is None or incarnation == known:
            return False
        if incarnation in self._replaced.get((engine.engine_id, rank), ()):
            return True
        return incarnation < known and not hello

    def _drop_engine(self, engine: _Decode, reason: str, now: float) -> list[Any]:
        """Forget a D engine now, or once its WRITEs in flight settled (never under them)."""
        if engine.inflight:
            engine.drop_when_idle = reason
            return []
        if self._engines.get(engine.engine_id) is engine:
            del self._engines[engine.engine_id]
        out: list[Any] = [DropPeer(engine.engine_id, reason)]
        for agent, note in engine.deferred:
            out += self.notification(agent, note, now)
        return out

    # ------------------------------------------------------------------ planning and posting

    def _plan_request(self, request: _Request, now: float) -> list[Any]:
        assert request.blocks is not None
        first = self._plannable(request)
        if first is None:
            return []  # planned once a registering D rank is loaded
        engine = self._engines[request.engine_id]
        if first.reg.decode_tp_size != engine.tp_size:
            return self._fail_request(
                request, f"PUSH_REG states D TP {first.reg.decode_tp_size}, D published {engine.tp_size}", now
            )
        try:
            specs = list(self._plan(request.blocks, first.reg))
        except Exception as err:  # a plugin, numpy or torch: the request fails, nothing else
            return self._fail_request(request, f"planning failed: {type(err).__name__}: {err}", now)
        request.dests = {spec.dst_tp_rank: _DestState() for spec in specs}
        first_dest = request.dests.get(first.reg.decode_tp_rank)
        if first_dest is not None:  # the plan already holds this rank's spec: not planned twice
            first_dest.spec = next(s for s in specs if s.dst_tp_rank == first.reg.decode_tp_rank)
            first_dest.planned_from = first.reg
        out: list[Any] = []
        for rank in sorted(request.regs):
            if rank not in request.dests:
                out += self._reject_reg(request, rank, "this P rank does not write to that D rank")
        for rank in sorted(request.dests):
            out += self._advance(request, rank, now)
        return out

    def _prompts_differ(
        self, request: _Request, wrong: Sequence[_Reg], now: float, *, displaced: Sequence[_Reg] = ()
    ) -> list[Any]:
        """Registrations stating another prompt than P's prefill of the key: the router reused
        the key. None of them is written; each is answered FAIL. P's leg fails too (every D rank
        registered for the key is told) unless P already wrote the key to some D rank (then a
        registration that matched, or stated no fingerprint, was paired first: its push goes on).
        Later registrations of the key meet the tombstone: FAIL."""
        self.stats["prompt_mismatches"] += len(wrong)
        first = wrong[0].reg
        why = self._differ_reason(
            request.key, request.fingerprint, first, f"P's request {request.request_id!r}"
        )
        out: list[Any] = []
        for entry in wrong:
            rank = entry.reg.decode_tp_rank
            dest = request.dests.get(rank) if request.dests else None
            current = request.regs.get(rank)
            same = current is not None and current.reg.request_id == entry.reg.request_id
            unsettled = same and dest is not None and (dest.unsettled or dest.state is _Dest.INFLIGHT)
            if current is entry:
                del request.regs[rank]
            out += self._refuse(entry.reg, entry.agent, why, unsettled, now)
        if self._writing(request):
            logger.warning("refused PUSH_REG of %s: %s", request.key, why)
            return out
        logger.warning("refused the push of %s: %s", request.key, why)
        for entry in displaced:
            if all(entry is not w for w in wrong):
                out += self._refuse(entry.reg, entry.agent, why, False, now)
        return out + self._fail_request(request, why, now)

    @staticmethod
    def _differ_reason(key: str, fingerprint: str | None, reg: PushRegistration, prefill: str) -> str:
        return (
            f"match key {key!r} was given to two different prompts: D's request {reg.request_id!r} "
            f"has prompt fingerprint {reg.prompt_fingerprint}, {prefill} has {fingerprint}; the "
            f"prompts differ (a router reused the key), so P wrote nothing into D's blocks for it"
        )

    @staticmethod
    def _writing(request: _Request) -> bool:
        """Has P written (or begun writing) the key to some D rank?"""
        return any(
            d.state in (_Dest.INFLIGHT, _Dest.DONE) or d.unsettled for d in (request.dests or {}).values()
        )

    def _refuse(self, reg: PushRegistration, agent: str, why: str, unsettled: bool, now: float) -> list[Any]:
        """Answer one registration FAIL: now if P loaded its D rank from ``agent``, else once it
        has (P connects to it, as for any registration)."""
        message = wire.encode_failed(
            reg.request_id, self.s.rank, why, unsettled, self.s.incarnation, attempt=reg.attempt
        )
        engine = self._engines.get(reg.decode_engine_id)
        if engine is None:
            return []
        rank = reg.decode_tp_rank
        if engine.agents.get(rank) == agent:
            return [Send(agent, message)]
        if sum(map(len, engine.owed.values())) >= MAX_OWED:
            logger.warning("dropped a FAIL for %s of an unloaded D rank: %d held", reg.request_id, MAX_OWED)
            return []  # that D request ends at its registration timeout
        engine.owed.setdefault(rank, []).append((agent, reg.decode_incarnation, message))
        return [] if self._closing else self._connect(engine, rank, now, reg.decode_incarnation)

    def _reject_reg(self, request: _Request, rank: int, why: str) -> list[Any]:
        logger.warning("PUSH_REG of %s from D rank %s ignored: %s", request.key, rank, why)
        return []

    def _advance(self, request: _Request, rank: int, now: float) -> list[Any]:
        """Move one destination as far as it can go."""
        assert request.dests is not None and request.blocks is not None
        dest = request.dests[rank]
        if dest.state not in (_Dest.WAIT_REG, _Dest.WAIT_CONNECT, _Dest.WAIT_FRESH):
            return []
        entry = request.regs.get(rank)
        if entry is None:
            dest.state = _Dest.WAIT_REG
            return []
        engine = self._engine_for(entry.reg, now)
        if rank not in engine.agents:
            dest.state = _Dest.WAIT_CONNECT
            return self._connect(engine, rank, now, entry.reg.decode_incarnation)
        if not self._loaded_from(engine, rank, entry):
            # Not the agent (or start) P loaded for that rank: a late registration of a D that
            # restarted under the same engine id, or one from an agent claiming the rank before
            # P loaded it. Never written; the rank's own registration may still come.
            del request.regs[rank]
            self._dropped_reg(request.key, entry, engine, rank)
            dest.state = _Dest.WAIT_REG
            return []
        if entry.fresh_until <= now:
            dest.state = _Dest.WAIT_FRESH
            self.stats["stale_registrations"] += 1
            return self._want(engine, entry.agent, [request.key], now)
        if dest.planned_from is not None and dest.planned_from is not entry.reg:
            dest.spec = dest.planned_from = None  # registered again since: plan for the new one
        if dest.spec is None:
            try:
                specs = [s for s in self._plan(request.blocks, entry.reg) if s.dst_tp_rank == rank]
                if len(specs) != 1:
                    raise ValueError(f"the plan has {len(specs)} specs for D rank {rank}")
            except Exception as err:
                return self._fail_request(
                    request, f"planning for D rank {rank} failed: {type(err).__name__}: {err}", now
                )
            dest.spec = specs[0]
        # The registration the spec was planned for: a post refused for a stale grant comes
        # back here, and a registration that replaced this one meanwhile is planned afresh
        # (its own block ids and request id, never this one's blocks under its DONE).
        dest.planned_from = entry.reg
        dest.state = _Dest.POSTING
        return [Post(request.key, rank, request.engine_id, dest.spec, entry.reg)]

    def _want(self, engine: _Decode, agent: str, keys: list[str], now: float) -> list[Any]:
        """Ask D's ``agent`` for a fresh grant of ``keys``: at once, or, within the rate limit
        of the last ask, in one message when the limit allows (a key is never left to wait for
        D's next heartbeat)."""
        engine.want_pending.setdefault(agent, set()).update(keys)
        due = engine.last_want.get(agent, -1e18) + self.s.want_interval_s
        if now < due:
            self._timers.arm(("want", engine.engine_id, agent), due)
            return []
        return self._send_want(engine, agent, now)

    def _send_want(self, engine: _Decode, agent: str, now: float) -> list[Any]:
        """One want for every pending key still waiting for a grant from ``agent``."""
        keys: list[str] = []
        attempts: list[int | None] = []  # the attempt of the registration waiting, per key
        for key in sorted(engine.want_pending.pop(agent, ())):
            request = self._requests.get(key)
            if request is None or request.dests is None:
                continue
            for rank, entry in sorted(request.regs.items()):
                dest = request.dests.get(rank)
                if entry.agent == agent and dest is not None and dest.state is _Dest.WAIT_FRESH:
                    keys.append(key)
                    attempts.append(entry.reg.attempt)
                    break
        if not keys:
            return []
        engine.last_want[agent] = now
        return [  # several messages past one's key limit (the encoder would cut the rest)
            Send(
                agent,
                wire.encode_heartbeat_answer(
                    self.s.rank,
                    now,
                    self.s.incarnation,
                    keys[i : i + WANT_KEYS_PER_MESSAGE],
                    want_attempts=attempts[i : i + WANT_KEYS_PER_MESSAGE],
                ),
            )
            for i in range(0, len(keys), WANT_KEYS_PER_MESSAGE)
        ]

    def confirm_post(self, key: str, rank: int, now: float) -> bool:
        """Called by the driver immediately before it posts: still wanted, not cancelled, and
        the registration's grant still fresh? A stale one goes back to waiting for a grant."""
        request = self._requests.get(key)
        if request is None or request.dests is None or request.failure or self._said_goodbye:
            return False
        dest = request.dests.get(rank)
        entry = request.regs.get(rank)
        if dest is None or dest.state is not _Dest.POSTING or entry is None:
            return False
        if entry.fresh_until <= now:
            dest.state = _Dest.WAIT_FRESH
            self.stats["stale_registrations"] += 1
            return False
        engine = self._engines.get(request.engine_id)
        loaded_at = engine.loaded_at.get(rank, float("inf")) if engine is not None else float("inf")
        if entry.grant < loaded_at:
            # A grant issued before P (re)loaded this D rank's agent reached D over an earlier
            # connection: nothing shows this one is up. A WRITE posted before its connection is
            # up is queued in UCX, survives P's abort and D's fence (no socket to shut yet) and
            # lands when a link heals; one P posts after D echoed a stamp sent over it goes into
            # a connection the fence covers. Asked for a fresh grant, as a stale one.
            dest.state = _Dest.WAIT_FRESH
            self.stats["grants_before_load"] += 1
            return False
        return True

    def refresh(self, key: str, rank: int, now: float) -> list[Any]:
        """After a refused ``confirm_post``: ask D for a fresh grant (rate-limited)."""
        request = self._requests.get(key)
        engine = self._engines.get(request.engine_id) if request else None
        entry = request.regs.get(rank) if request else None
        if engine is None or entry is None:
            return []
        return self._want(engine, entry.agent, [key], now)

    def posted(
        self, key: str, rank: int, handles: Sequence[Any], nbytes: int, now: float, *, abortable: bool = True
    ) -> list[Any]:
        """The driver posted the WRITE(s); ``abortable``: False when its transport cannot take
        them back once posted (a kernel copy), so the WRITE deadline waits instead of aborting."""
        request = self._requests[key]
        assert request.dests is not None
        dest = request.dests[rank]
        dest.state, dest.handles, dest.bytes = _Dest.INFLIGHT, set(handles), nbytes
        dest.abortable = abortable
        self.stats["writes"] += len(dest.handles)
        engine = self._engines.get(request.engine_id)
        if engine is not None:
            engine.inflight += 1
        self._timers.arm(("write", key, rank), now + self.s.write_deadline_s)
        return []

    def post_failed(
        self, key: str, rank: int, reason: str, now: float, *, maybe_sent: bool = True
    ) -> list[Any]:
        """A post raised; ``maybe_sent``: some of its bytes may have gone out (D must fence)."""
        request = self._requests.get(key)
        if request is None:
            return []
        # The engine stays loaded: a refused post is usually local, and a D that died and came
        # back is recognised by its new incarnation.
        dest = request.dests.get(rank) if request.dests else None
        if dest is not None and maybe_sent:
            dest.unsettled = True  # part of a refused post may have gone out
            self._unsettled_to.add((request.engine_id, rank))
        return self._fail_request(request, f"WRITE to D rank {rank} failed: {reason}", now)

    def write_settled(
        self, key: str, rank: int, handle: Any, ok: bool, now: float, error: str = ""
    ) -> list[Any]:
        """A WRITE handle settled (``ok``, or failed with the transport's ``error`` if any)."""
        request = self._requests.get(key)
        if request is None or request.dests is None:
            return []
        dest = request.dests[rank]
        dest.handles.discard(handle)
        if not ok and not dest.error:
            dest.error = f"WRITE to D rank {rank} ended in error" + (f": {error}" if error else "")
        if dest.handles:
            return []
        return self._dest_settled(request, rank, now)

    def _dest_settled(self, request: _Request, rank: int, now: float) -> list[Any]:
        assert request.dests is not None
        dest = request.dests[rank]
        self._timers.disarm(("write", request.key, rank))
        engine = self._engines.get(request.engine_id)
        out: list[Any] = []
        if engine is not None:
            engine.inflight = max(0, engine.inflight - 1)
        if dest.error:
            dest.state = _Dest.FAILED
            dest.unsettled = True  # aborted or failed after it was posted
            self._unsettled_to.add((request.engine_id, rank))
            request.failure = request.failure or dest.error
            entry = request.regs.get(rank)
            if entry is not None and (engine is None or rank not in engine.replacing):
                message = wire.encode_failed(
                    entry.reg.request_id,
                    self.s.rank,
                    dest.error,
                    True,
                    self.s.incarnation,
                    attempt=entry.reg.attempt,
                )
                out.append(Send(entry.agent, message))
        else:
            dest.state = _Dest.DONE
            entry = request.regs.get(rank)
            if engine is not None and entry is not None:
                self._delivered(engine, rank, entry.agent, entry.reg.request_id)
        if engine is not None and rank in engine.replacing:
            out += self._maybe_drop_rank(engine, rank, now)
        if engine is not None and engine.drop_when_idle and not engine.inflight:
            out += self._drop_engine(engine, engine.drop_when_idle, now)
        return out + self._maybe_end(request, now)

    @staticmethod
    def _delivered(engine: _Decode, rank: int, agent: str, request_id: str) -> None:
        """A WRITE, and so its DONE, to D rank ``rank`` (through ``agent``) completed."""
        sent_to, ids = engine.delivered.get(rank, ("", None))
        if ids is None or sent_to != agent:
            ids = deque(maxlen=MAX_DELIVERED)
            engine.delivered[rank] = (agent, ids)
        ids.append(request_id)

    def _fail_request(self, request: _Request, reason: str, now: float, *, untold: int = -1) -> list[Any]:
        """Stop posting for a request; report it once nothing of it is in flight (D rank
        ``untold`` is not told: a restarted rank's old start, gone)."""
        request.failure = request.failure or reason
        out: list[Any] = []
        engine = self._engines.get(request.engine_id)
        for rank, entry in sorted(request.regs.items()):
            dest = request.dests.get(rank) if request.dests else None
            if dest is not None and dest.state in (_Dest.INFLIGHT, _Dest.DONE, _Dest.FAILED):
                continue
            if dest is not None:
                dest.state = _Dest.FAILED
            loaded = engine is not None and engine.agents.get(rank) == entry.agent
            if loaded and rank != untold and entry.agent not in request.cancel_acks:
                unsettled = dest is not None and dest.unsettled
                message = wire.encode_failed(
                    entry.reg.request_id,
                    self.s.rank,
                    reason,
                    unsettled,
                    self.s.incarnation,
                    attempt=entry.reg.attempt,
                )
                out.append(Send(entry.agent, message))
        for dest in (request.dests or {}).values():
            if dest.state in (_Dest.WAIT_REG, _Dest.WAIT_CONNECT, _Dest.WAIT_FRESH, _Dest.POSTING):
                dest.state = _Dest.FAILED
        return out + self._maybe_end(request, now)

    def _maybe_end(self, request: _Request, now: float) -> list[Any]:
        if self._requests.get(request.key) is not request:
            return []  # ended meanwhile (a deferred message replayed under it failed it)
        dests = request.dests or {}
        if any(d.state is _Dest.INFLIGHT for d in dests.values()):
            return []
        if not request.failure and (not dests or any(d.state is not _Dest.DONE for d in dests.values())):
            return []
        return self._end(request, now)

    def _end(self, request: _Request, now: float) -> list[Any]:
        """The one place a request's state is deleted; reports it (once) and answers cancels."""
        del self._requests[request.key]
        for kind in ("lease", "stash", "unregistered"):
            self._timers.disarm((kind, request.key))
        # Cancels of registrations P never held end at most the attempt they met: a later
        # attempt of the key (a retry under it) is not ended by them.
        self._unregistered.pop(request.key, None)
        outcome = "failed" if request.failure else "sent"
        any_unsettled = any(d.unsettled for d in (request.dests or {}).values())
        tomb = _Tomb(outcome, request.engine_id, request.failure, any_unsettled, request.fingerprint, now)
        past = request.past
        if past is not None:  # what the key's earlier attempts saw stays answered
            tomb.seen, tomb.told, tomb.prefills = past.seen, past.told, past.prefills
            tomb.told_attempts = past.told_attempts
            tomb.overflow = past.overflow
            tomb.unsettled |= past.unsettled  # their late messages are answered unsettled still
        tomb.seen |= request.seen
        for where, when in request.told.items():
            tomb.told[where] = max(when, tomb.told.get(where, when))
        tomb.told_attempts |= request.told_attempts
        if len(tomb.told_attempts) > MAX_SEEN:
            tomb.overflow, tomb.told_attempts = True, set()
        if request.request_id:
            tomb.prefills.add(request.request_id)
        tomb.unfinished = not request.request_id  # ended before any prefill of it ended here
        if len(tomb.seen) > MAX_SEEN:
            tomb.overflow, tomb.seen = True, set()
        self._tombstones[request.key] = tomb
        self._timers.arm(("tomb", request.key), now + self.s.registration_ttl_s)
        unsettled = {
            entry.agent
            for rank, entry in request.regs.items()
            if request.dests and rank in request.dests and request.dests[rank].unsettled
        }
        out: list[Any] = [
            Send(
                agent,
                wire.encode_cancel_ack(
                    d_rid,
                    self.s.rank,
                    request.write_at_cancel,
                    agent in unsettled,
                    self.s.incarnation,
                    attempt=attempt,
                ),
            )
            for agent, (d_rid, attempt) in request.cancel_acks.items()
        ]
        if request.blocks is None:
            return out  # a stash that expired or was cancelled: nothing to report
        if outcome == "sent":
            self.stats["pushes"] += 1
            self.stats["bytes"] += sum(d.bytes for d in (request.dests or {}).values())
        return [*out, Report(request.request_id, outcome, request.failure, request.key)]

    # ------------------------------------------------------------------ timers

    def handle_timer(self, now: float) -> list[Any]:
        out: list[Any] = []
        for timer in self._timers.pop_expired(now):
            kind, key = timer[0], timer[1]
            request = self._requests.get(key)
            if kind == "tomb":
                self._tombstones.pop(key, None)
            elif kind == "refused":
                self._refused.pop(key, None)
            elif kind == "unregistered":
                self._unregistered.pop(key, None)
            elif kind == "refusal":
                self._refusals.pop(key, None)
            elif kind == "unloaded":
                self._unloaded(key, now)
            elif kind == "backoff":
                backoff_entry = self._address_backoff.get(key)
                until = backoff_entry.until if backoff_entry is not None else 0.0
                if until + self.s.retry_backoff_max_s <= now:  # long quiet: forget (bounded state)
                    self._address_backoff.pop(key, None)
            elif kind == "stash" and request is not None and request.blocks is None:
                why = f"no prefill finished within {self.s.registration_ttl_s:g}s of D's registration"
                logger.warning("dropped D's registration %s: %s", key, why)
                request.failure = why
                out += self._end(request, now)
            elif kind == "lease" and request is not None:
                missing = sorted(r for r, d in (request.dests or {}).items() if d.state is _Dest.WAIT_REG)
                why = f"D rank(s) {missing} never registered" if missing else "D never registered its blocks"
                out += self._fail_request(request, f"lease of {self.s.lease_s:g}s expired: {why}", now)
            elif kind == "write" and request is not None:
                out += self._write_deadline(request, timer[2], now)
            elif kind == "want" and key in self._engines:
                out += self._send_want(self._engines[key], timer[2], now)
        return out

    def _write_deadline(self, request: _Request, rank: int, now: float) -> list[Any]:
        assert request.dests is not None
        dest = request.dests[rank]
        if dest.state is not _Dest.INFLIGHT:
            return []
        if not dest.abortable:
            # Aborting would only be a claim: the launched copy runs on, and D, told the WRITE
            # ended, would fence a connection that does not carry it and release the blocks
            # under it. P keeps polling; D's own watchdog fails the request for its engine and
            # holds the blocks until this WRITE's end is acknowledged.
            self.stats["overdue_kernel_writes"] += 1
            if self._warned.allow():
                logger.warning(
                    "a copy to D rank %d for %r has not completed after %gs; it cannot be aborted "
                    "once launched, so P keeps waiting for it (the device may be stalled)",
                    rank,
                    request.key,
                    self.s.write_deadline_s,
                )
            self._timers.arm(("write", request.key, rank), now + self.s.write_deadline_s)
            return []
        self.stats["write_deadline_expiries"] += 1
        handles = tuple(dest.handles)
        dest.handles.clear()
        dest.error = f"WRITE to D rank {rank} did not complete within {self.s.write_deadline_s:g}s; aborted"
        engine = self._engines.get(request.engine_id)
        if engine is not None:
            engine.drop_when_idle = dest.error  # a fresh connection for the next push
        return [Abort(handles), *self._dest_settled(request, rank, now)]

    # ------------------------------------------------------------------ helpers

    def _fresh_until(self, reg: PushRegistration, now: float) -> float:
        """Until when ``reg`` may be written: its grant plus D's window; never for a grant P
        could not have issued (later than P's clock now: not one of P's stamps)."""
        if reg.grant is None or reg.fresh_s <= 0 or reg.grant > now:
            return float("-inf")
        return reg.grant + reg.fresh_s

    def _reject(self, agent: str, note: Notification, why: str) -> None:
        self.stats["rejected_notifications"] += 1
        if self._warned.allow():
            logger.warning(
                "dropped %s for %r from %s: %s", note.kind.value, note.request_id or "-", agent, why
            )

    def inflight_handles(self) -> Mapping[Any, tuple[str, int]]:
        """Every WRITE handle in flight -> (match key, D rank), for the driver to poll."""
        out = {}
        for request in self._requests.values():
            for rank, dest in (request.dests or {}).items():
                for handle in dest.handles:
                    out[handle] = (request.key, rank)
        return out
