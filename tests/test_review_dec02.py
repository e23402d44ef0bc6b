"""Adversarial review of the 2026-12-02 changes (reviewer "review").

Two findings (P forgetting an unsettled WRITE with a never-loaded engine; an allow-only
listener refusing a loaded peer that published no listeners) were tests that failed before
their fixes; the other tests pin what held.
Sans-IO cores are driven directly (harness as tests/test_hello_refusal_echo.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, Post, Send
from kvpush.core.prefill_core import PrefillCore, PrefillSettings
from kvpush.core.types import NotificationKind, PushRegistration, RankKey, ReadSpec
from kvpush.transports import tcp_fence

P0 = RankKey(0, 0)
D_AGENT = "D-decode-pp0-tp0"
TTL = 120.0


def _note(message: bytes) -> Any:
    note = wire.decode_notification(message)
    assert note is not None
    return note


def _sends(actions: list[Any], kind: NotificationKind) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and _note(a.message).kind is kind]


def _prefill() -> PrefillCore:
    def plan(blocks: Any, reg: PushRegistration) -> list[ReadSpec]:
        return [ReadSpec(dst_tp_rank=0, local_block_ids=blocks, remote_block_ids=reg.block_ids)]

    settings = PrefillSettings(engine_id="P", incarnation="p1", rank=P0, tp_size=1, registration_ttl_s=TTL)
    return PrefillCore(settings, plan=plan)


def _reg(rid: str, key: str, grant: float, **over: Any) -> PushRegistration:
    fields: dict[str, Any] = {
        "request_id": rid,
        "match_key": key,
        "decode_engine_id": "D",
        "decode_host": "127.0.0.1",
        "decode_port": 5601,
        "decode_tp_size": 1,
        "block_ids": ((3,),),
        "remote_engine_id": "P",
        "decode_incarnation": "d1",
        "grant": grant,
        "fresh_s": 1000.0,
    }
    return PushRegistration(**{**fields, **over})


def _push_reg(p: PrefillCore, rid: str, key: str, grant: float, now: float) -> list[Any]:
    return p.notification(D_AGENT, _note(wire.encode_push_reg(_reg(rid, key, grant))), now)


def _hello(p: PrefillCore, now: float) -> list[Any]:
    reg = _reg("(hello)", "(none)", 0.0, block_ids=(), remote_engine_id="(any)")
    return p.notification(D_AGENT, _note(wire.encode_hello(reg, 0, hello_id=1)), now)


# ------------------------------------------------------------------------------ finding 1


def test_forgetting_an_unloaded_engine_never_forgets_an_unsettled_write() -> None:
    """P loads D rank 0, posts a WRITE to it, the post fails with bytes maybe sent (unsettled).
    The rank's endpoint then breaks (partition): P drops its agent and (last rank) the engine,
    keeping the unsettled mark, as designed. D (alive) keeps registering; P's handshake with it
    fails, so the next registration finds the address in backoff and the engine stays
    unloaded. ``registration_ttl_s`` later ``_unloaded`` forgets it and with it the unsettled
    mark: the worker then records its incarnation as ended with nothing unsettled
    (``ended_workers``), and after the heal P's BYE to the same D process says unsettled=False,
    so D settles the request the WRITE targeted without fencing P's connections."""
    p = _prefill()
    assert any(isinstance(a, Connect) for a in _hello(p, 0.0))
    p.connected("D", 0, D_AGENT, "d1", 1, "", 0.1)
    _push_reg(p, "d-1", "x-1", 0.2, 0.2)
    posts = [a for a in p.finished("x-1", "p-1", ((7,),), "", 0.3) if isinstance(a, Post)]
    assert posts, "nothing planned"
    assert p.confirm_post("x-1", 0, 0.3)
    p.posted("x-1", 0, ["h1"], 1, 0.3)
    p.write_settled("x-1", 0, "h1", False, 0.4, "connection reset")
    assert p.wrote_unsettled
    p.unreachable(D_AGENT, "endpoint broke", 0.5)  # partition: agent (and engine) dropped
    assert "D" not in p._engines and p.wrote_unsettled  # the mark is kept by design
    # D keeps registering (same process); P's handshake fails: the address backs off.
    assert any(isinstance(a, Connect) for a in _push_reg(p, "d-2", "x-2", 1.0, 1.0))
    p.connected("D", 0, "", "", 1, "side channel did not answer", 1.1)
    _push_reg(p, "d-3", "x-3", 1.2, 1.2)  # in backoff: the engine stays, never loaded
    assert "D" in p._engines and not p._engines["D"].agents
    now = 1.2
    while now < 1.2 + 3 * TTL:
        now += 5.0
        p.handle_timer(now)
    assert p.wrote_unsettled, "P now says none of its WRITEs ended unsettled"
    # The heal: D registers again, P loads the same D process and closes: its BYE.
    assert any(isinstance(a, Connect) for a in _push_reg(p, "d-4", "x-4", now, now))
    p.connected("D", 0, D_AGENT, "d1", 1, "", now + 0.1)
    p.shutdown("closing", now + 0.2)
    (bye,) = _sends(p.goodbye(now + 0.3), NotificationKind.GOODBYE)
    assert _note(bye.message).unsettled, "BYE tells the D process P's WRITE to it ended settled"


# ------------------------------------------------------------------------------ tcp fence helpers

needs_proc = pytest.mark.skipif(not tcp_fence.supported(), reason="needs /proc/self/net/tcp (Linux)")


def _conn_req(host: str, port: int) -> bytes:
    """A UCX 1.23 TCP connection request naming listener ``(host, port)`` (IPv4 or IPv6)."""
    v6 = ":" in host
    out = bytearray(tcp_fence.CONN_REQ_LEN_V6 if v6 else tcp_fence.CONN_REQ_LEN)
    out[0:8] = tcp_fence.UCX_MAGIC.to_bytes(8, "little")
    out[8] = 32
    out[9:13] = (len(out) - 13).to_bytes(4, "little")
    out[13] = 1
    out[26:28] = (socket.AF_INET6 if v6 else socket.AF_INET).to_bytes(2, "little")
    out[28:30] = port.to_bytes(2, "big")
    if v6:
        out[34:50] = socket.inet_pton(socket.AF_INET6, host)
    else:
        out[30:34] = socket.inet_aton(host)
    assert tcp_fence.conn_req_source(bytes(out)) == (host, port)
    return bytes(out)


def _arrives(listener: socket.socket, payload: bytes) -> bool:
    """Whether a new connection into ``listener`` delivers ``payload`` whole within 1 s."""
    with socket.create_connection(listener.getsockname()[:2], timeout=5.0) as client:
        server, _ = listener.accept()
        with server:
            client.sendall(payload)
            server.settimeout(1.0)
            got = b""
            try:
                while len(got) < len(payload):
                    chunk = server.recv(1 << 16)
                    if not chunk:
                        break
                    got += chunk
            except TimeoutError:
                pass
            return got == payload


class _StubAgent:
    def add_remote_agent(self, blob: bytes) -> bytes:
        return blob

    def remove_remote_agent(self, name: str) -> None:
        pass


@pytest.fixture
def d_transport() -> Iterator[tuple[Any, socket.socket, list[tuple[str, int]]]]:
    """A NIXL transport whose fence filters a plain listener standing in for UCX's."""
    pytest.importorskip("nixl")
    from kvpush.core.transport import TransportConfig
    from kvpush.transports.nixl import NixlTransport

    listener = socket.create_server(("127.0.0.1", 0))
    local = NixlTransport(TransportConfig(agent_name="review-d0", options={"ucx_tls": "tcp"}))
    real_agent, local._agent = local._agent, _StubAgent()
    own = [listener.getsockname()]
    local._tcp_listeners = own
    try:
        yield local, listener, own
    finally:
        local._agent = real_agent
        local._tcp_listeners = []
        with tcp_fence._refusals_lock:
            for inode, _, _ in tcp_fence._own_listener_sockets(own):
                tcp_fence._refusals.pop(inode, None)
                tcp_fence._allowed.pop(inode, None)
        local.close()
        listener.close()


def _load(local: Any, name: str, listeners: list[tuple[str, int]] | None) -> str:
    from kvpush.transports.framing import frame
    from kvpush.transports.nixl import MAGIC

    info = {} if listeners is None else {"tcp_listeners": [list(a) for a in listeners]}
    return local.load_peer(frame(MAGIC, info, name.encode()))


def _churn_to_allow_only(local: Any, own: list[tuple[str, int]], restarts: int = 40) -> list[tuple[str, int]]:
    """A P rank killed and restarted ``restarts`` times: D fences each process (its addresses
    stay refused) until the listener turns allow-only. Returns the fenced addresses."""
    fenced = []
    for i in range(restarts):
        address = (f"10.1.{i // 250}.{i % 250 + 1}", 31000 + i)
        name = _load(local, "P-pp0-tp0", [address])
        local.fence_peer(name)
        fenced.append(address)
    assert tcp_fence.allowed(own) is not None, "never turned allow-only"
    assert local.counters.fences_unconfirmable == 0
    return fenced


# ------------------------------------------------------------------------------ held: allow-only filter


@needs_proc
def test_allow_only_filter_takes_exactly_the_loaded_peers_and_keeps_other_segments(d_transport: Any) -> None:
    local, listener, own = d_transport
    v4, v6, wild = ("10.9.9.9", 4444), ("fd00::9", 4445), ("::", 4446)
    _load(local, "P-live-v4", [v4])
    _load(local, "P-live-v6", [v6])
    _load(local, "P-live-any", [wild])
    fenced = _churn_to_allow_only(local, own)
    allowed = tcp_fence.allowed(own)
    assert allowed is not None and {v4, v6, wild} <= allowed
    assert not allowed & set(fenced)
    for address in fenced[:3] + fenced[-3:]:
        assert not _arrives(listener, _conn_req(*address)), f"fenced {address} may reconnect"
    assert not _arrives(listener, _conn_req("10.7.7.7", 4444)), "another host at a loaded port"
    assert not _arrives(listener, _conn_req("fd00::8", 4445))
    assert not _arrives(listener, _conn_req("fd00::9", 4444))
    assert _arrives(listener, _conn_req(*v4)) and _arrives(listener, _conn_req(*v6))
    # a wildcard listener matches its port in both families
    assert _arrives(listener, _conn_req("10.3.3.3", 4446)) and _arrives(listener, _conn_req("fd00::3", 4446))
    # every segment that is no connection request is kept whole
    request = _conn_req(*fenced[0])
    for payload in (
        b"x" * 10,
        request[:41],  # too short to be one
        b"\0" + request[1:],  # not UCX's magic
        request[:8] + b"\x21" + request[9:],  # another AM id
        request[:13] + b"\x02" + request[14:],  # not a request (event bit 0)
        bytes(range(256)) * 64,
    ):
        assert _arrives(listener, payload), f"a non-request segment was dropped: {payload[:16]!r}"
    # a fenced process's address loaded again (the same address reused) is taken again
    _load(local, "P-reused", [fenced[-1]])
    assert _arrives(listener, _conn_req(*fenced[-1]))
    assert not _arrives(listener, _conn_req(*fenced[-2]))
    # refusing a peer that shares a loaded wildcard's port cannot be confirmed
    assert not tcp_fence.refuse([("10.5.5.5", 4446)], own, loaded=[wild])


# ------------------------------------------------------------------------------ finding 2


@needs_proc
def test_allow_only_never_refuses_a_loaded_peer_that_published_no_listeners(d_transport: Any) -> None:
    """Exact refusal refuses only fenced addresses, so a P of an earlier release (no
    ``tcp_listeners`` in its metadata: its connections cannot be told apart, see
    ``_fence_peer``) still connects. Once the listener turned allow-only (more than
    EXACT_REFUSALS fenced addresses: P restarts over days), every request naming an address
    no loaded peer published is dropped: that P, loaded and live, can never open a connection
    to D again (its WRITEs for D's registrations never start; every request through it times out)."""
    local, listener, own = d_transport
    _churn_to_allow_only(local, own)
    old = ("10.8.8.8", 5555)  # where the earlier release's UCX listens (it does not say)
    _load(local, "P-old-release", None)
    assert _arrives(listener, _conn_req(*old)), "a loaded, live P cannot connect"


# ------------------------------------------------------------------ held: HELLO ids across D restarts


def test_a_refusal_of_a_previous_d_starts_hello_is_late_for_the_next_start() -> None:
    """D restarts under the same agent name (new incarnation): a refusal P sent to the old
    start's HELLO, delivered to the new start while its own HELLO waits, names an id the new
    start never used (its ids start from its incarnation), so it is dropped as late."""
    from kvpush.core.actions import Report
    from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
    from kvpush.core.types import RequestMetadata, TransferParams

    p_agent = "P-prefill-pp0-tp0"

    def start(incarnation: str) -> tuple[DecodeCore, int]:
        d = DecodeCore(
            DecodeSettings(
                engine_id="D",
                incarnation=incarnation,
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
        params = TransferParams.from_dict(
            {"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600, "transfer_id": "k"}
        )
        d.add(RequestMetadata(request_id="d-1", block_ids=((1,),), params=params), 0.0)
        info = ProducerInfo(
            prefill_pp=1,
            prefill_tp=1,
            agents={P0: p_agent},
            incarnations={p_agent: "p1"},
            write_deadline_s=1.0,
        )
        (hello,) = _sends(d.connected("P", info, "", 0.01), NotificationKind.HELLO)
        return d, _note(hello.message).hello_id

    _, old_id = start("d-1700000000.000-aaaa")
    new, new_id = start("d-1700000100.000-bbbb")
    assert old_id != new_id
    # ids of one start run in their own 4096-wide range
    assert abs(old_id - new_id) >= 4096 or (old_id >> 12) != (new_id >> 12)
    stale = wire.encode_failed("(hello)", P0, "refused", False, "p1", hello_id=old_id)
    actions = new.notification(p_agent, _note(stale), 0.5)
    assert [a for a in actions if isinstance(a, Report)] == []
    assert new.stats["late_refusals"] == 1 and new.holds("d-1")


# ------------------------------------------------------------------ held: D forgets failed engines


def test_a_failed_engine_is_not_forgotten_while_a_request_of_it_waits_for_its_fence() -> None:
    """P's agent turns unreachable with a request registered: the engine fails, the request is
    quarantined and then waits for a fence. However long the fence takes, ``forget_failed``
    leaves the engine alone while the request is held; its blocks go back only on the fence,
    and the engine is forgotten once nothing of it is left."""
    from kvpush.core.actions import Fence, Release
    from kvpush.core.decode_core import DecodeCore, DecodeSettings, ProducerInfo
    from kvpush.core.types import RequestMetadata, TransferParams

    p_agent = "P-prefill-pp0-tp0"
    d = DecodeCore(
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
            request_timeout_s=20.0,
        )
    )
    params = {"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600, "transfer_id": "k"}
    d.add(RequestMetadata(request_id="d-1", block_ids=((1,),), params=TransferParams.from_dict(params)), 0.0)
    info = ProducerInfo(
        prefill_pp=1, prefill_tp=1, agents={P0: p_agent}, incarnations={p_agent: "p1"}, write_deadline_s=1.0
    )
    d.connected("P", info, "", 0.01)
    ready = d.notification(p_agent, _note(wire.encode_heartbeat_answer(P0, 0.02, "p1")), 0.02)
    assert _sends(ready, NotificationKind.PUSH_REG), "d-1 did not register"
    actions = d.unreachable(p_agent, "endpoint broke", 0.5)
    fences: list[Fence] = []
    now = 0.5
    forget_at = 0.5 + d.s.retry_backoff_max_s + d.s.request_timeout_s
    while now < 3 * forget_at:
        fences += [a for a in actions if isinstance(a, Fence)]
        assert not any(isinstance(a, Release) for a in actions), "released before any fence confirmed"
        now += 1.0
        actions = d.handle_timer(now)
    assert fences, "no fence went out"
    assert d.holds("d-1") and "P" in d._engines
    released = []
    for fence in fences:
        released += [a for a in d.fenced(fence.fence_id, now) if isinstance(a, Release)]
    assert [r.request_id for r in released] == ["d-1"]
    for t in range(int(now) + 1, int(now + 3 * forget_at)):
        d.handle_timer(float(t))
    assert "P" not in d._engines and d.state_sizes()["fences"] == 0
