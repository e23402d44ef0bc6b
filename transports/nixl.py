"""The NIXL transport plugin (UCX backend by default).

Options (``TransportConfig.options``):

- ``backends`` (list, default ``["UCX"]``)
- ``progress_thread`` (bool, default False): NIXL's progress thread spins a whole core; the
  writer thread polls instead.
- ``ucx_error_handling_mode`` (``"none"`` default, or ``"peer"``): ``none`` cuts notification
  round trips to ~10 µs on loopback and still reports dead peers.
- ``num_threads`` (int, default 0): UCX worker threads.
- ``ucx_tls`` (str or list, default unset: UCX's own choice, or ``UCX_TLS`` from the
  environment): the UCX transports this agent may use, e.g. ``"tcp"`` or ``["tcp", "cma"]``
  (``UCX_TLS`` semantics, ``^`` excludes). Use ``tcp`` (plus ``rc``/``cuda_ipc`` where they
  apply) when P and D are on different hosts *or* in containers/namespaces that share
  ``/dev/shm``: UCX otherwise picks shared memory for notifications between "hosts" that only
  look local (issue 12).
- ``ucx_net_devices`` (str or list, default unset: every device): the network devices UCX may
  use (``UCX_NET_DEVICES``, e.g. ``"eth1"`` or ``"mlx5_0:1"``). With ``tcp`` this also restricts
  UCX's per-agent TCP listener to that interface's address. (NIXL 1.5.1's own UCX parameters do
  not do this for Ethernet: ``ucx_devices`` left the listener on every interface here, and
  ``device_list`` appends ``:1`` to each name, so ``eth1`` fails with "No such device".)
- ``ucx_tcp_port_range`` (str ``"LOW-HIGH"``, default unset: any port): the ports UCX's TCP
  listeners take (``UCX_TCP_PORT_RANGE``), so a firewall can allow them.
- ``ucx_env`` (dict, default empty): any other ``UCX_*`` variables for this agent.
  ``UCX_TCP_CONN_NB`` defaults to ``y`` here (UCX's own default is a blocking connect, which
  held the writer thread ~2 minutes in the kernel's SYN retries when a peer was unreachable);
  set it in ``ucx_env`` or the environment to choose otherwise.

The ``UCX_*`` settings are put in the environment only while the backend is created (UCX reads
its configuration then) and restored afterwards, so agents in one process can differ.

Fencing (:meth:`NixlTransport.fence_peer`): removing a NIXL agent does not close UCX's TCP
connection to it, and UCX over TCP copies a WRITE's bytes into memory as it reads them. So the
metadata carries this agent's UCX TCP listeners, and a fence shuts down every connection to the
peer's listeners and from its addresses into ours (:mod:`kvpush.transports.tcp_fence`), and
every one opened until it is confirmed (the peer's UCX and ours both reconnect); bytes the peer
queued before are then refused by the kernel. Over RDMA (untested here), destroying the endpoint
is the fence (there are no sockets to shut).

NIXL is imported only when a transport is created, never at plugin import.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvpush.core.errors import ConfigError, TransferError
from kvpush.core.markers import hookimpl
from kvpush.core.transport import TransferState, TransportConfig, TransportCounters
from kvpush.core.types import KVRegion, MemType, TransportProvider
from kvpush.transports import tcp_fence
from kvpush.transports.framing import frame, unframe

logger = logging.getLogger(__name__)

LOCAL_AGENT = "NIXL_INIT_AGENT"
MAGIC = b"KVPNIXL1\0"
PEER_LISTENERS_KEPT = 4096
"""Removed peers whose listeners are remembered, so a fence can still find their sockets."""
MAX_LISTENERS_PER_PEER = 64
"""Listeners remembered per peer name across restarts (oldest dropped first)."""
REFENCE_S = 1.0
"""A fenced socket still open after this long is shut down again (and logged)."""


def _merge_spans(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge overlapping ``(start, end, device)`` spans per device.

    Spans that merely touch stay separate: two tensors can be adjacent in virtual memory yet
    come from different device allocations, and one registration across an allocation
    boundary fails on CUDA IPC ("Input/output error" at the first post).
    """
    merged: list[tuple[int, int, int]] = []
    for start, end, device in sorted(spans, key=lambda s: (s[2], s[0])):
        if merged and merged[-1][2] == device and start < merged[-1][1]:
            last = merged[-1]
            merged[-1] = (last[0], max(last[1], end), device)
        else:
            merged.append((start, end, device))
    return merged


ERROR_MODES = ("none", "peer")
KNOWN_OPTIONS = (
    "backends",
    "progress_thread",
    "ucx_error_handling_mode",
    "num_threads",
    "ucx_tls",
    "ucx_net_devices",
    "ucx_tcp_port_range",
    "ucx_env",
)


def _name_list(options: dict[str, Any], key: str) -> str | None:
    """A comma-separated UCX list from a string or a list of names (``ConfigError`` if neither)."""
    value = options.get(key)
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else value
    if (
        isinstance(names, (bytes, dict))
        or not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(n, str) and n.strip() and "," not in n for n in names)
    ):
        raise ConfigError(
            f"nixl option {key!r} must be a comma-separated string or a list of names, got {value!r}"
        )
    return ",".join(n.strip() for n in names)


def ucx_settings(options: Any) -> dict[str, str]:
    """The ``UCX_*`` environment for the UCX options of ``TransportConfig.options``."""
    options = dict(options)
    env: dict[str, str] = {}
    extra = options.get("ucx_env", {}) or {}
    if not isinstance(extra, dict) or not all(
        isinstance(k, str) and k.startswith("UCX_") and isinstance(v, str) for k, v in extra.items()
    ):
        raise ConfigError(f"nixl option 'ucx_env' must map UCX_* names to strings, got {extra!r}")
    env.update(extra)
    tls = _name_list(options, "ucx_tls")
    if tls is not None:
        env["UCX_TLS"] = tls
    port_range = options.get("ucx_tcp_port_range")
    if port_range is not None:
        low, _, high = str(port_range).partition("-")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) <= 65535):
            raise ConfigError(
                f"nixl option 'ucx_tcp_port_range' must be 'LOW-HIGH' with 0 < LOW <= HIGH <= 65535, "
                f"got {port_range!r}"
            )
        env["UCX_TCP_PORT_RANGE"] = f"{int(low)}-{int(high)}"
    devices = _name_list(options, "ucx_net_devices")
    if devices is not None:
        env["UCX_NET_DEVICES"] = devices
    return env


NETWORK_ONLY_TLS = frozenset(
    {
        "tcp",
        "self",
        "cuda_copy",
        "rocm_copy",
        "ze_copy",
        "ib",
        "rc",
        "rc_v",
        "rc_x",
        "rc_verbs",
        "rc_mlx5",
        "ud",
        "ud_v",
        "ud_x",
        "ud_verbs",
        "ud_mlx5",
        "dc",
        "dc_x",
        "dc_mlx5",
    }
)
"""UCX transports that reach another process only through a connection (or stay in this
process); any other name (``sm``, ``shm``, ``posix``, ``sysv``, ``cma``, ``knem``, ``xpmem``,
``cuda_ipc``, ``all``, an alias, a negated list) may let a same-host peer copy in by itself."""


def ucx_takes_same_host_copies(tls: str | None) -> bool:
    """Whether UCX with ``UCX_TLS=tls`` (None: not set, UCX's default of all) may take copies a
    process on this host makes into this process's memory by itself (conservative)."""
    if not tls or tls.startswith("^"):
        return True
    names = {name.strip().split(":")[0] for name in tls.split(",") if name.strip()}
    return not names or not names <= NETWORK_ONLY_TLS


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` for the duration of the block, then restore what was there."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _parse_options(options: Any) -> tuple[list[str], bool, str, int]:
    """Validate ``TransportConfig.options`` before any agent is created (``ConfigError``)."""
    options = dict(options)
    ucx_settings(options)
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown nixl transport options {unknown}; known options are {list(KNOWN_OPTIONS)}"
        )
    backends = options.get("backends", ["UCX"])
    if isinstance(backends, str) or not all(isinstance(b, str) and b for b in backends):
        raise ConfigError(f"nixl option 'backends' must be a list of backend names, got {backends!r}")
    err_mode = options.get("ucx_error_handling_mode", "none")
    if err_mode not in ERROR_MODES:
        raise ConfigError(
            f"nixl option 'ucx_error_handling_mode' must be one of {ERROR_MODES}, got {err_mode!r}"
        )
    num_threads = options.get("num_threads", 0)
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 0:
        raise ConfigError(f"nixl option 'num_threads' must be an int >= 0, got {num_threads!r}")
    return list(backends), bool(options.get("progress_thread", False)), err_mode, num_threads


class NixlTransport:
    """A :class:`kvpush.core.transport.Transport` on one ``nixl_agent``."""

    name = "nixl"

    def __init__(self, config: TransportConfig) -> None:
        # NIXL logs INFO lines to stdout by default, which would corrupt `--json` output.
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ConfigError(
                f"the nixl transport needs the 'nixl' package (pip install 'nixl==1.5.1'): {err}"
            ) from err
        logging.getLogger("nixl").setLevel(logging.WARNING)
        backends, progress, err_mode, num_threads = _parse_options(config.options)
        ucx_env = ucx_settings(config.options)
        self._agent = nixl_agent(
            config.agent_name, nixl_agent_config(enable_prog_thread=progress, backends=[])
        )
        listeners_before = tcp_fence.own_listeners() if tcp_fence.supported() else set()
        for backend in backends:
            params: dict[str, str] = {}
            env: dict[str, str] = {}
            if backend == "UCX":
                params["ucx_error_handling_mode"] = err_mode
                if num_threads:
                    params["num_threads"] = str(num_threads)
                env = dict(ucx_env)
                if "UCX_TCP_CONN_NB" not in os.environ:
                    # UCX connects over TCP blocking by default: a load_peer (on the writer
                    # thread) of an unreachable peer sat in the kernel's SYN retries (~2 min),
                    # and every request of the rank with it, again at each reconnect attempt.
                    env.setdefault("UCX_TCP_CONN_NB", "y")
            try:
                with _environment(env):
                    self._agent.create_backend(backend, params)
            except Exception as err:  # nixlNotFoundError (no such plugin), nixlBackendError, ...
                raise ConfigError(
                    f"NIXL could not create backend {backend!r} with {params}"
                    f"{f' and environment {env}' if env else ''}: {type(err).__name__}: "
                    f"{err}; available plugins: {sorted(self._agent.get_plugin_list())}"
                ) from err
        self._agent_name = config.agent_name
        self.same_host_copies = ucx_takes_same_host_copies(ucx_env.get("UCX_TLS", os.environ.get("UCX_TLS")))
        """Whether a peer process on this host may copy into this agent's memory by itself
        (UCX shared memory, CMA, CUDA IPC: no connection carries it, so no fence stops it). D
        then holds a same-host P's failed requests until it acknowledges or exits."""
        self._tcp_listeners = sorted(
            (tcp_fence.own_listeners() - listeners_before) if tcp_fence.supported() else set()
        )
        """UCX's TCP listeners of this agent (published, so a peer can fence its connections)."""
        self._peer_listeners: dict[str, list[tuple[str, int]] | None] = {}
        self._loaded_listeners: dict[str, list[tuple[str, int]] | None] = {}
        """Loaded peer -> the listeners its latest load published (a fence's refusal turns
        allow-only past the filter's size, and then takes exactly these)."""
        self._fences: dict[str, _Fence] = {}
        """Peer -> its latest fence."""
        self._drains = 0
        self._blob = self._agent.get_agent_metadata()
        self._registrations: list[Any] = []
        self._lists: set[int] = set()
        self._remote_lists: dict[str, set[int]] = {}
        self._peers: set[str] = set()
        self._unremoved: set[str] = set()
        """Peers whose agent NIXL failed to remove: their endpoints may still carry data (over
        RDMA removing the agent is the whole fence), so a fence of them is not confirmed."""
        self._handles: set[int] = set()
        self.counters = TransportCounters()

    @property
    def agent_name(self) -> str:
        return self._agent_name

    def metadata(self) -> bytes:
        return frame(MAGIC, {"tcp_listeners": [list(a) for a in self._tcp_listeners]}, self._blob)

    # ------------------------------------------------------------------ memory

    def register_regions(self, regions: Sequence[KVRegion]) -> None:
        by_mem: dict[str, list[tuple[int, int, int]]] = {}
        for region in regions:
            by_mem.setdefault(region.mem_type, []).append(
                (region.base_addr, region.end_addr, region.device_id)
            )
        for mem_type, spans in by_mem.items():
            merged = _merge_spans(spans)
            self._register(np.array([(s, e - s, d) for s, e, d in merged], dtype=np.uint64), mem_type)

    def register_buffer(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None:
        self._register(np.array([(addr, length, device_id)], dtype=np.uint64), mem_type)

    def _register(self, descs: np.ndarray, mem_type: str) -> None:
        reg = self._agent.get_reg_descs(descs, mem_type)
        result = self._agent.register_memory(reg)
        if result is None:
            raise TransferError(f"NIXL refused to register {len(descs)} {mem_type} spans")
        self._registrations.append(result)
        self._blob = self._agent.get_agent_metadata()

    def prepare_local(self, descriptors: np.ndarray, mem_type: MemType) -> int:
        handle = self._agent.prep_xfer_dlist(LOCAL_AGENT, descriptors, mem_type)
        self._lists.add(handle)
        self.counters.local_lists_prepared += 1
        return handle

    # ------------------------------------------------------------------ peers

    def load_peer(self, blob: bytes) -> str:
        inner, info = unframe(MAGIC, blob, "nixl")
        try:
            name = self._agent.add_remote_agent(inner)
        except Exception as err:
            raise TransferError(f"NIXL could not load a peer agent: {err}") from err
        name = name.decode() if isinstance(name, bytes) else str(name)
        # Keep the listeners of earlier loads under this name too: a restarted peer reuses its
        # name, and the old process's connections (bytes its kernel still holds) must be fenced.
        earlier = self._peer_listeners.pop(name, None)
        listeners = _listeners(info)
        # None: it published none (an earlier release) or one a filter cannot name: while it
        # is loaded, no listener may take only the loaded peers' connection requests.
        known = listeners is not None and tcp_fence.refusable(listeners)[1]
        self._loaded_listeners[name] = list(listeners or ()) if known else None
        if tcp_fence.supported() and (listeners or not known) and self._tcp_listeners:
            # Loaded again: its connections are accepted again (an earlier fence refused them).
            # Only the listeners this load publishes: a restarted peer's old ones stay refused.
            tcp_fence.admit(listeners, self._tcp_listeners, loaded=self._loaded())
        if listeners is not None and earlier:
            listeners = list(dict.fromkeys(earlier + listeners))[-MAX_LISTENERS_PER_PEER:]
        self._peer_listeners[name] = listeners
        while len(self._peer_listeners) > PEER_LISTENERS_KEPT:
            oldest = next(iter(self._peer_listeners))
            if oldest in self._peers:
                break
            del self._peer_listeners[oldest]
        self._unremoved.discard(name)  # loaded afresh under the name
        if name not in self._peers:
            self._peers.add(name)
            self.counters.peers_loaded += 1
        return name

    def _loaded(self) -> list[tuple[str, int]] | None:
        """The listeners of every peer loaded now (their latest loads), and this agent's own
        (UCX connects an agent to itself: those requests name its own listeners); None while a
        loaded peer's are unknown (its connection requests cannot be told apart)."""
        if any(listeners is None for listeners in self._loaded_listeners.values()):
            return None
        loaded = [a for listeners in self._loaded_listeners.values() for a in listeners or ()]
        return loaded + list(self._tcp_listeners)

    def remove_peer(self, peer: str) -> None:
        self._loaded_listeners.pop(peer, None)
        for handle in self._remote_lists.pop(peer, set()):
            self.release_list(handle)
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as err:  # the peer may already be gone, or its endpoints not
                logger.warning("removing NIXL peer %s failed: %s", peer, err)
                self._unremoved.add(peer)
            self.counters.peers_removed += 1

    def fence_peer(self, peer: str) -> None:
        """Remove ``peer`` and shut down every TCP connection that can carry its data here."""
        try:
            self._fence_peer(peer)
        except OSError as err:
            # This process's sockets could not be read (EMFILE: the fd table is full): nothing
            # is known to be shut or refused. Never confirmed, like a refusal that failed.
            logger.error(
                "fencing %s: this process's sockets cannot be read (%s); the fence will not be "
                "confirmed and the blocks waiting on it stay held",
                peer,
                err,
            )
            self.counters.fences_unconfirmable += 1
            self._fences[peer] = _Fence([], self._drains, time.monotonic(), True)

    def _fence_peer(self, peer: str) -> None:
        self.remove_peer(peer)
        inodes: list[int] = []
        refusal_failed = False
        if tcp_fence.supported():
            listeners = self._peer_listeners.get(peer)
            if listeners is None and self._tcp_listeners:
                # A peer that published no listeners (an older release): its connections cannot
                # be told apart, so every connection into ours is shut (others reconnect), and
                # its connection requests cannot be refused.
                refusal_failed = True
            elif listeners and self._tcp_listeners:
                refusal_failed = not tcp_fence.refuse(listeners, self._tcp_listeners, loaded=self._loaded())
            if refusal_failed:
                # The peer's UCX reconnects by itself once its connection is shut, and sends what
                # it queued on the new one: without the refusal nothing stops that, however
                # long after the shut sockets drained. The fence is never confirmed.
                logger.error(
                    "fencing %s: its UCX connection requests cannot be refused (published "
                    "listeners %s, ours %s); the fence will not be confirmed and the blocks "
                    "waiting on it stay held",
                    peer,
                    listeners,
                    self._tcp_listeners,
                )
                self.counters.fences_unconfirmable += 1
            found = tcp_fence.peer_sockets(listeners, self._tcp_listeners)
            inodes = tcp_fence.shut_down(s.inode for s in found)
            if inodes:
                logger.info(
                    "fenced %s: shut down %d TCP connection(s) %s",
                    peer,
                    len(inodes),
                    [f"{s.local[1]}->{s.remote[0]}:{s.remote[1]}" for s in found],
                )
        self._fences[peer] = _Fence(inodes, self._drains, time.monotonic(), refusal_failed)

    def fenced(self, peer: str) -> bool:
        """:meth:`_fenced`; False (not yet) while this process's sockets cannot be read, or
        while NIXL has not removed the peer's agent (tried again here)."""
        if peer in self._unremoved:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as err:
                logger.debug("fence of %s: removing its agent failed again: %s", peer, err)
                return False
            self._unremoved.discard(peer)
        try:
            return self._fenced(peer)
        except OSError as err:
            logger.debug("fence of %s: this process's sockets cannot be read (%s); not confirmed", peer, err)
            return False

    def _fenced(self, peer: str) -> bool:
        """True once nothing ``peer`` sent before its latest :meth:`fence_peer` can still be
        read: every socket that fence shut is closed or drained, and UCX progressed since.

        A connection the peer opened into our listeners before the fence may still wait in the
        kernel's accept queue (UCX accepts only when this process progresses it): it has no fd
        then, so the fence could not shut it, and the peer's WRITE goes out on it once UCX
        accepted it. Until the fence is confirmed, such connections hold it, and each inbound
        connection of the peer accepted since is shut as well (the cost: a connection the peer
        opens for new work meanwhile is shut too, and it reconnects).

        This process's own UCX reconnects too: an endpoint to the peer that was still setting up
        its connection when the fence shut it opens a new one to the peer's listener at once
        (outbound: no refusal sees it), whether or not the peer's agent is loaded, and a peer
        still waiting for our acknowledgement takes it as a simultaneous connection and sends
        its queued WRITE on it (where our address is the lower; the whole 64 MiB landed after a
        confirmed fence, ``test_a_connection_d_reopens_to_p_after_the_fence_is_fenced_too``). So
        each connection to the peer's listeners opened since is shut as well, and the fence is
        confirmed only once this process holds no connection to or from the peer but the shut
        ones, drained, after UCX progressed: no endpoint of ours is then left setting one up."""
        entry = self._fences.get(peer)
        if entry is None:
            return peer not in self._peers
        if entry.confirmed:
            return True
        if entry.refusal_failed:
            return False
        if self._drains <= entry.drains:
            return False
        if tcp_fence.supported():
            listeners = self._peer_listeners.get(peer)
            table = tcp_fence.sockets()
            late = [
                s.inode
                for s in tcp_fence.peer_sockets(listeners, self._tcp_listeners, table)
                if s.inode not in entry.inodes
            ]
            if late:
                shut = tcp_fence.shut_down(late)
                logger.info("fence of %s: shut down %d connection(s) opened since", peer, len(shut))
                entry.inodes.extend(late)
                entry.drains = self._drains  # UCX must progress once more after these
                return False
            if tcp_fence.waiting_connections(listeners, self._tcp_listeners, table):
                return False
        if tcp_fence.fence_complete(entry.inodes):
            entry.confirmed = True
            return True
        if time.monotonic() - entry.when >= REFENCE_S:  # the same sockets again
            logger.warning(
                "fence of %s: %d socket(s) still open after %.1fs; shutting them again",
                peer,
                len(entry.inodes),
                time.monotonic() - entry.when,
            )
            tcp_fence.shut_down(entry.inodes)
            entry.when = time.monotonic()
        return False

    def prepare_remote(self, peer: str, descriptors: np.ndarray, mem_type: MemType) -> int:
        try:
            handle = self._agent.prep_xfer_dlist(peer, descriptors, mem_type)
        except Exception as err:
            raise TransferError(
                f"NIXL could not prepare {len(descriptors)} descriptors of peer {peer}: {err}"
            ) from err
        self._lists.add(handle)
        self._remote_lists.setdefault(peer, set()).add(handle)
        self.counters.remote_lists_prepared += 1
        return handle

    def release_list(self, handle: int) -> None:
        if handle in self._lists:
            self._lists.discard(handle)
            for lists in self._remote_lists.values():  # forget it: released lists must not pile up
                lists.discard(handle)
            try:
                self._agent.release_dlist_handle(handle)
            except Exception as err:
                logger.warning("releasing NIXL descriptor list failed: %s", err)

    # ------------------------------------------------------------------ transfers

    def post_write(
        self,
        local_list: int,
        local_ids: np.ndarray,
        remote_list: int,
        remote_ids: np.ndarray,
        notif: bytes,
    ) -> int:
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", local_list, local_ids, remote_list, remote_ids, notif
            )
            state = self._agent.transfer(handle)
        except Exception as err:
            if handle is not None:
                self._release_quietly(handle)
            self.counters.writes_failed += 1
            raise TransferError(
                f"NIXL WRITE of {len(local_ids)} descriptors failed: {err}",
                maybe_sent=handle is not None,  # nothing goes out before transfer() is called
            ) from err
        self._handles.add(handle)
        self.counters.writes_posted += 1
        if state == "ERR":
            self.counters.writes_failed += 1
            self.release(handle)
            raise TransferError(f"NIXL WRITE of {len(local_ids)} descriptors was refused (ERR)")
        return handle

    def poll(self, handle: int) -> TransferState:
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as err:
            logger.warning("NIXL transfer failed while polling: %s", err)
            return TransferState.FAILED
        if state == "DONE":
            return TransferState.DONE
        if state == "PROC":
            return TransferState.PENDING
        return TransferState.FAILED

    def release(self, handle: int) -> None:
        if handle in self._handles:
            self._handles.discard(handle)
            self._release_quietly(handle)
            self.counters.handles_released += 1

    def _release_quietly(self, handle: int) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as err:
            logger.warning("releasing a NIXL transfer handle failed: %s", err)

    @property
    def outstanding_handles(self) -> int:
        return len(self._handles)

    # ------------------------------------------------------------------ notifications

    def send_notif(self, peer: str, message: bytes) -> None:
        try:
            self._agent.send_notif(peer, message)
        except Exception as err:
            raise TransferError(f"NIXL notification to {peer} failed: {err}") from err
        self.counters.notifs_sent += 1

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        self._drains += 1
        out = []
        for peer, messages in self._agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((name, m) for m in messages)
        self.counters.notifs_received += len(out)
        return out

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        for handle in list(self._handles):
            self.release(handle)
        for peer in list(self._peers):
            self.remove_peer(peer)
        for handle in list(self._lists):
            self.release_list(handle)
        for reg in self._registrations:
            try:
                self._agent.deregister_memory(reg)
            except Exception as err:
                logger.warning("deregistering NIXL memory failed: %s", err)
        self._registrations.clear()


class _Fence:
    """A peer's latest fence: the sockets it shut, UCX's drain count when it last shut any, when
    it last shut them, whether it was confirmed (then it stays so), and whether the peer's
    connection requests could not be refused (then it is never confirmed)."""

    __slots__ = ("confirmed", "drains", "inodes", "refusal_failed", "when")

    def __init__(self, inodes: list[int], drains: int, when: float, refusal_failed: bool = False) -> None:
        self.inodes = inodes
        self.drains = drains
        self.when = when
        self.confirmed = False
        self.refusal_failed = refusal_failed


def _listeners(info: dict[str, Any] | None) -> list[tuple[str, int]] | None:
    """The peer's published UCX TCP listeners; None for a peer that published none."""
    if info is None or not isinstance(info.get("tcp_listeners"), list):
        return None
    if len(info["tcp_listeners"]) > MAX_LISTENERS_PER_PEER:
        raise TransferError(
            f"nixl peer metadata: {len(info['tcp_listeners'])} TCP listeners published, at most "
            f"{MAX_LISTENERS_PER_PEER}"
        )
    out = []
    for entry in info["tcp_listeners"]:
        if (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and len(entry[0]) <= 64
            and type(entry[1]) is int
            and 0 < entry[1] < 65536
        ):
            out.append((entry[0], entry[1]))
        else:
            raise TransferError(f"nixl peer metadata: a TCP listener must be [host, port], got {entry!r}")
    return out


@hookimpl
def kvpush_transports() -> list[TransportProvider]:
    return [
        TransportProvider(
            name="nixl",
            create=NixlTransport,
            description="NIXL one-sided WRITEs with notifications (UCX backend)",
        )
    ]
