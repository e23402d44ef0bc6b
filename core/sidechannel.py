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

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvpush.core import wire
from kvpush.core.addresses import ip_literal, is_ipv6, tcp_url, url_host
from kvpush.core.errors import ConfigError, HandshakeError, WireError
from kvpush.core.sidechannel_auth import (
    AUTH_MAGIC,
    AUTH_OVERHEAD,
    CURVE_OVERHEAD,
    NONCE_BYTES,
    SECRET_ENV,
    CurveKeys,
    curve_keys,
    is_loopback,
    resolve_secret,
    seal,
    unseal,
)
from kvpush.core.sidechannel_bounds import (
    HANDSHAKE_FAILED,
    MONITORED_EVENTS,
    ConnectionTracker,
    RateLimitedWarnings,
)
from kvpush.core.types import RankKey

__all__ = [
    "AUTH_MAGIC",
    "AUTH_OVERHEAD",
    "CURVE_OVERHEAD",
    "GET_META",
    "MAX_REQUEST_BYTES",
    "NONCE_BYTES",
    "SECRET_ENV",
    "TRANSPORT_LIMIT_BYTES",
    "CurveKeys",
    "SideChannelServer",
    "curve_keys",
    "fetch_metadata",
    "is_loopback",
    "seal",
    "unseal",
]

logger = logging.getLogger(__name__)


class SideChannelUnanswered(HandshakeError):
    """A side channel gave no payload: no answer in time, a failed (CURVE) handshake, a socket
    error, or an error reply (it does not serve the rank). Nothing was learned about the peer,
    so a side that refuses peers it *could* read can tell them; this one cannot be told."""


GET_META = "GET_META"
DEFAULT_HOST = "127.0.0.1"
MAX_REQUEST_BYTES = 128
"""Largest request the server decodes: a request is at most 37 bytes of msgpack, plus the
52-byte HMAC envelope when a secret is set."""
TRANSPORT_LIMIT_BYTES = 1024
"""ZMQ ``MAXMSGSIZE`` of the server: larger frames cut the connection before they are read.
Above ``MAX_REQUEST_BYTES`` because the CURVE handshake's commands (~300 bytes) obey it too."""
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_IDLE_TIMEOUT_S = 10.0
DEFAULT_ZMTP_HANDSHAKE_TIMEOUT_S = 2.0
DEFAULT_MAX_QUEUED_REPLIES = 2
MONITOR_BUDGET = 256
"""Connection events the server handles per round before it serves requests and shuts
connections down."""
CLIENT_HANDSHAKE_FAILURES = 3
"""Failed CURVE handshakes in a row after which ``fetch_metadata`` gives up (wrong secret)."""
CLIENT_RESENDS = 5
"""Times ``fetch_metadata`` re-sends its request after its connection dropped (a server at its
connection cap shuts down the least recently active connection)."""

_REQUEST_LIMITS = {
    "max_str_len": 32,
    "max_bin_len": 64,
    "max_array_len": 8,
    "max_map_len": 8,
    "max_ext_len": 0,
}
_REPLY_LIMITS = {"max_str_len": 1 << 16, "max_array_len": 16, "max_map_len": 8, "max_ext_len": 0}


def _unpack(data: bytes, what: str, limits: Mapping[str, int]) -> Any:
    """msgpack-decode ``data`` with length limits, so a small frame cannot expand into millions
    of objects; ``WireError`` naming ``what`` otherwise."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, **limits)
    except Exception as err:  # msgpack raises several unrelated types
        raise WireError(f"{what} is not valid msgpack ({type(err).__name__}: {err})") from None


def _positive(name: str, value: float, fix: str, *, integer: bool = False) -> None:
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < float("inf"):
        what = "an int" if integer else "finite"
        raise ConfigError(f"SideChannelServer {name}={value!r} must be a positive number ({what}); {fix}")


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
        self._secret = resolve_secret(secret)
        if self._secret is None and not insecure and not is_loopback(host):
            raise ConfigError(
                f"side channel of engine {engine_id!r} would serve its NIXL metadata (UCX address and "
                f"memory keys) in clear text to anyone reaching {host}: set {SECRET_ENV} (or secret=) "
                f"to the same value on every engine, bind 127.0.0.1, or pass insecure=True if every "
                f"host on that network is trusted"
            )
        _positive("max_connections", max_connections, "e.g. 128", integer=True)
        _positive("idle_timeout_s", idle_timeout_s, "e.g. 10")
        _positive("zmtp_handshake_timeout_s", zmtp_handshake_timeout_s, "e.g. 2")
        _positive("max_queued_replies", max_queued_replies, "1 or 2", integer=True)
        if max_reply_bytes is not None:
            _positive("max_reply_bytes", max_reply_bytes, f"at most {wire.MAX_FRAME_BYTES}", integer=True)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(
                f"SideChannelServer port={port!r} must be a TCP port in [0, 65535] (0: a free one)"
            )
        self.max_reply_bytes = max_reply_bytes or wire.MAX_FRAME_BYTES
        self._warnings = RateLimitedWarnings(logger, f"side channel of {engine_id}: ")
        self._replies: dict[RankKey, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.requests_served = 0
        self.requests_rejected = 0
        self.replies_dropped = 0
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
        if is_ipv6(host):  # an IPv6 literal (or '::'), or a name with IPv6 addresses only
            self._router.setsockopt(zmq.IPV6, 1)  # without it ZMQ answers 'No such device'
        monitor_address = f"inproc://kvpush-side-channel-monitor-{uuid.uuid4().hex}"
        self._router.monitor(monitor_address, MONITORED_EVENTS)
        self._monitor = self._ctx.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(monitor_address)
        address = f"tcp://{url_host(host)}"
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
        self._connections = ConnectionTracker(self.port, int(max_connections), idle_timeout_s, self._warnings)
        self._thread = threading.Thread(
            target=self._serve, name=f"kvpush-side-channel-{engine_id}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return tcp_url(self.host, self.port)

    @property
    def connections(self) -> int:
        """Connections the server holds now (accepted and not yet closed)."""
        return len(self._connections)

    def stats(self) -> dict[str, int]:
        """Requests served, rejected and dropped; connections open, accepted, shut down (over
        the cap: ``connections_evicted``; idle: ``connections_idle_closed``), failed handshakes."""
        return {
            "requests_served": self.requests_served,
            "requests_rejected": self.requests_rejected,
            "replies_dropped": self.replies_dropped,
            "connections": self.connections,
            **self._connections.stats,
        }

    def publish(self, rank: RankKey, payload: bytes) -> None:
        """Serve ``payload`` for ``rank`` from now on (replacing any earlier one)."""
        self.publish_all({rank: payload})

    def publish_all(self, payloads: Mapping[RankKey, bytes]) -> None:
        replies = {}
        for rank, payload in payloads.items():
            if not isinstance(rank, RankKey):
                raise ConfigError(
                    f"engine {self.engine_id!r}: publish a payload under its worker's "
                    f"config.parallel.rank (a RankKey), not {rank!r}: peers ask for RankKeys, and a "
                    f"payload under anything else is never served"
                )
            try:
                identity = wire.decode_identity(payload, source=f"the payload published for rank {rank}")
            except WireError:
                identity = None  # not a worker's payload (tools, tests): served as given
            if identity is not None and identity.rank != rank:
                raise ConfigError(
                    f"engine {self.engine_id!r}: the payload published for rank {rank} is rank "
                    f"{identity.rank}'s; publish each worker's handshake_payload() under its own "
                    f"config.parallel.rank"
                )
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
                self._connections.enforce()
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
            self._touch(frames[-1])  # before serving: a connection that asked is shut down last
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
        """Mark the connection ``frame`` came from (its ``SRCFD``) as having asked."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        self._connections.touch(fd, request=True)

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

    def _drain_monitor(self) -> None:
        for _ in range(MONITOR_BUDGET):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._connections.on_event(event["event"], event["value"])

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


def _await_reply(
    sock: zmq.Socket, monitor: zmq.Socket, request: bytes, deadline: float, why: tuple[str, RankKey, bool]
) -> tuple[bytes | None, int]:
    """The reply to ``request`` (already sent) before ``deadline``, or None, and how many times
    the connection dropped after its handshake. A dropped connection may have lost the request:
    it is sent again (``CLIENT_RESENDS`` times). ``why`` (address, rank, has_secret) words a
    failed handshake."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    failures = drops = 0
    connected = resend = False
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(max(1, int(left * 1000))))
        if sock in ready:
            return sock.recv(zmq.NOBLOCK), drops
        if monitor not in ready:
            continue
        event = parse_monitor_message(monitor.recv_multipart())
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            failures, connected = 0, True
            if resend:  # on the new connection, once its pipe is attached (a bounded wait)
                sock.setsockopt(zmq.SNDTIMEO, max(1, int(min(left, 1.0) * 1000)))
                with contextlib.suppress(zmq.Again):
                    sock.send(request)
                    resend = False
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            # A reply that came first is already queued (a resend would discard it).
            if connected and drops < CLIENT_RESENDS and not sock.poll(0, zmq.POLLIN):
                resend = True
            drops += connected
            connected = False
        else:  # a failed handshake (a mismatch may also surface as the server closing first)
            failures += 1
            mismatch = event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            if mismatch or failures >= CLIENT_HANDSHAKE_FAILURES:
                raise SideChannelUnanswered(_handshake_error(*why, mismatch))
    return None, drops


def _is_ipv6_within(host: str, deadline: float) -> bool | None:
    """:func:`is_ipv6` of ``host``, or None when its name lookup did not answer by
    ``deadline`` (getaddrinfo takes no timeout: it runs on a daemon thread left to finish). An IP
    literal, the common case, needs no lookup."""
    ip = ip_literal(host)
    if ip is not None:
        return ip.version == 6
    box: dict[str, bool] = {}

    def lookup() -> None:
        try:
            box["ipv6"] = is_ipv6(host)
        except Exception:  # an unresolvable name: ZMQ reports it on connect
            box["ipv6"] = False

    thread = threading.Thread(target=lookup, name="kvpush-resolve", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    return box.get("ipv6")


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
    CURVE-encrypted with the server key derived from it and the request is HMAC-sealed. A reply
    over ``max_reply_bytes`` (default ``wire.MAX_FRAME_BYTES``) is refused by ZMQ."""
    deadline = time.monotonic() + timeout_s
    ipv6 = _is_ipv6_within(host, deadline)  # a name resolves within the query's bound
    if ipv6 is None:
        raise SideChannelUnanswered(
            f"resolving {host!r} (the side channel of engine {engine_id!r}) took over {timeout_s:g}s "
            f"while asking for rank {rank}; is the resolver answering?"
        )
    key = resolve_secret(secret)
    limit = max_reply_bytes or wire.MAX_FRAME_BYTES
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limit)
    sock.setsockopt(zmq.REQ_RELAXED, 1)  # a request lost with its connection may be sent again
    if key is not None:
        keys = curve_keys(key)
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)  # without it ZMQ cannot reach an IPv6 address
    monitor_address = f"inproc://kvpush-fetch-monitor-{uuid.uuid4().hex}"
    sock.monitor(monitor_address, HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    monitor = ctx.socket(zmq.PAIR)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(monitor_address)
    address = tcp_url(host, port)
    started = time.perf_counter()
    try:
        sock.connect(address)
        request = wire.pack([GET_META, wire.WIRE_VERSION, rank.pp_rank, rank.tp_rank])
        request = seal(key, b"req", os.urandom(NONCE_BYTES), request) if key else request
        sock.send(request, zmq.NOBLOCK)
        why = (address, rank, key is not None)
        reply, drops = _await_reply(sock, monitor, request, deadline, why)
    except zmq.ZMQError as err:
        raise SideChannelUnanswered(f"side channel {address} failed for rank {rank}: {err}") from err
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    if reply is None:
        dropped = (
            f"; the connection dropped before a reply ({drops}x: a reply over max_reply_bytes="
            f"{limit} is cut, or the server is shedding connections under load)"
            if drops
            else ""
        )
        raise SideChannelUnanswered(
            f"no answer from the side channel of engine {engine_id!r} at {address} within "
            f"{timeout_s:g}s while asking for rank {rank}; is that engine running and is the "
            f"port right?{dropped}"
        )
    limits = dict(_REPLY_LIMITS, max_bin_len=len(reply))
    body = _unpack(reply, f"side-channel reply from {address}", limits)
    if not isinstance(body, Mapping):
        raise WireError(f"side-channel reply from {address} is not a map")
    if body.get("error"):
        raise SideChannelUnanswered(f"side channel {address} refused rank {rank}: {body['error']}")
    payload = body.get("payload")
    if not isinstance(payload, bytes):
        raise WireError(f"side-channel reply from {address} carries no payload")
    logger.debug(
        "fetched %s rank %s metadata in %.1f ms", engine_id, rank, (time.perf_counter() - started) * 1e3
    )
    return payload
