"""`pip install .` builds a wheel holding one import package, `kvpush`, mapped from the repo root."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        timeout=240,
    )
    (found,) = out.glob("kvpush-*.whl")
    return found


def test_wheel_installs_only_the_kvpush_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"kvpush"}
    for package in ("core", "plugins", "transports", "layouts", "demo"):
        assert f"kvpush/{package}/__init__.py" in names
    assert "kvpush/core/hookspecs.py" in names
    assert not any(
        name.startswith("kvpush/tests/") or name.startswith("kvpush/benchmarks/") for name in names
    )


def test_installed_wheel_imports_as_kvpush(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=240,
    )
    code = (
        "import kvpush, kvpush.core.manager as m, sys;"
        "print(kvpush.__file__);"
        "print(sorted(m.get_plugin_manager(load_entrypoints=False).layouts()));"
        "print('core' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    file, layouts, bare_core = result.stdout.strip().splitlines()
    assert file.startswith(str(target))
    assert "uniform" in layouts and "hma" in layouts
    assert bare_core == "False"
