"""The ``kvpush`` command: ``plugins [--json]`` and ``--version``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvpush
from kvpush.cli import main
from kvpush.core.errors import PluginError
from kvpush.core.manager import BUILTIN_PLUGINS

CONSOLE_SCRIPT = Path(sys.executable).with_name("kvpush")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    return {**env, **extra}


def run_kvpush(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args], capture_output=True, text=True, env=clean_env(**env), timeout=120
    )


def check_shape(report: dict) -> None:
    assert set(report) == {"plugins", "transports", "layouts"}
    for plugin in report["plugins"]:
        assert set(plugin) == {"name", "distribution", "version", "hooks"}
        assert all(isinstance(plugin[key], str) for key in ("name", "distribution", "version"))
        assert plugin["hooks"] == sorted(plugin["hooks"])
        assert all(hook.startswith("kvpush_") for hook in plugin["hooks"])
    names = [plugin["name"] for plugin in report["plugins"]]
    assert names == sorted(names)
    assert report["transports"] == sorted(report["transports"])
    assert report["layouts"] == sorted(report["layouts"])


def test_plugins_json_console_script():
    assert CONSOLE_SCRIPT.exists(), "the kvpush console script is not installed in this environment"
    out = run_kvpush("plugins", "--json", KVPUSH_LOAD_PLUGINS="")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    check_shape(report)
    plugins = {plugin["name"]: plugin for plugin in report["plugins"]}
    assert set(plugins) == set(BUILTIN_PLUGINS)
    assert plugins["nixl"] == {
        "name": "nixl",
        "distribution": "kvpush",
        "version": kvpush.__version__,
        "hooks": ["kvpush_transports"],
    }
    assert "nixl" in report["transports"]
    assert "uniform" in report["layouts"]


def test_plugins_json_respects_disable():
    out = run_kvpush("plugins", "--json", KVPUSH_LOAD_PLUGINS="", KVPUSH_DISABLE_PLUGINS="nixl,pp_slicing")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    names = {plugin["name"] for plugin in report["plugins"]}
    assert names == set(BUILTIN_PLUGINS) - {"nixl", "pp_slicing"}
    assert "nixl" not in report["transports"]


def test_plugins_module_entry_text():
    out = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "plugins"],
        capture_output=True,
        text=True,
        env=clean_env(KVPUSH_LOAD_PLUGINS=""),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    defaults = next(line for line in lines if line.startswith("defaults "))
    assert f"kvpush {kvpush.__version__}" in defaults
    assert "kvpush_handshake_mode" in defaults
    assert any(line.startswith("transports: ") and "nixl" in line for line in lines)
    assert any(line.startswith("layouts: ") and "uniform" in line for line in lines)


def test_plugins_in_process(capsys, monkeypatch):
    monkeypatch.setenv("KVPUSH_LOAD_PLUGINS", "")
    monkeypatch.setenv("KVPUSH_DISABLE_PLUGINS", "mla_replication")
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    check_shape(report)
    assert "mla_replication" not in {plugin["name"] for plugin in report["plugins"]}


def test_plugins_reports_broken_setup(capsys, monkeypatch):
    monkeypatch.setenv("KVPUSH_LOAD_PLUGINS", "not-installed-plugin")
    with pytest.raises(PluginError, match="KVPUSH_LOAD_PLUGINS names 'not-installed-plugin'"):
        main(["plugins", "--json"])


def test_version():
    out = run_kvpush("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvpush {kvpush.__version__}"
