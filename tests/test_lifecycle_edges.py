"""Issue 11.5: start() cleans up what it made when a later step fails; close() reports every
pending request failed and never releases memory under a live writer; empty requests complete at
once."""

from __future__ import annotations

import pytest
import torch
from cluster import MHA, Cluster, kv_bytes, wait_until

import kvpush.transports.loopback as loopback
from kvpush import hookimpl
from kvpush.core.errors import ConfigError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.sender import PushSender
from kvpush.core.types import ParallelConfig, RankKey
from kvpush.core.worker import WorkerConfig
from kvpush.layouts.uniform import allocate_kv_caches


class BrokenExtensions:
    @staticmethod
    @hookimpl
    def kvpush_metadata_extensions(local):
        raise RuntimeError("extension plugin broke")


def test_start_releases_the_agent_when_a_later_step_fails() -> None:
    pm = get_plugin_manager(load_entrypoints=False, plugins=[("loopback", loopback)])
    pm.register(BrokenExtensions(), "broken")
    parallel = ParallelConfig(tp_size=1, num_layers=MHA.num_layers)
    config = WorkerConfig(engine_id="P-start", parallel=parallel, model=MHA, transport="loopback")
    sender = PushSender(config, allocate_kv_caches(MHA, parallel, 8), pm=pm)
    with pytest.raises(Exception, match="extension plugin broke"):
        sender.start()
    assert sender.transport is not None and sender.transport.counters.peers_loaded == 0
    assert "P-start-prefill-pp0-tp0" not in loopback._AGENTS  # the agent was closed again


def test_close_reports_every_pending_request_failed() -> None:
    cluster = Cluster(request_timeout_s=60)
    try:
        cluster.add("d-1", [[1]], "x-1")  # P never finishes it
        cluster.finish("p-2", [[2]], "x-2")  # D never registers it
        sender, receiver = cluster.senders[RankKey(0, 0)], cluster.receivers[0]
    finally:
        cluster.close()
    p_results, d_results = sender.get_finished(), receiver.get_finished()
    assert "worker closed" in p_results.failed["p-2"]
    assert "worker closed" in d_results.failed["d-1"] and "d-1" in d_results.released
    with pytest.raises(ConfigError, match="which is closed"):
        receiver.add_request_params("d-3", [[1]], cluster.params("x-3"))
    with pytest.raises(ConfigError, match="which is closed"):
        sender.request_finished("p-3", [[1]])


def test_close_closes_the_transport_after_requests_were_released() -> None:
    """The worker's "transport closed" flag shared its name with D's list of released requests:
    a D that had released a request never closed its transport, and one that had not broke
    ``get_finished()`` after close."""
    cluster = Cluster(request_timeout_s=60)
    try:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[1]], "x-1")
        receiver.cancel("d-1")
        cluster.wait_released("d-1")
        cluster.add("d-2", [[2]], "x-2")
        receiver.cancel("d-2")
        wait_until(lambda: receiver.pending_requests == 0, what="d-2 released")
    finally:
        cluster.close()
    assert receiver.agent_name not in loopback._AGENTS
    assert receiver.get_finished().released == ("d-2",)


def test_empty_requests_complete_at_once() -> None:
    with Cluster() as cluster:
        cluster.add("d-empty", [[]], "x-empty")
        cluster.finish("p-empty", [[]], "x-empty")
        assert cluster.wait_decode("d-empty", timeout_s=2) == {0: None}
        assert cluster.wait_prefill("p-empty", timeout_s=2) == {RankKey(0, 0): None}


def test_p_abort_fails_decode_at_once_and_releases_p() -> None:
    """A prefill the P engine aborts reaches D as a failure within a heartbeat, not at D's
    watchdog."""
    with Cluster(request_timeout_s=60, heartbeat_interval_s=0.1) as cluster:
        sender = cluster.senders[RankKey(0, 0)]
        cluster.finish("p-1", [[1]], "x-1")  # D has not registered yet
        sender.abort("p-1", match_key="x-1")
        assert "aborted by the prefill engine" in cluster.wait_prefill("p-1")[RankKey(0, 0)]
        cluster.add("d-1", [[2]], "x-1")
        reason = cluster.wait_decode("d-1", timeout_s=5)[0]
        assert reason is not None and "aborted by the prefill engine" in reason


def test_a_reused_request_id_and_an_id_equal_to_its_alias_are_received_apart() -> None:
    """D registers a reused id under an alias (``d-1#n``); an engine id that happens to equal
    a live alias is aliased too, so the two never meet in the core or on the wire."""
    with Cluster(request_timeout_s=60) as cluster:
        receiver = cluster.receivers[0]
        cluster.add("d-1", [[1]], "x-1")
        receiver.cancel("d-1")
        cluster.wait_released("d-1")
        cluster.d_results[0].clear()
        cluster.add("d-1", [[2]], "x-2")  # registered as d-1#1
        cluster.add("d-1#1", [[3]], "x-3")
        cluster.finish("p-3", [[7]], "x-3")
        cluster.finish("p-2", [[6]], "x-2")
        assert cluster.wait_decode("d-1") == {0: None}
        assert cluster.wait_decode("d-1#1") == {0: None}
        for name, tensor in cluster.d_caches[0].items():
            dst, src = kv_bytes(tensor), kv_bytes(cluster.p_caches[RankKey(0, 0)][name])
            assert torch.equal(dst[:, 2], src[:, 6]) and torch.equal(dst[:, 3], src[:, 7]), name


def test_a_request_id_too_long_for_the_wire_is_refused_naming_the_limit() -> None:
    with Cluster() as cluster, pytest.raises(ConfigError, match="at most 1000 chars"):
        cluster.add("d" * 1001, [[1]], "x-1")
