"""Probes: safety facts that may rest on clocks, process ids or names (incarnation order, the
process identity D checks before it releases a held request's blocks)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvpush.core.process_identity import has_exited


def _hello(incarnation: str) -> Any:
    from test_handshake_refusal import _hello as hello

    return hello(incarnation)


def _push_reg(**overrides: Any) -> Any:
    from test_handshake_refusal import _note
    from test_probe_reconfig_restart import wire_push_reg

    return _note(wire_push_reg(**overrides))


# ---------------------------------------------------------------------------------------------
# (1) A D start on a clock behind, loaded from D's side channel, while a late message of the
#     dead start (whose clock was ahead, so it sorts after) is still on its way
# ---------------------------------------------------------------------------------------------


def test_late_messages_of_a_dead_start_sorting_after_the_live_one_do_not_fail_the_live_one() -> None:
    """D start "d5" says HELLO and dies (or, on a host that lost the address, goes on sending);
    D comes back as "d1" on a host whose clock is behind (it sorts before "d5"). P's handshake,
    asked by d5's HELLO, loads what D's side channel serves: "d1", and serves its registration.
    Then d5's HELLOs sent before it died arrive late. Each names a start P never loaded that
    sorts after the loaded one, so P takes each for a restart: it fails the live start's
    request, drops the rank and loads d1 again from the side channel; the next late message
    does it again. (The reverse order, a late HELLO of an earlier-sorting start, costs one
    reload at most: test_core_a_late_hello_of_a_start_p_never_loaded_costs_one_reload_at_most.)
    Fixed: P takes a message of a start it has not loaded for a restart only once D's side
    channel says that start runs (asked off the writer thread); a start whose message asked
    for a handshake that loaded another, or that the side channel did not name, has its
    messages dropped for a doubling backoff, and is asked about again after it."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import Connect, DropPeer, Post, Report

    core = _prefill()
    assert any(isinstance(a, Connect) for a in core.notification(D_AGENT, _hello("d5"), 100.0))
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)  # the side channel serves the live start
    core.notification(D_AGENT, _hello("d1"), 100.2)  # the live start handshakes
    core.finished("x-2", "p-2", ((6,),), "", 100.3)
    reg = _push_reg(decode_incarnation="d1", request_id="d-2", match_key="x-2", grant=100.25)
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, reg, 100.4))
    failed: list[Any] = []
    for at in (100.5, 100.7):  # two late messages of the dead start
        late = core.notification(D_AGENT, _hello("d5"), at)
        failed += [a for a in late if isinstance(a, Report | DropPeer)]
        if any(isinstance(a, Connect) for a in late):
            core.connected("D", 0, D_AGENT, "d1", 1, "", at + 0.05)  # still the live start
    assert not failed, failed


def test_a_start_the_side_channel_does_not_serve_is_asked_about_at_most_once_per_backoff() -> None:
    """A message of a start P has not loaded, sorting after the live one, makes P ask D's side
    channel (``AskStart``) instead of failing the live start's requests. While the question is
    out, further messages wait (no second question); the answer naming the live start drops
    them, and the late start's messages are dropped unasked for a backoff that doubles. A
    start the side channel does name is a restart: the live start's requests fail then."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import AskStart, Connect, DropPeer, Post, Report

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    core.finished("x-2", "p-2", ((6,),), "", 100.2)
    reg = _push_reg(decode_incarnation="d1", request_id="d-2", match_key="x-2", grant=100.15)
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, reg, 100.3))

    def asks(actions: list[Any]) -> list[Any]:
        assert not [a for a in actions if isinstance(a, Report | DropPeer | Connect)], actions
        return [a for a in actions if isinstance(a, AskStart)]

    assert len(asks(core.notification(D_AGENT, _hello("d5"), 100.4))) == 1  # a late one: asked
    assert not asks(core.notification(D_AGENT, _hello("d5"), 100.45))  # the question is out
    assert not asks(core.start_served("D", 0, "d1", "", 100.5))  # d1 runs: both dropped
    assert not asks(core.notification(D_AGENT, _hello("d5"), 101.0))  # within the backoff (1 s)
    assert len(asks(core.notification(D_AGENT, _hello("d5"), 101.6))) == 1  # asked again after it
    assert not asks(core.start_served("D", 0, "d1", "", 101.7))
    assert not asks(core.notification(D_AGENT, _hello("d5"), 103.0))  # the backoff doubled (2 s)
    assert core.stats["starts_asked"] == 2
    # d7 did restart: the side channel names it, and the live start's request fails then.
    assert len(asks(core.notification(D_AGENT, _hello("d7"), 104.0))) == 1
    restarted = core.start_served("D", 0, "d7", "", 104.1)
    assert [a.outcome for a in restarted if isinstance(a, Report)] == ["failed"], restarted


# ---------------------------------------------------------------------------------------------
# (3) "Has the producer process exited": a process in another time namespace
# ---------------------------------------------------------------------------------------------

_CHILD = (
    "import json, sys, time\n"
    "from kvpush.core.process_identity import this_process\n"
    "print(json.dumps(this_process()), flush=True)\n"
    "time.sleep(30)\n"
)


def _timens_ok() -> bool:
    try:
        return subprocess.run(["unshare", "--time", "--boottime", "1", "true"], timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _timens_ok(), reason="cannot create a time namespace here (unshare --time)")
def test_a_live_process_in_another_time_namespace_is_never_called_exited() -> None:
    """P publishes its start time as it reads it; a time namespace (CLONE_NEWTIME: CRIU restores
    a checkpointed process into one so that its monotonic and boot clocks go on where they
    were) shifts the boot clock, and /proc shows every process's start time shifted by the
    reader's offset. Same kernel, same PID namespace: D's check trusts the start time."""
    with subprocess.Popen(
        ["unshare", "--time", "--boottime", "1000", sys.executable, "-c", _CHILD],
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            identity = json.loads(child.stdout.readline())
            # The python the unshare command started (its pid) runs: never "exited".
            assert has_exited(identity) in (False, None), identity
            assert child.poll() is None
        finally:
            child.kill()
            child.wait(timeout=10)


def _pidns_ok() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _pidns_ok(), reason="cannot create a PID namespace here (unshare --pid)")
def test_a_live_process_is_never_called_exited_where_proc_shows_another_pid_namespace() -> None:
    """A process in a fresh PID namespace is pid 1 there, but a /proc not mounted afresh still
    shows the parent namespace's pids: /proc/1 is that namespace's init. has_exited compares
    the namespaces of the two processes (equal: both in the new one) but not the one /proc
    shows, reads another process's start time and answers "exited" for a process that runs
    (checked on itself, so it surely runs)."""
    code = (
        "from kvpush.core.process_identity import has_exited, this_process\n"
        "print(has_exited(this_process()))\n"
    )
    run = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() in ("False", "None"), run.stdout


# ---------------------------------------------------------------------------------------------
# (4) With the shared secret: a recorded DONE replayed within the same incarnations
# ---------------------------------------------------------------------------------------------


def _decode_registered(rid: str, key: str, at: float, core: Any = None, *, echoes: bool = True) -> Any:
    """D core (start "d1") with ``rid`` registered with P start "p1" (``echoes``: P states that
    its results echo the registration attempt, as every P of this release does)."""
    import attrs
    from test_handshake_refusal import P0, P_AGENT, _decode, _info, _request

    from kvpush.core import notifications as wire

    if core is None:
        core = _decode()
        core.add(_request(rid, key), at)
        info = _info()
        if echoes:
            info = attrs.evolve(info, echo_attempts=frozenset({P_AGENT}))
        core.connected("P", info, "", at + 0.01)
        out: list[Any] = []
    else:
        out = core.add(_request(rid, key), at)
    out += core.notification(P_AGENT, _decoded(wire.encode_heartbeat_answer(P0, at + 0.02, "p1")), at + 0.02)
    return core, out


def _attempt(actions: list[Any]) -> int:
    """The registration attempt D's PUSH_REG among ``actions`` states (P echoes it)."""
    from kvpush.core.actions import Send
    from kvpush.core.types import NotificationKind

    regs = [
        n
        for n in (_decoded(a.message) for a in actions if isinstance(a, Send))
        if n.kind is NotificationKind.PUSH_REG
    ]
    assert len(regs) == 1 and regs[0].registration.attempt is not None, actions
    return regs[0].registration.attempt


def _decoded(message: bytes) -> Any:
    from kvpush.core import notifications as wire

    note = wire.decode_notification(message)
    assert note is not None
    return note


def test_a_replayed_done_of_an_earlier_request_of_the_id_does_not_complete_the_new_one() -> None:
    """With the shared secret on, a DONE's MAC was the same bytes for every request of one id
    between the same two starts. r (key x-1) is pushed and done; much later the engine adds an
    id r again (the receiver aliases a reused id only while it remembers it: ID_MEMORY ids),
    for another prompt (key x-2), registered with the same P start. Someone on the path replays
    the recorded DONE of the first r: D reported the new r done before P wrote a byte of it.
    Fixed (notification format 2.7): each registration attempt has its own id, which P echoes
    in its DONE (under the MAC); the replayed DONE names the earlier attempt and is refused."""
    from test_handshake_refusal import P0, P_AGENT

    from kvpush.core import notifications as wire
    from kvpush.core.actions import Report

    core, out = _decode_registered("r", "x-1", 0.0)
    recorded = wire.encode_done("r", P0, 1, incarnation="p1", attempt=_attempt(out))
    out = core.notification(P_AGENT, _decoded(recorded), 0.1)
    assert [(a.request_id, a.outcome) for a in out if isinstance(a, Report)] == [("r", "done")]
    core, out = _decode_registered("r", "x-2", 1.0, core)  # the id again, another prompt
    replayed = core.notification(P_AGENT, _decoded(recorded), 1.1)
    assert not [a for a in replayed if isinstance(a, Report) and a.outcome == "done"], replayed
    assert core.stats["rejected_notifications"] == 1
    done = wire.encode_done("r", P0, 1, incarnation="p1", attempt=_attempt(out))  # P's own DONE
    out = core.notification(P_AGENT, _decoded(done), 1.2)
    assert [(a.request_id, a.outcome) for a in out if isinstance(a, Report)] == [("r", "done")]


def test_a_result_naming_no_attempt_counts_only_from_a_p_that_does_not_echo_attempts() -> None:
    """A P of this release states ``result_attempts`` and echoes the attempt in every result: a
    DONE of it naming none (stripped, or forged) is refused. A P of an earlier release states
    nothing and names none: its DONE counts as before (compatibility one minor apart)."""
    from test_handshake_refusal import P0, P_AGENT

    from kvpush.core import notifications as wire
    from kvpush.core.actions import Report

    bare = wire.encode_done("r", P0, 1, incarnation="p1")
    core, _ = _decode_registered("r", "x-1", 0.0)
    assert not [a for a in core.notification(P_AGENT, _decoded(bare), 0.1) if isinstance(a, Report)]
    core, _ = _decode_registered("r", "x-1", 0.0, echoes=False)
    out = core.notification(P_AGENT, _decoded(bare), 0.1)
    assert [(a.request_id, a.outcome) for a in out if isinstance(a, Report)] == [("r", "done")]


# ---------------------------------------------------------------------------------------------
# (1) on D's side: a P start D saw exit, whose clock was ahead of the live start's
# ---------------------------------------------------------------------------------------------


def _info(incarnation: str) -> Any:
    from test_handshake_refusal import P0, P_AGENT

    from kvpush.core.decode_core import ProducerInfo

    return ProducerInfo(
        prefill_pp=1,
        prefill_tp=1,
        agents={P0: P_AGENT},
        incarnations={P_AGENT: incarnation},
        write_deadline_s=1.0,
    )


def test_a_late_answer_of_a_p_start_d_saw_exit_does_not_fail_the_live_start() -> None:
    """P start "p5" serves r1 and exits; D sees its process gone (ProbeExit), fences, and
    handshakes afresh: P's side channel names "p1" (P came back on a clock behind), and r1 is
    registered again with it. A heartbeat answer p5 sent before it died (asking a fresh grant
    for x-1) arrives late: D's core compares incarnations by sort order only ("p5" > "p1": a
    restart) and fails r1, although it marked p5 closed itself (P's core keeps the starts it
    replaced for exactly this and drops their messages as stale)."""
    from test_handshake_refusal import P0, P_AGENT, _decode, _request

    from kvpush.core import notifications as wire
    from kvpush.core.actions import Report
    from kvpush.core.decode_core import ENGINE_PROBE

    d = _decode()
    d.add(_request("r1", "x-1"), 0.0)
    d.connected("P", _info("p5"), "", 0.01)
    d.notification(P_AGENT, _decoded(wire.encode_heartbeat_answer(P0, 0.02, "p5")), 0.02)
    out = d.producers_exited(ENGINE_PROBE + "P", [P_AGENT], 0.5)  # p5's process is gone
    out += d.fenced(1, 0.6)
    out += d.connected("P", _info("p1"), "", 0.7)  # the side channel serves the live start
    out += d.notification(P_AGENT, _decoded(wire.encode_heartbeat_answer(P0, 0.71, "p1")), 0.71)
    assert not [a for a in out if isinstance(a, Report)], out
    late = wire.encode_heartbeat_answer(P0, 0.3, "p5", want=["x-1"])  # sent before p5 died
    out = d.notification(P_AGENT, _decoded(late), 0.8)
    assert not [a for a in out if isinstance(a, Report)], out


def test_a_replayed_cancel_ack_of_an_earlier_request_of_the_id_does_not_release_the_new_one() -> None:
    """As the DONE above: r (key x-1) is cancelled and P acknowledges (nothing in flight). The
    id comes back after the receiver forgot it, for key x-2, and is cancelled while P may be
    writing it; the recorded ack, replayed, settled P's rank and D released the blocks. Fixed
    (2.7): the ack echoes the attempt D's CANCEL named, and the replayed one names the first."""
    from test_handshake_refusal import P0, P_AGENT

    from kvpush.core import notifications as wire
    from kvpush.core.actions import Release, Send
    from kvpush.core.types import NotificationKind

    core, out = _decode_registered("r", "x-1", 0.0)
    cancels = [_decoded(a.message) for a in core.cancel("r", 0.1) if isinstance(a, Send)]
    assert [n.registration.attempt for n in cancels if n.kind is NotificationKind.CANCEL] == [_attempt(out)]
    recorded = wire.encode_cancel_ack(
        "r", P0, False, unsettled=False, incarnation="p1", attempt=_attempt(out)
    )
    assert any(isinstance(a, Release) for a in core.notification(P_AGENT, _decoded(recorded), 0.15))
    core, _ = _decode_registered("r", "x-2", 1.0, core)  # the id again, P may be writing it
    core.cancel("r", 1.1)
    replayed = core.notification(P_AGENT, _decoded(recorded), 1.15)
    assert not [a for a in replayed if isinstance(a, Release)], replayed


# ---------------------------------------------------------------------------------------------
# (5) Clocks across processes: a grant is P's own clock reading, and only this process's counts
# ---------------------------------------------------------------------------------------------


def test_a_grant_issued_by_an_earlier_p_process_on_the_shared_boot_clock_is_not_written() -> None:
    """Every process on a host reads one boot clock (lease_clock), so a grant P's previous
    process issued a moment before it died is an earlier reading of the new process's clock,
    within the freshness window. The new process loaded D's rank after it started: a grant
    older than that load was not issued to it, and P asks D for a fresh one instead of writing."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import Post, Send

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    core.finished("x-1", "p-1", ((5,),), "", 100.2)
    old_grant = 99.5  # a stamp of P's previous process, on the same boot clock
    reg = _push_reg(decode_incarnation="d1", request_id="d-1", match_key="x-1", grant=old_grant)
    assert any(isinstance(a, Post) for a in core.notification(D_AGENT, reg, 100.3))  # planned
    assert not core.confirm_post("x-1", 0, 100.31)  # the driver's check right before the post
    asks = [a for a in core.refresh("x-1", 0, 100.32) if isinstance(a, Send) and _decoded(a.message).want]
    assert asks


def test_messages_held_while_the_side_channel_is_asked_are_bounded() -> None:
    """A start that keeps sending while P asks D's side channel about it: one question, at most
    ``MAX_DEFERRED`` messages held (the oldest kept, the rest dropped and counted, as lost
    messages D resends), all dropped when the answer names the live start."""
    from test_handshake_refusal import D_AGENT, _prefill

    from kvpush.core.actions import AskStart
    from kvpush.core.prefill_core import MAX_DEFERRED

    core = _prefill()
    core.notification(D_AGENT, _hello("d1"), 100.0)
    core.connected("D", 0, D_AGENT, "d1", 1, "", 100.1)
    rejected = core.stats["rejected_notifications"]
    out: list[Any] = []
    for i in range(MAX_DEFERRED + 20):
        out += core.notification(D_AGENT, _hello("d9"), 100.2 + i * 1e-4)
    assert len([a for a in out if isinstance(a, AskStart)]) == 1
    assert core.stats["rejected_notifications"] - rejected == 20
    assert not core.start_served("D", 0, "d1", "", 100.5)
    assert core.stats["rejected_notifications"] - rejected == 20 + MAX_DEFERRED
