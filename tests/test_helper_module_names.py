"""The tests' helper modules (``tests/*.py`` that are not tests) are imported by bare name
(``from rank_engines import Engines``): one named like a package or module at the repository
root (which *is* the ``kvpush`` package) is shadowed by it wherever pytest puts the root on
``sys.path`` first. That happens when the clone's directory is not a Python identifier
(``kv-push/``): ``tests/engines.py`` was then imported as the root's ``engines/`` package and 24
tests failed with an ImportError, in such a clone only."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_no_helper_module_of_the_tests_shares_a_name_with_the_repository_root() -> None:
    helpers = {p.stem for p in TESTS.glob("*.py") if not p.stem.startswith(("test_", "conftest"))}
    root = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    shared = sorted(helpers & root)
    assert not shared, (
        f"tests/{shared[0]}.py shares its name with the repository root's {shared[0]!r}, which "
        f"shadows it in clones whose directory is not a Python identifier; rename the helper"
    )
