"""A packed DONE must name exactly the share of D's blocks its producer's plan agreed at the
handshake (defence in depth for P's packer).

D counted a producer once the chunks its packed DONEs announced had been scattered, trusting
the regions and block slice each DONE named. A P whose packer left a region out of every chunk
got the request reported done with that region never written; one whose DONE named another
producer's block slice had its bytes scattered over that producer's heads. D now checks each
packed DONE against the ``(region, slice)`` pieces the handshake computed for that producer
(``check_producers``): a piece outside the share is refused before anything is scattered, and a
share piece that no chunk named fails the request once the last chunk is in.

P's packer is made faulty here by patching it (the loopback cluster: real planning, packing
and scattering, bytes really copied).
"""

from __future__ import annotations

from typing import Any

import pytest
from cluster import MHA, Cluster, settle, wait_until

from kvpush.core import packing
from kvpush.plugins.strategy import ForcedStrategy

P_BLOCKS = [[9, 3, 17, 40]]
D_BLOCKS = [[2, 50, 7, 33]]


def _push_packed(cluster: Cluster) -> dict[int, str | None]:
    cluster.pm.register(ForcedStrategy("packed"), "forced_strategy")
    cluster.add("d-1", D_BLOCKS, "x-1")
    wait_until(
        lambda: all(r.stats["push_regs_sent"] > 0 for r in cluster.receivers.values()),
        what="PUSH_REG from every D rank",
    )
    for sender in cluster.senders.values():
        settle(sender)
    cluster.finish("p-1", P_BLOCKS, "x-1")
    return cluster.wait_decode("d-1")


def test_a_packed_push_whose_chunks_leave_a_region_out_fails_instead_of_done(monkeypatch) -> None:
    chunk_regions = packing.chunk_regions

    def forgetful(chunks: Any, mem_type: str) -> list[tuple[int, int]]:
        runs = chunk_regions(chunks, mem_type)
        lo, hi = runs[-1]
        return [*runs[:-1], (lo, hi - 1)] if hi - 1 > lo else runs[:-1]  # the last region: never

    monkeypatch.setattr(packing, "chunk_regions", forgetful)
    with Cluster(MHA, num_blocks=64) as cluster:
        outcome = _push_packed(cluster)[0]
        assert outcome is not None, "D reported done with a region of its blocks never written"
        assert "left D regions" in outcome and "unwritten" in outcome, outcome


def test_a_packed_done_naming_another_producers_slice_is_refused_before_scatter(monkeypatch) -> None:
    """P TP 2 -> D TP 1: each P rank writes half of every D block. P rank 1's DONE claims rank
    0's half: its bytes would land on rank 0's heads."""
    original = packing.PackManifest

    def wrong_half(**fields: Any) -> Any:
        if tuple(fields["part"]) == (1, 2):
            fields["part"] = (0, 2)
        return original(**fields)

    monkeypatch.setattr(packing, "PackManifest", wrong_half)
    with Cluster(MHA, num_blocks=64, prefill_tp=2, decode_tp=1) as cluster:
        outcome = _push_packed(cluster)[0]
        assert outcome is not None, "D reported done with one producer's bytes over another's heads"
        assert "outside the share" in outcome, outcome


@pytest.mark.parametrize(
    "shape", [{}, {"prefill_tp": 2, "decode_tp": 1}, {"prefill_pp": 2, "decode_tp": 2}], ids=str
)
def test_an_honest_packed_push_names_exactly_its_share(monkeypatch, shape: dict) -> None:
    monkeypatch.setattr(packing, "CHUNK_BYTES", 1024)  # several chunks per destination
    with Cluster(MHA, num_blocks=64, **shape) as cluster:
        assert set(_push_packed(cluster).values()) == {None}
        for receiver in cluster.receivers.values():
            engine = receiver.core._engines["P"]
            assert engine.info is not None and engine.info.shares, "the handshake computed no share"
