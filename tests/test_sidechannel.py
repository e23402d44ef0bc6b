"""The side channel: a real ZMQ ROUTER server, real REQ/DEALER clients on 127.0.0.1.

Every bad request gets an error reply (or, for an oversized frame, a dropped connection) and
the server keeps answering valid requests afterwards. The bounds (request size, unpack limits,
queued replies, connection cap, idle timeout, rate-limited warnings) each have a test here; the
floods that need many clients are in test_sidechannel_floods.py. Every wait is bounded.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvpush.core import wire
from kvpush.core.errors import ConfigError, HandshakeError, WireError
from kvpush.core.sidechannel import (
    CLIENT_RESENDS,
    GET_META,
    MAX_REQUEST_BYTES,
    TRANSPORT_LIMIT_BYTES,
    SideChannelServer,
    fetch_metadata,
)
from kvpush.core.sidechannel_bounds import RateLimitedWarnings
from kvpush.core.types import RankKey

WAIT_MS = 30_000
PAYLOADS = {RankKey(0, 0): b"payload-0-0", RankKey(0, 1): b"payload-0-1", RankKey(1, 0): b"payload-1-0"}


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer("prefill-7")
    srv.publish_all(PAYLOADS)
    try:
        yield srv
    finally:
        srv.close()


def _request(address: str, frames: list[bytes], timeout_ms: int = WAIT_MS) -> Any:
    """Send ``frames`` as one REQ message; the decoded reply, or None if none came in time."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        try:
            return wire.unpack(sock.recv(), "reply")
        except zmq.Again:
            return None
    finally:
        sock.close()


def _get(server: SideChannelServer, pp: int, tp: int, version: int = wire.WIRE_VERSION) -> Any:
    return _request(server.address, [wire.pack([GET_META, version, pp, tp])])


def _assert_still_serves(server: SideChannelServer) -> None:
    for rank, payload in PAYLOADS.items():
        assert fetch_metadata("127.0.0.1", server.port, rank, timeout_s=30) == payload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- valid requests


def test_serves_each_rank_payload(server: SideChannelServer) -> None:
    assert server.address == f"tcp://127.0.0.1:{server.port}"
    _assert_still_serves(server)
    assert _get(server, 0, 1) == {"payload": b"payload-0-1", "error": None}
    assert server.requests_served == 4
    assert server.requests_rejected == 0


def test_publish_replaces_a_payload(server: SideChannelServer) -> None:
    server.publish(RankKey(0, 0), b"new")
    assert fetch_metadata("127.0.0.1", server.port, RankKey(0, 0), timeout_s=30) == b"new"


@pytest.mark.parametrize("rank", [0, (0, 0), "0"])
def test_a_payload_under_something_else_than_a_rank_key_is_refused_at_publish(
    server: SideChannelServer, rank: Any
) -> None:
    # publish(0, payload) used to be taken and the payload never served: every D rank then
    # failed its handshake with "engine ... has no rank (pp=0, tp=0); it serves 0".
    with pytest.raises(ConfigError, match=r"config\.parallel\.rank"):
        server.publish(rank, b"payload")
    _assert_still_serves(server)


def test_oversized_payload_is_refused_at_publish(server: SideChannelServer) -> None:
    with pytest.raises(
        WireError, match=r"rank \(pp=0, tp=2\) is \d+ bytes; the side channel carries at most"
    ):
        server.publish(RankKey(0, 2), b"x" * wire.MAX_FRAME_BYTES)
    with pytest.raises(HandshakeError, match=r"it serves \(pp=0, tp=0\), \(pp=0, tp=1\), \(pp=1, tp=0\)"):
        fetch_metadata("127.0.0.1", server.port, RankKey(0, 2), timeout_s=30)


# ---------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"\xc1\xc1 not msgpack", "side-channel request is not valid msgpack"),
        (b"", "side-channel request is not valid msgpack"),
        (wire.pack({"GET_META": 1}), 'request must be ["GET_META", wire_version, pp_rank, tp_rank]'),
        (wire.pack([GET_META, wire.WIRE_VERSION, 0]), "request must be"),
        (wire.pack([GET_META, wire.WIRE_VERSION, 0, 0, 0]), "request must be"),
        (wire.pack(["GET_PAYLOAD", wire.WIRE_VERSION, 0, 0]), "request must be"),
        (wire.pack([GET_META, wire.WIRE_VERSION, "0", 0]), "request must be"),
        (wire.pack([GET_META, wire.WIRE_VERSION, True, 0]), "request must be"),
        (wire.pack([GET_META, wire.WIRE_VERSION, 0.0, 0]), "request must be"),
        (wire.pack("GET_META"), "request must be"),
    ],
)
def test_malformed_request_gets_an_error_reply(server: SideChannelServer, frame: bytes, error: str) -> None:
    reply = _request(server.address, [frame])
    assert reply is not None, "no reply to a malformed request"
    assert reply["payload"] is None
    assert error in reply["error"]
    assert server.requests_rejected == 1
    _assert_still_serves(server)


def test_multi_frame_request_gets_an_error_reply(server: SideChannelServer) -> None:
    good = wire.pack([GET_META, wire.WIRE_VERSION, 0, 0])
    reply = _request(server.address, [good, good])
    assert reply == {"payload": None, "error": "expected exactly one request frame"}
    assert server.requests_rejected == 1
    _assert_still_serves(server)


def test_request_without_a_req_envelope_is_rejected(server: SideChannelServer) -> None:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    try:
        dealer.connect(server.address)
        dealer.send(wire.pack([GET_META, wire.WIRE_VERSION, 0, 0]))  # no empty delimiter frame
        empty, body = dealer.recv_multipart()
    finally:
        dealer.close()
    assert empty == b""
    assert wire.unpack(body, "reply")["error"] == "expected exactly one request frame"
    assert server.requests_rejected == 1
    _assert_still_serves(server)


def test_wrong_wire_version_names_both_versions(server: SideChannelServer) -> None:
    reply = _get(server, 0, 0, version=wire.WIRE_VERSION + 41)
    assert reply["payload"] is None
    assert reply["error"] == (
        f"wire version {wire.WIRE_VERSION + 41} not supported; engine 'prefill-7' speaks {wire.WIRE_VERSION}"
    )
    _assert_still_serves(server)


@pytest.mark.parametrize(("pp", "tp"), [(0, 5), (2, 0), (-1, 0)])
def test_unknown_rank_error_names_the_ranks_served(server: SideChannelServer, pp: int, tp: int) -> None:
    reply = _get(server, pp, tp)
    assert reply["payload"] is None
    assert reply["error"] == (
        f"engine 'prefill-7' has no rank (pp={pp}, tp={tp}); it serves "
        "(pp=0, tp=0), (pp=0, tp=1), (pp=1, tp=0)"
    )
    if pp >= 0:
        with pytest.raises(HandshakeError) as info:
            fetch_metadata("127.0.0.1", server.port, RankKey(pp, tp), timeout_s=30, engine_id="prefill-7")
        message = str(info.value)
        assert f"tcp://127.0.0.1:{server.port}" in message
        assert f"refused rank (pp={pp}, tp={tp})" in message
        assert "it serves (pp=0, tp=0), (pp=0, tp=1), (pp=1, tp=0)" in message
    _assert_still_serves(server)


def test_engine_with_no_ranks_says_so() -> None:
    srv = SideChannelServer("empty-engine")
    try:
        with pytest.raises(HandshakeError, match=r"has no rank \(pp=0, tp=0\); it serves none yet"):
            fetch_metadata("127.0.0.1", srv.port, RankKey(0, 0), timeout_s=30)
    finally:
        srv.close()


def test_oversized_frame_is_dropped_and_the_server_keeps_serving(server: SideChannelServer) -> None:
    # ZMQ's MAXMSGSIZE makes the server drop the connection of a client that sends more than
    # MAX_FRAME_BYTES: that client gets no reply (its own wait bounds it), nobody else notices.
    reply = _request(server.address, [b"\x00" * (wire.MAX_FRAME_BYTES + 1)], timeout_ms=1500)
    assert reply is None
    _assert_still_serves(server)
    assert server.requests_served == len(PAYLOADS)


def test_many_bad_clients_then_good_ones(server: SideChannelServer) -> None:
    threads = [
        threading.Thread(target=_request, args=(server.address, [b"\xc1" * n], 10_000)) for n in range(1, 9)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert server.requests_rejected == 8
    _assert_still_serves(server)


def test_rejections_are_logged(server: SideChannelServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpush.core.sidechannel"):
        _request(server.address, [b"\xc1"])
    assert any("prefill-7: rejected a request" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- client errors


def test_peer_not_listening_fails_within_the_timeout_naming_address_and_rank() -> None:
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(HandshakeError) as info:
        fetch_metadata("127.0.0.1", port, RankKey(1, 3), timeout_s=0.5, engine_id="prefill-9")
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert f"tcp://127.0.0.1:{port}" in message
    assert "rank (pp=1, tp=3)" in message
    assert "'prefill-9'" in message and "within 0.5s" in message
    assert elapsed < 60, "the bounded wait was not bounded"


def test_closed_server_fails_within_the_timeout() -> None:
    srv = SideChannelServer("short-lived")
    srv.publish(RankKey(0, 0), b"p")
    port = srv.port
    srv.close()
    with pytest.raises(HandshakeError, match=f"tcp://127.0.0.1:{port}"):
        fetch_metadata("127.0.0.1", port, RankKey(0, 0), timeout_s=0.5)


def test_bind_conflict_is_a_handshake_error(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match=f"cannot bind tcp://127.0.0.1:{server.port}"):
        SideChannelServer("second", port=server.port)


def _serve_once(reply: bytes) -> tuple[int, threading.Thread]:
    """A REP socket that answers one request with ``reply`` (a misbehaving engine)."""
    ctx = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    port = rep.bind_to_random_port("tcp://127.0.0.1")

    def run() -> None:
        try:
            if rep.poll(WAIT_MS):
                rep.recv()
                rep.send(reply)
        finally:
            rep.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return port, thread


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"\xc1", "is not valid msgpack"),
        (wire.pack([1, 2]), "is not a map"),
        (wire.pack({"payload": None, "error": None}), "carries no payload"),
    ],
)
def test_malformed_reply_is_a_wire_error(reply: bytes, error: str) -> None:
    port, thread = _serve_once(reply)
    with pytest.raises(WireError, match=error):
        fetch_metadata("127.0.0.1", port, RankKey(0, 0), timeout_s=30)
    thread.join(timeout=30)


# ---------------------------------------------------------------------------- bounds


def _raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.settimeout(0.2)
    return sock


def _closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closed ``sock`` within ``wait_s`` (its ZMTP greeting is skipped)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def test_request_over_the_request_limit_is_refused_before_decoding(server: SideChannelServer) -> None:
    reply = _request(server.address, [b"\x90" * (MAX_REQUEST_BYTES + 1)])
    assert reply["payload"] is None
    size = MAX_REQUEST_BYTES + 1
    assert reply["error"] == f"request of {size} bytes refused: a side-channel request is at most {size - 1}"
    _assert_still_serves(server)


def test_frame_over_the_transport_limit_cuts_the_connection(server: SideChannelServer) -> None:
    assert _request(server.address, [b"\x90" * (TRANSPORT_LIMIT_BYTES + 1)], timeout_ms=1000) is None
    assert server.requests_rejected == 0  # never read: libzmq cut it at the frame header
    _assert_still_serves(server)


def test_a_small_msgpack_bomb_hits_the_unpack_limits(server: SideChannelServer) -> None:
    bomb = b"\xdc\x00\x50" + b"\x80" * 80  # an array of 80 empty maps in 83 bytes
    reply = _request(server.address, [bomb])
    assert reply["payload"] is None and "exceeds max_array_len(8)" in reply["error"]
    _assert_still_serves(server)


def test_replies_to_a_peer_that_does_not_read_are_dropped() -> None:
    srv = SideChannelServer("P", max_queued_replies=2)
    srv.publish(RankKey(0, 0), b"m" * (512 << 10))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVBUF, 4096)  # the kernel holds little: unread replies queue in the server
    try:
        dealer.connect(srv.address)
        for _ in range(40):
            dealer.send_multipart([b"", wire.pack([GET_META, wire.WIRE_VERSION, 0, 0])])
        deadline = time.monotonic() + 20
        while srv.requests_served + srv.replies_dropped < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.requests_served + srv.replies_dropped == 40, srv.stats()
        assert srv.replies_dropped >= 25, srv.stats()
        _assert_still_serves_one(srv)
    finally:
        dealer.close()
        srv.close()


def test_a_peer_that_reads_every_reply_is_never_dropped() -> None:
    """One connection, 50 requests in turn, with room for one queued reply: all answered."""
    srv = SideChannelServer("P", max_queued_replies=1)
    srv.publish(RankKey(0, 0), b"p")
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    try:
        sock.connect(srv.address)
        for _ in range(50):
            sock.send(wire.pack([GET_META, wire.WIRE_VERSION, 0, 0]))
            assert wire.unpack(sock.recv(), "reply")["payload"] == b"p"
        assert srv.replies_dropped == 0 and srv.requests_served == 50
    finally:
        sock.close()
        srv.close()


def _assert_still_serves_one(srv: SideChannelServer) -> None:
    assert fetch_metadata("127.0.0.1", srv.port, RankKey(0, 0), timeout_s=30) == b"m" * (512 << 10)


def test_an_idle_connection_is_shut_down() -> None:
    srv = SideChannelServer("P", idle_timeout_s=0.3, zmtp_handshake_timeout_s=30)
    try:
        with _raw_connection(srv.port) as idle:
            assert _closed_by_server(idle, 10), "an idle connection was kept"
        deadline = time.monotonic() + 5  # counted just after the shutdown the client saw
        while srv.stats()["connections_idle_closed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stats()["connections_idle_closed"] == 1
    finally:
        srv.close()


def test_the_connection_cap_shuts_down_the_least_recently_active() -> None:
    srv = SideChannelServer("P", max_connections=4, zmtp_handshake_timeout_s=30)
    srv.publish(RankKey(0, 0), b"p")
    conns = []
    try:
        for _ in range(10):
            conns.append(_raw_connection(srv.port))
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while srv.stats()["connections_evicted"] < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stats()["connections_evicted"] == 6 and srv.connections == 4, srv.stats()
        assert all(_closed_by_server(c, 2) for c in conns[:6])
        assert not any(_closed_by_server(c, 0.3) for c in conns[6:])
        assert fetch_metadata("127.0.0.1", srv.port, RankKey(0, 0), timeout_s=30) == b"p"
        assert srv.stats()["peak_connections"] <= 5 + 1
    finally:
        for conn in conns:
            conn.close()
        srv.close()


def test_the_reply_limit_is_a_setting_on_both_ends() -> None:
    srv = SideChannelServer("P", max_reply_bytes=4096)
    try:
        with pytest.raises(WireError, match=r"is \d+ bytes; the side channel carries at most 4096"):
            srv.publish(RankKey(0, 0), b"x" * 8192)
        srv.publish(RankKey(0, 0), b"x" * 4000)
        assert fetch_metadata("127.0.0.1", srv.port, RankKey(0, 0), timeout_s=30, max_reply_bytes=4096)
        with pytest.raises(HandshakeError, match=r"dropped before a reply \(1x: .*max_reply_bytes=1024"):
            fetch_metadata("127.0.0.1", srv.port, RankKey(0, 0), timeout_s=3, max_reply_bytes=1024)
    finally:
        srv.close()


def test_a_request_lost_with_its_connection_is_sent_again() -> None:
    """The server drops the connection after reading the request (as one at its connection cap
    does): the client re-sends it on the next connection and gets its answer."""
    port = _free_port()
    ctx = zmq.Context.instance()
    answered = []

    def serve() -> None:
        for attempt in range(2):
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            deadline = time.monotonic() + 10  # the closed listener is torn down asynchronously
            while True:
                try:
                    router.bind(f"tcp://127.0.0.1:{port}")
                    break
                except zmq.ZMQError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            try:
                if not router.poll(WAIT_MS):
                    return
                identity, empty, _ = router.recv_multipart()
                if attempt == 1:
                    router.send_multipart([identity, empty, wire.pack({"payload": b"p", "error": None})])
                    answered.append(identity)
                    time.sleep(0.5)
            finally:
                router.close(linger=0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert fetch_metadata("127.0.0.1", port, RankKey(0, 0), timeout_s=30) == b"p"
    thread.join(timeout=30)
    assert len(answered) == 1 and CLIENT_RESENDS >= 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_connections": 0}, "max_connections=0"),
        ({"idle_timeout_s": -1}, "idle_timeout_s=-1"),
        ({"max_queued_replies": 0}, "max_queued_replies=0"),
        ({"zmtp_handshake_timeout_s": "2"}, "zmtp_handshake_timeout_s='2'"),
        ({"max_reply_bytes": -5}, "max_reply_bytes=-5"),
    ],
)
def test_bad_bounds_are_config_errors_naming_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=f"SideChannelServer {name} must be a positive number"):
        SideChannelServer("P", **kwargs)


def test_rejection_warnings_are_rate_limited(
    server: SideChannelServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpush.core.sidechannel"):
        for _ in range(20):
            _request(server.address, [b"\xc1"])
    assert server.requests_rejected == 20
    assert sum("rejected a request" in r.getMessage() for r in caplog.records) == 1


def test_a_rate_limited_warning_counts_the_ones_it_skipped(caplog: pytest.LogCaptureFixture) -> None:
    warnings = RateLimitedWarnings(logging.getLogger("kvpush.core.sidechannel"), "side channel of P: ", 0.2)
    with caplog.at_level(logging.WARNING, logger="kvpush.core.sidechannel"):
        for _ in range(5):
            warnings.warn("kind", "something")
        warnings.warn("other", "something else")
        time.sleep(0.25)
        warnings.warn("kind", "something")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "side channel of P: something"
    assert messages[1] == "side channel of P: something else"
    assert messages[2].startswith("side channel of P: something (4 more like it in the last ")
    assert len(messages) == 3
