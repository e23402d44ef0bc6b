"""The plugin manager: built-ins, registration errors, typos, entry points and the env switches."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpush import hookimpl
from kvpush.core.errors import PluginError
from kvpush.core.manager import BUILTIN_PLUGINS, KvpushPluginManager, get_plugin_manager
from kvpush.core.types import ParallelConfig, PushJob, Role
from kvpush.testing import make_agent_metadata, register_plugin

# ------------------------------------------------------------------------------ built-ins


def test_builtins_registered_with_provenance(kvpush_pm):
    import kvpush

    infos = {info.name: info for info in kvpush_pm.list_plugins()}
    assert set(infos) == set(BUILTIN_PLUGINS)
    assert [info.name for info in kvpush_pm.list_plugins()] == sorted(infos)
    for info in infos.values():
        assert (info.distribution, info.version) == ("kvpush", kvpush.__version__)
        assert info.hooks == tuple(sorted(info.hooks))
    assert infos["defaults"].hooks == (
        "kvpush_decode_notification",
        "kvpush_expected_producers",
        "kvpush_handshake_mode",
        "kvpush_validate_peer",
    )
    assert infos["nixl"].hooks == ("kvpush_transports",)
    assert infos["tp_mapping"].hooks == ("kvpush_build_read_specs",)
    assert infos["pp_slicing"].hooks == ("kvpush_align_regions", "kvpush_validate_peer")


def test_plugin_manager_facade_is_lazy_export():
    import kvpush

    manager = kvpush.get_plugin_manager(load_entrypoints=False, env={})
    assert isinstance(manager, KvpushPluginManager)
    assert "nixl" in manager.transports()


def test_caller_plugins_are_local(kvpush_pm_factory):
    class Mine:
        @staticmethod
        @hookimpl
        def kvpush_metadata_extensions():
            return {"mine": True}

    infos = {info.name: info for info in kvpush_pm_factory(("mine", Mine)).list_plugins()}
    assert (infos["mine"].distribution, infos["mine"].version) == ("local", "-")
    assert infos["mine"].hooks == ("kvpush_metadata_extensions",)


# ------------------------------------------------------------------------------ validation


def test_misspelled_hook_fails_startup():
    class Typo:
        @staticmethod
        @hookimpl
        def kvpush_layout():
            return []

    with pytest.raises(PluginError) as excinfo:
        get_plugin_manager(load_entrypoints=False, plugins=[("typo", Typo)], env={})
    message = str(excinfo.value)
    assert "plugin 'typo'" in message
    assert "kvpush_layout" in message
    assert "kvpush_layouts" in message  # the list of known hooks points at the right name
    assert "Rename the function" in message


def test_misspelled_hook_registered_late_is_caught(kvpush_pm):
    class Late:
        @staticmethod
        @hookimpl
        def kvpush_transport():
            return []

    with pytest.raises(PluginError, match="kvpush_transport"):
        register_plugin(kvpush_pm, Late)


def test_unknown_argument_fails_registration():
    class Wrong:
        @staticmethod
        @hookimpl
        def kvpush_validate_peer(local, remote):
            return []

    with pytest.raises(PluginError, match=r"plugin 'wrong' \(distribution local -\) is invalid") as exc:
        get_plugin_manager(load_entrypoints=False, plugins=[("wrong", Wrong)], env={})
    assert "remote" in str(exc.value)


def test_duplicate_plugin_name_fails(kvpush_pm):
    class Again:
        pass

    with pytest.raises(PluginError, match="plugin 'nixl' could not be registered"):
        kvpush_pm.register(Again, "nixl")


def test_default_valued_impl_parameter_is_not_passed(kvpush_pm):
    """The pluggy trap docs/plugins.md warns about: defaults in impl parameters are not passed."""
    seen = []

    class Defaulted:
        @staticmethod
        @hookimpl(tryfirst=True)
        def kvpush_handshake_mode(role, peer_role=Role.DECODE):
            seen.append(peer_role)

    register_plugin(kvpush_pm, Defaulted)
    kvpush_pm.handshake_mode(Role.DECODE, Role.PREFILL)
    assert seen == [Role.DECODE]  # never the PREFILL the caller passed


def test_wrappers_do_not_break_collect_hooks(kvpush_pm):
    calls = []

    class Timing:
        @staticmethod
        @hookimpl(wrapper=True)
        def kvpush_transports():
            calls.append("transports")
            return (yield)

        @staticmethod
        @hookimpl(wrapper=True)
        def kvpush_expected_producers():
            calls.append("expected")
            return (yield)

    register_plugin(kvpush_pm, Timing)
    assert "nixl" in kvpush_pm.transports()
    prefill = ParallelConfig(tp_size=2, num_layers=2)
    assert len(kvpush_pm.expected_producers(prefill, 0, 1)) == 2
    assert calls == ["expected"]  # a first-result hook runs its wrapper; collect hooks skip it


# ------------------------------------------------------------------------------ env switches


def test_disable_builtins_by_name(kvpush_pm_factory):
    pm = kvpush_pm_factory(env={"KVPUSH_DISABLE_PLUGINS": " mla_replication , pp_slicing"})
    names = {info.name for info in pm.list_plugins()}
    assert names == set(BUILTIN_PLUGINS) - {"mla_replication", "pp_slicing"}
    # Without MLA replication, a replicated latent falls back to TP head slicing.
    job = PushJob(
        local=make_agent_metadata(attention="mla"),
        decode_tp_size=2,
        local_block_ids=[1],
        remote_block_ids=[2],
    )
    assert [spec.local_part for spec in pm.build_read_specs(job)] == [(0, 2), (1, 2)]


def test_disable_defaults_removes_the_policies(kvpush_pm_factory):
    pm = kvpush_pm_factory(env={"KVPUSH_DISABLE_PLUGINS": "defaults"})
    with pytest.raises(PluginError, match="'defaults' plugin disabled"):
        pm.handshake_mode(Role.PREFILL, Role.DECODE)
    assert pm.decode_notification(b"DONE:\x80") is None  # nobody decodes


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("KVPUSH_DISABLE_PLUGINS", "nixl")
    monkeypatch.setenv("KVPUSH_LOAD_PLUGINS", "")
    assert "nixl" not in get_plugin_manager().transports()
    assert "nixl" in get_plugin_manager(env={}).transports()


# ------------------------------------------------------------------------------ entry points


def write_distribution(root: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A minimal installed distribution: ``<name>-1.0.dist-info`` plus top-level modules."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kvpush]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def extension_module(key: str) -> str:
    return f"""
        from kvpush import hookimpl

        @hookimpl
        def kvpush_metadata_extensions(local):
            return {{"{key}": local.engine_id}}
    """


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    """Two plugins (alpha, beta) from one distribution on sys.path."""
    write_distribution(
        tmp_path,
        "fake-kvpush-plugins",
        {"alpha": "fake_alpha", "beta": "fake_beta"},
        {"fake_alpha": extension_module("alpha"), "fake_beta": extension_module("beta")},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in ("fake_alpha", "fake_beta", "fake_broken", "fake_typo", "fake_nixl"):
        sys.modules.pop(module, None)


def loaded(pm: KvpushPluginManager) -> dict[str, tuple[str, str]]:
    return {
        info.name: (info.distribution, info.version)
        for info in pm.list_plugins()
        if info.name not in BUILTIN_PLUGINS
    }


def test_entrypoints_discovered(fake_dists):
    pm = get_plugin_manager(env={})
    assert loaded(pm) == {"alpha": ("fake-kvpush-plugins", "1.0"), "beta": ("fake-kvpush-plugins", "1.0")}
    assert pm.metadata_extensions(make_agent_metadata(engine_id="e1")) == {"alpha": "e1", "beta": "e1"}


def test_entrypoints_not_loaded_on_request(fake_dists):
    assert loaded(get_plugin_manager(env={}, load_entrypoints=False)) == {}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"KVPUSH_LOAD_PLUGINS": "alpha"}, {"alpha"}),
        ({"KVPUSH_LOAD_PLUGINS": "beta,alpha"}, {"alpha", "beta"}),
        ({"KVPUSH_LOAD_PLUGINS": "fake-kvpush-plugins"}, {"alpha", "beta"}),
        ({"KVPUSH_LOAD_PLUGINS": ""}, set()),
        ({"KVPUSH_LOAD_PLUGINS": "alpha,nixl"}, {"alpha"}),  # built-in names are accepted
        ({"KVPUSH_DISABLE_PLUGINS": "beta"}, {"alpha"}),
        ({"KVPUSH_DISABLE_PLUGINS": "fake-kvpush-plugins"}, set()),
        ({"KVPUSH_LOAD_PLUGINS": "alpha,beta", "KVPUSH_DISABLE_PLUGINS": "alpha"}, {"beta"}),
    ],
)
def test_entrypoints_env_switches(fake_dists, env, expected):
    pm = get_plugin_manager(env=env)
    assert set(loaded(pm)) == expected
    assert set(pm.metadata_extensions(make_agent_metadata())) == expected


def test_load_plugins_names_missing_plugin(fake_dists):
    with pytest.raises(PluginError, match="KVPUSH_LOAD_PLUGINS names 'gamma'"):
        get_plugin_manager(env={"KVPUSH_LOAD_PLUGINS": "alpha,gamma"})


def test_broken_entrypoint_names_plugin_and_escape_hatch(fake_dists, tmp_path, monkeypatch):
    write_distribution(
        tmp_path / "broken",
        "broken-dist",
        {"broken": "fake_broken"},
        {"fake_broken": "raise ImportError('libfabric.so.1: cannot open shared object file')\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path / "broken"))
    with pytest.raises(PluginError) as excinfo:
        get_plugin_manager(env={})
    message = str(excinfo.value)
    assert "plugin 'broken' from distribution broken-dist 1.0 failed to import" in message
    assert "libfabric.so.1" in message
    assert "KVPUSH_DISABLE_PLUGINS=broken" in message
    assert set(loaded(get_plugin_manager(env={"KVPUSH_DISABLE_PLUGINS": "broken"}))) == {"alpha", "beta"}


def test_entrypoint_typo_names_distribution(fake_dists, tmp_path, monkeypatch):
    write_distribution(
        tmp_path / "typo",
        "typo-dist",
        {"typo": "fake_typo"},
        {
            "fake_typo": extension_module("typo").replace(
                "kvpush_metadata_extensions", "kvpush_validate_peers"
            )
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path / "typo"))
    with pytest.raises(
        PluginError, match=r"plugin 'typo' \(distribution typo-dist 1.0\).*kvpush_validate_peers"
    ):
        get_plugin_manager(env={})


def test_entrypoint_named_like_a_builtin_fails(fake_dists, tmp_path, monkeypatch):
    write_distribution(
        tmp_path / "clash",
        "nixl-replacement",
        {"nixl": "fake_nixl"},
        {"fake_nixl": "from kvpush import hookimpl\n\n@hookimpl\ndef kvpush_transports():\n    return []\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path / "clash"))
    with pytest.raises(PluginError, match=r"'nixl' from distribution nixl-replacement 1\.0") as excinfo:
        get_plugin_manager(env={})
    assert "already registered from kvpush" in str(excinfo.value)
    pm = get_plugin_manager(env={"KVPUSH_DISABLE_PLUGINS": "nixl-replacement"})
    assert pm.transport("nixl").name == "nixl"


def test_same_distribution_twice_on_path_loads_once(fake_dists, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_dists))
    assert sys.path.count(str(fake_dists)) == 2
    assert set(loaded(get_plugin_manager(env={}))) == {"alpha", "beta"}


# ------------------------------------------------------------------------------ no side effects

HEAVY_PREFIXES = ("torch", "nixl")

IMPORT_PROBE = """
import json, sys
import kvpush, kvpush.core.manager, kvpush.transports.nixl
import kvpush.testing, kvpush.layouts.uniform, kvpush.plugins.defaults
after_import = sorted(sys.modules)
manager = kvpush.get_plugin_manager(load_entrypoints=False, env={})
providers = sorted(manager.transports()), sorted(manager.layouts())
print(json.dumps({"import": after_import, "manager": sorted(sys.modules), "providers": providers}))
"""


def test_import_has_no_side_effects():
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    modules = json.loads(out.stdout)
    for phase in ("import", "manager"):
        heavy = [m for m in modules[phase] if m.split(".")[0].startswith(HEAVY_PREFIXES)]
        assert heavy == [], f"{phase} pulled in {heavy}"
    transports, layouts = modules["providers"]
    assert "nixl" in transports
    assert "uniform" in layouts
    assert out.stderr == ""
