"""Prompt fingerprints: what lets P check that D's registration is for the prompt P prefilled.

P pairs D's ``PUSH_REG`` with its finished prefill by the match key alone (the router's
``transfer_id``, or P's request id). A router that reuses a key for another prompt would make P
push prompt A's KV into D's request for prompt B, which D cannot tell from the right KV. When
both legs state a fingerprint of their own prompt and the two differ, P writes nothing and
fails both legs (docs/engine-api.md, "Prompt fingerprints").

Both engines must compute it alike: :func:`prompt_fingerprint` over the prompt's token ids.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable
from typing import Any

from kvpush.core.errors import ConfigError

MAX_FINGERPRINT_CHARS = 128
"""Longest fingerprint either side accepts (from an engine, a router or the wire)."""

_PERSON = b"kvpush.prompt"


def prompt_fingerprint(token_ids: Iterable[int]) -> str:
    """A short, stable digest of a prompt's token ids: 32 hex chars, the BLAKE2b-128 (person
    ``kvpush.prompt``) of the ids as little-endian int64. Equal prompts give equal strings on
    every host; a list, tuple, ``array`` or numpy array of ints are all accepted.

    Raises ``ConfigError`` for an id that is not an int in the int64 range."""
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise ConfigError(
            f"prompt_fingerprint needs the prompt's token ids, got a {type(token_ids).__name__}"
        )
    try:
        ids = array("q", token_ids)
    except (TypeError, OverflowError) as err:
        raise ConfigError(
            f"prompt_fingerprint needs the prompt's token ids (ints in the int64 range): {err}"
        ) from None
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=16, person=_PERSON).hexdigest()


def check_fingerprint(value: Any, what: str) -> str | None:
    """``value`` as a fingerprint (None when absent); else ``ConfigError`` naming ``what``."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_FINGERPRINT_CHARS:
        raise ConfigError(
            f"{what} must be a non-empty string of at most {MAX_FINGERPRINT_CHARS} chars "
            f"(kvpush.engine.prompt_fingerprint(token_ids)), got {str(value)[:80]!r}"
        )
    return value
