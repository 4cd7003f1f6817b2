"""The supported families are named from the adapter registry: docs/FAMILIES.md's table and
`ctxpatch compare --help` list every registered model type, and docs/FAMILIES.md's table is
exactly the generated one (regenerate: ``python -m ctxpatch.core.adapters docs/FAMILIES.md``);
the README links to it."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from ctxpatch.app.cli import main
from ctxpatch.core.adapters import REGISTRY, TABLE_MARKERS, families_markdown, with_families_table

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ROOT / "docs" / "FAMILIES.md"


def test_families_table_is_the_generated_one():
    text = FAMILIES.read_text(encoding="utf-8")
    assert all(marker in text for marker in TABLE_MARKERS)
    assert with_families_table(text) == text, (
        "run: python -m ctxpatch.core.adapters docs/FAMILIES.md")


def test_readme_links_the_families_table_and_does_not_copy_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/FAMILIES.md)" in readme
    assert not any(marker in readme for marker in TABLE_MARKERS)


def test_generated_table_names_every_model_type_once():
    table = families_markdown()
    for model_type in REGISTRY:
        assert table.count(f"`{model_type}`") == 1, model_type
    assert with_families_table(TABLE_MARKERS[0] + "stale\n" + TABLE_MARKERS[1]).count(
        "stale") == 0


def test_compare_help_names_every_model_type():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["compare", "--help"]) == 0
    text = " ".join(out.getvalue().split())  # undo the wrapping
    for model_type in REGISTRY:
        assert model_type in text, model_type
    assert "examples:" in text


def test_a_text_without_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        with_families_table("no table here")


def _parsers():  # type: ignore[no-untyped-def]
    import argparse

    from ctxpatch.app.cli import build_parser

    root = build_parser()
    yield "ctxpatch", root
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_of_every_command_has_help_text():
    missing = [(name, a.option_strings or a.dest) for name, parser in _parsers()
               for a in parser._actions if not a.help]
    assert missing == []


def test_every_help_example_parses():
    """The examples under each command's help are command lines its own parser accepts."""
    import shlex

    from ctxpatch.app.cli import build_parser

    for name, parser in _parsers():
        epilog = (parser.epilog or "").replace("\\\n", " ")
        lines = [line.split("#")[0].strip() for line in epilog.splitlines()
                 if line.strip().startswith("ctxpatch ")]
        assert lines or name == "ctxpatch", name
        for line in lines:
            build_parser().parse_args(shlex.split(line)[1:])  # exits 2 on a bad example
