"""The process's record of worker incarnations that ended in it (``kvpush.core.ended_workers``):
what a worker created later publishes so D settles what it held for them (a lost ``BYE``)."""

from __future__ import annotations

from kvpush.core import ended_workers


def test_ended_incarnations_are_kept_per_agent_name_newest_last_and_bounded() -> None:
    name = "probe-ended-prefill-pp0-tp0"
    for n in range(ended_workers.MAX_PER_AGENT + 3):
        ended_workers.record(name, f"inc-{n:03d}", unsettled=n == 5)
    ended = ended_workers.ended_here(name)
    assert len(ended) == ended_workers.MAX_PER_AGENT
    assert list(ended)[-1] == f"inc-{ended_workers.MAX_PER_AGENT + 2:03d}"  # the newest kept
    assert "inc-000" not in ended and ended["inc-005"] is True
    assert ended_workers.ended_here("another-agent") == {}
