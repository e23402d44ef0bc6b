"""Probe of 2026-12-03: the lifecycle lock, the registered-caches check and the window-block
handshake check that landed that day, attacked for silent wrong KV, hangs, leaks and false
refusals.

Findings (each test failed before its fix):
1. ``close()`` called on the worker's own writer thread (from a plugin hook, a transport
   callback or a ``ready.query()``, which all run there) waited 10 s for a writer command that
   could never run (the writer was busy running close()), then raised ``RuntimeError: cannot
   join current thread``: the transport and registrations were never released, the pending
   requests never reported (their blocks lost to the engine) and the writer stalled for 10 s.
   Fixed: ``close()`` on the writer thread raises ``ConfigError`` at once and changes nothing;
   the worker goes on and a ``close()`` from another thread closes it.
2. A registered cache re-laid out in place (``resize_`` to another shape of the same size,
   ``set_`` / ``as_strided_`` on the same storage with other strides) kept its identity and its
   ``data_ptr``: the check passed, and P would push (D publish) blocks at the strides
   described at start while the engine writes them at others: wrong KV, silently. Fixed: the
   check compares each registered tensor's strides (and, on the slow path, element size) too.
3. A false refusal: an engine that puts a fresh view of the very same memory in its mapping
   (``kv_caches[name] = buffer[i]`` again; the same address, strides and dtype) was refused as
   "replaced". Fixed: a replacement viewing exactly the registered bytes is the same cache
   (the registered storage is held, so the address cannot belong to another allocation); it is
   adopted and the cheap path holds again.
4. Caches held as attributes of a plain object (a layout plugin's ``{"layer": KV(k, v)}``, no
   ``.tensor``) were not walked: nothing was registered for the check, so ``obj.k`` replaced
   passed silently. Fixed: the walk enters an object's ``__dict__`` (identity-compared like a
   mapping; bounded depth, each object once).
5. ``close()`` from a signal handler (an engine's SIGTERM handler) that interrupted a kvpush
   call holding the results lock on the same thread (``add_request``, ``get_finished``) waited
   for ever for that lock (new with the day's ``_closing`` flag set under it): the process hung
   at shutdown (the test's subprocess ran past 60 s). Fixed: close() waits at most
   ``CLOSE_LOCK_WAIT_S`` (5 s) for the lock, then raises ``ConfigError`` and changes nothing; a
   close() once the interrupted call returned closes the worker.

Checked and held (tested here): ``close()`` inside ``with worker:`` while another thread
holds the results lock waits for the lock only; after close, ``add_request``, ``cancel``,
``request_finished``, ``abort`` and ``request_abandoned`` raise ``ConfigError`` ("which is
closed"), ``get_finished`` answers and a second close returns; ``(K, V)`` tuples, per-layer
views of one buffer (as vLLM allocates), a new unrelated key; a resize_ that only shrinks
(every byte where it was) is accepted; the cheap check's cost for 80 and 160 layers.
Read and held (tested elsewhere): a start hung in transport creation vs a concurrent close
(tests/test_probe_api_threads.py); the window-block check: 0 (a whole group) vs ``None`` (not
stated: unchecked, the pairing refuses per request), group counts equal on PP stages (vLLM
lists every transfer group on each stage). Not covered by the check (documented): memory
remapped under the same address (vLLM sleep mode), a dtype reinterpreted at the same element
size, a slotted object's attributes other than ``.tensor``; for vLLM the check sees the
connector's own dict of wrappers, so it guards the tensors' address and strides only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cluster import Cluster

from kvpush.core.errors import ConfigError
from kvpush.core.registered_caches import RegisteredCaches
from kvpush.core.types import KVRegion, RankKey

P0 = RankKey(0, 0)
SLOW_SILENCE = {"request_timeout_s": 60, "heartbeat_interval_s": 5.0}


def _regions(named: Sequence[tuple[str, torch.Tensor]]) -> list[KVRegion]:
    """One region over each tensor: its two rows as two blocks (row strides as registered)."""
    return [
        KVRegion(
            base_addr=tensor.data_ptr(),
            block_len=tensor[0].numel() * tensor.element_size(),
            block_stride=tensor.stride(0) * tensor.element_size(),
            num_blocks=2,
            mem_type="DRAM",
            device_id=0,
            layer_names=(layer,),
        )
        for layer, tensor in named
    ]


def _check(caches: RegisteredCaches) -> None:
    caches.check("request_finished", "P-prefill-pp0-tp0")


def _refused(caches: RegisteredCaches, *words: str) -> str:
    with pytest.raises(ConfigError) as err:
        _check(caches)
    text = str(err.value)
    for word in words:
        assert word in text, text
    return text


# ---------------------------------------------------------------------------- finding 1


def _close_on_writer(worker: Any) -> tuple[BaseException | None, float]:
    """Run ``worker.close()`` on its writer thread (as a plugin hook would); what it raised
    and how long it took (bounded wait: 30 s)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def hook() -> None:
        began = time.monotonic()
        try:
            worker.close()
        except BaseException as err:  # reported to the test
            box["error"] = err
        finally:
            box["took"] = time.monotonic() - began
            done.set()

    worker.run_on_writer(hook)
    assert done.wait(30.0), "close() on the writer thread did not return within 30 s"
    return box.get("error"), box["took"]


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_close_on_the_writer_thread_is_refused_at_once_and_the_worker_goes_on(role: str) -> None:
    """close() from a hook running on the writer: refused at once (ConfigError naming the
    writer thread), nothing changed; requests still move, and close() from the engine's
    thread then closes the worker (its transport released)."""
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        worker = cluster.receivers[0] if role == "decode" else cluster.senders[P0]
        error, took = _close_on_writer(worker)
        assert isinstance(error, ConfigError) and "writer thread" in str(error), repr(error)
        assert took < 1.0, f"close() on the writer thread took {took:.1f}s"
        assert not worker._closing
        cluster.add("d-1", [[3]], "x-1")
        cluster.finish("p-1", [[5]], "x-1")
        assert cluster.wait_decode("d-1") == {0: None}
        worker.close()
        assert worker._transport_closed and worker._thread is not None and not worker._thread.is_alive()


# ---------------------------------------------------------------------------- finding 2


def _relaid(kind: str, tensor: torch.Tensor) -> None:
    """Re-lay ``tensor`` (2 x 8) out in place, keeping its object and its data_ptr."""
    if kind == "resize_":
        tensor.resize_(8, 2)
    elif kind == "set_":
        tensor.set_(tensor.untyped_storage(), 0, (2, 8), (1, 2))
    else:
        tensor.as_strided_((2, 8), (1, 2))


@pytest.mark.parametrize("kind", ["resize_", "set_", "as_strided_"])
def test_a_cache_re_laid_out_in_place_is_refused(kind: str) -> None:
    caches = {f"layers.{i}": torch.zeros(2, 8) for i in range(3)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    _check(registered)
    address = caches["layers.1"].data_ptr()
    _relaid(kind, caches["layers.1"])
    assert caches["layers.1"].data_ptr() == address  # what the check compared before
    _refused(registered, "'layers.1'", "strides")


def test_a_decode_cache_re_laid_out_in_place_is_refused_at_add_request() -> None:
    """The same over real NIXL: D's tensor set_ to other strides on its registered storage."""
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        caches = cluster.d_caches[0]
        name = next(iter(caches))
        tensor = caches[name]
        tensor.set_(
            tensor.untyped_storage(), 0, tuple(reversed(tensor.shape)), tuple(reversed(tensor.stride()))
        )
        with pytest.raises(ConfigError, match="strides") as err:
            cluster.add("d-1", [[3]], "x-1")
        assert repr(name) in str(err.value), err.value


def test_a_shrink_in_place_keeping_every_byte_where_it_was_is_accepted() -> None:
    """``resize_`` to fewer rows keeps the strides and the address: the bytes of each block
    lie where they were registered (the engine passes only blocks it has)."""
    caches = {"layers.0": torch.zeros(2, 8)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    caches["layers.0"].resize_(1, 8)
    _check(registered)


# ---------------------------------------------------------------------------- finding 3


def test_a_fresh_view_of_the_same_memory_is_the_same_cache() -> None:
    buffer = torch.zeros(4, 2, 8)  # one buffer sliced per layer (as vLLM allocates)
    caches = {f"layers.{i}": buffer[i] for i in range(4)}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    caches["layers.1"] = buffer[1]  # the engine re-made its view: the same bytes
    _check(registered)
    _check(registered)  # adopted: the cheap path again
    assert registered.registered["layers.1"][0] is caches["layers.1"]
    caches["layers.2"] = buffer[3]  # another layer's memory: refused
    _refused(registered, "'layers.2'", "replaced")


def test_a_view_of_the_same_address_with_other_strides_is_refused() -> None:
    buffer = torch.zeros(2, 8)
    caches = {"layers.0": buffer}
    registered = RegisteredCaches(caches, _regions(list(caches.items())))
    caches["layers.0"] = buffer.view(8, 2)
    _refused(registered, "'layers.0'", "replaced")


# ---------------------------------------------------------------------------- finding 4


class _KV:
    """A layout plugin's cache object: K and V as plain attributes (no ``.tensor``)."""

    def __init__(self) -> None:
        self.k = torch.zeros(2, 8)
        self.v = torch.zeros(2, 8)


def test_a_tensor_replaced_in_a_plain_objects_attributes_is_refused() -> None:
    caches = {f"layers.{i}": _KV() for i in range(2)}
    named = [(f"layers.{i}", getattr(caches[f"layers.{i}"], part)) for i in range(2) for part in "kv"]
    registered = RegisteredCaches(caches, _regions(named))
    assert set(registered.registered) == {"layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"}
    _check(registered)
    caches["layers.1"].v = torch.zeros(2, 8)
    _refused(registered, "'layers.1.v'", "replaced")


def test_an_object_cycle_in_the_caches_is_walked_once() -> None:
    kv = _KV()
    kv.owner = {"back": kv}  # type: ignore[attr-defined]
    caches = {"layers.0": kv}
    registered = RegisteredCaches(caches, _regions([("layers.0", kv.k)]))
    _check(registered)
    kv.k = torch.zeros(2, 8)
    _refused(registered, "'layers.0.k'")


# ---------------------------------------------------------------------------- checked and held


def test_k_v_tuples_and_a_new_key_and_views_of_one_buffer_hold() -> None:
    buffer = torch.zeros(3, 2, 2, 8)
    caches: dict[str, Any] = {f"layers.{i}": (buffer[i, 0], buffer[i, 1]) for i in range(3)}
    named = [(name, pair[j]) for name, pair in caches.items() for j in range(2)]
    registered = RegisteredCaches(caches, _regions(named))
    assert len(registered.registered) == 6
    caches["scratch"] = torch.zeros(1)
    _check(registered)
    caches["layers.2"] = (buffer[2, 0], torch.zeros(2, 8))
    _refused(registered, "'layers.2[1]'")


@pytest.mark.parametrize("layers", [80, 160])
def test_the_cheap_check_costs_microseconds_per_call(layers: int) -> None:
    """Measured on this 2-core host (loaded): printed; bounded generously (a regression to a
    walk per call costs ~10x)."""
    caches = {f"layers.{i}": (torch.zeros(2, 8), torch.zeros(2, 8)) for i in range(layers)}
    named = [(name, pair[j]) for name, pair in caches.items() for j in range(2)]
    registered = RegisteredCaches(caches, _regions(named))
    calls = 2000
    began = time.perf_counter()
    for _ in range(calls):
        _check(registered)
    per_call_us = (time.perf_counter() - began) / calls * 1e6
    print(f"RegisteredCaches.check, {layers} layers of (K, V): {per_call_us:.1f} us/call")
    assert per_call_us < layers * 2.0, per_call_us


def test_close_waits_only_for_a_results_lock_another_thread_holds() -> None:
    """``with worker:`` ends while the engine's collector thread holds the results lock for a
    moment: close() takes it once released, closes, and the collector's calls go on."""
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        receiver = cluster.receivers[0]
        held, release = threading.Event(), threading.Event()

        def collector() -> None:
            with receiver._results_lock:
                held.set()
                release.wait(10.0)

        thread = threading.Thread(target=collector, name="collector", daemon=True)
        thread.start()
        assert held.wait(5.0), "the collector did not take the lock"
        threading.Timer(0.3, release.set).start()
        began = time.monotonic()
        receiver.close()
        assert time.monotonic() - began < 5.0
        thread.join(5.0)
        assert receiver._transport_closed
        assert receiver.get_finished().done == ()


def test_calls_after_close_are_refused_naming_the_close_or_report_nothing() -> None:
    """After close(): the calls that act on requests raise ConfigError ("which is closed"),
    get_finished() answers (nothing new), a second close() returns."""
    with Cluster(transport="nixl", **SLOW_SILENCE) as cluster:
        receiver, sender = cluster.receivers[0], cluster.senders[P0]
        receiver.close()
        sender.close()
        for call in (
            lambda: cluster.add("d-1", [[3]], "x-1"),
            lambda: receiver.cancel("d-1"),
            lambda: sender.request_finished("p-1", [[5]], match_key="x-1"),
            lambda: sender.abort("p-1"),
            lambda: sender.request_abandoned("p-1"),
        ):
            with pytest.raises(ConfigError, match="which is closed"):
                call()
        assert receiver.get_finished().done == () and sender.get_finished().sent == ()
        receiver.close()
        sender.close()


_SIGNAL_CLOSE = """
import signal, sys, time
sys.path.insert(0, "tests")
from cluster import Cluster
from kvpush.core.errors import ConfigError

with Cluster(transport="nixl", request_timeout_s=60, heartbeat_interval_s=5.0) as cluster:
    receiver = cluster.receivers[0]
    outcome = []

    def on_term(signum, frame):
        try:
            receiver.close()
            outcome.append("closed")
        except ConfigError as err:
            outcome.append(f"refused: {err}")

    signal.signal(signal.SIGALRM, on_term)
    with receiver._results_lock:  # as inside add_request / get_finished on this thread
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        deadline = time.monotonic() + 15.0
        while not outcome and time.monotonic() < deadline:
            time.sleep(0.01)
    print("OUTCOME", outcome, flush=True)
    receiver.close()
    print("CLOSED", receiver._transport_closed, flush=True)
"""


def test_close_in_a_signal_handler_interrupting_a_kvpush_call_does_not_hang() -> None:
    """An engine's SIGTERM handler calls close() while the main thread it interrupted is
    inside a kvpush call holding the results lock (add_request, get_finished): close() must
    not wait for ever for the lock its own thread holds. It is refused (ConfigError, bounded)
    and a close() once the call returned closes the worker."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_CLOSE], capture_output=True, text=True, timeout=60, check=False
    )
    assert 'OUTCOME ["refused: ' in done.stdout, done.stdout + done.stderr[-3000:]
    assert "results lock" in done.stdout, done.stdout
    assert "CLOSED True" in done.stdout, done.stdout + done.stderr[-3000:]
