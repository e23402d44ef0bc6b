"""The writer thread's timer slack (Linux): its 50-200 µs polls must not last 2x as long."""

from __future__ import annotations

import ctypes
import sys

import pytest
from cluster import Cluster

from kvpush.core.errors import ConfigError
from kvpush.core.worker import PR_GET_TIMERSLACK, WorkerConfig

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_TIMERSLACK is Linux's")


def _slack() -> int:
    return ctypes.CDLL(None).prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)


@linux_only
@pytest.mark.parametrize(("configured", "expected"), [(None, 1000), (250, 250), (0, None)])
def test_each_writer_thread_runs_with_the_configured_timer_slack(
    configured: int | None, expected: int | None
) -> None:
    extra = {} if configured is None else {"timer_slack_ns": configured}
    default = _slack()  # this (test) thread's: what a thread left alone has
    with Cluster(**extra) as cluster:
        for worker in [*cluster.senders.values(), *cluster.receivers.values()]:
            assert worker.call_on_writer(_slack) == (default if expected is None else expected)
    assert _slack() == default, "only the writer threads change"


@pytest.mark.parametrize("bad", [-1, 1.5, "1000", True])
def test_a_bad_timer_slack_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match="timer_slack_ns"):
        WorkerConfig(engine_id="e", parallel=None, model=None, timer_slack_ns=bad)  # type: ignore[arg-type]
