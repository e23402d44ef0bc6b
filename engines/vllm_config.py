"""Settings of kvpush's vLLM connector, read from ``kv_connector_extra_config``.

Kept apart from :mod:`kvpush.engines.vllm` so it can be read and tested without vLLM.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvpush.core.errors import ConfigError
from kvpush.core.notifications import MAX_ID_CHARS

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
_CHILD = re.compile(r"^[0-9]+_(.+-[0-9a-f]{8})$", re.IGNORECASE)
"""A child request vLLM's frontend makes for parallel sampling (``n`` > 1): ``'<index>_<parent's
id>'`` (``ParentRequest.get_child_info``), the parent's id ending in the engine's ``-<8 hex>``."""


def parent_request_id(request_id: str) -> str | None:
    """The parent's id of a child request of parallel sampling (``'<index>_<parent>'``), else None."""
    found = _CHILD.match(request_id)
    return found.group(1) if found else None


def base_request_id(request_id: str) -> str:
    """vLLM's request id without the ``-<8 hex>`` suffix each engine appends to the client's id,
    so a P request and its D request share it; and without every leading ``'<digits>_'``, so
    each child of a D request with ``n`` > 1 (``'<index>_<parent>'``) shares its P request's,
    also when the client's id itself starts with ``'<digits>_'`` (P's ``'5_job-…'`` and D's
    child ``'0_5_job-…'`` both key as ``'job'``)."""
    while (parent := parent_request_id(request_id)) is not None:
        request_id = parent
    return _RANDOM_SUFFIX.sub("", request_id)


IDENTITY_SKIPPED = ("transformers_version",)
"""Keys of a model's HF config that say nothing of what it computes (besides ``_``-keys such
as ``_name_or_path``, where it was loaded from)."""


def model_identity(hf_config: Mapping[str, Any], revision: str | None = None) -> str:
    """A note for ``ModelSpec.name`` naming the model a KV cache comes from: its revision (when
    given) and a digest of its HF config (``hf_config.to_dict()``). The served name alone let a
    P and a D of different models with the same shapes pair (a new revision rolled out on one
    side, another RoPE base or window): D decoded from keys another model computed. The config
    covers what shapes the KV (RoPE, windows, layer types); a revision names the weights."""
    config = {k: v for k, v in hf_config.items() if not k.startswith("_") and k not in IDENTITY_SKIPPED}
    digest = hashlib.sha256(json.dumps(_stable(config)).encode()).hexdigest()[:12]
    return f" (revision {revision}, config {digest})" if revision else f" (config {digest})"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _stable(value: Any) -> Any:
    """``value`` as JSON that is the same in every process: mappings as sorted ``[key, value]``
    pairs (keys of mixed types sort as text), other objects by their repr without a memory
    address (``<Foo object at 0x7f..>`` differs between P and D)."""
    if isinstance(value, Mapping):
        return sorted(([str(k), _stable(v)] for k, v in value.items()), key=lambda kv: kv[0])
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _ADDRESS.sub("", repr(value))


MAX_KEY_CHARS = MAX_ID_CHARS
"""The longest match key kvpush's wire carries: P drops a PUSH_REG, heartbeat or CANCEL naming a
longer one as malformed, so D would wait on it for ever (and P, silent to the heartbeats that
carry it, would be taken for dead by every request of that D engine)."""


def match_key(request_id: str, kv_transfer_params: Mapping[str, Any] | None) -> str:
    """The key both legs of one request agree on: the router's ``transfer_id``, else the base id."""
    transfer_id = (kv_transfer_params or {}).get("transfer_id")
    if transfer_id is not None and (
        not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > MAX_KEY_CHARS
    ):
        raise ConfigError(
            f"kv_transfer_params['transfer_id'] must be a non-empty string of at most {MAX_KEY_CHARS} "
            f"chars (the longest key kvpush's wire carries), got {transfer_id!r:.80}"
            + (f" ({len(transfer_id)} chars)" if isinstance(transfer_id, str) else "")
        )
    key = transfer_id or base_request_id(request_id)
    if len(key) > MAX_KEY_CHARS:
        raise ConfigError(
            f"request id {request_id!r:.80} ({len(request_id)} chars) makes a match key longer than "
            f"{MAX_KEY_CHARS} chars, the longest kvpush's wire carries: give a shorter X-Request-Id "
            f"or a transfer_id"
        )
    return key


@attrs.frozen(kw_only=True)
class ConnectorSettings:
    """Every ``kv_connector_extra_config`` key the connector reads (docs/vllm.md lists them)."""

    side_channel_host: str = "127.0.0.1"
    """Host this engine's side channel is reached at (put in P's kv_transfer_params and in D's
    PUSH_REG). Default: ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` if set, else 127.0.0.1."""
    side_channel_bind_host: str | None = None
    """Interface the side channel binds (e.g. 0.0.0.0); default: ``side_channel_host``."""
    side_channel_port: int = 5600
    """Side-channel port; default ``$VLLM_NIXL_SIDE_CHANNEL_PORT`` (5600) + data-parallel index."""
    side_channel_insecure: bool = False
    """Serve the side channel on a non-loopback interface without ``KVPUSH_SIDE_CHANNEL_SECRET``
    (only on a network where every host is trusted)."""
    transport: str = "nixl"
    transport_options: dict[str, Any] = attrs.field(factory=dict)
    kv_lease_duration: float = 30.0
    """P: seconds finished blocks wait for D's registration before they are released."""
    push_registration_timeout: float = 120.0
    """D: seconds a registered request may wait for its KV before it fails."""
    handshake_timeout: float = 5.0
    staging_bytes: int = 64 << 20
    """Registered staging area for packed transfers; 0 disables packing."""
    model_name: str | None = None
    """Name both engines hash into the compatibility check; default: vLLM's served model name."""

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, data_parallel_index: int = 0
    ) -> ConnectorSettings:
        """Validate ``kv_connector_extra_config``; an unknown key or a bad value names the key."""
        extra = dict(extra or {})
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown key(s) {unknown}; kvpush's connector reads "
                f"{sorted(known)} (docs/vllm.md)"
            )
        values: dict[str, Any] = {
            "side_channel_host": os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "127.0.0.1",
            "side_channel_port": int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
            + data_parallel_index,
        }
        values.update(extra)
        checks: dict[str, tuple[type | tuple[type, ...], bool]] = {
            "side_channel_host": (str, False),
            "side_channel_bind_host": (str, True),
            "side_channel_port": (int, False),
            "side_channel_insecure": (bool, False),
            "transport": (str, False),
            "transport_options": (dict, False),
            "kv_lease_duration": ((int, float), False),
            "push_registration_timeout": ((int, float), False),
            "handshake_timeout": ((int, float), False),
            "staging_bytes": (int, False),
            "model_name": (str, True),
        }
        for name, (kind, optional) in checks.items():
            value = values.get(name)
            if value is None and (optional or name not in values):
                continue
            if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
                raise ConfigError(
                    f"kv_connector_extra_config[{name!r}] must be {getattr(kind, '__name__', 'a number')}, "
                    f"got {value!r}"
                )
        for name in ("kv_lease_duration", "push_registration_timeout", "handshake_timeout"):
            # json.loads (vLLM's reader of --kv-transfer-config) takes NaN and Infinity: a bound
            # that never runs out would hold blocks for ever, so only a finite positive one goes.
            if name in values and not (0 < values[name] < math.inf):
                raise ConfigError(
                    f"kv_connector_extra_config[{name!r}] must be a finite number of seconds > 0, "
                    f"got {values[name]}"
                )
        if not 0 < values["side_channel_port"] < 65536:
            raise ConfigError(
                f"kv_connector_extra_config['side_channel_port'] must be a TCP port (1-65535), "
                f"got {values['side_channel_port']}"
            )
        if values.get("staging_bytes", 0) < 0:
            raise ConfigError("kv_connector_extra_config['staging_bytes'] must be >= 0 (0 disables packing)")
        return cls(**values)

    @property
    def bind_host(self) -> str:
        return self.side_channel_bind_host or self.side_channel_host
