"""Shared helpers of the benchmark suite (not collected: the name starts with an underscore)."""

from __future__ import annotations

import os
import time


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields), idle


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ForeignLoad:
    """CPU cores busy with *other* processes while a block ran (from /proc/stat).

    ``with ForeignLoad() as load: ...`` then ``load.cores``. Children of this process count as
    ours only once reaped, so the figure over-counts live helper processes: read it as an
    upper bound when a benchmark spawns one.
    """

    def __enter__(self) -> ForeignLoad:
        self._total, self._idle = _cpu_times()
        self._own = _own_cpu()
        self._wall = time.monotonic()
        self.cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        total, idle = _cpu_times()
        wall = time.monotonic() - self._wall
        hz = os.sysconf("SC_CLK_TCK")
        busy = ((total - self._total) - (idle - self._idle)) / hz
        own = _own_cpu() - self._own
        self.cores = max(0.0, (busy - own) / wall) if wall > 0 else 0.0
