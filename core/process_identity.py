"""Who a process is, and whether it has exited: a fact another process on the same host can check.

A kernel copy (``cuda_ipc``) runs in P's process; no fence and no deadline stops it once
launched, only its own end or the end of the process (exiting closes the process's files and
memory maps, and with them its CUDA context, before the kernel marks it a zombie). D holds a
failed request's blocks while such a copy may still run and gives them back once it sees that
the process that could launch it has exited. P publishes :func:`this_process` in its metadata;
D checks it with :func:`has_exited`, which answers only what ``/proc`` shows: a process on
another host or in another PID namespace is "cannot tell" (``None``), never "exited".
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

PROC = "/proc"
PROCESS_KEY = "process"
"""Metadata extension with the rank's process identity (:func:`this_process`): a peer on the
same host can tell when the process that could launch a copy, or that published the metadata
it is about to load, has exited."""


def host_identity() -> str:
    """``hostname/boot id``. The boot id names the running kernel: every process on it shares
    it, whatever its hostname (a container has its own UTS namespace, hence hostname, and
    UCX still moves bytes between two such processes through shared memory or CMA)."""
    try:
        with open(f"{PROC}/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def same_kernel(host: Any) -> bool | None:
    """Whether a published :func:`host_identity` names the kernel this process runs on, by boot
    id alone (hostnames differ between containers on one kernel); None when either side could
    not read its boot id, or ``host`` is not an identity."""
    if not isinstance(host, str) or "/" not in host:
        return None
    boot = host.rpartition("/")[2]
    here_boot = host_identity().rpartition("/")[2]
    if "?" in (boot, here_boot) or not boot:
        return None
    return boot == here_boot


def may_be_this_host(host: Any) -> bool:
    """Whether a published :func:`host_identity` may name the host this process runs on (a
    process there may copy into this one's memory by itself): the same kernel, or, where either
    side could not read its boot id, the same hostname (unknown is never "another host")."""
    kernel = same_kernel(host)
    if kernel is not None:
        return kernel
    if not isinstance(host, str):
        return False
    return host.rpartition("/")[0] == host_identity().rpartition("/")[0]


def _pid_namespace() -> str:
    return _namespace("pid")


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"{PROC}/self/ns/{kind}")
    except OSError:
        return "?"


def _proc_is_own() -> bool:
    """Whether ``/proc`` shows this process's PID namespace (a namespace made without mounting
    /proc afresh keeps the parent's, where a pid names another process)."""
    try:
        return os.readlink(f"{PROC}/self") == str(os.getpid())
    except OSError:
        return False


def _stat(pid: int | str) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` of a process or thread, None if it has
    no ``/proc`` entry; raises ``OSError`` when the entry is there but cannot be read (``/proc``
    mounted ``hidepid=1``, another user's process: it runs)."""
    try:
        with open(f"{PROC}/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return fields[0], int(fields[19])  # field 22: starttime


def _pid_max() -> int:
    """The largest pid this kernel hands out (Linux's own limit when it cannot be read)."""
    try:
        with open(f"{PROC}/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22


def this_process() -> dict[str, Any]:
    """This process's identity: host, PID namespace, pid and start time (pids are reused), and
    the time namespace the start time was read in (``/proc`` shifts it by the reader's)."""
    try:
        stat = _stat("self")
    except OSError:
        stat = None
    return {
        "host": host_identity(),
        "pidns": _pid_namespace(),
        "pid": os.getpid(),
        "start": stat[1] if stat else -1,
        "timens": _namespace("time"),
    }


def has_exited(identity: Mapping[str, Any]) -> bool | None:
    """Whether the process ``identity`` names has exited: True (its /proc entry is gone, holds
    another process, or every thread of it is a zombie), False (it runs), None (cannot tell
    from here: another host or PID namespace, or an identity missing a field)."""
    try:
        host, pidns = identity["host"], identity["pidns"]
        pid, start = identity["pid"], identity["start"]
    except (KeyError, TypeError):
        return None
    # Plain ints only (int() made a bool or float some other process's pid), and a pid a
    # process can have: one past pid_max has no /proc entry and read as "exited".
    if type(pid) is not int or type(start) is not int or not 0 < pid <= _pid_max():
        return None
    # /proc answers for a pid only on the same kernel (boot id) and in the same PID namespace
    # (namespace inode numbers repeat between kernels: the initial one is the same everywhere).
    if same_kernel(host) is not True or pidns != _pid_namespace() or pidns == "?" or start < 0:
        return None
    # /proc shows a start time shifted by the reader's time namespace (its boot clock offset):
    # read in another one (a CRIU restore, a container given one), a live process's start time
    # differs from the one it published and read as "the pid holds a later process".
    timens = identity.get("timens")
    if timens is not None and timens != _namespace("time"):
        return None
    if not _proc_is_own():
        return None  # /proc shows another PID namespace's pids: this pid is someone else there
    try:
        stat = _stat(pid)
    except OSError:
        return None  # an entry this process may not read (hidepid=1): it exists
    if stat is None:
        # No entry: gone, or hidden from this user (hidepid=2). Only the kernel tells them apart.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return None  # EPERM: a process has that pid (maybe a later one): cannot tell
        return None
    if stat[1] != start:
        return True  # the pid now belongs to a later process
    if stat[0] not in ("Z", "X"):
        return False
    # A zombie leader may still have live threads (it called pthread_exit): check them all.
    try:
        threads = os.listdir(f"{PROC}/{pid}/task")
        return all((s := _stat(f"{pid}/task/{t}")) is None or s[0] in ("Z", "X") for t in threads)
    except FileNotFoundError:
        return True  # reaped meanwhile
    except OSError:
        return None
