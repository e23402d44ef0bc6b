"""Bounded bookkeeping for the protocol cores: a heap of deadlines (popping costs O(expired),
not O(tracked)), a bounded memory of recent ids, and a warning rate limit."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Hashable


class Deadlines:
    """``(when, key)`` entries; re-arming a key supersedes its earlier entry."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._armed: dict[Hashable, tuple[float, int]] = {}
        self._seq = itertools.count()

    def arm(self, key: Hashable, when: float) -> None:
        """Fire ``key`` at ``when`` (replacing any earlier arming of it)."""
        token = (when, next(self._seq))
        self._armed[key] = token
        heapq.heappush(self._heap, (when, token[1], key))

    def disarm(self, key: Hashable) -> None:
        self._armed.pop(key, None)

    def when(self, key: Hashable) -> float | None:
        token = self._armed.get(key)
        return None if token is None else token[0]

    def pop_expired(self, now: float) -> list[Hashable]:
        """Every key whose live arming is at or before ``now``, earliest first (each once)."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, seq, key = heapq.heappop(heap)
            if self._armed.get(key) == (when, seq):
                del self._armed[key]
                out.append(key)
        self._compact()
        return out

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and self._armed.get(heap[0][2]) != (heap[0][0], heap[0][1]):
            heapq.heappop(heap)  # superseded or disarmed
        return heap[0][0] if heap else None

    def _compact(self) -> None:
        # Disarmed entries that are not due yet would pile up under churn; rebuild when mostly dead.
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._armed):
            self._heap = [(w, s, k) for k, (w, s) in self._armed.items()]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._armed)


class RecentIds:
    """The last ``size`` ids added (a set with first-in-first-out eviction)."""

    def __init__(self, size: int) -> None:
        self._order: deque[Hashable] = deque()
        self._ids: set[Hashable] = set()
        self._size = size

    def add(self, item: Hashable) -> None:
        if item in self._ids:
            return
        self._ids.add(item)
        self._order.append(item)
        if len(self._order) > self._size:
            self._ids.discard(self._order.popleft())

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class RateLimit:
    """At most ``per_s`` events a second (a token bucket); for warnings a peer could flood."""

    def __init__(self, per_s: float) -> None:
        self._per_s = per_s
        self._tokens = per_s
        self._last = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._per_s, self._tokens + (now - self._last) * self._per_s)
        self._last = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
