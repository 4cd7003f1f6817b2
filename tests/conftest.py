"""Test setup: no network, offscreen Qt, the tiny-model helpers importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).parent))


def pytest_report_header() -> str:
    """The versions the numbers depend on, at the top of every run (CI's log included)."""
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in ("torch", "transformers", "PySide6-Essentials"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} not installed")
    return "ctxpatch tested with " + ", ".join(parts)
