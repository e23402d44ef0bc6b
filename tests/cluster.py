"""An in-process P engine and D engine for tests: every rank is a worker in this process.

With ``transport="loopback"`` it tests pure logic (no NIXL); with ``transport="nixl"`` the same
flows run over real NIXL agents (one per rank, each driven by its own writer thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import kvpush.transports.loopback
from kvpush.core.manager import get_plugin_manager
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ModelSpec, ParallelConfig, RankKey, RequestMetadata, TransferParams
from kvpush.core.worker import RankWorker, WorkerConfig
from kvpush.layouts.uniform import allocate_kv_caches

MHA = ModelSpec(name="test-gqa", num_layers=4, num_kv_heads=4, head_dim=8, block_size=4)
MLA = ModelSpec(name="test-mla", num_layers=4, attention="mla", head_dim=16, block_size=4)


def settle(worker: RankWorker) -> None:
    """Return once the writer has processed everything delivered before this call."""
    worker.call_on_writer(lambda: None)
    worker.call_on_writer(lambda: None)


def attempt_of(receiver: PushReceiver, request_id: str) -> int:
    """The registration attempt D's core gave the engine's request ``request_id`` (stated in its
    PUSH_REG and CANCEL): what a P of this release echoes in each DONE, FAIL and CANCEL_ACK, so
    a test standing in for P injects it too. Read on the writer thread."""
    return receiver.call_on_writer(lambda: receiver.core._requests[receiver._core_id(request_id)].attempt)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.002)


class Cluster:
    def __init__(
        self,
        model: ModelSpec = MHA,
        *,
        prefill_pp: int = 1,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        num_blocks: int = 64,
        transport: str = "loopback",
        device: str = "cpu",
        **config: Any,
    ) -> None:
        self.model = model
        self.prefill_pp, self.prefill_tp, self.decode_tp = prefill_pp, prefill_tp, decode_tp
        self.pm = get_plugin_manager(
            load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback)]
        )
        self.p_server = SideChannelServer("P")
        self.d_server = SideChannelServer("D")
        self.senders: dict[RankKey, PushSender] = {}
        self.receivers: dict[int, PushReceiver] = {}
        self.p_caches: dict[RankKey, dict[str, torch.Tensor]] = {}
        self.d_caches: dict[int, dict[str, torch.Tensor]] = {}
        self.d_results: dict[int, dict[str, Any]] = {}
        self.p_results: dict[RankKey, dict[str, Any]] = {}
        self.released: dict[int, set[str]] = {}
        """D rank -> requests whose blocks it released (after a failure or cancel)."""
        for pp in range(prefill_pp):
            for tp in range(prefill_tp):
                parallel = ParallelConfig.for_stage(
                    num_layers=model.num_layers,
                    pp_size=prefill_pp,
                    pp_rank=pp,
                    tp_size=prefill_tp,
                    tp_rank=tp,
                )
                caches = allocate_kv_caches(model, parallel, num_blocks, device=device)
                for tensor in caches.values():
                    tensor.view(torch.int16).copy_(
                        torch.randint(-30_000, 30_000, tensor.shape, dtype=torch.int16)
                    )
                sender = PushSender(
                    self._config("P", parallel, transport, self.p_server.port, config), caches, pm=self.pm
                )
                sender.start()
                self.p_server.publish(parallel.rank, sender.handshake_payload())
                self.senders[parallel.rank] = sender
                self.p_caches[parallel.rank] = caches
                self.p_results[parallel.rank] = {}
        for tp in range(decode_tp):
            parallel = ParallelConfig(tp_size=decode_tp, tp_rank=tp, num_layers=model.num_layers)
            caches = allocate_kv_caches(model, parallel, num_blocks, device=device)
            receiver = PushReceiver(
                self._config("D", parallel, transport, self.d_server.port, config), caches, pm=self.pm
            )
            receiver.start()
            self.d_server.publish(parallel.rank, receiver.handshake_payload())
            self.receivers[tp] = receiver
            self.d_caches[tp] = caches
            self.d_results[tp] = {}
            self.released[tp] = set()

    def _config(
        self, engine: str, parallel: ParallelConfig, transport: str, port: int, extra: dict[str, Any]
    ) -> WorkerConfig:
        return WorkerConfig(
            engine_id=engine,
            parallel=parallel,
            model=self.model,
            transport=transport,
            side_channel_port=port,
            **extra,
        )

    def params(self, transfer_id: str, **overrides: Any) -> dict[str, Any]:
        params = {
            "remote_engine_id": "P",
            "remote_host": "127.0.0.1",
            "remote_port": self.p_server.port,
            "tp_size": self.prefill_tp,
            "pp_size": self.prefill_pp,
            "transfer_id": transfer_id,
        }
        params.update(overrides)
        return params

    def finish(self, request_id: str, block_ids: Any, key: str) -> None:
        for sender in self.senders.values():
            sender.request_finished(request_id, block_ids, match_key=key)

    def add(
        self,
        request_id: str,
        block_ids: Any,
        key: str,
        ranks: Any = None,
        block_start: Any = None,
        num_tokens: int | None = None,
        **overrides: Any,
    ) -> None:
        params = TransferParams.from_dict(self.params(key, **overrides))
        meta = RequestMetadata(
            request_id=request_id,
            block_ids=block_ids,
            params=params,
            block_start=block_start,
            num_tokens=num_tokens,
        )
        for tp in self.receivers if ranks is None else ranks:
            self.receivers[tp].add_request(meta)

    def poll(self) -> None:
        for tp, receiver in self.receivers.items():
            got = receiver.get_finished()
            self.d_results[tp].update({rid: None for rid in got.done})
            self.d_results[tp].update(got.failed)
            self.d_results[tp].update(got.cancelled)
            self.released[tp].update(got.released)
        for key, sender in self.senders.items():
            got = sender.get_finished()
            self.p_results[key].update({rid: None for rid in got.sent})
            self.p_results[key].update(got.failed)

    def wait_decode(
        self, request_id: str, timeout_s: float = 10.0, ranks: Any = None
    ) -> dict[int, str | None]:
        """Each D rank's outcome for a request: None when done, else the failure reason."""
        wanted = list(self.receivers) if ranks is None else list(ranks)

        def ready() -> bool:
            self.poll()
            return all(request_id in self.d_results[tp] for tp in wanted)

        wait_until(ready, timeout_s, f"D ranks {wanted} to finish {request_id}")
        return {tp: self.d_results[tp][request_id] for tp in wanted}

    def wait_released(self, request_id: str, timeout_s: float = 10.0, ranks: Any = None) -> None:
        wanted = list(self.receivers) if ranks is None else list(ranks)

        def ready() -> bool:
            self.poll()
            return all(request_id in self.released[tp] for tp in wanted)

        wait_until(ready, timeout_s, f"D ranks {wanted} to release {request_id}")

    def wait_prefill(self, request_id: str, timeout_s: float = 10.0) -> dict[RankKey, str | None]:
        def ready() -> bool:
            self.poll()
            return all(request_id in results for results in self.p_results.values())

        wait_until(ready, timeout_s, f"P ranks to report {request_id}")
        return {key: results[request_id] for key, results in self.p_results.items()}

    def close(self) -> None:
        for worker in [*self.senders.values(), *self.receivers.values()]:
            worker.close()
        self.p_server.close()
        self.d_server.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def kv_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)
