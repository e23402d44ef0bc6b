"""P posts to a D rank only after a grant issued since it (re)loaded that rank's agent.

Found by the transport probe (``tests/test_probe_transport_netns.py``, xfail there): a WRITE
posted before its UCX connection to D is up is queued inside UCX; P's abort at the WRITE
deadline (releasing the handle, removing D's agent) does not cancel it, and D's fence finds no
socket to shut, so when the link heals the whole WRITE lands, after D released the blocks.

P's protocol posted such WRITEs: after P dropped a D engine (a WRITE past its deadline), D's
next registration reloaded it and was written at once on the new connection, because the grant
it carried (a stamp P sent over the old connection, still within the freshness window) looked
fresh. Now a grant only counts once issued at or after the load of the D rank's agent: D can
only have such a stamp if this connection carried it, and a WRITE on an established connection
is one D's fence covers. A reload costs one ``want`` round trip.
"""

from __future__ import annotations

from test_protocol_safety import _registration
from test_retry_after_abort import _core, _note, _posts

from kvpush.core import notifications as wire
from kvpush.core.actions import Connect, DropPeer, Send


def _wants(actions: list) -> set[str]:
    keys: set[str] = set()
    for action in actions:
        if isinstance(action, Send):
            note = _note(action.message)
            keys |= set(getattr(note, "want", ()) or ())
    return keys


def test_after_a_reload_a_grant_sent_over_the_old_connection_is_not_written() -> None:
    core = _core()  # D rank 0 loaded at 100.0 (HELLO answered with stamp 100.0)
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    reg1 = _registration(grant=100.0)
    (post,) = _posts(core.notification("D-agent", _note(wire.encode_push_reg(reg1)), 100.1))
    assert core.confirm_post("x-1", 0, 100.1)
    core.posted("x-1", 0, ["h"], 8, 100.1)
    # The WRITE never ends: at its deadline P aborts it, tells D and drops D's agent.
    expired = core.handle_timer(100.1 + core.s.write_deadline_s + 0.01)
    assert any(isinstance(a, DropPeer) for a in expired), expired

    # D's next request: its PUSH_REG carries the newest stamp D had, one P sent over the old
    # connection (fresh for another ~10 s). P loads D's agent again: a new connection.
    core.finished("x-2", "p-2", ((6,),), "", 111.0)
    stale_conn = _registration(request_id="d-2", match_key="x-2", block_ids=[[4]], grant=110.5)
    actions = core.notification("D-agent", _note(wire.encode_push_reg(stale_conn)), 111.0)
    assert any(isinstance(a, Connect) for a in actions), actions
    loaded = core.connected("D", 0, "D-agent", "d1", 1, "", 111.1)
    assert [p.key for p in _posts(loaded)] == ["x-2"]  # planned: the grant looks fresh
    assert not core.confirm_post("x-2", 0, 111.1), "a WRITE on a connection nothing shows is up"
    assert core.stats["grants_before_load"] == 1
    asked = core.refresh("x-2", 0, 111.1) + core.handle_timer(111.1 + core.s.want_interval_s)
    assert "x-2" in _wants(loaded + asked), "P asks D for a grant over the new connection"

    # D answers the want with its PUSH_REG again, carrying the stamp that came over the new
    # connection: now it is written.
    renewed = _registration(request_id="d-2", match_key="x-2", block_ids=[[4]], grant=111.15)
    (post,) = _posts(core.notification("D-agent", _note(wire.encode_push_reg(renewed)), 111.2))
    assert post.registration.request_id == "d-2"
    assert core.confirm_post("x-2", 0, 111.2)


def test_the_first_load_needs_no_extra_round_trip() -> None:
    """The HELLO answer's stamp is issued at the load: D's first PUSH_REG echoes it and is
    written at once."""
    core = _core()
    core.finished("x-1", "p-1", ((5,),), "", 100.0)
    first = _registration(grant=100.0)
    assert len(_posts(core.notification("D-agent", _note(wire.encode_push_reg(first)), 100.1))) == 1
    assert core.confirm_post("x-1", 0, 100.1)
    assert core.stats["grants_before_load"] == 0
