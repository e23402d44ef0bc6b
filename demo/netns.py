"""Two network namespaces joined by a veth pair: a faithful stand-in for two hosts on one box.

``NetnsPair`` creates namespaces ``<prefix>-p`` and ``<prefix>-d`` (unique per run), one veth
pair whose ends are both called :data:`LINK` inside them, and a private ``/30`` between them
(``10.213.N.1`` for P, ``.2`` for D). Nothing is added to the namespace this process runs in
(no address, no route), so traffic stays between the two namespaces it made. ``close()``
deletes both namespaces (which deletes the veth pair); it runs on every exit path of the
context manager and is safe to call twice.

:func:`enter` moves the calling *process* into a namespace; call it first thing in a fresh
process (before any thread starts: a network namespace is per thread, and threads inherit the
namespace of the thread that creates them). Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import subprocess
import threading

import attrs

from kvpush.core.errors import ConfigError

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MNT_DETACH = 2
NETNS_DIR = "/run/netns"
LINK = "kvpush0"
"""Name of the veth end inside each namespace (names are per namespace, so both ends share it)."""
SUBNET_PREFIX = "10.213"


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root"
    if shutil.which("ip") is None:
        return "iproute2's 'ip' command is missing (apt-get install iproute2)"
    return None


def sweep_stale() -> list[str]:
    """Delete namespaces a killed run left behind: ``kvpush-<pid>-<tag>-p|d`` whose pid is gone.
    Returns the names deleted."""
    swept = []
    with contextlib.suppress(OSError):
        for name in os.listdir(NETNS_DIR):
            parts = name.split("-")
            ours = len(parts) == 4 and parts[0] == "kvpush" and parts[3] in ("p", "d")
            if not ours or not parts[1].isdigit() or os.path.exists(f"/proc/{parts[1]}"):
                continue
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20, check=False)
            swept.append(name)
    return swept


def _run(*args: str, timeout_s: float = 20.0) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{' '.join(args)!r} did not finish within {timeout_s}s") from None
    if done.returncode != 0:
        raise ConfigError(f"{' '.join(args)!r} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _remount_sysfs(libc: ctypes.CDLL, name: str) -> None:
    """What ``ip netns exec`` does after ``setns``: a private mount namespace with a /sys that
    shows this network namespace's devices (UCX lists TCP devices from /sys/class/net)."""
    if libc.unshare(CLONE_NEWNS) != 0:
        raise ConfigError(f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}")
    if libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None) != 0:
        raise ConfigError(f"making / a slave mount failed: {os.strerror(ctypes.get_errno())}")
    libc.umount2(b"/sys", MNT_DETACH)  # may fail if /sys was not mounted; the mount below decides
    if libc.mount(name.encode(), b"/sys", b"sysfs", 0, None) != 0:
        raise ConfigError(
            f"mounting sysfs for network namespace {name!r} failed: {os.strerror(ctypes.get_errno())}"
        )


def enter(name: str) -> None:
    """Move the calling process into namespace ``name``, as ``ip netns exec`` would (network
    namespace, plus a private mount namespace whose /sys lists the namespace's devices)."""
    if threading.active_count() > 1:  # other threads would stay where they are
        raise ConfigError(
            f"cannot enter network namespace {name!r} with {threading.active_count() - 1} other "
            f"threads running; enter it before any thread starts"
        )
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise ConfigError(f"network namespace {name!r} does not exist ({path}: {err.strerror})") from None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise ConfigError(f"setns into network namespace {name!r} failed: {os.strerror(errno)}")
    finally:
        os.close(fd)
    _remount_sysfs(libc, name)


@attrs.define
class NetnsPair:
    """Two namespaces (P's and D's) and the link between them; a context manager."""

    prefix: str = attrs.field(factory=lambda: f"kvpush-{os.getpid()}-{random.randrange(16**4):04x}")
    subnet: int = attrs.field(factory=lambda: random.randrange(256))
    """N in 10.213.N.0/30."""
    created: list[str] = attrs.field(factory=list)

    @property
    def prefill_ns(self) -> str:
        return f"{self.prefix}-p"

    @property
    def decode_ns(self) -> str:
        return f"{self.prefix}-d"

    @property
    def prefill_host(self) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.1"

    @property
    def decode_host(self) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.2"

    @property
    def link(self) -> str:
        return LINK

    def create(self) -> NetnsPair:
        """Make both namespaces, the veth pair and the addresses; undo everything on failure."""
        reason = unavailable_reason()
        if reason:
            raise ConfigError(reason)
        sweep_stale()
        tag = f"{os.getpid() % 10**5}{random.randrange(10**4):04d}"
        outside = (f"kvp{tag}", f"kvd{tag}")  # temporary names (<= 15 chars) in this namespace
        try:
            for ns in (self.prefill_ns, self.decode_ns):
                _run("ip", "netns", "add", ns)
                self.created.append(ns)
            _run("ip", "link", "add", outside[0], "type", "veth", "peer", "name", outside[1])
            try:
                for end, ns in zip(outside, (self.prefill_ns, self.decode_ns)):
                    _run("ip", "link", "set", end, "netns", ns)
            except ConfigError:
                for end in outside:
                    subprocess.run(["ip", "link", "del", end], capture_output=True, timeout=20, check=False)
                raise
            for end, ns, host in zip(
                outside, (self.prefill_ns, self.decode_ns), (self.prefill_host, self.decode_host)
            ):
                _run("ip", "-n", ns, "link", "set", end, "name", LINK)
                _run("ip", "-n", ns, "addr", "add", f"{host}/30", "dev", LINK)
                _run("ip", "-n", ns, "link", "set", LINK, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec_args(self, ns: str, *args: str) -> list[str]:
        """``ip netns exec ns args...``."""
        return ["ip", "netns", "exec", ns, *args]

    def close(self) -> None:
        """Delete the namespaces this pair made (and with them the veth pair)."""
        while self.created:
            ns = self.created.pop()
            with contextlib.suppress(Exception):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20, check=False)

    def __enter__(self) -> NetnsPair:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()
