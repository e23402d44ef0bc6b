"""A heap of deadlines with lazy invalidation: popping costs O(expired), not O(tracked)."""

from __future__ import annotations

import heapq
import itertools
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
