"""The cuda_ipc transport: options, its metadata wrapping, the fall-back to the wrapped
transport (host memory, other hosts, peers without cuda_ipc), address translation, and peer
incarnations, on the CPU; the same-process IPC kernel copy where CUDA and Triton are."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvpush.core import kernels
from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.planning import IdGrid
from kvpush.core.transport import TransferState, TransportConfig
from kvpush.core.types import KVRegion, PushJob, ReadSpec
from kvpush.transports import cuda_ipc
from kvpush.transports.cuda_ipc import CudaIpcTransport, decode_blob, encode_blob

_NAMES = itertools.count()


def make(mode: str = "auto", **options: object) -> CudaIpcTransport:
    name = f"ipc-{next(_NAMES)}"
    return CudaIpcTransport(
        TransportConfig(agent_name=name, options={"inner": "loopback", "mode": mode, **options})
    )


def region(tensor: torch.Tensor, blocks: int, mem: str = "DRAM") -> KVRegion:
    block = tensor.numel() // blocks
    return KVRegion(
        base_addr=tensor.data_ptr(),
        block_len=block,
        block_stride=block,
        num_blocks=blocks,
        mem_type=mem,  # type: ignore[arg-type]
        device_id=tensor.device.index or 0,
        layer_names=("layers.0",),
    )


def descs(reg: KVRegion) -> np.ndarray:
    return np.array(
        [(reg.base_addr + b * reg.block_stride, reg.block_len, reg.device_id) for b in range(reg.num_blocks)],
        dtype=np.uint64,
    )


def test_registered_and_options_checked() -> None:
    assert "cuda_ipc" in get_plugin_manager(load_entrypoints=False).transports()
    with pytest.raises(ConfigError, match="unknown cuda_ipc transport options"):
        make(bogus=1)
    with pytest.raises(ConfigError, match="'mode' must be one of"):
        make("always")
    with pytest.raises(ConfigError, match="cannot wrap itself"):
        make(inner="cuda_ipc")
    with pytest.raises(ConfigError, match="'inner_options' must be a dict"):
        make(inner_options=[1])


def test_metadata_wraps_the_inner_bytes() -> None:
    blob = encode_blob(b"inner-bytes", {"host": "h", "pid": 7, "allocations": []})
    assert decode_blob(blob) == (b"inner-bytes", {"host": "h", "pid": 7, "allocations": []})
    assert decode_blob(b"plain nixl bytes") == (b"plain nixl bytes", None)
    with pytest.raises(TransferError, match="truncated"):
        decode_blob(blob[:12])
    transport = make()
    try:
        inner, info = decode_blob(transport.metadata())
        assert inner == transport.inner.metadata()
        assert info is not None and info["host"] == cuda_ipc.host_identity() and info["allocations"] == []
    finally:
        transport.close()


def test_host_memory_goes_over_the_inner_transport() -> None:
    p, d = make(), make()
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    rs, rd = region(src, 16), region(dst, 16)
    try:
        p.register_regions([rs])
        d.register_regions([rd])
        name = p.load_peer(d.metadata())
        assert name == d.agent_name and not p.ipc_peer(name) and not p.all_peers_ipc
        local, remote = p.prepare_local(descs(rs), "DRAM"), p.prepare_remote(name, descs(rd), "DRAM")
        handle = p.post_write(local, np.array([3, 9]), remote, np.array([0, 15]), b"DONE:x")
        assert p.abortable(handle), "a WRITE of the wrapped transport can be taken back"
        assert p.poll(handle) is TransferState.DONE
        p.release(handle)
        block = rs.block_len
        assert torch.equal(dst[:block], src[3 * block : 4 * block])
        assert torch.equal(dst[15 * block :], src[9 * block : 10 * block])
        assert d.drain_notifs() == [(p.agent_name, b"DONE:x")]
        assert p.counters.writes_posted == 1 and p.ipc_writes == 0
        job = PushJob(local=_meta(p, rs), decode_tp_size=1, local_block_ids=[[1]], remote_block_ids=[[1]])
        spec = ReadSpec(dst_tp_rank=0, local_block_ids=[[1]], remote_block_ids=[[1]])
        assert cuda_ipc.kvpush_transfer_strategy(job=job, spec=spec, num_descriptors=1) is None
    finally:
        p.close()
        d.close()


def test_what_a_fence_can_stop_is_published_and_checked() -> None:
    """With IPC on, P publishes that its WRITEs may be kernel copies no fence stops; a D that
    loaded it can still tell when it cannot copy in: no device allocations (host memory)."""
    assert make("nixl").writes_abortable and not make("auto").writes_abortable
    p, d = make(), make()
    try:
        p.register_regions([region(torch.zeros(1024, dtype=torch.uint8), 4)])
        name = d.load_peer(p.metadata())
        assert not d.may_copy_in(name) and not d.may_copy_in("never-loaded")
    finally:
        p.close()
        d.close()


def _meta(transport: CudaIpcTransport, reg: KVRegion) -> object:
    class Meta:
        agent_name = transport.agent_name
        regions = (reg,)

    return Meta()


def test_mode_ipc_refuses_host_memory_and_unreachable_peers() -> None:
    forced = make("ipc")
    try:
        with pytest.raises(ConfigError, match="needs KV caches in VRAM"):
            forced.register_regions([region(torch.zeros(1024, dtype=torch.uint8), 4)])
        other = make("nixl")
        try:
            with pytest.raises(TransferError, match="cannot reach peer"):
                forced.load_peer(other.metadata())
        finally:
            other.close()
    finally:
        forced.close()


def test_peer_on_another_host_is_unreachable(monkeypatch) -> None:
    transport = make()
    transport._spans = [(4096, 4096, 0)]  # as if VRAM were registered
    try:
        info = {"host": "elsewhere/boot", "pid": 1, "allocations": [{"base": 0, "size": 1, "device": "u"}]}
        assert transport._unreachable(info) == "the peer is on another host"
        assert transport._unreachable(None) == "the peer does not run the cuda_ipc transport"
        transport.use_ipc = False
        transport.mode = "nixl"
        assert transport._unreachable(info) == "mode 'nixl'"
    finally:
        transport._spans = []
        transport.close()


def test_translation_maps_into_opened_allocations() -> None:
    peer = cuda_ipc._Peer(
        pid=1,
        bases=np.array([1000, 5000], dtype=np.int64),
        sizes=np.array([1000, 500], dtype=np.int64),
        mapped=np.array([70_000, 90_000], dtype=np.int64),
        opened=[],
    )
    out = peer.translate(np.array([1000, 1500, 5100], dtype=np.uint64), np.array([100, 500, 400]))
    assert out.tolist() == [70_000, 70_500, 90_100]
    with pytest.raises(TransferError, match="outside the allocations"):
        peer.translate(np.array([1900], dtype=np.uint64), np.array([200]))
    with pytest.raises(TransferError, match="outside the allocations"):
        peer.translate(np.array([10], dtype=np.uint64), np.array([1]))


def test_reloading_a_restarted_peer_drops_its_old_lists() -> None:
    p, d = make(), make()
    dst = torch.zeros(1024, dtype=torch.uint8)
    try:
        name = p.load_peer(d.metadata())
        remote = p.prepare_remote(name, descs(region(dst, 4)), "DRAM")
        assert p.load_peer(d.metadata()) == name and remote in p._lists  # same incarnation: kept
        restarted = encode_blob(d.inner.metadata(), {"host": "h", "pid": 99, "allocations": [], "n": 2})
        assert p.load_peer(restarted) == name
        assert remote not in p._lists
        p.remove_peer(name)
        assert not p._blobs and p.counters.peers_removed == 1
    finally:
        p.close()
        d.close()


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
def test_same_process_ipc_copies_scattered_blocks_with_one_kernel() -> None:
    p, d = make("ipc"), make("ipc")
    src = torch.randint(0, 255, (64 * 4096,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    rs, rd = region(src, 64, "VRAM"), region(dst, 64, "VRAM")
    try:
        p.register_regions([rs])
        d.register_regions([rd])
        name = p.load_peer(d.metadata())
        assert p.ipc_peer(name) and p.all_peers_ipc
        local, remote = p.prepare_local(descs(rs), "VRAM"), p.prepare_remote(name, descs(rd), "VRAM")
        lids, rids = np.array([5, 60, 2, 33]), np.array([0, 7, 63, 20])
        handle = p.post_write(local, lids, remote, rids, b"DONE:y")
        assert not p.abortable(handle), "a launched kernel copy cannot be taken back"
        assert d.may_copy_in(d.load_peer(p.metadata())), "P's device memory: it may copy in"
        for _ in range(10_000):
            if p.poll(handle) is TransferState.DONE:
                break
        assert p.poll(handle) is TransferState.DONE
        p.release(handle)
        for li, ri in zip(lids, rids):
            assert torch.equal(dst[ri * 4096 : (ri + 1) * 4096], src[li * 4096 : (li + 1) * 4096])
        assert d.drain_notifs() == [(p.agent_name, b"DONE:y")]
        assert p.ipc_writes == 1 and p.outstanding_handles == 0
    finally:
        p.close()
        d.close()


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
def test_factored_ids_copy_every_region_with_one_kernel_and_are_range_checked() -> None:
    """``post_write_grid``: region starts and block ids (an ``IdGrid``) instead of their
    product; the kernel lands block b of every region, and an id past a list is refused."""
    p, d = make("ipc"), make("ipc")
    srcs = [torch.randint(0, 255, (64 * 4096,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    dsts = [torch.zeros_like(t) for t in srcs]
    rs = [region(t, 64, "VRAM") for t in srcs]
    rd = [region(t, 64, "VRAM") for t in dsts]
    try:
        p.register_regions(rs)
        d.register_regions(rd)
        name = p.load_peer(d.metadata())
        local = p.prepare_local(np.concatenate([descs(r) for r in rs]), "VRAM")
        remote = p.prepare_remote(name, np.concatenate([descs(r) for r in rd]), "VRAM")
        starts = np.array([[0], [64]], dtype=np.int32)
        lblocks, rblocks = np.array([5, 60, 2, 33], np.int32), np.array([0, 7, 63, 20], np.int32)
        handle = p.post_write_grid(local, IdGrid(starts, lblocks), remote, IdGrid(starts, rblocks), b"DONE:g")
        for _ in range(10_000):
            if p.poll(handle) is TransferState.DONE:
                break
        assert p.poll(handle) is TransferState.DONE
        p.release(handle)
        for src, dst in zip(srcs, dsts):
            for li, ri in zip(lblocks.tolist(), rblocks.tolist()):
                assert torch.equal(dst[ri * 4096 : (ri + 1) * 4096], src[li * 4096 : (li + 1) * 4096])
        assert d.drain_notifs() == [(p.agent_name, b"DONE:g")] and p.ipc_writes == 1
        past = IdGrid(starts, np.array([5, 64], np.int32))  # region 1's block 64 is past the list
        with pytest.raises(TransferError, match="outside its prepared list"):
            p.post_write_grid(local, IdGrid(starts, lblocks[:2]), remote, past, b"x")
        with pytest.raises(TransferError):  # shapes differ: expanded, and the counts differ
            p.post_write_grid(local, IdGrid(starts, lblocks), remote, IdGrid(starts, rblocks[:3]), b"x")
        assert p.ipc_writes == 1 and p.outstanding_handles == 0
    finally:
        p.close()
        d.close()


def test_host_memory_pair_over_real_nixl_falls_back_and_verifies() -> None:
    """P and D as two processes with transport cuda_ipc on host memory: every WRITE goes over the
    wrapped NIXL (no IPC on DRAM), metadata wraps and unwraps across processes, bytes verified."""
    from kvpush.demo import serve

    w = serve.Workload(
        preset="llama3-8b",
        layers=2,
        median_tokens=32,
        max_tokens=64,
        requests=6,
        verify_every=1,
        transport="cuda_ipc",
    )
    result = serve.run(w, [50.0], sweep=False, p99_factor=2.0, ideal=False, say=lambda _m: None)
    summary = result["runs"][0]["kvpush"]
    assert summary["completed"] == 6 and summary["verified"] == 6 and summary["verify_failed"] == 0
    assert result["strategy_mix"]["ipc_writes"] == 0
