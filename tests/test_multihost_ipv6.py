"""kvpush on an IPv6-only network: P and D in two namespaces joined by a veth pair that has IPv6
addresses only (``MultiHost(ipv6=True)``: ``fd00:6b76:N::1`` / ``::2``, UCX on ``inet6``,
every side-channel and engine address a bare IPv6 literal), plus the address handling it needs.

Findings (each a test that failed before its fix of 2026-12-02; the FINDING_n texts name the causes):

1. The side channel cannot bind an IPv6 address: its ZMQ socket lacks ``zmq.IPV6`` (ZMQ says
   'No such device'; the error then says 'pick another port'), and its URL is not bracketed.
2. ``fetch_metadata`` cannot reach a side channel at an IPv6 address (same cause, client side).
3. ``kv_transfer_params['remote_host']`` is not checked: ``'[fd00::1]:5600'``/``'tcp://…'`` pass
   and fail later as an unanswered handshake, and the spellings of one IPv6 address
   (``fd00::1``, ``[fd00::1]``, ``fd00:0:0::1``) are different P engines to D.
4. ``network_interface`` names an IPv6-only interface: ``interface_address`` looks for IPv4 only
   and refuses it (a clear ConfigError, but the setting is unusable on an IPv6-only host).
5. ``kvpush demo --prefill-host/--decode-host`` take any string: ``'[fd00::1]:5600'`` is
   accepted and fails later at the side-channel bind; the flags' help names no IPv6 form.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from netns_harness import Ipv6NetnsPair, MultiHost, quarantine_s, unavailable_reason

from kvpush.core.errors import ConfigError, HandshakeError
from kvpush.core.sidechannel import SideChannelServer, fetch_metadata
from kvpush.core.types import RankKey, TransferParams


def _ipv6_reason() -> str | None:
    reason = unavailable_reason()
    if reason:
        return reason
    if not Path("/proc/net/if_inet6").exists():
        return "this kernel has no IPv6"
    return None


REASON = _ipv6_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
LOOPBACK_V6 = (
    Path("/proc/net/if_inet6").exists()
    and "00000000000000000000000000000001" in Path("/proc/net/if_inet6").read_text()
)
needs_v6_loopback = pytest.mark.skipif(not LOOPBACK_V6, reason="no ::1 here")

FINDING_1 = (
    "finding 1: SideChannelServer never sets zmq.IPV6, so ZMQ refuses to bind an IPv6 address "
    "('No such device', reported as 'pick another port'), and formats tcp://fd00::1:PORT unbracketed"
)
FINDING_2 = (
    "finding 2: fetch_metadata never sets zmq.IPV6 on its REQ socket: an IPv6 side channel is unreachable"
)
FINDING_3 = (
    "finding 3: TransferParams.from_dict takes any string as remote_host: a port/scheme glued on "
    "passes (fails later as an unanswered handshake) and IPv6 spellings are not canonical, so D "
    "treats one P at fd00::1 and [fd00::1] as two engines"
)
FINDING_4 = (
    "finding 4: core/addresses.interface_address asks SIOCGIFADDR (IPv4) only: network_interface "
    "naming an IPv6-only interface is refused ('has no IPv4 address')"
)


# ---------------------------------------------------------------------- unit level (no netns)


@needs_v6_loopback
def test_side_channel_binds_an_ipv6_literal_and_publishes_a_bracketed_url() -> None:
    server = SideChannelServer("p-v6", host="::1", insecure=True)
    try:
        assert server.address == f"tcp://[::1]:{server.port}"
    finally:
        server.close()


@needs_v6_loopback
def test_fetch_metadata_reaches_a_side_channel_at_an_ipv6_literal() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # a server that binds IPv6 itself (finding 1 aside)
    router.setsockopt(zmq.IPV6, 1)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://[::1]")
    stop = threading.Event()

    def answer() -> None:
        from kvpush.core import wire

        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                frames = router.recv_multipart()
                router.send_multipart([frames[0], b"", wire.pack({"payload": b"meta-v6"})])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        got = fetch_metadata("::1", port, RankKey(0, 0), timeout_s=3.0, engine_id="p-v6", secret=None)
        assert got == b"meta-v6"
    finally:
        stop.set()
        thread.join(timeout=5)
        router.close(linger=0)


def test_an_ipv6_side_channel_bind_failure_names_the_cause_not_the_port() -> None:
    """What holds today: the bind fails loudly (a HandshakeError naming the address), never
    binds something else. (With finding 1 fixed it succeeds; the check covers both.)"""
    try:
        server = SideChannelServer("p-v6", host="::1", insecure=True)
    except HandshakeError as err:
        assert "::1" in str(err)
    else:
        try:
            assert server.address.startswith("tcp://[::1]:")
        finally:
            server.close()


def _params(host: str) -> dict:
    return {"remote_engine_id": "prefill-0", "remote_host": host, "remote_port": 5600}


@pytest.mark.parametrize(
    "bad", ["[fd00::1]:5600", "tcp://[fd00::1]:5600", "fd00::1]", "[10.0.0.1]", " fd00::1", "", "fd00::1%"]
)
def test_transfer_params_refuse_a_malformed_host_with_a_clear_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="remote_host"):
        TransferParams.from_dict(_params(bad))


def test_one_ipv6_address_spelled_three_ways_is_one_p_engine() -> None:
    hosts = {
        TransferParams.from_dict(_params(h)).remote_host for h in ("fd00::1", "[fd00::1]", "FD00:0:0::1")
    }
    assert hosts == {"fd00::1"}


def test_d_takes_one_busy_p_spelled_two_ways_as_one_engine() -> None:
    """The consequence in D's core: a request naming P at ``[fd00::1]`` while another request
    to P at ``fd00::1`` waits for its push fails at once ('two P engines share one engine_id')."""
    from test_adversarial_keepalive import P_AGENT, _answer, _decode, _info, _reports
    from test_engine_address import _meta

    d = _decode()
    d.add(_meta("r1", "k1", "fd00::1"), 0.0)
    d.connected("P", _info(), "", 0.0)
    d.notification(P_AGENT, _answer(0.0), 0.0)  # r1 registered, waiting for its push
    out = d.add(_meta("r2", "k2", "[fd00:0::1]"), 1.0)
    assert not [r for r in _reports(out) if r.outcome == "failed"], _reports(out)


def test_decode_names_two_ipv6_p_addresses_bracketed() -> None:
    """D's 'two P engines share one engine_id' names both addresses as ``[v6]:port``, not the
    ambiguous ``fd00::1:5600``."""
    from test_adversarial_keepalive import P_AGENT, _answer, _decode, _info, _reports
    from test_engine_address import _meta

    d = _decode()
    d.add(_meta("r1", "k1", "fd00::1"), 0.0)
    d.connected("P", _info(), "", 0.0)
    d.notification(P_AGENT, _answer(0.0), 0.0)
    out = d.add(_meta("r2", "k2", "fd00::2"), 1.0)
    failed = [r for r in _reports(out) if r.outcome == "failed"]
    assert failed and "[fd00::1]:" in failed[0].reason and "[fd00::2]:" in failed[0].reason, failed


def test_host_port_brackets_ipv6_only() -> None:
    from kvpush.core.addresses import host_port

    assert host_port("fd00::1", 5600) == "[fd00::1]:5600"
    assert host_port("[fd00::1]", 5600) == "[fd00::1]:5600"
    assert host_port("10.0.0.7", 5600) == "10.0.0.7:5600"
    assert host_port("decode-3.example", 5600) == "decode-3.example:5600"


FINDING_5 = (
    "finding 5: demo/runner.py's --prefill-host/--decode-host have no type check: a host with a "
    "port glued on ('[fd00::1]:5600') is accepted and fails later at the side-channel bind"
)


def _demo_parser():
    import argparse

    from kvpush.demo import runner

    parser = argparse.ArgumentParser(exit_on_error=False)
    runner.add_arguments(parser)
    return parser


@pytest.mark.parametrize("bad", ["[fd00::1]:5600", "10.0.0.7:5600", "tcp://[fd00::1]", "[10.0.0.7]"])
def test_demo_host_flags_refuse_a_host_with_a_port_or_scheme(bad: str) -> None:
    import argparse

    with pytest.raises((argparse.ArgumentError, SystemExit)):
        _demo_parser().parse_args(["--decode-host", bad])


def test_demo_host_flags_take_an_ipv6_literal() -> None:
    args = _demo_parser().parse_args(["--prefill-host", "fd00::1", "--decode-host", "10.0.0.7"])
    assert (args.prefill_host, args.decode_host) == ("fd00::1", "10.0.0.7")


def test_ipv4_and_names_stay_as_given() -> None:
    for host in ("10.0.0.7", "decode-3.example", "localhost"):
        assert TransferParams.from_dict(_params(host)).remote_host == host


# ---------------------------------------------------------------------- two namespaces, IPv6 only


def _in_ns(ns: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )


@needs_netns
def test_network_interface_of_an_ipv6_only_link_gives_its_ipv6_address() -> None:
    with Ipv6NetnsPair() as pair:
        done = _in_ns(
            pair.decode_ns,
            "from kvpush.core.addresses import interface_address as a; print(a('kvpush0'))",
        )
        assert done.returncode == 0, done.stderr[-600:]
        assert done.stdout.strip() == pair.decode_host


@needs_netns
def test_network_interface_without_any_address_is_refused_naming_it() -> None:
    """What holds (and must keep holding with finding 4 fixed): an interface with neither an
    IPv4 nor a global IPv6 address is a ConfigError naming it, never another address."""
    with Ipv6NetnsPair() as pair:
        flush = ["ip", "-n", pair.decode_ns, "-6", "addr", "flush", "dev", "kvpush0", "scope", "global"]
        subprocess.run(flush, capture_output=True, timeout=20, check=True)
        done = _in_ns(
            pair.decode_ns,
            "from kvpush.core.addresses import interface_address as a\n"
            "from kvpush.core.errors import ConfigError\n"
            "try:\n    print('GOT', a('kvpush0'))\nexcept ConfigError as e:\n    print('REFUSED', e)",
        )
        assert done.returncode == 0, done.stderr[-600:]
        assert done.stdout.startswith("REFUSED") and "'kvpush0'" in done.stdout, done.stdout


@needs_netns
@pytest.mark.timeout(300)
def test_push_over_an_ipv6_only_link_and_every_byte_verifies() -> None:
    with MultiHost(ipv6=True) as hosts:
        assert ":" in hosts.pair.prefill_host and ":" in hosts.pair.decode_host
        _, rx_before = hosts.link_bytes()
        rids = [f"v6-{i}" for i in range(12)]
        hosts.plan(rids)
        hosts.dispatch(rids)
        hosts.wait_decode(rids, 60)
        for rid in rids:
            outcome = hosts.outcome(rid)
            assert len(outcome) == hosts.decode_tp
            assert {kind for kind, _, _ in outcome.values()} == {"done"}, outcome
        pushed = 12 * 32 * 16 * 1024 * 4
        _, rx = hosts.link_bytes()
        assert rx - rx_before >= pushed, f"only {rx - rx_before} bytes reached D; pushed {pushed}"
        # Every listener (side channel, each rank's UCX) is on the link's IPv6 address only.
        for side, host in (("decode", hosts.pair.decode_host), ("prefill", hosts.pair.prefill_host)):
            listening = hosts.listeners(side)
            assert len(listening) >= 3 and {a for a, _ in listening} == {host}, (side, listening)
        assert hosts.check_freed() == {}
        assert not hosts.wait_no_leaks(20.0)


FAST_TIMERS = {
    "request_timeout_s": 6.0,
    "lease_s": 6.0,
    "heartbeat_interval_s": 0.5,
    "peer_silence_s": 4.0,
    "write_deadline_s": 2.0,
}
SLACK_S = 8.0


@needs_netns
@pytest.mark.timeout(400)
def test_writes_queued_through_an_ipv6_link_down_are_refused_after_d_released_the_blocks() -> None:
    """The IPv6 form of test_multihost_netns's: blocks released during a 20 s outage, then the
    link returns with P's queued WRITEs (over IPv6 UCX connections); none lands in freed blocks
    (D's fence found P's tcp6 sockets and refused its IPv6 connection requests), and new
    requests succeed over fresh connections."""
    bound = FAST_TIMERS["request_timeout_s"] + quarantine_s(FAST_TIMERS) + SLACK_S
    recovery = 2 * FAST_TIMERS["heartbeat_interval_s"] + SLACK_S
    with MultiHost(timers=FAST_TIMERS, ipv6=True) as hosts:
        rids = ["warm-0"]
        hosts.plan(rids)
        hosts.dispatch(rids)
        hosts.wait_decode(rids, bound)
        rids = [f"down-{i}" for i in range(16)]
        hosts.plan(rids, num_blocks=48)
        hosts.dispatch(rids)
        hosts.link_down()
        outage_end = time.monotonic() + 20.0
        hosts.wait_decode(rids, bound)
        failed = 0
        for rid in rids:
            for key, (kind, detail, _) in hosts.outcome(rid).items():
                assert kind != "corrupt", (rid, key, detail)
                if kind != "done":
                    failed += 1
                    assert isinstance(detail, str) and len(detail) > 10
                    assert rid in hosts.d_released[key], f"{rid} on {key}: blocks never released"
        assert failed, "the link went down with WRITEs in flight, yet nothing failed"
        assert hosts.check_freed() == {}
        time.sleep(max(0.0, outage_end - time.monotonic()))
        hosts.link_up()
        rx_at_up, up_at = hosts.link_bytes()[1], time.monotonic()
        after = ["after-0", "after-1"]
        hosts.plan(after)
        hosts.dispatch(after)
        hosts.wait_decode(after, recovery + bound)
        for rid in after:
            assert {kind for kind, _, _ in hosts.outcome(rid).values()} == {"done"}, hosts.outcome(rid)
        # P's kernel retransmits what it queued on its TCP backoff (measured over IPv6 with the
        # fence broken: the late WRITEs landed 4-12 s after the link returned). Watch D's freed
        # blocks for 30 s after the link came back (bounded; stops at the first landed WRITE).
        watch_end = up_at + 30.0
        while time.monotonic() < watch_end and not hosts.check_freed():
            time.sleep(1.0)
            hosts.poll()
        late = hosts.link_bytes()[1] - rx_at_up
        assert late > 2 * 32 * 16 * 1024 * 4, f"only {late} bytes crossed after the link came back"
        assert hosts.check_freed() == {}, "a WRITE landed in blocks D had freed"
        assert not hosts.wait_no_leaks(FAST_TIMERS["lease_s"] + SLACK_S)
        assert hosts.check_freed() == {}, "a late WRITE landed in blocks D had freed"
