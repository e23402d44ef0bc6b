"""The NIXL transport plugin against a real NIXL agent in another process (UCX over loopback).

The peer process owns one agent and one registered buffer; it keeps draining notifications
between commands (a NIXL target must make progress for the first wire-up to finish). Every
wait is bounded; nothing asserts on speed.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.transport import TransferState, Transport, TransportConfig
from kvpush.demo import processes

torch = pytest.importorskip("torch")

BLOCK = 1024
BLOCKS = 8
WAIT_S = 60.0


def _peer_main(conn: Connection, agent_name: str) -> None:
    """A NIXL agent with one registered buffer of BLOCKS blocks, driven over ``conn``."""
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        from kvpush.transports.nixl import NixlTransport

        transport = NixlTransport(TransportConfig(agent_name=agent_name))
        buf = torch.zeros(BLOCK * BLOCKS, dtype=torch.uint8)
        transport.register_buffer(buf.data_ptr(), buf.numel(), "DRAM", 0)
        conn.send(("ok", (transport.metadata(), buf.data_ptr())))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    notifs: list[tuple[str, bytes]] = []
    try:
        while True:
            notifs.extend(transport.drain_notifs())
            if not conn.poll(0.001):
                continue
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "notifs":
                    conn.send(("ok", list(notifs)))
                elif cmd == "read":
                    conn.send(("ok", buf.numpy().tobytes()))
                elif cmd == "load":
                    conn.send(("ok", transport.load_peer(args[0])))
                elif cmd == "notify":
                    transport.send_notif(args[0], args[1])
                    conn.send(("ok", None))
                elif cmd == "counters":
                    conn.send(("ok", transport.counters.as_dict()))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        transport.close()


class Peer:
    """The parent's handle on a peer process."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.process, self.conn = processes.start(_peer_main, lambda conn: (conn, name), name=f"peer-{name}")
        self.blob, self.addr = self._reply("start", WAIT_S)

    def _reply(self, what: str, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.name} did not answer {what!r} within {timeout_s}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer {self.name} failed on {what!r}:\n{value}")
        return value

    def call(self, *message: Any, timeout_s: float = WAIT_S) -> Any:
        self.conn.send(message)
        return self._reply(message[0], timeout_s)

    def wait_notifs(self, count: int, timeout_s: float = WAIT_S) -> list[tuple[str, bytes]]:
        deadline = time.monotonic() + timeout_s
        while True:
            notifs = self.call("notifs")
            if len(notifs) >= count or time.monotonic() > deadline:
                return notifs
            time.sleep(0.01)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=WAIT_S)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer("nixl-test-peer")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def local() -> Iterator[tuple[Transport, Any]]:
    from kvpush.transports.nixl import NixlTransport

    transport = NixlTransport(TransportConfig(agent_name="nixl-test-local"))
    src = (torch.arange(BLOCK * BLOCKS, dtype=torch.int64) * 7 + 3).to(torch.uint8)
    transport.register_buffer(src.data_ptr(), src.numel(), "DRAM", 0)
    try:
        yield transport, src
    finally:
        transport.close()


def _descs(base: int) -> np.ndarray:
    return np.array([(base + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], dtype=np.uint64)


def _ids(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def _poll_until_settled(transport: Transport, handle: Any, timeout_s: float = WAIT_S) -> TransferState:
    deadline = time.monotonic() + timeout_s
    state = transport.poll(handle)
    while state is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.0005)
        state = transport.poll(handle)
    return state


def _connect(transport: Transport, src: Any, peer: Peer) -> tuple[str, int, int]:
    name = transport.load_peer(peer.blob)
    local_list = transport.prepare_local(_descs(src.data_ptr()), "DRAM")
    remote_list = transport.prepare_remote(name, _descs(peer.addr), "DRAM")
    return name, local_list, remote_list


# ---------------------------------------------------------------------------- tests


def test_write_lands_bytes_and_notifies_the_peer(local: tuple[Transport, Any], peer: Peer) -> None:
    transport, src = local
    name, local_list, remote_list = _connect(transport, src, peer)
    assert name == peer.name

    handle = transport.post_write(local_list, _ids(0, 2, 5), remote_list, _ids(1, 3, 7), b"DONE:first")
    assert _poll_until_settled(transport, handle) is TransferState.DONE
    assert transport.outstanding_handles == 1
    transport.release(handle)
    assert transport.outstanding_handles == 0

    notifs = peer.wait_notifs(1)
    assert notifs == [("nixl-test-local", b"DONE:first")]

    written = np.frombuffer(peer.call("read"), dtype=np.uint8).reshape(BLOCKS, BLOCK)
    expected = src.numpy().reshape(BLOCKS, BLOCK)
    for src_block, dst_block in ((0, 1), (2, 3), (5, 7)):
        np.testing.assert_array_equal(written[dst_block], expected[src_block])
    for untouched in (0, 2, 4, 5, 6):
        assert not written[untouched].any(), f"block {untouched} was written"

    # Notifications flow the other way too (the PUSH_REG path: D -> P, no descriptors).
    assert peer.call("load", transport.metadata()) == "nixl-test-local"
    peer.call("notify", "nixl-test-local", b"PUSH_REG:hello")
    deadline = time.monotonic() + WAIT_S
    received: list[tuple[str, bytes]] = []
    while not received and time.monotonic() < deadline:
        received = transport.drain_notifs()
        time.sleep(0.001)
    assert received == [(peer.name, b"PUSH_REG:hello")]

    assert transport.counters.as_dict() == {
        "peers_loaded": 1,
        "peers_removed": 0,
        "local_lists_prepared": 1,
        "remote_lists_prepared": 1,
        "writes_posted": 1,
        "writes_failed": 0,
        "notifs_sent": 0,
        "notifs_received": 1,
        "handles_released": 1,
        "fences_unconfirmable": 0,
    }
    peer_counters = peer.call("counters")
    assert peer_counters["notifs_received"] == 1
    assert peer_counters["notifs_sent"] == 1
    assert peer_counters["remote_lists_prepared"] == 0


def test_close_releases_handles_lists_peers_and_registrations(
    local: tuple[Transport, Any], peer: Peer
) -> None:
    transport, src = local
    name, local_list, remote_list = _connect(transport, src, peer)
    handles = [
        transport.post_write(local_list, _ids(i), remote_list, _ids(i), f"w{i}".encode()) for i in range(3)
    ]
    for handle in handles:
        assert _poll_until_settled(transport, handle) is TransferState.DONE
    assert transport.outstanding_handles == 3  # settled but not yet released

    transport.close()

    assert transport.outstanding_handles == 0
    counters = transport.counters
    assert counters.writes_posted == 3
    assert counters.handles_released == 3
    assert counters.peers_removed == counters.peers_loaded == 1
    assert not transport._lists and not transport._remote_lists and not transport._peers
    assert not transport._registrations
    with pytest.raises(TransferError):  # the peer is gone from the agent
        transport.send_notif(name, b"after close")
    transport.close()  # idempotent
    assert transport.counters.handles_released == 3


def test_write_to_a_removed_peer_raises(local: tuple[Transport, Any], peer: Peer) -> None:
    transport, src = local
    name, local_list, remote_list = _connect(transport, src, peer)
    transport.remove_peer(name)
    assert transport.counters.peers_removed == 1
    assert name not in transport._remote_lists  # its prepared lists went with it
    with pytest.raises(TransferError, match="NIXL WRITE of 1 descriptors failed"):
        transport.post_write(local_list, _ids(0), remote_list, _ids(0), b"x")
    with pytest.raises(TransferError, match=f"notification to {name} failed"):
        transport.send_notif(name, b"x")
    assert transport.counters.writes_failed == 1
    assert transport.outstanding_handles == 0


def test_write_to_a_dead_peer_fails_without_hanging(local: tuple[Transport, Any], peer: Peer) -> None:
    transport, src = local
    _name, local_list, remote_list = _connect(transport, src, peer)
    handle = transport.post_write(local_list, _ids(0), remote_list, _ids(0), b"warm-up")
    assert _poll_until_settled(transport, handle) is TransferState.DONE
    transport.release(handle)

    peer.kill()
    assert not peer.process.is_alive()

    # NIXL reports a dead receiver by raising (nixlRemoteDisconnectError), at post or at poll.
    outcome = None
    deadline = time.monotonic() + WAIT_S
    while outcome is None and time.monotonic() < deadline:
        try:
            handle = transport.post_write(local_list, _ids(1), remote_list, _ids(1), b"to the dead")
        except TransferError as err:
            outcome = str(err)
            break
        state = _poll_until_settled(transport, handle, timeout_s=max(0.1, deadline - time.monotonic()))
        transport.release(handle)
        if state is TransferState.FAILED:
            outcome = "FAILED"
        time.sleep(0.05)
    assert outcome is not None, f"no write to the dead peer failed within {WAIT_S}s"
    assert transport.counters.writes_failed >= 1 or outcome == "FAILED"
    assert transport.outstanding_handles == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"progress": True}, r"unknown nixl transport options \['progress'\]"),
        ({"backend": "UCX", "num_thread": 2}, r"unknown nixl transport options \['backend', 'num_thread'\]"),
        ({"ucx_error_handling_mode": "bogus"}, "must be one of"),
        ({"backends": "UCX"}, "must be a list of backend names"),
        ({"num_threads": -1}, "must be an int >= 0"),
        ({"num_threads": "4"}, "must be an int >= 0"),
    ],
)
def test_bad_transport_options_raise_config_error(options: dict[str, Any], match: str) -> None:
    from kvpush.transports.nixl import NixlTransport

    with pytest.raises(ConfigError, match=match):
        NixlTransport(TransportConfig(agent_name="bad-options", options=options))


def test_unknown_backend_raises_config_error() -> None:
    from kvpush.transports.nixl import NixlTransport

    with pytest.raises(ConfigError, match=r"backend 'NO_SUCH_BACKEND'.*available plugins: \[.*'UCX'"):
        NixlTransport(TransportConfig(agent_name="bad-backend", options={"backends": ["NO_SUCH_BACKEND"]}))


def test_the_plugin_manager_creates_the_nixl_transport(kvpush_pm: Any) -> None:
    provider = kvpush_pm.transport("nixl")
    create: Callable[[TransportConfig], Transport] = provider.create
    transport = create(TransportConfig(agent_name="via-pm", options={"ucx_error_handling_mode": "peer"}))
    try:
        assert isinstance(transport, Transport)
        assert transport.agent_name == "via-pm"
        assert isinstance(transport.metadata(), bytes) and transport.metadata()
    finally:
        transport.close()


def test_released_remote_lists_are_forgotten(local: tuple[Transport, Any], peer: Peer) -> None:
    """Issue 11.3: packed WRITEs prepare and release a remote list per chunk; the transport must
    not keep every released one."""
    transport, src = local
    name, _local_list, remote_list = _connect(transport, src, peer)
    transport.release_list(remote_list)
    assert transport._remote_lists[name] == set()


@pytest.mark.parametrize(
    ("tls", "takes"),
    [
        (None, True),
        ("", True),
        ("all", True),
        ("tcp,cma", True),
        ("sm,tcp", True),
        ("^tcp", True),
        ("cuda_ipc,rc", True),
        ("tcp", False),
        ("rc_x,ud_x,self", False),
        ("tcp,cuda_copy", False),
    ],
)
def test_same_host_copies_follow_ucx_tls(tls: str | None, takes: bool) -> None:
    """Whether a process on this host may copy into this agent's memory by itself (D then
    holds a same-host P's failed requests instead of releasing them on a fence)."""
    from kvpush.transports.nixl import ucx_takes_same_host_copies

    assert ucx_takes_same_host_copies(tls) is takes
