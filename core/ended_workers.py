"""Worker incarnations that ended in this process with nothing in flight.

A closing P worker tells every D rank it loaded that its incarnation ended (``BYE``), once none
of its WRITEs is in flight. That message can be lost (the worker's agent goes away right after
it), and where P's copies are kernels no fence stops, D then holds what it held for that
incarnation until its process exits, which never happens when a new worker is created in the
same process. So the process remembers: a worker created later under the same agent name
publishes the incarnations of that name that ended here (``ENDED_KEY`` in its handshake
metadata), and D settles them as their ``BYE`` would, having checked that the process stating
it is the one the request registered with (docs/reliability.md, "Goodbye").
"""

from __future__ import annotations

import threading
from collections import OrderedDict

ENDED_KEY = "ended_incarnations"
"""Metadata extension: ``{incarnation: unsettled}`` of earlier workers of this agent name that
ended in this process with nothing in flight (``unsettled``: a WRITE of it ended without
completing, so D fences before it releases)."""
MAX_PER_AGENT = 16
"""Ended incarnations remembered per agent name (the newest)."""

_lock = threading.Lock()
_ended: dict[str, OrderedDict[str, bool]] = {}


def record(agent_name: str, incarnation: str, unsettled: bool) -> None:
    """Worker ``incarnation`` of ``agent_name`` ended here with nothing in flight."""
    with _lock:
        ended = _ended.setdefault(agent_name, OrderedDict())
        ended[incarnation] = unsettled
        ended.move_to_end(incarnation)
        while len(ended) > MAX_PER_AGENT:
            ended.popitem(last=False)


def ended_here(agent_name: str) -> dict[str, bool]:
    """The incarnations of ``agent_name`` that ended in this process (oldest first)."""
    with _lock:
        return dict(_ended.get(agent_name, {}))
