"""What the sans-IO protocol cores ask their drivers to do.

A core never touches the transport, the side channel, a thread or the clock: each event handler
returns a list of these actions, which the driver (:mod:`kvpush.core.sender`,
:mod:`kvpush.core.receiver`) executes in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvpush.core.types import BlockIds, PackManifest, PushRegistration, RankKey, ReadSpec


@attrs.frozen
class Send:
    """Send one notification to a loaded peer agent."""

    agent: str
    message: bytes


@attrs.frozen
class Connect:
    """Handshake with a peer engine (D: notif-only with P's producers; P: full with D ranks)."""

    engine_id: str
    host: str
    port: int
    ranks: tuple[RankKey, ...] = ()
    """P → D: the D ranks to load. D → P: empty (D learns P's ranks from P's metadata)."""


@attrs.frozen
class AskStart:
    """P: ask D rank ``rank``'s side channel which start (incarnation) of it runs, off the writer
    thread (one round trip, bounded by the handshake timeout); the driver answers
    ``PrefillCore.start_served`` with the incarnation it serves, or the error."""

    engine_id: str
    host: str
    port: int
    rank: int


@attrs.frozen
class DropPeer:
    """Forget a peer engine: remove its agents (tears the connection down) and what was prepared."""

    engine_id: str
    reason: str
    ranks: tuple[int, ...] = ()
    """P: only these D TP ranks (a D rank restarted under the same name); empty: the whole engine."""


@attrs.frozen
class Fence:
    """D: remove these P agents and make sure nothing they already sent can still land here
    (the transport tears down every connection that carries their data; TCP keeps a partitioned
    sender's bytes for minutes). The driver answers with ``DecodeCore.fenced(fence_id)`` once the
    transport confirms it; blocks waiting on the fence are released only then."""

    fence_id: int
    engine_id: str
    agents: tuple[str, ...]
    reason: str


@attrs.frozen
class Report:
    """Tell the engine how a request ended (exactly once per request and side)."""

    request_id: str
    outcome: str
    """``done`` / ``sent``, ``failed`` or ``cancelled``."""
    reason: str = ""
    key: str = ""
    """P: the match key the request was pushed under."""


@attrs.frozen
class ProbeExit:
    """D: check whether these producer processes of a held request have exited (their kernel
    copies ended with them); the driver answers ``DecodeCore.producers_exited`` with those that
    have (:func:`kvpush.core.process_identity.has_exited`)."""

    request_id: str
    processes: tuple[tuple[str, Mapping[str, Any]], ...]
    """``(agent, process identity)`` pairs."""


@attrs.frozen
class Release:
    """D: a failed or cancelled request's blocks may be reused (no WRITE into them can land)."""

    request_id: str


@attrs.frozen
class FreeStaging:
    """D: free a request's staging reservation (packed strategy)."""

    offset: int


@attrs.frozen
class Scatter:
    """D: copy a packed producer's bytes from the staging area into the request's blocks, then
    call ``scattered`` on the core."""

    request_id: str
    producer: RankKey
    manifest: PackManifest
    block_ids: BlockIds


@attrs.frozen
class Post:
    """P: post the WRITE(s) of one destination D rank. The driver calls ``confirm_post`` right
    before posting, then ``posted`` or ``post_failed``."""

    key: str
    dst: int
    engine_id: str
    spec: ReadSpec
    registration: PushRegistration


@attrs.frozen
class Abort:
    """P: a WRITE passed its deadline: release these handles (the driver drops the peer next)."""

    handles: tuple[Any, ...]
