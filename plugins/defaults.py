"""Default policies: handshake mode, peer validation, completion count, notification format."""

from __future__ import annotations

from kvpush.core import notifications
from kvpush.core.markers import hookimpl
from kvpush.core.producers import expected_producers
from kvpush.core.types import (
    AgentMetadata,
    HandshakeMode,
    Notification,
    ParallelConfig,
    Role,
)


@hookimpl(trylast=True)
def kvpush_handshake_mode(role: Role, peer_role: Role) -> HandshakeMode:
    # D only ever sends notifications to P; it never reads or writes P's memory (vLLM #49345).
    if role is Role.DECODE:
        return HandshakeMode.NOTIF_ONLY
    return HandshakeMode.FULL


@hookimpl
def kvpush_validate_peer(local: AgentMetadata, peer: AgentMetadata, mode: HandshakeMode) -> list[str]:
    problems = []
    if local.role is peer.role:
        problems.append(
            f"both sides are {local.role.value} engines; push pairs a prefill with a decode engine"
        )
    if peer.transport != local.transport:
        problems.append(f"peer uses transport {peer.transport!r}, this side {local.transport!r}")
    decode = peer if peer.role is Role.DECODE else local
    if decode.parallel.pp_size > 1:
        problems.append(
            f"decode engine {decode.engine_id!r} runs PP={decode.parallel.pp_size}; only the "
            f"prefill side may be pipeline-parallel"
        )
    if mode is HandshakeMode.FULL:
        mem = {r.mem_type for r in peer.regions}
        if len(mem) > 1:
            problems.append(f"peer mixes memory types {sorted(mem)} in its KV cache")
    return problems


@hookimpl(trylast=True)
def kvpush_expected_producers(prefill: ParallelConfig, decode_tp_rank: int, decode_tp_size: int) -> frozenset:
    return expected_producers(
        prefill_pp=prefill.pp_size,
        prefill_tp=prefill.tp_size,
        decode_tp_rank=decode_tp_rank,
        decode_tp_size=decode_tp_size,
    )


@hookimpl(tryfirst=True)
def kvpush_decode_notification(message: bytes) -> Notification | None:
    """kvpush's own messages are decoded here, before any plugin (one that mistook a DONE, FAIL
    or PUSH_REG for its own format could complete or fail a request); None for the rest."""
    return notifications.decode_notification(message)  # not via wire's module __getattr__
