"""The stable engine API of kvpush: everything an inference engine needs, from one module.

::

    from kvpush.engine import (
        ModelSpec, ParallelConfig, PushReceiver, PushSender, SideChannelServer, WorkerConfig,
    )

Names listed in ``__all__`` keep their meaning across minor releases; everything under
``kvpush.core`` is internal and may change. One engine runs one :class:`SideChannelServer`
(in its scheduler process) and one worker per rank (:class:`PushSender` on each P rank,
:class:`PushReceiver` on each D rank, often in separate processes); each rank hands its
:meth:`~PushSender.handshake_payload` to the engine's server, which serves it with
``server.publish(rank, payload)``. See docs/engine-api.md for the lifecycle and a
multi-process example.

Importing this module loads no torch, no NIXL and no plugin: the transport is created when a
worker starts.
"""

from __future__ import annotations

from kvpush.core.errors import (
    ConfigError,
    HandshakeError,
    KvpushError,
    PluginError,
    RequestFailed,
    TransferError,
    WaitTimeout,
    WireError,
)
from kvpush.core.fingerprint import prompt_fingerprint
from kvpush.core.manager import KvpushPluginManager, get_plugin_manager
from kvpush.core.receiver import PushReceiver, ReceiveResults
from kvpush.core.sender import PushResults, PushSender
from kvpush.core.sidechannel import SideChannelServer, fetch_metadata
from kvpush.core.types import (
    AgentMetadata,
    BlockIds,
    BlockIdsLike,
    KVRegion,
    ModelSpec,
    ParallelConfig,
    RankKey,
    RequestMetadata,
    Role,
    TransferParams,
)
from kvpush.core.worker import WorkerConfig

__all__ = [
    "AgentMetadata",
    "BlockIds",
    "BlockIdsLike",
    "ConfigError",
    "HandshakeError",
    "KVRegion",
    "KvpushError",
    "KvpushPluginManager",
    "ModelSpec",
    "ParallelConfig",
    "PluginError",
    "PushReceiver",
    "PushResults",
    "PushSender",
    "RankKey",
    "ReceiveResults",
    "RequestFailed",
    "RequestMetadata",
    "Role",
    "SideChannelServer",
    "TransferError",
    "TransferParams",
    "WaitTimeout",
    "WireError",
    "WorkerConfig",
    "fetch_metadata",
    "get_plugin_manager",
    "prompt_fingerprint",
]
