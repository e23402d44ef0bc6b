"""Fencing a peer's TCP connections: after this, nothing the peer already sent can be read here.

Why it is needed: UCX over TCP emulates a one-sided WRITE by sending the bytes over a socket,
and the receiving process copies them into its memory when it reads them. Removing a peer's
NIXL agent does not close that socket (UCX keeps a connection open while the other side may
still send on it), so bytes a partitioned peer queued before a WRITE deadline are still copied
in when the network returns, possibly into blocks the engine reused. The kernel's send queue of
the peer keeps them for minutes (TCP retransmits through an outage), whatever the peer's
process does.

The fence is the kernel's own rule (RFC 1122 4.2.2.13, Linux ``tcp_rcv_state_process``): a
socket shut down for reading and writing sends a FIN and answers any *new* data with a reset,
dropping it. Bytes already in the socket's receive queue are still read, so a fence is
complete only once every fenced socket is gone or has an empty receive queue and is no longer
``ESTABLISHED``. :func:`shut_down` shuts sockets down by inode; :func:`fence_complete` checks
them. Linux only (``/proc/self/net/tcp*``); elsewhere :func:`supported` is False.

Which sockets carry a peer's data (:func:`peer_sockets`): connections this process made to one
of the peer's UCX listeners (the peer publishes them), and connections into one of this
process's own UCX listeners from the peer's addresses.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat
from collections.abc import Iterable
from pathlib import Path

import attrs

TCP_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
ESTABLISHED, SYN_RECV, LISTEN = 0x01, 0x03, 0x0A
WILDCARDS = frozenset({"0.0.0.0", "::"})


@attrs.frozen
class TcpSocket:
    """One row of ``/proc/self/net/tcp{,6}`` (addresses as text, IPv4-mapped IPv6 unmapped)."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    rx_queue: int
    inode: int


def supported() -> bool:
    return Path(TCP_TABLES[0]).exists()


def _address(field: str) -> tuple[str, int]:
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1])), int(port, 16)
    # IPv6 is four little-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    mapped = address.ipv4_mapped
    return (str(mapped) if mapped else str(address)), int(port, 16)


def sockets() -> list[TcpSocket]:
    """Every TCP socket of this process's network namespace (not only this process's)."""
    out = []
    for table in TCP_TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            rx_queue = int(fields[4].split(":")[1], 16)
            out.append(
                TcpSocket(
                    local=_address(fields[1]),
                    remote=_address(fields[2]),
                    state=int(fields[3], 16),
                    rx_queue=rx_queue,
                    inode=int(fields[9]),
                )
            )
    return out


def own_socket_fds() -> dict[int, int]:
    """Socket inode -> one fd of this process that holds it."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc/self/fd"):
            try:
                target = os.readlink(entry.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                out.setdefault(int(target[8:-1]), int(entry.name))
    return out


def own_listeners() -> set[tuple[str, int]]:
    """``(address, port)`` of every listening TCP socket this process holds."""
    mine = own_socket_fds()
    return {s.local for s in sockets() if s.state == LISTEN and s.inode in mine}


def _match(
    peer_listeners: Iterable[tuple[str, int]] | None,
    own_listeners: Iterable[tuple[str, int]],
    table: list[TcpSocket] | None,
) -> tuple[list[TcpSocket], list[TcpSocket], list[TcpSocket]] | None:
    """``(outbound, inbound, waiting)``: this process's connections to the peer's listeners, its
    connections into ours from the peer's addresses, and connections from the peer's addresses
    into ours that the kernel holds but this process has not accepted yet (no fd: inode 0);
    None when the peer has no TCP listener (``peer_listeners`` empty)."""
    if peer_listeners is not None:
        peer_listeners = list(peer_listeners)
        if not peer_listeners:
            return None
    mine = own_socket_fds()
    table = sockets() if table is None else table
    rows = [s for s in table if s.inode in mine and s.state != LISTEN]
    theirs = set(peer_listeners or ())
    exact = {(h, p) for h, p in theirs if h not in WILDCARDS}
    any_host_ports = {p for h, p in theirs if h in WILDCARDS}
    outbound = [s for s in rows if s.remote in exact or s.remote[1] in any_host_ports]
    hosts = {h for h, _ in exact} | {s.remote[0] for s in outbound}
    our_ports = {p for _, p in own_listeners}

    def theirs_in(s: TcpSocket) -> bool:
        return s.local[1] in our_ports and (not hosts or s.remote[0] in hosts)

    inbound = [s for s in rows if theirs_in(s)]
    waiting = [s for s in table if s.inode == 0 and s.state in (ESTABLISHED, SYN_RECV) and theirs_in(s)]
    return outbound, inbound, waiting


def peer_sockets(
    peer_listeners: Iterable[tuple[str, int]] | None,
    own_listeners: Iterable[tuple[str, int]],
    table: list[TcpSocket] | None = None,
    *,
    inbound_only: bool = False,
) -> list[TcpSocket]:
    """This process's open connections that can carry a peer's data: those to one of the peer's
    listeners, and those into one of ours from the peer's addresses (its specific listener
    addresses and the addresses our connections to it reached; if none is known, every
    connection into our listeners, which is safe and may cost other peers a reconnect).
    ``inbound_only``: only the latter.

    ``peer_listeners`` empty: the peer has no TCP listener, so it has no TCP connection to us
    either. None: not known (a peer that does not publish them): every connection into ours."""
    match = _match(peer_listeners, own_listeners, table)
    if match is None:
        return []
    outbound, inbound, _ = match
    seen: dict[int, TcpSocket] = {}
    for row in ([] if inbound_only else outbound) + inbound:
        seen.setdefault(row.inode, row)
    return list(seen.values())


def waiting_connections(
    peer_listeners: Iterable[tuple[str, int]] | None,
    own_listeners: Iterable[tuple[str, int]],
    table: list[TcpSocket] | None = None,
) -> list[TcpSocket]:
    """Connections from the peer's addresses into one of our listeners that the kernel set up
    (or is setting up) but this process has not accepted yet. They hold no fd, so no fence can
    shut them; the peer may have queued bytes on them before a fence, which UCX reads once it
    accepts them. A fence is confirmed only once none is left (each accepted one is shut)."""
    match = _match(peer_listeners, own_listeners, table)
    return [] if match is None else match[2]


def shut_down(inodes: Iterable[int]) -> list[int]:
    """``shutdown(SHUT_RDWR)`` each socket of this process with one of ``inodes``; returns the
    inodes shut down. The fd is duplicated and checked to still be that socket first, so a
    number the owner closed and reused meanwhile is never touched."""
    wanted = set(inodes)
    done = []
    for inode, fd in own_socket_fds().items():
        if inode not in wanted:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue  # closed meanwhile: nothing left to fence
        try:
            info = os.fstat(dup)
            if not stat.S_ISSOCK(info.st_mode) or info.st_ino != inode:
                continue
            with socket.socket(fileno=dup) as sock:
                dup = -1  # the socket object owns (and closes) the duplicate
                with contextlib.suppress(OSError):  # ENOTCONN: already down
                    sock.shutdown(socket.SHUT_RDWR)
                done.append(inode)
        finally:
            if dup >= 0:
                os.close(dup)
    return done


def fence_complete(inodes: Iterable[int]) -> bool:
    """True once every socket in ``inodes`` is gone, or is past ``ESTABLISHED`` with nothing
    left to read (new data is then answered with a reset)."""
    wanted = set(inodes)
    if not wanted:
        return True
    for row in sockets():
        if row.inode in wanted and (row.state == ESTABLISHED or row.rx_queue > 0):
            return False
    return True
