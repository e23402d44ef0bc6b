"""The side channel's connection bounds: which connections a server keeps, which it shuts
down (over the cap, or idle), and warnings that cannot flood the log (docs/security.md).

ZMQ has no per-connection cap, so the server feeds its ROUTER's socket-monitor events
(``ACCEPTED``, ``HANDSHAKE_SUCCEEDED``, ``DISCONNECTED`` carry the connection's fd) and each
request's source fd to a :class:`ConnectionTracker`, which shuts connections down with
``shutdown(2)``: libzmq owns the descriptors and closes them itself on the EOF.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time

import zmq

from kvpush.core.sidechannel_auth import SECRET_ENV

WARNING_INTERVAL_S = 10.0
"""A kind of warning is logged at most once per interval; the next one counts those suppressed."""
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
MONITORED_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | HANDSHAKE_FAILED
)


class RateLimitedWarnings:
    """Logs each kind of warning at most once per ``interval_s``, counting the ones it skipped."""

    def __init__(self, logger: logging.Logger, prefix: str, interval_s: float | None = None) -> None:
        self._logger = logger
        self._prefix = prefix
        self._interval_s = WARNING_INTERVAL_S if interval_s is None else interval_s
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._suppressed[kind] += 1
            return
        self._last[kind] = now
        skipped = self._suppressed.pop(kind, 0)
        suffix = f" ({skipped} more like it in the last {now - last:.0f}s)" if skipped and last else ""
        self._logger.warning("%s%s%s", self._prefix, message, suffix)


class _Conn:
    __slots__ = ("last_active", "requests")

    def __init__(self, now: float) -> None:
        self.last_active = now
        self.requests = 0


class ConnectionTracker:
    """The open connections of one server by fd, least recently active first, split into those
    that have not sent a request yet (shut down first when over the cap) and those that have."""

    def __init__(
        self, port: int, max_connections: int, idle_timeout_s: float, warnings: RateLimitedWarnings
    ) -> None:
        self.port = port
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._warnings = warnings
        self._waiting: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self._asked: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self.stats = dict.fromkeys(
            (
                "connections_accepted",
                "peak_connections",
                "connections_evicted",
                "connections_idle_closed",
                "handshakes_failed",
                "accepts_failed",
            ),
            0,
        )

    def __len__(self) -> int:
        return len(self._waiting) + len(self._asked)

    def on_event(self, kind: int, value: int) -> None:
        """One socket-monitor event of the server's ROUTER."""
        if kind == zmq.EVENT_ACCEPTED:
            self._waiting[value] = _Conn(time.monotonic())
            self.stats["connections_accepted"] += 1
            self.stats["peak_connections"] = max(self.stats["peak_connections"], len(self))
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.touch(value)  # progress: a stalled connection is shut down before this one
        elif kind == zmq.EVENT_DISCONNECTED:
            self._waiting.pop(value, None)
            self._asked.pop(value, None)
        elif kind == zmq.EVENT_ACCEPT_FAILED:
            self.stats["accepts_failed"] += 1
            self._warnings.warn("accept", f"accept failed: {os.strerror(value)}")
        elif kind & HANDSHAKE_FAILED:
            self.stats["handshakes_failed"] += 1
            self._warnings.warn(
                "handshake",
                "a connection failed its handshake (timed out, or a peer without the same "
                f"{SECRET_ENV}: {zmq.Event(kind).name} {value})",
            )

    def touch(self, fd: int, request: bool = False) -> None:
        """The connection on ``fd`` made progress (handshake, or a request): most recent last."""
        conn = self._waiting.pop(fd, None) if request else self._waiting.get(fd)
        if conn is None:
            conn = self._asked.get(fd)
        if conn is None:
            return
        conn.last_active = time.monotonic()
        conn.requests += request
        if conn.requests:
            self._asked[fd] = conn
            self._asked.move_to_end(fd)
        else:
            self._waiting.move_to_end(fd)

    def enforce(self) -> None:
        """Shut down connections idle for ``idle_timeout_s``, then the least recently active
        ones (those that never asked first) while more than ``max_connections`` are open."""
        idle_before = time.monotonic() - self.idle_timeout_s
        for conns in (self._waiting, self._asked):
            while conns:
                fd, conn = next(iter(conns.items()))
                if conn.last_active >= idle_before:
                    break
                del conns[fd]
                self.stats["connections_idle_closed"] += self._shut_down(fd)
        while len(self) > self.max_connections:
            fd, _ = (self._waiting or self._asked).popitem(last=False)
            self.stats["connections_evicted"] += self._shut_down(fd)
            self._warnings.warn(
                "evicted", f"{self.max_connections} connections open; shut down the least recently active"
            )

    def _shut_down(self, fd: int) -> bool:
        """Shut down (not close: libzmq owns the fd and closes it on the EOF) one accepted TCP
        connection, after checking the fd is still a connection to our port: a descriptor that
        libzmq closed and the process reused for something else is left alone."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return False
        try:
            if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != self.port:
                return False
            sock.getpeername()  # the listening socket has no peer
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            sock.detach()
