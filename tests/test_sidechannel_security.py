"""Side-channel hardening: bounded frames, fuzzed frames (no crash, server keeps serving),
HMAC-SHA256 with a shared secret on every request and reply, loopback bind by default."""

from __future__ import annotations

import contextlib
import os
import threading

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.core import wire
from kvpush.core.errors import HandshakeError, WireError
from kvpush.core.sidechannel import (
    AUTH_MAGIC,
    NONCE_BYTES,
    SECRET_ENV,
    SideChannelServer,
    fetch_metadata,
    seal,
)
from kvpush.core.types import RankKey
from kvpush.core.worker import WorkerConfig

R0 = RankKey(0, 0)
PAYLOAD = b"metadata of rank 0"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.fixture
def server() -> SideChannelServer:
    server = SideChannelServer("P")
    server.publish(R0, PAYLOAD)
    yield server
    server.close()


@pytest.fixture
def secure() -> SideChannelServer:
    server = SideChannelServer("P", secret="s3cret")
    server.publish(R0, PAYLOAD)
    yield server
    server.close()


class RawClient:
    """A REQ socket sending arbitrary frames, with a bounded wait for each reply."""

    def __init__(self, port: int) -> None:
        self.socket = zmq.Context.instance().socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, 3000)
        self.socket.setsockopt(zmq.SNDTIMEO, 3000)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, frame: bytes) -> bytes:
        self.socket.send(frame)
        return self.socket.recv()

    def close(self) -> None:
        self.socket.close(linger=0)


# ---------------------------------------------------------------------------- binding and frame size


def test_server_and_workers_bind_loopback_by_default(server: SideChannelServer) -> None:
    assert server.address.startswith("tcp://127.0.0.1:")
    assert WorkerConfig.__attrs_attrs__.side_channel_host.default == "127.0.0.1"


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


def test_oversized_payload_with_a_secret_counts_the_envelope(secure: SideChannelServer) -> None:
    too_big = b"x" * (wire.MAX_FRAME_BYTES - 40)  # fits without the 52-byte envelope, not with it
    with pytest.raises(WireError, match="carries at most"):
        secure.publish(R0, too_big)


# ---------------------------------------------------------------------------- fuzzing


@FUZZ
@given(frame=st.binary(max_size=4096))
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
    client = RawClient(secure.port)
    try:
        reply = msgpack.unpackb(client.ask(frame))
    finally:
        client.close()
    assert reply["payload"] is None and "refused" in reply["error"]


@FUZZ
@given(reply=st.binary(max_size=512))
def test_fuzzed_replies_make_the_client_fail_with_a_kvpush_error(reply: bytes) -> None:
    """A hostile or broken server never crashes the client with anything but a clear error."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if socket.poll(3000):
            identity, empty, _ = socket.recv_multipart()
            socket.send_multipart([identity, empty, reply])

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        for secret in (None, "s3cret"):
            if secret is not None:
                thread.join()
                thread = threading.Thread(target=answer)
                thread.start()
            with contextlib.suppress(HandshakeError, WireError):
                fetch_metadata("127.0.0.1", port, R0, timeout_s=3, secret=secret)
    finally:
        thread.join()
        socket.close(linger=0)


@FUZZ
@given(message=st.binary(max_size=256))
def test_fuzzed_notifications_decode_or_raise_wire_error(message: bytes) -> None:
    for prefix in (b"", wire.PUSH_REG_PREFIX, wire.DONE_PREFIX, wire.CANCEL_PREFIX, wire.HEARTBEAT_PREFIX):
        with contextlib.suppress(WireError):
            wire.decode_notification(prefix + message)


# ---------------------------------------------------------------------------- shared secret


def test_secret_from_the_constructor_serves_a_client_with_the_same_secret(secure: SideChannelServer) -> None:
    assert fetch_metadata("127.0.0.1", secure.port, R0, timeout_s=3, secret="s3cret") == PAYLOAD
    assert secure.requests_served == 1


def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    server = SideChannelServer("P")
    try:
        server.publish(R0, PAYLOAD)
        assert fetch_metadata("127.0.0.1", server.port, R0, timeout_s=3) == PAYLOAD
        with pytest.raises(HandshakeError, match="failed HMAC authentication"):
            fetch_metadata("127.0.0.1", server.port, R0, timeout_s=3, secret="other")
    finally:
        server.close()


def test_client_without_the_secret_is_refused_with_a_clear_error(secure: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match=f"needs authentication.*{SECRET_ENV}"):
        fetch_metadata("127.0.0.1", secure.port, R0, timeout_s=3)
    assert secure.requests_rejected == 1 and secure.requests_served == 0


def test_client_with_a_wrong_secret_is_refused(secure: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match="failed HMAC authentication"):
        fetch_metadata("127.0.0.1", secure.port, R0, timeout_s=3, secret="wrong")


def test_client_with_a_secret_refuses_a_server_without_one(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match=r"without authentication.*no side-channel secret"):
        fetch_metadata("127.0.0.1", server.port, R0, timeout_s=3, secret="s3cret")


def test_tampered_request_and_replayed_reply_are_refused(secure: SideChannelServer) -> None:
    client = RawClient(secure.port)
    try:
        nonce = os.urandom(NONCE_BYTES)
        body = wire.pack(["GET_META", wire.WIRE_VERSION, 0, 0])
        sealed = seal(b"s3cret", b"req", nonce, body)
        reply = client.ask(sealed)
        assert reply.startswith(AUTH_MAGIC)  # a sealed reply for our nonce
        tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])  # ask for rank (0, 1) instead
        assert "failed HMAC" in msgpack.unpackb(client.ask(tampered))["error"]
        as_reply = seal(b"s3cret", b"rep", nonce, body)  # a reply-direction MAC is no request MAC
        assert "failed HMAC" in msgpack.unpackb(client.ask(as_reply))["error"]
    finally:
        client.close()


def test_secured_handshake_between_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers pick the secret up from the environment: a full push works with it set."""
    monkeypatch.setenv(SECRET_ENV, "cluster-secret")
    from cluster import Cluster

    with Cluster() as cluster:
        cluster.add("d-1", [[1]], "x-1")
        cluster.finish("p-1", [[2]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        assert cluster.p_server.requests_served >= 1 and cluster.d_server.requests_served >= 1
