"""``WorkerConfig.spin_s``: writers that poll without sleeping for a while after activity
(real NIXL between two in-process agents), and sleep again once it is over."""

from __future__ import annotations

import time

import pytest
from cluster import MHA, Cluster, wait_until
from test_push_flow import assert_pushed

from kvpush.core.errors import ConfigError
from kvpush.core.types import ParallelConfig
from kvpush.core.worker import WorkerConfig


@pytest.mark.parametrize("bad", [-0.001, 61.0, float("nan")])
def test_spin_outside_its_range_is_refused_with_the_field_named(bad: float) -> None:
    with pytest.raises(ConfigError, match="spin_s"):
        WorkerConfig(
            engine_id="x",
            parallel=ParallelConfig(tp_size=1, num_layers=MHA.num_layers),
            model=MHA,
            spin_s=bad,
        )


def test_spinning_writers_push_exactly_and_sleep_again_after_the_window() -> None:
    with Cluster(MHA, transport="nixl", spin_s=0.2) as cluster:
        sender, receiver = cluster.senders[next(iter(cluster.senders))], cluster.receivers[0]
        for i in range(3):
            cluster.add(f"s-{i}", [[1 + i, 9 + i]], f"k-{i}")
            wait_until(lambda: sender.core.state_sizes()["stashed"] >= 1, what="PUSH_REG at P")
            cluster.finish(f"s-{i}", [[20 + i, 30 + i]], f"k-{i}")
            cluster.wait_decode(f"s-{i}")
            assert_pushed(cluster, [20 + i, 30 + i], [1 + i, 9 + i])
        assert sender.spin_rounds > 0 and receiver.spin_rounds > 0
        time.sleep(0.5)  # past the window with nothing to do: both writers sleep on their wake-ups
        before = (sender.spin_rounds, receiver.spin_rounds)
        time.sleep(0.3)
        assert (sender.spin_rounds, receiver.spin_rounds) == before
