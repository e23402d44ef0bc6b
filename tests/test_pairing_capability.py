"""A D meets a P of an older release: one that pairs blocks from the end of its table.

Before notification format 2.2, P paired D's registered blocks with the last ones of its own
block table and ignored where D's blocks start (``block_start``, which it does not read): a P
table one block longer than the prompt (a block allocated ahead for decode) or a D registering
fewer blocks than P holds (a prefix hit) shifted every block, and D reported done with another
position's KV. A P of this release states how it pairs (``block_pairing: start`` in its
handshake metadata); D refuses the handshake of a P that does not, so the request fails naming
the cause and no byte lands. Both P and D here are real rank processes over real NIXL; P's
published metadata has the statement removed, as an older release publishes it.
"""

from __future__ import annotations

from typing import Any

import attrs
from test_probe_reconfig_restart import Rig, Side, outcome_kinds

from kvpush.core import wire
from kvpush.core.worker import BLOCK_PAIRING_KEY


def _as_older_release(payload: bytes) -> bytes:
    meta = wire.decode_metadata(payload, expected_hash=None, source="the test")
    extensions = {k: v for k, v in meta.extensions.items() if k != BLOCK_PAIRING_KEY}
    return wire.encode_metadata(attrs.evolve(meta, extensions=extensions))


class OlderP(Rig):
    """The rig with P's published metadata stripped of its pairing statement."""

    def start_p(self, side: Side, **extra: Any) -> None:
        published = self.p_server.publish_all
        self.p_server.publish_all = lambda payloads: published(  # type: ignore[method-assign]
            {rank: _as_older_release(payload) for rank, payload in payloads.items()}
        )
        try:
            super().start_p(side, **extra)
        finally:
            self.p_server.publish_all = published  # type: ignore[method-assign]


def test_d_refuses_a_p_that_does_not_state_how_it_pairs_blocks() -> None:
    with OlderP(Side(), Side()) as rig:
        rig.push("r1", 1, 4, 0, 3)
        outcomes = rig.settle(["r1"])
        rig.check_bytes(outcomes)
        assert outcome_kinds(outcomes) == {"r1": ["failed"]}, outcomes
        (reason,) = {str(value) for _, value in outcomes["r1"].values()}
        assert BLOCK_PAIRING_KEY in reason and "older kvpush release" in reason, reason


def test_the_same_p_stating_it_is_served() -> None:
    with Rig(Side(), Side()) as rig:
        rig.push("r1", 1, 4, 0, 3)
        outcomes = rig.settle(["r1"])
        rig.check_bytes(outcomes)
        assert outcome_kinds(outcomes) == {"r1": ["done"]}, outcomes
