"""Handshake payloads: compact generic region encoding, the frame limit, mismatches naming fields."""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.core import region_codec, wire
from kvpush.core.errors import HandshakeError, WireError
from kvpush.core.sidechannel import SideChannelServer, fetch_metadata
from kvpush.core.types import KVRegion, RankKey
from kvpush.testing import make_agent_metadata


def wide_metadata(layers: int, per_layer: int, name: str = "model.layers.{}.self_attn.attn"):
    """A rank with ``per_layer`` regions per layer (e.g. one per head group), long layer names."""
    meta = make_agent_metadata(num_layers=layers)
    regions, base = [], 0x7F00_0000_0000
    for layer in range(layers):
        for k in range(per_layer):
            regions.append(
                KVRegion(
                    base_addr=base,
                    block_len=4096,
                    block_stride=4096,
                    num_blocks=2048,
                    layer_names=(name.format(layer),),
                    component=("K", "V")[k % 2] if per_layer == 2 else "KV",
                    num_heads=1,
                )
            )
            base += 4096 * 2048 + (k % 3) * 64  # not perfectly regular
    return attrs.evolve(meta, regions=regions)


def test_every_kvregion_field_round_trips():
    meta = make_agent_metadata(num_layers=6, pp_size=2, pp_rank=1, tp_size=2, tp_rank=1)
    decoded = wire.decode_metadata(wire.encode_metadata(meta), expected_hash=None, source="test")
    assert decoded.regions == meta.regions
    encoded = region_codec.encode_regions(meta.regions)
    assert set(encoded["cols"]) == {f.name for f in attrs.fields(KVRegion)}


region_strategy = st.builds(
    KVRegion,
    base_addr=st.integers(0, 2**48),
    block_len=st.integers(1, 64),
    block_stride=st.just(64),
    num_blocks=st.integers(1, 9),
    mem_type=st.sampled_from(["DRAM", "VRAM"]),
    layer_names=st.lists(st.sampled_from(["a", "b.1", "layers.10"]), min_size=1, max_size=2),
    kv_group=st.integers(0, 2),
    component=st.sampled_from(["K", "V", "KV", "latent"]),
    replicate=st.booleans(),
    num_heads=st.just(1),
)


@given(st.lists(region_strategy, max_size=30))
def test_region_codec_round_trips_any_regions(regions):
    assert region_codec.decode_regions(
        wire.unpack(wire.pack(region_codec.encode_regions(regions)), "x")
    ) == tuple(regions)


def test_region_codec_errors_name_the_column():
    encoded = region_codec.encode_regions(make_agent_metadata().regions)
    encoded["cols"]["num_heads"] = {"i": [1, 0, 99]}
    with pytest.raises(WireError, match="column 'num_heads'"):
        region_codec.decode_regions(encoded)


def test_a_synthetic_newer_peer_one_minor_version_ahead_decodes():
    """Issue 10.5: metadata decoding ignores fields a newer minor release added (here: in the
    inner map, in ParallelConfig, in ModelSpec and a new region column)."""
    meta = make_agent_metadata()
    outer = wire.unpack(wire.encode_metadata(meta), "outer")
    inner = wire.unpack(outer["meta"], "inner")
    inner["telemetry"] = {"build": "x"}
    inner["parallel"]["ep_size"] = 4
    inner["model"]["rope_theta"] = 1e6
    inner["regions"]["cols"]["colour"] = {"v": ["red", len(meta.regions)]}
    outer["meta"] = wire.pack(inner)
    decoded = wire.decode_metadata(wire.pack(outer), expected_hash=outer["compat_hash"], source="newer")
    assert decoded.regions == meta.regions
    assert (decoded.parallel, decoded.model) == (meta.parallel, meta.model)


def test_maps_of_earlier_payloads_still_decode():
    meta = make_agent_metadata()
    inner = wire.unpack(wire.unpack(wire.encode_metadata(meta), "outer")["meta"], "inner")
    inner["regions"] = [attrs.asdict(r) for r in meta.regions]
    outer = {"wire_version": wire.WIRE_VERSION, "compat_hash": None, "meta": wire.pack(inner)}
    assert wire.decode_metadata(wire.pack(outer), expected_hash=None, source="x").regions == meta.regions


def test_80_layers_of_64_regions_publish_and_fetch():
    meta = wide_metadata(80, 64)
    payload = wire.encode_metadata(meta)
    assert len(payload) < wire.MAX_FRAME_BYTES // 10, len(payload)
    server = SideChannelServer("big")
    try:
        server.publish(RankKey(0, 0), payload)
        fetched = fetch_metadata("127.0.0.1", server.port, RankKey(0, 0), timeout_s=10)
    finally:
        server.close()
    assert wire.decode_metadata(fetched, expected_hash=None, source="big").regions == meta.regions


def test_frame_limit_is_a_setting():
    code = "from kvpush.core import wire; print(wire.MAX_FRAME_BYTES)"
    env = {**os.environ, "KVPUSH_MAX_FRAME_BYTES": str(8 << 20)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(8 << 20), out.stderr
    env["KVPUSH_MAX_FRAME_BYTES"] = "lots"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "KVPUSH_MAX_FRAME_BYTES='lots' must be an int" in out.stderr


def test_hash_mismatch_lists_every_differing_field():
    local = make_agent_metadata(head_dim=8)
    peer = make_agent_metadata(role="decode", head_dim=16, block_size=32, transport="ucx")
    expected = wire.compatibility_hash(local.model, local.layout, local.transport)
    with pytest.raises(HandshakeError) as err:
        wire.decode_metadata(wire.encode_metadata(peer), expected_hash=expected, source="engine 'd'")
    message = str(err.value)
    assert "compatibility hash mismatch with engine 'd'" in message
    assert "model.head_dim: peer 16, local 8" in message
    assert "model.block_size: peer 32, local 16" in message
    assert "transport: peer 'ucx', local 'nixl'" in message
    assert "model.num_layers" not in message


def test_hash_mismatch_with_explicit_local_and_layout():
    local = make_agent_metadata()
    peer = make_agent_metadata(role="decode", layout="hma")
    with pytest.raises(HandshakeError, match="layout: peer 'hma', local 'uniform'"):
        wire.decode_metadata(
            wire.encode_metadata(peer),
            expected_hash="0" * 32,
            source="x",
            local=(local.model, local.layout, local.transport),
        )
