"""``MAGIC | len(json) | json | inner``: a transport's metadata with a JSON header in front."""

from __future__ import annotations

import json
import struct
from typing import Any

from kvpush.core.errors import TransferError


def frame(magic: bytes, info: dict[str, Any], inner: bytes) -> bytes:
    header = json.dumps(info, separators=(",", ":")).encode()
    return magic + struct.pack("<I", len(header)) + header + inner


def unframe(magic: bytes, blob: bytes, what: str) -> tuple[bytes, dict[str, Any] | None]:
    """``(inner, info)``; ``info`` is None when ``blob`` has no such header (an older peer)."""
    if not blob.startswith(magic):
        return blob, None
    start = len(magic) + 4
    if len(blob) < start:
        raise TransferError(f"{what} peer metadata is truncated (no header length)")
    (size,) = struct.unpack_from("<I", blob, len(magic))
    if len(blob) < start + size:
        raise TransferError(f"{what} peer metadata is truncated (header of {size} bytes)")
    try:
        info = json.loads(blob[start : start + size])
    except (ValueError, RecursionError) as err:  # RecursionError: a deeply nested header
        raise TransferError(f"{what} peer metadata header is not JSON: {err}") from err
    if not isinstance(info, dict):
        raise TransferError(f"{what} peer metadata header must be a JSON object, got {type(info).__name__}")
    return blob[start + size :], info
