"""Which peer the cuda_ipc transport treats as "this process", and what an opened IPC handle
must map before a kernel writes through it.

A peer in this very process is written at its own addresses (no handle opened). Deciding that
by pid alone wrote into P's own address space when P and D ran in two containers of one host
(host networking: same hostname and boot id) with their own PID namespaces and the same pid:
P's kernel then copied P's blocks to D's addresses *in P's memory* (P's own cache when the two
engines' allocations sit at the same virtual addresses, as identical engines' do) and D was
told DONE with nothing written. The peer's allocation sizes were taken on its word too.

On the CPU the decision is driven with a stand-in for the CUDA driver (pure logic); on a GPU a
D in another process whose metadata states P's pid is written through opened handles, byte for
byte (P and D stand in for the two containers: the same pid is all the old check looked at).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import numpy as np
import pytest
import torch

from kvpush.core import kernels
from kvpush.core.errors import TransferError
from kvpush.core.transport import TransportConfig
from kvpush.transports import cuda_ipc
from kvpush.transports.cuda_ipc import CudaIpcTransport, decode_blob, encode_blob

HANDLE = "ab" * 64


class StandInDriver:
    """The two driver calls ``_open`` makes, answered from a table (pure logic tests only)."""

    def __init__(self, mapped_size: int | None = None) -> None:
        self.mapped_size = mapped_size
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.sizes: dict[int, int] = {}

    def bind(self, device: int) -> None:
        pass

    def open(self, handle: bytes) -> int:
        ptr = 0x7000_0000 + 0x100_0000 * len(self.opened)
        self.opened.append(ptr)
        return ptr

    def allocation(self, addr: int) -> tuple[int, int]:
        return addr, self.sizes.get(addr, self.mapped_size or 0)

    def close(self, ptr: int) -> None:
        self.closed.append(ptr)


def transport(driver: StandInDriver | None = None, name: str = "P") -> CudaIpcTransport:
    t = CudaIpcTransport(
        TransportConfig(agent_name=f"{name}-{os.urandom(3).hex()}", options={"inner": "loopback"})
    )
    t._spans = [(4096, 4096, 0)]  # as if VRAM were registered
    if driver is not None:
        t._driver = driver  # type: ignore[assignment]
    return t


def info(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "host": "h/b",
        "pid": os.getpid(),
        "process": "another-process",
        "allocations": [{"base": 0x5000_0000, "size": 1 << 20, "handle": HANDLE, "device": "u"}],
    }
    out.update(fields)
    return out


def test_a_peer_stating_this_pid_from_another_process_is_opened_through_its_handles() -> None:
    driver = StandInDriver(mapped_size=1 << 20)
    p = transport(driver)
    try:
        peer = p._open("D-0", info())  # the pid is ours, the process id is not: another process
        assert driver.opened == [0x7000_0000], "P must open D's handle, not use D's addresses as its own"
        assert peer.mapped.tolist() == [0x7000_0000] and peer.opened == [0x7000_0000]
        out = peer.translate(np.array([0x5000_0000 + 4096], dtype=np.uint64), np.array([4096]))
        assert out.tolist() == [0x7000_0000 + 4096]
    finally:
        p._spans = []
        p.close()


def test_a_handle_mapping_fewer_bytes_than_claimed_is_refused_and_closed() -> None:
    driver = StandInDriver(mapped_size=4096)  # the handle maps 4 KiB, the peer claims 1 MiB
    p = transport(driver)
    try:
        with pytest.raises(TransferError, match=r"claims 1048576 bytes .* maps 4096 bytes"):
            p._open("D-0", info())
        assert driver.closed == driver.opened == [0x7000_0000]
    finally:
        p._spans = []
        p.close()


def test_only_a_live_agent_of_this_process_is_written_at_its_own_addresses() -> None:
    driver = StandInDriver(mapped_size=1 << 20)
    p = transport(driver)
    d = transport(name="D")
    try:
        here = cuda_ipc._PROCESS[0]
        # This process's id but no agent of it under that name: refused, nothing opened.
        with pytest.raises(TransferError, match="states this process's id"):
            p._open("nobody", info(process=here))
        # The name of a live agent here, but allocations it does not export: refused.
        d._exports = [{"base": 0x6000_0000, "size": 4096, "handle": HANDLE, "device": "u"}]
        with pytest.raises(TransferError, match="states this process's id"):
            p._open(d.agent_name, info(process=here))
        # The live agent's own allocations: its addresses are ours, no handle opened.
        d._exports = [{"base": 0x5000_0000, "size": 1 << 20, "handle": HANDLE, "device": "u"}]
        peer = p._open(d.agent_name, info(process=here))
        assert peer.opened == [] and peer.mapped.tolist() == [0x5000_0000]
        assert driver.opened == []
    finally:
        p._spans = []
        p.close()
        d.close()


def test_the_process_id_is_published_and_renewed_in_a_forked_child() -> None:
    p = transport()
    p._spans = []  # nothing to export (no CUDA here)
    try:
        _, published = decode_blob(p.metadata())
        assert published is not None and published["process"] == cuda_ipc._PROCESS[0]
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover (the child)
            os.write(writer, cuda_ipc._PROCESS[0].encode())
            os._exit(0)
        os.close(writer)
        got = os.read(reader, 64).decode()
        os.close(reader)
        os.waitpid(child, 0)
        assert got and got != cuda_ipc._PROCESS[0]
    finally:
        p._spans = []
        p.close()


@pytest.mark.parametrize(
    "allocations, match",
    [
        ([{"base": 4096, "size": 1}], "malformed"),
        ([{"base": 4096, "size": 8, "handle": "zz"}], "malformed"),
        ([{"base": "4096", "size": 8, "handle": HANDLE}], "out of range"),
        ([{"base": 4096, "size": -8, "handle": HANDLE}], "out of range"),
        ([{"base": 4096, "size": 8, "handle": "ab"}], "out of range"),
        (
            [{"base": 4096, "size": 8192, "handle": HANDLE}, {"base": 8192, "size": 8, "handle": HANDLE}],
            "overlap",
        ),
    ],
)
def test_malformed_peer_allocations_are_refused(allocations: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(TransferError, match=match):
        cuda_ipc._allocations({"allocations": allocations})


def test_a_metadata_header_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(TransferError, match="not a JSON object"):
        decode_blob(encode_blob(b"inner", [1, 2]))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ on a GPU

BLOCK, BLOCKS = 4096, 16


def _pattern() -> torch.Tensor:
    return torch.arange(BLOCKS * BLOCK, dtype=torch.int64).remainder(251).to(torch.uint8)


def _descriptors(base: int) -> np.ndarray:
    return np.array([(base + b * BLOCK, BLOCK, 0) for b in range(BLOCKS)], dtype=np.uint64)


def _region(tensor: torch.Tensor) -> Any:
    from kvpush.core.types import KVRegion

    return KVRegion(
        base_addr=tensor.data_ptr(),
        block_len=BLOCK,
        block_stride=BLOCK,
        num_blocks=BLOCKS,
        mem_type="VRAM",
        device_id=tensor.device.index or 0,
        layer_names=("layers.0",),
    )


def _d_process(conn: Any) -> None:
    """D: a CUDA allocation behind a cuda_ipc agent; sends its metadata and base address, then
    says whether blocks 3 and 7 hold P's blocks 5 and 9 and how many bytes of block 0 changed."""
    d = CudaIpcTransport(TransportConfig(agent_name="D-identity", options={"inner": "nixl", "mode": "ipc"}))
    dst = torch.zeros(BLOCKS * BLOCK, dtype=torch.uint8, device="cuda")
    d.register_regions([_region(dst)])
    conn.send((d.metadata(), dst.data_ptr()))
    conn.recv()  # P's copy finished
    torch.cuda.synchronize()
    want = _pattern().cuda()
    ok = torch.equal(dst[3 * BLOCK : 4 * BLOCK], want[5 * BLOCK : 6 * BLOCK]) and torch.equal(
        dst[7 * BLOCK : 8 * BLOCK], want[9 * BLOCK : 10 * BLOCK]
    )
    conn.send((ok, int(dst[:BLOCK].count_nonzero())))
    conn.recv()
    d.close()


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
def test_a_d_in_another_process_with_ps_pid_is_written_through_its_handles() -> None:
    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    child = ctx.Process(target=_d_process, args=(child_conn,), daemon=True)
    child.start()
    p = CudaIpcTransport(TransportConfig(agent_name="P-identity", options={"inner": "nixl", "mode": "ipc"}))
    src = _pattern().cuda()
    handle = None
    try:
        p.register_regions([_region(src)])
        assert parent.poll(120), "D did not start within 120 s"
        blob, d_base = parent.recv()
        inner, published = decode_blob(blob)
        assert published is not None and published["pid"] != os.getpid()
        published["pid"] = os.getpid()  # two containers, one pid: all the old check compared
        name = p.load_peer(encode_blob(inner, published))
        assert p._peers[name].opened, "D is another process: its handles must be opened"
        local = p.prepare_local(_descriptors(src.data_ptr()), "VRAM")
        remote = p.prepare_remote(name, _descriptors(d_base), "VRAM")
        handle = p.post_write(local, np.array([5, 9]), remote, np.array([3, 7]), b"DONE")
        handle.event.synchronize()
        assert torch.equal(src, _pattern().cuda()), "P's own memory changed"
        parent.send("copied")
        assert parent.poll(60), "D did not answer within 60 s"
        ok, block0_changed = parent.recv()
        assert ok, "D's blocks 3 and 7 do not hold P's blocks 5 and 9"
        assert block0_changed == 0
        parent.send("bye")
    finally:
        if handle is not None:
            p.release(handle)
        p.close()
        child.join(30)
        if child.is_alive():
            child.kill()
