"""Transport probes of the cuda_ipc transport: values out of range in a peer's metadata and
descriptors, and a kernel copy whose peer was removed (restarted) while it ran.

1. Address translation (``_Peer.translate``) checked ``addr + len <= base + size`` in int64: a
   descriptor whose end passes 2**63 wrapped negative and was translated, so the kernel wrote
   past the opened mapping; a length of 2**63 or more (negative as int64) passed too. The
   peer's allocation entries were bounded only below: a base or end past 2**63 raised
   ``OverflowError`` from numpy (not ``TransferError``, so ``auto`` did not fall back).
   Pure logic (numpy and a stand-in for the CUDA driver): no GPU here.
2. A copy posted to a peer that P then removed and loaded again under the same agent name (a D
   restarted under the same engine id) sent its DONE, when the copy ended, to whatever agent held
   the name then: the *new* process, which never registered those blocks, was told the old
   request was written. Real NIXL between processes carries the notifications; only the GPU
   copy's completion event is a stand-in.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpush.core.errors import TransferError
from kvpush.core.transport import TransferState, TransportConfig
from kvpush.transports import cuda_ipc
from kvpush.transports.cuda_ipc import CudaIpcTransport

sys.path.insert(0, str(Path(__file__).parent))
from test_nixl_transport import Peer

HANDLE = "ab" * 64
WAIT_S = 30.0
TOP = 1 << 63


def _peer(base: int, size: int) -> cuda_ipc._Peer:
    return cuda_ipc._Peer(
        pid=1,
        bases=np.array([base], dtype=np.int64),
        sizes=np.array([size], dtype=np.int64),
        mapped=np.array([0x7000_0000], dtype=np.int64),
        opened=[],
    )


# ------------------------------------------------------------------------------ 1. bounds


def test_a_descriptor_whose_end_wraps_past_2_63_is_refused() -> None:
    """An allocation ending just below 2**63 and a descriptor starting in it whose end passes
    2**63: in int64 the end wrapped negative and the check passed, so 2 KiB past the mapping
    would be written."""
    peer = _peer(TOP - 8192, 8191)
    with pytest.raises(TransferError, match="outside"):
        peer.translate(np.array([TOP - 2048], dtype=np.uint64), np.array([4096], dtype=np.int64))


def test_a_negative_or_huge_descriptor_length_is_refused() -> None:
    peer = _peer(4096, 4096)
    # prepare_remote reads lengths as int64: 2**64 - 1 arrives as -1
    huge = np.array([2**64 - 1], dtype=np.uint64).astype(np.int64)
    with pytest.raises(TransferError, match="outside"):
        peer.translate(np.array([4096], dtype=np.uint64), huge)
    with pytest.raises(TransferError, match="outside"):
        peer.translate(np.array([4096], dtype=np.uint64), np.array([-4096], dtype=np.int64))


def test_zero_length_and_exact_fit_descriptors_still_translate() -> None:
    peer = _peer(4096, 4096)
    out = peer.translate(
        np.array([4096, 8192, 4096], dtype=np.uint64), np.array([4096, 0, 0], dtype=np.int64)
    )
    assert out.tolist() == [0x7000_0000, 0x7000_0000 + 4096, 0x7000_0000]
    with pytest.raises(TransferError, match="outside"):  # one byte past the end
        peer.translate(np.array([8192], dtype=np.uint64), np.array([1], dtype=np.int64))


@pytest.mark.parametrize(
    "base, size",
    [
        (2**64 - 4096, 4096),  # past int64: numpy raised OverflowError
        (TOP - 4096, 8192),  # its end past 2**63
        (4096, TOP),
        (TOP, 4096),
    ],
)
def test_allocations_past_2_63_are_refused_as_a_transfer_error(base: int, size: int) -> None:
    with pytest.raises(TransferError, match="out of range"):
        cuda_ipc._allocations({"allocations": [{"base": base, "size": size, "handle": HANDLE}]})


def test_malformed_allocation_lists_make_the_peer_unreachable_not_crash(monkeypatch: Any) -> None:
    """``_unreachable`` read ``alloc['device']`` of an entry that is not a map (TypeError) and
    iterated a map's keys; it must name the problem (``auto`` then falls back)."""
    monkeypatch.setattr(cuda_ipc, "device_uuids", lambda: ["u"])
    monkeypatch.setattr(cuda_ipc, "host_identity", lambda: "h/b")
    t = CudaIpcTransport(
        TransportConfig(agent_name=f"P-{os.urandom(3).hex()}", options={"inner": "loopback"})
    )
    t._spans = [(4096, 4096, 0)]
    t._driver = type("Reach", (), {"can_access": lambda self, a, b: True})()  # type: ignore[assignment]
    try:
        for allocations in ([[1, 2]], ["u"], {"device": "u"}, [None]):
            reason = t._unreachable({"host": "h/b", "allocations": allocations})
            assert isinstance(reason, str) and reason, allocations
    finally:
        t._spans = []
        t.close()


# ------------------------------------------------------------------------------ 2. a reloaded peer


class StandInEvent:
    """A GPU copy's completion event (no GPU here): pending until synchronized or set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _notifs_until(peer: Peer, marker: bytes) -> list[bytes]:
    """Every notification ``peer`` got up to and including ``marker`` (bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = [m for _, m in peer.call("notifs")]
        if marker in got:
            return got
        time.sleep(0.01)
    raise TimeoutError(f"{marker!r} never reached {peer.name}")


def test_a_copy_to_a_peer_reloaded_under_its_name_never_notifies_the_new_process() -> None:
    pytest.importorskip("nixl._api")
    name = f"D-{os.urandom(3).hex()}"
    p = CudaIpcTransport(TransportConfig(agent_name=f"P-{os.urandom(3).hex()}", options={"inner": "nixl"}))
    d1 = Peer(name)
    d2 = None
    try:
        assert p.load_peer(d1.blob) == name
        p.send_notif(name, b"hello-1")
        _notifs_until(d1, b"hello-1")
        # a kernel copy into D1's blocks, still running (its DONE goes out when it ends)
        write = p._posted(name, StandInEvent(), b"DONE:for-d1", 1, 0.0, 0.0)
        p.remove_peer(name)  # D1 restarted under the same engine id: its agent is dropped...
        d1.stop()
        d2 = Peer(name)
        assert p.load_peer(d2.blob) == name  # ...and the new process loaded under the name
        state = p.poll(write)
        p.send_notif(name, b"marker")
        got = _notifs_until(d2, b"marker")
        assert b"DONE:for-d1" not in got, "the old copy's DONE reached the restarted process"
        assert state is TransferState.FAILED, "a copy whose DONE could not reach its peer is not done"
        p.release(write)
        assert p.outstanding_handles == 0
    finally:
        p.close()
        d1.stop()
        if d2 is not None:
            d2.stop()


def test_a_descriptor_spanning_two_adjacent_allocations_is_refused() -> None:
    """Two allocations adjacent in the peer's address space are mapped apart here: a descriptor
    running from one into the next would be copied past the first mapping (passes: refused)."""
    peer = cuda_ipc._Peer(
        pid=1,
        bases=np.array([4096, 8192], dtype=np.int64),
        sizes=np.array([4096, 4096], dtype=np.int64),
        mapped=np.array([0x7000_0000, 0x9000_0000], dtype=np.int64),
        opened=[],
    )
    assert peer.translate(np.array([8192], dtype=np.uint64), np.array([4096])).tolist() == [0x9000_0000]
    with pytest.raises(TransferError, match="outside"):
        peer.translate(np.array([6144], dtype=np.uint64), np.array([4096]))
