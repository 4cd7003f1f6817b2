"""The supported families are named from the adapter registry: the README's table and
`ctxpatch compare --help` list every registered model type, and the README's table is exactly
the generated one (regenerate with ``python -m core.adapters README.md``)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from app.cli import main
from core.adapters import README_MARKERS, REGISTRY, families_markdown, readme_with_families

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_table_is_the_generated_one():
    text = README.read_text(encoding="utf-8")
    assert all(marker in text for marker in README_MARKERS)
    assert readme_with_families(text) == text, "run: python -m core.adapters README.md"


def test_generated_table_names_every_model_type_once():
    table = families_markdown()
    for model_type in REGISTRY:
        assert table.count(f"`{model_type}`") == 1, model_type
    assert readme_with_families(README_MARKERS[0] + "stale\n" + README_MARKERS[1]).count(
        "stale") == 0


def test_compare_help_names_every_model_type():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["compare", "--help"]) == 0
    text = " ".join(out.getvalue().split())  # undo the wrapping
    for model_type in REGISTRY:
        assert model_type in text, model_type
    assert "examples:" in text


def test_readme_without_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        readme_with_families("no table here")
