"""Where D's registered blocks start: D states it (``block_start`` per KV group, ``num_tokens``),
P pairs by it, never from the end, and refuses what it cannot cover or what the two legs state
differently (the LENGTHS_UNCHECKED defect of tests/test_probe_engine_sglang.py).

Pure units here (pairing, the wire, the engine API's checks); the pushes with every byte checked
are in tests/test_probe_engine_sglang.py (one group) and tests/test_hma.py (two groups, PP).
"""

from __future__ import annotations

import pytest

from kvpush.core import notifications as wire
from kvpush.core.errors import ConfigError, WireError
from kvpush.core.planning import HeldBlockIds, PromptBlocks, pair_blocks
from kvpush.core.types import PushRegistration, RequestMetadata, TransferParams

PARAMS = TransferParams(remote_engine_id="P", remote_host="127.0.0.1", remote_port=1, transfer_id="k")


# ------------------------------------------------------------------------------ pairing


def test_a_stated_start_pairs_d_blocks_with_p_blocks_of_the_same_index() -> None:
    p = ((10, 11, 12, 13, 14),)
    assert pair_blocks(p, ((20, 21),), "r", decode_start=(2,)) == ((12, 13),)
    assert pair_blocks(p, ((20, 21, 22),), "r", decode_start=(2,)) == ((12, 13, 14),)
    assert pair_blocks(p, ((20,),), "r", decode_start=(0,)) == ((10,),)


def test_a_block_p_holds_past_the_prompt_is_never_paired_when_d_states_its_start() -> None:
    """P's table holds a lookahead block; D registers the prompt's 3 blocks from 0: P's first
    3 move (from the end, P's blocks 1..3 moved into D's 0..2)."""
    assert pair_blocks(((10, 11, 12, 13),), ((20, 21, 22),), "r", decode_start=(0,)) == ((10, 11, 12),)


def test_d_registering_more_than_p_holds_from_its_start_fails_naming_both() -> None:
    with pytest.raises(ConfigError) as err:
        pair_blocks(((10, 11, 12),), ((20, 21),), "r-9", decode_start=(2,), decode_tokens=64)
    message = str(err.value)
    assert "D registered blocks 2 to 3 of KV group 0" in message
    assert "a 64-token prompt" in message
    assert "P holds blocks 0 to 2 (3 blocks)" in message
    assert "writes nothing" in message


def test_p_blocks_starting_after_ds_fail() -> None:
    """P states its group's blocks start at 2 (a window tail); D's start at 1 is not in it."""
    p = PromptBlocks(((10, 11, 12),), start=(2,))
    with pytest.raises(ConfigError, match="P holds blocks 2 to 4"):
        pair_blocks(p, ((20, 21),), "r", decode_start=(1,))
    assert pair_blocks(p, ((20, 21),), "r", decode_start=(3,)) == ((11, 12),)


def test_stated_prompt_lengths_that_differ_fail_naming_both() -> None:
    p = PromptBlocks(((10, 11, 12),), num_tokens=40)
    with pytest.raises(ConfigError, match="D expects a prompt of 41 tokens, P prefilled 40"):
        pair_blocks(p, ((20, 21, 22),), "r", decode_start=(0,), decode_tokens=41)
    assert pair_blocks(p, ((20, 21, 22),), "r", decode_start=(0,), decode_tokens=40) == ((10, 11, 12),)
    # one side stating no length: nothing to compare
    assert pair_blocks(((10, 11, 12),), ((20, 21, 22),), "r", decode_start=(0,), decode_tokens=41)


@pytest.mark.parametrize(
    ("p_ids", "d_ids"),
    [
        ((10, 11, 12, 13), (20, 21, 22)),  # P holds a block past the prompt
        ((10, 11, 12), (20, 21)),  # D one short, or a prefix hit: indistinguishable
    ],
)
def test_an_unstated_start_pairs_only_equal_counts(p_ids: tuple, d_ids: tuple) -> None:
    """A D that states no start (an earlier release, an engine that cannot tell): P pairs a
    group only when D registered as many blocks as P holds; otherwise it refuses to guess."""
    with pytest.raises(ConfigError, match="without stating where they start") as err:
        pair_blocks((p_ids,), (d_ids,), "r")
    assert f"D registered {len(d_ids)} blocks" in str(err.value)
    assert f"({len(p_ids)} blocks)" in str(err.value)
    assert pair_blocks((p_ids,), (d_ids + (99,) * (len(p_ids) - len(d_ids)),), "r") == (p_ids,)


def test_several_groups_pair_each_by_its_own_start() -> None:
    """A hybrid model: group 0 (full attention) with a 2-block hit, group 1 (sliding window)
    whose P blocks are the window's tail (P states they start at 3)."""
    p = PromptBlocks(((1, 2, 3, 4, 5), (7, 8)), start=(0, 3))
    d = ((21, 22, 23), (31,))
    assert pair_blocks(p, d, "r", decode_start=(2, 4)) == ((3, 4, 5), (8,))
    with pytest.raises(ConfigError, match="KV group 1"):
        pair_blocks(p, d, "r", decode_start=(2, 2))  # out of P's window: refused, not shifted
    with pytest.raises(ConfigError, match="without stating"):
        pair_blocks(p, d, "r")  # unstated, counts differ
    with pytest.raises(ConfigError, match="P has 2 KV-cache groups, D registered 3"):
        pair_blocks(p, (*d, ()), "r", decode_start=(0, 0, 0))
    with pytest.raises(ConfigError, match="1 block starts for 2 KV groups"):
        pair_blocks(p, d, "r", decode_start=(0,))


def test_a_group_this_rank_holds_no_layer_of_moves_nothing_whatever_its_ids() -> None:
    """A PP stage of a hybrid model: group 1's ids (the engine's count) are neither checked
    nor paired, stated start or not."""
    held = HeldBlockIds(((1, 2, 3), (9,)), frozenset({0}))
    assert pair_blocks(held, ((21, 22), (31, 32, 33)), "r", decode_start=(1, 0)) == ((2, 3), ())
    stated = PromptBlocks(held, held.held, (0, 5), None)
    assert pair_blocks(stated, ((21, 22), (31, 32, 33)), "r", decode_start=(1, 0)) == ((2, 3), ())


def test_prompt_blocks_survive_pickling() -> None:
    import pickle

    p = PromptBlocks(((1, 2),), frozenset({0}), (3,), 40)
    q = pickle.loads(pickle.dumps(p))
    assert (q, q.held, q.start, q.num_tokens) == (p, p.held, p.start, p.num_tokens)


# ------------------------------------------------------------------------------ the wire


def _reg(**kwargs: object) -> PushRegistration:
    fields = {
        "request_id": "d-1",
        "match_key": "k",
        "decode_engine_id": "D",
        "decode_host": "127.0.0.1",
        "decode_port": 5,
        "decode_tp_size": 1,
        "block_ids": ((1, 2), (3,)),
        "remote_engine_id": "P",
    }
    fields.update(kwargs)
    return PushRegistration(**fields)


def test_push_reg_carries_block_start_and_num_tokens() -> None:
    note = wire.decode_notification(wire.encode_push_reg(_reg(block_start=(4, 0), num_tokens=99)))
    assert note.registration.block_start == (4, 0)
    assert note.registration.num_tokens == 99
    assert wire.NOTIF_VERSION >= (2, 2)


def test_a_push_reg_without_them_reads_as_not_stated() -> None:
    """A D of an earlier release (2.1) sends neither field: P reads "not stated"."""
    message = wire.encode_push_reg(_reg())
    note = wire.decode_notification(message)
    assert note.registration.block_start is None and note.registration.num_tokens is None


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("bs", [1], "one int"),  # one start for two groups
        ("bs", [1, -1], "one int"),
        ("bs", [1, True], "one int"),
        ("bs", [1, 1 << 31], "one int"),
        ("bs", 3, "one int"),
        ("nt", -1, "'nt'"),
        ("nt", 1.5, "'nt'"),
        ("nt", 1 << 41, "'nt'"),
    ],
)
def test_malformed_block_start_or_num_tokens_is_a_wire_error(field: str, value: object, why: str) -> None:
    from kvpush.core.wire import pack, unpack

    body = unpack(wire.encode_push_reg(_reg())[len(wire.PUSH_REG_PREFIX) :], "test")
    body[field] = value
    with pytest.raises(WireError, match=why):
        wire.decode_notification(wire.PUSH_REG_PREFIX + pack(body))


# ------------------------------------------------------------------------------ the engine API


def test_request_metadata_takes_an_int_or_one_start_per_group() -> None:
    assert RequestMetadata(request_id="r", block_ids=[1], params=PARAMS, block_start=2).block_start == (2,)
    meta = RequestMetadata(request_id="r", block_ids=[[1], [2]], params=PARAMS, block_start=[0, 3])
    assert meta.block_start == (0, 3)
    assert RequestMetadata(request_id="r", block_ids=[1], params=PARAMS).block_start is None
    for bad in (-1, "2", [0, -2], {0: 1}, {1}, True, 1.0, []):
        with pytest.raises(ConfigError, match="block_start"):
            RequestMetadata(request_id="r", block_ids=[1], params=PARAMS, block_start=bad)
    for bad in (-1, "40", 1.5, True):
        with pytest.raises(ConfigError, match="num_tokens"):
            RequestMetadata(request_id="r", block_ids=[1], params=PARAMS, num_tokens=bad)
