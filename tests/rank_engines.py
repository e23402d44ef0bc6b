"""P and D engines as real processes (one per rank, real NIXL) for the reliability tests.

Each rank is a :mod:`kvpush.demo.rank` process driven over a pipe; this process serves both
engines' side channels, as a scheduler process does. Ranks can be killed with SIGKILL and
decode ranks restarted under the same agent name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ParallelConfig, RankKey
from kvpush.demo.rank import RankSpec
from kvpush.demo.runner import _Rank, _start_ranks, _stop
from kvpush.demo.soak import SOAK_MODEL


class Engines:
    def __init__(
        self,
        *,
        prefill_pp: int = 1,
        decode_tp: int = 1,
        blocks: int = 256,
        transport: str = "nixl",
        transport_options: dict[str, Any] | None = None,
        request_timeout_s: float = 10.0,
        lease_s: float = 3.0,
        **worker_options: Any,
    ) -> None:
        self.prefill_pp, self.decode_tp = prefill_pp, decode_tp
        self.p_server = SideChannelServer("prefill-0")
        self.d_server = SideChannelServer("decode-0")
        self.ranks: list[_Rank] = []
        common = {
            "model": SOAK_MODEL,
            "layout": "uniform",
            "blocks_per_group": (blocks,),
            "request_timeout_s": request_timeout_s,
            "lease_s": lease_s,
            "transport": transport,
            "transport_options": dict(transport_options or {}),
            "worker_options": worker_options,
            "log_level": os.environ.get("KVPUSH_TEST_RANK_LOG", "ERROR"),
        }
        self.p_specs = [
            RankSpec(
                role="prefill",
                engine_id="prefill-0",
                parallel=ParallelConfig.for_stage(
                    num_layers=SOAK_MODEL.num_layers, pp_size=prefill_pp, pp_rank=pp, tp_size=1, tp_rank=0
                ),
                side_channel_port=self.p_server.port,
                **common,
            )
            for pp in range(prefill_pp)
        ]
        self.d_specs = [
            RankSpec(
                role="decode",
                engine_id="decode-0",
                parallel=ParallelConfig(tp_size=decode_tp, tp_rank=tp, num_layers=SOAK_MODEL.num_layers),
                side_channel_port=self.d_server.port,
                **common,
            )
            for tp in range(decode_tp)
        ]
        try:
            self.p_ranks = self._start(self.p_specs, self.p_server)
            self.d_ranks = self._start(self.d_specs, self.d_server)
        except BaseException:
            self.close()
            raise
        self.d_results: dict[RankKey, dict[str, tuple[str, Any]]] = {r.key: {} for r in self.d_ranks}
        self.released: set[tuple[RankKey, str]] = set()
        """(D rank, request) pairs whose blocks were released after a failure or cancel."""
        self.p_results: dict[RankKey, dict[str, str | None]] = {r.key: {} for r in self.p_ranks}
        self.plans: dict[str, dict[str, Any]] = {}

    def _start(self, specs: list[RankSpec], server: SideChannelServer) -> list[_Rank]:
        ranks, payloads = _start_ranks(specs, timeout_s=120)
        self.ranks += ranks
        server.publish_all(payloads)
        return ranks

    # ------------------------------------------------------------------ requests

    def params(self, rid: str) -> dict[str, Any]:
        return {
            "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1",
            "remote_port": self.p_server.port,
            "tp_size": 1,
            "pp_size": self.prefill_pp,
            "transfer_id": f"xfer-{rid}",
            "remote_request_id": rid,
        }

    def plan(self, rid: str, p_ids: list[int], d_ids: list[int]) -> None:
        seed = len(self.plans) + 1
        self.plans[rid] = {"seed": seed, "p_ids": [p_ids], "d_ids": [d_ids]}
        for rank in self.p_ranks:
            rank.call(("prepare", [(rid, seed, [p_ids])]))

    def add(self, rid: str) -> None:
        plan = self.plans[rid]
        for rank in self.d_ranks:
            rank.call(("add", rid, plan["d_ids"], self.params(rid), plan["seed"], [0]))

    def finish(self, rid: str, stages: Any = None) -> None:
        for rank in self.p_ranks:
            if stages is None or rank.key.pp_rank in stages:
                rank.call(("finish", rid, self.plans[rid]["p_ids"], f"xfer-{rid}"))

    def cancel(self, rid: str) -> None:
        for rank in self.d_ranks:
            rank.call(("cancel", rid))

    def poll(self) -> None:
        for rank in self.d_ranks:
            if not rank.process.is_alive():
                continue
            polled = rank.call(("poll",))
            for kind in ("done", "failed", "cancelled"):
                for rid, value in polled[kind].items():
                    self.d_results[rank.key][rid] = (kind, value)
            self.released.update((rank.key, rid) for rid in polled["released"])
        for rank in self.p_ranks:
            if not rank.process.is_alive():
                continue
            polled = rank.call(("poll",))
            for rid in polled["sent"]:
                self.p_results[rank.key][rid] = None
            for rid, reason in polled["failed"].items():
                self.p_results[rank.key][rid] = reason

    def wait(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> float:
        """Poll every live rank until ``predicate`` holds; returns the seconds it took."""
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
            time.sleep(0.02)

    def decode_outcome(self, rid: str) -> dict[RankKey, tuple[str, Any]]:
        return {key: results[rid] for key, results in self.d_results.items() if rid in results}

    def wait_decode(self, rids: list[str], timeout_s: float = 30.0) -> float:
        """Wait until every D rank reported each request (done, failed or cancelled)."""
        return self.wait(
            f"D to resolve {rids}",
            lambda: all(rid in results for results in self.d_results.values() for rid in rids),
            timeout_s,
        )

    def wait_released(self, rids: list[str], timeout_s: float = 30.0) -> float:
        """Wait until every D rank released each (failed or cancelled) request's blocks."""
        return self.wait(
            f"D to release {rids}",
            lambda: all((key, rid) in self.released for key in self.d_results for rid in rids),
            timeout_s,
        )

    def wait_prefill(self, rids: list[str], timeout_s: float = 30.0, ranks: Any = None) -> float:
        keys = [r.key for r in self.p_ranks] if ranks is None else ranks
        return self.wait(
            f"P to report {rids}",
            lambda: all(rid in self.p_results[key] for key in keys for rid in rids),
            timeout_s,
        )

    def health(self, ranks: list[_Rank]) -> list[dict[str, Any]]:
        return [rank.call(("health",)) for rank in ranks]

    # ------------------------------------------------------------------ faults

    def kill(self, rank: _Rank) -> None:
        os.kill(rank.process.pid, signal.SIGKILL)
        rank.process.join(timeout=10)

    def restart_prefill(self, index: int = 0) -> None:
        """SIGKILL P rank ``index`` and start a fresh process under the same name (a new
        incarnation) with every planned prompt prepared; serve its new metadata."""
        old = self.p_ranks[index]
        if old.process.is_alive():
            self.kill(old)
        (fresh,), payloads = _start_ranks([self.p_specs[index]], timeout_s=120)
        self.ranks.append(fresh)
        fresh.call(("prepare", [(rid, plan["seed"], plan["p_ids"]) for rid, plan in self.plans.items()]))
        self.p_server.publish_all(payloads)
        self.p_ranks[index] = fresh
        self.p_results[fresh.key] = {}

    def restart_decode(self) -> None:
        """Start fresh decode processes under the same names and serve their new metadata."""
        old = self.d_ranks
        for rank in old:
            if rank.process.is_alive():
                self.kill(rank)
        self.d_ranks = self._start(self.d_specs, self.d_server)
        self.d_results = {r.key: {} for r in self.d_ranks}
        self.released = set()

    def close(self) -> None:
        _stop(self.ranks)
        for server in (self.p_server, self.d_server):
            with contextlib.suppress(Exception):
                server.close()

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
