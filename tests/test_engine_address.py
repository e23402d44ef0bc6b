"""A P engine id named at another address than the one D knows it at.

Two P engines started with one engine id (a config deployed twice), or a P that moved (restarted
elsewhere under its id): D used to register the request with the engine it knew, which never
pushes it, and the request waited for its registration timeout. Now an idle engine is forgotten
and handshaken afresh where the request names it; a busy one fails the new request at once,
naming both addresses. The cores are driven directly (no transport, an injected clock).
"""

from __future__ import annotations

from typing import Any

from test_adversarial_keepalive import P_AGENT, _answer, _decode, _info, _note, _reports, _sent

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, DropPeer
from kvpush.core.types import RankKey, RequestMetadata, TransferParams

P0 = RankKey(0, 0)


def _meta(rid: str, key: str, host: str) -> RequestMetadata:
    params = {"remote_engine_id": "P", "remote_host": host, "remote_port": 5600, "transfer_id": key}
    return RequestMetadata(request_id=rid, block_ids=((1,),), params=TransferParams.from_dict(params))


def _connects(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.engine_id, a.host) for a in actions if isinstance(a, Connect)]


def test_an_idle_engine_named_at_another_address_is_handshaken_afresh_there() -> None:
    d = _decode()
    assert _connects(d.add(_meta("r1", "k1", "p-a"), 0.0)) == [("P", "p-a")]
    d.connected("P", _info(), "", 0.0)
    d.notification(P_AGENT, _answer(0.0), 0.0)
    done = d.notification(P_AGENT, _note(wire.encode_done("r1", P0, 1)), 0.1)
    assert [r.outcome for r in _reports(done)] == ["done"]
    out = d.add(_meta("r2", "k2", "p-b"), 1.0)
    drops = [a for a in out if isinstance(a, DropPeer)]
    assert len(drops) == 1 and "p-b:5600" in drops[0].reason and "p-a:5600" in drops[0].reason, out
    assert _connects(out) == [("P", "p-b")]
    assert not _reports(out), "the request waits for the new handshake"
    assert [n.kind.value for n in _sent(d.connected("P", _info("p2"), "", 1.0))] == ["hello"]
    assert [n.kind.value for n in _sent(d.notification(P_AGENT, _answer(1.0, "p2"), 1.0))] == ["push_reg"]


def test_a_busy_engine_named_at_another_address_fails_the_new_request_at_once() -> None:
    d = _decode()
    d.add(_meta("r1", "k1", "p-a"), 0.0)
    d.connected("P", _info(), "", 0.0)
    d.notification(P_AGENT, _answer(0.0), 0.0)  # r1 registered, waiting for its push
    out = d.add(_meta("r2", "k2", "p-b"), 1.0)
    (report,) = _reports(out)
    assert report.request_id == "r2" and report.outcome == "failed", report
    assert "p-a:5600" in report.reason and "p-b:5600" in report.reason, report.reason
    assert "share one engine_id" in report.reason
    assert not _connects(out) and not [a for a in out if isinstance(a, DropPeer)]
    done = d.notification(P_AGENT, _note(wire.encode_done("r1", P0, 1)), 1.1)
    assert [(r.request_id, r.outcome) for r in _reports(done)] == [("r1", "done")], "r1 unaffected"


def test_an_engine_mid_handshake_named_at_another_address_fails_the_new_request() -> None:
    """The request that started the handshake was cancelled: nothing uses the engine, but its
    handshake is still in flight (its result would be taken for the new address's)."""
    d = _decode()
    assert _connects(d.add(_meta("r1", "k1", "p-a"), 0.0)) == [("P", "p-a")]
    d.cancel("r1", 0.01)
    out = d.add(_meta("r2", "k2", "p-b"), 0.02)
    (report,) = _reports(out)
    assert report.request_id == "r2" and report.outcome == "failed", report
    assert "p-a:5600" in report.reason and "p-b:5600" in report.reason, report.reason
    assert not _connects(out) and not [a for a in out if isinstance(a, DropPeer)]
