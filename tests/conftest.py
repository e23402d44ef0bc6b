"""Suite-wide settings: hypothesis without per-example deadlines (the 2-core CI box is shared by
real NIXL processes; a slow example is not a failure), derandomized so CI is reproducible.

The ``diagnosis`` fixture: text a failing test leaves for the very end of the run's output
(CI keeps only its tail)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvpush",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvpush")

_DIAGNOSES: list[tuple[str, str]] = []


@pytest.fixture
def diagnosis(request: pytest.FixtureRequest) -> Iterator[Callable[[str], None]]:
    """Call it with what explains a failure; printed after the run's summary."""
    yield lambda text: _DIAGNOSES.append((request.node.nodeid, text))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for nodeid, text in _DIAGNOSES:
        terminalreporter.section(f"diagnosis: {nodeid}", sep="-")
        terminalreporter.write_line(text)
