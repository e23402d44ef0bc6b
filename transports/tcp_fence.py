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
complete only once every fenced socket is closed or has an empty receive queue and is no longer
``ESTABLISHED``. That reset takes the socket out of ``/proc/net/tcp`` (state ``CLOSE``) while
this process still holds it and can still read what it had received, so a socket missing from
the table is asked itself (``FIONREAD``). :func:`shut_down` shuts sockets down by inode;
:func:`fence_complete` checks them. Linux only (``/proc/self/net/tcp*``); elsewhere
:func:`supported` is False.

A fenced peer reconnects by itself: UCX's TCP transport opens a new connection when one it is
still setting up (its connection request sent, not yet acknowledged) is reset, and the peer's
queued WRITE goes out on it once this side's UCX acknowledges, whether or not the peer's agent
is still loaded. :func:`refuse` stops that at the kernel: a socket filter on this process's UCX
listeners (inherited by every connection accepted after it) drops any segment that carries a
UCX connection request naming one of the peer's listeners, so no connection of the peer can
be set up until :func:`admit` lifts it (the peer loaded again).

Which sockets carry a peer's data (:func:`peer_sockets`): connections this process made to one
of the peer's UCX listeners (the peer publishes them), and connections into one of this
process's own UCX listeners from the peer's addresses.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import os
import socket
import stat
import struct
import termios
import threading
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
    """Every TCP socket of this process's network namespace (not only this process's). Raises
    ``OSError`` when a table that exists cannot be read (EMFILE: the fd table is full): an
    empty answer would read as "no connection left", and a fence would be confirmed on it."""
    out = []
    for table in TCP_TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue  # tcp6 without IPv6
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
    """Socket inode -> one fd of this process that holds it. Raises ``OSError`` when
    ``/proc/self/fd`` cannot be listed (EMFILE): "no socket" would shut nothing and confirm."""
    out: dict[int, int] = {}
    for entry in os.scandir("/proc/self/fd"):
        try:
            target = os.readlink(entry.path)
        except FileNotFoundError:
            continue  # closed meanwhile
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
        except OSError as err:
            if err.errno == errno.EBADF:
                continue  # closed meanwhile: nothing left to fence
            raise  # EMFILE: it was not shut
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
    """True once every socket in ``inodes`` is closed, or is past ``ESTABLISHED`` with nothing
    left to read (new data is then answered with a reset). A socket the peer reset is no longer
    in ``/proc/net/tcp`` but keeps its unread bytes while this process holds it: it counts as
    closed only once nothing is left in it (``FIONREAD``)."""
    wanted = set(inodes)
    if not wanted:
        return True
    listed = set()
    for row in sockets():
        if row.inode in wanted:
            listed.add(row.inode)
            if row.state == ESTABLISHED or row.rx_queue > 0:
                return False
    return all(_unread(fd, inode) == 0 for inode, fd in own_socket_fds().items() if inode in wanted - listed)


def _unread(fd: int, inode: int) -> int:
    """Bytes left to read in socket ``inode`` held as ``fd`` (0 once it is closed). Raises
    ``OSError`` when that cannot be asked (EMFILE): unknown is not empty."""
    try:
        dup = os.dup(fd)
    except OSError as err:
        if err.errno == errno.EBADF:
            return 0  # closed
        raise
    try:
        if os.fstat(dup).st_ino != inode:
            return 0  # closed and the number reused
        count = array.array("i", [0])
        fcntl.ioctl(dup, termios.FIONREAD, count)
        return count[0]
    finally:
        os.close(dup)


# ------------------------------------------------------------------------------ refusal

UCX_MAGIC = 0xCAFEBABE12345678
"""First 8 bytes (little-endian) a UCX TCP endpoint sends on a connection it opened."""
CONN_REQ_LEN = 42
"""A UCX 1.23 connection request from an IPv4 interface: magic (8), AM header (id 32 at 8, its
length as 4 bytes at 9), event at 13 (bit 0: request), flags, connection id, then the sender's
interface ``sockaddr_in`` at 26 (family 2 in host order, the port and IPv4 address in network
order): the address it listens on, which it publishes. Checked against a real UCX by
``tests/test_probe_transport_fence.py``."""
CONN_REQ_LEN_V6 = 54
"""The same request from an IPv6 interface (UCX picks IPv6 on a host without IPv4 addresses, or
with ``UCX_TCP_AF_PRIO=inet6``): a ``sockaddr_in6`` at 26 (family 10 in host order, the port in
network order at 28, flow info, the 16-byte address at 34, scope id)."""
_AM_ID_CM, _EVENT_AT, _ADDR_AT = 32, 13, 26
_PORT_AT, _V4_AT, _V6_AT = 28, 30, 34
BPF_MAXINSNS = 4096
"""The longest classic BPF program the kernel takes."""
MAX_REFUSED = 700
"""Addresses one listener can refuse (an IPv4 one takes five filter instructions, an IPv6 one
eleven; a program longer than :data:`BPF_MAXINSNS` is not attached: the refusal fails)."""
EXACT_REFUSALS = 32
"""Refused addresses past which a listener turns allow-only (when given the loaded peers' listeners
and they are fewer): attaching a filter charges the socket's option memory (``net.core.optmem_max``)
for the old and the new filter at once, ~180 bytes per IPv4 address each, so a listener holds at
most ~360 refused addresses with 128 KiB (the default since Linux 6.9) and ~57 with 20 KiB (before)."""
SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27

_refusals: dict[int, set[tuple[str, int]]] = {}
"""Listener inode -> the peer addresses its filter refuses."""
_allowed: dict[int, set[tuple[str, int]]] = {}
"""Listener inode -> the only peer addresses whose connection requests its filter takes, for a
listener in allow-only mode: its refused set outgrew the filter (addresses of fenced processes
are lifted only when the same address is loaded again, so the set grows with every P restart).
Refusing every address but the loaded peers' refuses at least what the refused set did, and is
bounded by the peers loaded now instead of by every process ever fenced."""
_refusals_lock = threading.Lock()


def _family_code(family: int) -> int:
    """A ``sa_family`` as the filter's big-endian halfword load reads it (stored in host order)."""
    return int.from_bytes(family.to_bytes(2, "little"), "big")


def conn_req_source(payload: bytes) -> tuple[str, int] | None:
    """The listener address a UCX TCP connection request names (the first bytes a UCX peer sends
    on a connection it opened); None if ``payload`` does not start with one."""
    if len(payload) < CONN_REQ_LEN or int.from_bytes(payload[:8], "little") != UCX_MAGIC:
        return None
    if payload[8] != _AM_ID_CM or not payload[_EVENT_AT] & 1:
        return None
    family = int.from_bytes(payload[_ADDR_AT : _ADDR_AT + 2], "little")
    port = int.from_bytes(payload[_PORT_AT : _PORT_AT + 2], "big")
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(payload[_V4_AT : _V4_AT + 4])), port
    if family == socket.AF_INET6 and len(payload) >= CONN_REQ_LEN_V6:
        return str(ipaddress.IPv6Address(payload[_V6_AT : _V6_AT + 16])), port
    return None


Instruction = tuple[int, int, int, int]


def _program(refused: Iterable[tuple[str, int]], *, allow_only: bool = False) -> list[Instruction]:
    """A classic BPF socket filter (run by the kernel on every TCP segment, ``skb->data`` at the
    TCP header) that drops a segment whose payload is a UCX connection request naming one of
    ``refused`` (IPv4 or IPv6 listeners; a wildcard host matches the port in both families) and
    keeps every other segment whole. ``allow_only``: drops every UCX connection request *but*
    those naming one of ``refused`` (then the addresses allowed)."""
    keep, drop = (0x06, 0, 0, 0xFFFFFFFF), (0x06, 0, 0, 0)
    hit, miss = (keep, drop) if allow_only else (drop, keep)

    def must_equal(load: Instruction, value: int) -> list[Instruction]:
        return [load, (0x15, 1, 0, value), keep]  # jeq value: skip the keep, else keep

    ldb_ind, ldh_ind, ld_ind, ld_mem, st_mem, ja = 0x50, 0x48, 0x40, 0x60, 0x02, 0x05
    prog: list[Instruction] = [
        (0x30, 0, 0, 12),  # ldb [12]: TCP data offset (high nibble)
        (0x54, 0, 0, 0xF0),  # and #0xf0
        (0x74, 0, 0, 2),  # rsh #2: header length in bytes
        (0x07, 0, 0, 0),  # tax
        (0x80, 0, 0, 0),  # ld len
        (0x1C, 0, 0, 0),  # sub x: payload length
        (st_mem, 0, 0, 0),  # st M[0]: kept for the IPv6 length check
        (0x35, 1, 0, CONN_REQ_LEN),  # jge #CONN_REQ_LEN: skip the keep
        keep,
    ]
    magic = UCX_MAGIC.to_bytes(8, "little")
    prog += must_equal((ld_ind, 0, 0, 0), int.from_bytes(magic[:4], "big"))
    prog += must_equal((ld_ind, 0, 0, 4), int.from_bytes(magic[4:], "big"))
    prog += must_equal((ldb_ind, 0, 0, 8), _AM_ID_CM)
    prog += [(ldb_ind, 0, 0, _EVENT_AT), (0x45, 1, 0, 1), keep]  # jset #1: a request

    v4: list[Instruction] = []
    v6: list[Instruction] = [(ld_mem, 0, 0, 0), (0x35, 1, 0, CONN_REQ_LEN_V6), miss]
    for host, port in sorted(refused):
        port_is = (ldh_ind, 0, 0, _PORT_AT)
        if host in WILDCARDS:
            v4 += [port_is, (0x15, 0, 1, port), hit]  # jeq port: hit, else skip it
            v6 += [port_is, (0x15, 0, 1, port), hit]
            continue
        address = ipaddress.ip_address(host)
        if address.version == 4:
            v4 += [port_is, (0x15, 0, 3, port), (ld_ind, 0, 0, _V4_AT), (0x15, 0, 1, int(address)), hit]
        else:
            words = [int.from_bytes(address.packed[i : i + 4], "big") for i in range(0, 16, 4)]
            v6 += [port_is, (0x15, 0, 9, port)]  # each word's jeq skips to past the hit
            for i, word in enumerate(words):
                v6 += [(ld_ind, 0, 0, _V6_AT + 4 * i), (0x15, 0, 7 - 2 * i, word)]
            v6.append(hit)
    v4.append(miss)
    v6.append(miss)
    # the address family: jump to its section (``ja`` reaches past 255 instructions; jeq cannot)
    prog += [
        (ldh_ind, 0, 0, _ADDR_AT),
        (0x15, 0, 1, _family_code(socket.AF_INET)),
        (ja, 0, 0, 3),  # to v4
        (0x15, 0, 1, _family_code(socket.AF_INET6)),
        (ja, 0, 0, 1 + len(v4)),  # to v6
        miss,
    ]
    return prog + v4 + v6


def _attach(fd: int, inode: int, prog: list[tuple[int, int, int, int]] | None) -> bool:
    """Set (None: remove) the socket filter of listener ``inode`` held as ``fd``."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        info = os.fstat(dup)
        if not stat.S_ISSOCK(info.st_mode) or info.st_ino != inode:
            return False
        with socket.socket(fileno=dup) as sock:
            dup = -1
            if prog is None:
                with contextlib.suppress(OSError):  # ENOENT: none attached
                    sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
                return True
            code = b"".join(struct.pack("HBBI", *ins) for ins in prog)
            buf = ctypes.create_string_buffer(code, len(code))
            fprog = struct.pack("HL", len(prog), ctypes.addressof(buf))
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            except OSError:  # ENOMEM: past the socket's option memory (net.core.optmem_max)
                return False
            return True
    finally:
        if dup >= 0:
            os.close(dup)


def _own_listener_sockets(
    own_listeners: Iterable[tuple[str, int]], table: list[TcpSocket] | None = None
) -> list[tuple[int, int, tuple[str, int]]]:
    """``(inode, fd, address)`` of this process's listening sockets at ``own_listeners``."""
    wanted = set(own_listeners)
    mine = own_socket_fds()
    return [
        (s.inode, mine[s.inode], s.local)
        for s in (sockets() if table is None else table)
        if s.state == LISTEN and s.inode in mine and s.local in wanted
    ]


def refusable(peer_listeners: Iterable[tuple[str, int]] | None) -> tuple[set[tuple[str, int]], bool]:
    """The peer's listener addresses a filter can name, and whether that is all of them."""
    out, whole = set(), True
    for host, port in peer_listeners or ():
        try:
            if host not in WILDCARDS:
                ipaddress.ip_address(host)
        except ValueError:
            whole = False
            continue
        out.add((host, port))
    return out, whole


def _fits(program: list[Instruction] | None) -> bool:
    return program is None or len(program) <= BPF_MAXINSNS


def _update(
    own_listeners: Iterable[tuple[str, int]],
    add: set[tuple[str, int]] = frozenset(),  # type: ignore[assignment]
    remove: set[tuple[str, int]] = frozenset(),  # type: ignore[assignment]
    *,
    accepted: bool = False,
    loaded: Iterable[tuple[str, int]] | None = None,
) -> list[int]:
    """Refuse ``add`` and lift ``remove`` on each listener; ``accepted``: give the connections
    each one accepted (which carry the filter it had then) its new filter too. ``loaded``: the
    listeners of every peer loaded now; a listener whose refused set no longer fits its filter
    then turns allow-only (:data:`_allowed`), which takes only their connection requests.
    None: not known (a loaded peer published none): a listener refuses exactly (an allow-only
    one goes back to its refused set, kept for this, where that fits; else it is not done)."""
    done = []
    live = None if loaded is None else refusable(loaded)[0]
    with _refusals_lock:
        table = sockets()
        held = _own_listener_sockets(own_listeners, table)
        mine = own_socket_fds()
        for stale in (_refusals, _allowed):
            for inode in [i for i in stale if i not in mine]:
                del stale[inode]  # a listener closed since
        for inode, fd, address in held:
            allowed = _allowed.get(inode)
            before = _refusals.get(inode, set())
            refused = (before | add) - remove
            program: list[Instruction] | None
            if allowed is not None and live is not None:
                # allow-only: the loaded peers' listeners, never one being refused now
                new = set(live) - add
                if new == allowed and not accepted:
                    _remember(inode, refused)
                    done.append(inode)
                    continue
                program = _program(new, allow_only=True)
                if not _fits(program) or not _attach(fd, inode, program):
                    continue
                _allowed[inode] = new
                _remember(inode, refused)
            else:
                if refused == before and allowed is None and not accepted:
                    done.append(inode)  # its filter already says so
                    continue
                # Allow-only as soon as it is the shorter filter: a replaced filter's memory is
                # still charged while its successor is attached, so a long one cannot be swapped
                # for a short one once the socket's option memory is nearly spent.
                smaller = live is not None and len(refused) > EXACT_REFUSALS and len(live) < len(refused)
                program = _program(refused) if refused else None
                if (
                    not smaller
                    and len(refused) <= MAX_REFUSED
                    and _fits(program)
                    and _attach(fd, inode, program)
                ):
                    _allowed.pop(inode, None)
                    _remember(inode, refused)
                elif live is not None:
                    new = set(live) - add
                    program = _program(new, allow_only=True)
                    if not _fits(program) or not _attach(fd, inode, program):
                        continue
                    _allowed[inode] = new
                    _remember(inode, refused)  # kept: the way back to exact refusal
                elif allowed is not None:
                    # Its refused set no longer fits: it stays allow-only (a loaded peer whose
                    # listeners are unknown stays refused), refusing ``add`` too.
                    new = allowed - add
                    program = _program(new, allow_only=True)
                    if (new != allowed or accepted) and (
                        not _fits(program) or not _attach(fd, inode, program)
                    ):
                        continue
                    _allowed[inode] = new
                    _remember(inode, refused)
                else:
                    continue
            done.append(inode)
            if accepted:
                for row in table:
                    if row.local == address and row.state != LISTEN and row.inode in mine:
                        _attach(mine[row.inode], row.inode, program)
    return done


def _remember(inode: int, refused: set[tuple[str, int]]) -> None:
    if refused:
        _refusals[inode] = refused
    else:
        _refusals.pop(inode, None)


def _refuses(inode: int, peer: set[tuple[str, int]]) -> bool:
    allowed = _allowed.get(inode)
    if allowed is not None:
        return not (peer & allowed) and not any((h, p) in allowed for h in WILDCARDS for _, p in peer)
    return peer <= _refusals.get(inode, set())


def refuse(
    peer_listeners: Iterable[tuple[str, int]] | None,
    own_listeners: Iterable[tuple[str, int]],
    loaded: Iterable[tuple[str, int]] | None = None,
) -> bool:
    """From now on, the kernel drops every UCX connection request naming one of
    ``peer_listeners`` that reaches one of this process's ``own_listeners``, on connections
    accepted after this call (an earlier one must be shut down): the peer's UCX cannot set up a
    connection here, so nothing it queued can be sent here. True only if every listener refuses
    every one of them (False: a peer that published no listener or one that is not an IP
    address, no listener of ours found, a filter grown past :data:`MAX_REFUSED` addresses or
    :data:`BPF_MAXINSNS` instructions): a fence must not rely on a refusal that returned False.
    ``loaded``: the listeners of every peer loaded now (the peer refused is not one of them); a
    listener whose filter cannot hold one more refused address then refuses every address but
    those (allow-only), so a fence never fails for the addresses of processes fenced long ago."""
    peer, whole = refusable(peer_listeners)
    own = list(own_listeners)
    if not peer or not own:
        return False
    held = _update(own, add=peer, loaded=loaded)
    with _refusals_lock:
        return (
            whole
            and bool(held)
            and len(held) == len(_own_listener_sockets(own))
            and all(_refuses(inode, peer) for inode in held)
        )


def admit(
    peer_listeners: Iterable[tuple[str, int]] | None,
    own_listeners: Iterable[tuple[str, int]],
    loaded: Iterable[tuple[str, int]] | None = None,
) -> None:
    """Lift :func:`refuse` for ``peer_listeners`` on ``own_listeners`` (the peer was loaded
    again), on the listeners and on the connections they accepted meanwhile: the peer's UCX may
    still be retransmitting a refused connection request on one of those (its endpoint waits
    for the acknowledgement), and that endpoint is the one its new traffic uses."""
    peer, _ = refusable(peer_listeners)
    if not _lifts_anything(peer):
        return  # no listener refuses these addresses, none is or may turn allow-only: no change
    if peer or loaded is None:  # None: a peer whose listeners are unknown is loaded (refuse exactly)
        _update(list(own_listeners), remove=peer, accepted=True, loaded=loaded)


def _lifts_anything(peer: set[tuple[str, int]]) -> bool:
    """Whether :func:`admit` of ``peer`` may change a filter of this process: a listener
    refuses one of its addresses, one is allow-only (every load may change what it takes), or
    one refuses more than ``EXACT_REFUSALS`` addresses (an update may turn it allow-only).
    Checked before the socket table is read: a load of a peer never refused (nearly every
    handshake) costs no filter rebuild on the listener and its accepted connections."""
    with _refusals_lock:
        if _allowed:
            return True
        return any(
            len(refused) > EXACT_REFUSALS or not refused.isdisjoint(peer) for refused in _refusals.values()
        )


def refused(own_listeners: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
    """The peer addresses this process's ``own_listeners`` refuse (a listener in allow-only
    mode refuses these and every other address but :func:`allowed`'s)."""
    with _refusals_lock:
        out: set[tuple[str, int]] = set()
        for inode, _, _ in _own_listener_sockets(own_listeners):
            out |= _refusals.get(inode, set())
        return out


def allowed(own_listeners: Iterable[tuple[str, int]]) -> set[tuple[str, int]] | None:
    """The only peer addresses ``own_listeners`` take connection requests from, once one of
    them turned allow-only (None: none did)."""
    with _refusals_lock:
        out: set[tuple[str, int]] | None = None
        for inode, _, _ in _own_listener_sockets(own_listeners):
            if inode in _allowed:
                out = (out or set()) | _allowed[inode]
        return out
