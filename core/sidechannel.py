"""The side channel: a ZMQ ROUTER server per engine serving each rank's handshake payload,
and a REQ client with a bounded wait.

Request (msgpack array): ``["GET_META", wire_version, pp_rank, tp_rank]``.
Reply (msgpack map): ``{"payload": bytes | None, "error": str | None}``.
A bad request gets an error reply and a log line; the server keeps serving.

Optional shared secret (``secret=`` argument, else the ``KVPUSH_SIDE_CHANNEL_SECRET``
environment variable): every request and reply is then wrapped as
``b"KVPA" + HMAC-SHA256(secret, direction + nonce + body) + nonce + body`` (the reply's MAC
covers the request's 16-byte nonce, so a reply cannot be replayed to another request). A server
with a secret answers a request without a valid MAC with a plain error reply naming the
problem; a client with a secret refuses a reply without a valid MAC. The server binds
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Mapping

import zmq

from kvpush.core import wire
from kvpush.core.errors import HandshakeError, WireError
from kvpush.core.types import RankKey

logger = logging.getLogger(__name__)

GET_META = "GET_META"
DEFAULT_HOST = "127.0.0.1"
SECRET_ENV = "KVPUSH_SIDE_CHANNEL_SECRET"
AUTH_MAGIC = b"KVPA"
NONCE_BYTES = 16
AUTH_OVERHEAD = len(AUTH_MAGIC) + hashlib.sha256().digest_size + NONCE_BYTES


def _secret(secret: bytes | str | None) -> bytes | None:
    """The shared secret: the argument, else ``KVPUSH_SIDE_CHANNEL_SECRET``; None when unset."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    return secret or None


def _mac(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(secret, direction + nonce + body, hashlib.sha256).digest()


def seal(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    """Wrap ``body`` with its HMAC (``direction`` is ``b"req"`` or ``b"rep"``)."""
    return AUTH_MAGIC + _mac(secret, direction, nonce, body) + nonce + body


def unseal(secret: bytes, direction: bytes, frame: bytes, nonce: bytes | None = None) -> tuple[bytes, bytes]:
    """``(nonce, body)`` of a sealed frame; raises ``HandshakeError`` if it is not sealed with
    ``secret`` (or, for a reply, not for ``nonce``)."""
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


class SideChannelServer:
    """Serves the handshake payload of every ``(pp_rank, tp_rank)`` of one engine."""

    def __init__(
        self, engine_id: str, host: str = DEFAULT_HOST, port: int = 0, *, secret: bytes | str | None = None
    ) -> None:
        self.engine_id = engine_id
        self.host = host
        self._secret = _secret(secret)
        self._payloads: dict[RankKey, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        address = f"tcp://{host}"
        try:
            if port == 0:
                self.port = self._socket.bind_to_random_port(address)
            else:
                self._socket.bind(f"{address}:{port}")
                self.port = port
        except zmq.ZMQError as err:
            self._socket.close()
            raise HandshakeError(
                f"side channel of engine {engine_id!r} cannot bind {address}:{port}: {err}; pick another port"
            ) from err
        self.requests_served = 0
        self.requests_rejected = 0
        self._thread = threading.Thread(
            target=self._serve, name=f"kvpush-side-channel-{engine_id}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def publish(self, rank: RankKey, payload: bytes) -> None:
        """Serve ``payload`` for ``rank`` from now on (replacing any earlier one)."""
        self.publish_all({rank: payload})

    def publish_all(self, payloads: Mapping[RankKey, bytes]) -> None:
        for rank, payload in payloads.items():
            # A reply over MAX_FRAME_BYTES would be dropped by the client's MAXMSGSIZE and
            # surface there as a misleading "no answer" timeout: refuse it here instead.
            size = len(wire.pack({"payload": payload, "error": None})) + AUTH_OVERHEAD * bool(self._secret)
            if size > wire.MAX_FRAME_BYTES:
                raise WireError(
                    f"handshake payload of engine {self.engine_id!r} rank {rank} is {size} bytes; "
                    f"the side channel carries at most {wire.MAX_FRAME_BYTES} (too many KV regions?)"
                )
        with self._lock:
            self._payloads.update(payloads)

    def _authenticated_reply_for(self, frame: bytes) -> tuple[bytes, bool]:
        """Check the request's HMAC (when a secret is set) and seal the reply."""
        if self._secret is None:
            if frame.startswith(AUTH_MAGIC):
                return wire.pack(
                    {
                        "payload": None,
                        "error": f"engine {self.engine_id!r} has no side-channel secret but the request "
                        f"is authenticated; set {SECRET_ENV} on both engines or on neither",
                    }
                ), False
            return self._reply_for(frame)
        try:
            nonce, body = unseal(self._secret, b"req", frame)
        except HandshakeError as err:
            return wire.pack({"payload": None, "error": f"engine {self.engine_id!r} refused: {err}"}), False
        reply, ok = self._reply_for(body)
        return seal(self._secret, b"rep", nonce, reply), ok

    def _reply_for(self, frame: bytes) -> tuple[bytes, bool]:
        try:
            request = wire.unpack(frame, "side-channel request")
        except WireError as err:
            return wire.pack({"payload": None, "error": str(err)}), False
        if (
            not isinstance(request, list)
            or len(request) != 4
            or request[0] != GET_META
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in request[1:])
        ):
            return wire.pack(
                {"payload": None, "error": 'request must be ["GET_META", wire_version, pp_rank, tp_rank]'}
            ), False
        _, version, pp_rank, tp_rank = request
        if version != wire.WIRE_VERSION:
            return wire.pack(
                {
                    "payload": None,
                    "error": f"wire version {version} not supported; engine {self.engine_id!r} "
                    f"speaks {wire.WIRE_VERSION}",
                }
            ), False
        with self._lock:
            payload = self._payloads.get(RankKey(pp_rank, tp_rank)) if pp_rank >= 0 and tp_rank >= 0 else None
            known = sorted(self._payloads)
        if payload is None:
            ranks = ", ".join(str(r) for r in known) or "none yet"
            return wire.pack(
                {
                    "payload": None,
                    "error": f"engine {self.engine_id!r} has no rank (pp={pp_rank}, tp={tp_rank}); "
                    f"it serves {ranks}",
                }
            ), False
        return wire.pack({"payload": payload, "error": None}), True

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as err:
                if self._stop.is_set():
                    break
                logger.warning("side channel of %s: receive failed: %s", self.engine_id, err)
                continue
            if len(frames) != 3 or frames[1] != b"":
                self.requests_rejected += 1
                logger.warning(
                    "side channel of %s: dropped a message of %d frames (expected a REQ envelope)",
                    self.engine_id,
                    len(frames),
                )
                if len(frames) >= 2:
                    reply = wire.pack({"payload": None, "error": "expected exactly one request frame"})
                    self._send(frames[0], reply)
                continue
            identity, _, frame = frames
            reply, ok = self._authenticated_reply_for(frame)
            if ok:
                self.requests_served += 1
            else:
                self.requests_rejected += 1
                error = wire.unpack(reply[AUTH_OVERHEAD:] if reply.startswith(AUTH_MAGIC) else reply, "reply")
                logger.warning("side channel of %s: rejected a request: %s", self.engine_id, error["error"])
            self._send(identity, reply)

    def _send(self, identity: bytes, reply: bytes) -> None:
        try:
            self._socket.send_multipart([identity, b"", reply], zmq.NOBLOCK)
        except zmq.ZMQError as err:
            logger.warning("side channel of %s: reply failed: %s", self.engine_id, err)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close(linger=0)


def fetch_metadata(
    host: str,
    port: int,
    rank: RankKey,
    *,
    timeout_s: float = 5.0,
    engine_id: str = "?",
    secret: bytes | str | None = None,
) -> bytes:
    """Ask an engine's side channel for one rank's payload; raises ``HandshakeError`` on a
    timeout or an error reply, naming the address, the rank and what was waited for. With a
    secret (argument or ``KVPUSH_SIDE_CHANNEL_SECRET``) the request is sealed and the reply must
    be sealed for it."""
    key = _secret(secret)
    nonce = os.urandom(NONCE_BYTES)
    ctx = zmq.Context.instance()
    socket = ctx.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    timeout_ms = max(1, int(timeout_s * 1000))
    socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
    socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
    socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
    address = f"tcp://{host}:{port}"
    started = time.perf_counter()
    try:
        socket.connect(address)
        request = wire.pack([GET_META, wire.WIRE_VERSION, rank.pp_rank, rank.tp_rank])
        socket.send(seal(key, b"req", nonce, request) if key else request)
        reply = socket.recv()
    except zmq.Again:
        raise HandshakeError(
            f"no answer from the side channel of engine {engine_id!r} at {address} within "
            f"{timeout_s:g}s while asking for rank {rank}; is that engine running and is the "
            f"port right?"
        ) from None
    except zmq.ZMQError as err:
        raise HandshakeError(f"side channel {address} failed for rank {rank}: {err}") from err
    finally:
        socket.close(linger=0)
    if key is not None:
        if not reply.startswith(AUTH_MAGIC):  # a plain reply: the server refused us, or has no secret
            plain = wire.unpack(reply, f"side-channel reply from {address}")
            error = plain.get("error") if isinstance(plain, Mapping) else None
            raise HandshakeError(
                f"side channel {address} answered rank {rank} without authentication"
                + (f": {error}" if error else f"; set the same {SECRET_ENV} on both engines")
            )
        try:
            reply = unseal(key, b"rep", reply, nonce)[1]
        except HandshakeError as err:
            raise HandshakeError(f"reply from side channel {address} for rank {rank}: {err}") from None
    body = wire.unpack(reply, f"side-channel reply from {address}")
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
