"""The per-token CSV: a token text that a spreadsheet would run as a formula is written as text
(a leading single quote, OWASP "CSV Injection"); numbers, negative ones too, stay numbers."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from ctxpatch.core.export import CSV_COLUMNS, csv_text, steps_csv
from ctxpatch.core.record import read_record

RUN = Path(__file__).parents[1] / "app" / "fixtures" / "session_v0.json"
TEXT_COLUMNS = ("baseline_text", "patched_text", "control_text")
NUMBER_COLUMNS = ("linf", "tvd", "control_linf", "control_tvd")


def _steps(text: str, linf: float = -1.5e-3) -> tuple:
    steps = read_record(json.loads(RUN.read_text())["run"]).steps
    return tuple(replace(s, baseline_text=text,
                         patched=replace(s.patched, text=text, linf=linf),
                         control=replace(s.control, text=text, linf=-2.0))
                 for s in steps)


def _rows(steps: tuple) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(steps_csv(steps))))


@pytest.mark.parametrize("text", ["=cmd|' /C calc'!A0", "+1+1", "-2+3", "@SUM(A1:A2)",
                                  "\t=1+1", "\r=1+1", "\n=1", "＝1+1", "=HYPERLINK(\"x\")", "-"])
def test_a_formula_token_is_written_as_text(text: str) -> None:
    for row in _rows(_steps(text)):
        for column in TEXT_COLUMNS:
            assert row[column] == "'" + text  # quoted: a spreadsheet shows it, runs nothing


@pytest.mark.parametrize("text", ["Paris", " =1", "a=b", "'quoted", "", "1.5", "é"])
def test_plain_text_is_unchanged(text: str) -> None:
    for row in _rows(_steps(text)):
        assert all(row[c] == text for c in TEXT_COLUMNS)


def test_numbers_stay_numbers_negative_ones_too() -> None:
    rows = _rows(_steps("=1+1", linf=-1.5e-3))
    assert list(rows[0]) == list(CSV_COLUMNS)
    for row in rows:
        assert float(row["linf"]) == -1.5e-3 and row["linf"] == "-0.0015"
        assert float(row["control_linf"]) == -2.0
        assert all(not row[c].startswith("'") for c in CSV_COLUMNS if c not in TEXT_COLUMNS)
        int(row["step"]), int(row["control_id"]), float(row["seconds"])


def test_csv_text_is_the_one_rule() -> None:
    assert csv_text("=1") == "'=1" and csv_text("x") == "x" and csv_text("") == ""
