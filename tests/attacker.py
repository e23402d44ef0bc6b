"""A test helper that plays the attacker (issue 16): a NIXL agent that knows only what side
channels serve.

:class:`Attacker` owns its own NIXL agent (:class:`kvpush.transports.nixl.NixlTransport`). It
learns a victim engine's ranks by asking the engine's side channel, exactly as any peer can
(:func:`kvpush.core.sidechannel.fetch_metadata`, :func:`kvpush.core.wire.decode_metadata`), loads
the agent blob it found there, and then sends whatever it likes: notifications built with
:mod:`kvpush.core.notifications` encoders or hand-made bytes. It can also answer P's requests for
a fresh grant (:meth:`Attacker.echo_grants`), which is what a registrant must do before P writes.

:func:`rogue_decode` builds a whole decode engine (own memory, own side channel) from a victim
D's served metadata, to register first for a match key and receive the push if P lets it.
Everything runs on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import time
from typing import Any

from kvpush.core import notifications as wire
from kvpush.core.sidechannel import SideChannelServer, fetch_metadata
from kvpush.core.transport import TransportConfig
from kvpush.core.types import AgentMetadata, Notification, PushRegistration, RankKey
from kvpush.core.wire import decode_metadata
from kvpush.transports.nixl import NixlTransport

HOST = "127.0.0.1"
FIRST_RANK = RankKey(0, 0)


class Attacker:
    """A NIXL agent outside both engines. Use from one thread (the test's)."""

    def __init__(self, name: str = "mallory") -> None:
        self.name = name
        self.transport = NixlTransport(TransportConfig(agent_name=name, options={}))
        self.loaded: dict[str, AgentMetadata] = {}
        """Peer agent name -> the metadata it was loaded from."""
        self.received: list[tuple[str, bytes]] = []
        """Every notification this agent received (peer, bytes)."""

    # ------------------------------------------------------------------ learning the victims

    def fetch(self, port: int, rank: RankKey = FIRST_RANK, engine_id: str = "?") -> AgentMetadata:
        """What the side channel at 127.0.0.1:``port`` serves for ``rank`` (no hash check)."""
        payload = fetch_metadata(HOST, port, rank, timeout_s=5.0, engine_id=engine_id)
        return decode_metadata(payload, expected_hash=None, source=f"side channel {HOST}:{port}")

    def load(self, port: int, rank: RankKey = FIRST_RANK, engine_id: str = "?") -> str:
        """Fetch a rank's metadata and load its NIXL agent; the agent name to send to."""
        meta = self.fetch(port, rank, engine_id)
        agent = self.transport.load_peer(meta.agent_blob)
        self.loaded[agent] = meta
        return agent

    # ------------------------------------------------------------------ sending

    def send(self, agent: str, message: bytes, pump_s: float = 0.05) -> None:
        """Send one notification and drive this agent's progress a moment (without a progress
        thread UCX sends only while the sending agent is progressed)."""
        self.transport.send_notif(agent, message)
        self.pump(pump_s)

    def pump(self, seconds: float) -> None:
        """Progress this agent for ``seconds`` (draining what arrives into ``received``)."""
        deadline = time.monotonic() + seconds
        while True:
            self.drain()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.002)

    def drain(self) -> list[tuple[str, bytes]]:
        got = self.transport.drain_notifs()
        self.received += got
        return got

    def echo_grants(
        self, agent: str, reg: PushRegistration, keys: list[str], timeout_s: float = 5.0
    ) -> float | None:
        """Wait (bounded) for P's heartbeat answer carrying a stamp, then send a heartbeat that
        echoes it as the grant for ``keys``; the stamp echoed, or None if none came."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for peer, message in self.drain():
                note = wire.decode_notification(message)
                if peer == agent and note is not None and note.stamp is not None:
                    granted = _evolve(reg, grant=note.stamp)
                    self.send(agent, wire.encode_heartbeat(keys, granted, reg.decode_tp_rank))
                    return note.stamp
            time.sleep(0.01)
        return None

    def notifications(self) -> list[Notification]:
        self.drain()
        out = []
        for _, message in self.received:
            note = wire.decode_notification(message)
            if note is not None:
                out.append(note)
        return out

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Attacker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def registration(
    *,
    request_id: str,
    match_key: str,
    block_ids: Any,
    decode_engine_id: str = "mallory",
    decode_port: int = 1,
    decode_tp_size: int = 1,
    decode_tp_rank: int = 0,
    remote_engine_id: str = "P",
    incarnation: str = "evil",
    grant: float | None = None,
    fresh_s: float = 60.0,
) -> PushRegistration:
    """A PUSH_REG's content, with whatever coordinates the attacker claims."""
    return PushRegistration(
        request_id=request_id,
        match_key=match_key,
        decode_engine_id=decode_engine_id,
        decode_host=HOST,
        decode_port=decode_port,
        decode_tp_size=decode_tp_size,
        block_ids=tuple(tuple(g) for g in block_ids),
        remote_engine_id=remote_engine_id,
        decode_tp_rank=decode_tp_rank,
        decode_incarnation=incarnation,
        grant=grant,
        fresh_s=fresh_s,
    )


def _evolve(reg: PushRegistration, **changes: Any) -> PushRegistration:
    import attrs

    return attrs.evolve(reg, **changes)


def rogue_decode(victim: AgentMetadata, prefill_port: int, engine_id: str = "mallory") -> Any:
    """A decode engine built from a victim D's served metadata (model, layout, parallel): its own
    caches, its own NIXL agent and its own side channel. Returns ``(receiver, server, caches)``;
    the caller closes the receiver and the server."""
    from kvpush.core.manager import get_plugin_manager
    from kvpush.core.receiver import PushReceiver
    from kvpush.core.worker import WorkerConfig

    pm = get_plugin_manager(load_entrypoints=False)
    caches = pm.layout(victim.layout).allocate(
        victim.model, victim.parallel, (victim.regions[0].num_blocks,), "cpu"
    )
    server = SideChannelServer(engine_id)
    receiver = PushReceiver(
        WorkerConfig(
            engine_id=engine_id,
            parallel=victim.parallel,
            model=victim.model,
            layout=victim.layout,
            transport="nixl",
            side_channel_port=server.port,
            heartbeat_interval_s=0.05,
        ),
        dict(caches),
        pm=pm,
    )
    receiver.start()
    server.publish(victim.parallel.rank, receiver.handshake_payload())
    return receiver, server, caches
