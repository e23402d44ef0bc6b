"""Install ``examples/kvpush-example-plugin`` like a user would and check kvpush discovers it.

The plugin is installed with pip into a throwaway ``--target`` directory (no venv, no network:
``--no-deps --no-build-isolation --no-index``) from a copy of its source, so the repository
stays clean. Subprocesses put that directory on ``PYTHONPATH``, which is all
``importlib.metadata`` needs to find the ``kvpush`` entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kvpush-example-plugin"
CONSOLE_SCRIPT = Path(sys.executable).with_name("kvpush")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("example-plugin")
    source = root / "src"
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".benchmarks")
    )
    site = root / "site"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return {"site": site, "source": source}


def env_with(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return {**env, **extra}


PROBE = textwrap.dedent(
    """
    import json, attrs
    from kvpush import get_plugin_manager
    from kvpush.core.types import HandshakeMode
    from kvpush.testing import make_agent_metadata

    pm = get_plugin_manager()
    local = make_agent_metadata(role="prefill")
    local = attrs.evolve(local, extensions=pm.metadata_extensions(local))
    peer = make_agent_metadata(role="decode", engine_id="d-west", extensions={"example_cluster": "west"})
    print(json.dumps({
        "plugins": [[p.name, p.distribution, p.version, list(p.hooks)] for p in pm.list_plugins()],
        "extensions": dict(local.extensions),
        "problems": pm.validate_peer(local, peer, HandshakeMode.FULL),
    }))
    """
)


def probe(site: Path, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env_with(site, **env), timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_installed_layout(installed):
    site = installed["site"]
    assert (site / "kvpush_example_plugin.py").exists()
    (info,) = site.glob("kvpush_example_plugin-0.1.0.dist-info")
    assert "[kvpush]\nexample = kvpush_example_plugin" in (info / "entry_points.txt").read_text()


def test_discovered_and_called(installed):
    result = probe(installed["site"], KVPUSH_EXAMPLE_CLUSTER="east")
    plugins = {name: (dist, version, hooks) for name, dist, version, hooks in result["plugins"]}
    assert plugins["example"] == (
        "kvpush-example-plugin",
        "0.1.0",
        ["kvpush_metadata_extensions", "kvpush_validate_peer"],
    )
    assert result["extensions"] == {"example_cluster": "east"}
    (problem,) = result["problems"]
    assert "'d-west' runs in cluster 'west', this engine in 'east'" in problem


@pytest.mark.parametrize(
    "env",
    [
        {"KVPUSH_DISABLE_PLUGINS": "example"},
        {"KVPUSH_DISABLE_PLUGINS": "kvpush-example-plugin"},
        {"KVPUSH_LOAD_PLUGINS": ""},
    ],
)
def test_env_switches_keep_it_out(installed, env):
    result = probe(installed["site"], KVPUSH_EXAMPLE_CLUSTER="east", **env)
    assert "example" not in {name for name, *_ in result["plugins"]}
    assert result["extensions"] == {}
    assert result["problems"] == []


def test_load_plugins_allows_it(installed):
    result = probe(installed["site"], KVPUSH_LOAD_PLUGINS="kvpush-example-plugin")
    assert "example" in {name for name, *_ in result["plugins"]}
    assert result["extensions"] == {"example_cluster": "default"}


def test_listed_by_cli(installed):
    out = subprocess.run(
        [str(CONSOLE_SCRIPT), "plugins", "--json"],
        capture_output=True,
        text=True,
        env=env_with(installed["site"]),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plugins = {plugin["name"]: plugin for plugin in json.loads(out.stdout)["plugins"]}
    assert plugins["example"] == {
        "name": "example",
        "distribution": "kvpush-example-plugin",
        "version": "0.1.0",
        "hooks": ["kvpush_metadata_extensions", "kvpush_validate_peer"],
    }


def test_example_suite_passes_with_kvpush_testing(installed):
    """The example's own tests use kvpush.testing's fixtures, loaded through pytest11."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        cwd=installed["source"],
        env=env_with(installed["site"]),
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout
    assert "skipped" not in out.stdout
