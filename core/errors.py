"""kvpush's error hierarchy. Every message names what was wrong and what to do about it."""

from __future__ import annotations


class KvpushError(Exception):
    """Base class of every error kvpush raises on purpose."""


class PluginError(KvpushError):
    """A plugin could not be loaded, is misspelled, or conflicts with another plugin."""


class ConfigError(KvpushError, ValueError):
    """A configuration, a layout or an argument is invalid."""


class WireError(KvpushError, ValueError):
    """A message on the side channel or in a notification could not be decoded."""


class HandshakeError(KvpushError):
    """A handshake with a peer failed: unreachable, incompatible, or rejected."""


class PeerProcessExited(HandshakeError):
    """The metadata a peer's side channel serves names a process that has exited (the rank is
    restarting under its name, or is gone): it is not loaded, and the handshake is tried again
    rather than counted as a failure of the peer."""


class TransferError(KvpushError):
    """Posting or completing a transfer failed.

    ``maybe_sent``: some bytes may have gone out before it failed (the default: D then fences
    the connection before it reuses the blocks); False only when nothing was handed to the
    network (e.g. the transfer could not even be prepared)."""

    def __init__(self, message: str, *, maybe_sent: bool = True) -> None:
        super().__init__(message)
        self.maybe_sent = maybe_sent


class RequestFailed(KvpushError):
    """A request could not be completed; ``reason`` says why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class WaitTimeout(KvpushError, TimeoutError):
    """A bounded wait ran out; the message says what was waited for."""
