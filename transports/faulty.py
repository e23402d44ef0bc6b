"""A fault-injecting transport: wraps another transport by name and misbehaves on purpose.

Select it with ``WorkerConfig(transport="faulty", transport_options={...})``. Options:

- ``inner`` (str, default ``"nixl"``): the transport that does the real work.
- ``inner_options`` (dict, default ``{}``): options passed to the inner transport.
- ``seed`` (int, default 0): seeds the fault generator (mixed with the agent name, so ranks
  differ but a run is reproducible).
- ``drop_notifs``, ``dup_notifs``, ``delay_notifs`` (rates in [0, 1], default 0): each received
  notification is dropped, delivered twice, or held back for ``delay_s`` (default 0.05 s).
- ``fail_posts`` (rate): ``post_write`` raises ``TransferError`` without posting.
- ``fail_writes`` (rate): the WRITE is not posted and its handle polls ``FAILED`` (no bytes
  land, no completion notification), as a WRITE that ends in error does.
- ``slow_writes`` (rate): the WRITE stays in flight for ``write_delay_s`` (default 0.05 s):
  the inner post happens only then, so its bytes and notification land late, as on a busy
  fabric. (Host-memory NIXL finishes a WRITE inside ``transfer()``; this opens the window in
  which a cancel can race a WRITE.)
- ``raise_errors`` (rate): the transport misbehaves outside its contract, raising a
  non-kvpush ``RuntimeError``: half of the hits from ``post_write`` (nothing posted), half from
  the first ``poll`` of the handle (the WRITE itself still runs). kvpush must contain both: the
  request fails with a reason, nothing else is affected.
- ``stall_writer`` (rate): ``drain_notifs`` sleeps ``stall_s`` (default 0.2 s) first, as a
  writer thread stalled by the GIL, a long ``prepare_remote`` or a GC pause: queued posts and
  notifications pile up behind it, and the grants they carry age meanwhile.
- ``kernel_copies`` (bool, default False): its WRITEs stand for kernel copies (``cuda_ipc``),
  which nothing takes back once launched: it publishes ``writes_abortable: false`` and
  ``abortable(handle)`` is False, so P waits for an overdue WRITE instead of aborting it and D
  holds a failed request's blocks until P acknowledges or its process exited. With
  ``slow_writes`` it is a device stalled in a copy, on the CPU.
- ``notif_prefixes`` (list of str, default all): only notifications starting with one of these
  are dropped, duplicated or delayed (e.g. ``["DONE:"]``); ``drop_prefixes``,
  ``dup_prefixes`` and ``delay_prefixes`` narrow one kind of fault further.

Faults are counted in ``injected`` (``{"drop": n, "dup": n, "delay": n, "fail_post": n,
"fail_write": n}``). Everything else is delegated to the inner transport.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.markers import hookimpl
from kvpush.core.transport import TransferState, TransportConfig, TransportCounters
from kvpush.core.types import KVRegion, MemType, TransportProvider

RATES = (
    "drop_notifs",
    "dup_notifs",
    "delay_notifs",
    "fail_posts",
    "fail_writes",
    "slow_writes",
    "raise_errors",
    "stall_writer",
)
PREFIX_OPTIONS = ("notif_prefixes", "drop_prefixes", "dup_prefixes", "delay_prefixes")
KNOWN_OPTIONS = (
    *RATES,
    *PREFIX_OPTIONS,
    "inner",
    "inner_options",
    "seed",
    "delay_s",
    "write_delay_s",
    "stall_s",
    "kernel_copies",
)


class _FailedWrite:
    """The handle of a WRITE that was never posted and ends in error."""

    __slots__ = ()


class _SlowWrite:
    """A WRITE whose inner post is held back until ``due``."""

    __slots__ = ("args", "due", "inner")

    def __init__(self, args: tuple[Any, ...], due: float) -> None:
        self.args = args
        self.due = due
        self.inner: Any = None


def _create_inner(name: str, config: TransportConfig) -> Any:
    if name == "faulty":
        raise ConfigError("the faulty transport cannot wrap itself; set option 'inner' to a real one")
    if name == "loopback":  # not registered by default; tests wrap it directly
        from kvpush.transports.loopback import LoopbackTransport

        return LoopbackTransport(config)
    from kvpush.core.manager import get_plugin_manager

    return get_plugin_manager().transport(name).create(config)


class FaultyTransport:
    """A :class:`kvpush.core.transport.Transport` that injects faults around another one."""

    name = "faulty"

    def __init__(self, config: TransportConfig) -> None:
        options = dict(config.options)
        unknown = sorted(set(options) - set(KNOWN_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown faulty transport options {unknown}; known: {list(KNOWN_OPTIONS)}")
        self.rates: dict[str, float] = {}
        for rate in RATES:
            value = options.get(rate, 0.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"faulty option {rate!r} must be a rate in [0, 1], got {value!r}")
            self.rates[rate] = float(value)
        self.delay_s = float(options.get("delay_s", 0.05))
        self.write_delay_s = float(options.get("write_delay_s", 0.05))
        self.stall_s = float(options.get("stall_s", 0.2))
        if self.delay_s < 0 or self.write_delay_s < 0:
            raise ConfigError("faulty options 'delay_s' and 'write_delay_s' must be >= 0")
        self.prefixes: dict[str, tuple[bytes, ...] | None] = {}
        for name in PREFIX_OPTIONS:
            value = options.get(name)
            if value is not None and (isinstance(value, str) or not all(isinstance(p, str) for p in value)):
                raise ConfigError(f"faulty option {name!r} must be a list of prefixes, got {value!r}")
            self.prefixes[name] = None if value is None else tuple(p.encode() for p in value)
        kernel_copies = options.get("kernel_copies", False)
        if not isinstance(kernel_copies, bool):
            raise ConfigError(f"faulty option 'kernel_copies' must be true or false, got {kernel_copies!r}")
        self.kernel_copies = kernel_copies
        seed = options.get("seed", 0)
        if not isinstance(seed, int):
            raise ConfigError(f"faulty option 'seed' must be an int, got {seed!r}")
        self._rng = random.Random(seed * 1_000_003 + zlib.crc32(config.agent_name.encode()))
        inner_options = options.get("inner_options", {})
        if not isinstance(inner_options, dict):
            raise ConfigError(f"faulty option 'inner_options' must be a dict, got {inner_options!r}")
        self.inner = _create_inner(
            str(options.get("inner", "nixl")),
            TransportConfig(agent_name=config.agent_name, options=inner_options),
        )
        self._failed: set[_FailedWrite] = set()
        self._raise_on_poll: set[int] = set()
        """ids of handles whose first poll raises (``raise_errors``)."""
        self._slow: set[_SlowWrite] = set()
        self._delayed: list[tuple[float, int, str, bytes]] = []
        self._order = itertools.count()
        self.injected = {
            "drop": 0,
            "dup": 0,
            "delay": 0,
            "fail_post": 0,
            "fail_write": 0,
            "slow_write": 0,
            "raise": 0,
            "stall": 0,
        }

    def _hit(self, rate: str) -> bool:
        value = self.rates[rate]
        return value > 0 and self._rng.random() < value

    def _hit_notif(self, kind: str, message: bytes) -> bool:
        for name in ("notif_prefixes", f"{kind}_prefixes"):
            prefixes = self.prefixes[name]
            if prefixes is not None and not message.startswith(prefixes):
                return False
        return self._hit(f"{kind}_notifs")

    # ------------------------------------------------------------------ delegated

    @property
    def agent_name(self) -> str:
        return self.inner.agent_name

    @property
    def counters(self) -> TransportCounters:
        return self.inner.counters

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def register_regions(self, regions: Sequence[KVRegion]) -> None:
        self.inner.register_regions(regions)

    def register_buffer(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None:
        self.inner.register_buffer(addr, length, mem_type, device_id)

    def prepare_local(self, descriptors: np.ndarray, mem_type: MemType) -> int:
        return self.inner.prepare_local(descriptors, mem_type)

    def load_peer(self, blob: bytes) -> str:
        return self.inner.load_peer(blob)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def fence_peer(self, peer: str) -> None:
        self.inner.fence_peer(peer)

    def fenced(self, peer: str) -> bool:
        return bool(self.inner.fenced(peer))

    def prepare_remote(self, peer: str, descriptors: np.ndarray, mem_type: MemType) -> int:
        return self.inner.prepare_remote(peer, descriptors, mem_type)

    def release_list(self, handle: int) -> None:
        self.inner.release_list(handle)

    def send_notif(self, peer: str, message: bytes) -> None:
        self.inner.send_notif(peer, message)

    @property
    def same_host_copies(self) -> bool:
        """The inner transport's (see :attr:`kvpush.transports.nixl.NixlTransport.same_host_copies`)."""
        return bool(getattr(self.inner, "same_host_copies", True))

    @property
    def writes_abortable(self) -> bool:
        """Published in the rank's metadata (see ``kernel_copies``)."""
        return not self.kernel_copies and bool(getattr(self.inner, "writes_abortable", True))

    def abortable(self, handle: Any) -> bool:
        """Whether a posted WRITE can still be taken back (never, with ``kernel_copies``)."""
        if self.kernel_copies:
            return False
        if isinstance(handle, _SlowWrite):
            handle = handle.inner  # None while not posted yet: nothing to take back
        inner = getattr(self.inner, "abortable", None)
        if inner is None or handle is None or isinstance(handle, _FailedWrite):
            return True
        return bool(inner(handle))

    # ------------------------------------------------------------------ faulty

    def post_write(
        self,
        local_list: int,
        local_ids: np.ndarray,
        remote_list: int,
        remote_ids: np.ndarray,
        notif: bytes,
    ) -> Any:
        raising = self._hit("raise_errors")
        if raising and self._rng.random() < 0.5:
            self.injected["raise"] += 1
            raise RuntimeError("faulty transport: injected non-kvpush error in post_write")
        handle = self._post(local_list, local_ids, remote_list, remote_ids, notif)
        if raising:
            self._raise_on_poll.add(id(handle))
        return handle

    def _post(
        self,
        local_list: int,
        local_ids: np.ndarray,
        remote_list: int,
        remote_ids: np.ndarray,
        notif: bytes,
    ) -> Any:
        if self._hit("fail_posts"):
            self.injected["fail_post"] += 1
            self.inner.counters.writes_failed += 1
            raise TransferError(
                f"faulty transport: injected post failure ({len(local_ids)} descriptors)", maybe_sent=False
            )
        if self._hit("fail_writes"):
            self.injected["fail_write"] += 1
            handle = _FailedWrite()
            self._failed.add(handle)
            return handle
        if self._hit("slow_writes"):
            self.injected["slow_write"] += 1
            slow = _SlowWrite(
                (local_list, local_ids, remote_list, remote_ids, notif), time.monotonic() + self.write_delay_s
            )
            self._slow.add(slow)
            return slow
        return self.inner.post_write(local_list, local_ids, remote_list, remote_ids, notif)

    def poll(self, handle: Any) -> TransferState:
        if self._raise_on_poll and id(handle) in self._raise_on_poll:
            self._raise_on_poll.discard(id(handle))
            self.injected["raise"] += 1
            raise RuntimeError("faulty transport: injected non-kvpush error in poll")
        if isinstance(handle, _FailedWrite):
            return TransferState.FAILED
        if isinstance(handle, _SlowWrite):
            if handle.inner is None:
                if time.monotonic() < handle.due:
                    return TransferState.PENDING
                try:
                    handle.inner = self.inner.post_write(*handle.args)
                except TransferError:
                    self._slow.discard(handle)
                    return TransferState.FAILED
            return self.inner.poll(handle.inner)
        return self.inner.poll(handle)

    def release(self, handle: Any) -> None:
        self._raise_on_poll.discard(id(handle))
        if isinstance(handle, _FailedWrite):
            self._failed.discard(handle)
            return
        if isinstance(handle, _SlowWrite):
            self._slow.discard(handle)
            if handle.inner is not None:
                self.inner.release(handle.inner)
            return
        self.inner.release(handle)

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        if self._hit("stall_writer"):
            self.injected["stall"] += 1
            time.sleep(self.stall_s)
        now = time.monotonic()
        out = []
        for peer, message in self.inner.drain_notifs():
            if self._hit_notif("drop", message):
                self.injected["drop"] += 1
            elif self._hit_notif("delay", message):
                self.injected["delay"] += 1
                heapq.heappush(self._delayed, (now + self.delay_s, next(self._order), peer, message))
            elif self._hit_notif("dup", message):
                self.injected["dup"] += 1
                out += [(peer, message), (peer, message)]
            else:
                out.append((peer, message))
        while self._delayed and self._delayed[0][0] <= now:
            _, _, peer, message = heapq.heappop(self._delayed)
            out.append((peer, message))
        return out

    @property
    def outstanding_handles(self) -> int:
        unposted = sum(1 for h in self._slow if h.inner is None)
        return len(self._failed) + unposted + self.inner.outstanding_handles

    def close(self) -> None:
        self._failed.clear()
        self._slow.clear()
        self._delayed.clear()
        self.inner.close()


@hookimpl
def kvpush_transports() -> list[TransportProvider]:
    return [
        TransportProvider(
            name="faulty",
            create=FaultyTransport,
            description="wraps another transport (option 'inner') and injects faults at seeded rates",
        )
    ]
