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
