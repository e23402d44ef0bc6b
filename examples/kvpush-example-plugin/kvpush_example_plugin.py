"""An example kvpush plugin: keep prefill and decode engines of different clusters apart.

Every rank publishes the cluster it runs in (``KVPUSH_EXAMPLE_CLUSTER``, default
``"default"``) as the metadata field ``example_cluster``; a handshake with a peer that
publishes a different cluster fails with a message naming both. A peer without the field
(it does not run this plugin) is accepted.

The module is cheap to import: the environment is read inside the hook, when a rank starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvpush import hookimpl
from kvpush.core.types import AgentMetadata

CLUSTER_ENV = "KVPUSH_EXAMPLE_CLUSTER"
FIELD = "example_cluster"


@hookimpl
def kvpush_metadata_extensions(local: AgentMetadata) -> Mapping[str, Any]:
    return {FIELD: os.environ.get(CLUSTER_ENV) or "default"}


@hookimpl
def kvpush_validate_peer(local: AgentMetadata, peer: AgentMetadata) -> list[str]:
    # An implementation may take any subset of the spec's arguments; this one ignores `mode`.
    mine = local.extensions.get(FIELD)
    theirs = peer.extensions.get(FIELD)
    if mine is None or theirs is None or mine == theirs:
        return []
    return [
        f"peer {peer.engine_id!r} runs in cluster {theirs!r}, this engine in {mine!r}; route "
        f"requests within one cluster or set {CLUSTER_ENV} alike on both engines"
    ]
