"""Block pairing against a model of the request's block sequence, driven by hypothesis.

Every P block id here encodes its index in the request's block sequence (``1000 x group +
index``), so a pairing is right when D's ``i``-th block of group ``g`` receives the id of index
``start[g] + i``, where ``start`` is where D's blocks *really* begin. P's engine passes any
window of the sequence (a sliding-window tail from a stated start, a lookahead block past the
prompt, a table cut short); D registers any window (a prefix hit, a block short of the
prompt's end, more than P holds) and states its start, or not. :func:`pair_blocks` must then
either pair every D block with exactly the P block of its index, or refuse (``ConfigError``):
never a shifted block, which D would report done with wrong KV.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.errors import ConfigError
from kvpush.core.planning import PromptBlocks, pair_blocks

EXAMPLES = int(os.environ.get("KVPUSH_CORE_EXAMPLES", "1500"))


def _block(group: int, index: int) -> int:
    return 1000 * group + index


@st.composite
def _requests(draw: st.DrawFn) -> dict:
    groups = draw(st.integers(1, 3))
    prompt_blocks = draw(st.integers(1, 12))
    p_states_start = draw(st.booleans())
    p_first, p_len, d_first, d_len = [], [], [], []
    for _ in range(groups):
        # the engine contract: P's ids begin at block 0 unless P states where they begin
        first = draw(st.integers(0, prompt_blocks - 1)) if p_states_start else 0
        p_first.append(first)
        p_len.append(draw(st.integers(0, prompt_blocks + 2 - first)))  # may run past the prompt
        start = draw(st.integers(0, prompt_blocks))
        d_first.append(start)
        d_len.append(draw(st.integers(0, prompt_blocks + 1 - start)))  # may be short or long
    p_tokens = draw(st.none() | st.integers(1, 200))
    d_tokens = draw(st.none() | st.sampled_from([p_tokens, 7]) if p_tokens is not None else st.none())
    return {
        "p": tuple(tuple(_block(g, p_first[g] + i) for i in range(p_len[g])) for g in range(groups)),
        "p_first": tuple(p_first),
        "d": tuple(tuple(5000 + 100 * g + i for i in range(d_len[g])) for g in range(groups)),
        "d_first": tuple(d_first),
        "p_states_start": p_states_start,
        "d_states_start": draw(st.booleans()),
        "p_tokens": p_tokens,
        "d_tokens": d_tokens,
    }


@settings(max_examples=EXAMPLES, deadline=None)
@given(_requests())
def test_every_paired_block_holds_its_own_index_or_the_push_is_refused(r: dict) -> None:
    if not any(r["d"]):
        return  # a full prefix hit: D completes at once and never registers
    producer = PromptBlocks(
        r["p"], start=r["p_first"] if r["p_states_start"] else None, num_tokens=r["p_tokens"]
    )
    try:
        paired = pair_blocks(
            producer,
            r["d"],
            "r",
            decode_start=r["d_first"] if r["d_states_start"] else None,
            decode_tokens=r["d_tokens"],
        )
    except ConfigError:
        return  # refused: nothing is written, both legs fail (the push tests check that)
    assert len(paired) == len(r["d"])
    lengths_stated_apart = r["p_tokens"] is not None and r["d_tokens"] not in (None, r["p_tokens"])
    assert not lengths_stated_apart, "two different stated prompt lengths were paired"
    for group, (ids, d_ids) in enumerate(zip(paired, r["d"])):
        if not d_ids:
            assert ids == ()
            continue
        assert len(ids) == len(d_ids), (group, ids, d_ids)
        if not r["d_states_start"]:
            # D stated no start: only a block-for-block pairing of equal counts is allowed,
            # resting on the engine contract that both legs then begin at block 0.
            assert len(r["p"][group]) == len(d_ids)
            if r["d_first"][group] != 0:
                continue  # D broke that contract (a hit it did not state): not P's to see

        want = tuple(_block(group, r["d_first"][group] + i) for i in range(len(d_ids)))
        assert ids == want, f"group {group}: D's blocks from {r['d_first'][group]} got {ids}"


@pytest.mark.parametrize(
    ("p_first", "p_len", "d_first", "d_len", "ok"),
    [
        (0, 4, 0, 3, True),  # P holds a lookahead block: D's 3 get P's first 3
        (0, 3, 1, 2, True),  # a prefix hit of one block
        (0, 3, 0, 4, False),  # D registers more than P holds
        (2, 3, 1, 2, False),  # D starts before P's first block (a window tail)
        (2, 3, 3, 2, True),
    ],
)
def test_the_models_corner_cases(p_first: int, p_len: int, d_first: int, d_len: int, ok: bool) -> None:
    p = PromptBlocks((tuple(_block(0, p_first + i) for i in range(p_len)),), start=(p_first,))
    d = (tuple(range(5000, 5000 + d_len)),)
    if not ok:
        with pytest.raises(ConfigError):
            pair_blocks(p, d, "r", decode_start=(d_first,))
        return
    assert pair_blocks(p, d, "r", decode_start=(d_first,)) == (
        tuple(_block(0, d_first + i) for i in range(d_len)),
    )


def test_a_d_stating_no_start_is_not_paired_with_a_p_tail_of_equal_count() -> None:
    """Found by the model above: P's engine passed a sliding-window group's tail from block 1
    (stated), D stated no start and registered as many blocks (its own from 0): block for block
    put P's block 1 into D's block 0, and D reported the request done."""
    p = PromptBlocks(((), (_block(1, 1),)), start=(0, 1))
    with pytest.raises(ConfigError, match="stated block_start=1"):
        pair_blocks(p, ((), (5100,)), "r")
