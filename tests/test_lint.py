"""The house's static checks, run with the suite: ruff with the project's rules, and the import
contracts of pyproject.toml (core never imports the app or Qt; the Python API imports the app
only to draw a report) checked by import-linter on the layout an install has."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is missing: pip install -e '.[test]'"
    return found


def test_ruff_finds_nothing() -> None:
    done = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    """The packages as an install lays them out (pyproject's package-dir: core/ and app/ inside
    ctxpatch/), so that the import graph follows every import to its file."""
    site = tmp_path / "site" / "ctxpatch"
    shutil.copytree(ROOT / "ctxpatch", site, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("core", "app", "resources"):
        shutil.copytree(ROOT / name, site / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([_tool("lint-imports"), str(ROOT / "pyproject.toml"),
                           "--no-cache"], cwd=tmp_path,
                          env={"PYTHONPATH": str(site.parent), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout[-4000:] + done.stderr
    assert "2 kept" in done.stdout
