"""In-block order at handshake: refuse a peer whose blocks cannot be head-sliced like ours.

Both sides must declare the same :attr:`~kvpush.core.types.KVRegion.block_order` (and tokens
per block), and when the TP sizes differ every head-split region must declare an order whose
head slices fall on head boundaries (:func:`kvpush.core.block_order.check_peer_order`). Checked
in both handshake modes, so D refuses a P it could not be written correctly by, too.
"""

from __future__ import annotations

from kvpush.core.block_order import check_peer_order
from kvpush.core.markers import hookimpl
from kvpush.core.types import AgentMetadata


@hookimpl
def kvpush_validate_peer(local: AgentMetadata, peer: AgentMetadata) -> list[str]:
    return check_peer_order(local, peer)
