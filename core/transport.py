"""The interface every transport plugin implements, and its configuration.

Threading contract: one writer thread per rank owns the transport. Every method except
``metadata()`` and ``counters`` is called from that thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from kvpush.core.types import KVRegion, MemType


class TransferState(enum.Enum):
    DONE = "done"
    PENDING = "pending"
    FAILED = "failed"


@attrs.frozen(kw_only=True)
class TransportConfig:
    """What a transport needs to start. ``options`` carries transport-specific knobs."""

    agent_name: str
    options: dict[str, Any] = attrs.field(factory=dict, hash=False)


@attrs.define
class TransportCounters:
    """Counts of what a transport did; tests and the demo assert against these."""

    peers_loaded: int = 0
    peers_removed: int = 0
    local_lists_prepared: int = 0
    remote_lists_prepared: int = 0
    writes_posted: int = 0
    writes_failed: int = 0
    notifs_sent: int = 0
    notifs_received: int = 0
    handles_released: int = 0
    fences_unconfirmable: int = 0
    """Fences that can never be confirmed (NIXL: the peer's UCX connection requests could not
    be refused); the blocks waiting on them stay held."""

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


@runtime_checkable
class Transport(Protocol):
    """A one-sided WRITE transport with notifications (NIXL is the first).

    Optional, not part of the protocol check: ``post_write_grid(local_list, local_ids,
    remote_list, remote_ids, notif)`` with :class:`kvpush.core.planning.IdGrid` ids (factored:
    region starts and block ids), called instead of ``post_write`` where the layout allows; it
    must act as ``post_write`` with ``ids()`` (see docs/plugins.md).
    """

    name: str
    counters: TransportCounters

    @property
    def agent_name(self) -> str: ...

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``load_peer`` to reach this agent."""

    def register_regions(self, regions: Sequence[KVRegion]) -> None:
        """Register the memory behind ``regions`` for transfers."""

    def register_buffer(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None:
        """Register one extra buffer (e.g. a staging area)."""

    def prepare_local(self, descriptors: np.ndarray, mem_type: MemType) -> int:
        """Prepare an Nx3 ``(addr, len, device)`` uint64 list of local descriptors; returns a handle."""

    def load_peer(self, blob: bytes) -> str:
        """Load a peer agent from its ``metadata()`` bytes; returns the peer's agent name."""

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and every list prepared against it."""

    def fence_peer(self, peer: str) -> None:
        """Remove ``peer`` and start making sure nothing it already sent can still land in this
        agent's memory: tear down every connection that can carry its data (over TCP, bytes a
        partitioned peer queued arrive minutes later unless the connection is gone). D calls it
        before it reuses blocks a failed or silent P may have been writing."""

    def fenced(self, peer: str) -> bool:
        """True once the fence of ``peer`` is complete (D releases the blocks only then)."""

    def prepare_remote(self, peer: str, descriptors: np.ndarray, mem_type: MemType) -> int:
        """Prepare an Nx3 list of a peer's descriptors; returns a handle."""

    def release_list(self, handle: int) -> None:
        """Release a prepared descriptor list."""

    def post_write(
        self,
        local_list: int,
        local_ids: np.ndarray,
        remote_list: int,
        remote_ids: np.ndarray,
        notif: bytes,
    ) -> Any:
        """Post one WRITE of ``local_ids`` into ``remote_ids``; the peer receives ``notif`` once
        the data has landed. Returns a transfer handle. Raises ``TransferError`` on failure."""

    def poll(self, handle: Any) -> TransferState:
        """State of a posted WRITE; never raises (a transport error is ``FAILED``)."""

    def release(self, handle: Any) -> None:
        """Release a transfer handle (done or failed)."""

    def send_notif(self, peer: str, message: bytes) -> None:
        """Send a notification to a loaded peer. Raises ``TransferError`` on failure."""

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        """Every notification received since the last call, as ``(peer name, message)``."""

    def close(self) -> None:
        """Release every handle, list, peer and registration this transport made."""
