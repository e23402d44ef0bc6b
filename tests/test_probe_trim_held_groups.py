"""Trim probes: a PP stage of a hybrid model and the KV groups it holds no layer of.

An engine hands every PP stage the request's block ids of every KV group, also of the groups the
stage holds no layer of, counted its own way: a vLLM stage cuts a group it lacks at its
scheduler block (it knows no kernel width for it), D at that group's kernel block, so the stage
hands *fewer* ids of that group than D registers. Nothing of that group moves from the stage
(another stage writes it), so P's end-trim must neither refuse nor use them; it still refuses
fewer ids than D's in a group the stage holds (D would count blocks P never writes).

Real pushes over loopback, every byte of every D tensor checked (``ProbeCluster``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
from test_probe_geometry_bytes import ENGINE_MODEL, SPLIT, ProbeCluster, engine_caches

from kvpush.core.errors import ConfigError
from kvpush.core.planning import trim_for_prefix_hit


def _short_unheld(cluster: ProbeCluster, keep: int) -> None:
    """Every P stage hands only the last ``keep`` ids of each KV group it holds no layer of (a
    vLLM stage's count of a group it lacks), the ids of its own groups as they are."""
    for sender in cluster.senders.values():
        held = {r.kv_group for r in sender.metadata.regions}
        finished = sender.request_finished

        def request_finished(
            rid: str, ids: Sequence[Sequence[int]], *a: Any, _f: Any = finished, _h: Any = held, **k: Any
        ) -> Any:
            cut = [list(g) if i in _h else list(g)[len(g) - keep :][:keep] for i, g in enumerate(ids)]
            return _f(rid, cut, *a, **k)

        sender.request_finished = request_finished  # type: ignore[method-assign]


@pytest.mark.parametrize("keep", [1, 0])
@pytest.mark.parametrize("layout", ["hma", "vllm"])
def test_a_stage_handing_fewer_ids_of_a_group_it_lacks_than_d_registered_pushes_its_layers(
    layout: str, keep: int
) -> None:
    """Layers (0, 0, 1, 1) over PP=2: stage 0 holds only group 0, stage 1 only group 1, and each
    hands fewer ids (one, or none) of the other group than D registered. P refused the request
    ("D registered 2 blocks in group 1 but P computed only 1") though that group never moves
    from the stage: every request failed (the vLLM adapter handed one id per token for such a
    group to dodge it). Now each stage pushes its own groups, byte-exact, nothing else written."""
    requests = [("r", [[1, 2, 3], [4, 5]], [[7, 6], [0, 3]]), ("s", [[4, 5], [6, 7]], [[1], [2, 4]])]
    kwargs: dict[str, Any] = {}
    model = SPLIT
    if layout == "vllm":
        groups = (0, 0, 1, 1)
        model, kwargs = ENGINE_MODEL, {"allocate": engine_caches(groups), "layer_groups": groups}
    with ProbeCluster(
        layout, model, prefill_pp=2, decode_tp=2, p_blocks=[8, 8], d_blocks=[8, 8], **kwargs
    ) as cluster:
        _short_unheld(cluster, keep)
        done = cluster.push(requests)
        assert set(done.values()) == {None}, done
        assert cluster.mismatches(requests, done) == []


def test_a_stage_handing_fewer_ids_of_a_group_it_holds_than_d_registered_still_fails() -> None:
    """The skip is for groups the stage holds no layer of only: each stage holds fewer ids of its
    own group than D registered (and fewer of the other): the request fails on D with P's
    reason, and nothing of it lands (D would otherwise count blocks P never wrote)."""
    requests = [("more", [[1], [3]], [[4, 5], [6, 7]]), ("fine", [[5, 6], [8, 9]], [[0, 1], [2]])]
    with ProbeCluster(
        "hma", SPLIT, prefill_pp=2, decode_tp=1, p_blocks=[12, 12], d_blocks=[12, 12]
    ) as cluster:
        _short_unheld(cluster, 1)
        done = cluster.push(requests)
        assert done[(0, "fine")] is None
        why = r"D registered blocks 0 to 1 of KV group [01] .* P holds blocks 0 to 0 \(1 blocks\)"
        assert re.search(why, done[(0, "more")] or ""), done
        assert cluster.mismatches(requests, done) == []


def test_trim_checks_and_trims_only_the_groups_the_rank_holds() -> None:
    from kvpush.core.planning import HeldBlockIds

    p, d = ((1, 2, 3), (4,)), ((7, 6), (0, 3, 5))
    with pytest.raises(ConfigError, match="D registered 3 blocks in group 1 but P computed only 1"):
        trim_for_prefix_hit(p, d, "r")
    assert trim_for_prefix_hit(p, d, "r", held={0}) == ((2, 3), ())
    assert trim_for_prefix_hit(HeldBlockIds(p, frozenset({0})), d, "r") == ((2, 3), ())
    with pytest.raises(ConfigError, match="in group 0 but P computed only 1"):
        trim_for_prefix_hit(HeldBlockIds(((1,), (4, 5, 6)), frozenset({0})), d, "r")
    with pytest.raises(ConfigError, match="P has 2 KV-cache groups, D registered 1"):
        trim_for_prefix_hit(HeldBlockIds(p, frozenset({0})), ((1,),), "r")


@pytest.mark.parametrize("strategy", ["direct", "packed"])
def test_a_stage_whose_own_groups_d_registered_nothing_of_still_completes(strategy: str) -> None:
    """D registers nothing of group 1 (its prefix cache held the window), something of group 0:
    stage 1, which holds only group 1, has nothing to write. It must still let D complete (a
    DONE with nothing written), or D waits for it until its timeout with its blocks held;
    stage 0 pushes group 0 byte-exact."""
    requests = [("z", [[1, 2, 3], [4, 5]], [[7, 6], []]), ("y", [[4], [6, 7]], [[], [1, 2]])]
    with ProbeCluster(
        "hma", SPLIT, prefill_pp=2, decode_tp=2, p_blocks=[8, 8], d_blocks=[8, 8], strategy=strategy
    ) as cluster:
        _short_unheld(cluster, 1)
        done = cluster.push(requests, timeout_s=20)
        assert set(done.values()) == {None}, done
        assert cluster.mismatches(requests, done) == []
