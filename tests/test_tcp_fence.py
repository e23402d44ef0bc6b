"""Issue 12: fencing a peer's TCP connections (``kvpush.transports.tcp_fence``, NIXL's
``fence_peer``): after the fence, bytes the peer sends on an old connection are refused by the
kernel, never read, so they cannot land in blocks D released."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.transports import tcp_fence

pytestmark = pytest.mark.skipif(not tcp_fence.supported(), reason="needs /proc/self/net/tcp (Linux)")
WAIT_S = 30.0


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    """(listener, client, server side): a connection made by this process to its own listener."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        yield listener, client, server
    finally:
        for s in (listener, client, server):
            s.close()


def _inode(table: list[tcp_fence.TcpSocket], sock: socket.socket) -> int:
    return next(s.inode for s in table if (s.local, s.remote) == (sock.getsockname(), sock.getpeername()))


def test_peer_sockets_finds_connections_to_the_peers_listeners_and_from_its_host(
    pair: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listener, client, server = pair
    port = listener.getsockname()[1]
    table = tcp_fence.sockets()
    out = {s.inode for s in tcp_fence.peer_sockets([("127.0.0.1", port)], [], table)}
    client_inode = _inode(table, client)
    server_inode = _inode(table, server)
    assert out == {client_inode}, "outbound: the connection to the peer's listener only"
    inbound = {s.inode for s in tcp_fence.peer_sockets([("127.0.0.2", 1)], [("0.0.0.0", port)], table)}
    assert server_inode not in inbound, "inbound from another host is not the peer's"
    unknown = {s.inode for s in tcp_fence.peer_sockets(None, [("0.0.0.0", port)], table)}
    assert server_inode in unknown, "a peer that publishes nothing: every inbound connection"
    assert tcp_fence.peer_sockets([], [("0.0.0.0", port)], table) == [], "no TCP listener, no TCP"


def test_after_the_fence_new_bytes_are_refused_and_never_read(
    pair: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    """The kernel rule the fence rests on: a socket shut down for reading and writing answers
    new data with a reset; the reader sees end of stream or the reset, never the bytes."""
    _, client, server = pair
    client.sendall(b"before")
    assert server.recv(64) == b"before"
    inode = _inode(tcp_fence.sockets(), server)
    assert tcp_fence.shut_down([inode]) == [inode]
    deadline = time.monotonic() + WAIT_S
    while not tcp_fence.fence_complete([inode]):
        assert time.monotonic() < deadline, "the fence was not confirmed"
        time.sleep(0.01)
    with pytest.raises(OSError):  # reset by the fenced side (EPIPE / ECONNRESET)
        for _ in range(50):
            client.sendall(b"after the fence" * 1000)
            time.sleep(0.02)
    try:
        got = server.recv(64)
    except ConnectionResetError:
        got = b""  # the fenced side reset the connection itself
    assert got == b"", "the fenced side reads end of stream or a reset, never the new bytes"


def test_shut_down_ignores_sockets_this_process_does_not_hold() -> None:
    assert tcp_fence.shut_down([2**40]) == []
    assert tcp_fence.fence_complete([2**40])


# ------------------------------------------------------------------------------ NIXL

torch = pytest.importorskip("torch")


def _tcp_peer(monkeypatch: pytest.MonkeyPatch) -> Any:
    from test_nixl_transport import Peer

    monkeypatch.setenv("UCX_TLS", "tcp")  # the spawned peer's UCX reads it
    return Peer("fence-test-peer")


def _progress_until(local: Any, done: Any, what: str) -> None:
    """Progress ``local``'s UCX worker (a send goes out only when it progresses) until ``done()``."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"{what!r} did not arrive within {WAIT_S}s"
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            local.drain_notifs()


def test_nixl_publishes_its_ucx_tcp_listeners() -> None:
    from kvpush.core.transport import TransportConfig
    from kvpush.transports.framing import unframe
    from kvpush.transports.nixl import MAGIC, NixlTransport

    transport = NixlTransport(TransportConfig(agent_name="fence-listeners", options={"ucx_tls": "tcp"}))
    try:
        _, info = unframe(MAGIC, transport.metadata(), "nixl")
        assert info is not None and info["tcp_listeners"], info
        listening = {s.local for s in tcp_fence.sockets() if s.state == tcp_fence.LISTEN}
        assert {tuple(a) for a in info["tcp_listeners"]} <= listening
    finally:
        transport.close()


def test_nixl_fence_shuts_the_peers_connection_and_a_new_one_works(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpush.core.transport import TransportConfig
    from kvpush.transports.nixl import NixlTransport

    peer = _tcp_peer(monkeypatch)
    local = NixlTransport(TransportConfig(agent_name="fence-test-local", options={"ucx_tls": "tcp"}))
    try:
        name = local.load_peer(peer.blob)
        assert peer.call("load", local.metadata()) == "fence-test-local"
        local.send_notif(name, b"hello")
        _progress_until(local, lambda: any(m == b"hello" for _, m in peer.call("notifs")), "hello")
        peer.call("notify", "fence-test-local", b"before")
        deadline = time.monotonic() + WAIT_S
        got: list[tuple[str, bytes]] = []
        while not got and time.monotonic() < deadline:
            got += local.drain_notifs()
        assert got == [(name, b"before")]
        mine = tcp_fence.own_socket_fds()
        before = [s for s in tcp_fence.sockets() if s.inode in mine and s.state == tcp_fence.ESTABLISHED]
        assert before, "no TCP connection to fence: UCX did not use TCP"

        local.fence_peer(name)
        deadline = time.monotonic() + WAIT_S
        while not local.fenced(name):
            assert time.monotonic() < deadline, "the fence was not confirmed"
            local.drain_notifs()
            time.sleep(0.005)
        alive = {s.inode for s in tcp_fence.sockets() if s.state == tcp_fence.ESTABLISHED}
        assert not alive & {s.inode for s in before}, "a fenced connection is still established"

        # The peer's next message on its old connection is refused, never delivered here.
        with contextlib.suppress(RuntimeError):  # the peer's UCX may see the reset
            peer.call("notify", "fence-test-local", b"after the fence")
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert local.drain_notifs() == [], "bytes sent on a fenced connection were read"

        # A fresh connection works.
        name = local.load_peer(peer.blob)
        local.send_notif(name, b"again")
        _progress_until(local, lambda: any(m == b"again" for _, m in peer.call("notifs")), "again")
    finally:
        local.close()
        peer.stop()


def test_a_restarted_peers_old_listeners_are_still_fenced() -> None:
    """A peer restarted under the same agent name publishes new listeners; the old process's
    connections (its kernel may still deliver) must be fenced too, so both are remembered."""
    from kvpush.core.transport import TransportConfig
    from kvpush.transports.framing import frame
    from kvpush.transports.nixl import MAGIC, NixlTransport

    local = NixlTransport(TransportConfig(agent_name="fence-restart-local", options={"ucx_tls": "tcp"}))
    other = NixlTransport(TransportConfig(agent_name="fence-restart-peer", options={"ucx_tls": "tcp"}))
    try:
        from kvpush.transports.framing import unframe

        inner, _ = unframe(MAGIC, other.metadata(), "nixl")
        name = local.load_peer(frame(MAGIC, {"tcp_listeners": [["10.0.0.1", 1111]]}, inner))
        local.remove_peer(name)
        local.load_peer(frame(MAGIC, {"tcp_listeners": [["10.0.0.1", 2222]]}, inner))
        assert local._peer_listeners[name] == [("10.0.0.1", 1111), ("10.0.0.1", 2222)]
    finally:
        local.close()
        other.close()


def test_admitting_a_peer_no_listener_refuses_rebuilds_no_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load of a peer admits its listeners; a peer never refused (nearly every handshake)
    must not reread the socket table and re-attach the listeners' filters (~10 ms a handshake,
    the CPU gate's notif-only handshake 2 -> 14.5 ms). A refused one, an allow-only listener or
    one refusing more than EXACT_REFUSALS addresses still goes through the update."""
    calls: list[str] = []
    monkeypatch.setattr(tcp_fence, "_update", lambda *a, **k: calls.append("update") or [])
    monkeypatch.setattr(tcp_fence, "_refusals", {})
    monkeypatch.setattr(tcp_fence, "_allowed", {})
    peer, own = [("10.0.0.2", 4000)], [("10.0.0.1", 5000)]
    tcp_fence.admit(peer, own, loaded=peer)
    assert calls == []
    tcp_fence._refusals[7] = {("10.0.0.2", 4000)}
    tcp_fence.admit(peer, own, loaded=peer)
    assert calls == ["update"]
    tcp_fence._refusals[7] = {("10.0.0.9", n) for n in range(tcp_fence.EXACT_REFUSALS + 1)}
    tcp_fence.admit(peer, own, loaded=peer)
    assert calls == ["update"] * 2
    tcp_fence._refusals.clear()
    tcp_fence._allowed[7] = {("10.0.0.3", 4000)}
    tcp_fence.admit(peer, own, loaded=peer)
    assert calls == ["update"] * 3
