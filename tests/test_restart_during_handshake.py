"""A P rank killed while D handshakes with it, or before D's first handshake, and started again
under the same name: the requests waiting for the handshake are served by the new process.

Found by the soak with one P kill (no injected faults, seed 5): in 1 run of 8 every one of the
40 requests failed, also the 20 dispatched after the new process was published.

1. D's HELLO went to the process that was killed a moment later. Only a ready engine's silent
   agents were probed for an exited process, so D waited out the whole HELLO timeout and then
   failed the engine and every request waiting for it, as for a P that cannot reach D.
2. A handshake loaded the metadata P's side channel still served for the killed process (the
   new one was starting). Loading it fails (UCX cannot attach the dead process's shared memory:
   ``NIXL_ERR_BACKEND``), and D failed every waiting request "handshake with P failed", again
   and again while the rank restarted.

Both are a P rank restarting, which D already waits for when it sees it from a ready engine
(bounded by ``peer_silence_s``; each request by its own watchdog): the handshake's agents that
ran in an exited process are now seen the same way, before a HELLO times out and before
their metadata is loaded.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

import attrs
from rank_engines import Engines
from test_adversarial_keepalive import P0, P_AGENT, _answer, _decode, _meta, _reports, _sent
from test_adversarial_keepalive import _info as _keepalive_info

from kvpush.core.actions import Connect, DropPeer, ProbeExit
from kvpush.core.decode_core import ProducerInfo
from kvpush.core.errors import HandshakeError, PeerProcessExited
from kvpush.core.peers import refuse_exited
from kvpush.core.process_identity import PROCESS_KEY, this_process


@functools.cache
def _exited_identity() -> dict[str, Any]:
    """The identity of a process that has exited (it printed it and ended)."""
    code = "import json, kvpush.core.process_identity as p; print(json.dumps(p.this_process()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _info(incarnation: str, identity: dict[str, Any] | None = None) -> ProducerInfo:
    """The keepalive tests' one P rank, published with a process identity (this one's: alive)."""
    return attrs.evolve(
        _keepalive_info(incarnation),
        processes={P_AGENT: identity if identity is not None else this_process()},
    )


def test_d_probes_an_unanswered_hello_s_process_and_handshakes_afresh_when_it_exited() -> None:
    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0, heartbeat_interval_s=0.25, peer_silence_s=8.0)
    d.add(_meta("r1", "k1"), 0.0)
    assert [n.kind.value for n in _sent(d.connected("P", _info("p1", _exited_identity()), "", 0.0))] == [
        "hello"
    ]
    out = d.handle_timer(d.next_deadline())  # the HELLO resend: the unanswered agent is probed
    (probe,) = [a for a in out if isinstance(a, ProbeExit)]
    assert [agent for agent, _ in probe.processes] == [P_AGENT]
    t = d.next_deadline()
    out = d.producers_exited(probe.request_id, [P_AGENT], t)  # the driver saw it exited
    assert not _reports(out), _reports(out)  # r1 waits for the new process
    assert [a for a in out if isinstance(a, DropPeer)]
    assert d.stats["exited_producers"] == 1
    t += 1.0  # the backoff: the next handshake
    assert [a for a in d.handle_timer(t) if isinstance(a, Connect)]
    assert [n.kind.value for n in _sent(d.connected("P", _info("p2"), "", t))] == ["hello"]
    registered = d.notification(P_AGENT, _answer(t, "p2"), t)
    assert [n.kind.value for n in _sent(registered)] == ["push_reg"] and not _reports(registered)


def test_a_hello_that_could_not_be_sent_to_an_exited_process_waits_for_the_new_one() -> None:
    """The HELLO's send raised (``NIXL_ERR_REMOTE_DISCONNECT``: the process was killed as D
    greeted it). D failed the engine at once, and with it the 20 requests waiting for it; when
    the process it sent to has exited, the rank is restarting and they wait for the new one."""
    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0, heartbeat_interval_s=0.25, peer_silence_s=8.0)
    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", _info("p1", _exited_identity()), "", 0.0)
    out = d.unreachable(P_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 0.0)
    assert not _reports(out), _reports(out)
    (probe,) = [a for a in out if isinstance(a, ProbeExit)]
    out = d.producers_exited(probe.request_id, [P_AGENT], 0.0)  # the driver ran the probe
    out += d.handle_timer(0.0)
    assert not _reports(out), _reports(out)
    assert [a for a in d.handle_timer(1.0) if isinstance(a, Connect)]
    d.connected("P", _info("p2"), "", 1.0)
    registered = d.notification(P_AGENT, _answer(1.0, "p2"), 1.0)
    assert [n.kind.value for n in _sent(registered)] == ["push_reg"] and not _reports(registered)


def test_a_hello_that_could_not_be_sent_to_a_live_process_fails_the_engine_as_before() -> None:
    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0, heartbeat_interval_s=0.25)
    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", _info("p1"), "", 0.0)
    out = d.unreachable(P_AGENT, "NIXL_ERR_REMOTE_DISCONNECT", 0.0)
    assert [a for a in out if isinstance(a, ProbeExit)]  # alive: the driver calls nothing back
    (report,) = _reports(out + d.handle_timer(0.0))
    assert report.request_id == "r1" and "unreachable" in report.reason


def test_a_live_hello_peer_is_probed_but_nothing_changes() -> None:
    d = _decode(hello_timeout_s=5.0, heartbeat_interval_s=0.25)
    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", _info("p1"), "", 0.0)
    t = d.next_deadline()
    assert [a for a in d.handle_timer(t) if isinstance(a, ProbeExit)]
    registered = d.notification(P_AGENT, _answer(t, "p1"), t)  # a slow answer
    assert [n.kind.value for n in _sent(registered)] == ["push_reg"]


def test_a_handshake_that_found_the_published_process_exited_keeps_its_requests_waiting() -> None:
    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0, peer_silence_s=8.0)
    d.add(_meta("r1", "k1"), 0.0)
    out = d.connected("P", None, "P rank 0's process has exited", 0.0, exited=True)
    assert not _reports(out), _reports(out)
    for t in (1.0, 2.0):  # still the exited process: retried, nothing fails
        assert [a for a in d.handle_timer(t) if isinstance(a, Connect)]
        assert not _reports(d.connected("P", None, "exited", t, exited=True))
    assert [a for a in d.handle_timer(3.0) if isinstance(a, Connect)]
    d.connected("P", _info("p2"), "", 3.0)
    registered = d.notification(P_AGENT, _answer(3.0, "p2"), 3.0)
    assert [n.kind.value for n in _sent(registered)] == ["push_reg"] and not _reports(registered)
    assert d._engines["P"].failures == 0


def test_a_rank_that_never_comes_back_fails_its_waiting_requests_at_the_restart_bound() -> None:
    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0, peer_silence_s=8.0, request_timeout_s=60.0)
    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", None, "P rank 0's process has exited", 0.0, exited=True)
    t, reports = 0.0, []
    while not reports and t < 30.0:
        t = d.next_deadline()
        out = d.handle_timer(t)
        if [a for a in out if isinstance(a, Connect)]:
            out += d.connected("P", None, "P rank 0's process has exited", t, exited=True)
        reports = _reports(out)
    assert 8.0 <= t <= 9.5, t
    assert [r.request_id for r in reports] == ["r1"] and "exited" in reports[0].reason


def test_a_process_published_just_before_the_restart_bound_is_not_missed() -> None:
    """The restart-phase probe's finding 1: D's handshakes run ``retry_backoff_s`` apart while
    the side channel serves the exited process, and the restart bound (``peer_silence_s`` after
    the exit was seen) fell between two of them: a new process published just before it was
    never tried, and every waiting request failed. At the bound one more attempt is made now;
    only if it fails too do the requests fail."""
    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0, peer_silence_s=2.5, request_timeout_s=60.0)
    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", None, "exited", 0.0, exited=True)
    for t in (1.0, 2.0):
        assert [a for a in d.handle_timer(t) if isinstance(a, Connect)]
        assert not _reports(d.connected("P", None, "exited", t, exited=True))
    # The new process is published at 2.3 s; D's next attempt would be at 3 s.
    out = d.handle_timer(2.5)  # the restart bound: the last attempt, made now
    assert not _reports(out) and [a for a in out if isinstance(a, Connect)]
    d.connected("P", _info("p2"), "", 2.5)
    registered = d.notification(P_AGENT, _answer(2.5, "p2"), 2.5)
    assert [n.kind.value for n in _sent(registered)] == ["push_reg"] and not _reports(registered)


def test_the_last_attempt_at_the_restart_bound_failing_fails_the_waiting_requests() -> None:
    d = _decode(hello_timeout_s=5.0, retry_backoff_s=1.0, peer_silence_s=2.5, request_timeout_s=60.0)
    d.add(_meta("r1", "k1"), 0.0)
    d.connected("P", None, "exited", 0.0, exited=True)
    for t in (1.0, 2.0):
        d.handle_timer(t)
        d.connected("P", None, "exited", t, exited=True)
    assert [a for a in d.handle_timer(2.5) if isinstance(a, Connect)]
    (report,) = _reports(d.connected("P", None, "exited", 2.5, exited=True))
    assert report.request_id == "r1" and "exited" in report.reason and "within 2.5s" in report.reason


def test_refuse_exited_names_the_rank_and_its_process() -> None:
    class Meta:
        agent_name, rank, engine_id = "P-prefill-pp0-tp0", P0, "P"
        extensions = {PROCESS_KEY: _exited_identity()}

    try:
        refuse_exited(Meta())  # type: ignore[arg-type]
    except PeerProcessExited as err:
        assert isinstance(err, HandshakeError)
        assert (
            "P-prefill-pp0-tp0" in str(err)
            and "exited" in str(err)
            and str(Meta.extensions[PROCESS_KEY]["pid"]) in str(err)
        )
    else:
        raise AssertionError("an exited process's metadata was not refused")
    Meta.extensions = {PROCESS_KEY: this_process()}
    refuse_exited(Meta())  # type: ignore[arg-type]  # alive: nothing raised
    Meta.extensions = {}
    refuse_exited(Meta())  # type: ignore[arg-type]  # no identity: cannot tell, nothing raised


def test_rank_processes_a_request_added_while_p_s_side_channel_serves_the_killed_rank() -> None:
    """Over real NIXL between rank processes: P's rank is killed before D's first handshake;
    D's request arrives while P's side channel still serves the killed process, which D must
    not load (it failed ``NIXL_ERR_BACKEND`` and failed the request); the new process is
    published seconds later, finishes the prefill, and the request lands byte for byte."""
    with Engines(
        heartbeat_interval_s=0.25, peer_silence_s=30.0, request_timeout_s=30.0, lease_s=30.0
    ) as engines:
        engines.plan("r1", [1, 2], [1, 2])
        engines.kill(engines.p_ranks[0])
        engines.add("r1")
        engines.wait(
            "D to find the published P process exited",
            lambda: engines.health(engines.d_ranks)[0]["stats"]["exited_producers"] >= 1,
            20,
        )
        engines.restart_prefill(0)
        engines.finish("r1")
        engines.wait_decode(["r1"], timeout_s=30)
        ((kind, result),) = engines.decode_outcome("r1").values()
        assert kind == "done" and result["ok"], (kind, result)


def test_a_load_that_failed_because_the_process_exited_after_the_fetch_is_a_restart() -> None:
    """The fetch saw the process alive; it was killed before the writer thread loaded it (the
    soak with a side-channel secret, whose fetch takes longer, hit this window every run): the
    failed load is reported as the process's exit, not as P failing."""
    from kvpush.core.errors import TransferError
    from kvpush.core.peers import PeerRegistry

    class DeadPeerTransport:
        removed: list[str] = []

        def load_peer(self, blob: bytes) -> str:
            raise TransferError("NIXL could not load a peer agent: NIXL_ERR_BACKEND")

        def remove_peer(self, agent: str) -> None:
            self.removed.append(agent)

    class Meta:
        agent_name, rank, engine_id, agent_blob = "P-prefill-pp0-tp0", P0, "P", b""
        extensions = {PROCESS_KEY: _exited_identity()}

    registry = object.__new__(PeerRegistry)
    registry._transport = DeadPeerTransport()  # type: ignore[assignment]
    registry.engines, registry._incarnations = {}, {}
    try:
        registry._load_agent(Meta())  # type: ignore[arg-type]
    except PeerProcessExited as err:
        assert "has exited" in str(err)
    else:
        raise AssertionError("a load failed by an exited process was not reported as its exit")
    Meta.extensions = {PROCESS_KEY: this_process()}  # alive: the load's own error stands
    try:
        registry._load_agent(Meta())  # type: ignore[arg-type]
    except PeerProcessExited:
        raise AssertionError("a live process's failed load was called an exit") from None
    except TransferError:
        pass
