"""Removing a peer (or closing) while a kernel copy through its IPC mapping still runs.

The mapping must not be closed under the kernel (the process would fault), and the wait for the
copy must be bounded: it was an unbounded ``event.synchronize()``, so a hung GPU hung
``remove_peer`` and ``close()`` for ever. Now the wait ends at ``close_wait_s``, the mapping is
left open (counted in ``unclosed``) and the error says why. Pure logic: a stand-in driver and
event (the GPU tests cover real copies).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from kvpush.core.transport import TransportConfig
from kvpush.transports.cuda_ipc import CudaIpcTransport, _IpcWrite, _Peer


class Driver:
    def __init__(self) -> None:
        self.closed: list[int] = []

    def bind(self, device: int) -> None:
        pass

    def close(self, ptr: int) -> None:
        self.closed.append(ptr)


class Event:
    """Completes after ``queries`` queries (never when None)."""

    def __init__(self, queries: int | None) -> None:
        self.left = queries

    def query(self) -> bool:
        if self.left is None:
            return False
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:  # the old code's call: a hung copy never returns
        raise AssertionError("an unbounded wait")


def transport_with_copy(event: Event) -> tuple[CudaIpcTransport, Driver, str]:
    t = CudaIpcTransport(
        TransportConfig(agent_name=f"P-{os.urandom(3).hex()}", options={"inner": "loopback"})
    )
    driver = Driver()
    t._driver = driver  # type: ignore[assignment]
    t._spans = [(4096, 4096, 0)]
    name = "D-0"
    t._peers[name] = _Peer(
        pid=1,
        bases=np.array([0x5000], dtype=np.int64),
        sizes=np.array([4096], dtype=np.int64),
        mapped=np.array([0x9000], dtype=np.int64),
        opened=[0x9000],
    )
    t._blobs[name] = b"blob"
    t._writes.add(_IpcWrite(event=event, peer=name, notif=b"DONE", descriptors=1))
    return t, driver, name


def test_a_copy_that_never_ends_leaves_the_mapping_open_within_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t, driver, name = transport_with_copy(Event(None))
    t.close_wait_s = 0.2
    started = time.monotonic()
    with caplog.at_level(logging.ERROR):
        t.remove_peer(name)
    assert time.monotonic() - started < 5.0
    assert driver.closed == [] and t.unclosed == [0x9000]
    assert "stay open" in caplog.text and "is the GPU hung" in caplog.text
    assert all(w.failed and not w.sent for w in t._writes)  # its DONE is never sent


def test_a_copy_that_ends_is_waited_for_then_the_mapping_closed() -> None:
    t, driver, _ = transport_with_copy(Event(3))
    t.close_wait_s = 5.0
    t.close()
    assert driver.closed == [0x9000] and t.unclosed == []
