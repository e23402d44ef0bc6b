"""How the demo, the soak and the tests start rank processes.

A spawned rank imports torch, nixl and kvpush anew: ~1.6 s of CPU each, ~4 s for four ranks on
a 2-core machine, paid again at every restart the soak makes and by every multi-process test.
So on Linux ranks start from a fork server with those modules imported once (the default,
``KVPUSH_START_METHOD=forkserver``): a few milliseconds a rank, each still single-threaded (the
server forks before any thread or UCX context exists) and with the environment of its parent
at the moment it was started, as a spawned one (:func:`start`); the suite takes about half the
time. ``KVPUSH_START_METHOD=spawn`` spawns each rank instead (the default where there is no fork
server). (It was off for a session: a P rank restarted from the fork server seemed to serve
nothing after its restart. That was D greeting the killed process, spawned ranks lost requests
to it too; tests/test_restart_during_handshake.py.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

PRELOAD = ["torch", "nixl._api", "kvpush.demo.rank"]
"""Imported once by the fork server (a module that fails to import is skipped)."""


def context() -> Any:
    """The multiprocessing context rank processes start from (see the module docstring)."""
    default = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    method = os.environ.get("KVPUSH_START_METHOD") or default
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"KVPUSH_START_METHOD must be 'forkserver' or 'spawn', got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    return ctx


def start(
    target: Callable[..., None], args: Callable[[Connection], tuple[Any, ...]], name: str
) -> tuple[Any, Connection]:
    """Start ``target(*args(conn))`` as a daemon process, ``conn`` the child's end of a pipe;
    return the process and the parent's end. ``target`` must be importable by name (a
    module-level function)."""
    ctx = context()
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=_with_environment, args=(dict(os.environ), target, args(child)), daemon=True, name=name
    )
    process.start()
    child.close()  # the child has its own copy: the parent's end reads EOF once it exits
    return process, parent


def _with_environment(environ: dict[str, str], target: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Run ``target`` with the parent's environment at its start (a forked child would otherwise
    keep the fork server's)."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
