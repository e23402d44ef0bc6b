"""Process identities: what D checks on its own host before it gives back blocks a producer's
kernel copy could still reach (a real child process, real /proc)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from kvpush.core.process_identity import has_exited, this_process

CHILD = (
    "import json, sys; from kvpush.core.process_identity import this_process; "
    "print(json.dumps(this_process()), flush=True); sys.stdin.read()"
)


def _child() -> tuple[subprocess.Popen[str], dict]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


def test_this_process_runs() -> None:
    assert has_exited(this_process()) is False


def test_a_child_runs_then_exits_and_a_zombie_counts_as_exited() -> None:
    child, identity = _child()
    try:
        assert identity["pid"] == child.pid and has_exited(identity) is False
        assert child.stdin is not None
        child.stdin.close()  # it exits; not reaped yet: a zombie, its files and GPU context closed
        for _ in range(200):
            if has_exited(identity):
                break
            time.sleep(0.01)
        assert has_exited(identity) is True
    finally:
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
    assert has_exited(identity) is True  # reaped: gone from /proc


def test_a_reused_pid_is_another_process() -> None:
    identity = {**this_process(), "start": this_process()["start"] - 1}
    assert has_exited(identity) is True


def test_what_cannot_be_seen_from_here_is_never_called_exited() -> None:
    me = this_process()
    assert has_exited({**me, "host": "elsewhere/boot"}) is None
    assert has_exited({**me, "pidns": "pid:[1]"}) is None
    assert has_exited({"pid": me["pid"]}) is None
    assert has_exited({**me, "pid": "not a pid"}) is None


def test_another_hostname_on_this_kernel_is_this_host() -> None:
    """Containers on one kernel have their own hostnames (UTS namespaces) and share the boot id;
    UCX still copies between two such processes through shared memory or CMA (measured here:
    a P in its own UTS namespace, hostname 'p-container', WRITEs into D with
    ``UCX_TLS=shm,self``, and the bytes land), so a P whose identity names another hostname
    with this boot id may copy in by itself and is held, not fenced; and /proc answers for it
    when its PID namespace is this one. Before, the hostname decided: such a P was taken for a
    remote one, fenced, and its blocks released under a copy no fence stops."""
    from kvpush.core.process_identity import host_identity, may_be_this_host, same_kernel

    boot = host_identity().rpartition("/")[2]
    other_name = f"p-container/{boot}"
    assert same_kernel(other_name) is True and may_be_this_host(other_name)
    assert not may_be_this_host("p-container/00000000-0000-0000-0000-000000000000")
    assert same_kernel("p-container/?") is None and not may_be_this_host("p-container/?")
    mine = {**this_process(), "host": other_name}
    assert has_exited(mine) is False, "this process, named with another hostname, runs"
