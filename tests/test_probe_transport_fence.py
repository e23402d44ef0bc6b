"""Transport probes of the TCP fence (``NixlTransport.fence_peer`` / ``fenced``) with real NIXL
(UCX over TCP) between processes: once ``fenced`` says True, no byte of the fenced peer may land
here any more, whatever the peer's UCX still holds (a WRITE it had not finished sending, a
connection it opens again).

The peer (P) posts one large WRITE into this process (D) while D does not progress UCX, so most
of it waits in P's UCX and in the kernel; D then fences P, progresses until the fence is
confirmed, and keeps progressing while P keeps trying. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvpush.core.transport import TransferState, TransportConfig
from kvpush.transports import tcp_fence

pytestmark = pytest.mark.skipif(not tcp_fence.supported(), reason="needs /proc/self/net/tcp (Linux)")
torch = pytest.importorskip("torch")
pytest.importorskip("nixl._api")

BLOCK = 1 << 20
BLOCKS = 64
WAIT_S = 30.0
FILL = 0xAB


def _descs(base: int, blocks: int = BLOCKS) -> np.ndarray:
    return np.array([(base + i * BLOCK, BLOCK, 0) for i in range(blocks)], dtype=np.uint64)


def _p_main(conn: Connection, name: str, options: dict[str, Any]) -> None:
    """P: a NIXL agent whose buffer is FILL; it WRITEs into D on command and keeps progressing."""
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    try:
        from kvpush.transports.nixl import NixlTransport

        transport = NixlTransport(TransportConfig(agent_name=name, options=options))
        buf = torch.full((BLOCK * BLOCKS,), FILL, dtype=torch.uint8)
        transport.register_buffer(buf.data_ptr(), buf.numel(), "DRAM", 0)
        local = transport.prepare_local(_descs(buf.data_ptr()), "DRAM")
        conn.send(("ok", transport.metadata()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    handles: list[Any] = []
    states: list[str] = []
    try:
        while True:
            with contextlib.suppress(Exception):
                transport.drain_notifs()
            for i, handle in enumerate(handles):
                if handle is not None and states[i] == "pending":
                    state = transport.poll(handle)
                    if state is not TransferState.PENDING:
                        states[i] = state.value
            if not conn.poll(0.001):
                continue
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "load":
                    conn.send(("ok", transport.load_peer(args[0])))
                elif cmd == "write":  # peer name, D's base address, blocks, notification
                    peer, base, blocks, notif = args
                    remote = transport.prepare_remote(peer, _descs(base, blocks), "DRAM")
                    ids = np.arange(blocks, dtype=np.int32)
                    try:
                        handles.append(transport.post_write(local, ids, remote, ids, notif))
                        states.append("pending")
                    except Exception as err:
                        handles.append(None)
                        states.append(f"raised {err}")
                    conn.send(("ok", len(handles) - 1))
                elif cmd == "states":
                    conn.send(("ok", list(states)))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            transport.close()


class P:
    def __init__(self, name: str, options: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_p_main, args=(child, name, options), daemon=True)
        self.process.start()
        child.close()
        self.blob = self._reply("start")

    def _reply(self, what: str) -> Any:
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"P did not answer {what!r} within {WAIT_S}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"P failed on {what!r}:\n{value}")
        return value

    def call(self, *message: Any) -> Any:
        self.conn.send(message)
        return self._reply(message[0])

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()


def _progress(transport: Any, seconds: float) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got += transport.drain_notifs()
    return got


def _landed(buf: Any) -> int:
    return int((buf == FILL).sum())


@pytest.mark.parametrize("options", [{"ucx_tls": "tcp"}], ids=["tcp"])
def test_no_byte_lands_after_the_fence_is_confirmed_while_p_still_sends(options: dict[str, Any]) -> None:
    from kvpush.transports.nixl import NixlTransport

    suffix = os.urandom(3).hex()
    d = NixlTransport(TransportConfig(agent_name=f"fx-D-{suffix}", options=options))
    buf = torch.zeros(BLOCK * BLOCKS, dtype=torch.uint8)
    d.register_buffer(buf.data_ptr(), buf.numel(), "DRAM", 0)
    p = P(f"fx-P-{suffix}", options)
    try:
        name = d.load_peer(p.blob)
        p.call("load", d.metadata())
        # warm up: one small WRITE lands and its DONE arrives, so the connections exist
        p.call("write", d.agent_name, buf.data_ptr(), 1, b"warm")
        deadline = time.monotonic() + WAIT_S
        while not any(m == b"warm" for _, m in d.drain_notifs()):
            assert time.monotonic() < deadline, "the warm-up WRITE never arrived"
        buf.zero_()
        # the big WRITE; D does not progress for a while, so most of it waits on P's side
        p.call("write", d.agent_name, buf.data_ptr(), BLOCKS, b"big")
        time.sleep(0.5)
        d.fence_peer(name)
        deadline = time.monotonic() + WAIT_S
        notes: list[tuple[str, bytes]] = []
        while not d.fenced(name):
            assert time.monotonic() < deadline, "the fence was never confirmed"
            notes += d.drain_notifs()
            time.sleep(0.001)
        at_fence = _landed(buf)
        notes += _progress(d, 3.0)  # P keeps progressing (and may reconnect) meanwhile
        after = _landed(buf)
        states = p.call("states")
        assert at_fence < BLOCK * BLOCKS, f"the WRITE finished before the fence ({states}); nothing probed"
        assert after == at_fence, (
            f"{after - at_fence} bytes of P landed after the fence was confirmed "
            f"({at_fence} before; P's WRITE states {states}; notifications {[m for _, m in notes]})"
        )
    finally:
        d.close()
        p.stop()


UNDER_LOAD = (
    "open: with the CPU busy (two spinning cores here; CI's suite run) bytes of P's WRITE still "
    "land after the fence was confirmed (2 of 3 runs: 21 and 61 MiB after 12 and 6 MiB had landed; "
    "CI: 63 MiB), on a connection the fence did not see; alone the test passes. The code before "
    "the accept-queue check lost all 64 MiB this way even then. Not yet understood"
)


@pytest.mark.xfail(strict=False, reason=UNDER_LOAD)
@pytest.mark.parametrize("options", [{"ucx_tls": "tcp"}], ids=["tcp"])
def test_a_connection_p_opened_before_the_fence_but_not_yet_accepted_is_fenced_too(
    options: dict[str, Any],
) -> None:
    """P loads D and WRITEs at once, on a connection D's UCX has not accepted yet (D progresses
    only when its writer drains): it waits in the kernel's accept queue, in no fd of D's, so a
    fence that looks only at D's sockets misses it, and UCX accepts it at the next progress."""
    from kvpush.transports.nixl import NixlTransport

    suffix = os.urandom(3).hex()
    d = NixlTransport(TransportConfig(agent_name=f"fx-D-{suffix}", options=options))
    buf = torch.zeros(BLOCK * BLOCKS, dtype=torch.uint8)
    d.register_buffer(buf.data_ptr(), buf.numel(), "DRAM", 0)
    p = P(f"fx-P-{suffix}", options)
    try:
        name = d.load_peer(p.blob)
        p.call("load", d.metadata())
        p.call("write", d.agent_name, buf.data_ptr(), BLOCKS, b"big")
        time.sleep(0.5)
        d.fence_peer(name)
        deadline = time.monotonic() + WAIT_S
        notes: list[tuple[str, bytes]] = []
        while not d.fenced(name):
            assert time.monotonic() < deadline, "the fence was never confirmed"
            notes += d.drain_notifs()
            time.sleep(0.001)
        at_fence = _landed(buf)
        notes += _progress(d, 3.0)
        after = _landed(buf)
        states = p.call("states")
        assert after == at_fence, (
            f"{after - at_fence} bytes of P landed after the fence was confirmed "
            f"({at_fence} before; P's WRITE states {states}; notifications {[m for _, m in notes]})"
        )
    finally:
        d.close()
        p.stop()


def test_published_listeners_are_bounded_and_plain() -> None:
    """A peer's published listener list (what a fence shuts connections to) is checked: a bool
    port is not a port, and a list longer than MAX_LISTENERS_PER_PEER is refused (each fence
    scans them against every socket of the process)."""
    from kvpush.core.errors import TransferError
    from kvpush.transports import nixl

    with pytest.raises(TransferError, match="listener"):
        nixl._listeners({"tcp_listeners": [["127.0.0.1", True]]})
    many = [["10.0.0.1", 1000 + i] for i in range(nixl.MAX_LISTENERS_PER_PEER + 1)]
    with pytest.raises(TransferError, match="listener"):
        nixl._listeners({"tcp_listeners": many})
    assert nixl._listeners({"tcp_listeners": many[:2]}) == [("10.0.0.1", 1000), ("10.0.0.1", 1001)]
