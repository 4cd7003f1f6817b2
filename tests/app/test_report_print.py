"""Issue 35 #6, the report laid out for print: parameter names wrap only between their parts,
settings, model rows and faults are named in words, a newline token is drawn without leaving a
lone ↵ line, a heading stays with the section it opens, pages are not left half empty, long
tables repeat their header, and the patch profiles are the selected token's."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.cli import main


@pytest.fixture(scope="module")
def record(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny model's run: a context with newlines, 4 tokens."""
    out = tmp_path_factory.mktemp("print") / "run.json"
    assert main(["compare", "--model", tiny_model_dir, "--context", "Alice\nlives\n\nin Paris.",
                 "--query", "Where?", "--max-new-tokens", "4", "--quiet", "--json",
                 str(out)]) == 0
    return json.loads(out.read_text())


def _html(record: dict[str, Any], screen: bool = True) -> str:
    from ctxpatch.app.report import report_html
    from ctxpatch.core.record import read_record

    return report_html(read_record(record), {}, screen=screen)


def test_every_recorded_setting_and_fault_is_named_in_words(record: dict[str, Any]) -> None:
    from ctxpatch.app.report import _SHOWN_ELSEWHERE, FAULTS, SETTINGS
    from ctxpatch.core.spec import RunSpec

    recorded = {f.name for f in fields(RunSpec) if f.metadata["option"].recorded}
    assert recorded <= set(SETTINGS) | set(_SHOWN_ELSEWHERE), recorded - set(SETTINGS)
    assert set(record["summary"]["faults"]) <= set(FAULTS)
    text = _html(record)
    settings = text.split("<h2>Settings</h2>", 1)[1].split("<h2>", 1)[0]
    names = re.findall(r"<tr><td>([^<]*)</td>", settings)
    assert len(names) == len(record["settings"]) - 2  # context and query: the prompt table
    assert not [n for n in names if "_" in n], names  # never an identifier ("control_row")
    assert all(re.search(r'<td class="note">[^<]+</td>', row) for row in
               re.findall(r"<tr><td>.*?</tr>", settings)), "a setting without its meaning"
    model = text.split("<h2>Model</h2>", 1)[1].split("<h2>", 1)[0]
    assert "num_layers" not in model and "<td>layers</td>" in model
    pooled = text.split("<h2>Pooled metrics</h2>", 1)[1].split("<h2>", 1)[0]
    for key in record["summary"]["faults"]:
        assert key not in pooled
    assert "Time: the model with the context" in pooled
    # the verdict is the one the command line and the tab give (tests/app/test_verdict.py)
    control = text.split("<h2>Controllability and conditioning</h2>", 1)[1].split("<h2>", 1)[0]
    assert "conditions: held at every patched layer and step" in control


def test_a_fault_is_counted_in_words(record: dict[str, Any]) -> None:
    from ctxpatch.app.report import _faults_line, _times_line

    summary = {"faults": {"div_by_one": 3, "zero_z_layers": 0},
               "seconds": {"baseline": 1.25, "wall": 2.0}}
    line = _faults_line(summary)
    assert line == ("Faults over all layers and steps: N(h)_j = 0: divided by one at 3 "
                    "coordinates.")
    assert _times_line(summary).startswith("Time: the model with the context 1.2 s")
    assert _faults_line({"faults": {"div_by_one": 0}}).startswith("No fault")


def test_newline_tokens_are_drawn_in_the_line(record: dict[str, Any]) -> None:
    from ctxpatch.core.record import read_record

    run = read_record(record)
    gens = re.findall(r'<div class="gen">(.*?)</div>', _html(record), re.S)
    assert len(gens) == 2 and all("<br" not in g for g in gens)
    newlines = sum(s.baseline_text.count("\n") for s in run.steps)
    assert gens[0].count("↵") == newlines


def test_the_controls_are_one_row_per_run_of_layers_and_names_wrap_between_parts(
        qtbot: Any, record: dict[str, Any]) -> None:
    from ctxpatch.app.report import report_document
    from ctxpatch.core.record import read_record
    from PySide6.QtCore import QSizeF

    text = _html(record)
    part = text.split("<h2>Controllability and conditioning</h2>", 1)[1].split("<h2>", 1)[0]
    layers = len(record["controllability"]["plan"])
    assert f"<td>0–{layers - 1}</td>" in part  # the tiny model's layers share their controls
    assert "gate<wbr>_<wbr>proj" not in part and "mlp.<wbr>gate_<wbr>proj.<wbr>weight" in part
    # Qt's layout on a page too narrow for the names: lines end only between a name's parts
    doc = report_document(read_record(record), {})
    doc.setPageSize(QSizeF(330, 2000))
    doc.pageCount()
    block, broken = doc.begin(), []
    while block.isValid():
        words = block.text()
        layout = block.layout()
        for i in range(layout.lineCount() - 1):
            line = layout.lineAt(i)
            end = line.textStart() + line.textLength()
            if "proj" in words and words[end - 1] not in "\u200b ,.-_":
                broken.append(words[line.textStart():end])
        block = block.next()
    assert not broken, broken


def test_long_tables_repeat_their_header_and_pages_are_not_half_empty(
        qtbot: Any, record: dict[str, Any]) -> None:
    from ctxpatch.app.report import PDF_DPI, plot_images, report_document
    from ctxpatch.app.report_print import keep_with_next, page_fill
    from ctxpatch.core.record import read_record
    from PySide6.QtCore import QMarginsF
    from PySide6.QtGui import QPageLayout, QPageSize

    text = _html(record)
    tables = re.findall(r"<table.*?</table>", text, re.S)
    headed = [t for t in tables if "<th>" in t]
    assert len(headed) >= 4 and all("<thead><tr><th>" in t for t in headed)  # header repeats
    run = read_record(record)
    doc = report_document(run, plot_images(run))
    layout = QPageLayout(QPageSize(QPageSize.PageSizeId.A4), QPageLayout.Orientation.Portrait,
                         QMarginsF(15, 15, 15, 15), QPageLayout.Unit.Millimeter)
    doc.setPageSize(layout.paintRectPixels(PDF_DPI).size().toSizeF())
    keep_with_next(doc)
    fill = page_fill(doc)
    assert len(fill) > 2 and min(fill[:-1]) > 0.5, fill


def test_the_patch_profiles_are_the_selected_tokens(qtbot: Any, keep: Any, settings: Any,
                                                    tiny_model_dir: str, tmp_path: Path) -> None:
    from ctxpatch.app import report
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(model=tiny_model_dir, settings=settings, autoload=False)
    keep(w)
    w.input_panel.context.setPlainText("Alice lives in Paris.")
    w.input_panel.query.setPlainText("Where?")
    w.input_panel.max_tokens.setValue(3)
    with qtbot.waitSignal(w.run_finished, timeout=60_000):
        w.start_run()

    def profile_title() -> str:
        return str(report._EXPORT[2].profile.titleLabel.text)

    assert w.export("report", str(tmp_path / "last.html"))
    assert "token 3:" in profile_title()
    w.state.select(0)
    assert w.export("report", str(tmp_path / "first.html"))
    assert "token 1:" in profile_title()
