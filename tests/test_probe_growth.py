"""Probes of long-lived state under weeks of churn (reviewer "growth", 2026-12-02).

Each finding was a test that failed on main (fixed since; the tests are kept). Every test
drives the sans-IO cores, the loopback cluster or the NIXL transport's fence bookkeeping
in-process (a stand-in NIXL agent, a plain Python listener in place of UCX's), and runs in
seconds.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest

from kvpush.transports import tcp_fence

# ------------------------------------------------------------------------------ helpers


def _conn_req(host: str, port: int) -> bytes:
    """A UCX 1.23 TCP connection request naming listener ``(host, port)`` (layout: tcp_fence)."""
    out = bytearray(tcp_fence.CONN_REQ_LEN)
    out[0:8] = tcp_fence.UCX_MAGIC.to_bytes(8, "little")
    out[8] = 32
    out[9:13] = (tcp_fence.CONN_REQ_LEN - 13).to_bytes(4, "little")
    out[13] = 1
    out[26:28] = socket.AF_INET.to_bytes(2, "little")
    out[28:30] = port.to_bytes(2, "big")
    out[30:34] = socket.inet_aton(host)
    return bytes(out)


def _arrives(listener: socket.socket, payload: bytes) -> bytes | None:
    """What a new connection into ``listener`` delivers of ``payload`` (None: the filter
    dropped it; a refused request is never acknowledged, so nothing arrives within 1 s)."""
    with socket.create_connection(listener.getsockname(), timeout=5.0) as client:
        server, _ = listener.accept()
        with server:
            client.sendall(payload)
            server.settimeout(1.0)
            try:
                return server.recv(1 << 16)
            except TimeoutError:
                return None


class _StubAgent:
    """Stands in for the NIXL agent: loading a peer's metadata names the peer by its bytes."""

    def add_remote_agent(self, blob: bytes) -> bytes:
        return blob

    def remove_remote_agent(self, name: str) -> None:
        pass


# ------------------------------------------------------------------------------ finding 1


@pytest.mark.skipif(not tcp_fence.supported(), reason="needs /proc/self/net/tcp (Linux)")
def test_refusals_of_restarted_prefill_processes_never_exhaust_the_fence(caplog: Any) -> None:
    """One P rank (4 NICs, so UCX publishes 4 TCP listeners) killed and restarted under its name
    200 times; D fences it each time (the exit path), then loads the new process. Only the live
    process matters, but D's listener keeps refusing every dead one's addresses. Past ~92 restarts
    here the filter cannot grow, so the next fence's refusal fails: the fence is never confirmed
    (the failed request's blocks are held forever) and the fenced process's connection request is
    let through."""
    pytest.importorskip("nixl")
    from kvpush.core.transport import TransportConfig
    from kvpush.transports.framing import frame
    from kvpush.transports.nixl import MAGIC, NixlTransport

    caplog.set_level(logging.CRITICAL, logger="kvpush.transports.nixl")
    listener = socket.create_server(("127.0.0.1", 0))
    local = NixlTransport(TransportConfig(agent_name="growth-d0", options={"ucx_tls": "tcp"}))
    real_agent, local._agent = local._agent, _StubAgent()
    own = [listener.getsockname()]
    local._tcp_listeners = own  # this listener stands in for UCX's: its filter is observable
    latest: list[tuple[str, int]] = []
    try:
        for restart in range(200):
            latest = [(f"10.{nic}.{restart // 250}.{restart % 250 + 1}", 30000 + restart) for nic in range(4)]
            name = local.load_peer(frame(MAGIC, {"tcp_listeners": [list(a) for a in latest]}, b"P-pp0-tp0"))
            local.fence_peer(name)  # that process is gone (or partitioned): D fences it
        live = ("10.9.9.9", 4444)
        local.load_peer(frame(MAGIC, {"tcp_listeners": [list(live)]}, b"P-pp0-tp1"))
        assert local.counters.fences_unconfirmable == 0, (
            f"{local.counters.fences_unconfirmable} of 200 fences can never be confirmed: the blocks "
            f"waiting on them are held for D's life ({len(tcp_fence.refused(own))} addresses refused)"
        )
        assert _arrives(listener, _conn_req(*latest[0])) is None, "the fenced process may reconnect"
        assert _arrives(listener, _conn_req(*live)) == _conn_req(*live), "a loaded peer is refused"
    finally:
        local._agent = real_agent
        local._tcp_listeners = []
        tcp_fence.admit(list(tcp_fence.refused(own)), own)
        local.close()
        listener.close()


# ------------------------------------------------------------------------------ finding 2


@pytest.fixture
def small_id_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpush.core.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "ID_MEMORY", 3)


def _push(cluster: Any, rid: str, block: int, key: str) -> None:
    cluster.add(rid, [[block]], key)
    cluster.finish(f"p-{key}", [[block]], key)
    assert cluster.wait_decode(rid) == {0: None}
    cluster.d_results[0].pop(rid)


def test_the_alias_map_is_bounded_by_the_id_memory(small_id_memory: None) -> None:
    """Clients reuse request ids (a retry under the same id is common): each reused id gets an
    alias. ``_used_ids`` and ``_engine_id_of`` keep the last ``ID_MEMORY``; ``_alias_of`` keeps
    every reused id forever (millions over weeks)."""
    from cluster import Cluster

    with Cluster(transport="loopback", request_timeout_s=30) as cluster:
        receiver = cluster.receivers[0]
        for i in range(12):
            _push(cluster, f"r-{i}", 2 * i, f"r-{i}-a")
            _push(cluster, f"r-{i}", 2 * i + 1, f"r-{i}-b")  # reused: registered as r-i#n
        assert receiver.pending_requests == 0
        assert len(receiver._alias_of) <= 3, f"{len(receiver._alias_of)} aliases kept for 12 reused ids"


def test_a_stale_cancel_never_cancels_another_request(small_id_memory: None) -> None:
    """``x`` was reused once (alias ``x#1``), then enough ids went by that D forgot both. The
    client's own id ``x#1`` (ids are the client's: X-Request-Id) is then registered as itself.
    A late cancel of ``x`` (an engine aborting a request that already finished, which
    ``cancel`` documents as harmless) cancelled ``x#1``."""
    from cluster import Cluster

    with Cluster(transport="loopback", request_timeout_s=30) as cluster:
        _push(cluster, "x", 1, "x-a")
        _push(cluster, "x", 2, "x-b")  # registered as x#1
        for i in range(4):  # more aliases than D remembers: x and x#1 leave both memories
            _push(cluster, f"c-{i}", 10 + 2 * i, f"c-{i}-a")
            _push(cluster, f"c-{i}", 11 + 2 * i, f"c-{i}-b")
        cluster.add("x#1", [[30]], "y")  # the client's own id, registered as itself
        cluster.receivers[0].cancel("x")  # late cancel of a request done long ago
        cluster.finish("p-y", [[31]], "y")
        assert cluster.wait_decode("x#1") == {0: None}, "x#1 was cancelled by a cancel of x"


# ------------------------------------------------------------------------------ finding 3


def _registration(**overrides: Any) -> Any:
    from kvpush.core.types import PushRegistration

    fields = {
        "request_id": "d-1",
        "match_key": "x-1",
        "decode_engine_id": "D",
        "decode_host": "127.0.0.1",
        "decode_port": 5601,
        "decode_tp_size": 1,
        "block_ids": [[3]],
        "remote_engine_id": "P",
        "decode_incarnation": "d1",
        "grant": 100.0,
        "fresh_s": 10.0,
    }
    return PushRegistration(**{**fields, **overrides})


def test_prefill_forgets_d_engines_it_never_loaded() -> None:
    """D engines restarted with fresh engine ids (vLLM's default engine_id is a uuid per start)
    at an address P is handshaking or backing off: each HELLO leaves a ``_Decode`` for good.
    Without a shared secret any sender can do this at line rate. The entry also pins the id to
    that address: the real engine's registrations from elsewhere are rejected."""
    from kvpush.core import notifications as wire
    from kvpush.core.prefill_core import PrefillCore, PrefillSettings
    from kvpush.core.types import RankKey

    core = PrefillCore(
        PrefillSettings(engine_id="P", incarnation="p1", rank=RankKey(0, 0), tp_size=1), plan=lambda b, r: []
    )

    def hello(engine_id: str, now: float) -> list[Any]:
        reg = _registration(decode_engine_id=engine_id, decode_incarnation=f"i-{engine_id}")
        note = wire.decode_notification(wire.encode_hello(reg, 0))
        return core.notification(f"agent-{engine_id}", note, now)

    now = 100.0
    hello("D-first", now)  # its handshake is in flight: the address is busy
    for i in range(200):
        hello(f"D-busy-{i}", now)
    core.connected("D-first", 0, "", "", 1, "side channel did not answer", now + 5.0)
    for i in range(200):  # the address is in its backoff now
        hello(f"D-backoff-{i}", now + 5.5)
    for t in range(0, 2 * 86400, 60):  # two days of timers; none of these senders speaks again
        core.handle_timer(now + 6.0 + t)
    left = len(core._engines)
    assert left <= 1, f"{left} D engines P never loaded are still remembered two days later"


def test_decode_forgets_p_engines_it_never_loaded() -> None:
    """vLLM gives each P start a fresh engine_id: every P that died before D handshook it (D's
    requests for it failed) stays in D's core for the worker's life."""
    from kvpush.core.decode_core import DecodeCore, DecodeSettings
    from kvpush.core.types import RequestMetadata, TransferParams

    core = DecodeCore(
        DecodeSettings(
            engine_id="D",
            incarnation="d1",
            tp_rank=0,
            tp_size=1,
            host="127.0.0.1",
            port=5601,
            hello_timeout_s=5.0,
            heartbeat_interval_s=0.5,
            peer_silence_s=2.0,
            fresh_s=1.0,
        )
    )
    now = 0.0
    for i in range(200):
        params = TransferParams.from_dict(
            {
                "remote_engine_id": f"P-{i}",
                "remote_host": "10.0.0.1",
                "remote_port": 5600 + i,
                "transfer_id": f"k-{i}",
            }
        )
        core.add(RequestMetadata(request_id=f"d-{i}", block_ids=((1,),), params=params), now)
        core.connected(f"P-{i}", None, "side channel did not answer", now + 0.1)
        now += 1.0
    for t in range(0, 2 * 86400, 60):
        core.handle_timer(now + t)
    assert core.pending == 0
    left = len(core._engines)
    assert left == 0, f"{left} P engines D never loaded are still remembered two days later"


# ------------------------------------------------------------------------------ finding 4


def test_handshake_samples_are_bounded() -> None:
    from cluster import Cluster

    from kvpush.core.peers import PeerRegistry
    from kvpush.core.types import HandshakeMode, RankKey
    from kvpush.transports.loopback import LoopbackTransport

    with Cluster(transport="loopback") as cluster:
        receiver = cluster.receivers[0]
        transport = LoopbackTransport(_config())
        registry = PeerRegistry(
            pm=cluster.pm,
            local=receiver.metadata,
            transport=transport,
            run_on_writer=lambda f: f(),
            timeout_s=5.0,
        )
        try:
            for _ in range(300):  # P evicted and handshaken again, restarts, reconnects...
                registry.ensure(
                    "P", "127.0.0.1", cluster.p_server.port, [RankKey(0, 0)], HandshakeMode.NOTIF_ONLY
                ).result(10)
                registry.remove("P")
            kept = sum(len(v) for v in registry.handshake_ms.values())
            assert kept <= 256, f"{kept} handshake samples kept"
        finally:
            registry.close()
            transport.close()


def _config() -> Any:
    from kvpush.core.transport import TransportConfig

    return TransportConfig(agent_name="growth-registry")
