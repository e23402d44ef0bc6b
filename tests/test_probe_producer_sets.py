"""Who D waits for, and what it assumes of them: probes of the producer set (helper "producers").

D waits for every producer ``kvpush_expected_producers`` names from P's published config, and
what it knows of each (its agent, incarnation, share, whether a fence stops its WRITEs) must
come from that producer's own metadata, checked in the handshake that D registers with.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch
from cluster import MHA, kv_bytes, wait_until
from rank_engines import Engines

import kvpush.transports.loopback
from kvpush.core.manager import get_plugin_manager
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ParallelConfig, RankKey, RequestMetadata, TransferParams
from kvpush.core.worker import WorkerConfig
from kvpush.demo.rank import RankSpec
from kvpush.layouts.uniform import allocate_kv_caches

# ------------------------------------------------------------------ one producer speaks for all

TIMINGS: dict[str, Any] = {
    "request_timeout_s": 1.0,
    "heartbeat_interval_s": 0.2,
    "peer_silence_s": 1.0,
    "write_deadline_s": 1.0,
}
NETWORK_ONLY = {"ucx_tls": "tcp"}
"""UCX over TCP alone: a peer on this host cannot copy into D's memory through UCX, so D's
transport says ``same_host_copies`` False and D relies on what P publishes."""


class _MixedCopies(Engines):
    """P PP2: stage 0 posts WRITEs a fence stops (NIXL), stage 1 copies with kernels that nothing
    stops (``kernel_copies``, as ``cuda_ipc``), stalled for ``stall_s``. Both publish it."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        super().__init__(
            prefill_pp=2,
            transport="faulty",
            transport_options={"inner": "nixl", "inner_options": NETWORK_ONLY},
            request_timeout_s=TIMINGS["request_timeout_s"],
            **{k: v for k, v in TIMINGS.items() if k != "request_timeout_s"},
        )

    def _start(self, specs: list[RankSpec], server: SideChannelServer) -> list[Any]:
        if specs and specs[0].role == "prefill":
            stalled = {"kernel_copies": True, "slow_writes": 1.0, "write_delay_s": self.stall_s}
            specs = [
                attrs.evolve(s, transport_options={**s.transport_options, **stalled})
                if s.parallel.pp_rank == 1
                else s
                for s in specs
            ]
            self.p_specs = specs
        return super()._start(specs, server)


def test_a_stage_whose_copies_no_fence_stops_holds_d_blocks_though_stage_0_says_abortable() -> None:
    """Stage 0 publishes ``writes_abortable: true``, stage 1 ``false``. Stage 1's copy stalls
    past D's watchdog; D fails the request and must hold its blocks until stage 1 says the copy
    ended (or its process exited): a fence does not stop a kernel copy."""
    stall_s = 8.0
    with _MixedCopies(stall_s) as engines:
        engines.plan("a", [1, 2], [3, 4])
        engines.add("a")
        started = time.monotonic()
        engines.finish("a")
        engines.wait_decode(["a"], timeout_s=10)
        ((kind, reason),) = engines.decode_outcome("a").values()
        assert kind == "failed", (kind, reason)
        engines.wait_released(["a"], timeout_s=stall_s + 10)
        released_after = time.monotonic() - started
        assert released_after >= stall_s, (
            f"D released the blocks {released_after:.1f}s in, while stage 1's kernel copy (stalled "
            f"{stall_s:g}s) could still land in them"
        )


# ------------------------------------------------------------------ a partial, stale view


class _Engines:
    """P and D ranks in this process over the loopback transport, with P's side channel under
    the test's control: which P ranks run and what each rank's slot serves."""

    def __init__(self) -> None:
        self.pm = get_plugin_manager(
            load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback)]
        )
        self.p_server, self.d_server = SideChannelServer("P"), SideChannelServer("D")
        self.senders: dict[tuple[int, RankKey], PushSender] = {}
        self.p_caches: dict[tuple[int, RankKey], dict[str, torch.Tensor]] = {}
        self.receivers: dict[int, PushReceiver] = {}
        self.d_caches: dict[int, dict[str, torch.Tensor]] = {}
        for tp in range(2):
            parallel = ParallelConfig(tp_size=2, tp_rank=tp, num_layers=MHA.num_layers)
            caches = allocate_kv_caches(MHA, parallel, 16)
            receiver = PushReceiver(self._config("D", parallel, self.d_server.port), caches, pm=self.pm)
            receiver.start()
            self.d_server.publish(parallel.rank, receiver.handshake_payload())
            self.receivers[tp], self.d_caches[tp] = receiver, caches

    def _config(self, engine: str, parallel: ParallelConfig, port: int) -> WorkerConfig:
        return WorkerConfig(
            engine_id=engine,
            parallel=parallel,
            model=MHA,
            transport="loopback",
            side_channel_port=port,
            request_timeout_s=8.0,
            staging_bytes=0,
        )

    def start_p(self, gen: int, tp_size: int, pp: int, tp: int) -> None:
        """Start P rank (pp, tp) of a PP2 engine of TP ``tp_size`` and serve it in its slot."""
        parallel = ParallelConfig.for_stage(
            num_layers=MHA.num_layers, pp_size=2, pp_rank=pp, tp_size=tp_size, tp_rank=tp
        )
        caches = allocate_kv_caches(MHA, parallel, 16)
        for tensor in caches.values():
            tensor.view(torch.int16).copy_(torch.randint(-30_000, 30_000, tensor.shape, dtype=torch.int16))
        sender = PushSender(self._config("P", parallel, self.p_server.port), caches, pm=self.pm)
        sender.start()
        self.p_server.publish(parallel.rank, sender.handshake_payload())
        self.senders[(gen, parallel.rank)], self.p_caches[(gen, parallel.rank)] = sender, caches

    def stop_p(self, gen: int, rank: RankKey) -> None:
        self.senders.pop((gen, rank)).close()

    def add(self, rid: str, key: str, blocks: list[int]) -> None:
        params = TransferParams.from_dict(
            {
                "remote_engine_id": "P",
                "remote_host": "127.0.0.1",
                "remote_port": self.p_server.port,
                "transfer_id": key,
            }
        )
        for receiver in self.receivers.values():
            receiver.add_request(RequestMetadata(request_id=rid, block_ids=(tuple(blocks),), params=params))

    def outcome(self, rid: str, timeout_s: float = 20.0) -> dict[int, str | None]:
        got: dict[int, str | None] = {}

        def ended() -> bool:
            for tp, receiver in self.receivers.items():
                finished = receiver.get_finished()
                if rid in finished.failed:
                    got[tp] = finished.failed[rid]
                if rid in finished.done:
                    got[tp] = None
            return len(got) == len(self.receivers)

        wait_until(ended, timeout_s, f"both D ranks to end {rid}")
        return got

    def close(self) -> None:
        for worker in [*self.senders.values(), *self.receivers.values()]:
            worker.close()
        self.p_server.close()
        self.d_server.close()


def test_a_refused_mix_leaves_no_stale_rank_to_compute_the_next_producer_set_from() -> None:
    """P PP2 is restarted from TP1 to TP2 one rank at a time. D rank 1 (of TP2) handshakes
    while stage 0 is still TP1 and stage 1 already TP2: refused (rightly). Once every P rank
    runs TP2, D rank 1 must wait for exactly the TP2 producers that write its heads, (0, 1)
    and (1, 1), as the handshake that checked them says."""
    engines = _Engines()
    try:
        engines.start_p(0, 1, 0, 0)  # old stage 0 (TP1)
        engines.start_p(1, 2, 1, 0)  # new stage 1, TP rank 0 (TP2)
        engines.add("r1", "k1", [1, 2])
        first = engines.outcome("r1")
        assert all(first.values()), first  # a mix of TP sizes: refused on both D ranks
        engines.stop_p(0, RankKey(0, 0))
        for pp, tp in [(0, 0), (0, 1), (1, 1)]:
            engines.start_p(1, 2, pp, tp)
        time.sleep(1.2)  # the failed engine's backoff
        for (gen, _rank), sender in engines.senders.items():
            assert gen == 1
            sender.request_finished("p-2", ((3, 4),), match_key="k2")
        engines.add("r2", "k2", [5, 6])
        second = engines.outcome("r2")
        assert second == {0: None, 1: None}, second
        for tp, caches in engines.d_caches.items():
            for layer, got in caches.items():
                (owner,) = [
                    k for (g, k), c in engines.p_caches.items() if g == 1 and k.tp_rank == tp and layer in c
                ]
                want = kv_bytes(engines.p_caches[(1, owner)][layer])[:, [3, 4]]
                assert torch.equal(kv_bytes(got)[:, [5, 6]], want), (tp, layer)
    finally:
        engines.close()
