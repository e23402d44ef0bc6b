"""``kvpush demo`` across hosts: host options, the namespace pair it builds, a push over the link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.cli import build_parser
from kvpush.demo import netns
from kvpush.demo.runner import RunConfig, placed_in_netns, placement, placement_options

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
CONSOLE_SCRIPT = Path(sys.executable).with_name("kvpush")


def _namespaces() -> set[str]:
    return set(os.listdir(netns.NETNS_DIR)) if os.path.isdir(netns.NETNS_DIR) else set()


def test_host_options_become_the_run_config() -> None:
    args = build_parser().parse_args(
        ["demo", "--prefill-host", "10.0.0.1", "--decode-host", "10.0.0.2", "--ucx-tls", "tcp"]
    )
    options = placement_options(args)
    assert options["prefill_host"] == "10.0.0.1" and options["decode_host"] == "10.0.0.2"
    assert options["transport_options"] == {"ucx_tls": "tcp"} and options["netns"] is False
    cfg = RunConfig(**options)
    assert placement(cfg) == "P at 10.0.0.1, D at 10.0.0.2; ucx_tls=tcp"


def test_netns_mode_pins_ucx_to_tcp_over_the_link_unless_told_otherwise() -> None:
    pair = netns.NetnsPair(prefix="kvpush-1-abcd", subnet=9)
    cfg = placed_in_netns(RunConfig(netns=True), pair)
    assert (cfg.prefill_host, cfg.decode_host) == ("10.213.9.1", "10.213.9.2")
    assert (cfg.prefill_netns, cfg.decode_netns) == ("kvpush-1-abcd-p", "kvpush-1-abcd-d")
    assert cfg.transport_options == {"ucx_tls": "tcp", "ucx_net_devices": netns.LINK}
    cfg = placed_in_netns(RunConfig(netns=True, transport_options={"ucx_tls": "tcp,cma"}), pair)
    assert cfg.transport_options["ucx_tls"] == "tcp,cma" and not cfg.netns


@needs_netns
def test_the_pair_is_made_and_removed_and_stale_ones_are_swept() -> None:
    with netns.NetnsPair() as pair:
        assert {pair.prefill_ns, pair.decode_ns} <= _namespaces()
        shown = subprocess.run(
            ["ip", "-n", pair.decode_ns, "-o", "addr", "show", "dev", pair.link],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        assert f"{pair.decode_host}/30" in shown
    assert not {pair.prefill_ns, pair.decode_ns} & _namespaces()
    # A namespace left behind by a killed run (its pid is gone) is swept by the next pair.
    dead_pid = 4_000_000 + os.getpid() % 100_000
    assert not os.path.exists(f"/proc/{dead_pid}")
    stale = f"kvpush-{dead_pid}-0000-p"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=20)
    try:
        assert netns.sweep_stale() == [stale]
        assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=20)


@needs_netns
@pytest.mark.multihost
@pytest.mark.timeout(600)
def test_kvpush_demo_netns_pushes_pp2_to_tp2_across_the_link() -> None:
    demo = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "demo", "--netns", "--layout", "mha", "--requests", "6", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")},
    )
    try:
        stdout, stderr = demo.communicate(timeout=540)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate(timeout=30)
    assert demo.returncode == 0, stderr[-3000:]
    assert not [n for n in _namespaces() if n.startswith(f"kvpush-{demo.pid}-")], "namespaces left behind"
    report = json.loads(stdout)
    (run,) = report["runs"]
    assert report["ok"] and run["verified_requests"] == 6, run
    assert (run["prefill_pp"], run["decode_tp"]) == (2, 2)
    assert "netns" in run["placement"] and "ucx_tls=tcp" in run["placement"], run["placement"]
