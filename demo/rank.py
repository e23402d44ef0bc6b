"""One engine rank in its own process: a P stage/TP rank or a D TP rank, driven over a pipe.

Messages from the parent (tuples): ``("prepare", [(rid, seed, block_ids), ...])`` (P: fill
blocks), ``("finish", rid, block_ids, match_key)`` (P), ``("add", rid, block_ids, params, seed,
position_offset)`` (D), ``("poll",)``, ``("stats",)``, ``("stop",)``. Every message gets one
reply; a failure replies ``("error", traceback)``.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import attrs

from kvpush.core.types import ModelSpec, ParallelConfig, RequestMetadata, TransferParams

SENTINEL = 0x5A5A
"""int16 value D writes into a cancelled or failed request's blocks once they are freed."""
REUSED = 0x3C3C
"""int16 value P writes into a failed request's blocks (``RankSpec.reuse_failed_blocks``)."""


def _rss_mb() -> float:
    """This process's resident memory in MiB (Linux /proc; 0.0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def torch_int16() -> Any:
    import torch

    return torch.int16


@attrs.frozen(kw_only=True)
class RankSpec:
    """Everything a rank process needs to start (picklable)."""

    role: str  # "prefill" or "decode"
    engine_id: str
    parallel: ParallelConfig
    model: ModelSpec
    layout: str
    blocks_per_group: tuple[int, ...]
    device: str = "cpu"
    side_channel_port: int = 0
    request_timeout_s: float = 60.0
    lease_s: float = 60.0
    transport: str = "nixl"
    transport_options: dict[str, Any] = attrs.field(factory=dict, hash=False)
    log_level: str = "WARNING"
    log_file: str | None = None
    """Append the rank's log to this file instead of stderr (the soak reads it back)."""
    worker_options: dict[str, Any] = attrs.field(factory=dict, hash=False)
    """Extra ``WorkerConfig`` fields (e.g. ``heartbeat_interval_s``, ``write_deadline_s``)."""
    strategy: str | None = None
    """Force the transfer strategy (``direct``/``packed``); None: the strategy plugin picks."""
    plugins: tuple[tuple[str, str], ...] = ()
    """Extra plugins as ``(name, "module[:attr]")``, imported and registered in the rank."""
    load_entrypoints: bool = True
    """Load installed plugins (the ``kvpush`` entry points) too."""
    host: str = "127.0.0.1"
    """This rank's engine address: its side channel binds (and D advertises) it."""
    netns: str | None = None
    """Run in this network namespace (the rank's "host"; :mod:`kvpush.demo.netns`)."""
    reuse_failed_blocks: bool = False
    """P: overwrite a request's blocks (with ``REUSED``) as soon as it is reported failed, as an
    engine that gives them to its next prefill would: a WRITE still reading them then would
    carry the wrong bytes to D, and D's check of a request it reports done shows it."""


def plugin_manager(spec: RankSpec) -> Any:
    """The rank's plugin manager: built-ins, ``spec.plugins`` (imported by path), a forced
    strategy, and the installed entry points when ``spec.load_entrypoints``."""
    import importlib

    from kvpush.core.manager import get_plugin_manager

    plugins: list[tuple[str, object]] = []
    for name, path in spec.plugins:
        module, _, attr = path.partition(":")
        plugin: object = importlib.import_module(module)
        for part in filter(None, attr.split(".")):
            plugin = getattr(plugin, part)
        plugins.append((name, plugin))
    if spec.strategy is not None:
        from kvpush.plugins.strategy import ForcedStrategy

        plugins.append(("forced_strategy", ForcedStrategy(spec.strategy)))
    return get_plugin_manager(plugins=plugins, load_entrypoints=spec.load_entrypoints)


def allocate(spec: RankSpec, pm: Any = None) -> dict[str, Any]:
    """Zeroed caches in the rank's layout, from the layout's ``LayoutProvider.allocate``."""
    from kvpush.core.errors import ConfigError

    provider = (pm or plugin_manager(spec)).layout(spec.layout)
    if provider.allocate is None:
        raise ConfigError(
            f"layout {spec.layout!r} offers no LayoutProvider.allocate(model, parallel, "
            f"blocks_per_group, device); the demo and kvpush.testing's cluster need it to allocate caches"
        )
    return dict(provider.allocate(spec.model, spec.parallel, spec.blocks_per_group, spec.device))


def rank_main(spec: RankSpec, conn: Connection) -> None:
    if spec.netns is not None:
        try:
            from kvpush.demo.netns import enter

            enter(spec.netns)  # before any thread starts
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return
    stamp = "%(created).3f" if spec.log_file else "%(asctime)s"  # a file is read back by time
    logging.basicConfig(
        level=os.environ.get("KVPUSH_LOG_LEVEL", spec.log_level),
        format=f"{stamp} {spec.role}{spec.parallel.rank} %(message)s",
        filename=spec.log_file,
    )
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        server = _RankServer(spec)
        conn.send(("ready", server.worker.handshake_payload()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            if not conn.poll(600):
                break  # the parent is gone
            message = conn.recv()
            if message[0] == "stop":
                conn.send(("ok", None))
                break
            try:
                conn.send(("ok", server.handle(message)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        server.worker.close()


class _RankServer:
    def __init__(self, spec: RankSpec) -> None:
        import torch

        from kvpush.core.receiver import PushReceiver
        from kvpush.core.sender import PushSender
        from kvpush.core.worker import WorkerConfig
        from kvpush.demo.content import region_views

        cuda_index = None
        if spec.device.startswith("cuda"):
            cuda_index = torch.device(spec.device).index or 0
            torch.cuda.set_device(cuda_index)
        self.spec = spec
        pm = plugin_manager(spec)
        self.caches = allocate(spec, pm)
        pm.layout(spec.layout).describe(self.caches, spec.parallel, spec.model)  # layout rules, named
        config = WorkerConfig(
            engine_id=spec.engine_id,
            parallel=spec.parallel,
            model=spec.model,
            layout=spec.layout,
            transport=spec.transport,
            transport_options=dict(spec.transport_options),
            side_channel_host=spec.host,
            side_channel_port=spec.side_channel_port,
            request_timeout_s=spec.request_timeout_s,
            lease_s=spec.lease_s,
            **spec.worker_options,
            cuda_device=cuda_index,
        )
        worker_cls = PushSender if spec.role == "prefill" else PushReceiver
        self.worker = worker_cls(config, self.caches, pm=pm)
        self.worker.start()
        assert self.worker.metadata is not None
        self.regions = self.worker.metadata.regions
        self.tensors = region_views(self.caches, self.regions)
        self.expect: dict[str, tuple[int, Any, Any]] = {}
        self.received_bytes: dict[str, int] = {}
        self.freed: dict[str, Any] = {}
        """D: block ids of cancelled/failed requests, filled with SENTINEL once reported."""
        self.named: dict[int, set[int]] = {}
        """D: per KV group, every block id a request added here named (the rest stay zero)."""
        self.finished: dict[str, Any] = {}
        """P: block ids of finished requests not yet reported (``reuse_failed_blocks``)."""

    def handle(self, message: tuple[Any, ...]) -> Any:
        kind = message[0]
        if kind == "prepare":
            from kvpush.demo.content import fill_request

            for _rid, seed, block_ids in message[1]:
                fill_request(self.regions, self.tensors, self.spec.parallel, seed, block_ids)
            self._synchronize()
            return len(message[1])
        if kind == "finish":
            _, rid, block_ids, match_key = message
            if self.spec.reuse_failed_blocks:
                self.finished[rid] = block_ids
            self.worker.request_finished(rid, block_ids, match_key=match_key)
            return None
        if kind == "add":
            _, rid, block_ids, params, seed, offsets = message
            self.expect[rid] = (seed, block_ids, offsets)
            for group, ids in enumerate(block_ids):
                self.named.setdefault(group, set()).update(ids)
            self.worker.add_request(  # offsets: the blocks of D's prefix hit, per group
                RequestMetadata(
                    request_id=rid,
                    block_ids=block_ids,
                    params=TransferParams.from_dict(params),
                    block_start=offsets,
                )
            )
            return None
        if kind == "cancel":
            self.worker.cancel(message[1])
            return None
        if kind == "check_freed":
            return self._check_freed()
        if kind == "check_untouched":
            return self._check_untouched()
        if kind == "scribble":  # the soak's negative control: a late WRITE, simulated
            for block_ids in list(self.freed.values())[: message[1]]:
                for tensor in self.tensors:
                    tensor[block_ids[0][0]].reshape(-1).view(torch_int16()).fill_(7)
            return None
        if kind == "health":
            return self._health()
        if kind == "poll":
            return self._poll()
        if kind == "stats":
            return self._stats()
        raise ValueError(f"unknown message {kind!r}")

    def _synchronize(self) -> None:
        if self.spec.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def _poll(self) -> dict[str, Any]:
        from kvpush.demo.content import verify_request

        results = self.worker.get_finished()
        if self.spec.role == "prefill":
            for rid in results.sent:
                self.finished.pop(rid, None)
            for rid in results.failed:
                block_ids = self.finished.pop(rid, None)
                if block_ids is not None:  # the engine's next prefill writes them now
                    self._fill_blocks(block_ids, REUSED)
            return {"sent": list(results.sent), "failed": dict(results.failed)}
        verified = {}
        self._synchronize()
        for rid in results.done:
            seed, block_ids, offsets = self.expect.pop(rid)
            miss = verify_request(self.regions, self.tensors, self.spec.parallel, seed, block_ids, offsets)
            nbytes = sum(r.block_len * len(block_ids[r.kv_group]) for r in self.regions)
            verified[rid] = {
                "ok": miss is None,
                "miss": miss,
                "bytes": nbytes,
                "t_done": results.completed_at[rid],
            }
        for rid in results.released:
            # The engine frees these blocks now: fill them so a late WRITE would show.
            _seed, block_ids, _offsets = self.expect.pop(rid)
            self.freed[rid] = block_ids
            self._fill_freed(block_ids)
        return {
            "done": verified,
            "failed": dict(results.failed),
            "cancelled": dict(results.cancelled),
            "released": list(results.released),
            "now": time.perf_counter(),
        }

    def _fill_freed(self, block_ids: Any) -> None:
        self._fill_blocks(block_ids, SENTINEL)

    def _fill_blocks(self, block_ids: Any, value: int) -> None:
        for region, tensor in zip(self.regions, self.tensors, strict=True):
            for block in block_ids[region.kv_group]:
                tensor[block].reshape(-1).view(torch_int16()).fill_(value)
        self._synchronize()

    def _check_freed(self) -> dict[str, str]:
        """D: requests whose freed blocks no longer hold the sentinel (a WRITE landed late)."""
        self._synchronize()
        bad = {}
        for rid, block_ids in self.freed.items():
            for region, tensor in zip(self.regions, self.tensors, strict=True):
                for block in block_ids[region.kv_group]:
                    if not bool((tensor[block].reshape(-1).view(torch_int16()) == SENTINEL).all()):
                        bad[rid] = f"block {block} of {region.layer_names[0]} changed after it was freed"
        return bad

    def _check_untouched(self) -> list[str]:
        """D: blocks no request added here ever named that are not zero any more (a WRITE of
        another process's registration, or one at a wrong address, landed in them)."""
        import torch

        self._synchronize()
        bad = []
        for region, tensor in zip(self.regions, self.tensors, strict=True):
            named = self.named.get(region.kv_group, set())
            unnamed = [b for b in range(tensor.shape[0]) if b not in named]
            if unnamed:
                rows = tensor[torch.tensor(unnamed, device=tensor.device)]
                changed = rows.ne(0).any(dim=1).nonzero().flatten().tolist()
                layer = region.layer_names[0]
                bad += [f"block {unnamed[i]} of {layer}, never named, was written" for i in changed]
        return bad[:20]

    def _health(self) -> dict[str, Any]:
        """What is still held: transfer handles, and requests/blocks not released."""
        worker: Any = self.worker
        sizes = worker.call_on_writer(worker.core.state_sizes)  # the core is the writer's
        held = (
            {
                "finished": len(worker.call_on_writer(worker.core.pending_requests)),
                "inflight": sizes["inflight"],
                "stashed_registrations": sizes["stashed"],
                "state": sizes,
            }
            if self.spec.role == "prefill"
            else {"pending": worker.pending_requests, "state": sizes}
        )
        return {
            "outstanding_handles": worker.transport.outstanding_handles,
            **held,
            "stats": dict(worker.stats),
            "rss_mb": _rss_mb(),
        }

    def _stats(self) -> dict[str, Any]:
        worker = self.worker
        assert worker.transport is not None and worker.peers is not None
        return {
            "handshake_ms": worker.peers.handshake_ms,
            "counters": worker.transport.counters.as_dict(),
            "transport": transport_report(worker.transport),
            "stats": dict(worker.stats),
            "dropped_notifications": worker.dropped_notifications,
        }


def transport_report(transport: Any) -> dict[str, Any]:
    """What carried this rank's WRITEs: the transport's name, its inner transport's (a wrapper's),
    and for ``cuda_ipc`` the WRITEs posted as IPC kernel copies and why peers fell back."""
    inner = getattr(transport, "inner", None)
    report: dict[str, Any] = {
        "name": getattr(transport, "name", type(transport).__name__),
        "inner": getattr(inner, "name", None) if inner is not None else None,
    }
    if hasattr(transport, "ipc_writes"):
        report["ipc_writes"] = int(transport.ipc_writes)
        report["fallbacks"] = dict(getattr(transport, "fallbacks", {}))
    return report


def side_channel_main(engine_id: str, host: str, netns: str | None, conn: Connection, port: int = 0) -> None:
    """An engine's side channel in its own process (its scheduler's role), on ``host`` inside
    ``netns``: replies ``("ready", port)``, then serves ``("publish", {rank: payload})`` until
    ``("stop",)`` or the parent is gone."""
    try:
        if netns is not None:
            from kvpush.demo.netns import enter

            enter(netns)
        from kvpush.core.sidechannel import SideChannelServer

        server = SideChannelServer(engine_id, host=host, port=port)
        conn.send(("ready", server.port))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the parent is gone
                break
            if message[0] == "stop":
                conn.send(("ok", None))
                break
            try:
                server.publish_all(message[1])
                conn.send(("ok", None))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        server.close()
