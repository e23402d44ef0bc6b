"""The NIXL transport posts a WRITE whose pieces are contiguous on both sides as runs.

NIXL walks every index of a prepared WRITE on the posting thread (~0.5 ms for 64 regions x 128
blocks on the H200 host, as long as the copy itself), so ``NixlTransport.post_write`` merges
pieces that continue each other on both sides into one descriptor per run and posts those
(``initialize_xfer``); scattered pieces, short WRITEs and lists NIXL refuses a merged WRITE
for go as prepared. Pure checks of :func:`merge_runs`, then real NIXL between two processes:
every byte lands where the pieces say and nowhere else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_nixl_transport import BLOCK, BLOCKS, Peer, _poll_until_settled

from kvpush.core.transport import TransferState, TransportConfig
from kvpush.transports.nixl import MERGE_MIN_DESCRIPTORS, merge_runs

torch = pytest.importorskip("torch")

PIECE = 64
PIECES = BLOCK * BLOCKS // PIECE
assert PIECES >= 2 * MERGE_MIN_DESCRIPTORS


def _pieces(base: int, ids: Any, device: int = 0) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.uint64)
    return np.column_stack(
        (base + ids * PIECE, np.full(len(ids), PIECE, np.uint64), np.full(len(ids), device, np.uint64))
    ).astype(np.uint64)


def _bytes(descs: np.ndarray) -> list[tuple[int, int]]:
    """Every byte address a descriptor list names, as (addr, device) in order."""
    return [(int(a) + i, int(d)) for a, n, d in descs for i in range(int(n))]


def test_contiguous_pieces_merge_into_runs_that_name_the_same_bytes() -> None:
    local = _pieces(1 << 20, range(0, 100))
    remote = _pieces(1 << 30, [*range(10, 60), *range(70, 120)])  # one break on D's side
    runs = merge_runs(local, remote)
    assert runs is not None
    assert len(runs[0]) == 2 and len(runs[1]) == 2
    assert _bytes(runs[0]) == _bytes(local) and _bytes(runs[1]) == _bytes(remote)


@pytest.mark.parametrize(
    "case",
    ["scattered", "device changes", "unequal lengths"],
)
def test_pieces_that_do_not_continue_each_other_are_not_merged(case: str) -> None:
    local = _pieces(1 << 20, range(100))
    remote = _pieces(1 << 30, range(100))
    if case == "scattered":
        remote = _pieces(1 << 30, np.random.default_rng(0).permutation(100))
        assert merge_runs(local, remote) is None
        return
    if case == "device changes":
        remote[1::2, 2] = 1  # every other piece on another device: no two join
        assert merge_runs(local, remote) is None
        return
    remote[5, 1] = PIECE // 2
    assert merge_runs(local, remote) is None


@pytest.fixture
def local() -> Any:
    from kvpush.transports.nixl import NixlTransport

    transport = NixlTransport(TransportConfig(agent_name="nixl-merge-local"))
    src = (torch.arange(BLOCK * BLOCKS, dtype=torch.int64) * 7 + 3).to(torch.uint8)
    transport.register_buffer(src.data_ptr(), src.numel(), "DRAM", 0)
    try:
        yield transport, src
    finally:
        transport.close()


def _write(transport: Any, src: Any, peer: Peer, local_ids: list[int], remote_ids: list[int]) -> np.ndarray:
    name = transport.load_peer(peer.blob)
    local_list = transport.prepare_local(_pieces(src.data_ptr(), range(PIECES)), "DRAM")
    remote_list = transport.prepare_remote(name, _pieces(peer.addr, range(PIECES)), "DRAM")
    handle = transport.post_write(
        local_list, np.array(local_ids, np.int32), remote_list, np.array(remote_ids, np.int32), b"DONE:m"
    )
    assert _poll_until_settled(transport, handle) is TransferState.DONE
    transport.release(handle)
    written = np.frombuffer(peer.call("read"), dtype=np.uint8).reshape(PIECES, PIECE)
    expected = np.zeros_like(written)
    source = src.numpy().reshape(PIECES, PIECE)
    for s, d in zip(local_ids, remote_ids):
        expected[d] = source[s]
    np.testing.assert_array_equal(written, expected)  # right bytes, nothing else touched
    return written


@pytest.mark.parametrize(
    ("local_ids", "remote_ids", "merged"),
    [
        (list(range(0, 96)), [*range(8, 40), *range(50, 114)], True),  # two runs
        (list(range(96)), list(np.random.default_rng(1).permutation(range(16, 112))), False),
        (list(range(MERGE_MIN_DESCRIPTORS - 1)), list(range(MERGE_MIN_DESCRIPTORS - 1)), False),
    ],
    ids=["runs", "scattered", "short"],
)
def test_writes_land_exactly_merged_or_not(
    local: Any, local_ids: list[int], remote_ids: list[int], merged: bool
) -> None:
    transport, src = local
    peer = Peer("nixl-merge-peer")
    try:
        _write(transport, src, peer, local_ids, [int(i) for i in remote_ids])
    finally:
        peer.stop()
    assert transport.counters.writes_posted == 1
    assert transport.counters.writes_merged == (1 if merged else 0)


def test_a_run_across_two_peer_registrations_goes_as_prepared(local: Any) -> None:
    """D's memory is two registrations that touch: a run across them is in neither, NIXL
    refuses it before anything is sent, and the WRITE goes from the prepared lists."""
    transport, src = local
    peer = Peer("nixl-merge-split", split=True)
    try:
        middle = PIECES // 2
        _write(transport, src, peer, list(range(100)), list(range(middle - 50, middle + 50)))
    finally:
        peer.stop()
    assert transport.counters.writes_posted == 1 and transport.counters.writes_merged == 0
    assert transport.counters.writes_failed == 0
