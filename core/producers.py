"""Who writes to whom: the one rule P plans its WRITEs by and D counts completions by.

A D rank waits for exactly the set of producers ``(pp_rank, tp_rank)`` that
:func:`expected_producers` names, computed from P's ``ParallelConfig`` as P published it in the
handshake (never from sizes a router passed). P checks its read specs against the same rule
before it posts (``PushSender._plan``), so a plugin whose plan disagrees fails the request with a
named reason instead of leaving D waiting or counting a producer that wrote nothing.

TP mapping (heads or MLA latent alike): with ``k`` the ratio of the TP sizes, P rank ``r``
writes D ranks ``r·k … r·k+k-1`` when P_TP <= D_TP, and D rank ``r // k`` when P_TP > D_TP.
Every PP stage writes its own layers, so every stage is a producer.
"""

from __future__ import annotations

from kvpush.core.errors import ConfigError
from kvpush.core.types import RankKey


def tp_ratio(producer_tp: int, decode_tp: int) -> int:
    """``k``: the larger TP size over the smaller; raises when one does not divide the other."""
    big, small = max(producer_tp, decode_tp), min(producer_tp, decode_tp)
    if small <= 0 or big % small:
        raise ConfigError(f"prefill TP {producer_tp} and decode TP {decode_tp} must divide one another")
    return big // small


def destinations(producer_tp_rank: int, producer_tp: int, decode_tp: int) -> list[int]:
    """The D TP ranks one P TP rank writes to."""
    k = tp_ratio(producer_tp, decode_tp)
    if producer_tp <= decode_tp:
        return [producer_tp_rank * k + s for s in range(k)]
    return [producer_tp_rank // k]


def expected_producers(
    *, prefill_pp: int, prefill_tp: int, decode_tp_rank: int, decode_tp_size: int
) -> frozenset[RankKey]:
    """Every producer ``(pp_rank, tp_rank)`` whose completion D rank ``decode_tp_rank`` needs."""
    if not 0 <= decode_tp_rank < decode_tp_size:
        raise ConfigError(f"decode tp_rank {decode_tp_rank} is not below decode tp_size {decode_tp_size}")
    k = tp_ratio(prefill_tp, decode_tp_size)
    if prefill_tp <= decode_tp_size:
        tp_ranks = [decode_tp_rank // k]
    else:
        tp_ranks = [decode_tp_rank * k + s for s in range(k)]
    return frozenset(RankKey(pp, tp) for pp in range(prefill_pp) for tp in tp_ranks)
