"""Authenticated notifications: with a shared secret, every notification carries a MAC.

The key is derived from the engines' shared secret (``WorkerConfig.secret``, else
``KVPUSH_SIDE_CHANNEL_SECRET``, the side channel's). The MAC covers the sender's agent name, the
receiver's agent name, the receiver's *incarnation* (which the sender learned in the
authenticated handshake) and the message, so a process that never passed the handshake can
neither register, complete, fail nor cancel a request, a message cannot be redirected to another
agent, and a captured message is refused by a restarted receiver. Within one incarnation a
captured message can be replayed by someone on the path; every kvpush notification is
idempotent or bound to a live request (docs/reliability.md, "Threat model").

Wire: ``MAC_PREFIX + mac(16 bytes) + message``.
"""

from __future__ import annotations

import hashlib
import hmac

MAC_PREFIX = b"KVM1:"
MAC_BYTES = 16
_CONTEXT = b"kvpush notifications v1"


def derive_key(secret: bytes) -> bytes:
    """The notification key from the shared secret (never the secret itself on the wire)."""
    return hmac.new(secret, _CONTEXT, hashlib.sha256).digest()


def _mac(key: bytes, sender: str, receiver: str, receiver_incarnation: str, message: bytes) -> bytes:
    head = b"\0".join((sender.encode(), receiver.encode(), receiver_incarnation.encode())) + b"\0"
    return hmac.new(key, head + message, hashlib.sha256).digest()[:MAC_BYTES]


def seal(key: bytes, sender: str, receiver: str, receiver_incarnation: str, message: bytes) -> bytes:
    return MAC_PREFIX + _mac(key, sender, receiver, receiver_incarnation, message) + message


def unseal(key: bytes, sender: str, receiver: str, receiver_incarnation: str, frame: bytes) -> bytes | None:
    """The message if its MAC is valid for this sender and receiver, else None."""
    if not frame.startswith(MAC_PREFIX) or len(frame) < len(MAC_PREFIX) + MAC_BYTES:
        return None
    start = len(MAC_PREFIX)
    mac, message = frame[start : start + MAC_BYTES], frame[start + MAC_BYTES :]
    if not hmac.compare_digest(mac, _mac(key, sender, receiver, receiver_incarnation, message)):
        return None
    return message
