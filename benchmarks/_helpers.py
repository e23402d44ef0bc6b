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


def machine_id() -> str:
    """pytest-benchmark's storage folder for this interpreter (e.g. ``Linux-CPython-3.11-64bit``)."""
    import platform

    version = ".".join(platform.python_version_tuple()[:2])
    bits = platform.architecture()[0]
    return f"{platform.system()}-{platform.python_implementation()}-{version}-{bits}"


def baseline_names(storage: str, number: str) -> tuple[str, set[str]]:
    """The baseline file ``storage/<machine id>/<number>_*.json`` and its benchmark full names."""
    import glob
    import json

    folder = os.path.join(storage, machine_id())
    found = sorted(glob.glob(os.path.join(folder, f"{number}_*.json")))
    if not found:
        raise SystemExit(
            f"no baseline {number!r} in {folder}: this machine needs its own baseline "
            f"(`make bench-baseline`, then BENCH_BASELINE=<its number>)"
        )
    with open(found[0]) as f:
        return found[0], {bench["fullname"] for bench in json.load(f)["benchmarks"]}


def collected_names(files: list[str]) -> set[str]:
    """Node ids of the benchmarks pytest collects from ``files``."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise SystemExit(f"collecting {files} failed:\n{out.stdout}\n{out.stderr}")
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def check_names(argv: list[str]) -> int:
    """``_helpers.py STORAGE NUMBER FILE...``: exit 1 when a benchmark of FILE... has no entry in
    the baseline (it would go ungated) or the baseline names one that no longer exists."""
    storage, number, files = argv[0], argv[1], argv[2:]
    path, saved = baseline_names(storage, number)
    collected = collected_names(files)
    missing, stale = sorted(collected - saved), sorted(saved - collected)
    for name in missing:
        print(f"not in the baseline (would go ungated): {name}")
    for name in stale:
        print(f"in the baseline but no longer collected: {name}")
    if missing or stale:
        print(
            f"{path} does not match the benchmarks of {' '.join(files)}: save a new baseline "
            f"(`make bench-baseline`) and point BENCH_BASELINE at it"
        )
        return 1
    print(f"{len(collected)} benchmarks, all in {path}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(check_names(sys.argv[1:]))
