"""The host path's fast paths (issue 14) decide exactly what the general paths decide.

A direct DONE is decoded inline (:func:`kvpush.core.notifications._direct_done`), and hooks
are called without pluggy's call loop while it would only call the implementations in turn
(:meth:`KvpushPluginManager._direct_calls`); both must give the general path's answer or
error on every input, and a plugin registered, wrapped or traced later is still honoured.
"""

from __future__ import annotations

import msgpack
import pytest

from kvpush import hookimpl
from kvpush.core import notifications as wire
from kvpush.core.errors import WireError
from kvpush.core.types import Notification, NotificationKind, PackManifest, RankKey


def _body(**fields: object) -> bytes:
    base: dict[str, object] = {"request_id": "r-1", "pp": 0, "tp": 0, "ptp": 1, "v": [2, 0]}
    base.update(fields)
    return wire.DONE_PREFIX + msgpack.packb({k: v for k, v in base.items() if v is not _GONE})


_GONE = object()

CASES = [
    wire.encode_done("r-1", RankKey(0, 0), 1),
    wire.encode_done("r" * wire.MAX_ID_CHARS, RankKey(4095, 4095), 4096),
    wire.encode_done("r", RankKey(3, 7), 8, PackManifest(staging_offset=64, regions=[0, 1])),
    _body(v=[2, 9, "extra"], extra_field={"ignored": True}),
    _body(pk=None),
    _body(request_id=""),
    _body(request_id="r" * (wire.MAX_ID_CHARS + 1)),
    _body(request_id=7),
    _body(pp=-1),
    _body(pp=4096),
    _body(tp=True),
    _body(tp=1.0),
    _body(ptp=0),
    _body(ptp=4097),
    _body(ptp=_GONE),
    _body(v=[3, 0]),
    _body(v=[2]),
    _body(v=[False, 0]),
    _body(v=_GONE),
    wire.DONE_PREFIX + msgpack.packb([1, 2]),
    wire.DONE_PREFIX + b"\xc1",
    wire.DONE_PREFIX,
]


def _general(message: bytes, monkeypatch: pytest.MonkeyPatch) -> Notification | str:
    with monkeypatch.context() as patch:
        patch.setattr(wire, "_direct_done", lambda message: None)
        return _outcome(message)


def _outcome(message: bytes) -> Notification | str:
    try:
        return wire.decode_notification(message)  # type: ignore[return-value]
    except WireError as err:
        return f"WireError: {err}"


@pytest.mark.parametrize("message", CASES)
def test_direct_done_decodes_as_the_general_path(message: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _outcome(message)
    assert fast == _general(message, monkeypatch)
    if isinstance(fast, Notification):
        assert type(fast.producer) is RankKey


def test_direct_done_keeps_the_range_checks() -> None:
    with pytest.raises(WireError, match="field 'pp'"):
        wire.decode_notification(_body(pp=4096))
    with pytest.raises(WireError, match=r"format 3\.0"):
        wire.decode_notification(_body(v=[3, 0]))
    note = wire.decode_notification(wire.encode_done("r-9", RankKey(1, 2), 4))
    assert note == Notification(
        kind=NotificationKind.DONE, request_id="r-9", producer=RankKey(1, 2), producer_tp_size=4
    )


class _Legacy:
    @staticmethod
    @hookimpl
    def kvpush_decode_notification(message):
        if message.startswith(b"OLD_DONE "):
            return Notification(kind=NotificationKind.DONE, request_id=message.split()[1].decode())
        return None


class _Wrapper:
    def __init__(self) -> None:
        self.seen: list[bytes] = []

    @hookimpl(wrapper=True)
    def kvpush_decode_notification(self, message):
        self.seen.append(message)
        return (yield)


def test_decode_hook_sees_plugins_registered_later(kvpush_pm) -> None:
    done = wire.encode_done("r-1", RankKey(0, 0), 1)
    assert kvpush_pm.decode_notification(done).request_id == "r-1"  # direct calls cached
    assert kvpush_pm.decode_notification(b"OLD_DONE r7") is None
    kvpush_pm.register(_Legacy, "legacy")
    assert kvpush_pm.decode_notification(b"OLD_DONE r7").request_id == "r7"
    assert kvpush_pm.decode_notification(done).request_id == "r-1"  # the built-in still answers
    kvpush_pm.pm.unregister(name="legacy")
    assert kvpush_pm.decode_notification(b"OLD_DONE r7") is None


def test_decode_hook_wrappers_and_tracing_go_through_pluggy(kvpush_pm) -> None:
    done = wire.encode_done("r-1", RankKey(0, 0), 1)
    kvpush_pm.decode_notification(done)
    wrapper = _Wrapper()
    kvpush_pm.register(wrapper, "wrapper")
    assert kvpush_pm.decode_notification(done).request_id == "r-1"
    assert wrapper.seen == [done]
    kvpush_pm.pm.unregister(wrapper)
    traced: list[str] = []
    undo = kvpush_pm.pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: traced.append(name), lambda *args: None
    )
    try:
        kvpush_pm.decode_notification(done)
    finally:
        undo()
    assert traced == ["kvpush_decode_notification"]


def test_decode_hook_errors_pass_through(kvpush_pm) -> None:
    with pytest.raises(WireError, match="DONE field 'ptp'"):
        kvpush_pm.decode_notification(_body(ptp=0))
