"""End-to-end push between two processes over real NIXL, beside raw NIXL and a plain copy.

For each shape (4 KiB and 32 KiB blocks; 16, 128 and 512 blocks; scattered and contiguous
block tables; 16 layers x K/V = 32 regions) and in this order within one run: ``raw_nixl``
(the same descriptors through a bare ``nixl_agent``), ``copy`` (one in-process
``index_select`` of the same bytes), then kvpush ``direct`` and ``packed`` (forced). Each
kvpush benchmark's ``extra_info`` carries its ratios to the raw and copy medians of the same
run, and what the built-in strategy rule picks. A round is one request, timed from its start
to D's acknowledgement over a pipe (see :mod:`kvpush.demo.bench`). Buffers are pre-touched,
no NIXL progress thread runs. Run::

    .venv/bin/pytest benchmarks/bench_push.py --benchmark-enable -p no:cacheprovider
"""

from __future__ import annotations

import itertools

import pytest

from kvpush.demo.bench import BLOCK_BYTES, BLOCK_COUNTS, PATTERNS, BenchPair, PairSpec, block_tables

LAYERS = 16
ROUNDS = 7
SMALL_ROUNDS = 25
"""Requests up to SMALL_BYTES take well under 10 ms; more rounds keep their medians steady
when another job takes a core for a scheduler slice."""
SMALL_BYTES = 16 << 20
MEDIANS: dict[tuple[int, int, str, str], float] = {}
"""(block bytes, blocks, pattern, method) -> median seconds, filled as the run goes."""


@pytest.fixture(scope="module", params=BLOCK_BYTES, ids=lambda b: f"{b // 1024}KiB")
def pair(request):
    size = request.param
    max_blocks = max(BLOCK_COUNTS)
    spec = PairSpec(
        block_bytes=size,
        layers=LAYERS,
        pool_blocks=2 * max_blocks,
        staging_bytes=2 * LAYERS * size * max_blocks + (1 << 20),
    )
    with BenchPair(spec) as bench_pair:
        yield bench_pair


CASES = list(itertools.product(BLOCK_COUNTS, PATTERNS, ["raw_nixl", "copy", "direct", "packed"]))


@pytest.mark.parametrize(("blocks", "pattern", "method"), CASES, ids=[f"{b}-{p}-{m}" for b, p, m in CASES])
def test_push(benchmark, pair, blocks, pattern, method):
    p_ids, d_ids = block_tables(blocks, pair.spec.pool_blocks, pattern, seed=0)
    if method != "copy":
        pair.verify(method, p_ids, d_ids)  # bytes checked; doubles as the warm-up round
    holder = {}

    def setup():
        holder["run"] = pair.prepare(method, p_ids, d_ids)
        return (), {}

    def run():
        holder["run"]()

    from kvpush.demo.bench import foreign_cores, snapshot

    since = snapshot(pair.pids)
    rounds = SMALL_ROUNDS if pair.request_bytes(blocks) <= SMALL_BYTES else ROUNDS
    benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1)
    pair.settle()
    load = foreign_cores(since, pair.pids)
    median = benchmark.stats.stats.median
    key = (pair.spec.block_bytes, blocks, pattern)
    MEDIANS[(*key, method)] = median
    nbytes = pair.request_bytes(blocks)
    info = {
        "block_bytes": pair.spec.block_bytes,
        "blocks": blocks,
        "pattern": pattern,
        "bytes": nbytes,
        "descriptors": blocks * len(pair.regions),
        "gbps": nbytes / median / 1e9,
        "foreign_cores": round(load, 2),
        "default_strategy": pair.strategy_for(p_ids, d_ids),
    }
    for other in ("raw_nixl", "copy", "direct"):
        if other != method and (*key, other) in MEDIANS:
            info[f"vs_{other}"] = round(MEDIANS[(*key, other)] / median, 3)
    benchmark.extra_info.update(info)
