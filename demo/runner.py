"""``kvpush demo``: P stages and D ranks as real processes, real NIXL, every byte verified.

For each ``--layout`` it starts P as ``--prefill-pp`` stages × ``--prefill-tp`` ranks and D as
``--decode-tp`` ranks, serves both engines' side channels from this process (the role a
scheduler process plays in an engine), fills P's blocks with request-specific content, then
dispatches every request to both legs at once (as a router does), waits for D to report each
request complete, and checks that every byte of every pushed block in D's caches equals what
P wrote. ``--transport`` picks the transport plugin of every rank (``nixl``, ``cuda_ipc``, ...);
the report says which transport carried the WRITEs (``cuda_ipc`` falls back to NIXL where IPC
cannot reach, e.g. caches on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvpush.core.errors import ConfigError, WaitTimeout
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ModelSpec, ParallelConfig, RankKey
from kvpush.demo import processes
from kvpush.demo.rank import RankSpec, rank_main

LAYOUTS = ("mha", "mla", "hma")


def model_for(layout: str, num_layers: int = 8) -> tuple[ModelSpec, str]:
    """The demo model of a ``--layout`` choice, and the layout plugin that describes it."""
    if layout == "mha":
        return ModelSpec(name="demo-gqa", num_layers=num_layers, num_kv_heads=4, head_dim=64), "uniform"
    if layout == "mla":
        return ModelSpec(name="demo-mla", num_layers=num_layers, attention="mla", head_dim=576), "uniform"
    if layout == "hma":
        return (
            ModelSpec(
                name="demo-hybrid",
                num_layers=num_layers,
                num_kv_heads=4,
                head_dim=64,
                layer_groups=[i % 2 for i in range(num_layers)],
                layer_kinds=["full" if i % 2 == 0 else "sliding_window" for i in range(num_layers)],
            ),
            "hma",
        )
    return _registered_model(layout)


def _registered_model(layout: str) -> tuple[ModelSpec, str]:
    """Any other name: a registered layout plugin and its ``LayoutProvider.demo_model``."""
    from kvpush.core.manager import get_plugin_manager

    layouts = get_plugin_manager().layouts()
    if layout not in layouts:
        raise ConfigError(
            f"unknown --layout {layout!r}: choose {', '.join(LAYOUTS)} or a registered layout "
            f"({', '.join(sorted(layouts))}; `kvpush plugins` lists them), or install the plugin "
            f"that provides it"
        )
    provider = layouts[layout]
    if provider.demo_model is None:
        raise ConfigError(
            f"layout {layout!r} sets no LayoutProvider.demo_model, so the demo has no model to "
            f"push with it; give its provider a demo_model (and an allocate)"
        )
    return provider.demo_model, layout


@attrs.frozen(kw_only=True)
class RunConfig:
    layout: str = "mha"
    prefill_pp: int = 2
    prefill_tp: int = 1
    decode_tp: int = 2
    requests: int = 32
    max_blocks: int = 16
    """Largest request, in blocks (of group 0)."""
    window_blocks: int = 4
    """Sliding-window groups (hma) keep at most this many blocks per request."""
    prefix_hit_rate: float = 0.0
    """Share of requests where D has a prefix cached and registers only the suffix."""
    device: str = "cpu"
    decode_device: str | None = None
    seed: int = 0
    timeout_s: float = 120.0
    num_layers: int = 8
    model: ModelSpec | None = None
    """The model to push; None: the ``--layout`` choice's demo model (then ``layout`` is a
    registered layout name when it is not mha/mla/hma)."""
    plugins: tuple[tuple[str, str], ...] = ()
    """Extra plugins every rank registers, as ``(name, "module[:attr]")``."""
    load_entrypoints: bool = True
    """Ranks also load installed plugins (the ``kvpush`` entry points)."""
    transport: str = "nixl"
    """The transport plugin of every rank (``nixl``, ``cuda_ipc`` or any registered one)."""
    strategy: str | None = None
    """Force the transfer strategy (``direct`` or ``packed``); None lets the strategy plugin pick."""
    prefill_host: str = "127.0.0.1"
    """P's address: its side channel binds it and D reaches P there (``remote_host``)."""
    decode_host: str = "127.0.0.1"
    """D's address: its side channel binds it and D advertises it to P."""
    prefill_netns: str | None = None
    """Run P's processes (ranks and side channel) in this network namespace."""
    decode_netns: str | None = None
    """Run D's processes in this network namespace."""
    netns: bool = False
    """Build two namespaces joined by a veth pair for this run and place P and D in them
    (``kvpush.demo.netns``; needs root); UCX is set to ``tcp`` over the link unless
    ``transport_options`` says otherwise."""
    transport_options: dict[str, Any] = attrs.field(factory=dict, hash=False)
    """Options of every rank's transport (nixl: e.g. ``{"ucx_tls": "tcp"}``; cuda_ipc: e.g.
    ``{"mode": "ipc", "inner_options": {"ucx_tls": "tcp"}}``)."""


@attrs.define
class _Rank:
    key: RankKey
    process: Any
    conn: Any

    def call(self, message: tuple[Any, ...], timeout_s: float = 60.0) -> Any:
        self.send(message)
        return self.reply(message, timeout_s)

    def send(self, message: tuple[Any, ...]) -> None:
        self.conn.send(message)

    def reply(self, message: tuple[Any, ...], timeout_s: float = 60.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise WaitTimeout(f"rank {self.key} did not answer {message[0]!r} within {timeout_s}s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"rank {self.key} failed on {message[0]!r}:\n{value}")
        return value


@attrs.define
class EngineSideChannel:
    """One engine's side channel: served from this process, or (``netns``) from a process in
    the engine's namespace, as the engine's scheduler would on its own host."""

    engine_id: str
    host: str
    port: int
    server: SideChannelServer | None = None
    process: Any = None
    conn: Any = None

    def publish_all(self, payloads: dict[RankKey, bytes], timeout_s: float = 30.0) -> None:
        if self.server is not None:
            self.server.publish_all(payloads)
            return
        self.conn.send(("publish", payloads))
        if not self.conn.poll(timeout_s):
            raise WaitTimeout(
                f"side channel of {self.engine_id} did not confirm a publish within {timeout_s}s"
            )
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"side channel of {self.engine_id} failed to publish:\n{value}")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            return
        with contextlib.suppress(Exception):
            self.conn.send(("stop",))
            self.conn.poll(5)
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def start_side_channel(
    engine_id: str,
    host: str = "127.0.0.1",
    netns: str | None = None,
    timeout_s: float = 60.0,
    port: int = 0,
) -> EngineSideChannel:
    """Serve ``engine_id``'s side channel on ``host:port`` (inside ``netns`` when given;
    port 0: any free port)."""
    if netns is None:
        server = SideChannelServer(engine_id, host=host, port=port)
        return EngineSideChannel(engine_id, host, server.port, server=server)
    from kvpush.demo.rank import side_channel_main

    process, parent = processes.start(
        side_channel_main, lambda conn: (engine_id, host, netns, conn, port), name="kvpush-sc"
    )
    if not parent.poll(timeout_s):
        process.kill()
        raise WaitTimeout(f"side channel of {engine_id} in {netns} did not start within {timeout_s}s")
    status, value = parent.recv()
    if status == "error":
        process.join(timeout=5)
        raise RuntimeError(f"side channel of {engine_id} in {netns} failed to start:\n{value}")
    return EngineSideChannel(engine_id, host, value, process=process, conn=parent)


def _start_ranks(
    specs: list[RankSpec],
    timeout_s: float,
    target: Callable[..., None] = rank_main,
    extra: tuple[Any, ...] = (),
) -> tuple[list[_Rank], dict[RankKey, Any]]:
    """Spawn ``target(spec, conn, *extra)`` per spec; wait (bounded) for each one's ready value."""
    ranks, payloads = [], {}
    for spec in specs:
        process, parent = processes.start(
            target, lambda conn, spec=spec: (spec, conn, *extra), name=f"kvpush-{spec.role}"
        )
        ranks.append(_Rank(spec.parallel.rank, process, parent))
    deadline = time.monotonic() + timeout_s
    for rank in ranks:
        if not rank.conn.poll(max(0.0, deadline - time.monotonic())):
            raise WaitTimeout(f"rank {rank.key} did not start within {timeout_s}s")
        try:
            status, value = rank.conn.recv()
        except EOFError:
            rank.process.join(timeout=5)
            raise RuntimeError(
                f"rank {rank.key} exited (exit code {rank.process.exitcode}) before it was ready"
            ) from None
        if status == "error":
            raise RuntimeError(f"rank {rank.key} failed to start:\n{value}")
        payloads[rank.key] = value
    return ranks, payloads


def _stop(ranks: list[_Rank]) -> None:
    for rank in ranks:
        with contextlib.suppress(Exception):
            rank.call(("stop",), timeout_s=10)
        rank.process.join(timeout=10)
        if rank.process.is_alive():
            rank.process.kill()


def _plan_requests(cfg: RunConfig, model: ModelSpec, blocks: tuple[int, ...]) -> list[dict[str, Any]]:
    rng = random.Random(cfg.seed)
    groups = model.num_groups
    p_free = [rng.sample(range(n), n) for n in blocks]
    d_free = [rng.sample(range(n), n) for n in blocks]
    plans = []
    for index in range(cfg.requests):
        length = rng.randint(1, cfg.max_blocks)
        per_group = [length if g == 0 else min(length, cfg.window_blocks) for g in range(groups)]
        hit = rng.random() < cfg.prefix_hit_rate and length > 1
        cached = [rng.randint(1, n - 1) if hit and n > 1 else 0 for n in per_group]
        p_ids = [[p_free[g].pop() for _ in range(per_group[g])] for g in range(groups)]
        d_ids = [[d_free[g].pop() for _ in range(per_group[g] - cached[g])] for g in range(groups)]
        plans.append(
            {
                "rid": f"req-{index}",
                "seed": cfg.seed * 100_003 + index + 1,
                "p_ids": p_ids,
                "d_ids": d_ids,
                "offsets": cached,
            }
        )
    return plans


def placed_in_netns(cfg: RunConfig, pair: Any) -> RunConfig:
    """``cfg`` with P and D placed in ``pair``'s namespaces (a :class:`NetnsPair`), UCX on TCP
    over the link between them unless ``cfg.transport_options`` chose otherwise."""
    options = with_nixl_options(
        cfg.transport, cfg.transport_options, {"ucx_tls": "tcp", "ucx_net_devices": pair.link}
    )
    return attrs.evolve(
        cfg,
        netns=False,
        prefill_host=pair.prefill_host,
        decode_host=pair.decode_host,
        prefill_netns=pair.prefill_ns,
        decode_netns=pair.decode_ns,
        transport_options=options,
    )


def with_nixl_options(transport: str, options: dict[str, Any], nixl: dict[str, Any]) -> dict[str, Any]:
    """``options`` of ``transport`` with the NIXL options ``nixl`` added: at the top level for
    ``nixl``, under ``inner_options`` for a transport that wraps NIXL (``cuda_ipc``, ``faulty``).
    Options already given win."""
    if not nixl:
        return dict(options)
    if transport == "nixl":
        return {**nixl, **options}
    return {**options, "inner_options": {**nixl, **options.get("inner_options", {})}}


def check_transport_name(name: str) -> None:
    """``ConfigError`` naming the registered transports when ``name`` is not one of them."""
    from kvpush.core.manager import get_plugin_manager

    known = sorted(get_plugin_manager().transports())
    if name not in known:
        raise ConfigError(
            f"unknown --transport {name!r}: the registered transports are {', '.join(known)} "
            f"(`kvpush plugins` lists them); install the plugin that provides another"
        )


def transport_notes(
    transport: str, options: dict[str, Any], device: str, decode_device: str | None
) -> list[str]:
    """What to tell the user about this transport choice before a run; ``ConfigError`` when
    it cannot work (``cuda_ipc`` options it does not know, or mode ``ipc`` with caches on the CPU)."""
    if transport != "cuda_ipc":
        return []
    from kvpush.transports.cuda_ipc import KNOWN_OPTIONS, MODES

    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown cuda_ipc option(s) {', '.join(unknown)} in --transport-option; it knows "
            f"{', '.join(KNOWN_OPTIONS)} (NIXL options go in inner_options)"
        )
    mode = options.get("mode", "auto")
    if mode not in MODES:
        raise ConfigError(f"--transport-option mode={mode!r}: cuda_ipc modes are {', '.join(MODES)}")
    on_cpu = [
        side
        for side, where in (("P", device), ("D", decode_device or device))
        if not where.startswith("cuda")
    ]
    if not on_cpu or mode == "nixl":
        return [f"transport cuda_ipc, mode {mode}"]
    if mode == "ipc":
        raise ConfigError(
            f"--transport cuda_ipc with mode=ipc needs P's and D's caches on a GPU ({' and '.join(on_cpu)} "
            f"on the CPU): pass --device cuda[:N] (and --decode-device cuda:M), or use mode=auto, "
            f"which sends WRITEs that IPC cannot carry over NIXL"
        )
    return [
        f"transport cuda_ipc, mode auto: {' and '.join(on_cpu)} caches are on the CPU, so CUDA IPC "
        f"cannot reach and every WRITE goes over its inner transport "
        f"({options.get('inner', 'nixl')}); the report names what carried them"
    ]


def carried_by(transport: str, p_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Which transport carried P's WRITEs: ``{"writes": {name: count}, "summary": words}``.

    For ``cuda_ipc``: kernel copies over IPC, and the rest over its inner transport (with the
    reasons IPC could not reach a peer)."""
    writes: dict[str, int] = {}
    reasons: set[str] = set()
    for stats in p_stats:
        info = stats.get("transport", {})
        total = int(stats["counters"]["writes_posted"])
        ipc = info.get("ipc_writes")
        if ipc is None:
            name = info.get("name", transport)
            if info.get("inner"):
                name = f"{name} over {info['inner']}"
            writes[name] = writes.get(name, 0) + total
            continue
        inner = info.get("inner") or "inner"
        writes["cuda_ipc"] = writes.get("cuda_ipc", 0) + int(ipc)
        writes[inner] = writes.get(inner, 0) + total - int(ipc)
        reasons.update(info.get("fallbacks", {}).values())
    used = {name: count for name, count in writes.items() if count}
    words = ", ".join(f"{name} ({count} WRITEs)" for name, count in used.items()) or "nothing (no WRITE)"
    if reasons and any(name != "cuda_ipc" for name in used):
        words += f"; cuda_ipc fell back: {'; '.join(sorted(reasons))}"
    return {"writes": used, "summary": words}


def placement(cfg: RunConfig) -> str:
    """Where P and D run, in words."""
    p_where = cfg.prefill_host + (f" (netns {cfg.prefill_netns})" if cfg.prefill_netns else "")
    d_where = cfg.decode_host + (f" (netns {cfg.decode_netns})" if cfg.decode_netns else "")
    options = {**cfg.transport_options.get("inner_options", {}), **cfg.transport_options}
    ucx = ", ".join(f"{k}={v}" for k, v in sorted(options.items()) if k.startswith("ucx_"))
    return f"P at {p_where}, D at {d_where}" + (f"; {ucx}" if ucx else "")


@contextlib.contextmanager
def side_channel_secret(hosts: tuple[str, ...], say: Callable[[str], None]) -> Iterator[None]:
    """Off loopback the side channel needs a shared secret: unless ``KVPUSH_SIDE_CHANNEL_SECRET``
    is set, set a random one for this run (every process started meanwhile inherits it)."""
    from kvpush.core.addresses import is_loopback
    from kvpush.core.sidechannel import SECRET_ENV

    if all(is_loopback(host) for host in hosts) or os.environ.get(SECRET_ENV):
        yield
        return
    os.environ[SECRET_ENV] = secrets.token_hex(32)
    say(f"side channels off loopback: {SECRET_ENV} set to a random secret for this run")
    try:
        yield
    finally:
        os.environ.pop(SECRET_ENV, None)


def run_config(cfg: RunConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one configuration end to end and return its report row."""
    if cfg.netns:
        from kvpush.demo.netns import NetnsPair

        with NetnsPair() as pair:
            return run_config(placed_in_netns(cfg, pair), progress)
    say = progress or (lambda _msg: None)
    for note in transport_notes(cfg.transport, cfg.transport_options, cfg.device, cfg.decode_device):
        say(note)
    with side_channel_secret((cfg.prefill_host, cfg.decode_host), say):
        return _run_placed(cfg, say)


def _run_placed(cfg: RunConfig, say: Callable[[str], None]) -> dict[str, Any]:
    model, layout = (
        (cfg.model, cfg.layout) if cfg.model is not None else model_for(cfg.layout, cfg.num_layers)
    )
    base = cfg.requests * cfg.max_blocks + 16
    blocks = tuple(base if g == 0 else cfg.requests * cfg.window_blocks + 16 for g in range(model.num_groups))
    ranks: list[_Rank] = []
    servers: list[EngineSideChannel] = []
    label = f"{cfg.layout} PP{cfg.prefill_pp}xTP{cfg.prefill_tp} -> TP{cfg.decode_tp}"
    try:
        p_server = start_side_channel("prefill-0", cfg.prefill_host, cfg.prefill_netns)
        servers.append(p_server)
        d_server = start_side_channel("decode-0", cfg.decode_host, cfg.decode_netns)
        servers.append(d_server)
        if cfg.prefill_host != "127.0.0.1" or cfg.decode_host != "127.0.0.1" or cfg.transport_options:
            say(f"[{label}] {placement(cfg)}")
        common = {
            "model": model,
            "layout": layout,
            "blocks_per_group": blocks,
            "request_timeout_s": cfg.timeout_s,
            "strategy": cfg.strategy,
            "transport_options": dict(cfg.transport_options),
            "transport": cfg.transport,
            "plugins": cfg.plugins,
            "load_entrypoints": cfg.load_entrypoints,
        }
        p_specs = [
            RankSpec(
                role="prefill",
                engine_id="prefill-0",
                parallel=ParallelConfig.for_stage(
                    num_layers=model.num_layers,
                    pp_size=cfg.prefill_pp,
                    pp_rank=pp,
                    tp_size=cfg.prefill_tp,
                    tp_rank=tp,
                ),
                device=cfg.device,
                side_channel_port=p_server.port,
                host=cfg.prefill_host,
                netns=cfg.prefill_netns,
                **common,
            )
            for pp in range(cfg.prefill_pp)
            for tp in range(cfg.prefill_tp)
        ]
        d_specs = [
            RankSpec(
                role="decode",
                engine_id="decode-0",
                parallel=ParallelConfig(tp_size=cfg.decode_tp, tp_rank=tp, num_layers=model.num_layers),
                device=cfg.decode_device or cfg.device,
                side_channel_port=d_server.port,
                host=cfg.decode_host,
                netns=cfg.decode_netns,
                **common,
            )
            for tp in range(cfg.decode_tp)
        ]
        say(f"[{label}] starting {len(p_specs)} prefill and {len(d_specs)} decode processes")
        p_ranks, p_payloads = _start_ranks(p_specs, timeout_s=120)
        ranks += p_ranks
        d_ranks, d_payloads = _start_ranks(d_specs, timeout_s=120)
        ranks += d_ranks
        p_server.publish_all(p_payloads)
        d_server.publish_all(d_payloads)

        plans = _plan_requests(cfg, model, blocks)
        for rank in p_ranks:
            rank.call(("prepare", [(p["rid"], p["seed"], p["p_ids"]) for p in plans]), timeout_s=300)
        params = {
            "remote_engine_id": "prefill-0",
            "remote_host": cfg.prefill_host,
            "remote_port": p_server.port,
            "tp_size": cfg.prefill_tp,
            "pp_size": cfg.prefill_pp,
        }
        # One warm-up request connects the engines (handshakes); the rest are measured.
        warmup, batch = plans[:1], plans[1:]
        results = _Results(plans)
        for group, what in ((warmup, "warm-up request"), (batch, "requests")):
            if group:
                say(f"[{label}] dispatching {len(group)} {what}")
                _dispatch(group, params, p_ranks, d_ranks, results)
                _wait(cfg, label, group, p_ranks, d_ranks, results, say)
        return _summarise(cfg, plans, batch or warmup, results, p_ranks, d_ranks)
    finally:
        _stop(ranks)
        for server in servers:
            server.close()


@attrs.define
class _Results:
    plans: list[dict[str, Any]]
    dispatched: dict[str, float] = attrs.field(factory=dict)
    outcome: dict[str, dict[RankKey, dict[str, Any]]] = attrs.field(factory=dict)
    failures: dict[str, str] = attrs.field(factory=dict)
    prefill_reported: dict[RankKey, set[str]] = attrs.field(factory=dict)


def _dispatch(
    plans: list[dict[str, Any]],
    params: dict[str, Any],
    p_ranks: list[_Rank],
    d_ranks: list[_Rank],
    results: _Results,
) -> None:
    """Send both legs of every request at once, as a router does; read the acks afterwards."""
    for plan in plans:
        rid = plan["rid"]
        request_params = {**params, "transfer_id": f"xfer-{rid}", "remote_request_id": rid}
        results.dispatched[rid] = time.perf_counter()
        for rank in d_ranks:
            rank.send(("add", rid, plan["d_ids"], request_params, plan["seed"], plan["offsets"]))
        for rank in p_ranks:
            rank.send(("finish", rid, plan["p_ids"], f"xfer-{rid}"))
    for rank in [*d_ranks, *p_ranks]:
        for _ in plans:
            rank.reply(("dispatch",), timeout_s=60)


def _wait(
    cfg: RunConfig,
    label: str,
    plans: list[dict[str, Any]],
    p_ranks: list[_Rank],
    d_ranks: list[_Rank],
    results: _Results,
    say: Callable[[str], None],
) -> None:
    """Poll every rank until each request of ``plans`` is done or failed everywhere (bounded)."""
    rids = {p["rid"] for p in plans}
    for rid in rids:
        results.outcome.setdefault(rid, {})
    deadline = time.monotonic() + cfg.timeout_s + 10
    reported = -1
    while time.monotonic() < deadline:
        for rank in d_ranks:
            polled = rank.call(("poll",))
            for rid, result in polled["done"].items():
                results.outcome[rid][rank.key] = result
            for rid, reason in polled["failed"].items():
                results.failures.setdefault(rid, f"D rank {rank.key}: {reason}")
        for rank in p_ranks:
            polled = rank.call(("poll",))
            seen = results.prefill_reported.setdefault(rank.key, set())
            seen.update(polled["sent"])
            for rid, reason in polled["failed"].items():
                seen.add(rid)
                results.failures.setdefault(rid, f"P rank {rank.key}: {reason}")
        finished = sum(
            1 for rid in rids if len(results.outcome[rid]) == len(d_ranks) or rid in results.failures
        )
        if finished != reported:
            say(f"[{label}] {finished}/{len(plans)} requests finished")
            reported = finished
        prefill_done = all(rids <= results.prefill_reported.get(r.key, set()) for r in p_ranks)
        if finished == len(plans) and prefill_done:
            return
        time.sleep(0.01)


def _summarise(
    cfg: RunConfig,
    plans: list[dict[str, Any]],
    measured: list[dict[str, Any]],
    results: _Results,
    p_ranks: list[_Rank],
    d_ranks: list[_Rank],
) -> dict[str, Any]:
    failures = results.failures
    verified, total_bytes = 0, 0
    done_at: dict[str, float] = {}
    for plan in plans:
        rid = plan["rid"]
        per_rank = results.outcome.get(rid, {})
        if rid in failures or len(per_rank) != len(d_ranks):
            failures.setdefault(rid, "not completed before the deadline")
            continue
        misses = [f"D rank {k}: {r['miss']}" for k, r in per_rank.items() if not r["ok"]]
        if misses:
            failures[rid] = "; ".join(misses)
            continue
        verified += 1
        total_bytes += sum(r["bytes"] for r in per_rank.values())
        done_at[rid] = max(r["t_done"] for r in per_rank.values())
    measured_ids = [p["rid"] for p in measured if p["rid"] in done_at]
    latencies = [(done_at[rid] - results.dispatched[rid]) * 1e3 for rid in measured_ids]
    measured_bytes = sum(sum(r["bytes"] for r in results.outcome[rid].values()) for rid in measured_ids)
    elapsed = (
        max(done_at[rid] for rid in measured_ids) - min(results.dispatched[rid] for rid in measured_ids)
        if measured_ids
        else 0.0
    )
    p_stats = [rank.call(("stats",)) for rank in p_ranks]
    d_stats = [rank.call(("stats",)) for rank in d_ranks]
    full = [ms for s in p_stats for ms in s["handshake_ms"]["full"]]
    notif = [ms for s in d_stats for ms in s["handshake_ms"]["notif_only"]]
    return {
        "layout": cfg.layout,
        "placement": placement(cfg),
        "devices": f"P {cfg.device}, D {cfg.decode_device or cfg.device}",
        "transport": cfg.transport,
        "carried_by": carried_by(cfg.transport, p_stats),
        "prefill_pp": cfg.prefill_pp,
        "prefill_tp": cfg.prefill_tp,
        "decode_tp": cfg.decode_tp,
        "requests": len(plans),
        "verified_requests": verified,
        "failed_requests": len(plans) - verified,
        "failures": dict(sorted(failures.items())[:10]),
        "bytes": total_bytes,
        "gbps": measured_bytes / elapsed / 1e9 if elapsed > 0 else 0.0,
        "handshake_ms_full": statistics.mean(full) if full else None,
        "handshake_ms_notif_only": statistics.mean(notif) if notif else None,
        "latency_ms_p50": _percentile(latencies, 50),
        "latency_ms_p99": _percentile(latencies, 99),
        "remote_lists_prepared_by_decode": sum(s["counters"]["remote_lists_prepared"] for s in d_stats),
        "writes": sum(s["counters"]["writes_posted"] for s in p_stats),
        "packed_destinations": sum(s["stats"].get("packed_writes", 0) for s in p_stats),
        "packed_fallbacks": sum(s["stats"].get("packed_fallbacks", 0) for s in p_stats),
    }


def _percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    width = max([7, *(len(row["layout"]) + 1 for row in rows)])  # layout names of plugins are longer
    header = (
        f"{'layout':<{width}}{'P':>8}{'D':>5}{'reqs':>6}{'verified':>10}{'MiB':>9}"
        f"{'hs full ms':>12}{'hs notif ms':>13}{'p50 ms':>9}{'p99 ms':>9}{'GB/s':>8}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        print(
            f"{row['layout']:<{width}}{'PP' + str(row['prefill_pp']) + 'xTP' + str(row['prefill_tp']):>8}"
            f"{'TP' + str(row['decode_tp']):>5}{row['requests']:>6}{row['verified_requests']:>10}"
            f"{row['bytes'] / 2**20:>9.1f}{_fmt(row['handshake_ms_full'], '.1f'):>12}"
            f"{_fmt(row['handshake_ms_notif_only'], '.1f'):>13}{_fmt(row['latency_ms_p50'], '.1f'):>9}"
            f"{_fmt(row['latency_ms_p99'], '.1f'):>9}{row['gbps']:>8.2f}",
            file=out,
        )
    for row in rows:
        where = row.get("placement")
        if where and not where.startswith("P at 127.0.0.1, D at 127.0.0.1"):
            print(f"  {row['layout']}: {where}", file=out)
        if "carried_by" in row:
            print(
                f"  {row['layout']}: {row['devices']}; --transport {row['transport']}, carried by "
                f"{row['carried_by']['summary']}",
                file=out,
            )
        for rid, reason in row["failures"].items():
            print(f"  {row['layout']} {rid}: {reason}", file=out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-pp", type=int, default=2, help="P pipeline stages (default 2)")
    parser.add_argument("--prefill-tp", type=int, default=1, help="P TP ranks per stage (default 1)")
    parser.add_argument("--decode-tp", type=int, default=2, help="D TP ranks (default 2)")
    parser.add_argument(
        "--layout",
        action="append",
        metavar="NAME",
        help="model layout to push: mha, mla, hma or any registered layout with a demo_model "
        "(see `kvpush plugins`); repeatable (default: mha, mla and hma)",
    )
    parser.add_argument("--requests", type=int, default=32, help="requests per layout (default 32)")
    parser.add_argument("--max-blocks", type=int, default=16, help="largest request in blocks (default 16)")
    parser.add_argument(
        "--prefix-hit-rate", type=float, default=0.0, help="share of partial prefix hits on D"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument(
        "--decode-device", default=None, help="device of D's caches, e.g. cuda:1 (default: --device)"
    )
    parser.add_argument(
        "--transport",
        default="nixl",
        metavar="NAME",
        help="transport plugin of every rank: nixl (default), cuda_ipc (same-host CUDA IPC kernel "
        "copies, NIXL for notifications and where IPC cannot reach) or any registered transport "
        "(`kvpush plugins`)",
    )
    parser.add_argument(
        "--transport-option",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="an option of --transport, e.g. mode=ipc for cuda_ipc (auto, ipc or nixl); VALUE is "
        "read as JSON when it parses, else as a string; repeatable",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request bound in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--strategy", choices=["direct", "packed"], default=None, help="force a transfer strategy"
    )
    parser.add_argument(
        "--soak", type=int, default=0, metavar="N", help="soak: N concurrent requests with aborts and faults"
    )
    parser.add_argument("--abort-rate", type=float, default=0.1, help="soak: share of requests D aborts")
    parser.add_argument("--fault-rate", type=float, default=0.01, help="soak: rate of each injected fault")
    parser.add_argument(
        "--p-kills",
        type=int,
        default=0,
        metavar="N",
        help="soak: kill N P rank processes mid-run and restart them under the same name",
    )
    parser.add_argument(
        "--d-kills",
        type=int,
        default=0,
        metavar="N",
        help="soak: kill N D rank processes mid-run and restart them under the same name",
    )
    parser.add_argument(
        "--p-pauses", type=int, default=0, metavar="N", help="soak: stop N P rank processes for 2 s mid-run"
    )
    hosts = parser.add_argument_group("placing P and D on different hosts (docs/deployment.md)")
    hosts.add_argument(
        "--prefill-host",
        default="127.0.0.1",
        type=_host_argument,
        help="P's address (IPv4, IPv6 such as fd00::1, or a name); its side channel binds it",
    )
    hosts.add_argument(
        "--decode-host",
        default="127.0.0.1",
        type=_host_argument,
        help="D's address (IPv4, IPv6 such as fd00::1, or a name); bound and advertised to P",
    )
    hosts.add_argument("--prefill-netns", default=None, help="run P's processes in this network namespace")
    hosts.add_argument("--decode-netns", default=None, help="run D's processes in this network namespace")
    hosts.add_argument(
        "--netns",
        action="store_true",
        help="build two network namespaces joined by a veth pair, place P and D in them and push "
        "across the link (needs root; removed afterwards)",
    )
    hosts.add_argument("--ucx-tls", default=None, help="UCX transports, e.g. tcp (nixl option ucx_tls)")
    hosts.add_argument(
        "--ucx-net-devices", default=None, help="UCX network devices, e.g. eth1 (nixl option ucx_net_devices)"
    )


def _host_argument(text: str) -> str:
    """``--prefill-host`` / ``--decode-host``: an IP address or host name, without a port (an
    IPv6 address bare or in brackets, given bare on: ``fd00::1``)."""
    from kvpush.core.addresses import canonical_host

    try:
        return canonical_host(text, "host")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--transport-option``: VALUE as JSON when it parses, else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. mode=ipc), got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags of ``kvpush demo`` in range (NaN and inf are not)."""
    if not 0 < args.timeout <= 86400:
        raise ConfigError(f"--timeout must be a finite number of seconds in (0, 86400], got {args.timeout}")
    for flag in ("requests", "max_blocks", "prefill_pp", "prefill_tp", "decode_tp"):
        value = getattr(args, flag)
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("prefix_hit_rate", "abort_rate", "fault_rate"):
        value = getattr(args, flag, 0.0)
        if not 0 <= value <= 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be a share in [0, 1], got {value}")
    for flag in ("soak", "p_kills", "d_kills", "p_pauses"):
        if getattr(args, flag, 0) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")


def main(args: argparse.Namespace) -> int:
    try:
        check_numbers(args)
    except ConfigError as err:
        print(f"kvpush demo: {err}", file=sys.stderr)
        return 2
    transport = getattr(args, "transport", "nixl")
    if getattr(args, "soak", 0):
        if transport not in ("nixl", "cuda_ipc") or getattr(args, "transport_option", None):
            print(
                "kvpush demo: --soak runs the faulty transport over nixl or cuda_ipc; use "
                "--transport nixl or cuda_ipc and drop --transport-option (or run without --soak)",
                file=sys.stderr,
            )
            return 2
        from kvpush.demo.soak import main as soak_main

        return soak_main(args)
    options = placement_options(args)
    try:
        check_transport_name(transport)
        transport_notes(transport, options["transport_options"], args.device, args.decode_device)
    except ConfigError as err:
        print(f"kvpush demo: {err}", file=sys.stderr)
        return 2
    layouts = args.layout or list(_available_layouts())
    rows, ok = [], True
    for layout in layouts:
        cfg = RunConfig(
            layout=layout,
            prefill_pp=args.prefill_pp,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            requests=args.requests,
            max_blocks=args.max_blocks,
            prefix_hit_rate=args.prefix_hit_rate,
            device=args.device,
            decode_device=args.decode_device,
            seed=args.seed,
            timeout_s=args.timeout,
            strategy=args.strategy,
            **options,
        )
        try:
            row = run_config(cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
        except Exception as err:
            print(f"[{layout}] failed: {err}", file=sys.stderr)
            row = {
                "layout": layout,
                "placement": placement(cfg),
                "devices": f"P {cfg.device}, D {cfg.decode_device or cfg.device}",
                "transport": cfg.transport,
                "prefill_pp": cfg.prefill_pp,
                "prefill_tp": cfg.prefill_tp,
                "decode_tp": cfg.decode_tp,
                "requests": cfg.requests,
                "verified_requests": 0,
                "failed_requests": cfg.requests,
                "failures": {"*": str(err)},
                "bytes": 0,
                "gbps": 0.0,
                "handshake_ms_full": None,
                "handshake_ms_notif_only": None,
                "latency_ms_p50": None,
                "latency_ms_p99": None,
            }
        ok = ok and row["verified_requests"] == row["requests"]
        rows.append(row)
    if args.json:
        print(json.dumps({"ok": ok, "runs": rows}, indent=2))
    else:
        print_table(rows)
        print("\nall requests verified byte for byte" if ok else "\nSOME REQUESTS WERE NOT VERIFIED")
    return 0 if ok else 1


def placement_options(args: argparse.Namespace) -> dict[str, Any]:
    """``RunConfig`` fields from the host-placement and transport options of ``kvpush demo``
    (the UCX options go to NIXL: under ``inner_options`` of a transport that wraps it)."""
    ucx = {}
    if getattr(args, "ucx_tls", None):
        ucx["ucx_tls"] = args.ucx_tls
    if getattr(args, "ucx_net_devices", None):
        ucx["ucx_net_devices"] = args.ucx_net_devices
    transport = getattr(args, "transport", "nixl")
    transport_options = with_nixl_options(transport, dict(getattr(args, "transport_option", None) or []), ucx)
    return {
        "transport": transport,
        "prefill_host": getattr(args, "prefill_host", "127.0.0.1"),
        "decode_host": getattr(args, "decode_host", "127.0.0.1"),
        "prefill_netns": getattr(args, "prefill_netns", None),
        "decode_netns": getattr(args, "decode_netns", None),
        "netns": bool(getattr(args, "netns", False)),
        "transport_options": transport_options,
    }


def _available_layouts() -> list[str]:
    from kvpush.core.manager import get_plugin_manager

    names = get_plugin_manager().layouts()
    return [layout for layout in LAYOUTS if model_for(layout)[1] in names]
