"""Side-channel hardening: bounded frames, fuzzed frames (no crash, server keeps serving), the
metadata as a secret (CURVE encryption with keys derived from the shared secret, HMAC-sealed
requests, no replay, no clear-text serving off loopback), loopback bind by default."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.core import wire
from kvpush.core.errors import ConfigError, HandshakeError, WireError
from kvpush.core.sidechannel import (
    AUTH_MAGIC,
    NONCE_BYTES,
    SECRET_ENV,
    TRANSPORT_LIMIT_BYTES,
    CurveKeys,
    SideChannelServer,
    curve_keys,
    fetch_metadata,
    is_loopback,
    seal,
)
from kvpush.core.types import RankKey
from kvpush.core.worker import WorkerConfig

R0 = RankKey(0, 0)
PAYLOAD = b"metadata of rank 0: UCX address and remote keys"
SECRET = b"s3cret"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    server = SideChannelServer("P")
    server.publish(R0, PAYLOAD)
    yield server
    server.close()


@pytest.fixture
def secure() -> Iterator[SideChannelServer]:
    server = SideChannelServer("P", secret=SECRET)
    server.publish(R0, PAYLOAD)
    yield server
    server.close()


class RawClient:
    """A REQ socket sending arbitrary frames, with a bounded wait for each reply; with ``curve``
    it speaks CURVE with the keys derived from the secret (an insider forging requests)."""

    def __init__(self, port: int, curve: CurveKeys | None = None) -> None:
        self.socket = zmq.Context.instance().socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, 3000)
        self.socket.setsockopt(zmq.SNDTIMEO, 3000)
        if curve is not None:
            self.socket.curve_serverkey = curve.server_public
            self.socket.curve_publickey = curve.client_public
            self.socket.curve_secretkey = curve.client_secret
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, frame: bytes) -> bytes:
        self.socket.send(frame)
        return self.socket.recv()

    def close(self) -> None:
        self.socket.close(linger=0)


class Recorder:
    """A TCP relay on 127.0.0.1 that records both directions of the connections it carries."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.to_server = bytearray()
        self.to_client = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._listener.settimeout(0.1)
        pairs: dict[socket.socket, tuple[socket.socket, bytearray]] = {}
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                pairs[client] = (upstream, self.to_server)
                pairs[upstream] = (client, self.to_client)
            readable, _, _ = select.select(list(pairs), [], [], 0.05) if pairs else ([], [], [])
            for sock in readable:
                data = b""
                with contextlib.suppress(OSError):
                    data = sock.recv(65536)
                other, log = pairs[sock]
                if not data:
                    for s in (sock, other):
                        pairs.pop(s, None)
                        s.close()
                    continue
                log += data
                with contextlib.suppress(OSError):
                    other.sendall(data)
        for sock in pairs:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._listener.close()


def _replay(port: int, data: bytes, wait_s: float = 1.0) -> bytes:
    """Send recorded client bytes to ``port`` on a fresh connection; what came back."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
    return bytes(received)


# ---------------------------------------------------------------------------- binding and frame size


def test_server_and_workers_bind_loopback_by_default(server: SideChannelServer) -> None:
    assert server.address.startswith("tcp://127.0.0.1:")
    assert WorkerConfig.__attrs_attrs__.side_channel_host.default == "127.0.0.1"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]", " 127.0.0.1 "])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "", "::", "10.0.0.1", "192.168.1.5", "eth0"])
def test_non_loopback_addresses(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "10.0.0.1"])
def test_non_loopback_bind_without_a_secret_is_refused(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        SideChannelServer("P", host=host)
    message = str(info.value)
    assert SECRET_ENV in message and "insecure=True" in message and host in message


def test_non_loopback_bind_with_a_secret_or_insecure_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    for kwargs in ({"secret": SECRET}, {"insecure": True}):
        srv = SideChannelServer("P", host="0.0.0.0", **kwargs)
        try:
            srv.publish(R0, PAYLOAD)
            secret = kwargs.get("secret")
            assert fetch_metadata("127.0.0.1", srv.port, R0, timeout_s=5, secret=secret) == PAYLOAD
        finally:
            srv.close()
    monkeypatch.setenv(SECRET_ENV, "from-env")  # the environment's secret counts too
    SideChannelServer("P", host="0.0.0.0").close()


def test_oversized_frame_is_dropped_and_the_server_keeps_serving(server: SideChannelServer) -> None:
    client = RawClient(server.port)
    try:
        client.socket.setsockopt(zmq.RCVTIMEO, 500)
        client.socket.send(b"\x00" * (wire.MAX_FRAME_BYTES + 1))
        with pytest.raises(zmq.Again):  # ZMQ cut the connection at MAXMSGSIZE; no reply
            client.socket.recv()
    finally:
        client.close()
    assert fetch_metadata("127.0.0.1", server.port, R0, timeout_s=3) == PAYLOAD


def test_oversized_payload_with_a_secret_counts_the_curve_overhead(secure: SideChannelServer) -> None:
    too_big = b"x" * (wire.MAX_FRAME_BYTES - 40)  # fits without CURVE's 33 bytes, not with them
    with pytest.raises(WireError, match="carries at most"):
        secure.publish(R0, too_big)


def test_largest_payload_with_a_secret_reaches_the_client(secure: SideChannelServer) -> None:
    overhead = len(wire.pack({"payload": b"", "error": None})) + 3 + 33  # bin32 header, CURVE
    largest = b"y" * (wire.MAX_FRAME_BYTES - overhead)
    with pytest.raises(WireError, match="carries at most"):
        secure.publish(R0, largest + b"y")
    secure.publish(R0, largest)
    assert fetch_metadata("127.0.0.1", secure.port, R0, timeout_s=10, secret=SECRET) == largest


# ---------------------------------------------------------------------------- fuzzing


@FUZZ
@given(frame=st.binary(max_size=TRANSPORT_LIMIT_BYTES))
def test_fuzzed_frames_get_an_answer_and_never_stop_the_server(
    server: SideChannelServer, frame: bytes
) -> None:
    client = RawClient(server.port)
    try:
        reply = msgpack.unpackb(client.ask(frame))
    finally:
        client.close()
    assert set(reply) == {"payload", "error"}
    assert reply["payload"] is None or reply["payload"] == PAYLOAD


requests = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=12,
)


@FUZZ
@given(
    request=st.one_of(
        requests,
        st.tuples(st.just("GET_META"), requests, requests, requests).map(list),
        st.tuples(
            st.just("GET_META"), st.integers(-5, 5), st.integers(-(2**40), 2**40), st.integers(-3, 2**40)
        ).map(list),
    )
)
def test_fuzzed_msgpack_requests_get_an_error_or_the_payload(
    server: SideChannelServer, request: object
) -> None:
    client = RawClient(server.port)
    try:
        reply = msgpack.unpackb(client.ask(wire.pack(request)))
    finally:
        client.close()
    if reply["payload"] is None:
        assert isinstance(reply["error"], str) and reply["error"]
    else:
        assert request == ["GET_META", wire.WIRE_VERSION, 0, 0] and reply["payload"] == PAYLOAD


@FUZZ
@given(frame=st.binary(max_size=512))
def test_fuzzed_frames_to_a_secured_server_are_refused(secure: SideChannelServer, frame: bytes) -> None:
    """Even through CURVE (a peer that somehow has the server key), a frame without the HMAC
    envelope is refused."""
    client = RawClient(secure.port, curve_keys(SECRET))
    try:
        reply = msgpack.unpackb(client.ask(frame))
    finally:
        client.close()
    assert reply["payload"] is None and ("refused" in reply["error"] or "at most" in reply["error"])


def _hostile_server(secret: bytes | None) -> tuple[zmq.Socket, int]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        sock.curve_server = True
        sock.curve_secretkey = curve_keys(secret).server_secret
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


@FUZZ
@given(reply=st.binary(max_size=512))
def test_fuzzed_replies_make_the_client_fail_with_a_kvpush_error(reply: bytes) -> None:
    """A hostile or broken server (plain, or with the secret) never crashes the client with
    anything but a clear error."""
    for secret in (None, SECRET):
        sock, port = _hostile_server(secret)

        def answer(sock: zmq.Socket = sock) -> None:
            if sock.poll(3000):
                identity, empty, _ = sock.recv_multipart()
                sock.send_multipart([identity, empty, reply])

        thread = threading.Thread(target=answer)
        thread.start()
        try:
            with contextlib.suppress(HandshakeError, WireError):
                fetch_metadata("127.0.0.1", port, R0, timeout_s=3, secret=secret)
        finally:
            thread.join()
            sock.close(linger=0)


@FUZZ
@given(message=st.binary(max_size=256))
def test_fuzzed_notifications_decode_or_raise_wire_error(message: bytes) -> None:
    for prefix in (b"", wire.PUSH_REG_PREFIX, wire.DONE_PREFIX, wire.CANCEL_PREFIX, wire.HEARTBEAT_PREFIX):
        with contextlib.suppress(WireError):
            wire.decode_notification(prefix + message)


# ---------------------------------------------------------------------------- shared secret


def test_curve_keys_are_derived_from_the_secret() -> None:
    keys = curve_keys(SECRET)
    assert keys == curve_keys(SECRET) and keys != curve_keys(b"other")
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert len(keys.server_public) == 40 and SECRET not in b"".join(keys)


def test_secret_from_the_constructor_serves_a_client_with_the_same_secret(secure: SideChannelServer) -> None:
    assert fetch_metadata("127.0.0.1", secure.port, R0, timeout_s=3, secret=SECRET) == PAYLOAD
    assert secure.requests_served == 1


def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    server = SideChannelServer("P")
    try:
        server.publish(R0, PAYLOAD)
        assert fetch_metadata("127.0.0.1", server.port, R0, timeout_s=3) == PAYLOAD
        with pytest.raises(HandshakeError, match=f"do not share the same {SECRET_ENV}"):
            fetch_metadata("127.0.0.1", server.port, R0, timeout_s=3, secret="other")
    finally:
        server.close()


def test_client_without_the_secret_is_refused_at_once_with_a_clear_error(secure: SideChannelServer) -> None:
    started = time.monotonic()
    with pytest.raises(HandshakeError, match=f"requires a shared secret.*set the same {SECRET_ENV}"):
        fetch_metadata("127.0.0.1", secure.port, R0, timeout_s=20)
    assert time.monotonic() - started < 10, "a mechanism mismatch should not wait for the timeout"
    assert secure.requests_served == 0
    deadline = time.monotonic() + 5
    while secure.stats()["handshakes_failed"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert secure.stats()["handshakes_failed"] >= 1


def test_client_with_a_wrong_secret_is_refused(secure: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match=f"CURVE handshake .* failed 3 times.*{SECRET_ENV}"):
        fetch_metadata("127.0.0.1", secure.port, R0, timeout_s=20, secret="wrong")
    assert secure.requests_served == 0


def test_client_with_a_secret_refuses_a_server_without_one(server: SideChannelServer) -> None:
    # libzmq reports the mechanism mismatch, or just the server closing the connection first
    with pytest.raises(
        HandshakeError, match=r"serves without a secret but this engine has|or that engine has none"
    ):
        fetch_metadata("127.0.0.1", server.port, R0, timeout_s=3, secret=SECRET)


def test_unsealed_tampered_and_misdirected_requests_are_refused(secure: SideChannelServer) -> None:
    """A peer that knows the CURVE server key still needs the secret itself for each request."""
    client = RawClient(secure.port, curve_keys(SECRET))
    try:
        nonce = os.urandom(NONCE_BYTES)
        body = wire.pack(["GET_META", wire.WIRE_VERSION, 0, 0])
        assert "needs authentication" in msgpack.unpackb(client.ask(body))["error"]
        sealed = seal(SECRET, b"req", nonce, body)
        assert msgpack.unpackb(client.ask(sealed))["payload"] == PAYLOAD
        tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])  # ask for rank (0, 1) instead
        assert "failed HMAC" in msgpack.unpackb(client.ask(tampered))["error"]
        as_reply = seal(SECRET, b"rep", nonce, body)  # a reply-direction MAC is no request MAC
        assert "failed HMAC" in msgpack.unpackb(client.ask(as_reply))["error"]
        assert sealed.startswith(AUTH_MAGIC)
    finally:
        client.close()


def test_without_a_secret_the_metadata_is_in_clear_text(server: SideChannelServer) -> None:
    """The recorder works: without a secret a passive observer sees the metadata."""
    recorder = Recorder(server.port)
    try:
        assert fetch_metadata("127.0.0.1", recorder.port, R0, timeout_s=5) == PAYLOAD
    finally:
        recorder.close()
    assert PAYLOAD in recorder.to_client


def test_with_a_secret_the_metadata_travels_encrypted(secure: SideChannelServer) -> None:
    recorder = Recorder(secure.port)
    try:
        assert fetch_metadata("127.0.0.1", recorder.port, R0, timeout_s=5, secret=SECRET) == PAYLOAD
    finally:
        recorder.close()
    assert recorder.to_server and recorder.to_client
    assert PAYLOAD not in recorder.to_client and b"GET_META" not in recorder.to_server


def test_a_recorded_request_replayed_fails_also_against_a_restarted_server() -> None:
    srv = SideChannelServer("P", secret=SECRET)
    port = srv.port
    try:
        srv.publish(R0, PAYLOAD)
        recorder = Recorder(port)
        try:
            assert fetch_metadata("127.0.0.1", recorder.port, R0, timeout_s=5, secret=SECRET) == PAYLOAD
        finally:
            recorder.close()
        captured = bytes(recorder.to_server)
        served = srv.requests_served
        for _ in range(3):
            assert PAYLOAD not in _replay(port, captured)
        assert srv.requests_served == served
    finally:
        srv.close()
    restarted = SideChannelServer("P", port=port, secret=SECRET)
    try:
        restarted.publish(R0, PAYLOAD)
        assert PAYLOAD not in _replay(port, captured)
        assert restarted.requests_served == 0
        assert fetch_metadata("127.0.0.1", port, R0, timeout_s=5, secret=SECRET) == PAYLOAD
    finally:
        restarted.close()


def test_secured_handshake_between_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers pick the secret up from the environment: a full push works with it set."""
    monkeypatch.setenv(SECRET_ENV, "cluster-secret")
    from cluster import Cluster

    with Cluster() as cluster:
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[2]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert cluster.p_server.requests_served >= 1 and cluster.d_server.requests_served >= 1
