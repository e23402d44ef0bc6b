"""Block ids of fewer KV groups than the rank holds are refused at the call.

A flat list on a two-group (hybrid) model is group 0's ids alone. It used to be taken: on P
the request failed only at posting, after D had registered, and D fenced P's connections for
it (every other request on them failed over); on D the registration named no block of group 1.
Now both legs refuse it at the call, naming the groups and the form to use. A rank that holds
no layer of a group (a PP stage) and empty id lists (a full prefix hit) are not affected.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvpush.transports.loopback
from kvpush.core.errors import ConfigError
from kvpush.core.manager import get_plugin_manager
from kvpush.core.receiver import PushReceiver
from kvpush.core.sender import PushSender
from kvpush.core.sidechannel import SideChannelServer
from kvpush.core.types import ModelSpec, ParallelConfig
from kvpush.core.worker import WorkerConfig
from kvpush.layouts.hma import allocate_hma_caches

KINDS = ("sliding_window", "full", "sliding_window", "full")
MODEL = ModelSpec(
    name="hybrid-groups",
    num_layers=4,
    num_kv_heads=2,
    head_dim=8,
    block_size=4,
    dtype="bfloat16",
    layer_groups=tuple(0 if kind == "full" else 1 for kind in KINDS),
    layer_kinds=KINDS,
)
PARALLEL = ParallelConfig(tp_size=1, tp_rank=0, num_layers=4)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[PushSender, PushReceiver]]:
    pm = get_plugin_manager(load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback)])
    made = []
    server = SideChannelServer("D")
    for engine, cls in (("P", PushSender), ("D", PushReceiver)):
        config = WorkerConfig(
            engine_id=engine,
            parallel=PARALLEL,
            model=MODEL,
            layout="hma",
            transport="loopback",
            side_channel_port=server.port,
        )
        worker = cls(config, allocate_hma_caches(MODEL, PARALLEL, (16, 16)), pm=pm)
        worker.start()
        made.append(worker)
    yield made[0], made[1]
    for worker in made:
        worker.close()
    server.close()


@pytest.mark.parametrize("blocks", [[1, 2, 3], [[1, 2, 3]]], ids=["flat", "one-group"])
def test_ids_of_one_group_on_a_two_group_model_are_refused_on_both_legs(
    workers: tuple[PushSender, PushReceiver], blocks: list
) -> None:
    sender, receiver = workers
    with pytest.raises(ConfigError, match=r"one id list per KV group.*\[0, 1\]|\[0, 1\].*one id list"):
        sender.request_finished("p-1", blocks, match_key="k-1")
    params = {"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 1, "transfer_id": "k-1"}
    with pytest.raises(ConfigError, match="one id list per KV group"):
        receiver.add_request_params("d-1", blocks, params)
    assert receiver.pending_requests == 0


def test_ids_of_every_group_and_empty_lists_are_taken(workers: tuple[PushSender, PushReceiver]) -> None:
    sender, _ = workers
    sender.request_finished("p-2", [[1, 2, 3], [4]], match_key="k-2")  # D never registers: it waits
    sender.request_finished("p-3", [], match_key="k-3")  # nothing to push: done at once


def test_num_tokens_is_refused_on_a_several_group_model(workers: tuple[PushSender, PushReceiver]) -> None:
    # A token count does not say which of a sliding-window group's ids are the prompt's.
    sender, _ = workers
    with pytest.raises(ConfigError, match="one-group"):
        sender.request_finished("p-4", [[1, 2], [3]], match_key="k-4", num_tokens=5)


@pytest.mark.parametrize(
    ("num_tokens", "why"), [(-1, "non-negative"), (True, "non-negative"), (9, "needs 3")]
)
def test_num_tokens_out_of_range_is_refused(num_tokens: object, why: str) -> None:
    pm = get_plugin_manager(load_entrypoints=False, plugins=[("loopback", kvpush.transports.loopback)])
    model = ModelSpec(name="one-group", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    parallel = ParallelConfig(tp_size=1, tp_rank=0, num_layers=2)
    from kvpush.layouts.uniform import allocate_kv_caches

    config = WorkerConfig(engine_id="P1", parallel=parallel, model=model, transport="loopback")
    sender = PushSender(config, allocate_kv_caches(model, parallel, 8), pm=pm)
    sender.start()
    try:
        with pytest.raises(ConfigError, match=why):
            sender.request_finished("p-5", [1, 2], match_key="k-5", num_tokens=num_tokens)
    finally:
        sender.close()
