"""kvpush as an out-of-tree vLLM KV connector (vLLM 0.33).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvpushConnector",
                           "kv_connector_module_path": "kvpush.engines.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {...}}'

vLLM builds the connector twice: a **scheduler half** in the engine-core process and a **worker
half** in every worker (one per PP stage × TP rank). This module imports vLLM; nothing else in
kvpush imports it. The flow (docs/vllm.md has the details and the comparison with vLLM's
in-tree ``NixlPushConnector``):

- Start-up: every worker builds a :class:`PushSender` (P) or :class:`PushReceiver` (D) in
  ``register_kv_caches``; its handshake payload reaches the scheduler through
  ``get_handshake_metadata`` → ``set_xfer_handshake_metadata_pp_aware``, and the scheduler half's
  :class:`SideChannelServer` serves it per ``(pp_rank, tp_rank)``.
- D: ``update_state_after_alloc`` stages the request's uncached blocks; the worker adds the
  request to its receiver (handshake with P, ``PUSH_REG``) and reports it in
  ``finished_recving`` once the KV landed, or failed (``failed_recving`` → vLLM's
  ``kv_load_failure_policy``) once kvpush released the blocks (no WRITE can land any more).
  An abort while receiving returns ``(True, None)``; the worker cancels and reports the
  request only when kvpush says no WRITE can land any more, so vLLM frees the blocks only then.
- P: ``request_finished`` stages the prompt's blocks and returns the ``kv_transfer_params`` D
  needs; the worker hands them to its sender and reports ``finished_sending`` when every WRITE
  settled (or failed, or the lease expired), keeping ``has_pending_push_work`` true meanwhile.
- Both legs fingerprint their own ``prompt_token_ids`` (P: in ``request_finished``, also
  returned as ``kv_transfer_params['prompt_fingerprint']``; D: in its registration). P writes
  nothing into a D request whose prompt differs (a router that reused a key): both fail.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpush.core.errors import ConfigError
from kvpush.engines.vllm_config import ConnectorSettings, match_key, model_identity, parent_request_id

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

BlockIds = tuple[tuple[int, ...], ...]


@dataclass
class KvpushHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's kvpush handshake payload, carried to the scheduler by vLLM."""

    payload: bytes


@dataclass
class RecvItem:
    """D: a request to receive, in scheduler block ids per KV-cache (transfer) group."""

    block_ids: BlockIds
    kv_transfer_params: dict[str, Any]
    error: str | None = None
    """Why the request cannot be received (malformed kv_transfer_params): the worker fails it."""
    num_tokens: int | None = None
    """The prompt's length: the worker registers no kernel block past its last token."""
    block_start: tuple[int, ...] | None = None
    """Per transfer group, the index of the first registered scheduler block in the request's
    block table (the blocks of D's local prefix hit, and a sliding-window group's blocks out of
    its window): the worker states it in kernel blocks, and P pairs by it."""


@dataclass
class SendItem:
    """P: a finished prefill to push."""

    block_ids: BlockIds
    match_key: str
    decode_engine_id: str | None = None
    """The D engine the router dispatched the other leg to, when it says so (binds the push)."""
    prompt_fingerprint: str | None = None
    """The prompt's fingerprint: P refuses a D registration stating another prompt's."""
    num_tokens: int | None = None
    """The prompt's length: the worker pushes no kernel block past its last token."""
    block_start: tuple[int, ...] | None = None
    """Per transfer group, the index of the first pushed scheduler block in the prompt's block
    table (a sliding-window group's blocks out of its window, or dropped past it)."""


FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""vLLM's ``kv_cache_dtype`` names of fp8 caches it keeps in uint8 buffers -> their format."""


def kv_spec_dtype(cache_dtype: str, tensor_dtype: str) -> tuple[str, str]:
    """``(ModelSpec.dtype, a note for ModelSpec.name)`` of vLLM's KV cache.

    vLLM keeps fp8 e4m3 and e5m2 caches (and other quantized formats) in uint8 tensors, so the
    tensors' dtype alone made every one of them "uint8" and two engines with different formats
    hashed alike: P's e4m3 bytes were decoded as e5m2 on D, reported done. fp8 states its
    format; any other quantized ``kv_cache_dtype`` goes into the model name, so a mismatch is
    refused at the handshake.
    """
    if cache_dtype in FP8_CACHE_DTYPES and tensor_dtype == "uint8":
        return FP8_CACHE_DTYPES[cache_dtype], ""
    if cache_dtype in ("auto", tensor_dtype):
        return tensor_dtype, ""
    return tensor_dtype, f" (kv_cache_dtype={cache_dtype})"


@dataclass
class KvpushConnectorMetadata(KVConnectorMetadata):
    """Scheduler half → worker halves, once per engine step (pickled by vLLM)."""

    recv: dict[str, RecvItem] = field(default_factory=dict)
    send: dict[str, SendItem] = field(default_factory=dict)
    cancel: list[str] = field(default_factory=list)
    """D requests aborted while receiving: cancel, report them once settled."""
    abandon: dict[str, tuple[str, str]] = field(default_factory=dict)
    """P: request id -> (match key, why) of prefills that ended without a push (aborted on P):
    D's registrations of the key are answered FAIL at once. Never reported back to vLLM."""


@dataclass
class KvpushConnectorStats(KVConnectorStats):
    """kvpush's counters (pushes, writes, cancels, ...) since the last interval, summed over workers."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvpushConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _fingerprint(request: Request) -> str | None:
    """:func:`~kvpush.core.fingerprint.prompt_fingerprint` of the request's prompt token ids
    (None for a prompt given as embeddings only). Each leg computes its own: a router that
    reused a key for another prompt is caught by P comparing the two."""
    from kvpush.core.fingerprint import prompt_fingerprint

    ids = getattr(request, "prompt_token_ids", None)
    try:
        return None if ids is None else prompt_fingerprint(ids)
    except ConfigError as err:  # not token ids: this request pairs on its key alone
        logger.warning("request %s: no prompt fingerprint: %s", request.request_id, err)
        return None


_PUSHABLE_NAMES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "FINISHED_REPETITION")
"""Statuses of a request vLLM finished after sampling (``check_stop``): its prompt's KV is
complete. Any other (aborted, errored, ignored) ended before its prefill finished."""


def _pushable_statuses() -> frozenset[Any]:
    from vllm.v1.request import RequestStatus

    return frozenset(getattr(RequestStatus, name) for name in _PUSHABLE_NAMES if hasattr(RequestStatus, name))


def _groups(block_ids: Any) -> BlockIds:
    return tuple(tuple(int(b) for b in group) for group in block_ids)


NULL_BLOCK_ID = 0
"""vLLM's null block (``BlockPool.null_block``, the pool's first block): a sliding-window group's
placeholder for a block vLLM dropped out of the window."""


def _real_tail(block_ids: BlockIds) -> BlockIds:
    """Per group, the blocks after the last null one. A P leg that decoded past the prompt has had
    window blocks dropped that D's window at the prompt's end may need: P pushes what it still
    holds, and a D registering more fails at once (P's plan refuses it and tells D) rather than
    receiving the null block's bytes."""
    out = []
    for ids in block_ids:
        nulls = [i for i, b in enumerate(ids) if b == NULL_BLOCK_ID]
        out.append(tuple(ids[nulls[-1] + 1 :]) if nulls else tuple(ids))
    return tuple(out)


def is_sliding_window(spec: Any) -> bool:
    """Whether vLLM frees this KV-cache group's blocks out of its window: a ``SlidingWindowSpec``
    group (a FullAttentionSpec with a sliding_window keeps every block, as vLLM's own connector
    clips)."""
    return any(cls.__name__ == "SlidingWindowSpec" for cls in type(spec).__mro__) and bool(
        getattr(spec, "sliding_window", None)
    )


def window_block_tokens(groups: Any) -> tuple[int, ...]:
    """Per transfer group, the scheduler block (tokens) at which vLLM frees a sliding-window
    group's out-of-window blocks, 0 for a group it keeps whole (``WorkerConfig.window_block_tokens``:
    the handshake refuses a P whose window blocks D's do not divide)."""
    return tuple(int(g.kv_cache_spec.block_size) if is_sliding_window(g.kv_cache_spec) else 0 for g in groups)


class KvpushConnector(KVConnectorBase_V1, SupportsHMA):
    """kvpush's push-mode KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(
                f"kv_transfer_config.kv_role is {transfer.kv_role!r}; kvpush's connector needs "
                f"'kv_producer' (prefill engine) or 'kv_consumer' (decode engine)"
            )
        parallel = vllm_config.parallel_config
        if transfer.kv_role == "kv_consumer" and parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                f"decode engine has pipeline_parallel_size={parallel.pipeline_parallel_size}; kvpush "
                f"pushes into non-PP decoders only (PP is supported on the prefill side)"
            )
        self.settings = ConnectorSettings.from_extra_config(
            transfer.kv_connector_extra_config, getattr(parallel, "data_parallel_index", 0)
        )
        self.engine_id: str = transfer.engine_id
        self.is_producer = transfer.kv_role == "kv_producer"
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self, vllm_config, kv_cache_config)
        else:
            self._worker = _WorkerSide(self, vllm_config, kv_cache_config)

    # ------------------------------------------------------------------ class-level

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """HND: heads outermost in a block, so a TP head slice is one byte range (MLA: any)."""
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return "HND"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # P may be writing into a sleeping decoder's registered memory

    # ------------------------------------------------------------------ scheduler half

    def _sched(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on the worker half of KvpushConnector")
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(getattr(self._kv_cache_config, "transfer_group_ids", (0,)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): meta for tp, meta in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().publish(metadata)

    # ------------------------------------------------------------------ worker half

    def _work(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side method called on the scheduler half of KvpushConnector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvpushConnectorMetadata):
            self._work().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the whole request lands before vLLM schedules it

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # P pushes whole requests at request_finished

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work().results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self._worker is None else self._worker.stats_delta()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvpushConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


# ---------------------------------------------------------------------------- scheduler half


SERVED_MAX = 4096
"""D: children of parallel sampling whose receive ended, remembered for their siblings."""
PREFILL_ID_MEMORY = 4096
"""P: vLLM request ids a worker remembers handing to its sender (a reused one is aliased)."""


class _SchedulerSide:
    """Stages registrations (D) and finished prefills (P); serves the engine's side channel."""

    def __init__(self, owner: KvpushConnector, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        self.owner = owner
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.server: Any = None
        self._recv: dict[str, RecvItem] = {}
        self._send: dict[str, SendItem] = {}
        self._cancel: list[str] = []
        self._abandon: dict[str, tuple[str, str]] = {}
        self._send_keys: dict[str, str] = {}
        """P: request id -> match key of every push in ``sending`` (a key in use is never abandoned)."""
        self.receiving: set[str] = set()
        """D requests registered and not yet reported in finished_recving."""
        self._recv_keys: dict[str, str] = {}
        """D: match key -> the request in ``receiving`` registered under it."""
        self.sending: set[str] = set()
        """P requests handed to the workers and not yet reported in finished_sending."""
        self._served: dict[str, tuple[str, str | None]] = {}
        """D: match key -> (parent id, None or why it failed) of a child of parallel sampling
        (n > 1) whose receive ended: the parent's other children under the key decode from its
        KV (vLLM's prefix cache) or fail as it did. The oldest go first past ``SERVED_MAX``."""
        self._window_blocks = self._sliding_window_blocks()

    def _sliding_window_blocks(self) -> list[int]:
        """Per transfer group: blocks a sliding-window group keeps in its window (0: all)."""
        groups = getattr(self.kv_cache_config, "transfer_groups", self.kv_cache_config.kv_cache_groups)
        out = []
        for group in groups:
            spec = group.kv_cache_spec
            window = spec.sliding_window if is_sliding_window(spec) else None
            out.append(-(-window // spec.block_size) + 1 if window else 0)
        return out

    def clip(self, block_ids: Any) -> BlockIds:
        """The transferable blocks: transfer groups only, sliding-window groups cut to their window
        (P and D clip alike; each states where its blocks start: :meth:`clip_from`)."""
        return self.clip_from(block_ids, None)[0]

    def clip_from(self, block_ids: Any, starts: Any) -> tuple[BlockIds, tuple[int, ...]]:
        """:meth:`clip`, and where each transfer group's clipped ids start in the request's block
        table, given where ``block_ids`` start per KV-cache group (``starts``; None: at 0)."""
        groups = list(block_ids)
        if not groups:
            return (), ()
        firsts = [0] * len(groups) if starts is None else list(starts)
        select = getattr(self.kv_cache_config, "select_transfer_block_ids", None)
        if select is not None and len(groups) == len(self.kv_cache_config.kv_cache_groups):
            groups = list(select(groups))
            firsts = [f[0] for f in select([[f] for f in firsts])]
        clipped, at = [], []
        for ids, keep, first in zip(groups, self._window_blocks, firsts):
            ids = list(ids)
            kept = ids[-keep:] if keep and len(ids) > keep else ids
            clipped.append(tuple(kept))
            at.append(first + len(ids) - len(kept))
        return tuple(clipped), tuple(at)

    # -------------------------------------------------------------- D

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if self.owner.is_producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        sibling = self._sibling(request.request_id, params)
        if sibling == "wait":
            return None, False  # vLLM asks again next step
        count = request.num_prompt_tokens - num_computed_tokens
        if sibling == "received":
            # P's one push landed in a sibling's blocks, which vLLM's prefix cache now holds: this
            # child takes them as a local hit and computes the rest itself (never registers).
            return 0, False
        return (count, True) if count > 0 else (0, False)

    def _sibling(self, rid: str, params: dict[str, Any]) -> str | None:
        """How a child of parallel sampling (vLLM's frontend fans a D request with ``n`` > 1 out
        into ``'<i>_<parent>'`` children with the parent's kv_transfer_params, so all of them
        name P's one push) stands with its siblings: ``"wait"`` while a sibling is receiving
        the key, ``"received"`` once one received it, ``"failed"`` once one failed; None for
        any other request (it registers, or fails at once if its key is being received)."""
        parent = parent_request_id(rid)
        if parent is None:
            return None
        try:
            key = match_key(rid, params)
        except ConfigError:
            return None  # failed with its reason in update_state_after_alloc
        holder = self._recv_keys.get(key)
        if holder is not None and holder != rid and holder in self.receiving:
            return "wait" if parent_request_id(holder) == parent else None
        served = self._served.get(key)
        if served is None or served[0] != parent:
            return None
        return "received" if served[1] is None else "failed"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self.owner.is_producer or not params or not params.get("do_remote_prefill"):
            return
        # Only the first pass registers; a re-entry (preemption, second allocation) must not.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return  # full local prefix hit: nothing to receive (P releases at its lease)
        # vLLM now waits for this request's KV: it is staged even without blocks (the worker then
        # reports it failed, and kv_load_failure_policy applies) so it never waits forever.
        unhashed = blocks.get_unhashed_block_ids_all_groups()
        # Where the uncached blocks start in each group's table: after the local prefix hit (and
        # a sliding-window group's blocks out of its window). P pairs by it, never from the end.
        tables = blocks.blocks
        firsts = [len(tables[g]) - len(ids) if g < len(tables) else 0 for g, ids in enumerate(unhashed)]
        block_ids, block_start = self.clip_from(unhashed, firsts)
        rid = request.request_id
        send_params = dict(params)
        error = None
        if self._sibling(rid, params) == "failed":
            key = match_key(rid, params)
            _, why = self._served[key]
            error = (
                f"{rid!r} is a child of parallel sampling (n > 1) whose sibling's receive of P's one "
                f"push under match key {key!r} failed ({why}); this child fails as it did "
                f"(kv_load_failure_policy applies)"
            )
            num_tokens = request.num_prompt_tokens
            self._recv[rid] = RecvItem(
                block_ids, send_params, error=error, num_tokens=num_tokens, block_start=block_start
            )
            self.receiving.add(rid)
            return
        try:
            send_params["transfer_id"] = key = match_key(rid, params)
            holder = self._recv_keys.get(key)
            if holder is not None and holder in self.receiving:
                raise ConfigError(
                    f"match key {key!r} is already being received by request {holder!r} on this "
                    f"engine: a router gave two decode requests one transfer_id (or X-Request-Id); "
                    f"this one fails rather than race the other for P's one push"
                )
            self._recv_keys[key] = rid
            own = _fingerprint(request)
            given = params.get("prompt_fingerprint")
            if own is not None and given is not None and given != own:
                raise ConfigError(
                    f"kv_transfer_params['prompt_fingerprint'] {str(given)[:80]!r} is not this request's "
                    f"prompt's ({own}): the router paired it with another prompt's prefill under match "
                    f"key {key!r} (prompts differ); nothing is received"
                )
            if own is not None:  # D states its own prompt; P compares it with the prompt it prefilled
                send_params["prompt_fingerprint"] = own
        except ConfigError as err:  # a client's bad field fails its request, not the engine
            error = str(err)
        error = error or self._load_end_error(request, blocks)
        self._recv[rid] = RecvItem(
            block_ids=block_ids,
            kv_transfer_params=send_params,
            error=error,
            num_tokens=request.num_prompt_tokens,
            block_start=block_start,
        )
        self.receiving.add(rid)

    def _load_end_error(self, request: Request, blocks: KVCacheBlocks) -> str | None:
        """Why D cannot receive this load, or None. D registers the blocks up to the prompt's last
        token and states the prompt's length: a load vLLM cut short (it computes the rest
        itself) ends a block or more earlier. Paired from the end (kvpush before block starts
        were stated, or a P of that release) every block D registered would get P's KV of later
        tokens, silently; it is refused here, before anything is registered."""
        num_tokens = request.num_prompt_tokens
        groups = self.kv_cache_config.kv_cache_groups
        # Only the groups kvpush transfers are checked; vLLM sizes an excluded group (a device
        # replica) its own way.
        for gid in getattr(self.kv_cache_config, "transfer_group_ids", range(len(groups))):
            group = groups[gid]
            if gid >= len(blocks.blocks):
                break
            size = group.kv_cache_spec.block_size
            have, need = len(blocks.blocks[gid]), -(-num_tokens // size)
            if have != need:
                return (
                    f"vLLM allocated the load of {request.request_id!r} {have} blocks of {size} tokens "
                    f"in KV-cache group {gid}, the prompt's {num_tokens} tokens take {need}: kvpush "
                    f"receives the blocks up to the prompt's end, so the request fails rather than "
                    f"risk another position's KV"
                )
        return None

    # -------------------------------------------------------------- both

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        if rid in self.receiving:
            # D aborted (or failed) while P may still write: hold the blocks until kvpush says no
            # WRITE can land any more (the worker reports the request then).
            self._cancel.append(rid)
            return True, None
        if not params:
            return False, None
        if not self.owner.is_producer:
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        try:
            key = match_key(rid, params)
        except ConfigError as err:  # a client's bad field: no push, the engine goes on
            logger.error("request %s is not pushed: %s", rid, err)
            return False, None
        if request.status not in _pushable_statuses():
            # Aborted (client gone), errored or refused on P before its prefill finished: nothing
            # will be pushed, so D's registration is failed now rather than at its timeout.
            self._abandon_key(
                rid, key, f"P's request {rid!r} ended {request.status.name} before its prefill finished"
            )
            return False, None
        decode = params.get("decode_engine_id")
        if decode is not None and (not isinstance(decode, str) or not decode):
            # The router meant to bind the push to one D engine: pushing unbound would let any
            # D that knows the key claim the KV. Not pushed; D's registrations fail at once.
            why = (
                f"P's request {rid!r} has kv_transfer_params['decode_engine_id']={decode!r:.80}, not a "
                f"non-empty string: the push the router bound to one decode engine is not made unbound"
            )
            logger.error("request %s is not pushed: %s", rid, why)
            self._abandon_key(rid, key, why)
            return False, None
        prompt_blocks = self._prompt_blocks(block_ids, request.num_prompt_tokens)
        clipped, firsts = self.clip_from(prompt_blocks, None)
        blocks = _real_tail(clipped)
        # where each group's pushed blocks start in the prompt's table (D pairs by index)
        block_start = tuple(f + len(c) - len(b) for f, c, b in zip(firsts, clipped, blocks))
        fingerprint = _fingerprint(request)
        out = self._transfer_params(rid, params, fingerprint)
        if not any(blocks):
            self._abandon_key(rid, key, f"P's request {rid!r} holds none of the prompt's blocks any more")
            return False, out
        self._send[rid] = SendItem(
            block_ids=blocks,
            match_key=key,
            decode_engine_id=decode,
            prompt_fingerprint=fingerprint,
            num_tokens=request.num_prompt_tokens,
            block_start=block_start,
        )
        self.sending.add(rid)
        self._send_keys[rid] = key
        return True, out

    def _abandon_key(self, rid: str, key: str, why: str) -> None:
        """Stage telling every P rank that ``key`` will never be pushed by this engine (D's
        registrations of it fail at once). Not when another request of this engine is pushing
        the same key (a router that reused it): a FAIL must never reach a D that P may still
        write to."""
        owner = next((other for other, used in self._send_keys.items() if used == key), None)
        if owner is not None:
            logger.warning("request %s ended unpushed; its key %r stays with request %s", rid, key, owner)
            return
        self._abandon[rid] = (key, why)

    def _prompt_blocks(self, block_ids: Any, num_prompt_tokens: int) -> list[list[int]]:
        """Per KV-cache group, the blocks holding the prompt's KV. A P leg that decoded past the
        prompt (max_tokens > 1) holds more; D registers the prompt's blocks only, and P's
        end-trim would pair P's *last* blocks with them, shifted by the extra ones."""
        specs = self.kv_cache_config.kv_cache_groups
        out = []
        for gid, ids in enumerate(block_ids):
            spec = specs[gid].kv_cache_spec if gid < len(specs) else None
            size = spec.block_size if spec is not None else self.vllm_config.cache_config.block_size
            out.append(list(ids)[: -(-num_prompt_tokens // size)])
        return out

    def _transfer_params(self, rid: str, params: dict[str, Any], fingerprint: str | None) -> dict[str, Any]:
        """What a router forwards to D: P's coordinates, the pairing key and P's prompt
        fingerprint (D checks it against its own prompt)."""
        parallel = self.vllm_config.parallel_config
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.owner.engine_id,
            "remote_host": self.owner.settings.side_channel_host,
            "remote_port": self.owner.settings.side_channel_port,
            "remote_request_id": rid,
            "tp_size": parallel.tensor_parallel_size,
            "pp_size": parallel.pipeline_parallel_size,
            "transfer_mode": "push",
        }
        if params.get("transfer_id"):
            out["transfer_id"] = params["transfer_id"]
        if fingerprint is not None:
            out["prompt_fingerprint"] = fingerprint
        return out

    def build_connector_meta(self) -> KvpushConnectorMetadata:
        meta = KvpushConnectorMetadata(
            recv=self._recv, send=self._send, cancel=self._cancel, abandon=self._abandon
        )
        self._recv, self._send, self._cancel, self._abandon = {}, {}, [], {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self.sending.discard(rid)
            self._send_keys.pop(rid, None)
        if output.finished_recving:
            done = set(output.finished_recving)
            failed = set(getattr(output, "failed_recving", None) or ())
            for key, rid in self._recv_keys.items():
                parent = parent_request_id(rid)
                if rid in done and rid in self.receiving and parent is not None:
                    # A child of parallel sampling received (or failed) P's one push: its
                    # siblings waiting under the key decode from its KV (or fail as it did).
                    self._served.pop(key, None)
                    self._served[key] = (parent, f"{rid!r} failed" if rid in failed else None)
            while len(self._served) > SERVED_MAX:
                del self._served[next(iter(self._served))]
        for rid in output.finished_recving or ():
            self.receiving.discard(rid)
        if output.finished_recving:
            self._recv_keys = {k: r for k, r in self._recv_keys.items() if r not in done}
            # A cancel staged for a request the workers already reported (vLLM finished it while
            # their report was on its way: an abort under async scheduling, or the FINISHED_ERROR
            # of a failed load, which vLLM applies before this update) is moot, and must not
            # reach a later request of the same id (a client's retry): the workers would cancel
            # that one and vLLM take its unwritten blocks as received.
            self._cancel = [rid for rid in self._cancel if rid not in done]

    def has_pending_work(self) -> bool:
        return bool(self.sending or self._send or self._recv or self._cancel or self._abandon)

    # -------------------------------------------------------------- side channel

    def publish(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        from kvpush.core.sidechannel import SideChannelServer
        from kvpush.core.types import RankKey

        payloads = {}
        for (pp_rank, tp_rank), meta in metadata.items():
            if not isinstance(meta, KvpushHandshakeMetadata):
                raise ConfigError(
                    f"worker (pp={pp_rank}, tp={tp_rank}) sent {type(meta).__name__} handshake metadata; "
                    f"every worker must run KvpushConnector"
                )
            payloads[RankKey(pp_rank, tp_rank)] = meta.payload
        if self.server is None:
            settings = self.owner.settings
            options = {"insecure": True} if settings.side_channel_insecure else {}
            self.server = SideChannelServer(
                self.owner.engine_id, settings.bind_host, settings.side_channel_port, **options
            )
            logger.info("kvpush side channel of engine %s at %s", self.owner.engine_id, self.server.address)
        self.server.publish_all(payloads)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


# ---------------------------------------------------------------------------- worker half


class _WorkerSide:
    """One worker's PushSender (P) or PushReceiver (D)."""

    def __init__(self, owner: KvpushConnector, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        self.owner = owner
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine: Any = None
        self.ratios: tuple[int, ...] = ()
        self.block_sizes: tuple[int, ...] = ()
        """Scheduler block size (tokens) of each transfer group."""
        self._inflight: dict[str, BlockIds] = {}
        """D: requests added to the receiver and not reported yet (scheduler block ids)."""
        self._load_errors: set[int] = set()
        self._last_stats: dict[str, int | float] = {}
        self._failed_now: dict[str, str] = {}
        """Requests kvpush refused (D: bad kv_transfer_params; P: e.g. a transfer_id in use),
        reported failed (D) or released (P) at the next poll."""
        self._failing: dict[str, str] = {}
        """D: requests kvpush reported failed whose blocks it has not released yet (a WRITE may
        still land): vLLM hears of the failure only once they are released."""
        self._released: set[str] = set()
        """D: requests kvpush released before this worker saw their failure."""
        self._sender_ids: dict[str, str] = {}
        """P: the sender's id -> vLLM's request id, of prefills handed to the sender and not
        reported yet (see :meth:`_sender_id`)."""
        self._prefill_ids: OrderedDict[str, int] = OrderedDict()
        """P: vLLM request ids of the prefills this worker handed on (finished or abandoned), most
        recent last (at most ``PREFILL_ID_MEMORY``), with how many times."""

    def ranks(self) -> tuple[int, int]:
        """``(pp_rank, tp_rank)`` of this worker."""
        try:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tp_group,
                model_parallel_is_initialized,
            )

            if model_parallel_is_initialized():
                return get_pp_group().rank_in_group, get_tp_group().rank_in_group
        except ImportError:  # pragma: no cover - vLLM moved its parallel state
            pass
        parallel = self.vllm_config.parallel_config
        tp = parallel.tensor_parallel_size
        return (parallel.rank // tp) % parallel.pipeline_parallel_size, parallel.rank % tp

    def register(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.utils import get_pp_indices

        from kvpush.core.types import ModelSpec, ParallelConfig
        from kvpush.core.worker import WorkerConfig
        from kvpush.layouts.vllm import LAYOUT_NAME, check_excluded_groups, group_ratios, layer_caches

        model_config = self.vllm_config.model_config
        parallel_config = self.vllm_config.parallel_config
        pp_rank, tp_rank = self.ranks()
        num_layers = model_config.get_total_num_hidden_layers()
        start, end = get_pp_indices(num_layers, pp_rank, parallel_config.pipeline_parallel_size)
        caches = layer_caches(kv_caches, self.kv_cache_config)
        check_excluded_groups(kv_caches, self.kv_cache_config, caches, end - start)
        if not caches:
            raise ConfigError("register_kv_caches got no attention KV caches to transfer")
        groups = getattr(self.kv_cache_config, "transfer_groups", self.kv_cache_config.kv_cache_groups)
        self.ratios = group_ratios(caches, len(groups))
        self.block_sizes = tuple(int(group.kv_cache_spec.block_size) for group in groups)
        parallel = ParallelConfig(
            tp_size=parallel_config.tensor_parallel_size,
            tp_rank=tp_rank,
            pp_size=parallel_config.pipeline_parallel_size,
            pp_rank=pp_rank,
            num_layers=num_layers,
            start_layer=start,
            end_layer=end,
        )
        first = next(iter(caches.values()))
        # Group 0's kernel block (tokens), the same on every PP stage and on D: a stage's first
        # cache may be of another group whose kernel blocks are of another width (its hash would
        # then differ from D's and every handshake be refused).
        block_size = self._group0_kernel_tokens(caches, len(groups))
        settings = self.owner.settings
        served = model_config.served_model_name
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        cache_dtype = str(getattr(self.vllm_config.cache_config, "cache_dtype", "auto"))
        dtype, format_note = kv_spec_dtype(cache_dtype, str(first.tensor.dtype).removeprefix("torch."))
        identity = model_identity(model_config.hf_config.to_dict(), getattr(model_config, "revision", None))
        model = ModelSpec(
            name=f"{settings.model_name or served or model_config.model}{format_note}{identity}",
            num_layers=num_layers,
            attention="mla" if model_config.use_mla else "mha",
            num_kv_heads=1 if model_config.use_mla else model_config.get_total_num_kv_heads(),
            head_dim=model_config.get_head_size(),
            block_size=block_size,
            dtype=dtype,
        )
        device = first.tensor.device
        config = WorkerConfig(
            engine_id=self.owner.engine_id,
            parallel=parallel,
            model=model,
            layout=LAYOUT_NAME,
            transport=settings.transport,
            transport_options=dict(settings.transport_options),
            side_channel_host=settings.side_channel_host,
            side_channel_port=settings.side_channel_port,
            handshake_timeout_s=settings.handshake_timeout,
            request_timeout_s=settings.push_registration_timeout,
            lease_s=settings.kv_lease_duration,
            staging_bytes=settings.staging_bytes,
            cuda_device=device.index if device.type == "cuda" else None,
            window_block_tokens=window_block_tokens(groups),
        )
        if self.owner.is_producer:
            from kvpush.core.sender import PushSender

            self.engine = PushSender(config, caches)
        else:
            from kvpush.core.receiver import PushReceiver

            self.engine = PushReceiver(config, caches)
        self.engine.start()
        logger.info("kvpush rank (pp=%d, tp=%d) of engine %s started", pp_rank, tp_rank, config.engine_id)

    def _group0_kernel_tokens(self, caches: dict[str, Any], num_groups: int) -> int:
        """Tokens of a kernel block of KV group 0 (ModelSpec.block_size): from this rank's own
        group-0 cache; on a PP stage holding no layer of group 0 (a hybrid model), from a stage
        that does, over vLLM's PP group (every stage calls this together, as vLLM registers the
        caches of all workers at once). Without vLLM's parallel state (no PP group to ask): the
        scheduler block, vLLM's kernel choice for a group without layers; a stage whose group 0
        is split otherwise then hashes another ModelSpec than D and its handshakes are refused."""
        group0 = next((c for c in caches.values() if c.group == 0), None)
        local = int(group0.tensor.shape[2]) if group0 is not None else None
        if num_groups > 1 and self.vllm_config.parallel_config.pipeline_parallel_size > 1:
            try:
                from vllm.distributed.parallel_state import get_pp_group, model_parallel_is_initialized
            except ImportError:  # pragma: no cover - vLLM moved its parallel state
                model_parallel_is_initialized = None
            if model_parallel_is_initialized is not None and model_parallel_is_initialized():
                import torch.distributed as dist

                group = get_pp_group()
                gathered: list[int | None] = [None] * group.world_size
                dist.all_gather_object(gathered, local, group=group.cpu_group)
                found = {value for value in gathered if value is not None}
                if len(found) > 1:
                    raise ConfigError(
                        f"the PP stages cut KV group 0 into kernel blocks of {sorted(found)} tokens"
                    )
                if found:
                    return found.pop()
        return local if local is not None else self.block_sizes[0]

    def _started(self) -> Any:
        if self.engine is None:
            raise RuntimeError("KvpushConnector: register_kv_caches() has not run on this worker")
        return self.engine

    def handshake_metadata(self) -> KvpushHandshakeMetadata:
        return KvpushHandshakeMetadata(payload=self._started().handshake_payload())

    def kernel_ids(self, block_ids: BlockIds, num_tokens: int | None = None) -> BlockIds:
        """Kernel block ids of a request's scheduler blocks. With ``num_tokens`` (the prompt's
        length; each group's last block holds its last token) the kernel blocks past the prompt's
        end are left out: kvpush pairs P's and D's blocks from the end, and two engines whose
        scheduler blocks differ in size (kernel blocks alike) end theirs at different tokens
        (P's 40-token prompt in blocks of 32 ends at token 63, D's in blocks of 16 at 47: paired
        from there, D would get tokens 16-63 as 0-47)."""
        from kvpush.layouts.vllm import expand_block_ids

        # A group this stage holds no layer of (a PP stage of a hybrid model) is expanded at
        # ratio 1: fewer ids than D's kernel blocks of it, which kvpush neither checks nor uses
        # (nothing of that group moves from this rank: core.planning.trim_for_prefix_hit).
        ratios = self.ratios
        expanded = expand_block_ids(block_ids, ratios)
        if num_tokens is None or num_tokens <= 0:
            return expanded
        out = []
        for gid, ids in enumerate(expanded):
            ratio = ratios[gid] if gid < len(ratios) else 1
            size = self.block_sizes[gid] if gid < len(self.block_sizes) else 0
            if ratio <= 1 or not size or not ids:
                out.append(ids)
                continue
            past = ratio * -(-num_tokens // size) - -(-num_tokens // (size // ratio))
            out.append(ids[: len(ids) - past] if 0 < past < len(ids) else ids)
        return tuple(out)

    def kernel_start(self, block_start: tuple[int, ...] | None, groups: int) -> tuple[int, ...] | None:
        """Where a request's kernel blocks start, per group, from where its scheduler blocks do
        (scheduler block ``b`` is kernel blocks ``b x ratio`` on)."""
        if block_start is None or not groups:
            return None
        ratios = self.ratios
        return tuple(s * (ratios[g] if g < len(ratios) else 1) for g, s in enumerate(block_start[:groups]))

    def start(self, meta: KvpushConnectorMetadata) -> None:
        engine = self._started()
        if self.owner.is_producer:
            ready = self._kv_written() if meta.send else None
            for rid, item in meta.send.items():
                bind = {"decode_engine_id": item.decode_engine_id} if item.decode_engine_id else {}
                sid = self._sender_id(rid)
                try:
                    blocks = self.kernel_ids(item.block_ids, item.num_tokens)
                    engine.request_finished(
                        sid,
                        blocks,
                        match_key=item.match_key,
                        ready=ready,
                        prompt_fingerprint=item.prompt_fingerprint,
                        block_start=self.kernel_start(item.block_start, len(blocks)),
                        # one group: P states the prompt's length too (D's must agree)
                        num_tokens=item.num_tokens if len(blocks) == 1 else None,
                        **bind,
                    )
                except Exception as err:  # e.g. a transfer_id already in use: release, go on
                    logger.error("kvpush cannot push request %s (its blocks are released): %s", rid, err)
                    self._failed_now[rid] = str(err)
                    continue
                self._sender_ids[sid] = rid
            for rid, (key, why) in meta.abandon.items():
                self._abandon(rid, key, why)
            return
        for rid, item in meta.recv.items():
            try:
                if item.error is not None:
                    raise ConfigError(item.error)
                blocks = self.kernel_ids(item.block_ids, item.num_tokens)
                engine.add_request_params(
                    rid,
                    blocks,
                    item.kv_transfer_params,
                    block_start=self.kernel_start(item.block_start, len(blocks)),
                    num_tokens=item.num_tokens,
                )
            except Exception as err:  # a request kvpush cannot take fails; the engine goes on
                logger.error("kvpush cannot receive request %s: %s", rid, err)
                self._failed_now[rid] = str(err)
            self._inflight[rid] = item.block_ids
        for rid in meta.cancel:
            if rid in self._inflight and rid not in self._failed_now:
                engine.cancel(rid)

    def _abandon(self, rid: str, key: str, why: str) -> None:
        """Tell the sender that ``key`` will never be finished here (``request_abandoned``):
        it answers D's registrations of it FAIL. Nothing is reported to vLLM (the request's
        blocks were freed; an unknown id in finished_sending would stop vLLM's scheduler)."""
        try:
            self.engine.request_abandoned(self._sender_id(rid), match_key=key, reason=why)
        except Exception as err:  # D's request then ends at its registration timeout
            logger.error("kvpush could not tell D that %s will not be pushed: %s", key, err)

    def _sender_id(self, rid: str) -> str:
        """The id P's sender knows vLLM's prefill ``rid`` by: ``rid`` the first time, a fresh
        alias ``rid#<n>`` when vLLM reused the id (without request-id randomisation a client's
        X-Request-Id is the id): the sender takes a finish or abandon under an ended prefill's
        id and key for that prefill's, and refuses or ignores it (D's retry would wait for its
        registration timeout)."""
        count = self._prefill_ids.get(rid, 0)
        self._prefill_ids[rid] = count + 1
        self._prefill_ids.move_to_end(rid)
        while len(self._prefill_ids) > PREFILL_ID_MEMORY:
            self._prefill_ids.popitem(last=False)
        if not count:
            return rid
        alias = f"{rid}#{count}"
        while alias in self._prefill_ids or alias in self._sender_ids:
            count += 1
            alias = f"{rid}#{count}"
        return alias

    def _kv_written(self) -> Any:
        """An event after everything this worker queued on its CUDA stream (the finished
        prefills' KV writes included), so nothing is posted before the KV is there; None for
        CPU caches. vLLM reads a step's sampled tokens on the host before its scheduler sees a
        request finish, which already orders the KV; the event also covers an engine stream
        that did not synchronise."""
        if self.engine is None or self.engine.config.cuda_device is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.engine.config.cuda_device))
        return event

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.engine is None:
            return out
        if self.owner.is_producer:
            sent = self.engine.get_finished()
            out.finished_sending.update(self._sender_ids.pop(sid, sid) for sid in sent.sent)
            out.finished_sending.update(self._failed_now)
            self._failed_now.clear()
            for sid, reason in sent.failed.items():
                logger.warning("kvpush push of %s failed (its blocks are released): %s", sid, reason)
                out.finished_sending.add(self._sender_ids.pop(sid, sid))
            return out
        got = self.engine.get_finished()
        for rid, reason in got.failed.items():
            if rid in self._inflight:
                logger.warning("kvpush receive of %s failed (blocks held until released): %s", rid, reason)
                self._failing[rid] = reason
        self._released.update(rid for rid in got.released if rid in self._inflight)
        # A failure reaches vLLM only once kvpush released the blocks: vLLM frees them (policy
        # `fail`) or recomputes into them (`recompute`) as soon as it hears of it.
        failed = {rid: self._failing.pop(rid) for rid in list(self._failing) if rid in self._released}
        failed.update(self._failed_now)  # never added to the receiver: nothing can land
        self._failed_now.clear()
        for rid in got.done:
            if self._inflight.pop(rid, None) is not None:
                out.finished_recving.add(rid)
        for rid, reason in got.cancelled.items():
            if self._inflight.pop(rid, None) is not None:
                logger.info("kvpush receive of %s cancelled and settled: %s", rid, reason)
                # Failed too: a cancelled request was never received, and vLLM must never take it
                # as received (it ignores the failure of a request it finished, as an abort's is).
                out.finished_recving.add(rid)
                out.failed_recving.add(rid)
                self._failing.pop(rid, None)
                self._released.discard(rid)
        for rid, reason in failed.items():
            self._released.discard(rid)
            blocks = self._inflight.pop(rid, None)
            if blocks is None:
                continue
            logger.warning("kvpush receive of %s failed, its blocks released: %s", rid, reason)
            out.finished_recving.add(rid)
            out.failed_recving.add(rid)
            # vLLM maps block-level errors to requests only when its KV-cache config holds one
            # group (one transferred group is not enough: a group excluded from transfer counts),
            # and stops its scheduler on any it gets otherwise; failed_recving covers every case.
            if len(blocks) == 1 and len(self.kv_cache_config.kv_cache_groups) == 1:
                self._load_errors.update(blocks[0])
        return out

    def stats_delta(self) -> KvpushConnectorStats | None:
        """The sender's or receiver's counters that moved since the last call (None: none did)."""
        if self.engine is None:
            return None
        now = {k: v for k, v in dict(self.engine.stats).items() if isinstance(v, (int, float))}
        delta = {k: v - self._last_stats.get(k, 0) for k, v in now.items() if v != self._last_stats.get(k, 0)}
        self._last_stats = now
        return KvpushConnectorStats(data=delta) if delta else None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
