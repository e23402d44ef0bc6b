"""The side channel: a ZMQ ROUTER server per engine serving each rank's handshake payload,
and a REQ client with a bounded wait.

Request (msgpack array): ``["GET_META", wire_version, pp_rank, tp_rank]``.
Reply (msgpack map): ``{"payload": bytes | None, "error": str | None}``.
A bad request gets an error reply and a (rate-limited) log line; the server keeps serving.

The payload is a key to the engine's memory (NIXL agent blob: UCX address + remote keys), so:

* **Secret** (``secret=`` argument, else ``KVPUSH_SIDE_CHANNEL_SECRET``): both ends speak ZMQ
  CURVE with a server keypair derived from the secret (scrypt), so the metadata travels encrypted
  and a recorded connection cannot be replayed (fresh per-connection keys). Inside, every request
  is also sealed ``b"KVPA" + HMAC-SHA256(secret, b"req" + nonce + body) + nonce + body``.
* **Off loopback a secret is required**: binding a non-loopback address without one raises
  ``ConfigError`` unless ``insecure=True``.
* **Bounds**: requests over ``MAX_REQUEST_BYTES`` are refused before decoding (ZMQ drops a
  connection sending over ``TRANSPORT_LIMIT_BYTES``), requests and replies are unpacked with
  msgpack length limits, at most ``max_queued_replies`` replies wait per connection (more
  requests from a peer with unread replies are dropped), at most ``max_connections`` connections
  are kept (the least recently active one is shut down) and a connection idle for
  ``idle_timeout_s`` is shut down. docs/security.md has the threat model and the measurements.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack
import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from kvpush.core import wire
from kvpush.core.errors import ConfigError, HandshakeError, WireError
from kvpush.core.types import RankKey

logger = logging.getLogger(__name__)

GET_META = "GET_META"
DEFAULT_HOST = "127.0.0.1"
SECRET_ENV = "KVPUSH_SIDE_CHANNEL_SECRET"
AUTH_MAGIC = b"KVPA"
NONCE_BYTES = 16
AUTH_OVERHEAD = len(AUTH_MAGIC) + hashlib.sha256().digest_size + NONCE_BYTES

MAX_REQUEST_BYTES = 128
"""Largest request the server decodes: a request is at most 37 bytes of msgpack, plus the
52-byte HMAC envelope when a secret is set."""
TRANSPORT_LIMIT_BYTES = 1024
"""ZMQ ``MAXMSGSIZE`` of the server: larger frames cut the connection before they are read.
Above ``MAX_REQUEST_BYTES`` because the CURVE handshake's commands (~300 bytes) obey it too."""
CURVE_OVERHEAD = 33
"""Bytes CURVE adds to each frame (counted against the client's ``MAXMSGSIZE``)."""
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_IDLE_TIMEOUT_S = 10.0
DEFAULT_ZMTP_HANDSHAKE_TIMEOUT_S = 2.0
DEFAULT_MAX_QUEUED_REPLIES = 2
WARNING_INTERVAL_S = 10.0
"""A kind of warning is logged at most once per interval; the next one counts those suppressed."""
CLIENT_HANDSHAKE_FAILURES = 3
"""Failed CURVE handshakes in a row after which ``fetch_metadata`` gives up (wrong secret)."""

_REQUEST_LIMITS = {
    "max_str_len": 32,
    "max_bin_len": 64,
    "max_array_len": 8,
    "max_map_len": 8,
    "max_ext_len": 0,
}
_REPLY_LIMITS = {"max_str_len": 1 << 16, "max_array_len": 16, "max_map_len": 8, "max_ext_len": 0}
_KDF_SALT = b"kvpush side channel CURVE keys v1"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_SERVER_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | _HANDSHAKE_FAILED
)
CLIENT_RESENDS = 5
"""Times ``fetch_metadata`` re-sends its request after its connection dropped (a server at its
connection cap shuts down the least recently active connection)."""


def _secret(secret: bytes | str | None) -> bytes | None:
    """The shared secret: the argument, else ``KVPUSH_SIDE_CHANNEL_SECRET``; None when unset."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    return secret or None


class CurveKeys(NamedTuple):
    """Z85 CURVE keys both ends derive from the shared secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@functools.lru_cache(maxsize=8)
def curve_keys(secret: bytes) -> CurveKeys:
    """The CURVE keypairs of ``secret``: scrypt (n=2**14, r=8; ~50 ms, once per process and
    secret) so that a recorded handshake does not let a weak secret be guessed quickly."""
    material = hashlib.scrypt(secret, salt=_KDF_SALT, n=1 << 14, r=8, p=1, dklen=64)
    server_secret = zmq.utils.z85.encode(material[:32])
    client_secret = zmq.utils.z85.encode(material[32:])
    return CurveKeys(
        zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is only reachable from this machine."""
    name = host.strip().strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    if name in ("", "*"):
        return False
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def _mac(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(secret, direction + nonce + body, hashlib.sha256).digest()


def seal(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    """Wrap ``body`` with its HMAC (``direction`` is ``b"req"``)."""
    return AUTH_MAGIC + _mac(secret, direction, nonce, body) + nonce + body


def unseal(secret: bytes, direction: bytes, frame: bytes, nonce: bytes | None = None) -> tuple[bytes, bytes]:
    """``(nonce, body)`` of a sealed frame; raises ``HandshakeError`` if it is not sealed with
    ``secret`` (or not for ``nonce``)."""
    digest = hashlib.sha256().digest_size
    if not frame.startswith(AUTH_MAGIC) or len(frame) < AUTH_OVERHEAD:
        raise HandshakeError(
            f"the side channel needs authentication (HMAC-SHA256 with the shared secret in "
            f"{SECRET_ENV}) and this message carries none; set the same secret on both engines"
        )
    mac = frame[len(AUTH_MAGIC) : len(AUTH_MAGIC) + digest]
    got_nonce = frame[len(AUTH_MAGIC) + digest : AUTH_OVERHEAD]
    body = frame[AUTH_OVERHEAD:]
    if (nonce is not None and got_nonce != nonce) or not hmac.compare_digest(
        mac, _mac(secret, direction, got_nonce, body)
    ):
        raise HandshakeError(
            f"side-channel message failed HMAC authentication; the engines do not share the same {SECRET_ENV}"
        )
    return got_nonce, body


def _unpack(data: bytes, what: str, limits: Mapping[str, int]) -> Any:
    """msgpack-decode ``data`` with length limits, so a small frame cannot expand into millions
    of objects; ``WireError`` naming ``what`` otherwise."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, **limits)
    except Exception as err:  # msgpack raises several unrelated types
        raise WireError(f"{what} is not valid msgpack ({type(err).__name__}: {err})") from None


class _Warnings:
    """Logs each kind of warning at most once per ``interval_s``, counting the ones it skipped."""

    def __init__(self, prefix: str, interval_s: float | None = None) -> None:
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
        logger.warning("%s%s%s", self._prefix, message, suffix)


class _Conn:
    __slots__ = ("accepted_at", "last_active", "requests")

    def __init__(self, now: float) -> None:
        self.accepted_at = now
        self.last_active = now
        self.requests = 0


def _positive(name: str, value: float, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"SideChannelServer {name}={value!r} must be a positive number; {fix}")


class SideChannelServer:
    """Serves the handshake payload of every ``(pp_rank, tp_rank)`` of one engine, within bounds
    (see the module docstring). ``stats()`` counts what it served, refused and shut down."""

    def __init__(
        self,
        engine_id: str,
        host: str = DEFAULT_HOST,
        port: int = 0,
        *,
        secret: bytes | str | None = None,
        insecure: bool = False,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        zmtp_handshake_timeout_s: float = DEFAULT_ZMTP_HANDSHAKE_TIMEOUT_S,
        max_queued_replies: int = DEFAULT_MAX_QUEUED_REPLIES,
        max_reply_bytes: int | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.host = host
        self._secret = _secret(secret)
        if self._secret is None and not insecure and not is_loopback(host):
            raise ConfigError(
                f"side channel of engine {engine_id!r} would serve its NIXL metadata (UCX address and "
                f"memory keys) in clear text to anyone reaching {host}: set {SECRET_ENV} (or secret=) "
                f"to the same value on every engine, bind 127.0.0.1, or pass insecure=True if every "
                f"host on that network is trusted"
            )
        _positive("max_connections", max_connections, "e.g. 128")
        _positive("idle_timeout_s", idle_timeout_s, "e.g. 10")
        _positive("zmtp_handshake_timeout_s", zmtp_handshake_timeout_s, "e.g. 2")
        _positive("max_queued_replies", max_queued_replies, "1 or 2")
        self.max_connections = int(max_connections)
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_reply_bytes = max_reply_bytes or wire.MAX_FRAME_BYTES
        self._warnings = _Warnings(f"side channel of {engine_id}: ")
        self._replies: dict[RankKey, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Open connections by fd, least recently active first: those that have not asked yet
        # (shut down first when over the cap), and those that have.
        self._waiting: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self._asked: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self.requests_served = 0
        self.requests_rejected = 0
        self.replies_dropped = 0
        self.handshakes_failed = 0
        self.accepts_failed = 0
        self.connections_accepted = 0
        self.connections_evicted = 0
        self.connections_idle_closed = 0
        self.peak_connections = 0
        # A context of our own: one I/O thread (monitor events arrive in order) and floods on
        # this port do not share a thread with the engine's other ZMQ sockets.
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_LIMIT_BYTES)
        self._router.setsockopt(zmq.SNDHWM, int(max_queued_replies))
        self._router.setsockopt(zmq.RCVHWM, 8)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full reply queue raises, not blocks
        self._router.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(zmtp_handshake_timeout_s * 1000)))
        # Pending connections cost no descriptor; a full backlog drops SYNs (1 s client retry).
        self._router.setsockopt(zmq.BACKLOG, 128)
        if self._secret is not None:
            keys = curve_keys(self._secret)
            self._router.curve_server = True
            self._router.curve_secretkey = keys.server_secret
        monitor_address = f"inproc://kvpush-side-channel-monitor-{uuid.uuid4().hex}"
        self._router.monitor(monitor_address, _SERVER_EVENTS)
        self._monitor = self._ctx.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(monitor_address)
        address = f"tcp://{host}"
        try:
            if port == 0:
                self.port = self._router.bind_to_random_port(address)
            else:
                self._router.bind(f"{address}:{port}")
                self.port = port
        except zmq.ZMQError as err:
            self._close_sockets()
            raise HandshakeError(
                f"side channel of engine {engine_id!r} cannot bind {address}:{port}: {err}; pick another port"
            ) from err
        if self._secret is None and not is_loopback(host):
            logger.warning(
                "side channel of %s serves NIXL metadata in clear text on %s (insecure=True)",
                engine_id,
                self.address,
            )
        self._thread = threading.Thread(
            target=self._serve, name=f"kvpush-side-channel-{engine_id}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections the server holds now (accepted and not yet closed)."""
        return len(self._waiting) + len(self._asked)

    def stats(self) -> dict[str, int]:
        return {
            "requests_served": self.requests_served,
            "requests_rejected": self.requests_rejected,
            "replies_dropped": self.replies_dropped,
            "handshakes_failed": self.handshakes_failed,
            "accepts_failed": self.accepts_failed,
            "connections_accepted": self.connections_accepted,
            "connections": self.connections,
            "peak_connections": self.peak_connections,
            "connections_evicted": self.connections_evicted,
            "connections_idle_closed": self.connections_idle_closed,
        }

    def publish(self, rank: RankKey, payload: bytes) -> None:
        """Serve ``payload`` for ``rank`` from now on (replacing any earlier one)."""
        self.publish_all({rank: payload})

    def publish_all(self, payloads: Mapping[RankKey, bytes]) -> None:
        replies = {}
        for rank, payload in payloads.items():
            # A reply over the client's MAXMSGSIZE would be dropped there and surface as a
            # misleading "no answer" timeout: refuse it here instead.
            reply = wire.pack({"payload": payload, "error": None})
            size = len(reply) + CURVE_OVERHEAD * bool(self._secret)
            if size > self.max_reply_bytes:
                raise WireError(
                    f"handshake payload of engine {self.engine_id!r} rank {rank} is {size} bytes; "
                    f"the side channel carries at most {self.max_reply_bytes} (too many KV regions?)"
                )
            replies[rank] = reply
        with self._lock:
            self._replies.update(replies)

    # ------------------------------------------------------------------------ requests

    def _reply_for(self, frame: bytes) -> tuple[bytes, str | None]:
        """The reply to one request frame and, for a refusal, the error."""
        if len(frame) > MAX_REQUEST_BYTES:
            return self._error(
                f"request of {len(frame)} bytes refused: a side-channel request is at most "
                f"{MAX_REQUEST_BYTES}"
            )
        if self._secret is None:
            if frame.startswith(AUTH_MAGIC):
                return self._error(
                    f"engine {self.engine_id!r} has no side-channel secret but the request is "
                    f"authenticated; set {SECRET_ENV} on both engines or on neither"
                )
        else:
            try:
                frame = unseal(self._secret, b"req", frame)[1]
            except HandshakeError as err:
                return self._error(f"engine {self.engine_id!r} refused: {err}")
        try:
            request = _unpack(frame, "side-channel request", _REQUEST_LIMITS)
        except WireError as err:
            return self._error(str(err))
        if (
            not isinstance(request, list)
            or len(request) != 4
            or request[0] != GET_META
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in request[1:])
        ):
            return self._error('request must be ["GET_META", wire_version, pp_rank, tp_rank]')
        _, version, pp_rank, tp_rank = request
        if version != wire.WIRE_VERSION:
            return self._error(
                f"wire version {version} not supported; engine {self.engine_id!r} speaks {wire.WIRE_VERSION}"
            )
        with self._lock:
            reply = self._replies.get(RankKey(pp_rank, tp_rank)) if pp_rank >= 0 and tp_rank >= 0 else None
            known = sorted(self._replies)
        if reply is None:
            ranks = ", ".join(str(r) for r in known) or "none yet"
            return self._error(
                f"engine {self.engine_id!r} has no rank (pp={pp_rank}, tp={tp_rank}); it serves {ranks}"
            )
        return reply, None

    @staticmethod
    def _error(error: str) -> tuple[bytes, str]:
        return wire.pack({"payload": None, "error": error}), error

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                poller.poll(100)
                # Connection events first (a request can only come after its connection's),
                # then requests (a connection that asked is shut down last), then the bounds.
                self._drain_monitor()
                self._drain_requests()
                self._enforce_bounds()
            except zmq.ZMQError as err:
                if self._stop.is_set():
                    break
                self._warnings.warn("zmq", f"serving failed: {err}")

    def _drain_requests(self, budget: int = 64) -> None:
        for _ in range(budget):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._touch(frames[-1])
            if len(frames) != 3 or frames[1].bytes != b"":
                self.requests_rejected += 1
                self._warnings.warn(
                    "envelope", f"dropped a message of {len(frames)} frames (expected a REQ envelope)"
                )
                if len(frames) >= 2:
                    self._send(frames[0].bytes, self._error("expected exactly one request frame")[0])
                continue
            reply, error = self._reply_for(frames[2].bytes)
            if error is not None:
                self.requests_rejected += 1
                self._warnings.warn("rejected", f"rejected a request: {error}")
            else:
                self.requests_served += 1  # before the send: the client may read stats at once
            if not self._send(frames[0].bytes, reply) and error is None:
                self.requests_served -= 1

    def _touch(self, frame: zmq.Frame) -> None:
        """Mark the connection ``frame`` came from as active."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        self._touch_fd(fd, request=True)

    def _touch_fd(self, fd: int, request: bool = False) -> None:
        """The connection on ``fd`` made progress (handshake or request): most recent last."""
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

    def _send(self, identity: bytes, reply: bytes) -> bool:
        """Queue ``reply`` (zero-copy: every queued reply of a rank shares one buffer)."""
        for attempt in range(2):
            try:
                self._router.send_multipart([identity, b"", reply], zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if attempt == 0:
                    # send() processes libzmq's commands only every ~1 ms: the "peer read a
                    # reply" notice may be waiting. Reading EVENTS processes them; then retry.
                    self._router.getsockopt(zmq.EVENTS)
                    continue
                # The peer has max_queued_replies unread replies: drop this one, do not grow.
                self.replies_dropped += 1
                self._warnings.warn("unread", "dropped a request from a peer that does not read its replies")
            except zmq.ZMQError as err:  # EHOSTUNREACH: the peer left before its reply
                self._warnings.warn("send", f"reply failed: {err}")
                return False
        return False

    # ------------------------------------------------------------------------ connections

    def _drain_monitor(self, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._waiting[value] = _Conn(time.monotonic())
                self.connections_accepted += 1
                self.peak_connections = max(self.peak_connections, self.connections)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._touch_fd(value)  # progress: a stalled connection is shut down before it
            elif kind == zmq.EVENT_DISCONNECTED:
                self._waiting.pop(value, None)
                self._asked.pop(value, None)
            elif kind == zmq.EVENT_ACCEPT_FAILED:
                self.accepts_failed += 1
                self._warnings.warn("accept", f"accept failed: {os.strerror(value)}")
            elif kind & _HANDSHAKE_FAILED:
                self.handshakes_failed += 1
                self._warnings.warn(
                    "handshake",
                    "a connection failed its handshake (timed out, or a peer without the same "
                    f"{SECRET_ENV}: {zmq.Event(kind).name} {value})",
                )

    def _enforce_bounds(self) -> None:
        """Shut down connections idle for ``idle_timeout_s``, then apply the cap."""
        idle_before = time.monotonic() - self.idle_timeout_s
        for conns in (self._waiting, self._asked):
            while conns:
                fd, conn = next(iter(conns.items()))
                if conn.last_active >= idle_before:
                    break
                del conns[fd]
                self.connections_idle_closed += self._shut_down(fd)
        while self.connections > self.max_connections:
            fd, _ = (self._waiting or self._asked).popitem(last=False)
            self.connections_evicted += self._shut_down(fd)
            self._warnings.warn(
                "evicted", f"{self.max_connections} connections open; shut down the least recently active"
            )

    def _shut_down(self, fd: int) -> bool:
        """Shut down (not close: libzmq owns the fd and closes it on the EOF) one accepted TCP
        connection, after checking the fd is still a connection to our port."""
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

    def _close_sockets(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.disable_monitor()
        self._monitor.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():
            logger.warning("side channel of %s: serving thread did not stop within 2s", self.engine_id)
            return
        self._close_sockets()


def _handshake_error(address: str, rank: RankKey, has_secret: bool, mismatch: bool) -> str:
    """Why the handshake with a side channel failed, and what to do about it."""
    asking = f"(asking for rank {rank})"
    if has_secret and mismatch:
        return (
            f"side channel {address} serves without a secret but this engine has {SECRET_ENV} set "
            f"{asking}; set the same secret on both engines or on neither"
        )
    if has_secret:
        return (
            f"the CURVE handshake with side channel {address} failed {CLIENT_HANDSHAKE_FAILURES} times "
            f"{asking}; the engines do not share the same {SECRET_ENV}, or that engine has none"
        )
    return (
        f"side channel {address} requires a shared secret (CURVE encryption) and this engine has none "
        f"{asking}: the handshake failed; set the same {SECRET_ENV} on both engines"
    )


def fetch_metadata(
    host: str,
    port: int,
    rank: RankKey,
    *,
    timeout_s: float = 5.0,
    engine_id: str = "?",
    secret: bytes | str | None = None,
    max_reply_bytes: int | None = None,
) -> bytes:
    """Ask an engine's side channel for one rank's payload; raises ``HandshakeError`` on a
    timeout, a failed handshake or an error reply, naming the address, the rank and what was
    waited for. With a secret (argument or ``KVPUSH_SIDE_CHANNEL_SECRET``) the connection is
    CURVE-encrypted with the server key derived from it and the request is HMAC-sealed."""
    key = _secret(secret)
    nonce = os.urandom(NONCE_BYTES)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes or wire.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.REQ_RELAXED, 1)  # a request lost with its connection may be sent again
    if key is not None:
        keys = curve_keys(key)
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    monitor_address = f"inproc://kvpush-fetch-monitor-{uuid.uuid4().hex}"
    sock.monitor(monitor_address, _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    monitor = ctx.socket(zmq.PAIR)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(monitor_address)
    address = f"tcp://{host}:{port}"
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    reply: bytes | None = None
    try:
        sock.connect(address)
        request = wire.pack([GET_META, wire.WIRE_VERSION, rank.pp_rank, rank.tp_rank])
        request = seal(key, b"req", nonce, request) if key else request
        sock.send(request, zmq.NOBLOCK)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        failures = resends = 0
        connected = False
        while reply is None and (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            if sock in ready:
                reply = sock.recv(zmq.NOBLOCK)
                break
            if monitor in ready:
                event = parse_monitor_message(monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    failures, connected = 0, True
                    continue
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    # The request may be lost with the connection; a reply that came first is
                    # already queued (a resend would discard it).
                    if connected and resends < CLIENT_RESENDS and not sock.poll(0, zmq.POLLIN):
                        resends += 1
                        sock.send(request, zmq.NOBLOCK)
                    connected = False
                    continue
                failures += 1
                mismatch = event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                # (a mismatch may also surface as the server closing the connection first)
                if mismatch or failures >= CLIENT_HANDSHAKE_FAILURES:
                    raise HandshakeError(_handshake_error(address, rank, key is not None, mismatch))
    except zmq.ZMQError as err:
        raise HandshakeError(f"side channel {address} failed for rank {rank}: {err}") from err
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    if reply is None:
        raise HandshakeError(
            f"no answer from the side channel of engine {engine_id!r} at {address} within "
            f"{timeout_s:g}s while asking for rank {rank}; is that engine running and is the "
            f"port right?"
        )
    limits = dict(_REPLY_LIMITS, max_bin_len=len(reply))
    body = _unpack(reply, f"side-channel reply from {address}", limits)
    if not isinstance(body, Mapping):
        raise WireError(f"side-channel reply from {address} is not a map")
    if body.get("error"):
        raise HandshakeError(f"side channel {address} refused rank {rank}: {body['error']}")
    payload = body.get("payload")
    if not isinstance(payload, bytes):
        raise WireError(f"side-channel reply from {address} carries no payload")
    logger.debug(
        "fetched %s rank %s metadata in %.1f ms", engine_id, rank, (time.perf_counter() - started) * 1e3
    )
    return payload
