"""Test setup: no network, offscreen Qt, the tiny-model helpers importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def picture():  # type: ignore[no-untyped-def]
    """The bundled sample picture, decoded (the image tests' context)."""
    from ctxpatch.core.images import read_image
    from ctxpatch.resources import sample_image_path

    return read_image(sample_image_path())


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


@pytest.fixture(autouse=True)
def _default_dtype_is_restored():  # type: ignore[no-untyped-def]
    """Every test starts and ends with torch's default dtype float32, as a user's process does
    (a test that changed it at import once made later tests pass or fail by order)."""
    import torch

    assert torch.get_default_dtype() == torch.float32, "a test left the default dtype changed"
    yield
    assert torch.get_default_dtype() == torch.float32, "this test left the default dtype changed"
