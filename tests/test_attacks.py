"""Issue 16, item 2: peers are who the handshake says. Every attack is a test.

P and D are real NIXL agents (an in-process :class:`cluster.Cluster` on ``transport="nixl"``, so
their counters, peers and caches can be inspected directly); the attacker is a third NIXL agent
(:class:`attacker.Attacker`) that knows only what the two side channels serve. Each test checks
that the attack is refused or harmless: nothing is written outside the blocks a request offered,
and no request is reported done without its bytes (a legitimate push afterwards still lands,
byte for byte). Everything runs on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch
from attacker import Attacker, registration, rogue_decode
from attrs import evolve as attrs_evolve
from cluster import MHA, Cluster, attempt_of, kv_bytes, settle, wait_until
from test_push_flow import assert_pushed

from kvpush.core import notifications as wire
from kvpush.core.errors import WireError
from kvpush.core.types import RankKey, RequestMetadata, TransferParams
from kvpush.core.worker import lease_clock

P0 = RankKey(0, 0)


class World:
    """P (1 rank) and D (1 rank) over NIXL, and an attacker that loaded both from their side
    channels."""

    def __init__(self, **config: object) -> None:
        options = {"heartbeat_interval_s": 0.1, "request_timeout_s": 20.0, **config}
        self.cluster = Cluster(MHA, transport=str(options.pop("transport", "nixl")), **options)
        try:
            self.attacker = Attacker()
            self.p_agent = self.attacker.load(self.cluster.p_server.port, P0, "P")
            self.d_agent = self.attacker.load(self.cluster.d_server.port, P0, "D")
        except BaseException:
            self.cluster.close()
            raise
        self.sender = self.cluster.senders[P0]
        self.receiver = self.cluster.receivers[0]
        self.d_meta = self.attacker.loaded[self.d_agent]
        self.snapshot = {k: kv_bytes(t).clone() for k, t in self.cluster.d_caches[0].items()}
        self.offered: set[int] = set()

    def push(self, name: str, p_blocks: list[int], d_blocks: list[int], **finish: object) -> None:
        """A legitimate request end to end: D reports it done and its bytes are P's."""
        self.add(name, d_blocks)
        self.finish(name, p_blocks, **finish)
        assert self.cluster.wait_decode(f"d-{name}", timeout_s=15) == {0: None}
        assert_pushed(self.cluster, p_blocks, d_blocks)

    def add(self, name: str, d_blocks: list[int]) -> None:
        self.offered.update(d_blocks)
        self.cluster.add(f"d-{name}", [d_blocks], f"x-{name}")

    def finish(self, name: str, p_blocks: list[int], **finish: object) -> None:
        self.sender.request_finished(f"p-{name}", [p_blocks], match_key=f"x-{name}", **finish)

    def registered(self, name: str) -> None:
        """Wait until P holds D's PUSH_REG for ``name``."""
        wait_until(
            lambda: f"x-{name}" in self.sender.call_on_writer(lambda: set(self.sender.core._requests)),
            timeout_s=10,
            what=f"P to hold D's PUSH_REG of x-{name}",
        )

    def rejected(self, worker: object, before: int, count: int = 1) -> None:
        def seen() -> bool:
            self.attacker.pump(0.01)
            return worker.stats["rejected_notifications"] >= before + count  # type: ignore[attr-defined]

        wait_until(
            seen,
            timeout_s=10,
            what=f"{count} notification(s) rejected",
        )

    def assert_nothing_outside_offered(self) -> None:
        """Every D block no legitimate request offered still holds what it held at the start."""
        others = [b for b in range(self.cluster.d_caches[0][next(iter(self.snapshot))].shape[1])]
        others = [b for b in others if b not in self.offered]
        for layer, tensor in self.cluster.d_caches[0].items():
            assert torch.equal(kv_bytes(tensor)[:, others], self.snapshot[layer][:, others]), layer

    def close(self) -> None:
        try:
            self.attacker.close()
        finally:
            self.cluster.close()


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    try:
        w.push("warm", [1], [1])  # P and D loaded each other
        yield w
    finally:
        w.close()


def _quiet(world: World, seconds: float = 0.3) -> None:
    """Let the attacker's notifications arrive and the writers handle them."""
    world.attacker.pump(seconds)
    settle(world.sender)
    settle(world.receiver)


# ---------------------------------------------------------------------------- DONE and FAIL


def test_done_from_a_producer_that_does_not_exist_is_dropped(world: World) -> None:
    world.add("a", [10, 11])
    wait_until(lambda: world.receiver.stats["push_regs_sent"] >= 2, what="D's PUSH_REG")
    before = world.receiver.stats["rejected_notifications"]
    for producer, ptp in ((RankKey(3, 0), 1), (RankKey(0, 7), 8), (P0, 2)):
        world.attacker.send(world.d_agent, wire.encode_done("d-a", producer, ptp))
    world.rejected(world.receiver, before, 3)
    _quiet(world)
    assert world.receiver.get_finished().done == ()
    world.finish("a", [3, 4])
    assert world.cluster.wait_decode("d-a") == {0: None}
    assert_pushed(world.cluster, [3, 4], [10, 11])
    world.assert_nothing_outside_offered()


def test_done_from_the_attackers_agent_naming_the_real_producer_is_dropped(world: World) -> None:
    world.add("b", [12, 13])
    wait_until(lambda: world.receiver.stats["push_regs_sent"] >= 2, what="D's PUSH_REG")
    before = world.receiver.stats["rejected_notifications"]
    world.attacker.send(world.d_agent, wire.encode_done("d-b", P0, 1))
    world.rejected(world.receiver, before)
    _quiet(world)
    assert world.receiver.get_finished().done == ()
    world.finish("b", [5, 6])
    assert world.cluster.wait_decode("d-b") == {0: None}
    assert_pushed(world.cluster, [5, 6], [12, 13])


def test_done_before_d_has_the_request_does_not_complete_it(world: World) -> None:
    before = world.receiver.stats["rejected_notifications"]
    world.attacker.send(world.d_agent, wire.encode_done("d-c", P0, 1))
    world.attacker.send(world.d_agent, wire.encode_done("d-c", RankKey(1, 0), 1))
    _quiet(world)  # held as early notifications (bounded per agent)
    world.add("c", [14, 15])
    world.rejected(world.receiver, before, 2)  # replayed at registration, then refused
    _quiet(world)
    assert world.receiver.get_finished().done == ()
    world.finish("c", [7, 8])
    assert world.cluster.wait_decode("d-c") == {0: None}
    assert_pushed(world.cluster, [7, 8], [14, 15])


def test_fail_of_someone_elses_request_is_dropped(world: World) -> None:
    world.add("d", [16, 17])
    wait_until(lambda: world.receiver.stats["push_regs_sent"] >= 2, what="D's PUSH_REG")
    before = world.receiver.stats["rejected_notifications"]
    world.attacker.send(world.d_agent, wire.encode_failed("d-d", P0, "forged failure"))
    world.rejected(world.receiver, before)
    _quiet(world)
    got = world.receiver.get_finished()
    assert got.failed == {} and got.done == ()
    world.finish("d", [9, 10])
    assert world.cluster.wait_decode("d-d") == {0: None}
    assert_pushed(world.cluster, [9, 10], [16, 17])


def test_a_one_megabyte_fail_reason_is_truncated_and_harmless(world: World) -> None:
    body = {"request_id": "d-e", "pp": 0, "tp": 0, "reason": "x" * (1 << 20), "v": list(wire.NOTIF_VERSION)}
    message = wire.FAIL_PREFIX + msgpack.packb(body, use_bin_type=True)
    note = wire.decode_notification(message)
    assert note is not None and len(note.reason) == wire.MAX_REASON
    world.add("e", [18, 19])
    wait_until(lambda: world.receiver.stats["push_regs_sent"] >= 2, what="D's PUSH_REG")
    before_d = world.receiver.stats["rejected_notifications"]
    for agent in (world.d_agent, world.p_agent):
        world.attacker.send(agent, message)
    world.rejected(world.receiver, before_d)
    _quiet(world)
    assert world.receiver.get_finished().failed == {}
    world.finish("e", [11, 12])
    assert world.cluster.wait_decode("d-e") == {0: None}
    assert_pushed(world.cluster, [11, 12], [18, 19])


# ---------------------------------------------------------------------------- CANCEL_ACK


def test_spoofed_cancel_ack_while_a_write_is_landing_frees_nothing_early() -> None:
    """D cancels while P's WRITE is in flight (held 0.6 s, then its bytes land); the attacker
    acknowledges the cancel at once in P's name. D must release only after P's WRITE settled."""
    slow = {"inner": "nixl", "slow_writes": 1.0, "write_delay_s": 0.6}
    w = World(transport="faulty", transport_options=slow)
    try:
        w.push("warm", [1], [1])
        d_blocks = [20, 21]
        w.add("f", d_blocks)
        w.registered("f")
        w.finish("f", [13, 14])
        wait_until(lambda: w.sender.stats["writes"] >= 2, what="P's WRITE in flight")
        posted = time.monotonic()
        before = w.receiver.stats["rejected_notifications"]
        w.receiver.cancel("d-f")
        for _ in range(3):
            w.attacker.send(w.d_agent, wire.encode_cancel_ack("d-f", P0, False))
        released_at = None
        deadline = time.monotonic() + 10
        while released_at is None and time.monotonic() < deadline:
            got = w.receiver.wait_finished(5)
            if "d-f" in got.released:
                released_at = time.monotonic()
                for tensor in w.cluster.d_caches[0].values():  # the engine frees: fill them
                    kv_bytes(tensor)[:, d_blocks] = 0x5A5A
        assert released_at is not None, "D never released the cancelled request"
        assert released_at - posted >= 0.5, f"released {released_at - posted:.2f}s after the post"
        assert w.receiver.stats["rejected_notifications"] >= before + 1
        assert "cancelled by D rank 0 while a WRITE was in flight" in w.cluster.wait_prefill("p-f")[P0]
        time.sleep(0.5)
        for tensor in w.cluster.d_caches[0].values():
            assert bool((kv_bytes(tensor)[:, d_blocks] == 0x5A5A).all()), "a WRITE landed after the release"
    finally:
        w.close()


# ---------------------------------------------------------------------------- registering first


class Rogue:
    """A whole decode engine the attacker built from D's served metadata."""

    def __init__(self, world: World) -> None:
        self.receiver, self.server, self.caches = rogue_decode(world.d_meta, world.cluster.p_server.port)
        self.zero = {k: kv_bytes(t).clone() for k, t in self.caches.items()}

    def register(self, world: World, key: str, blocks: list[int]) -> None:
        params = TransferParams.from_dict(world.cluster.params(key))
        self.receiver.add_request(RequestMetadata(request_id="m-1", block_ids=[blocks], params=params))
        wait_until(lambda: self.receiver.stats["push_regs_sent"] >= 1, what="the rogue's PUSH_REG")

    def received_anything(self) -> bool:
        return any(not torch.equal(kv_bytes(t), self.zero[k]) for k, t in self.caches.items())

    def close(self) -> None:
        try:
            self.receiver.close()
        finally:
            self.server.close()


def _p_holds(world: World, key: str, engine_id: str) -> None:
    wait_until(
        lambda: (
            world.sender.call_on_writer(
                lambda: getattr(world.sender.core._requests.get(key), "engine_id", "")
            )
            == engine_id
        ),
        what=f"P to bind {key} to {engine_id}",
    )


def test_first_registrant_cannot_steal_a_push_bound_to_the_routers_d_engine(world: World) -> None:
    rogue = Rogue(world)
    try:
        rogue.register(world, "x-g", [5, 6])
        _p_holds(world, "x-g", "mallory")
        world.add("g", [22, 23])  # the real D registers second
        wait_until(lambda: world.receiver.stats["push_regs_sent"] >= 2, what="D's PUSH_REG")
        _quiet(world)
        world.finish("g", [15, 16], decode_engine_id="D")
        assert world.cluster.wait_decode("d-g", timeout_s=10) == {0: None}
        assert_pushed(world.cluster, [15, 16], [22, 23])
        assert not rogue.received_anything()
    finally:
        rogue.close()


def test_first_registrant_gets_nothing_when_the_router_binds_before_d_registers(world: World) -> None:
    rogue = Rogue(world)
    try:
        rogue.register(world, "x-h", [5, 6])
        _p_holds(world, "x-h", "mallory")
        world.finish("h", [17, 18], decode_engine_id="D")
        _p_holds(world, "x-h", "D")
        world.add("h", [24, 25])
        assert world.cluster.wait_decode("d-h", timeout_s=10) == {0: None}
        assert_pushed(world.cluster, [17, 18], [24, 25])
        assert world.cluster.wait_prefill("p-h")[P0] is None
        time.sleep(0.3)
        assert not rogue.received_anything()
        world.assert_nothing_outside_offered()
    finally:
        rogue.close()


def test_without_router_binding_the_first_registrant_receives_the_push(world: World) -> None:
    """The documented limit (issue 16): without ``decode_engine_id`` P binds the key to the first
    engine that registers. The rogue engine receives the prompt's KV, P reports it sent, and the
    real D is told that the key is bound to another engine: at P's finish when its PUSH_REG was
    held before it, else at its next heartbeat. Only the router's binding (test above) prevents
    this."""
    rogue = Rogue(world)
    try:
        rogue.register(world, "x-i", [5, 6])
        _p_holds(world, "x-i", "mallory")
        world.add("i", [26, 27])
        world.finish("i", [19, 20])
        assert world.cluster.wait_prefill("p-i")[P0] is None  # "sent" — to the rogue
        wait_until(lambda: "m-1" in rogue.receiver.get_finished().done, what="the rogue's done")
        assert rogue.received_anything()
        reason = world.cluster.wait_decode("d-i", timeout_s=10)[0]
        # told at the finish (its PUSH_REG held before it) or at its next heartbeat (after)
        told = ("is bound to D engine 'mallory'", "P no longer holds this request")
        assert reason is not None and any(t in reason for t in told), reason
        world.assert_nothing_outside_offered()
    finally:
        rogue.close()


# ---------------------------------------------------------------------------- forged PUSH_REG and CANCEL


def test_push_reg_naming_another_requests_live_blocks_writes_nothing(world: World) -> None:
    world.add("j", [28, 29])  # live, registered, P has not finished
    world.registered("j")
    before_p = world.sender.stats["rejected_notifications"]
    writes = world.sender.stats["writes"]
    inc = world.d_meta.incarnation
    port = world.cluster.d_server.port
    forged = [  # in D's name, then in its own engine's name pointing at D's side channel
        registration(
            request_id="d-evil",
            match_key="x-evil",
            block_ids=[[28, 29]],
            decode_engine_id="D",
            decode_port=port,
            incarnation=inc,
            grant=lease_clock(),
        ),
        registration(request_id="d-evil", match_key="x-evil2", block_ids=[[28, 29]], decode_port=port),
    ]
    for reg in forged:
        world.attacker.send(world.p_agent, wire.encode_push_reg(reg))
    world.rejected(world.sender, before_p)
    world.finish("evil", [30, 31])
    world.finish("evil2", [30, 31])
    _quiet(world, 1.0)
    assert world.sender.stats["writes"] == writes, "P wrote for a forged registration"
    world.finish("j", [21, 22])
    assert world.cluster.wait_decode("d-j") == {0: None}
    assert_pushed(world.cluster, [21, 22], [28, 29])
    world.assert_nothing_outside_offered()


def test_forged_push_reg_to_a_p_that_has_not_loaded_d_writes_nothing() -> None:
    """The forged PUSH_REG arrives before P ever handshook with D: P loads D's agent from D's side
    channel and drops the registration, which came from another agent."""
    w = World(lease_s=1.0)
    try:
        before = w.sender.stats["rejected_notifications"]
        reg = registration(
            request_id="d-evil",
            match_key="x-evil",
            block_ids=[[2, 3]],
            decode_engine_id="D",
            decode_port=w.cluster.d_server.port,
            incarnation=w.d_meta.incarnation,
            grant=1e12,
        )
        w.attacker.send(w.p_agent, wire.encode_push_reg(reg))
        w.finish("evil", [4, 5])
        reason = w.cluster.wait_prefill("p-evil", timeout_s=10)[P0]
        assert reason is not None, "P reported the forged push sent"
        assert w.sender.stats["writes"] == 0 and w.sender.stats["rejected_notifications"] > before
        w.assert_nothing_outside_offered()
        w.push("k", [6, 7], [8, 9])  # D itself still works
    finally:
        w.close()


def test_cancel_of_a_strangers_prefill_is_dropped(world: World) -> None:
    world.add("l", [32, 33])
    world.registered("l")
    before = world.sender.stats["rejected_notifications"]
    reg = registration(
        request_id="d-l",
        match_key="x-l",
        block_ids=[[32, 33]],
        decode_engine_id="D",
        decode_port=world.cluster.d_server.port,
        incarnation=world.d_meta.incarnation,
    )
    world.attacker.send(world.p_agent, wire.encode_cancel("x-l", reg, 0))
    world.attacker.send(world.p_agent, wire.encode_cancel("x-l"))  # without coordinates
    world.rejected(world.sender, before, 2)
    assert world.sender.stats["cancels"] <= 1
    world.finish("l", [23, 24])
    assert world.cluster.wait_decode("d-l") == {0: None}
    assert_pushed(world.cluster, [23, 24], [32, 33])
    assert world.cluster.wait_prefill("p-l")[P0] is None


# ---------------------------------------------------------------------------- heartbeats and HELLO


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


def _accepted(sock: socket.socket) -> int:
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def test_heartbeats_pointing_at_arbitrary_ports_open_no_handshake(world: World) -> None:
    sock = _listener()
    try:
        port = sock.getsockname()[1]
        counters = world.sender.transport.counters
        loaded, engines = counters.peers_loaded, set(world.sender.peers.engines)
        before = world.sender.stats["rejected_notifications"]
        for i in range(30):
            reg = registration(
                request_id="hb", match_key="hb", block_ids=[], decode_engine_id=f"evil-{i}", decode_port=port
            )
            world.attacker.send(world.p_agent, wire.encode_heartbeat([f"x-{i}"], reg, 0))
        # and one in D's name (D is loaded at P, but not through this agent)
        reg = registration(
            request_id="hb", match_key="hb", block_ids=[], decode_engine_id="D", decode_port=port
        )
        world.attacker.send(world.p_agent, wire.encode_heartbeat(["x-warm"], reg, 0))
        world.rejected(world.sender, before, 31)
        _quiet(world, 1.0)
        assert _accepted(sock) == 0, "P connected to the address a heartbeat named"
        assert counters.peers_loaded == loaded and set(world.sender.peers.engines) == engines
        assert world.sender.call_on_writer(lambda: world.sender.core.state_sizes()["engines"]) == 1
        assert not [n for n in world.attacker.notifications() if n.stamp is not None], "P answered"
        started = time.monotonic()
        world.push("m", [25, 26], [34, 35])
        assert time.monotonic() - started < 5
    finally:
        sock.close()


def test_hello_in_ds_name_with_a_new_incarnation_does_not_drop_d(world: World) -> None:
    world.add("n", [36, 37])
    world.registered("n")
    reg = registration(
        request_id="(hello)",
        match_key="(hello)",
        block_ids=[],
        decode_engine_id="D",
        decode_port=world.cluster.d_server.port,
        incarnation="restarted-evil",
    )
    world.attacker.send(world.p_agent, wire.encode_hello(reg, 0))
    _quiet(world)
    assert "D" in world.sender.peers.engines, "P dropped the real D's agent"
    world.finish("n", [27, 28])
    assert world.cluster.wait_decode("d-n") == {0: None}
    assert_pushed(world.cluster, [27, 28], [36, 37])


# ---------------------------------------------------------------------------- sizes from peers


def test_push_reg_with_decode_tp_size_3000000_is_refused_at_decode(world: World) -> None:
    reg = registration(
        request_id="d-o",
        match_key="x-o",
        block_ids=[[40]],
        decode_tp_size=3_000_000,
        decode_port=world.cluster.d_server.port,
    )
    message = wire.encode_push_reg(reg)
    with pytest.raises(WireError, match="decode_tp_size"):
        wire.decode_notification(message)
    dropped = world.sender.dropped_notifications
    world.attacker.send(world.p_agent, message)
    wait_until(
        lambda: world.attacker.pump(0.01) or world.sender.dropped_notifications > dropped,
        what="P to drop the PUSH_REG",
    )
    started = time.monotonic()
    world.sender.call_on_writer(lambda: None, timeout_s=2.0)  # the writer is not frozen
    world.push("o", [29, 30], [38, 39])
    assert time.monotonic() - started < 5


# ---------------------------------------------------------------------------- names and secrets


@pytest.mark.parametrize(
    "secret",
    [
        "s3cret",
        pytest.param(
            None,
            marks=pytest.mark.xfail(
                strict=True,
                reason="by design today: without a secret, NIXL agent names are not authenticated, so "
                "an agent that takes P's name completes D's request without bytes (issue 16: "
                "notifications are MACed only with a secret)",
            ),
        ),
    ],
    ids=["secret", "no-secret"],
)
def test_an_agent_that_takes_ps_name_cannot_complete_a_request(secret: str | None) -> None:
    w = World(**({"secret": secret} if secret else {}))
    try:
        w.push("warm", [1], [1])
        w.add("p", [40, 41])
        wait_until(lambda: w.receiver.stats["push_regs_sent"] >= 2, what="D's PUSH_REG")
        # The impostor names the registration attempt too (without a secret nothing hides it:
        # D's attempt ids count up from a hash of its published incarnation).
        forged = wire.encode_done("d-p", P0, 1, attempt=attempt_of(w.receiver, "d-p"))
        with Attacker(name=w.p_agent) as impostor:  # the same agent name as P's rank
            impostor.send(impostor.load(w.cluster.d_server.port, P0, "D"), forged)
            impostor.pump(0.5)
            settle(w.receiver)
        assert w.receiver.get_finished().done == (), "D reported done without the bytes"
        w.finish("p", [31, 32])
        assert w.cluster.wait_decode("d-p") == {0: None}
        assert_pushed(w.cluster, [31, 32], [40, 41])
    finally:
        w.close()


def test_with_a_secret_every_forged_notification_is_dropped_unauthenticated() -> None:
    w = World(secret="s3cret")
    try:
        w.push("warm", [1], [1])
        w.add("q", [42, 43])
        wait_until(lambda: w.receiver.stats["push_regs_sent"] >= 2, what="D's PUSH_REG")
        reg = registration(
            request_id="d-q",
            match_key="x-q",
            block_ids=[[42, 43]],
            decode_engine_id="D",
            decode_port=w.cluster.d_server.port,
            incarnation=w.d_meta.incarnation,
        )
        to_d = [
            wire.encode_done("d-q", P0, 1),
            wire.encode_failed("d-q", P0, "forged"),
            wire.encode_cancel_ack("d-q", P0, False),
        ]
        to_p = [
            wire.encode_push_reg(reg),
            wire.encode_cancel("x-q", reg, 0),
            wire.encode_heartbeat(["x-q"], reg, 0),
            wire.encode_hello(attrs_evolve(reg, decode_incarnation="x"), 0),
        ]
        for message in to_d:
            w.attacker.send(w.d_agent, message)
        for message in to_p:
            w.attacker.send(w.p_agent, message)
        wait_until(
            lambda: (
                w.attacker.pump(0.01)
                or (
                    w.receiver.unauthenticated_notifications >= len(to_d)
                    and w.sender.unauthenticated_notifications >= len(to_p)
                )
            ),
            what="every forged notification dropped",
        )
        assert w.receiver.get_finished().done == ()
        w.finish("q", [33, 34])
        assert w.cluster.wait_decode("d-q") == {0: None}
        assert_pushed(w.cluster, [33, 34], [42, 43])
        w.assert_nothing_outside_offered()
    finally:
        w.close()


def test_hellos_naming_a_silent_port_do_not_delay_a_new_d() -> None:
    """Without a secret P must handshake back to the address a HELLO names (that is how it
    reaches D), but at most one engine id per address at a time, with a backoff after a failure:
    30 HELLOs naming one silent port cost one handshake slot, never a real D's."""
    sock = _listener()  # accepts TCP, never answers: each handshake waits for its timeout
    w = World()
    try:
        port = sock.getsockname()[1]
        for i in range(30):
            reg = registration(
                request_id="(hello)",
                match_key="(hello)",
                block_ids=[],
                decode_engine_id=f"evil-{i}",
                decode_port=port,
            )
            w.attacker.send(w.p_agent, wire.encode_hello(reg, 0))
        _quiet(w, 0.5)
        started = time.monotonic()
        w.push("r", [35, 36], [44, 45])  # D's first request: P must handshake with D now
        assert time.monotonic() - started < 10
        assert _accepted(sock) <= 1, "P opened more than one connection to the address 30 HELLOs named"
    finally:
        w.close()
        sock.close()


@pytest.mark.parametrize("kind", ["HELLO", "PUSH_REG"])
def test_a_claim_to_be_d_at_another_address_before_d_speaks_does_not_lock_d_out(kind: str) -> None:
    """Before D's first contact, the attacker claims D's engine id at a silent address. P must not
    bind D's name to that address: D's own registrations still reach P afterwards."""
    sock = _listener()
    w = World(handshake_timeout_s=1.0)
    try:
        reg = registration(
            request_id="d-s",
            match_key="x-s",
            block_ids=[[2]],
            decode_engine_id="D",
            decode_port=sock.getsockname()[1],
        )
        message = wire.encode_hello(reg, 0) if kind == "HELLO" else wire.encode_push_reg(reg)
        w.attacker.send(w.p_agent, message)
        _quiet(w, 2.5)  # P's handshake with the silent address timed out
        w.push("s", [37, 38], [46, 47])
        w.assert_nothing_outside_offered()
    finally:
        w.close()
        sock.close()


def test_early_dones_from_one_agent_are_capped(world: World) -> None:
    """DONEs for requests D does not have yet are held (they may overtake the add), at most
    ``early_cap_per_peer`` per agent; the rest are dropped. None completes anything."""
    cap = world.receiver.core.s.early_cap_per_peer
    before = world.receiver.stats["rejected_notifications"]
    for i in range(cap + 100):
        world.attacker.send(world.d_agent, wire.encode_done(f"never-{i}", P0, 1), pump_s=0.0)
        if i % 64 == 0:
            world.attacker.pump(0.01)
    world.rejected(world.receiver, before, 100)
    held = world.receiver.call_on_writer(lambda: world.receiver.core.state_sizes()["early"])
    assert held <= cap
    world.push("t", [39, 40], [48, 49])  # D still works; its own request is unaffected
