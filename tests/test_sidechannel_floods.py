"""Side-channel floods (issue 16, item 4), bounded in count and time, on 127.0.0.1 only.

The server runs in a process of its own (its RSS and file descriptors are measured from
``/proc``, under the usual soft limit of 1024 descriptors); the attackers and the legitimate
client run here. Each test prints its figures (``pytest -s``); docs/security.md records them.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvpush.core import wire
from kvpush.core.sidechannel import (
    DEFAULT_MAX_CONNECTIONS,
    GET_META,
    MONITOR_BUDGET,
    SECRET_ENV,
    fetch_metadata,
)
from kvpush.core.types import RankKey

R0 = RankKey(0, 0)
SERVER_NOFILE = 1024
FETCH_TIMEOUT_S = 2.0
"""Each legitimate fetch's own bound: a flood that stalls the server makes it fail."""
CHURN_FETCH_TIMEOUT_S = 10.0
"""The bound under 1200 clients reconnecting every 100 ms when shut down (~10k connections/s on
two cores): answered, not fast; a SYN dropped by a full accept queue alone costs 1 s, then 2 s."""

SERVER = r"""
import json, resource, sys
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import RankKey
args = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (args["nofile"], resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
server = SideChannelServer("flood", **args["server"])
server.publish(RankKey(0, 0), b"m" * args["payload"])
print(json.dumps({"port": server.port}), flush=True)
for line in sys.stdin:
    if line.strip() != "stats":
        break
    print(json.dumps(server.stats()), flush=True)
server.close()
"""


class ServerProcess:
    """A side-channel server in a child process, with a line protocol for its stats."""

    def __init__(self, payload: int, **server: Any) -> None:
        args = json.dumps({"nofile": SERVER_NOFILE, "payload": payload, "server": server})
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        self.payload = b"m" * payload
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.port = self._read(30)["port"]
        self.peak_fds = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _read(self, wait_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], wait_s)
        assert ready, f"the server process said nothing within {wait_s}s"
        return json.loads(self.proc.stdout.readline())

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return self._read(10)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            line = next(x for x in status if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def _sample(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak_fds = max(self.peak_fds, self.fds())
            time.sleep(0.005)

    def fetch(self, timeout_s: float = FETCH_TIMEOUT_S) -> float:
        """One legitimate fetch; its latency in seconds."""
        started = time.perf_counter()
        assert fetch_metadata("127.0.0.1", self.port, R0, timeout_s=timeout_s) == self.payload
        return time.perf_counter() - started

    def close(self) -> None:
        self._stop.set()
        self._sampler.join(timeout=5)
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class Attackers:
    """The attacking ZMQ sockets, in a context of their own, closed without lingering."""

    def __init__(self) -> None:
        self.ctx = zmq.Context(io_threads=2)
        self.ctx.set(zmq.MAX_SOCKETS, 4096)
        self.sockets: list[zmq.Socket] = []

    def dealer(self, port: int, **options: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        sock.connect(f"tcp://127.0.0.1:{port}")
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def attackers() -> Iterator[Attackers]:
    attackers = Attackers()
    try:
        yield attackers
    finally:
        attackers.close()


@pytest.fixture
def many_fds() -> Iterator[None]:
    """Raise this process's soft descriptor limit for the attacking clients (not the server's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4000:
        pytest.skip(f"needs 4000 file descriptors for the clients; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 8000), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _bomb(size: int) -> bytes:
    """A msgpack array of empty maps filling ``size`` bytes: one frame unpacks into ~size objects."""
    count = size - 5
    return b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count


def _fetch_during(server: ServerProcess, busy: threading.Thread, at_least: int) -> list[float]:
    """Legitimate fetches, one after another, while ``busy`` runs (at least ``at_least``)."""
    latencies = []
    while busy.is_alive() or len(latencies) < at_least:
        latencies.append(server.fetch())
        time.sleep(0.02)
    return latencies


def _report(name: str, **figures: Any) -> None:
    print(f"\n[flood] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def test_msgpack_bombs_do_not_delay_legitimate_fetches(attackers: Attackers) -> None:
    """40 clients x 10 frames of MAX_FRAME_BYTES, each ~1M empty maps: libzmq cuts each at its
    header (over the transport limit); the one serving thread never decodes them."""
    server = ServerProcess(payload=256 << 10)
    bomb = _bomb(wire.MAX_FRAME_BYTES)
    clients = []
    try:
        baseline = [server.fetch() for _ in range(5)]

        def flood() -> None:
            for _ in range(40):
                clients.append(attackers.dealer(server.port, SNDHWM=20))
            for _ in range(10):
                for dealer in clients:
                    dealer.send_multipart([b"", bomb], copy=False)
            time.sleep(1.0)  # let the queued bombs go out and reconnect

        busy = threading.Thread(target=flood)
        busy.start()
        try:
            latencies = _fetch_during(server, busy, at_least=20)
        finally:
            busy.join(timeout=30)  # its sockets are closed by the fixture, after it ended
        stats = server.stats()
    finally:
        server.close()
    _report(
        "40 clients x 10 bombs",
        fetches=len(latencies),
        baseline_max_ms=round(max(baseline) * 1e3, 1),
        max_ms=round(max(latencies) * 1e3, 1),
        median_ms=round(sorted(latencies)[len(latencies) // 2] * 1e3, 1),
        connections_accepted=stats["connections_accepted"],
    )
    assert stats["connections_accepted"] >= 40, "the bombs never reached the server"
    assert stats["requests_served"] == len(latencies) + len(baseline)
    assert stats["requests_rejected"] == 0, "a bomb was read and decoded"


def test_unread_requests_do_not_grow_the_server(attackers: Attackers) -> None:
    """4 clients x 1000 requests, no reply read: each connection holds at most 2 queued replies
    (the rest are dropped), so the server's RSS stays flat."""
    server = ServerProcess(payload=512 << 10)
    try:
        server.fetch()
        before = server.rss_mb()
        request = wire.pack([GET_META, wire.WIRE_VERSION, 0, 0])
        clients = []
        for _ in range(4):
            clients.append(attackers.dealer(server.port, SNDHWM=2000, RCVHWM=1, RCVBUF=4096))
        for dealer in clients:
            for _ in range(1000):
                dealer.send_multipart([b"", request])
        deadline = time.monotonic() + 30
        peak = before
        while time.monotonic() < deadline:
            stats = server.stats()
            peak = max(peak, server.rss_mb())
            if stats["requests_served"] + stats["replies_dropped"] >= 4001:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        peak = max(peak, server.rss_mb())
        latency = server.fetch()
    finally:
        server.close()
    _report(
        "4 x 1000 unread requests (512 KiB replies)",
        rss_before_mb=round(before, 1),
        rss_peak_mb=round(peak, 1),
        growth_mb=round(peak - before, 1),
        replies_dropped=stats["replies_dropped"],
        then_fetch_ms=round(latency * 1e3, 1),
    )
    assert stats["requests_served"] + stats["replies_dropped"] >= 4001, stats
    assert stats["replies_dropped"] >= 3900, stats
    assert peak - before < 50, f"server RSS grew {peak - before:.0f} MB"


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
def test_idle_clients_do_not_take_every_descriptor(kind: str, attackers: Attackers, many_fds: None) -> None:
    """1200 idle connections (raw TCP, or ZMQ sockets that reconnect when shut down) against a
    server limited to 1024 descriptors: it keeps at most max_connections and still answers."""
    server = ServerProcess(payload=64 << 10, zmtp_handshake_timeout_s=30)
    idle: list[Any] = []
    try:
        fds_before = server.fds()
        for _ in range(1200):
            if kind == "tcp":
                idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            else:
                idle.append(attackers.dealer(server.port))
        time.sleep(1.0)
        latencies = [server.fetch(CHURN_FETCH_TIMEOUT_S) for _ in range(5)]
        stats = server.stats()
        fds_after = server.fds()
    finally:
        for conn in idle:
            if isinstance(conn, socket.socket):
                conn.close()
        server.close()
    _report(
        f"1200 idle {kind} clients",
        fetch_max_ms=round(max(latencies) * 1e3, 1),
        server_fds_before=fds_before,
        server_fds_peak=server.peak_fds,
        server_fds_after=fds_after,
        peak_connections=stats["peak_connections"],
        evicted=stats["connections_evicted"],
        accepts_failed=stats["accepts_failed"],
    )
    assert stats["accepts_failed"] == 0, "the server ran out of descriptors"
    assert server.peak_fds < SERVER_NOFILE
    assert stats["connections"] <= DEFAULT_MAX_CONNECTIONS + MONITOR_BUDGET
    if kind == "tcp":  # nobody reconnects: the server settles at its cap
        assert (
            stats["connections"] <= DEFAULT_MAX_CONNECTIONS
            and fds_after < fds_before + DEFAULT_MAX_CONNECTIONS + 20
        )
