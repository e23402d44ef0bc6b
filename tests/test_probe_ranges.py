"""Probe (ranges): every number that enters kvpush from outside, at its edges.

NaN, +/-inf, 0, negative, huge (1e308, 2**63), bool for int, float for int, numpy scalars and
strings, given to ``WorkerConfig``, ``SideChannelServer``, ``TransferParams`` / request metadata,
the engine API's waits and the CLI. Good: a ``ConfigError`` naming the field, the value and the
allowed range. Bad: a timer that never fires (``now >= nan`` is always False; a NaN in the
deadline heap blocks every timer behind it), a writer thread that dies after ``start()``
returned, a request held forever.

Each finding was a test that failed before its fix (2026-12-02); the tests are kept. Wire fields
are fuzzed in test_wire_fuzz.py and the engine API's ids/blocks in test_api_validation.py; not
repeated here. Each cluster test runs on the loopback transport and is bounded (a few seconds).
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from cluster import MHA, Cluster

from kvpush.core.errors import ConfigError
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import (
    ParallelConfig,
    RankKey,
    RequestMetadata,
    TransferParams,
    check_num_tokens,
    to_block_start,
)
from kvpush.core.worker import WorkerConfig

NAN, INF = math.nan, math.inf
PAR = ParallelConfig(tp_size=1, num_layers=MHA.num_layers)
P0 = RankKey(0, 0)


def _cfg(**fields: Any) -> WorkerConfig:
    return WorkerConfig(engine_id="E", parallel=PAR, model=MHA, **fields)


def _assert_refused(field: str, value: Any, **extra: Any) -> None:
    """``WorkerConfig`` refuses ``field=value`` with a ConfigError naming the field."""
    with pytest.raises(ConfigError) as info:
        _cfg(**{field: value}, **extra)
    assert field in str(info.value), f"the error does not name {field}: {info.value}"


def _cluster_or_refused(field: str, **config: Any) -> Cluster | None:
    """A loopback cluster with ``config``, or None when kvpush refused it naming ``field``
    (at the config or at ``start()``): refusing is the good outcome."""
    try:
        return Cluster(MHA, **config)
    except ConfigError as err:
        assert field in str(err), f"refused, but the error does not name {field}: {err}"
        return None


# --------------------------------------------------------------------------- what held

HELD = [
    ("lease_s", NAN),
    ("lease_s", 0),
    ("lease_s", -1.0),
    ("request_timeout_s", NAN),
    ("request_timeout_s", -INF),
    ("handshake_timeout_s", 0.0),
    ("registration_ttl_s", NAN),
    ("write_deadline_s", -1),
    ("close_timeout_s", NAN),
    ("keepalive_s", -1.0),
    ("keepalive_s", NAN),
    ("timer_slack_ns", -1),
    ("timer_slack_ns", 1.5),
    ("timer_slack_ns", True),
    ("timer_slack_ns", np.int64(1000)),
]


@pytest.mark.parametrize(("field", "value"), HELD)
def test_held_workerconfig_refuses_nan_zero_negative_of_checked_bounds(field: str, value: Any) -> None:
    _assert_refused(field, value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("remote_port", True),
        ("remote_port", 5600.0),
        ("remote_port", NAN),
        ("remote_port", 0),
        ("remote_port", 65536),
        ("remote_port", 2**63),
        ("remote_port", "5600"),
        ("remote_port", np.int64(5600)),
        ("tp_size", True),
        ("tp_size", 2.0),
        ("tp_size", 0),
        ("tp_size", -1),
        ("tp_size", 2**63),
        ("pp_size", INF),
        ("pp_size", "1"),
    ],
)
def test_held_router_sizes_and_port_are_refused_naming_the_field(name: str, value: Any) -> None:
    params = {"remote_engine_id": "P", "remote_host": "h", "remote_port": 1, "transfer_id": "t"}
    params[name] = value
    with pytest.raises(ConfigError, match=name):
        TransferParams.from_dict(params)


@pytest.mark.parametrize("value", [True, NAN, INF, -1, 1.0, 2**63, 1e308, "3", [True], [0, -1]])
def test_held_block_start_refuses_out_of_range_and_non_ints(value: Any) -> None:
    with pytest.raises(ConfigError, match="block_start"):
        to_block_start(value)


@pytest.mark.parametrize("value", [True, NAN, INF, -1, 2.0, 2**63, 1e308, "5"])
def test_held_num_tokens_refuses_out_of_range_and_non_ints(value: Any) -> None:
    with pytest.raises(ConfigError, match="num_tokens"):
        check_num_tokens(value, "RequestMetadata.num_tokens")


def test_held_numpy_scalars_are_taken_where_an_engine_keeps_them() -> None:
    params = TransferParams(remote_engine_id="P", remote_host="h", remote_port=1, transfer_id="t")
    meta = RequestMetadata(
        request_id="r",
        block_ids=np.array([3, 4]),
        params=params,
        block_start=np.int32(2),
        num_tokens=np.int64(40),
    )
    assert meta.block_ids == ((3, 4),) and meta.block_start == (2,) and meta.num_tokens == 40


# --------------------------------------------------------------------------- finding 1: NaN timers


def test_nan_heartbeat_interval_is_refused_or_every_request_still_times_out() -> None:
    cluster = _cluster_or_refused("heartbeat_interval_s", heartbeat_interval_s=NAN, request_timeout_s=0.5)
    if cluster is None:
        return
    with cluster as c:
        for i in range(4):  # P never finishes them: each must fail at its 0.5 s watchdog
            c.add(f"d-{i}", [[i]], f"k-{i}")
            reason = c.wait_decode(f"d-{i}", timeout_s=4)[0]
            assert reason is not None and "no completion" in reason, reason


@pytest.mark.parametrize("field", ["heartbeat_interval_s", "fresh_s", "peer_silence_s"])
def test_nan_liveness_windows_are_refused(field: str) -> None:
    _assert_refused(field, NAN)


# --------------------------------------------------------------------------- finding 2: poll intervals


def test_nan_idle_poll_is_refused_or_the_rank_still_serves() -> None:
    cluster = _cluster_or_refused("idle_poll_s", idle_poll_s=NAN, request_timeout_s=1.0)
    if cluster is None:
        return
    with cluster as c:
        c.add("d-1", [[1, 2]], "k-1")
        c.finish("p-1", [[3, 4]], "k-1")
        assert c.wait_decode("d-1", timeout_s=3) == {0: None}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("idle_poll_s", NAN),
        ("idle_poll_s", INF),
        ("idle_poll_s", -1),
        ("idle_poll_s", "0.002"),
        ("busy_poll_s", NAN),
        ("busy_poll_s", -0.5),
        ("busy_poll_s", 1e308),
    ],
)
def test_bad_poll_intervals_are_refused(field: str, value: Any) -> None:
    _assert_refused(field, value)


# --------------------------------------------------------------------------- finding 3: timer slack


def test_huge_timer_slack_is_refused_or_harmless() -> None:
    cluster = _cluster_or_refused("timer_slack_ns", timer_slack_ns=2**40)
    if cluster is None:
        return
    with cluster as c:
        c.add("d-1", [[1, 2]], "k-1")
        c.finish("p-1", [[3, 4]], "k-1")
        assert c.wait_decode("d-1", timeout_s=3) == {0: None}


# --------------------------------------------------------------------------- finding 4: cuda_device


def test_bad_cuda_device_fails_start_not_the_writer() -> None:
    cluster = _cluster_or_refused("cuda_device", cuda_device="0")
    if cluster is None:
        return
    with cluster as c:
        c.add("d-1", [[1, 2]], "k-1")
        c.finish("p-1", [[3, 4]], "k-1")
        assert c.wait_decode("d-1", timeout_s=3) == {0: None}


# --------------------------------------------------------------------------- finding 5: unbounded bounds


def test_infinite_lease_is_refused_or_p_still_releases() -> None:
    cluster = _cluster_or_refused("lease_s", lease_s=INF, heartbeat_interval_s=0.1)
    if cluster is None:
        return
    with cluster as c:
        c.finish("p-1", [[3, 4]], "k-1")
        assert c.wait_prefill("p-1", timeout_s=3)[P0] is not None


INFINITE = [
    ("request_timeout_s", INF, {}),
    ("request_timeout_s", 1e308, {}),
    ("registration_ttl_s", INF, {}),
    ("write_deadline_s", INF, {}),  # published to D, whose metadata check refuses > 2**40
    ("write_deadline_s", 2.0**41, {}),
    ("handshake_timeout_s", INF, {}),  # fetch_metadata: int(inf * 1000) -> OverflowError
    ("close_timeout_s", INF, {}),
    ("peer_silence_s", INF, {}),
    ("lease_s", INF, {"heartbeat_interval_s": 1.0}),
    ("lease_s", INF, {}),  # refused today, but as "fresh_s (infs) must be shorter than ..."
    ("early_notification_ttl_s", INF, {}),
    ("early_notification_ttl_s", NAN, {}),
    ("engine_ttl_s", NAN, {}),
]


@pytest.mark.parametrize(("field", "value", "extra"), INFINITE)
def test_infinite_or_nan_bounds_are_refused_naming_the_field(
    field: str, value: Any, extra: dict[str, Any]
) -> None:
    _assert_refused(field, value, **extra)


# --------------------------------------------------------------------------- finding 6: types, signs


TYPES = [
    ("handshake_timeout_s", "5"),  # TypeError: '>' not supported between 'str' and 'int'
    ("heartbeat_interval_s", "5"),  # TypeError: can only concatenate str
    ("lease_s", True),  # a bool is 1 s
    ("request_timeout_s", True),
    ("fresh_s", True),
    ("heartbeat_interval_s", -1.0),  # fresh -2 s, silence 2 s: accepted
    ("fresh_s", 0.0),  # P may never post: every request fails at its watchdog
    ("fresh_s", -1.0),
    ("staging_bytes", "64"),  # TypeError deep in start()
    ("staging_bytes", 1.5),
    ("staging_bytes", -1),
    ("side_channel_port", 70000),  # advertised in PUSH_REG; P's decoder refuses it
    ("side_channel_port", -1),
    ("side_channel_port", True),
    ("side_channel_port", "5600"),
    ("cuda_device", -1),
    ("cuda_device", True),
    ("timer_slack_ns", 2**64),
]


@pytest.mark.parametrize(("field", "value"), TYPES)
def test_wrong_types_and_signs_are_refused_naming_the_field(field: str, value: Any) -> None:
    _assert_refused(field, value)


# --------------------------------------------------------------------------- finding 7: engine API waits


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(MHA) as c:
        yield c


def _wait_in_thread(c: Cluster, timeout: Any, tag: str) -> tuple[bool, BaseException | None]:
    """Call ``wait_finished(timeout)`` with nothing pending; whether it was still waiting after
    1.5 s, and what it raised. An empty request then wakes a stuck call (so no thread is left)."""
    receiver = c.receivers[0]
    box: dict[str, BaseException] = {}

    def call() -> None:
        try:
            receiver.wait_finished(timeout)
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(1.5)
    stuck = thread.is_alive()
    c.add(f"wake-{tag}", [], f"wake-{tag}")
    thread.join(5)
    assert not thread.is_alive()
    receiver.get_finished()
    return stuck, box.get("error")


@pytest.mark.parametrize("timeout", [NAN, None], ids=["nan", "none"])
def test_wait_finished_with_a_non_number_timeout_raises_at_once(cluster: Cluster, timeout: Any) -> None:
    stuck, error = _wait_in_thread(cluster, timeout, str(timeout))
    assert not stuck, f"wait_finished({timeout!r}) was still waiting after 1.5 s"
    assert isinstance(error, (ConfigError, ValueError)) and "timeout_s" in str(error), repr(error)


@pytest.mark.parametrize("timeout", [INF, 1e308, "5"])
def test_wait_finished_with_a_bad_timeout_names_it(cluster: Cluster, timeout: Any) -> None:
    stuck, error = _wait_in_thread(cluster, timeout, str(timeout))
    assert not stuck
    assert isinstance(error, ConfigError) and "timeout_s" in str(error), repr(error)


def test_held_wait_finished_with_zero_or_negative_timeout_times_out_at_once(cluster: Cluster) -> None:
    started = time.monotonic()
    for timeout in (0, -1.0, -INF):
        with pytest.raises(Exception, match="within"):
            cluster.receivers[0].wait_finished(timeout)
    assert time.monotonic() - started < 1.0


# --------------------------------------------------------------------------- finding 8: side channel


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("idle_timeout_s", NAN),
        ("idle_timeout_s", INF),
        ("max_connections", 2.5),
        ("port", 70000),
        ("port", -1),
    ],
)
def test_side_channel_server_refuses_bad_numbers(field: str, value: Any) -> None:
    server = None
    try:
        with pytest.raises(ConfigError, match=field):
            server = SideChannelServer("E", **{field: value})
    finally:
        if server is not None:
            server.close()


@pytest.mark.parametrize("value", ["float('nan')", "float('inf')"])
def test_side_channel_server_refuses_a_non_finite_zmtp_timeout(value: str) -> None:
    code = (
        "from kvpush.core.sidechannel import SideChannelServer\n"
        f"try:\n    SideChannelServer('E', zmtp_handshake_timeout_s={value})\n"
        "except Exception as err:\n    print(type(err).__name__, err, flush=True)\n"
        "import os; os._exit(0)\n"  # skip the leaked context's teardown
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("ConfigError") and "zmtp_handshake_timeout_s" in out, out


# --------------------------------------------------------------------------- finding 9: CLI


class _Ran(Exception):
    pass


def _ran(*_a: Any, **_k: Any) -> Any:
    raise _Ran


@pytest.mark.parametrize(
    "argv",
    [
        ["--rate", "nan"],
        ["--rate", "inf"],
        ["--prefill-ms", "nan"],
        ["--p99-factor", "nan"],
        ["--requests", "0"],
        ["--verify-every", "-1"],
    ],
)
def test_bench_serve_refuses_bad_numbers_before_running(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    from kvpush.cli import build_parser
    from kvpush.demo import serve

    monkeypatch.setattr(serve, "run", _ran)
    args = build_parser().parse_args(["bench", "--serve", *argv])
    assert serve.main(args) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--timeout", "inf"],
        ["--timeout", "nan"],
        ["--timeout", "-1"],
        ["--requests", "-1"],
        ["--max-blocks", "0"],
        ["--prefix-hit-rate", "nan"],
    ],
)
def test_demo_refuses_bad_numbers_before_running(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    from kvpush.cli import build_parser
    from kvpush.demo import runner

    monkeypatch.setattr(runner, "run_config", _ran)
    monkeypatch.setattr(runner, "check_transport_name", lambda *_a: None)
    monkeypatch.setattr(runner, "transport_notes", lambda *_a: None)
    args = build_parser().parse_args(["demo", "--layout", "mha", *argv])
    assert runner.main(args) == 2
