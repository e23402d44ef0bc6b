"""One-launch span copies (core/kernels.py) and the packer's CUDA path: the address math is
checked byte for byte on the CPU (memmove stands in for the kernel); the Triton kernel itself
runs only where CUDA and Triton are (skipped otherwise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cluster import kv_bytes

from kvpush.core import kernels, packing
from kvpush.core.errors import ConfigError
from kvpush.core.packing import Packer, StagingPool
from kvpush.core.types import ModelSpec, ParallelConfig
from kvpush.layouts.uniform import allocate_kv_caches, describe_uniform

GPU = pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")


def test_spans_are_validated_and_widened() -> None:
    with pytest.raises(ConfigError, match="equally long"):
        kernels.as_spans([0, 8], [16], 8)
    with pytest.raises(ConfigError, match="negative"):
        kernels.as_spans([0], [16], [-1])
    s, d, n = kernels.as_spans([0, 64], [128, 256], 32)
    assert n.tolist() == [32, 32]
    assert kernels.widest(s, d, n) == 8
    assert kernels.widest(s + 4, d, n) == 4
    assert kernels.widest(s, d, n + 2) == 2
    assert kernels.widest(s + 1, d, n) == 1


def test_long_spans_are_cut_into_pieces_covering_the_same_bytes() -> None:
    src = np.array([0, 10_000], dtype=np.int64)
    dst = np.array([50_000, 90_000], dtype=np.int64)
    lengths = np.array([2500, 700], dtype=np.int64)
    s, d, n = kernels.split_long(src, dst, lengths, piece=1000)
    assert n.tolist() == [1000, 1000, 500, 700]
    assert s.tolist() == [0, 1000, 2000, 10_000]
    assert d.tolist() == [50_000, 51_000, 52_000, 90_000]
    same = kernels.split_long(src, dst, lengths, piece=4096)
    assert all(a is b for a, b in zip(same, (src, dst, lengths)))


def test_cpu_reference_copies_every_span_exactly() -> None:
    rng = np.random.default_rng(0)
    source = torch.from_numpy(rng.integers(0, 255, 1 << 16, dtype=np.uint8))
    target = torch.zeros(1 << 16, dtype=torch.uint8)
    starts = rng.permutation(np.arange(0, 1 << 16, 512))[:40]
    lengths = rng.integers(1, 512, 40)
    dst_starts = np.arange(40) * 512
    copied = kernels.copy_spans_cpu(source.data_ptr() + starts, target.data_ptr() + dst_starts, lengths)
    assert copied == int(lengths.sum())
    for s, d, n in zip(starts, dst_starts, lengths):
        assert torch.equal(target[d : d + n], source[s : s + n])


class _MemmoveCopier:
    """Stands in for the CUDA copier: same call, bytes moved by memmove."""

    launches = 0

    def copy(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> int:
        type(self).launches += 1
        return kernels.copy_spans_cpu(src, dst, lengths)


def _caches(seed: int) -> tuple[dict, list, ModelSpec, ParallelConfig]:
    model = ModelSpec(name="k", num_layers=3, num_kv_heads=4, head_dim=8, block_size=4)
    par = ParallelConfig(tp_size=1, num_layers=3)
    caches = allocate_kv_caches(model, par, 32)
    gen = torch.Generator().manual_seed(seed)
    for tensor in caches.values():
        view = kv_bytes(tensor)
        view.copy_(torch.randint(-30_000, 30_000, view.shape, dtype=torch.int16, generator=gen))
    return caches, describe_uniform(caches, par, model), model, par


@pytest.mark.parametrize("part", [(0, 1), (1, 2), (3, 4)])
def test_one_launch_address_math_matches_index_ops(monkeypatch, part: tuple[int, int]) -> None:
    src, rs, model, par = _caches(1)
    dst = allocate_kv_caches(model, par, 32)
    rd = describe_uniform(dst, par, model)
    ids_p, ids_d = ((5, 1, 30, 17),), ((0, 31, 9, 2),)
    size = rs[0].block_len // part[1] * 4
    offsets = [i * size for i in range(len(rs))]
    want = StagingPool(1 << 16)
    Packer(rs).copy(want.tensor, offsets, rs, ids_p, part, gather=True)  # torch index ops

    _MemmoveCopier.launches = 0
    monkeypatch.setattr(packing, "rows_on_cuda", lambda _t: True)
    monkeypatch.setattr(kernels, "copier_for", lambda _device: _MemmoveCopier())
    got = StagingPool(1 << 16)
    assert Packer(rs).copy(got.tensor, offsets, rs, ids_p, part, gather=True) == size * len(rs)
    assert torch.equal(got.tensor, want.tensor)
    Packer(rd).copy(got.tensor, offsets, rd, ids_d, part, gather=False)
    assert _MemmoveCopier.launches == 2  # one launch for the gather, one for the scatter
    for name in src:
        s_rows, d_rows = src[name].view(torch.uint8).flatten(2), dst[name].view(torch.uint8).flatten(2)
        width = s_rows.shape[2] // part[1]  # byte slice ``part`` of every block
        cols = slice(part[0] * width, (part[0] + 1) * width)
        assert torch.equal(s_rows[:, list(ids_p[0]), cols], d_rows[:, list(ids_d[0]), cols]), (name, part)
        assert int(d_rows[:, :, :].count_nonzero()) == int(d_rows[:, list(ids_d[0]), cols].count_nonzero())


def test_one_launch_refuses_offsets_past_the_staging_tensor(monkeypatch) -> None:
    _, rs, _, _ = _caches(2)
    monkeypatch.setattr(packing, "rows_on_cuda", lambda _t: True)
    monkeypatch.setattr(kernels, "copier_for", lambda _device: _MemmoveCopier())
    small = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="past its 1024 bytes"):
        Packer(rs).copy(small, [i * 768 for i in range(len(rs))], rs, ((1, 2, 3),), (0, 1), gather=True)


@GPU
@pytest.mark.parametrize("shift", [0, 4, 2, 1])
def test_triton_copy_is_byte_exact(shift: int) -> None:
    rng = np.random.default_rng(shift)
    source = torch.randint(0, 255, (1 << 22,), dtype=torch.uint8, device="cuda")
    target = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    starts = rng.permutation(np.arange(0, (1 << 22) - 8192, 8192))[:300] + shift
    lengths = np.full(300, 4096 - (8 if shift else 0)) + (rng.integers(0, 2, 300) * 3 * bool(shift))
    dst_starts = np.arange(300) * 8192 + shift
    copier = kernels.copier_for("cuda")
    aligned = copier.aligned_launches
    copier.copy(source.data_ptr() + starts, target.data_ptr() + dst_starts, lengths, timed=True)
    assert copier.gpu_ms() is not None
    assert copier.aligned_launches == aligned + (shift == 0)  # 16-byte aligned, one length
    host_s, host_t = source.cpu(), target.cpu()
    for s, d, n in zip(starts, dst_starts, lengths):
        assert torch.equal(host_t[d : d + n], host_s[s : s + n])
    big = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")  # one span cut into pieces
    copier.copy([source.data_ptr()], [big.data_ptr()], 3 << 20)
    assert torch.equal(big, source[: 3 << 20])


@GPU
def test_cuda_packer_round_trip_equals_cpu() -> None:
    model = ModelSpec(name="k", num_layers=4, num_kv_heads=8, head_dim=128, block_size=16)
    par = ParallelConfig(tp_size=1, num_layers=4)
    src = allocate_kv_caches(model, par, 64, device="cuda")
    dst = allocate_kv_caches(model, par, 64, device="cuda")
    for tensor in src.values():
        kv_bytes(tensor).copy_(torch.randint(-30_000, 30_000, kv_bytes(tensor).shape, dtype=torch.int16))
    rs, rd = describe_uniform(src, par, model), describe_uniform(dst, par, model)
    ids_p, ids_d = ((5, 1, 60, 17, 33),), ((0, 63, 9, 2, 40),)
    pool = StagingPool(1 << 24, "cuda")
    size = rs[0].block_len * 5
    offsets = [i * size for i in range(len(rs))]
    Packer(rs).copy(pool.tensor, offsets, rs, ids_p, (0, 1), gather=True)
    Packer(rd).copy(pool.tensor, offsets, rd, ids_d, (0, 1), gather=False)
    for name in src:
        assert torch.equal(kv_bytes(src[name])[:, list(ids_p[0])], kv_bytes(dst[name])[:, list(ids_d[0])])


@GPU
def test_repeated_launches_skip_tritons_jit_entry_and_stay_byte_exact() -> None:
    """After the first launch of a specialisation, launches call the compiled kernel directly;
    span counts that specialise differently (1, multiples of 16, others) each stay exact."""
    source = torch.randint(0, 255, (1 << 22,), dtype=torch.uint8, device="cuda")
    copier = kernels.copier_for("cuda")
    before = copier.replays
    for count in (1, 16, 17, 300, 1, 16, 17, 300, 64):
        target = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
        starts = np.arange(count) * 8192
        copier.copy(source.data_ptr() + starts, target.data_ptr() + starts + 4096, 4096)
        for s in starts.tolist():
            assert torch.equal(target[s + 4096 : s + 8192], source[s : s + 4096]), count
    if kernels._REPLAY[0]:
        assert copier.replays > before


@GPU
def test_grid_launch_equals_the_indirect_launch_of_the_expanded_ids() -> None:
    """``launch_grid`` (region starts + block ids) copies exactly what ``launch_indirect``
    copies for the same ids expanded (region-major), into scattered blocks."""
    from kvpush.core.planning import IdGrid

    regions, blocks, size = 3, 32, 4096
    source = torch.randint(0, 255, (regions * blocks * size,), dtype=torch.uint8, device="cuda")
    addrs = source.data_ptr() + np.arange(regions * blocks) * size
    ltab = kernels.DeviceTable(addrs, np.full(len(addrs), size), "cuda")
    starts = (np.arange(regions, dtype=np.int32) * blocks)[:, None]
    lblocks, rblocks = np.array([3, 31, 0, 7], np.int32), np.array([30, 1, 12, 5], np.int32)
    copier = kernels.copier_for("cuda")
    outputs = []
    for grid in (True, False):
        target = torch.zeros_like(source)
        taddrs = target.data_ptr() + np.arange(regions * blocks) * size
        rtab = kernels.DeviceTable(taddrs, np.full(len(taddrs), size), "cuda")
        local, remote = IdGrid(starts, lblocks), IdGrid(starts, rblocks)
        if grid:
            event = copier.launch_grid(ltab, rtab, local, remote)
        else:
            event = copier.launch_indirect(ltab, rtab, local.ids(), remote.ids())
        event.synchronize()
        outputs.append(target)
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].any()
    for r in range(regions):
        for lb, rb in zip(lblocks.tolist(), rblocks.tolist()):
            got = outputs[0][(r * blocks + rb) * size : (r * blocks + rb + 1) * size]
            assert torch.equal(got, source[(r * blocks + lb) * size : (r * blocks + lb + 1) * size])


class _FakeRing:
    """An upload ring on host memory: records what each launch put in its slot."""

    def __init__(self) -> None:
        self.uploads: list[np.ndarray] = []
        self.view = np.zeros(1024, dtype=np.int32)

    def take(self, words: int, stream: object) -> tuple[np.ndarray, int]:
        return self.view, 0

    def upload(self, slot: int, words: int, stream: object) -> str:
        self.uploads.append(self.view[:words].copy())
        return "ids-on-device"


def _host_only_copier(monkeypatch) -> tuple[kernels.SpanCopier, list[tuple]]:
    """A ``SpanCopier`` whose device side is recorded instead of run (no CUDA, no Triton):
    what the host prepares for the indirect and grid launches is checked on the CPU."""
    copier = object.__new__(kernels.SpanCopier)
    launches: list[tuple] = []
    copier._ids, copier._timing, copier.stream, copier._handle = _FakeRing(), None, "stream", 0
    copier.launches = copier.aligned_launches = 0
    copier.host_seconds = [0.0, 0.0]
    copier._wait_for = lambda after: None
    copier._done = lambda timed: "event"
    copier._launch = lambda kernel, grid, args, constexprs, warps, stream: launches.append(
        (kernel, grid, args, constexprs, warps)
    )
    copier._driver = type("D", (), {"switch": lambda self, c: None, "restore": lambda self, p: None})()
    copier.context = 0
    monkeypatch.setattr(kernels, "_kernel", lambda: ("plain", "aligned", "indirect", "grid"))
    return copier, launches


def test_indirect_and_grid_launches_prepare_ids_grid_and_constants_on_the_host(monkeypatch) -> None:
    from kvpush.core.planning import IdGrid

    copier, launches = _host_only_copier(monkeypatch)
    table = type("T", (), {"length": 32768, "usable": True, "tensor": "table"})()
    assert copier.launch_indirect(table, table, [5, 9], [1, 2]) == "event"
    starts = np.array([[0], [64]], dtype=np.int32)
    grid = IdGrid(starts, np.array([3, 7, 11], dtype=np.int32))
    assert copier.launch_grid(table, table, grid, IdGrid(starts, np.array([1, 2, 4], np.int32))) == "event"
    constants = {"LEN": 4096, "BLOCK": 2048, "MASK": False}
    assert launches == [
        ("indirect", (2, 2), ("table", "table", "ids-on-device", 2), constants, 8),
        ("grid", (6, 2), ("table", "table", "ids-on-device", 3), constants, 8),
    ]
    indirect, factored = copier._ids.uploads
    assert indirect.tolist() == [5, 9, 1, 2]
    assert factored.tolist() == [0, 64, 0, 64, 3, 7, 11, 1, 2, 4]
    assert copier.launches == copier.aligned_launches == 2
    assert copier.launch_indirect(table, table, [], []) is None  # nothing to copy
    with pytest.raises(ConfigError, match="differ"):
        copier.launch_grid(table, table, grid, IdGrid(starts[:1], grid.blocks))
    with pytest.raises(ConfigError, match="differ"):
        copier.launch_indirect(table, table, [1], [1, 2])
