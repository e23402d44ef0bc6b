"""Transport probe across two network namespaces (real NIXL, UCX over TCP on a veth pair): a
WRITE P posted while a silent partition kept its *first* connection to D from being set up.

P loads D and posts a WRITE during the partition: UCX's connect() waits for an answer to its
SYN, which the kernel retransmits (1, 3, 7, 15 s ...). P gives up as its core does at the WRITE
deadline (releases the handle, drops D's agent); D fences P (there is no connection to shut)
and the fence is confirmed. Then the partition heals. If P's kernel still completes that
connection and P's UCX still sends the queued WRITE, its bytes land in blocks D released.

Found (fixed since, see below): the whole 16 MiB WRITE landed after the fence was confirmed, with
``ucx_error_handling_mode`` ``none`` (every run) and ``peer`` (most runs). The bytes come on a
connection P opened after the partition healed; releasing the NIXL handle does not cancel
UCX's queued PUT, and removing the agent closes the endpoint in flush mode, which delivers it.
Shutting down P's own sockets to D at the abort (tried) does not help: the socket does not exist
yet then. What would: a P that cannot prove such a WRITE gone must not tell D it may fence
(treat it like a kernel copy: ``abortable`` False, D holds until P answers or exits), or P must
destroy its UCX worker (a new agent and metadata) when it aborts a WRITE whose endpoint never
connected. Both are protocol decisions (prefill/decode cores), not the transport's alone. What
was done: P's core posts to a D rank only with a grant issued since it loaded that rank's agent
(a stamp that crossed this very connection), so the protocol never posts the WRITE this test
posts by hand (``tests/test_probe_grant_after_load.py``); this test keeps the transport's own
behaviour on record. A fence that refuses the peer at D's UCX listeners (``tcp_fence.refuse``,
not yet called by ``NixlTransport``) drops the connection request of the connection P opens
after the partition heals: with it wired in, both cases passed (one run each, 20:50 UTC
2026-12-01; then 8 of 8 runs each on 2026-12-02, so the xfail marks are gone). Still open, in
docs/reliability.md's residual risks: D's reload of P lifts the refusal, and a WRITE P's UCX
still holds could then go out on the new connection.

Everything made here (two namespaces, the veth pair, iptables rules inside them, two
processes) is removed at the end; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from typing import Any

import pytest
from _nixl_agent_proc import Agent as _Proc

torch = pytest.importorskip("torch")
pytest.importorskip("nixl._api")

BLOCKS = 16
FILL = 0xAB
WAIT_S = 30.0


def _unavailable() -> str | None:
    from kvpush.demo import netns

    reason = netns.unavailable_reason()
    if reason:
        return reason
    if subprocess.run(["which", "iptables"], capture_output=True).returncode != 0:
        return "iptables is missing"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


def Agent(ns: str, name: str, fill: int, err_mode: str = "none", env: dict[str, str] | None = None) -> Any:
    """An agent in namespace ``ns`` with one buffer of ``fill`` bytes, UCX over TCP on the link."""
    from kvpush.demo import netns

    options = {"ucx_tls": "tcp", "ucx_net_devices": netns.LINK, "ucx_error_handling_mode": err_mode}
    return _Proc(name, options, fill, BLOCKS, ns=ns, env={"UCX_LOG_LEVEL": "fatal", **(env or {})})


def _iptables(pair: Any, *args: str) -> None:
    for ns in (pair.prefill_ns, pair.decode_ns):
        subprocess.run(pair.exec_args(ns, "iptables", *args), check=True, capture_output=True, timeout=20)


@pytest.mark.parametrize(
    "err_mode",
    [
        # before the refusal, landed in every run (5 of 5)
        pytest.param("none", id="error-mode-none"),
        # before the refusal, landed in most runs
        pytest.param("peer", id="error-mode-peer"),
    ],
)
def test_a_write_queued_behind_a_connect_during_a_partition_never_lands_after_the_fence(
    err_mode: str,
) -> None:
    from kvpush.demo.netns import LINK, NetnsPair

    suffix = os.urandom(3).hex()
    with NetnsPair() as pair:
        p = d = None
        try:
            p = Agent(pair.prefill_ns, f"nx-P-{suffix}", FILL, err_mode)
            d = Agent(pair.decode_ns, f"nx-D-{suffix}", 0, err_mode)
            p_name = d.call("load", p.blob)  # D knows P's listeners (for the fence)
            _iptables(pair, "-I", "INPUT", "-i", LINK, "-j", "DROP")
            _iptables(pair, "-I", "OUTPUT", "-o", LINK, "-j", "DROP")
            d_name = p.call("load", d.blob)
            index = p.call("write", d_name, d.addr, BLOCKS, b"DONE-partitioned")
            time.sleep(2.0)  # P's connect() is retransmitting its SYN into the partition
            assert p.call("states")[index] == "pending", "the WRITE ended during the partition"
            p.call("abort", index, d_name)
            d.call("fence", p_name)
            deadline = time.monotonic() + WAIT_S
            while not d.call("fenced", p_name):
                assert time.monotonic() < deadline, "the fence was never confirmed"
                time.sleep(0.01)
            _iptables(pair, "-F")  # heal
            end = time.monotonic() + 12.0  # past the SYN retransmissions at 3 and 7 s
            landed = 0
            while time.monotonic() < end and not landed:
                landed = d.call("landed")
                time.sleep(0.05)
            assert landed == 0, (
                f"{landed} bytes of a WRITE P aborted landed in D after D confirmed its fence "
                f"(P states {p.call('states')}; D sockets {d.call('sockets')})"
            )
        finally:
            for agent in (p, d):
                if agent is not None:
                    agent.stop()


def test_loading_a_peer_across_a_partition_does_not_block_the_writer() -> None:
    """D fences P (its usual reaction to a silent P) and loads P's agent again for its other
    requests while the partition lasts, as its core does. ``load_peer`` runs on the writer
    thread; UCX's TCP connect was blocking (``UCX_TCP_CONN_NB`` defaults to no), so the load
    sat in the kernel's SYN retries (~127 s here) and with it every request of the rank (no
    notification drained, no timer run, no fence checked), again at each reconnect attempt
    while the partition lasted. The agent here answers nothing while a command runs, so a load
    not back within the wait bound (30 s) is a blocked writer."""
    from kvpush.demo.netns import LINK, NetnsPair

    suffix = os.urandom(3).hex()
    with NetnsPair() as pair:
        p = d = None
        try:
            p = Agent(pair.prefill_ns, f"nb-P-{suffix}", FILL)
            d = Agent(pair.decode_ns, f"nb-D-{suffix}", 0)
            p_name = d.call("load", p.blob)
            d.call("notify", p_name, b"hello")
            _iptables(pair, "-I", "INPUT", "-i", LINK, "-j", "DROP")
            _iptables(pair, "-I", "OUTPUT", "-o", LINK, "-j", "DROP")
            d.call("fence", p_name)
            deadline = time.monotonic() + WAIT_S
            while not d.call("fenced", p_name):
                assert time.monotonic() < deadline, "the fence was never confirmed"
                time.sleep(0.01)
            try:
                assert d.call("load", p.blob) == p_name
            except TimeoutError:
                pytest.fail(f"load_peer of a partitioned peer blocked the writer for over {WAIT_S}s")
            assert d.call("fenced", p_name) in (True, False)  # the agent answers again
        finally:
            with contextlib.suppress(Exception):
                _iptables(pair, "-F")
            for agent in (p, d):
                if agent is not None:
                    agent.stop()
