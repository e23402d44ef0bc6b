"""The frozen attrs data model: validation names the field, objects are immutable and hashable."""

from __future__ import annotations

import attrs
import pytest

from kvpush.core.errors import ConfigError
from kvpush.core.types import (
    KVRegion,
    ModelSpec,
    ParallelConfig,
    RankKey,
    ReadSpec,
    RegionAlignment,
    RequestMetadata,
    TransferParams,
    to_block_ids,
)
from kvpush.testing import make_agent_metadata

VALID = {
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 4,
    "pp_size": 2,
    "remote_block_ids": [[1, 2], [3]],
    "remote_request_id": "p-req",
    "transfer_id": "xfer-9",
}

# ------------------------------------------------------------------------------ TransferParams


def test_transfer_params_round_trip():
    params = TransferParams.from_dict(VALID)
    assert params.remote_block_ids == ((1, 2), (3,))
    assert params.to_dict() == VALID
    assert TransferParams.from_dict(params.to_dict()) == params


def test_transfer_params_defaults():
    params = TransferParams.from_dict(
        {"remote_engine_id": "p", "remote_host": "h", "remote_port": 1, "tp_size": None}
    )
    # Absent sizes stay absent: D takes P's published sizes, never a default of 1 (issue 10.1).
    assert (params.tp_size, params.pp_size, params.remote_block_ids, params.transfer_id) == (None,) * 4
    assert params.to_dict() == {"remote_engine_id": "p", "remote_host": "h", "remote_port": 1}


@pytest.mark.parametrize("field", ["remote_engine_id", "remote_host", "remote_port"])
def test_transfer_params_missing_field_named(field):
    params = {k: v for k, v in VALID.items() if k != field}
    with pytest.raises(ConfigError, match=f"kv_transfer_params is missing '{field}'"):
        TransferParams.from_dict(params)
    with pytest.raises(ConfigError, match=f"missing '{field}'"):
        TransferParams.from_dict({**VALID, field: None})


@pytest.mark.parametrize(
    ("field", "value", "needs"),
    [
        ("remote_engine_id", 7, "must be a str"),
        ("remote_host", b"10.0.0.1", "must be a str"),
        ("remote_request_id", 1, "must be a str"),
        ("transfer_id", ["x"], "must be a str"),
        ("remote_port", "5600", "must be an int in"),
        ("remote_port", 0, "must be an int in"),
        ("remote_port", 70000, "[1, 65535]"),
        ("tp_size", 0, "must be an int in"),
        ("tp_size", 2.0, "must be an int in"),
        ("pp_size", True, "must be an int in"),
        ("pp_size", -1, "must be an int in"),
        ("remote_block_ids", [[1, -2]], "block id -2"),
        ("remote_block_ids", [[1], "ab"], "list of per-group lists"),
    ],
)
def test_transfer_params_bad_field_named(field, value, needs):
    with pytest.raises(ConfigError) as excinfo:
        TransferParams.from_dict({**VALID, field: value})
    message = str(excinfo.value)
    assert f"kv_transfer_params['{field}']" in message
    assert needs in message


def test_transfer_params_not_a_mapping():
    with pytest.raises(ConfigError, match="kv_transfer_params must be a dict, got list"):
        TransferParams.from_dict([("remote_host", "h")])


def test_transfer_params_match_key():
    assert TransferParams.from_dict(VALID).match_key == "xfer-9"
    assert TransferParams.from_dict({**VALID, "transfer_id": None}).match_key == "p-req"
    bare = TransferParams.from_dict({**VALID, "transfer_id": None, "remote_request_id": None})
    with pytest.raises(ConfigError, match="needs 'transfer_id' or 'remote_request_id'"):
        _ = bare.match_key


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        TransferParams.from_dict({})


# ------------------------------------------------------------------------------ block ids


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ()),
        ([], ()),
        ([1, 2, 3], ((1, 2, 3),)),
        ((4,), ((4,),)),
        ([[1, 2], [], [5]], ((1, 2), (), (5,))),
        (((1,), range(2, 4)), ((1,), (2, 3))),
    ],
)
def test_to_block_ids(value, expected):
    assert to_block_ids(value) == expected


@pytest.mark.parametrize("value", [[[1, True]], [[1, 2.0]], [[-1]], ["12"], [7, [8]]])
def test_to_block_ids_rejects(value):
    with pytest.raises(ConfigError):
        to_block_ids(value)


def test_request_and_read_spec_normalise_block_ids():
    params = TransferParams.from_dict(VALID)
    request = RequestMetadata(request_id="r", block_ids=[4, 5], params=params)
    assert request.block_ids == ((4, 5),)
    assert request.params.pp_size == 2
    spec = ReadSpec(dst_tp_rank=0, local_block_ids=[1], remote_block_ids=[[2], [3]])
    assert (spec.local_block_ids, spec.remote_block_ids) == (((1,),), ((2,), (3,)))
    assert (spec.local_part, spec.remote_part) == ((0, 1), (0, 1))
    assert hash(spec) == hash(ReadSpec(dst_tp_rank=0, local_block_ids=((1,),), remote_block_ids=[[2], [3]]))


# ------------------------------------------------------------------------------ parallel / model


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 0, "num_layers": 4}, "tp_size must be a positive int"),
        ({"tp_size": 2, "tp_rank": 2, "num_layers": 4}, "tp_rank 2 is not below tp_size 2"),
        ({"tp_size": 1, "pp_size": 2, "pp_rank": 2, "num_layers": 4}, "pp_rank 2 is not below pp_size 2"),
        ({"tp_size": 1, "tp_rank": -1, "num_layers": 4}, "tp_rank must be a non-negative int"),
        ({"tp_size": 1, "num_layers": 4, "start_layer": 2, "end_layer": 2}, r"layer window \[2, 2\)"),
        ({"tp_size": 1, "num_layers": 4, "end_layer": 5}, "inside the model's 4 layers"),
    ],
)
def test_parallel_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


def test_parallel_config_stages():
    stages = [
        ParallelConfig.for_stage(num_layers=5, pp_size=2, pp_rank=r, tp_size=2, tp_rank=1) for r in (0, 1)
    ]
    assert [(s.start_layer, s.end_layer, s.num_local_layers) for s in stages] == [(0, 3, 3), (3, 5, 2)]
    assert stages[1].rank == RankKey(pp_rank=1, tp_rank=1)
    assert ParallelConfig(tp_size=1, num_layers=6).end_layer == 6
    with pytest.raises(ConfigError, match="pp_size 5 exceeds the model's 4 layers"):
        ParallelConfig.for_stage(num_layers=4, pp_size=5, pp_rank=0, tp_size=1, tp_rank=0)


def test_rank_key_orders_and_prints():
    assert sorted([RankKey(1, 0), RankKey(0, 3), RankKey(0, 1)]) == [
        RankKey(0, 1),
        RankKey(0, 3),
        RankKey(1, 0),
    ]
    assert str(RankKey(1, 2)) == "(pp=1, tp=2)"


def test_model_spec_groups_and_kinds():
    model = ModelSpec(
        name="hybrid", num_layers=3, layer_groups=[0, 1, 0], layer_kinds=["full", "sliding_window", "full"]
    )
    assert model.layer_groups == (0, 1, 0)
    assert (model.num_groups, model.group_of(1), model.kind_of(1)) == (2, 1, "sliding_window")
    plain = ModelSpec(name="plain", num_layers=2)
    assert (plain.num_groups, plain.group_of(1), plain.kind_of(0)) == (1, 0, "full")
    with pytest.raises(
        ConfigError, match=r"ModelSpec.layer_groups has 2 entries; it needs one per layer \(3\)"
    ):
        ModelSpec(name="bad", num_layers=3, layer_groups=[0, 1])


# ------------------------------------------------------------------------------ regions / metadata


def region(**overrides):
    fields = {
        "base_addr": 4096,
        "block_len": 256,
        "block_stride": 512,
        "num_blocks": 4,
        "layer_names": ["l.0"],
    }
    return KVRegion(**{**fields, **overrides})


def test_kv_region_geometry():
    r = region()
    assert r.end_addr == 4096 + 3 * 512 + 256
    assert r.layer_names == ("l.0",)
    assert r.semantic_key == (("l.0",), 0, "KV")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"block_stride": 128}, "block_stride 128 is smaller than block_len 256"),
        ({"mem_type": "HBM"}, "mem_type must be 'DRAM' or 'VRAM'"),
        ({"num_blocks": 0}, "num_blocks must be a positive int"),
        ({"base_addr": -1}, "base_addr must be a non-negative int"),
    ],
)
def test_kv_region_validation(overrides, match):
    with pytest.raises(ConfigError, match=match):
        region(**overrides)


def test_frozen_and_evolve():
    meta = make_agent_metadata(tp_size=2, tp_rank=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        meta.engine_id = "other"
    renamed = attrs.evolve(meta, engine_id="other")
    assert (renamed.engine_id, meta.engine_id) == ("other", "prefill-engine")
    assert renamed.rank == meta.rank == RankKey(0, 1)
    assert isinstance(meta.regions, tuple)


def test_agent_metadata_repr_hides_blob():
    meta = make_agent_metadata()
    assert "<16 bytes>" in repr(meta)
    assert "\\x00" not in repr(meta)


def test_region_alignment_is_a_tuple():
    alignment = RegionAlignment(remote_indices=range(2, 4))
    assert alignment.remote_indices == (2, 3)
    assert alignment.source == "identity"
    assert {alignment, RegionAlignment(remote_indices=[2, 3])} == {alignment}
