"""Every kvpush hook spec.

Engines never call these directly: :class:`kvpush.core.manager.KvpushPluginManager` has one typed
method per hook and applies the combining rule stated in each docstring. Implement a hook with
``from kvpush import hookimpl``; an implementation may accept any subset of the arguments.
Never give an implementation's parameters default values: pluggy does not pass those. An
implementation that raises anything but a kvpush error is reported as a ``PluginError`` naming
its plugin and the hook.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvpush.core.markers import hookspec

if TYPE_CHECKING:
    from kvpush.core.types import (
        AgentMetadata,
        HandshakeMode,
        LayoutProvider,
        Notification,
        ParallelConfig,
        PushJob,
        RankKey,
        ReadSpec,
        RegionAlignment,
        Role,
        TransportProvider,
    )

__all__ = [
    "kvpush_align_regions",
    "kvpush_build_read_specs",
    "kvpush_decode_notification",
    "kvpush_expected_producers",
    "kvpush_handshake_mode",
    "kvpush_layouts",
    "kvpush_metadata_extensions",
    "kvpush_transfer_strategy",
    "kvpush_transports",
    "kvpush_validate_peer",
]

# --------------------------------------------------------------------------------------------
# Transports and layouts, offered by name
# --------------------------------------------------------------------------------------------


@hookspec
def kvpush_transports() -> Iterable[TransportProvider]:
    """Offer transports by name.

    When: once, when the manager is asked for a transport or lists plugins.

    :return: an iterable of :class:`~kvpush.core.types.TransportProvider`.

    Combining rule: all results are collected and flattened; two providers with one name raise
    ``PluginError`` naming both plugins.
    """
    return ()


@hookspec
def kvpush_layouts() -> Iterable[LayoutProvider]:
    """Offer KV layouts by name; a layout describes a rank's KV regions from its tensors.

    When: once, when the manager is asked for a layout or lists plugins.

    :return: an iterable of :class:`~kvpush.core.types.LayoutProvider`. Its
        ``describe_regions(kv_caches, parallel, model)`` must return regions that follow the
        layout rules (checked when a rank starts, each broken rule a ``ConfigError`` naming it;
        helpers and checks in :mod:`kvpush.layouts.regions`):

        - ``layer_names``: each region names the model layer whose KV it holds, the same name
          for every region of that layer (K and V share it), distinct between layers; a rank
          owning n layers describes n distinct names.
        - region order: layer by layer in model order (a layer's regions adjacent, layers in
          natural name order), because PP slicing pairs a stage's regions with a window of the
          decode side's list by position.
        - components: distinct inside a layer (``K``, ``V``, ``KV``, ``latent``), the same
          sequence for every layer of a KV group; regions of one group never share bytes.
        - in-block order: ``block_order`` says how a block is laid out; ``heads_outer`` blocks
          hold ``num_heads`` equal head slices (``block_len`` divides by ``num_heads``),
          ``tokens_outer`` blocks one row per head per token (``block_tokens`` set); a
          replicated region has ``num_heads == 1``. A 4-D tensor given to ``tensor_region``
          must have the declared block shape (``(heads, tokens, ...)`` or ``(tokens, heads,
          ...)``).
        - block geometry: a region declaring an order holds exactly ``num_heads x
          model.block_size x model.head_dim`` elements of ``model.dtype`` per block (twice
          for ``KV``): no padding in ``block_len``, one block per block id, ``model.dtype`` the
          cache's own dtype (``kvpush.layouts.regions.block_geometry``).
        - tensors: regions lie inside the tensors of ``kv_caches``, which are of
          ``model.dtype``; call ``kvpush.layouts.regions.check_tensors`` in
          ``describe_regions``.

        Optional ``allocate`` and ``demo_model`` let ``kvpush demo --layout NAME`` and
        ``kvpush.testing.run_cluster`` push with the layout.

    Combining rule: all results are collected and flattened; two providers with one name raise
    ``PluginError`` naming both plugins.
    """
    return ()


# --------------------------------------------------------------------------------------------
# Handshake
# --------------------------------------------------------------------------------------------


@hookspec
def kvpush_metadata_extensions(local: AgentMetadata) -> Mapping[str, Any] | None:
    """Add fields to what a rank publishes about itself on the side channel.

    When: once per rank, after its KV regions are registered and before it is served.

    :param local: the metadata the host built for this rank (extensions still empty).
    :return: a mapping of extra msgpack-serialisable fields, or None for nothing.

    Combining rule: all results are collected and merged into ``AgentMetadata.extensions``;
    a key set by two plugins raises ``PluginError`` naming the key.
    """


@hookspec
def kvpush_handshake_mode(role: Role, peer_role: Role) -> HandshakeMode | None:
    """Decide how much of a peer a rank loads during a handshake.

    When: before each handshake with a peer engine.

    :param role: this rank's role (prefill or decode).
    :param peer_role: the peer's role.
    :return: a :class:`~kvpush.core.types.HandshakeMode`, or None to leave it to others.

    Combining rule: first result wins (stops at the first non-None result); None from every
    plugin is an error. Push mode fixes the answer: decode → prefill must be ``NOTIF_ONLY``
    (D never touches P's memory) and prefill → decode ``FULL``; any other answer is a
    ``PluginError`` naming the plugin.
    """


@hookspec
def kvpush_validate_peer(
    local: AgentMetadata, peer: AgentMetadata, mode: HandshakeMode
) -> Iterable[str] | None:
    """Check a peer's published metadata against this rank's.

    When: during every handshake, after the compatibility hash matched and before any agent is
    loaded.

    :param local: this rank's metadata.
    :param peer: the peer rank's metadata.
    :param mode: the handshake mode (full handshakes check geometry; notif-only ones less).
    :return: problem descriptions (each naming what is wrong and what to do), or None/empty;
        a single string counts as one problem.

    Combining rule: all results are collected; any problem fails the handshake with one
    ``HandshakeError`` listing every problem.
    """


# --------------------------------------------------------------------------------------------
# Region mapping
# --------------------------------------------------------------------------------------------


@hookspec
def kvpush_align_regions(local: AgentMetadata, peer: AgentMetadata) -> RegionAlignment | None:
    """Pair each local KV region with one of the peer's regions (full handshakes only).

    When: during a full handshake, after validation. PP slicing and HMA semantic matching
    plug in here.

    :param local: this rank's metadata (its regions in model-layer order).
    :param peer: the peer rank's metadata.
    :return: a :class:`~kvpush.core.types.RegionAlignment` if this plugin claims the pair,
        else None.

    Combining rule: claim — all results are collected and exactly one plugin may claim; two
    claims raise ``PluginError`` naming both. With no claim the host pairs regions one to one,
    which needs equal region counts (else ``HandshakeError``). Every pair is then checked
    (:func:`kvpush.core.peers.check_geometry`): same component, replication and KV-cache group
    (block ids are per group), equal bytes per head.
    """


# --------------------------------------------------------------------------------------------
# Read-spec building
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvpush_build_read_specs(job: PushJob) -> Sequence[ReadSpec] | None:
    """Decide which destination ranks receive which blocks, and which byte slice of each.

    When: on the producer's writer thread, once per request, before its WRITEs are posted.
    TP mapping (head slices) is built in; MLA replication overrides it.

    :param job: the producer rank's metadata, D's TP size and both sides' block ids.
    :return: one :class:`~kvpush.core.types.ReadSpec` per destination rank, or None to leave
        it to others. Each carries ``job.local_block_ids`` and ``job.remote_block_ids``
        unchanged (a plugin picks destinations and head slices, never blocks); other ids are a
        ``PluginError`` naming the plugin, at the handshake and when P plans.

    Combining rule: first result wins (stops at the first non-None result; ``tryfirst``
    plugins are asked first). None from every plugin is an error. An empty list is an error
    too: a request with no destination would never complete.
    """


@hookspec(firstresult=True)
def kvpush_transfer_strategy(job: PushJob, spec: ReadSpec, num_descriptors: int) -> str | None:
    """Choose how one destination's blocks travel: ``"direct"`` or ``"packed"``.

    When: on the producer's writer thread, once per (request, destination rank).

    :param job: the request being pushed.
    :param spec: the destination's read spec.
    :param num_descriptors: descriptors a direct transfer would post.
    :return: a strategy name, or None to leave it to others.

    Combining rule: first result wins; None from every plugin means ``"direct"``.
    """


# --------------------------------------------------------------------------------------------
# Completion aggregation
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvpush_expected_producers(
    prefill: ParallelConfig, decode_tp_rank: int, decode_tp_size: int
) -> Iterable[RankKey] | None:
    """Name the exact set of producers ``(pp_rank, tp_rank)`` whose completion a D rank waits for.

    When: on D, once per P engine, during the notif-only handshake (D loads exactly these
    producers' agents and counts a request done once each of them reported); and on P, when it
    plans a request, to check that its read specs write exactly the D ranks that count it. One
    rule for both sides, so "done" always means every producer that writes really wrote.

    :param prefill: P's parallel config *as P published it* in the handshake (never the sizes a
        router passed).
    :param decode_tp_rank: the D rank.
    :param decode_tp_size: D's TP size.
    :return: the producer ranks (non-empty, each inside P's sizes), or None to leave it to others.

    Combining rule: first result wins. The built-in rule (:mod:`kvpush.core.producers`): every PP
    stage, and the P TP ranks whose heads (or MLA latent) land on this D rank — ``d // k`` when
    P_TP <= D_TP, ``d·k … d·k+k-1`` when P_TP > D_TP, with ``k`` the TP ratio.
    """


@hookspec(firstresult=True)
def kvpush_decode_notification(message: bytes) -> Notification | None:
    """Say what a received notification means.

    When: on the writer thread, for every notification drained from the transport.

    :param message: the raw notification bytes.
    :return: a :class:`~kvpush.core.types.Notification`, or None if this plugin does not know
        the format.

    Combining rule: first result wins. A message no plugin decodes is logged and dropped.
    """
