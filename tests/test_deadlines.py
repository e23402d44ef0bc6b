"""Deadlines (core/deadlines.py): the lazily invalidated heap both protocol cores keep timers in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.deadlines import Deadlines


def test_pop_expired_returns_due_keys_earliest_first_and_each_once() -> None:
    timers = Deadlines()
    timers.arm("c", 3.0)
    timers.arm("a", 1.0)
    timers.arm("b", 2.0)
    timers.arm("later", 10.0)
    assert timers.pop_expired(0.5) == []
    assert timers.pop_expired(3.0) == ["a", "b", "c"]  # "at or before now"
    assert timers.pop_expired(3.0) == []
    assert len(timers) == 1 and timers.next_deadline() == 10.0


def test_equal_deadlines_fire_in_arming_order() -> None:
    timers = Deadlines()
    for key in ("x", "y", "z"):
        timers.arm(key, 5.0)
    assert timers.pop_expired(5.0) == ["x", "y", "z"]


def test_rearming_supersedes_the_earlier_arming_in_both_directions() -> None:
    timers = Deadlines()
    timers.arm(("lease", "k"), 1.0)
    timers.arm(("lease", "k"), 5.0)  # pushed later: the 1.0 entry is dead
    assert timers.when(("lease", "k")) == 5.0
    assert timers.next_deadline() == 5.0
    assert timers.pop_expired(4.0) == []
    timers.arm(("lease", "k"), 2.0)  # pulled earlier
    assert timers.pop_expired(2.0) == [("lease", "k")]
    assert timers.pop_expired(100.0) == []  # the superseded 5.0 entry never fires
    assert len(timers) == 0 and timers.when(("lease", "k")) is None


def test_disarm_forgets_a_key_and_next_deadline_skips_it() -> None:
    timers = Deadlines()
    timers.arm("a", 1.0)
    timers.arm("b", 2.0)
    timers.disarm("a")
    timers.disarm("never armed")  # a no-op, not an error
    assert timers.when("a") is None and len(timers) == 1
    assert timers.next_deadline() == 2.0
    assert timers.pop_expired(10.0) == ["b"]
    assert timers.next_deadline() is None


def test_a_key_popped_can_be_armed_again() -> None:
    timers = Deadlines()
    timers.arm("hb", 1.0)
    assert timers.pop_expired(1.0) == ["hb"]
    timers.arm("hb", 2.0)
    assert timers.pop_expired(2.0) == ["hb"]


def test_churn_of_disarmed_future_entries_does_not_grow_the_heap() -> None:
    """Requests that end before their timers fire leave dead entries; a pop compacts them."""
    timers = Deadlines()
    for i in range(20_000):
        timers.arm(("lease", i), 1000.0 + i)
        timers.disarm(("lease", i))
    for i in range(10):
        timers.arm(("live", i), 2000.0 + i)
    assert timers.pop_expired(0.0) == []
    assert len(timers) == 10
    assert len(timers._heap) <= 64, "dead entries were not compacted"
    assert timers.pop_expired(3000.0) == [("live", i) for i in range(10)]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("arm"), st.integers(0, 7), st.integers(0, 40)),
            st.tuples(st.just("disarm"), st.integers(0, 7), st.just(0)),
            st.tuples(st.just("pop"), st.just(0), st.integers(0, 40)),
        ),
        max_size=80,
    )
)
def test_matches_a_dict_of_live_deadlines(ops: list[tuple[str, int, int]]) -> None:
    """Against a plain model: each key's newest arming is the only one that counts."""
    timers = Deadlines()
    model: dict[int, tuple[float, int]] = {}
    seq = 0
    for op, key, value in ops:
        if op == "arm":
            timers.arm(key, float(value))
            model[key] = (float(value), seq)
            seq += 1
        elif op == "disarm":
            timers.disarm(key)
            model.pop(key, None)
        else:
            due = sorted((k for k, (w, _) in model.items() if w <= value), key=lambda k: model[k])
            assert timers.pop_expired(float(value)) == due
            for k in due:
                del model[k]
        assert len(timers) == len(model)
        assert timers.next_deadline() == (min(w for w, _ in model.values()) if model else None)
        for k in range(8):
            assert timers.when(k) == (model[k][0] if k in model else None)
