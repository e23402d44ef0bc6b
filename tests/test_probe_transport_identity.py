"""Transport probe of :func:`kvpush.core.process_identity.has_exited`: D releases blocks held
for a same-host P's kernel copies once this says P's process exited, so an identity that names
no process P could be must answer "cannot tell" (None: keep holding), never "exited".

Before: the wire lets a pid up to 2**31 through, and ``has_exited`` read a pid above the
kernel's ``pid_max`` (a process that cannot exist, so its /proc entry is missing) as exited;
``int()`` also turned a bool or float pid or start time into some other process's. A live P
publishing such an identity (a bug, or a metadata mix-up) got its held requests released while
its copies could still run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvpush.core.process_identity import has_exited, this_process

PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())


def _me(**fields: Any) -> dict[str, Any]:
    identity = this_process()
    identity.update(fields)
    return identity


def test_this_process_runs_and_a_later_start_of_its_pid_has_exited() -> None:
    assert has_exited(_me()) is False
    assert has_exited(_me(start=_me()["start"] + 1)) is True  # the pid now holds another process


@pytest.mark.parametrize(
    "fields",
    [
        {"pid": PID_MAX + 1},  # no process can have it
        {"pid": 1 << 31},
        {"pid": 0},
        {"pid": -5},
        {"pid": True},
        {"pid": float(os.getpid())},
        {"pid": str(os.getpid())},
        {"start": True},
        {"start": 1.5},
    ],
    ids=repr,
)
def test_an_identity_naming_no_possible_process_is_cannot_tell_not_exited(fields: dict[str, Any]) -> None:
    assert has_exited(_me(**fields)) is None
