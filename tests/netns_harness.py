"""P (PP2) and D (TP2) on two "hosts": network namespaces joined by a veth pair, with impairments.

``MultiHost`` builds a :class:`kvpush.demo.netns.NetnsPair`, runs each engine's side channel and
ranks as real processes inside its namespace (``kvpush.demo.rank``), and drives them over pipes
from this process, which stays in its own namespace. UCX is pinned to TCP over the link
(``ucx_tls=tcp``, ``ucx_net_devices=kvpush0``): namespaces share /dev/shm, so UCX would
otherwise pick shared memory as if P and D were one host.

Impairments act only on the ``kvpush0`` link inside the two namespaces this harness made:

- ``link_down()`` / ``link_up()``: ``ip link set kvpush0 down`` in D's namespace (the carrier
  drops on both ends).
- ``partition()`` / ``heal()``: iptables ``DROP`` of everything on the link, both ways, in both
  namespaces (a silent partition: no RST, no ICMP).
- ``loss(p)``: iptables ``-m statistic --mode random --probability p -j DROP`` on each
  namespace's output.
- ``delay(ms)``: this kernel has no ``sch_netem``, so each namespace's input from the link goes
  to an iptables ``NFQUEUE`` and a delayer process in that namespace (this file, run as a script)
  gives each packet its verdict ``ms`` later. One-way delay ``ms``, round trip ``2 * ms``.
  ``--queue-bypass`` and fail-open let packets through if the delayer is gone or overloaded.

``MultiHost(ipv6=True)`` gives the link IPv6 addresses only (:class:`Ipv6NetnsPair`:
``fd00:6b76:N::1/64`` for P, ``::2`` for D, ``nodad``, no IPv4 on the link), tells UCX to use
IPv6 (``ucx_env={"UCX_TCP_AF_PRIO": "inet6"}``) and gives every side-channel and engine address
as a bare IPv6 literal. Its impairments use ``ip6tables`` and its ``listeners()`` read ``tcp6``.

Everything is removed by ``close()`` (also on failure): rank and helper processes are stopped
by pid, then both namespaces are deleted, which deletes the veth pair and every rule in them.
"""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kvpush.core.errors import ConfigError
from kvpush.core.types import ModelSpec, ParallelConfig, RankKey
from kvpush.demo import netns
from kvpush.demo.rank import RankSpec
from kvpush.demo.runner import (
    EngineSideChannel,
    _Rank,
    _start_ranks,
    _stop,
    side_channel_secret,
    start_side_channel,
)

MODEL = ModelSpec(name="multihost-gqa", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
"""16 KiB per block and layer (K+V, bf16): big enough that WRITEs take a while over TCP."""

QUICK_TIMERS: dict[str, float] = {
    "request_timeout_s": 20.0,
    "lease_s": 6.0,
    "heartbeat_interval_s": 0.5,
    "peer_silence_s": 15.0,
    "write_deadline_s": 10.0,
}
"""Short timers for the tests (defaults: 120 s, 30 s, lease_s / 6, 3 heartbeats + 5 s, 10 s);
``fresh_s`` stays at its default, two heartbeat intervals. ``peer_silence_s`` and
``write_deadline_s`` outlast a 5 s outage plus TCP's retransmission backoff (the next
retransmission after 5 s without a link comes at ~6.2 s), so such an outage is ridden through."""


def quarantine_s(timers: dict[str, float]) -> float:
    """How long D keeps a failed request's blocks when P does not acknowledge the cancel:
    ``fresh_s`` + ``write_deadline_s`` + max(1 s, ``write_deadline_s``) (the decode core)."""
    fresh = timers.get("fresh_s", 2 * timers["heartbeat_interval_s"])
    return fresh + timers["write_deadline_s"] + max(1.0, timers["write_deadline_s"])


D_PORT = 5601
"""D's side-channel port inside its namespace (fixed, so a restarted D serves the same one)."""


def unavailable_reason(need_iptables: bool = False) -> str | None:
    """Why these tests cannot run here (None when they can)."""
    reason = netns.unavailable_reason()
    if reason:
        return reason
    if need_iptables and shutil.which("iptables") is None:
        return "iptables is missing (apt-get install iptables; .ci/run installs it)"
    probe = f"kvpush-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        return f"'ip netns add' does not work here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


IPV6_PREFIX = "fd00:6b76"
"""``fd00:6b76:N::/64`` ("kv"): a unique local prefix for :class:`Ipv6NetnsPair`."""


@attrs.define
class Ipv6NetnsPair(netns.NetnsPair):
    """:class:`kvpush.demo.netns.NetnsPair` with IPv6 addresses only on the link
    (``fd00:6b76:N::1`` for P, ``::2`` for D; no IPv4 address anywhere but loopback). The
    addresses are kept on ``ip link set down`` (``keep_addr_on_down=1``), as a carrier loss
    keeps them; the default would flush them and the test would measure a renumbering."""

    @property
    def prefill_host(self) -> str:
        return f"{IPV6_PREFIX}:{self.subnet:x}::1"

    @property
    def decode_host(self) -> str:
        return f"{IPV6_PREFIX}:{self.subnet:x}::2"

    def create(self) -> Ipv6NetnsPair:
        reason = netns.unavailable_reason()
        if reason:
            raise ConfigError(reason)
        netns.sweep_stale()
        tag = f"{os.getpid() % 10**5}{netns.random.randrange(10**4):04d}"
        outside = (f"kvp{tag}", f"kvd{tag}")
        link = netns.LINK
        try:
            for ns in (self.prefill_ns, self.decode_ns):
                netns._run("ip", "netns", "add", ns)
                self.created.append(ns)
            netns._run("ip", "link", "add", outside[0], "type", "veth", "peer", "name", outside[1])
            try:
                for end, ns in zip(outside, (self.prefill_ns, self.decode_ns)):
                    netns._run("ip", "link", "set", end, "netns", ns)
            except ConfigError:
                for end in outside:
                    subprocess.run(["ip", "link", "del", end], capture_output=True, timeout=20, check=False)
                raise
            for end, ns, host in zip(
                outside, (self.prefill_ns, self.decode_ns), (self.prefill_host, self.decode_host)
            ):
                netns._run("ip", "-n", ns, "link", "set", end, "name", link)
                for name, value in (("disable_ipv6", "0"), ("keep_addr_on_down", "1")):
                    setting = f"net.ipv6.conf.{link}.{name}={value}"
                    netns._run("ip", "netns", "exec", ns, "sysctl", "-qw", setting)
                netns._run("ip", "-n", ns, "-6", "addr", "add", f"{host}/64", "dev", link, "nodad")
                netns._run("ip", "-n", ns, "link", "set", link, "up")
                netns._run("ip", "-n", ns, "link", "set", "lo", "up")
                if "inet " in netns._run("ip", "-n", ns, "-4", "addr", "show", "dev", link):
                    raise ConfigError(f"{link} in {ns} has an IPv4 address; this pair is IPv6 only")
        except BaseException:
            self.close()
            raise
        return self


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)!r} failed ({done.returncode}): {done.stderr.strip()}")


class MultiHost:
    """P as ``prefill_pp`` stages in one namespace, D as ``decode_tp`` ranks in the other."""

    def __init__(
        self,
        *,
        prefill_pp: int = 2,
        decode_tp: int = 2,
        blocks: int = 1024,
        timers: dict[str, float] | None = None,
        transport_options: dict[str, Any] | None = None,
        sysctls: dict[str, str] | None = None,
        reuse_failed: bool = False,
        ipv6: bool = False,
    ) -> None:
        """``reuse_failed``: P's ranks overwrite a failed request's blocks at once, as an engine
        reusing them would (``RankSpec.reuse_failed_blocks``). ``ipv6``: an IPv6-only link
        (:class:`Ipv6NetnsPair`, UCX on ``inet6``, addresses as IPv6 literals)."""
        self.prefill_pp, self.decode_tp = prefill_pp, decode_tp
        self.timers = dict(QUICK_TIMERS if timers is None else timers)
        self.ipv6 = ipv6
        self.pair = Ipv6NetnsPair() if ipv6 else netns.NetnsPair()
        self.ranks: list[_Rank] = []
        self.channels: list[EngineSideChannel] = []
        self.helpers: list[subprocess.Popen[str]] = []
        self.plans: dict[str, dict[str, Any]] = {}
        self.blocks, self.next_block = blocks, 0
        self.record: dict[str, Any] = {}
        """What a test measured (saved by the test module)."""
        self._secret = contextlib.ExitStack()
        self.pair.create()
        try:
            for name, value in (sysctls or {}).items():  # per namespace, e.g. net.ipv4.tcp_retries2
                path = "/proc/sys/" + name.replace(".", "/")
                self.both(sys.executable, "-c", f"open({path!r}, 'w').write({str(value)!r})")
            hosts = (self.pair.prefill_host, self.pair.decode_host)
            self._secret.enter_context(side_channel_secret(hosts, lambda _msg: None))
            self.transport_options = {
                "ucx_tls": "tcp",
                "ucx_net_devices": self.pair.link,
                **({"ucx_env": {"UCX_TCP_AF_PRIO": "inet6"}} if ipv6 else {}),
                **(transport_options or {}),
            }
            self.p_channel = self._channel("prefill-0", self.pair.prefill_host, self.pair.prefill_ns)
            self.d_channel = self._channel("decode-0", self.pair.decode_host, self.pair.decode_ns, D_PORT)
            options = {k: v for k, v in self.timers.items() if k not in ("request_timeout_s", "lease_s")}
            common = {
                "model": MODEL,
                "layout": "uniform",
                "blocks_per_group": (blocks,),
                "request_timeout_s": self.timers["request_timeout_s"],
                "lease_s": self.timers["lease_s"],
                "transport_options": self.transport_options,
                "worker_options": options,
                "log_level": "ERROR",
            }
            self.p_specs = [
                RankSpec(
                    role="prefill",
                    engine_id="prefill-0",
                    parallel=ParallelConfig.for_stage(
                        num_layers=MODEL.num_layers, pp_size=prefill_pp, pp_rank=pp, tp_size=1, tp_rank=0
                    ),
                    side_channel_port=self.p_channel.port,
                    host=self.pair.prefill_host,
                    netns=self.pair.prefill_ns,
                    reuse_failed_blocks=reuse_failed,
                    **common,
                )
                for pp in range(prefill_pp)
            ]
            self.d_specs = [
                RankSpec(
                    role="decode",
                    engine_id="decode-0",
                    parallel=ParallelConfig(tp_size=decode_tp, tp_rank=tp, num_layers=MODEL.num_layers),
                    side_channel_port=self.d_channel.port,
                    host=self.pair.decode_host,
                    netns=self.pair.decode_ns,
                    **common,
                )
                for tp in range(decode_tp)
            ]
            self.p_ranks = self._start(self.p_specs, self.p_channel)
            self.d_ranks = self._start(self.d_specs, self.d_channel)
        except BaseException:
            self.close()
            raise
        self.reset_results()

    def _channel(self, engine_id: str, host: str, ns: str, port: int = 0) -> EngineSideChannel:
        channel = start_side_channel(engine_id, host, ns, port=port)
        self.channels.append(channel)
        return channel

    def _start(self, specs: list[RankSpec], channel: EngineSideChannel) -> list[_Rank]:
        ranks, payloads = _start_ranks(specs, timeout_s=120)
        self.ranks += ranks
        channel.publish_all(payloads)
        return ranks

    def reset_results(self) -> None:
        self.d_results: dict[RankKey, dict[str, tuple[str, Any, float]]] = {r.key: {} for r in self.d_ranks}
        """D rank -> request -> (``done``/``corrupt``/``failed``/``cancelled``, detail, when)."""
        self.d_released: dict[RankKey, dict[str, float]] = {r.key: {} for r in self.d_ranks}
        """D rank -> failed request -> when its blocks were released (no WRITE can land)."""
        self.p_results: dict[RankKey, dict[str, str | None]] = {r.key: {} for r in self.p_ranks}

    # ------------------------------------------------------------------ requests

    def params(self, rid: str) -> dict[str, Any]:
        return {
            "remote_engine_id": "prefill-0",
            "remote_host": self.pair.prefill_host,
            "remote_port": self.p_channel.port,
            "tp_size": 1,
            "pp_size": self.prefill_pp,
            "transfer_id": f"xfer-{rid}",
            "remote_request_id": rid,
        }

    def plan(self, rids: list[str], num_blocks: int = 32, d_blocks: list[int] | None = None) -> None:
        """Give each request ``num_blocks`` blocks never used before in this run on both sides
        (so the freed-block check never mistakes a reused block for a late WRITE), fill P's."""
        batch = []
        for rid in rids:
            start, self.next_block = self.next_block, self.next_block + num_blocks
            if self.next_block > self.blocks:
                raise ValueError(f"the run needs more than its {self.blocks} blocks; pass blocks=")
            ids = list(range(start, start + num_blocks))
            seed = len(self.plans) + 1
            d_ids = ids[::-1] if d_blocks is None else list(d_blocks)  # d_blocks: reuse D blocks
            self.plans[rid] = {"seed": seed, "p_ids": [ids], "d_ids": [d_ids], "added": None}
            batch.append((rid, seed, [ids]))
        for rank in self.p_ranks:
            rank.call(("prepare", batch), timeout_s=120)

    def dispatch(self, rids: list[str], stages: Any = None) -> None:
        """Both legs of every request at once, as a router does (D adds, P finishes)."""
        for rid in rids:
            plan = self.plans[rid]
            plan["added"] = time.monotonic()
            for rank in self.d_ranks:
                rank.send(("add", rid, plan["d_ids"], self.params(rid), plan["seed"], [0]))
            for rank in self.p_ranks:
                if stages is None or rank.key.pp_rank in stages:
                    rank.send(("finish", rid, plan["p_ids"], f"xfer-{rid}"))
        for rank in self.d_ranks:
            for _ in rids:
                rank.reply(("add",), timeout_s=60)
        for rank in self.p_ranks:
            if stages is None or rank.key.pp_rank in stages:
                for _ in rids:
                    rank.reply(("finish",), timeout_s=60)

    def cancel(self, rid: str) -> None:
        for rank in self.d_ranks:
            rank.call(("cancel", rid), timeout_s=60)

    def poll(self) -> None:
        now = time.monotonic()
        for rank in self.d_ranks:
            if not rank.process.is_alive():
                continue
            polled = rank.call(("poll",), timeout_s=60)
            for rid, result in polled["done"].items():
                verdict = "done" if result["ok"] else "corrupt"
                self.d_results[rank.key][rid] = (verdict, result["miss"], now)
            for kind in ("failed", "cancelled"):
                for rid, reason in polled[kind].items():
                    self.d_results[rank.key][rid] = (kind, reason, now)
            for rid in polled.get("released", ()):
                self.d_released[rank.key][rid] = now
        for rank in self.p_ranks:
            if not rank.process.is_alive():
                continue
            polled = rank.call(("poll",), timeout_s=60)
            for rid in polled["sent"]:
                self.p_results[rank.key][rid] = None
            for rid, reason in polled["failed"].items():
                self.p_results[rank.key][rid] = reason

    def wait(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> float:
        """Poll every live rank until ``predicate`` holds (bounded); the seconds it took."""
        started = time.monotonic()
        while True:
            self.poll()
            if predicate():
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise AssertionError(
                    f"timed out after {timeout_s}s waiting for {what}; "
                    f"D: {self.d_results}; P: {self.p_results}"
                )
            time.sleep(0.05)

    def resolved(self, rids: list[str]) -> bool:
        """Every D rank reported each request done, or failed and released its blocks."""
        return all(
            rid in results and (results[rid][0] in ("done", "corrupt") or rid in self.d_released[key])
            for key, results in self.d_results.items()
            for rid in rids
        )

    def wait_decode(self, rids: list[str], timeout_s: float) -> float:
        return self.wait(f"D to resolve {rids}", lambda: self.resolved(rids), timeout_s)

    def outcome(self, rid: str) -> dict[RankKey, tuple[str, Any, float]]:
        return {key: results[rid] for key, results in self.d_results.items() if rid in results}

    def check_freed(self) -> dict[str, str]:
        """D: requests whose freed blocks were written after D released them."""
        bad: dict[str, str] = {}
        for rank in self.d_ranks:
            if rank.process.is_alive():
                bad.update(rank.call(("check_freed",), timeout_s=60))
        return bad

    def leaks(self) -> list[str]:
        """What any live rank still holds: transfer handles, requests (finished, in flight,
        stashed, pending, quarantined)."""
        found = []
        for rank in self.ranks:
            if not rank.process.is_alive():
                continue
            health = rank.call(("health",), timeout_s=60)
            state = health.get("state", {})
            counts = {
                "outstanding_handles": health["outstanding_handles"],
                **{k: health.get(k, 0) for k in ("finished", "inflight", "stashed_registrations", "pending")},
                **{f"state.{k}": state.get(k, 0) for k in ("requests", "inflight", "quarantined")},
            }
            held = {k: v for k, v in counts.items() if v}
            if held:
                found.append(f"{rank.process.name} rank {rank.key} holds {held}")
        return found

    def wait_no_leaks(self, timeout_s: float) -> list[str]:
        """Poll until no rank holds anything (P releases on leases), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            found = self.leaks()
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    # ------------------------------------------------------------------ faults

    def kill(self, rank: _Rank) -> None:
        os.kill(rank.process.pid, signal.SIGKILL)
        rank.process.join(timeout=10)

    def restart_decode(self) -> None:
        """SIGKILL D (ranks and side channel), then start it again under the same engine id,
        host and side-channel port."""
        for rank in self.d_ranks:
            if rank.process.is_alive():
                self.kill(rank)
        self.ranks = [r for r in self.ranks if r not in self.d_ranks]
        os.kill(self.d_channel.process.pid, signal.SIGKILL)
        self.d_channel.process.join(timeout=10)
        self.channels.remove(self.d_channel)
        deadline = time.monotonic() + 30
        while True:  # the killed side channel's port is free at once (no TIME_WAIT on a listener)
            try:
                self.d_channel = self._channel("decode-0", self.pair.decode_host, self.pair.decode_ns, D_PORT)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.d_ranks = self._start(self.d_specs, self.d_channel)
        self.d_results = {r.key: {} for r in self.d_ranks}
        self.d_released = {r.key: {} for r in self.d_ranks}

    def _ns_run(self, ns: str, *args: str) -> None:
        _run(*self.pair.exec_args(ns, *args))

    def both(self, *args: str) -> None:
        for ns in (self.pair.prefill_ns, self.pair.decode_ns):
            self._ns_run(ns, *args)

    def link_down(self) -> None:
        _run("ip", "-n", self.pair.decode_ns, "link", "set", self.pair.link, "down")

    def link_up(self) -> None:
        _run("ip", "-n", self.pair.decode_ns, "link", "set", self.pair.link, "up")
        # The connected route comes back with the link; wait (bounded) until it is there.
        deadline = time.monotonic() + 10
        while f"dev {self.pair.link}" not in _routes(self.pair.decode_ns, self._route_prefix()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no route over {self.pair.link} 10s after the link came up")
            time.sleep(0.05)

    def _route_prefix(self) -> str | None:
        """IPv6: the link's /64 route (``fd00:6b76:N::/64``), which comes back with the link."""
        return self.pair.prefill_host.rsplit("::", 1)[0] + "::/64" if self.ipv6 else None

    def listeners(self, side: str = "decode") -> list[tuple[str, int]]:
        """``(address, port)`` of every listening IPv4 TCP socket in P's or D's namespace
        (IPv6 ones, compressed text, when the harness is ``ipv6``)."""
        channel = self.d_channel if side == "decode" else self.p_channel
        found = []
        table = "tcp6" if self.ipv6 else "tcp"
        for line in Path(f"/proc/{channel.process.pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                if self.ipv6:  # four little-endian 32-bit words
                    text = str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))
                else:
                    text = ".".join(str(b) for b in raw[::-1])
                found.append((text, int(port, 16)))
        return found

    def link_bytes(self) -> tuple[int, int]:
        """``(tx, rx)`` bytes of D's end of the link."""
        stats = Path(f"/proc/{self.d_channel.process.pid}/net/dev").read_text()
        for line in stats.splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == self.pair.link:
                fields = counters.split()
                return int(fields[8]), int(fields[0])
        raise RuntimeError(f"{self.pair.link} not found in D's namespace")

    @property
    def _iptables(self) -> str:
        return "ip6tables" if self.ipv6 else "iptables"

    def partition(self) -> None:
        link = self.pair.link
        self.both(self._iptables, "-I", "INPUT", "-i", link, "-j", "DROP")
        self.both(self._iptables, "-I", "OUTPUT", "-o", link, "-j", "DROP")

    def heal(self) -> None:
        """Remove every impairment rule (only the namespaces' own tables; they hold nothing else)."""
        self.both(self._iptables, "-F")

    def loss(self, probability: float) -> None:
        self.both(
            self._iptables, "-A", "OUTPUT", "-o", self.pair.link, "-m", "statistic", "--mode", "random",
            "--probability", f"{probability}", "-j", "DROP",
        )  # fmt: skip

    def delay(self, ms: float, queue: int = 7) -> None:
        """Delay every packet arriving in either namespace over the link by ``ms`` (NFQUEUE
        delayer). On arrival, not departure: a packet held on the sender's OUTPUT path still
        counts against TCP small queues, which then allows ~2 packets per delay (measured:
        a 16 MiB TCP copy at 10 ms did not finish in 2 minutes; on INPUT it ran at 39 MB/s)."""
        for ns in (self.pair.prefill_ns, self.pair.decode_ns):
            proc = subprocess.Popen(
                self.pair.exec_args(ns, sys.executable, str(Path(__file__)), "delay", str(queue), str(ms)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self.helpers.append(proc)
            ready, _, _ = select.select([proc.stdout], [], [], 20)
            line = proc.stdout.readline() if ready and proc.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(
                    f"the NFQUEUE delayer in {ns} did not start within 20s: {line!r} "
                    f"{proc.stderr.read() if proc.poll() is not None and proc.stderr else ''}"
                )
            self._ns_run(
                ns, self._iptables, "-A", "INPUT", "-i", self.pair.link, "-j", "NFQUEUE",
                "--queue-num", str(queue), "--queue-bypass",
            )  # fmt: skip

    def close(self) -> None:
        _stop(self.ranks)
        for channel in self.channels:
            with contextlib.suppress(Exception):
                channel.close()
        for proc in self.helpers:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(Exception):
                proc.communicate(timeout=10)
        self.pair.close()
        self._secret.close()

    def __enter__(self) -> MultiHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _routes(ns: str, ipv6_prefix: str | None = None) -> str:
    """``ip route`` in ``ns``; with ``ipv6_prefix``, only the IPv6 route to that prefix."""
    if ipv6_prefix is None:
        return subprocess.run(["ip", "-n", ns, "route"], capture_output=True, text=True, timeout=20).stdout
    done = subprocess.run(
        ["ip", "-n", ns, "-6", "route", "show", ipv6_prefix], capture_output=True, text=True, timeout=20
    )
    return done.stdout


# ---------------------------------------------------------------------- the NFQUEUE delayer

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    body = struct.pack("=HH", 4 + len(payload), kind) + payload
    return body + b"\0" * (-len(body) % 4)


def _message(msg_type: int, queue: int, attrs: bytes, flags: int, seq: int) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


def _check_ack(sock: socket.socket, what: str) -> None:
    data = sock.recv(65536)
    _length, msg_type = struct.unpack_from("=IH", data)
    if msg_type == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", data, 16)
        if error != 0:
            raise OSError(-error, f"nfqueue {what}: {os.strerror(-error)}")


def run_delayer(queue: int, delay_ms: float, max_s: float = 3600.0) -> None:
    """Bind NFQUEUE ``queue`` in this namespace and accept each packet ``delay_ms`` after it
    arrived, in arrival order. Exits after ``max_s`` (bounded) or when killed."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    config = NFQNL_MSG_CONFIG
    flags = NLM_F_REQUEST | NLM_F_ACK
    sock.send(
        _message(config, queue, _attr(NFQA_CFG_CMD, struct.pack(">BxH", NFQNL_CFG_CMD_BIND, 2)), flags, 1)
    )
    _check_ack(sock, "bind")
    params = _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
    params += _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", 65536))
    # GSO: queue a segmentation-offload packet whole (one verdict per up to 64 KiB, not per MTU).
    queue_flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
    params += _attr(NFQA_CFG_FLAGS, struct.pack(">I", queue_flags))
    params += _attr(NFQA_CFG_MASK, struct.pack(">I", queue_flags))
    sock.send(_message(config, queue, params, flags, 2))
    _check_ack(sock, "params")
    print("ready", flush=True)
    delay = delay_ms / 1e3
    held: list[tuple[float, int]] = []
    end = time.monotonic() + max_s
    while time.monotonic() < end:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, packet_id = heapq.heappop(held)
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id))
            sock.send(_message(NFQNL_MSG_VERDICT, queue, verdict, NLM_F_REQUEST, 0))
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        ready, _, _ = select.select([sock], [], [], timeout)
        if not ready:
            continue
        data = sock.recv(1 << 20)
        arrived = time.monotonic()
        offset = 0
        while offset + 16 <= len(data):
            length, msg_type = struct.unpack_from("=IH", data, offset)
            if length < 16:
                break
            if msg_type == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                pos = offset + 20
                while pos + 4 <= offset + length:
                    attr_len, attr_type = struct.unpack_from("=HH", data, pos)
                    if attr_len < 4:
                        break
                    if attr_type & 0x7FFF == NFQA_PACKET_HDR:
                        (packet_id,) = struct.unpack_from(">I", data, pos + 4)
                        heapq.heappush(held, (arrived + delay, packet_id))
                    pos += (attr_len + 3) & ~3
            offset += (length + 3) & ~3


# ---------------------------------------------------------------------- sequential latency


def measure_latency(mode: str, requests: int = 20, num_blocks: int = 32) -> dict[str, Any]:
    """One request at a time, dispatch to both D ranks done (docs/deployment.md): ``mode`` is
    ``loopback`` (UCX's choice: CMA for data), ``tcp`` (loopback, ``ucx_tls=tcp``) or ``netns``
    (two namespaces, TCP over the veth link)."""
    import statistics

    pair = netns.NetnsPair().create() if mode == "netns" else None
    hosts = (pair.prefill_host, pair.decode_host) if pair else ("127.0.0.1", "127.0.0.1")
    spaces = (pair.prefill_ns, pair.decode_ns) if pair else (None, None)
    options: dict[str, Any] = {"ucx_tls": "tcp"} if mode != "loopback" else {}
    if pair:
        options["ucx_net_devices"] = pair.link
    ranks: list[_Rank] = []
    channels: list[EngineSideChannel] = []
    try:
        with side_channel_secret(hosts, lambda _msg: None):
            p_channel = start_side_channel("prefill-0", hosts[0], spaces[0])
            channels.append(p_channel)
            d_channel = start_side_channel("decode-0", hosts[1], spaces[1])
            channels.append(d_channel)
            common: dict[str, Any] = {
                "model": MODEL,
                "layout": "uniform",
                "blocks_per_group": ((requests + 1) * num_blocks,),
                "transport_options": options,
                "log_level": "ERROR",
            }
            p_specs = [
                RankSpec(
                    role="prefill",
                    engine_id="prefill-0",
                    parallel=ParallelConfig.for_stage(
                        num_layers=4, pp_size=2, pp_rank=pp, tp_size=1, tp_rank=0
                    ),
                    side_channel_port=p_channel.port,
                    host=hosts[0],
                    netns=spaces[0],
                    **common,
                )
                for pp in range(2)
            ]
            d_specs = [
                RankSpec(
                    role="decode",
                    engine_id="decode-0",
                    parallel=ParallelConfig(tp_size=2, tp_rank=tp, num_layers=MODEL.num_layers),
                    side_channel_port=d_channel.port,
                    host=hosts[1],
                    netns=spaces[1],
                    **common,
                )
                for tp in range(2)
            ]
            p_ranks, payloads = _start_ranks(p_specs, 120)
            ranks += p_ranks
            p_channel.publish_all(payloads)
            d_ranks, payloads = _start_ranks(d_specs, 120)
            ranks += d_ranks
            d_channel.publish_all(payloads)
            latencies = []
            for index in range(requests + 1):  # the first one connects the engines
                rid, ids = f"lat-{index}", list(range(index * num_blocks, (index + 1) * num_blocks))
                for rank in p_ranks:
                    rank.call(("prepare", [(rid, index + 1, [ids])]))
                params = {
                    "remote_engine_id": "prefill-0",
                    "remote_host": hosts[0],
                    "remote_port": p_channel.port,
                    "pp_size": 2,
                    "transfer_id": f"x-{rid}",
                }
                started = time.perf_counter()
                for rank in d_ranks:
                    rank.call(("add", rid, [ids], params, index + 1, [0]))
                for rank in p_ranks:
                    rank.call(("finish", rid, [ids], f"x-{rid}"))
                done: dict[RankKey, float] = {}
                while len(done) < len(d_ranks):
                    if time.perf_counter() - started > 60:
                        raise RuntimeError(f"{rid} not done within 60s")
                    for rank in d_ranks:
                        polled = rank.call(("poll",))
                        if polled["failed"]:
                            raise RuntimeError(f"{rid} failed: {polled['failed']}")
                        for result in polled["done"].values():
                            if not result["ok"]:
                                raise RuntimeError(f"{rid}: {result['miss']}")
                            done[rank.key] = result["t_done"]
                    time.sleep(0.001)
                for rank in p_ranks:
                    rank.call(("poll",))
                if index:
                    latencies.append((max(done.values()) - started) * 1e3)
    finally:
        _stop(ranks)
        for channel in channels:
            channel.close()
        if pair:
            pair.close()
    return {
        "mode": mode,
        "requests": requests,
        "bytes_per_request": num_blocks * 16 * 1024 * MODEL.num_layers,
        "p50_ms": round(statistics.median(latencies), 2),
        "min_ms": round(min(latencies), 2),
        "max_ms": round(max(latencies), 2),
    }


if __name__ == "__main__":
    # ip netns exec NS python tests/netns_harness.py delay QUEUE MS
    # python tests/netns_harness.py latency loopback|tcp|netns ...
    if len(sys.argv) == 4 and sys.argv[1] == "delay":
        run_delayer(int(sys.argv[2]), float(sys.argv[3]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "latency":
        import json

        for latency_mode in sys.argv[2:]:
            print(json.dumps(measure_latency(latency_mode)), flush=True)
    else:
        sys.exit("usage: netns_harness.py delay QUEUE DELAY_MS | latency MODE...")
