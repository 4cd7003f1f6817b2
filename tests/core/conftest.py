"""Fixtures of the core tests that several modules share (a module defining its own wins)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import llama_config, save_tiny_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of two layers saved as a model folder."""
    return Path(save_tiny_folder(tmp_path_factory.mktemp("tiny-llama"), llama_config(layers=2)))
