"""Same-host CUDA IPC transport: P copies straight into D's KV blocks with one kernel.

Select it with ``WorkerConfig(transport="cuda_ipc")`` on both sides. It wraps another
transport (``inner``, default NIXL) that carries every notification and every WRITE to a peer
that IPC cannot reach. Options:

- ``inner`` (str, default ``"nixl"``) and ``inner_options`` (dict): the wrapped transport.
- ``mode``: ``"auto"`` (default: IPC to a peer on this host whose GPU this process can reach
  (same GPU or peer access), the inner transport otherwise), ``"ipc"`` (IPC or fail the
  handshake with ``TransferError``), ``"nixl"`` (always the inner transport).

How it works. ``metadata()`` wraps the inner transport's bytes with this rank's host identity
(hostname and boot id), pid, a random id of this process, and a CUDA IPC handle of every device
allocation behind its registered memory (KV regions and staging area). ``load_peer`` opens a
peer's handles when the peer is reachable, and refuses a handle that maps fewer bytes than the
peer claims (a peer is this same process only when it states this process's random id: pids
repeat across containers); ``prepare_remote`` turns the peer's descriptor addresses into this process's
mapped addresses once; ``post_write`` gathers the request's ``(src, dst, len)`` triples and
launches one kernel (:class:`kvpush.core.kernels.SpanCopier`, on the writer's own stream after
the engine's stream) that copies scattered blocks into scattered blocks: no staging, no
per-block descriptors. ``poll`` reports DONE once the kernel's event has completed and the
notification went out over the inner transport, so D sees the same completion message as with
a NIXL WRITE. ``remove_peer`` (and a reload of a restarted peer under the same name, a new
incarnation) closes the handles.

Memory legacy IPC cannot export (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
``cuMemCreate`` allocators) publishes no handles: in ``auto`` peers then write to this rank over
the inner transport (``unexported`` says why); ``ipc`` refuses at start.

While every loaded peer is reached by IPC, the built-in strategy answer for a VRAM push is
``direct`` (one kernel beats gather + WRITE + scatter); a pinned strategy still wins.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import struct
import time
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.markers import hookimpl
from kvpush.core.planning import IdGrid
from kvpush.core.process_identity import host_identity
from kvpush.core.transport import TransferState, TransportConfig, TransportCounters
from kvpush.core.types import KVRegion, MemType, PushJob, ReadSpec, TransportProvider

logger = logging.getLogger(__name__)

MAGIC = b"KVPIPC1\0"
MODES = ("auto", "ipc", "nixl")
KNOWN_OPTIONS = ("inner", "inner_options", "mode")
CUDA_ERROR_ALREADY_MAPPED = 208
MAX_ADDRESS = (1 << 63) - 1
"""Largest end (base + size) of a peer allocation: translation runs in int64, and an end past
it wrapped negative (a descriptor reaching past the mapping passed the range check)."""

CLOSE_WAIT_S = 10.0
"""How long removing a peer (or closing) waits for a copy still running through its mapping."""

_LIVE: weakref.WeakValueDictionary[str, CudaIpcTransport] = weakref.WeakValueDictionary()

_PROCESS = [os.urandom(16).hex()]
"""A random id of this process, published in the metadata: a peer is "this process" (its
addresses used as they are, no handle opened) only when it states this id. A pid cannot tell:
two containers on one host (same hostname and boot id, e.g. host networking) each have their own
PID namespace and often the same pid, and P would then copy into its own address space at D's
addresses. Renewed in a forked child."""
os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, os.urandom(16).hex()))


# ------------------------------------------------------------------------------ metadata blob


def encode_blob(inner: bytes, info: dict[str, Any]) -> bytes:
    """``MAGIC | len(json) | json | inner`` (what ``metadata()`` returns)."""
    header = json.dumps(info, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + inner


def decode_blob(blob: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """``(inner bytes, info)``; ``info`` is None for a peer whose transport is not cuda_ipc."""
    if not blob.startswith(MAGIC):
        return blob, None
    start = len(MAGIC) + 4
    if len(blob) < start:
        raise TransferError("cuda_ipc peer metadata is truncated (no header length)")
    (size,) = struct.unpack_from("<I", blob, len(MAGIC))
    if len(blob) < start + size:
        raise TransferError(f"cuda_ipc peer metadata is truncated (header of {size} bytes)")
    try:
        info = json.loads(blob[start : start + size])
    except (ValueError, RecursionError) as err:  # RecursionError: a deeply nested header
        raise TransferError(f"cuda_ipc peer metadata header is not JSON: {err}") from err
    if not isinstance(info, dict):
        raise TransferError(f"cuda_ipc peer metadata header is not a JSON object: {type(info).__name__}")
    return blob[start + size :], info


def _allocations(info: dict[str, Any]) -> list[tuple[int, int, bytes]]:
    """The peer's ``(base, size, IPC handle)`` list, sorted by base, checked: positive sizes,
    no overlap, 64-byte handles (``TransferError`` naming what is wrong)."""
    out = []
    entries = info.get("allocations") or ()
    if not isinstance(entries, list):
        raise TransferError(f"cuda_ipc: a peer's allocations must be a list, got {type(entries).__name__}")
    for alloc in entries:
        try:
            base, size = alloc["base"], alloc["size"]
            handle = bytes.fromhex(alloc["handle"])
        except (KeyError, TypeError, ValueError) as err:
            raise TransferError(
                f"cuda_ipc: a peer allocation entry is malformed ({err!r}): {alloc!r}"
            ) from err
        if (
            type(base) is not int
            or type(size) is not int
            or base <= 0
            or size <= 0
            or base + size > MAX_ADDRESS
            or len(handle) != 64
        ):
            raise TransferError(f"cuda_ipc: a peer allocation entry is out of range: {alloc!r}")
        out.append((base, size, handle))
    out.sort()
    for (base, size, _), (following, _, _) in itertools.pairwise(out):
        if base + size > following:
            raise TransferError(f"cuda_ipc: peer allocations overlap at {following:#x}")
    return out


# ------------------------------------------------------------------------------ CUDA driver


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # not c_char: that reads as bytes cut at a NUL


class Driver:
    """The CUDA driver calls IPC needs, beside :mod:`kvpush.core.cuda_driver` (whose library,
    error check and primary contexts it uses)."""

    def __init__(self) -> None:
        from kvpush.core.cuda_driver import driver

        self._core = driver()
        self.lib = self._core.lib
        self._check = self._core._check

    def bind(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread."""
        context = self._core.primary_context(device)
        self._check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")

    def allocation(self, addr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)),
            "cuMemGetAddressRange",
        )
        return base.value, size.value

    def export(self, base: int) -> bytes:
        handle = _Handle()
        self._check(
            self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base)), "cuIpcGetMemHandle"
        )
        return bytes(handle.reserved)

    def open(self, handle: bytes) -> int:
        if len(handle) != 64:
            raise TransferError(f"cuda_ipc: a peer IPC handle has {len(handle)} bytes, not 64")
        raw = _Handle()
        ctypes.memmove(ctypes.addressof(raw), handle, 64)
        ptr = ctypes.c_uint64()
        status = self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, ctypes.c_uint(1))  # lazy peer access
        self._check(status, "cuIpcOpenMemHandle")
        return ptr.value

    def close(self, ptr: int) -> None:
        self._check(self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")

    def can_access(self, device: int, peer: int) -> bool:
        if device == peer:
            return True
        ok = ctypes.c_int()
        self._check(self.lib.cuDeviceCanAccessPeer(ctypes.byref(ok), device, peer), "cuDeviceCanAccessPeer")
        return bool(ok.value)


def device_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, by ordinal."""
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


# ------------------------------------------------------------------------------ lists and writes


@attrs.define(eq=False)
class _List:
    """A prepared descriptor list: addresses (mapped, for an IPC peer) and lengths."""

    peer: str | None
    descs: np.ndarray
    mem_type: str
    addrs: np.ndarray
    lens: np.ndarray
    inner: int | None = None
    table: Any = None
    """:class:`kvpush.core.kernels.DeviceTable` of ``addrs``, made at the first IPC post."""

    def device_table(self, device: int) -> Any:
        if self.table is None:
            from kvpush.core.kernels import DeviceTable

            self.table = DeviceTable(self.addrs, self.lens, f"cuda:{device}")
        return self.table


@attrs.define(eq=False)
class _IpcWrite:
    """A posted kernel copy; DONE once its event completed and the notification was sent."""

    event: Any
    peer: str
    notif: bytes
    descriptors: int
    sent: bool = False
    failed: bool = False


@attrs.define(eq=False)
class _Peer:
    """An IPC-reachable peer: its allocations, sorted by base, and where they are mapped here."""

    pid: int
    bases: np.ndarray
    sizes: np.ndarray
    mapped: np.ndarray
    opened: list[int]
    """Pointers this process opened (closed on removal); empty for a peer in this process."""

    def translate(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Peer addresses -> addresses mapped in this process (``TransferError`` if outside)."""
        a = addrs.astype(np.int64)  # an address of 2**63 or more turns negative: k < 0 below
        n = np.asarray(lens).astype(np.int64)  # a length of 2**63 or more turns negative
        k = np.searchsorted(self.bases, a, side="right") - 1
        if len(a) and (k < 0).any():
            raise TransferError("cuda_ipc: a peer descriptor lies outside the allocations it exported")
        # end - a, never a + n: the sum could pass 2**63 and wrap (ends are below 2**63)
        room = (self.bases[k] + self.sizes[k]) - a
        if len(a) and ((n < 0) | (n > room)).any():
            raise TransferError("cuda_ipc: a peer descriptor lies outside the allocations it exported")
        return self.mapped[k] + (a - self.bases[k])


class CudaIpcTransport:
    """A :class:`kvpush.core.transport.Transport`: CUDA IPC kernel copies on this host,
    ``inner`` for notifications and every other peer."""

    name = "cuda_ipc"

    def __init__(self, config: TransportConfig) -> None:
        options = dict(config.options)
        unknown = sorted(set(options) - set(KNOWN_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown cuda_ipc transport options {unknown}; known: {list(KNOWN_OPTIONS)}")
        self.mode = str(options.get("mode", "auto"))
        if self.mode not in MODES:
            raise ConfigError(f"cuda_ipc option 'mode' must be one of {list(MODES)}, got {self.mode!r}")
        self.use_ipc = self.mode != "nixl"
        """Post over IPC to IPC-reachable peers (a benchmark may flip it between requests)."""
        inner_options = options.get("inner_options", {})
        if not isinstance(inner_options, dict):
            raise ConfigError(f"cuda_ipc option 'inner_options' must be a dict, got {inner_options!r}")
        inner = str(options.get("inner", "nixl"))
        if inner == "cuda_ipc":
            raise ConfigError("the cuda_ipc transport cannot wrap itself; set option 'inner' to 'nixl'")
        self.inner = _create_inner(
            inner, TransportConfig(agent_name=config.agent_name, options=inner_options)
        )
        self._driver: Driver | None = None
        self._spans: list[tuple[int, int, int]] = []  # registered (addr, len, device) in VRAM
        self._exports: list[dict[str, Any]] | None = None
        self._lists: dict[int, _List] = {}
        self._next_list = 1
        self._peers: dict[str, _Peer] = {}
        self._blobs: dict[str, bytes] = {}
        self._writes: set[_IpcWrite] = set()
        self.ipc_writes = 0
        self.post_seconds = [0.0, 0.0]
        """Time in IPC posts: building the address lists, launching the copy (totals)."""
        self.close_wait_s = CLOSE_WAIT_S
        self.unclosed: list[int] = []
        """Mappings left open because a copy through them still ran when their peer went."""
        self.unexported = ""
        """Why this rank's VRAM cannot be exported over IPC (empty when it can, or not yet asked)."""
        self.fallbacks: dict[str, str] = {}
        """Peer -> why WRITEs to it go over the inner transport (auto mode)."""
        _LIVE[config.agent_name] = self

    # ------------------------------------------------------------------ delegated

    @property
    def agent_name(self) -> str:
        return self.inner.agent_name

    @property
    def counters(self) -> TransportCounters:
        return self.inner.counters

    def send_notif(self, peer: str, message: bytes) -> None:
        self.inner.send_notif(peer, message)

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        return self.inner.drain_notifs()

    # ------------------------------------------------------------------ memory

    def _cuda(self) -> Driver:
        if self._driver is None:
            self._driver = Driver()
        return self._driver

    def register_regions(self, regions: Sequence[KVRegion]) -> None:
        self.inner.register_regions(regions)
        vram = [(r.base_addr, r.end_addr - r.base_addr, r.device_id) for r in regions if r.mem_type == "VRAM"]
        if self.mode == "ipc" and len(vram) < len(regions):
            raise ConfigError(
                "cuda_ipc mode 'ipc' needs KV caches in VRAM; use mode 'auto' or the nixl transport"
            )
        self._spans += vram
        self._exports = None

    def register_buffer(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None:
        self.inner.register_buffer(addr, length, mem_type, device_id)
        if mem_type == "VRAM":
            self._spans.append((addr, length, device_id))
            self._exports = None

    def _export(self) -> list[dict[str, Any]]:
        """One IPC handle per device allocation behind the registered VRAM (cached); none at
        all when any of it cannot be exported (``unexported`` then says why)."""
        if self._exports is None:
            exports: dict[int, dict[str, Any]] = {}
            if self._spans and self.mode != "nixl":
                driver = self._cuda()
                uuids = device_uuids()
                try:
                    for addr, _length, device in self._spans:
                        driver.bind(device)
                        base, size = driver.allocation(addr)
                        if base not in exports:
                            exports[base] = {
                                "base": base,
                                "size": size,
                                "handle": driver.export(base).hex(),
                                "device": uuids[device],
                            }
                except TransferError as err:
                    self._unexportable(err)
                    exports = {}
            self._exports = sorted(exports.values(), key=lambda e: e["base"])
        return self._exports

    def _unexportable(self, err: TransferError) -> None:
        """Legacy CUDA IPC cannot export this memory: memory of ``cuMemCreate``/``cuMemMap``
        (PyTorch's ``expandable_segments``, virtual-memory allocators) is refused by
        ``cuIpcGetMemHandle``. ``ipc`` mode refuses to start; ``auto`` publishes no handles."""
        self.unexported = (
            f"{err}: legacy CUDA IPC cannot export virtual-memory allocations "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, cuMemCreate allocators)"
        )
        if self.mode == "ipc":
            raise ConfigError(
                f"cuda_ipc mode 'ipc' cannot export this rank's KV memory ({self.unexported}); "
                "start the engine without expandable_segments, or use mode 'auto' (WRITEs to this "
                "rank then go over the inner transport) or the nixl transport"
            ) from err
        logger.warning(
            "cuda_ipc: this rank's KV memory cannot be exported (%s); peers write to it over %s",
            self.unexported,
            getattr(self.inner, "name", "the inner transport"),
        )

    def metadata(self) -> bytes:
        info = {
            "host": host_identity(),
            "pid": os.getpid(),
            "process": _PROCESS[0],
            "allocations": self._export(),
        }
        if self.unexported:
            info["unexported"] = self.unexported
        return encode_blob(self.inner.metadata(), info)

    # ------------------------------------------------------------------ peers

    def load_peer(self, blob: bytes) -> str:
        inner_blob, info = decode_blob(blob)
        name = self.inner.load_peer(inner_blob)
        if self._blobs.get(name) == blob:
            return name
        self._close_peer(name)  # a new incarnation under a loaded name: reopen
        self._blobs[name] = blob
        reason = self._unreachable(info)
        if reason is None:
            assert info is not None
            try:
                self._peers[name] = self._open(name, info)
            except TransferError as err:
                reason = str(err)
        if reason is not None:
            if self.mode == "ipc":
                raise TransferError(f"cuda_ipc mode 'ipc' cannot reach peer {name}: {reason}")
            self.fallbacks[name] = reason
            log = logger.warning if info is not None and self.mode == "auto" else logger.info
            log("cuda_ipc: peer %s goes over %s (%s)", name, getattr(self.inner, "name", "inner"), reason)
        return name

    def _unreachable(self, info: dict[str, Any] | None) -> str | None:
        """Why IPC cannot reach this peer, or None when it can."""
        if self.mode == "nixl":
            return "mode 'nixl'"
        if info is None:
            return "the peer does not run the cuda_ipc transport"
        if isinstance(info.get("unexported"), str):
            return f"the peer cannot export its KV memory over CUDA IPC ({info['unexported'][:300]})"
        if not self._spans or not info.get("allocations"):
            return "no VRAM registered on one side"
        if info.get("host") != host_identity():
            return "the peer is on another host"
        uuids = device_uuids()
        driver = self._cuda()
        local = {device for _, _, device in self._spans}
        if not isinstance(info["allocations"], list):
            return "the peer's allocations are not a list"
        for alloc in info["allocations"]:
            if not isinstance(alloc, dict):
                return f"a peer allocation entry is not a map: {str(alloc)[:80]}"
            if alloc.get("device") not in uuids:
                return f"the peer's GPU {str(alloc.get('device'))[:80]} is not visible here"
            peer_dev = uuids.index(alloc["device"])
            if not all(driver.can_access(dev, peer_dev) for dev in local):
                return f"no peer access from GPUs {sorted(local)} to GPU {peer_dev}"
        return None

    def _open(self, name: str, info: dict[str, Any]) -> _Peer:
        """Map the peer's allocations here: open each IPC handle and check that it maps at
        least the bytes the peer claims (the kernel writes up to the claimed end); a peer in this
        very process (``process`` id) must be a live cuda_ipc agent of it exporting exactly
        these allocations, whose addresses are then used as they are."""
        allocations = _allocations(info)
        bases = np.array([a[0] for a in allocations], dtype=np.int64)
        sizes = np.array([a[1] for a in allocations], dtype=np.int64)
        pid = int(info["pid"]) if isinstance(info.get("pid"), int) else -1
        if info.get("process") == _PROCESS[0]:
            twin = _LIVE.get(name)
            exported = [(e["base"], e["size"]) for e in twin._export()] if twin is not None else None
            if exported != [(base, size) for base, size, _ in allocations]:
                raise TransferError(
                    f"cuda_ipc: peer {name} states this process's id, but no cuda_ipc agent of this "
                    f"process named {name} exports the allocations it lists"
                )
            return _Peer(pid=os.getpid(), bases=bases, sizes=sizes, mapped=bases.copy(), opened=[])
        driver = self._cuda()
        driver.bind(self._spans[0][2])
        opened: list[int] = []
        try:
            for base, size, handle in allocations:
                ptr = driver.open(handle)
                opened.append(ptr)
                start, length = driver.allocation(ptr)
                if start != ptr or length < size:
                    raise TransferError(
                        f"cuda_ipc: peer {name} claims {size} bytes at {base:#x}, but its IPC handle "
                        f"maps {length} bytes here (at {start:#x} for {ptr:#x}); refusing to write there"
                    )
        except TransferError:
            for ptr in opened:
                driver.close(ptr)
            raise
        mapped = np.array(opened, dtype=np.int64)
        return _Peer(pid=pid, bases=bases, sizes=sizes, mapped=mapped, opened=opened)

    def _close_peer(self, name: str) -> None:
        running = False
        for write in list(self._writes):  # a kernel still using the mapping would fault on close
            if write.peer == name and not write.sent and not write.failed:
                if write.event is not None and not _copy_ended(write.event, self.close_wait_s):
                    running = True
                # Its DONE belongs to the agent being closed: sent later, it would reach whatever
                # agent holds the name then (a restarted peer loaded under it), telling that
                # process blocks it never offered were written. The copy ends unreported.
                write.failed = True
                self.counters.writes_failed += 1
                logger.warning(
                    "cuda_ipc: a copy to %s ended after its peer was removed; its DONE is not sent", name
                )
        peer = self._peers.pop(name, None)
        self._blobs.pop(name, None)
        self.fallbacks.pop(name, None)
        for handle, lst in list(self._lists.items()):
            if lst.peer == name:
                self.release_list(handle)
        if peer is not None and peer.opened and running:
            # Closing the mapping under a running kernel faults the process: keep it open.
            self.unclosed += peer.opened
            logger.error(
                "cuda_ipc: a copy to %s still ran %gs after its peer was removed; its %d IPC "
                "mapping(s) stay open (closing them under the kernel would fault): is the GPU hung?",
                name,
                self.close_wait_s,
                len(peer.opened),
            )
        elif peer is not None and peer.opened:
            driver = self._cuda()
            driver.bind(self._spans[0][2])
            for ptr in peer.opened:
                try:
                    driver.close(ptr)
                except TransferError as err:
                    logger.warning("cuda_ipc: closing a handle of %s failed: %s", name, err)

    def remove_peer(self, peer: str) -> None:
        self._close_peer(peer)
        self.inner.remove_peer(peer)

    def fence_peer(self, peer: str) -> None:
        """Close the peer's IPC handles and fence the wrapped transport's connections. A copy
        the peer already launched into this process's memory is a kernel in its process: no
        fence stops it, and neither does its WRITE deadline (see ``writes_abortable``)."""
        self._close_peer(peer)
        self.inner.fence_peer(peer)

    def fenced(self, peer: str) -> bool:
        return bool(self.inner.fenced(peer))

    @property
    def same_host_copies(self) -> bool:
        """The wrapped transport's (IPC copies are answered by ``may_copy_in``)."""
        return bool(getattr(self.inner, "same_host_copies", True))

    @property
    def writes_abortable(self) -> bool:
        """Published in this rank's metadata: False while IPC is on, because a WRITE to a peer
        reached by IPC is a launched kernel that nothing takes back; a D then holds this P's
        failed requests until it acknowledges, instead of fencing and releasing them."""
        return not self.use_ipc

    def abortable(self, handle: Any) -> bool:
        """Whether a posted WRITE can still be taken back (never an IPC kernel copy)."""
        if isinstance(handle, _IpcWrite):
            return False
        inner = getattr(self.inner, "abortable", None)
        return True if inner is None else bool(inner(handle))

    def may_copy_in(self, peer: str) -> bool:
        """Whether ``peer`` may copy into this process's memory with kernels: it runs cuda_ipc
        with IPC on, on this host (conservative: its GPU's reach is not asked)."""
        blob = self._blobs.get(peer)
        if blob is None:
            return False
        _, info = decode_blob(blob)
        return bool(info and info.get("allocations") and info.get("host") == host_identity())

    def ipc_peer(self, peer: str) -> bool:
        """True when WRITEs to ``peer`` go over CUDA IPC."""
        return self.use_ipc and peer in self._peers

    @property
    def all_peers_ipc(self) -> bool:
        """True when at least one peer is loaded and every loaded peer is reached by IPC."""
        return self.use_ipc and bool(self._blobs) and all(name in self._peers for name in self._blobs)

    # ------------------------------------------------------------------ lists

    def _add(self, lst: _List) -> int:
        handle = self._next_list
        self._next_list += 1
        self._lists[handle] = lst
        return handle

    def prepare_local(self, descriptors: np.ndarray, mem_type: MemType) -> int:
        descs = np.asarray(descriptors, dtype=np.uint64).reshape(-1, 3)
        addrs, lens = descs[:, 0].astype(np.int64), descs[:, 1].astype(np.int64)
        return self._add(_List(peer=None, descs=descs, mem_type=mem_type, addrs=addrs, lens=lens))

    def prepare_remote(self, peer: str, descriptors: np.ndarray, mem_type: MemType) -> int:
        descs = np.asarray(descriptors, dtype=np.uint64).reshape(-1, 3)
        lens = descs[:, 1].astype(np.int64)
        target = self._peers.get(peer)
        addrs = target.translate(descs[:, 0], lens) if target is not None else descs[:, 0].astype(np.int64)
        return self._add(_List(peer=peer, descs=descs, mem_type=mem_type, addrs=addrs, lens=lens))

    def _inner_list(self, lst: _List) -> int:
        if lst.inner is None:
            if lst.peer is None:
                lst.inner = self.inner.prepare_local(lst.descs, lst.mem_type)
            else:
                lst.inner = self.inner.prepare_remote(lst.peer, lst.descs, lst.mem_type)
        return lst.inner

    def release_list(self, handle: int) -> None:
        lst = self._lists.pop(handle, None)
        if lst is not None and lst.inner is not None:
            self.inner.release_list(lst.inner)

    # ------------------------------------------------------------------ transfers

    def post_write(
        self,
        local_list: int,
        local_ids: np.ndarray,
        remote_list: int,
        remote_ids: np.ndarray,
        notif: bytes,
    ) -> Any:
        local, remote = self._lists.get(local_list), self._lists.get(remote_list)
        if local is None or remote is None or remote.peer is None:
            raise TransferError("cuda_ipc: post_write names a descriptor list that is not prepared")
        if not (self.ipc_peer(remote.peer) and local.mem_type == "VRAM"):
            return self.inner.post_write(
                self._inner_list(local), local_ids, self._inner_list(remote), remote_ids, notif
            )
        started = time.perf_counter()
        from kvpush.core.kernels import copier_for

        device = int(local.descs[0, 2]) if len(local.descs) else 0
        ltab, rtab = local.device_table(device), remote.device_table(device)
        if ltab.usable and rtab.usable and ltab.length == rtab.length and len(local_ids) == len(remote_ids):
            return self._post_indirect(local, remote, local_ids, remote_ids, notif, device, started)
        lids = np.asarray(local_ids, dtype=np.int64)
        rids = np.asarray(remote_ids, dtype=np.int64)
        lens = local.lens[lids]
        if len(lids) != len(rids) or not np.array_equal(lens, remote.lens[rids]):
            self.counters.writes_failed += 1
            raise TransferError(
                f"cuda_ipc: {len(lids)} local and {len(rids)} remote descriptors differ in count or length"
            )
        try:
            src, dst = local.addrs[lids], remote.addrs[rids]
            indexed = time.perf_counter()
            event = copier_for(device).launch(src, dst, lens)
        except Exception as err:
            self.counters.writes_failed += 1
            raise TransferError(
                f"cuda_ipc: launching the copy of {len(lids)} descriptors failed: {err}"
            ) from err
        write = _IpcWrite(event=event, peer=remote.peer, notif=notif, descriptors=len(lids))
        self._writes.add(write)
        self.counters.writes_posted += 1
        self.ipc_writes += 1
        self.post_seconds[0] += indexed - started
        self.post_seconds[1] += time.perf_counter() - indexed
        return write

    def post_write_grid(
        self, local_list: int, local_ids: IdGrid, remote_list: int, remote_ids: IdGrid, notif: bytes
    ) -> Any:
        """:meth:`post_write` with the ids in factored form (:class:`IdGrid`, optional transport
        method): an IPC copy uploads ``regions + blocks`` ids per side instead of their
        product; anything else expands them and posts as :meth:`post_write`."""
        local, remote = self._lists.get(local_list), self._lists.get(remote_list)
        shape = (len(local_ids.starts), len(local_ids.blocks))
        if (
            local is None
            or remote is None
            or remote.peer is None
            or not (self.ipc_peer(remote.peer) and local.mem_type == "VRAM")
            or shape != (len(remote_ids.starts), len(remote_ids.blocks))
        ):
            return self.post_write(local_list, local_ids.ids(), remote_list, remote_ids.ids(), notif)
        device = int(local.descs[0, 2]) if len(local.descs) else 0
        ltab, rtab = local.device_table(device), remote.device_table(device)
        if not (ltab.usable and rtab.usable and ltab.length == rtab.length):
            return self.post_write(local_list, local_ids.ids(), remote_list, remote_ids.ids(), notif)
        started = time.perf_counter()
        for grid, table in ((local_ids, ltab), (remote_ids, rtab)):
            if len(grid) and (
                int(grid.starts.min()) < 0
                or int(grid.blocks.min()) < 0
                or int(grid.starts.max()) + int(grid.blocks.max()) >= table.count
            ):
                self.counters.writes_failed += 1
                raise TransferError("cuda_ipc: a descriptor id is outside its prepared list")
        checked = time.perf_counter()
        from kvpush.core.kernels import copier_for

        try:
            event = copier_for(device).launch_grid(ltab, rtab, local_ids, remote_ids)
        except Exception as err:
            self.counters.writes_failed += 1
            raise TransferError(
                f"cuda_ipc: launching a copy of {len(local_ids)} descriptors failed: {err}"
            ) from err
        return self._posted(remote.peer, event, notif, len(local_ids), started, checked)

    def _posted(
        self, peer: str, event: Any, notif: bytes, descriptors: int, started: float, checked: float
    ) -> _IpcWrite:
        write = _IpcWrite(event=event, peer=peer, notif=notif, descriptors=descriptors)
        self._writes.add(write)
        self.counters.writes_posted += 1
        self.ipc_writes += 1
        self.post_seconds[0] += checked - started
        self.post_seconds[1] += time.perf_counter() - checked
        return write

    def _post_indirect(
        self,
        local: _List,
        remote: _List,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        notif: bytes,
        device: int,
        started: float,
    ) -> _IpcWrite:
        """Equal-length aligned lists: only the ids travel; the GPU looks the addresses up."""
        from kvpush.core.kernels import copier_for

        lids = np.asarray(local_ids)
        rids = np.asarray(remote_ids)
        if len(lids) and (
            int(lids.min()) < 0
            or int(lids.max()) >= local.table.count
            or int(rids.min()) < 0
            or int(rids.max()) >= remote.table.count
        ):
            self.counters.writes_failed += 1
            raise TransferError("cuda_ipc: a descriptor id is outside its prepared list")
        checked = time.perf_counter()
        try:
            event = copier_for(device).launch_indirect(local.table, remote.table, lids, rids)
        except Exception as err:
            self.counters.writes_failed += 1
            raise TransferError(
                f"cuda_ipc: launching a copy of {len(lids)} descriptors failed: {err}"
            ) from err
        assert remote.peer is not None
        return self._posted(remote.peer, event, notif, len(lids), started, checked)

    def poll(self, handle: Any) -> TransferState:
        if not isinstance(handle, _IpcWrite):
            return self.inner.poll(handle)
        if handle.failed:
            return TransferState.FAILED
        if not handle.sent:
            try:
                if handle.event is not None and not handle.event.query():
                    return TransferState.PENDING
                self.inner.send_notif(handle.peer, handle.notif)
            except Exception as err:
                logger.warning("cuda_ipc: completing a copy to %s failed: %s", handle.peer, err)
                handle.failed = True
                self.counters.writes_failed += 1
                return TransferState.FAILED
            handle.sent = True
        return TransferState.DONE

    def release(self, handle: Any) -> None:
        if isinstance(handle, _IpcWrite):
            if handle in self._writes:
                self._writes.discard(handle)
                self.counters.handles_released += 1
            return
        self.inner.release(handle)

    @property
    def outstanding_handles(self) -> int:
        return len(self._writes) + self.inner.outstanding_handles

    def close(self) -> None:
        for name in list(self._blobs):
            self._close_peer(name)  # waits (bounded) for copies through each peer's mapping
        self._writes.clear()
        for handle in list(self._lists):
            self.release_list(handle)
        self.inner.close()


def _copy_ended(event: Any, timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for a kernel copy's event; False while it still runs."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0002)
    return True


def _create_inner(name: str, config: TransportConfig) -> Any:
    if name == "loopback":  # not registered by default; tests wrap it directly
        from kvpush.transports.loopback import LoopbackTransport

        return LoopbackTransport(config)
    from kvpush.core.manager import get_plugin_manager

    return get_plugin_manager().transport(name).create(config)


@hookimpl
def kvpush_transports() -> list[TransportProvider]:
    return [
        TransportProvider(
            name="cuda_ipc",
            create=CudaIpcTransport,
            description="same-host CUDA IPC: one kernel copies scattered blocks into D's; NIXL otherwise",
        )
    ]


@hookimpl
def kvpush_transfer_strategy(job: PushJob, spec: ReadSpec, num_descriptors: int) -> str | None:
    """``direct`` for a VRAM push while every loaded peer of this rank is reached by IPC."""
    transport = _LIVE.get(job.local.agent_name)
    if transport is None or not job.local.regions or job.local.regions[0].mem_type != "VRAM":
        return None
    return "direct" if transport.all_peers_ipc else None
