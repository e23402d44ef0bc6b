"""Tests of the example plugin, with the fixtures kvpush ships in ``kvpush.testing``.

``kvpush_pm_factory`` and ``make_agent_metadata`` come from kvpush's pytest plugin, which pytest
loads on its own once kvpush is installed; no conftest.py is needed.
"""

from __future__ import annotations

import attrs
import kvpush_example_plugin
import pytest

from kvpush.core.errors import HandshakeError, PluginError
from kvpush.core.types import HandshakeMode
from kvpush.testing import make_agent_metadata, register_plugin


@pytest.fixture
def pm(kvpush_pm_factory):
    return kvpush_pm_factory(("example", kvpush_example_plugin))


def published(pm, **kwargs):
    """A rank's metadata as the engine publishes it: extensions filled in by the plugins."""
    meta = make_agent_metadata(**kwargs)
    return attrs.evolve(meta, extensions=pm.metadata_extensions(meta))


def test_registered_with_its_hooks(pm):
    info = {p.name: p for p in pm.list_plugins()}["example"]
    assert info.hooks == ("kvpush_metadata_extensions", "kvpush_validate_peer")


def test_publishes_cluster(pm, monkeypatch):
    monkeypatch.setenv("KVPUSH_EXAMPLE_CLUSTER", "east")
    assert pm.metadata_extensions(make_agent_metadata()) == {"example_cluster": "east"}


def test_default_cluster(pm, monkeypatch):
    monkeypatch.delenv("KVPUSH_EXAMPLE_CLUSTER", raising=False)
    assert pm.metadata_extensions(make_agent_metadata()) == {"example_cluster": "default"}


def test_same_cluster_accepted(pm, monkeypatch):
    monkeypatch.setenv("KVPUSH_EXAMPLE_CLUSTER", "east")
    local = published(pm, role="prefill")
    peer = published(pm, role="decode")
    assert pm.validate_peer(local, peer, HandshakeMode.FULL) == []
    pm.check_peer(local, peer, HandshakeMode.FULL)


def test_other_cluster_refused(pm, monkeypatch):
    monkeypatch.setenv("KVPUSH_EXAMPLE_CLUSTER", "east")
    local = published(pm, role="prefill")
    monkeypatch.setenv("KVPUSH_EXAMPLE_CLUSTER", "west")
    peer = published(pm, role="decode", engine_id="d0")
    with pytest.raises(HandshakeError, match=r"'d0' runs in cluster 'west', this engine in 'east'"):
        pm.check_peer(local, peer, HandshakeMode.NOTIF_ONLY)


def test_peer_without_plugin_accepted(pm, kvpush_pm):
    local = published(pm, role="prefill")
    peer = published(kvpush_pm, role="decode")  # a decode engine without the plugin
    assert "example_cluster" not in peer.extensions
    assert pm.validate_peer(local, peer, HandshakeMode.FULL) == []


def test_field_clash_with_another_plugin(kvpush_pm):
    class Clashing:
        @staticmethod
        @kvpush_example_plugin.hookimpl
        def kvpush_metadata_extensions(local):
            return {"example_cluster": "mine"}

    register_plugin(kvpush_pm, kvpush_example_plugin, "example")
    register_plugin(kvpush_pm, Clashing)
    with pytest.raises(PluginError, match="metadata field 'example_cluster'") as excinfo:
        kvpush_pm.metadata_extensions(make_agent_metadata())
    assert "'example'" in str(excinfo.value)
    assert "'Clashing'" in str(excinfo.value)
