"""Issue 16, item 5: the engine API validates at the call.

Ids are non-empty strings, the match key is present, block ids are non-negative, unique and
within the rank's capacity, a second finish of a key is refused (or, once the first ended,
reported failed), and calls on a worker that is not started or already closed raise. Each is a
``ConfigError`` naming the argument (or the call). Empty requests complete at once.

The workers run on the loopback transport: these are checks at the call, before any transfer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import MHA, Cluster, settle, wait_until

from kvpush.core.errors import ConfigError
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.types import ParallelConfig, RankKey, RequestMetadata, TransferParams
from kvpush.core.worker import WorkerConfig
from kvpush.layouts.uniform import allocate_kv_caches

P0 = RankKey(0, 0)
BLOCKS = 64  # Cluster's num_blocks

BAD_IDS = ["", 5, None, b"rid", ["rid"]]
BAD_BLOCKS = [
    ([[-1]], "non-negative"),
    ([-1], "non-negative"),  # a flat list is one group
    ([[3, -2]], "non-negative"),
    ([[9, 9]], "repeat"),
    ([9, 9], "repeat"),
    ([[BLOCKS]], "beyond"),
    ([BLOCKS + 100], "beyond"),
    ([[1], [2]], "group"),  # one KV group on this model
    ([["a"]], "block"),
    ([[1.5]], "block"),
    ("12", "block"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(MHA) as c:
        yield c


def _params(cluster: Cluster, key: str | None = "x-1", **extra: Any) -> dict[str, Any]:
    params = cluster.params(key or "")
    if key is None:
        del params["transfer_id"]
    params.update(extra)
    return params


def _meta(cluster: Cluster, rid: Any, blocks: Any, key: str = "x-1") -> RequestMetadata:
    return RequestMetadata(
        request_id=rid, block_ids=blocks, params=TransferParams.from_dict(_params(cluster, key))
    )


# ---------------------------------------------------------------------------- P: request_finished


@pytest.mark.parametrize("rid", BAD_IDS, ids=repr)
def test_finish_refuses_a_request_id_that_is_not_a_non_empty_string(cluster: Cluster, rid: Any) -> None:
    with pytest.raises(ConfigError, match="request_id"):
        cluster.senders[P0].request_finished(rid, [[1]], match_key="k")


@pytest.mark.parametrize("key", ["", 7, b"k"], ids=repr)
def test_finish_refuses_a_match_key_that_is_not_a_non_empty_string(cluster: Cluster, key: Any) -> None:
    with pytest.raises(ConfigError, match="match_key"):
        cluster.senders[P0].request_finished("p-mk", [[1]], match_key=key)


@pytest.mark.parametrize("engine", ["", 3], ids=repr)
def test_finish_refuses_a_bad_decode_engine_id(cluster: Cluster, engine: Any) -> None:
    with pytest.raises(ConfigError, match="decode_engine_id"):
        cluster.senders[P0].request_finished("p-de", [[1]], match_key="k-de", decode_engine_id=engine)


@pytest.mark.parametrize(("blocks", "why"), BAD_BLOCKS, ids=repr)
def test_finish_refuses_bad_block_ids_naming_the_argument(cluster: Cluster, blocks: Any, why: str) -> None:
    with pytest.raises(ConfigError, match="block") as info:
        cluster.senders[P0].request_finished("p-bb", blocks, match_key="k-bb")
    assert why in str(info.value), str(info.value)
    assert "block_ids" in str(info.value) or "block id" in str(info.value), str(info.value)


def test_a_second_finish_of_a_key_in_progress_is_refused(cluster: Cluster) -> None:
    sender = cluster.senders[P0]
    sender.request_finished("p-2a", [[1]], match_key="k-2")  # no D registers: stays pending
    with pytest.raises(ConfigError, match="match_key 'k-2'"):
        sender.request_finished("p-2b", [[2]], match_key="k-2")
    settle(sender)
    assert "p-2b" not in sender.get_finished().failed


def test_a_finish_of_a_key_that_already_ended_is_reported_failed(cluster: Cluster) -> None:
    cluster.add("d-3", [[11]], "k-3")
    cluster.finish("p-3", [[12]], "k-3")
    assert cluster.wait_decode("d-3") == {0: None}
    assert cluster.wait_prefill("p-3") == {P0: None}
    sender = cluster.senders[P0]
    posted = sender.transport.counters.writes_posted
    del cluster.p_results[P0]["p-3"]
    sender.request_finished("p-3", [[13]], match_key="k-3")  # the same prefill again
    reason = cluster.wait_prefill("p-3")[P0]
    assert reason is not None and "already ended" in reason
    # Another prefill of the key is a new attempt (a retry): it waits for a registration newer
    # than the key's end, and D's done one is not (never written again).
    sender.request_finished("p-3b", [[13]], match_key="k-3")
    time.sleep(0.3)
    cluster.poll()
    assert "p-3b" not in cluster.p_results[P0] and sender.transport.counters.writes_posted == posted
    sender.abort("p-3b", match_key="k-3")
    assert cluster.wait_prefill("p-3b")[P0] is not None


def test_a_finish_with_no_blocks_is_sent_at_once(cluster: Cluster) -> None:
    sender = cluster.senders[P0]
    for rid, blocks in (("p-e1", [[]]), ("p-e2", []), ("p-e3", None)):
        sender.request_finished(rid, blocks, match_key=f"k-{rid}")
    settle(sender)
    got = sender.get_finished()
    assert set(got.sent) >= {"p-e1", "p-e2", "p-e3"}, got


# ---------------------------------------------------------------------------- D: add_request


@pytest.mark.parametrize("rid", BAD_IDS, ids=repr)
def test_add_refuses_a_request_id_that_is_not_a_non_empty_string(cluster: Cluster, rid: Any) -> None:
    receiver = cluster.receivers[0]
    with pytest.raises(ConfigError, match="request_id"):
        receiver.add_request_params(rid, [[1]], _params(cluster))
    with pytest.raises(ConfigError, match="request_id"):
        receiver.add_request(_meta(cluster, rid, [[1]]))


def test_add_refuses_params_without_a_match_key(cluster: Cluster) -> None:
    receiver = cluster.receivers[0]
    params = _params(cluster, None)
    params.pop("remote_request_id", None)
    with pytest.raises(ConfigError, match="transfer_id"):
        receiver.add_request_params("d-nokey", [[1]], params)
    assert receiver.pending_requests == 0


@pytest.mark.parametrize(("blocks", "why"), BAD_BLOCKS, ids=repr)
def test_add_refuses_bad_block_ids_naming_the_argument(cluster: Cluster, blocks: Any, why: str) -> None:
    receiver = cluster.receivers[0]
    with pytest.raises(ConfigError, match="block") as info:
        receiver.add_request_params("d-bb", blocks, _params(cluster, "k-dbb"))
    assert why in str(info.value), str(info.value)
    assert receiver.pending_requests == 0


def test_a_second_add_of_a_request_in_progress_is_refused(cluster: Cluster) -> None:
    receiver = cluster.receivers[0]
    receiver.add_request_params("d-twice", [[20]], _params(cluster, "k-twice"))
    with pytest.raises(ConfigError, match="request_id 'd-twice'"):
        receiver.add_request_params("d-twice", [[21]], _params(cluster, "k-twice"))
    receiver.cancel("d-twice")
    wait_until(lambda: "d-twice" in receiver.get_finished().released, what="the cancel's release")


def test_an_add_with_no_blocks_is_done_at_once(cluster: Cluster) -> None:
    receiver = cluster.receivers[0]
    for rid, blocks in (("d-e1", [[]]), ("d-e2", []), ("d-e3", None)):
        receiver.add_request_params(rid, blocks, _params(cluster, f"k-{rid}"))
    got = receiver.get_finished()  # no wait: done in the call
    assert set(got.done) == {"d-e1", "d-e2", "d-e3"}, got
    assert receiver.pending_requests == 0


def test_an_add_with_blocks_is_not_done_before_its_bytes(cluster: Cluster) -> None:
    """The duplicate-ids case of the issue ([9, 9] reported done with a block lost) is refused at
    the call (above); a valid request completes only with P's DONE."""
    receiver = cluster.receivers[0]
    cluster.add("d-9", [[9, 10]], "k-9")
    settle(receiver)
    assert "d-9" not in receiver.get_finished().done
    cluster.finish("p-9", [[30, 31]], "k-9")
    assert cluster.wait_decode("d-9") == {0: None}


# ---------------------------------------------------------------------------- lifecycle


def _worker(kind: type, port: int = 1) -> Any:
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=MHA.num_layers)
    config = WorkerConfig(
        engine_id="V", parallel=parallel, model=MHA, transport="loopback", side_channel_port=port
    )
    return kind(config, allocate_kv_caches(MHA, parallel, 8), pm=_pm())


def _pm() -> Any:
    import kvpush.transports.loopback
    from kvpush.core.manager import get_plugin_manager

    return get_plugin_manager(load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback)])


def _calls(cluster: Cluster, worker: Any) -> list[tuple[str, Any]]:
    if isinstance(worker, PushSender):
        return [
            ("request_finished", lambda: worker.request_finished("p-l", [[1]], match_key="k-l")),
        ]
    return [
        ("add_request", lambda: worker.add_request(_meta(cluster, "d-l", [[1]]))),
        ("add_request", lambda: worker.add_request_params("d-l", [[1]], _params(cluster))),
        ("cancel", lambda: worker.cancel("d-l")),
    ]


@pytest.mark.parametrize("kind", [PushSender, PushReceiver], ids=lambda k: k.__name__)
def test_calls_before_start_raise_naming_the_call(cluster: Cluster, kind: type) -> None:
    worker = _worker(kind)
    with pytest.raises(ConfigError, match="start"):
        worker.handshake_payload()
    for name, call in _calls(cluster, worker):
        with pytest.raises(ConfigError, match=rf"{name}.*not started"):
            call()


@pytest.mark.parametrize("kind", [PushSender, PushReceiver], ids=lambda k: k.__name__)
def test_calls_after_close_raise_naming_the_call(cluster: Cluster, kind: type) -> None:
    worker = _worker(kind)
    worker.start()
    worker.close()
    for name, call in _calls(cluster, worker):
        with pytest.raises(ConfigError, match=rf"{name}.*closed"):
            call()
    with pytest.raises(ConfigError, match="already started"):
        worker.start()
