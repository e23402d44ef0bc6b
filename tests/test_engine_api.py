"""kvpush.engine is the stable surface; `python -m kvpush` is the kvpush command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvpush
import kvpush.engine as engine

ROOT = Path(__file__).resolve().parents[1]


def test_all_names_resolve_and_are_the_core_objects():
    from kvpush.core.receiver import PushReceiver
    from kvpush.core.sender import PushSender
    from kvpush.core.worker import WorkerConfig

    assert sorted(engine.__all__) == engine.__all__
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name
    assert engine.PushSender is PushSender and engine.PushReceiver is PushReceiver
    assert engine.WorkerConfig is WorkerConfig
    assert issubclass(engine.WaitTimeout, engine.KvpushError)
    assert (Path(kvpush.__file__).parent / "py.typed").exists()


def test_importing_loads_no_torch_or_nixl():
    code = (
        "import sys, kvpush, kvpush.engine; print(sorted(m for m in ('torch', 'nixl') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_python_dash_m_kvpush_is_the_command():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    out = subprocess.run(
        [sys.executable, "-m", "kvpush", "--version"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvpush {kvpush.__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "kvpush", "plugins", "--json"],
        capture_output=True,
        text=True,
        env={**env, "KVPUSH_LOAD_PLUGINS": ""},
        timeout=120,
    )
    assert out.returncode == 0 and '"layouts"' in out.stdout


def test_multiprocess_engine_example_pushes_and_verifies():
    """docs/engine-api.md's example: ranks in their own processes, one side channel per engine."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "engine_multiprocess.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "P: ['sent', 'sent'] D: ['verified', 'verified']" in out.stdout
