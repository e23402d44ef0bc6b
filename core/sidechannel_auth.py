"""The side channel's secret: where it comes from, the CURVE keys derived from it, the HMAC
envelope of a request; ``is_loopback`` (kvpush.core.addresses) decides whether a bind address
needs the secret (docs/security.md)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from typing import NamedTuple

import zmq
import zmq.utils.z85

from kvpush.core.addresses import is_loopback
from kvpush.core.errors import HandshakeError

__all__ = ["CurveKeys", "curve_keys", "is_loopback", "resolve_secret", "seal", "unseal"]

SECRET_ENV = "KVPUSH_SIDE_CHANNEL_SECRET"
AUTH_MAGIC = b"KVPA"
NONCE_BYTES = 16
AUTH_OVERHEAD = len(AUTH_MAGIC) + hashlib.sha256().digest_size + NONCE_BYTES
CURVE_OVERHEAD = 33
"""Bytes CURVE adds to each frame (counted against the client's ``MAXMSGSIZE``)."""
_KDF_SALT = b"kvpush side channel CURVE keys v1"


def resolve_secret(secret: bytes | str | None) -> bytes | None:
    """The shared secret: the argument, else ``KVPUSH_SIDE_CHANNEL_SECRET``; None when unset."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    return secret or None


class CurveKeys(NamedTuple):
    """Z85 CURVE keys both ends derive from the shared secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@functools.lru_cache(maxsize=8)
def curve_keys(secret: bytes) -> CurveKeys:
    """The CURVE keypairs of ``secret``: scrypt (n=2**14, r=8; ~50 ms, once per process and
    secret) so that a recorded handshake does not let a weak secret be guessed quickly."""
    material = hashlib.scrypt(secret, salt=_KDF_SALT, n=1 << 14, r=8, p=1, dklen=64)
    server_secret = zmq.utils.z85.encode(material[:32])
    client_secret = zmq.utils.z85.encode(material[32:])
    return CurveKeys(
        zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret
    )


def _mac(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(secret, direction + nonce + body, hashlib.sha256).digest()


def seal(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    """Wrap ``body`` with its HMAC (``direction`` is ``b"req"``)."""
    return AUTH_MAGIC + _mac(secret, direction, nonce, body) + nonce + body


def unseal(secret: bytes, direction: bytes, frame: bytes, nonce: bytes | None = None) -> tuple[bytes, bytes]:
    """``(nonce, body)`` of a sealed frame; raises ``HandshakeError`` if it is not sealed with
    ``secret`` (or not for ``nonce``)."""
    digest = hashlib.sha256().digest_size
    if not frame.startswith(AUTH_MAGIC) or len(frame) < AUTH_OVERHEAD:
        raise HandshakeError(
            f"the side channel needs authentication (HMAC-SHA256 with the shared secret in "
            f"{SECRET_ENV}) and this message carries none; set the same secret on both engines"
        )
    mac = frame[len(AUTH_MAGIC) : len(AUTH_MAGIC) + digest]
    got_nonce = frame[len(AUTH_MAGIC) + digest : AUTH_OVERHEAD]
    body = frame[AUTH_OVERHEAD:]
    if (nonce is not None and got_nonce != nonce) or not hmac.compare_digest(
        mac, _mac(secret, direction, got_nonce, body)
    ):
        raise HandshakeError(
            f"side-channel message failed HMAC authentication; the engines do not share the same {SECRET_ENV}"
        )
    return got_nonce, body
