"""An in-process loopback transport for unit tests of pure logic (not registered by default).

Agents created in one process reach each other by name. A WRITE copies the bytes with
``memmove`` and delivers its notification to the target; notifications are queued per agent.
Tests can make posts fail (``fail_posts``) or WRITEs end in error (``fail_writes``), and can
inject notifications (``inject``). Register it with
``get_plugin_manager(plugins=[("loopback", kvpush.transports.loopback)])``.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpush.core.errors import TransferError
from kvpush.core.markers import hookimpl
from kvpush.core.transport import TransferState, TransportConfig, TransportCounters
from kvpush.core.types import KVRegion, MemType, TransportProvider

_AGENTS: dict[str, LoopbackTransport] = {}
_AGENTS_LOCK = threading.Lock()
_IDS = itertools.count(1)


class LoopbackTransport:
    name = "loopback"
    same_host_copies = False
    """Its copies complete inside ``post_write``: none lands after a fence."""

    def __init__(self, config: TransportConfig) -> None:
        self._agent_name = config.agent_name
        self.counters = TransportCounters()
        self.inbox: deque[tuple[str, bytes]] = deque()
        self.fail_posts = 0
        """The next N ``post_write`` calls raise ``TransferError``."""
        self.fail_writes = 0
        """The next N posted WRITEs end in error (no bytes copied, no notification)."""
        self.posts: list[dict[str, Any]] = []
        self.sent: list[tuple[str, bytes]] = []
        self._lists: dict[int, tuple[str | None, np.ndarray]] = {}
        self._states: dict[int, TransferState] = {}
        self._peers: set[str] = set()
        with _AGENTS_LOCK:
            _AGENTS[self._agent_name] = self

    @property
    def agent_name(self) -> str:
        return self._agent_name

    def metadata(self) -> bytes:
        return self._agent_name.encode()

    def register_regions(self, regions: Sequence[KVRegion]) -> None:
        pass

    def register_buffer(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None:
        pass

    def prepare_local(self, descriptors: np.ndarray, mem_type: MemType) -> int:
        handle = next(_IDS)
        self._lists[handle] = (None, np.array(descriptors, dtype=np.uint64))
        self.counters.local_lists_prepared += 1
        return handle

    def load_peer(self, blob: bytes) -> str:
        name = blob.decode()
        if name not in _AGENTS:
            raise TransferError(f"no loopback agent named {name!r} in this process")
        if name not in self._peers:
            self._peers.add(name)
            self.counters.peers_loaded += 1
        return name

    def remove_peer(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            self.counters.peers_removed += 1
            for handle in [h for h, (owner, _) in self._lists.items() if owner == peer]:
                del self._lists[handle]

    def fence_peer(self, peer: str) -> None:
        """In-process copies complete inside ``post_write``: removing the peer is the fence."""
        self.remove_peer(peer)

    def fenced(self, peer: str) -> bool:
        return peer not in self._peers

    def prepare_remote(self, peer: str, descriptors: np.ndarray, mem_type: MemType) -> int:
        handle = next(_IDS)
        self._lists[handle] = (peer, np.array(descriptors, dtype=np.uint64))
        self.counters.remote_lists_prepared += 1
        return handle

    def release_list(self, handle: int) -> None:
        self._lists.pop(handle, None)

    def post_write(
        self,
        local_list: int,
        local_ids: np.ndarray,
        remote_list: int,
        remote_ids: np.ndarray,
        notif: bytes,
    ) -> int:
        if self.fail_posts:
            self.fail_posts -= 1
            self.counters.writes_failed += 1
            raise TransferError("loopback: post refused (injected)")
        peer, remote = self._lists[remote_list]
        _, local = self._lists[local_list]
        handle = next(_IDS)
        self.posts.append(
            {"peer": peer, "local_ids": list(local_ids), "remote_ids": list(remote_ids), "notif": notif}
        )
        self.counters.writes_posted += 1
        if self.fail_writes:
            self.fail_writes -= 1
            self._states[handle] = TransferState.FAILED
            return handle
        for lid, rid in zip(local_ids, remote_ids, strict=True):
            src, dst = local[lid], remote[rid]
            if src[1] != dst[1]:
                raise TransferError(f"descriptor sizes differ: {src[1]} vs {dst[1]}")
            ctypes.memmove(int(dst[0]), int(src[0]), int(src[1]))
        _AGENTS[peer].inbox.append((self._agent_name, notif))
        self._states[handle] = TransferState.DONE
        return handle

    def poll(self, handle: int) -> TransferState:
        return self._states.get(handle, TransferState.FAILED)

    def release(self, handle: int) -> None:
        if self._states.pop(handle, None) is not None:
            self.counters.handles_released += 1

    def send_notif(self, peer: str, message: bytes) -> None:
        target = _AGENTS.get(peer)
        if target is None or peer not in self._peers:
            raise TransferError(f"loopback peer {peer!r} is not loaded")
        target.inbox.append((self._agent_name, message))
        self.sent.append((peer, message))
        self.counters.notifs_sent += 1

    def inject(self, peer: str, message: bytes) -> None:
        """Deliver ``message`` to this agent as if ``peer`` had sent it."""
        self.inbox.append((peer, message))

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        out = []
        while self.inbox:
            out.append(self.inbox.popleft())
        self.counters.notifs_received += len(out)
        return out

    @property
    def outstanding_handles(self) -> int:
        return len(self._states)

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        self._states.clear()
        self._lists.clear()
        with _AGENTS_LOCK:
            if _AGENTS.get(self._agent_name) is self:
                del _AGENTS[self._agent_name]


@hookimpl
def kvpush_transports() -> list[TransportProvider]:
    return [
        TransportProvider(name="loopback", create=LoopbackTransport, description="in-process, for unit tests")
    ]
