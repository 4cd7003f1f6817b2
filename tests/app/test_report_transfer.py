"""The report's "Transfer" section (ANALYSIS.md A3): its table's means and match counts are the
record's (computed here from the record's matrix), its figure is written as PNG and SVG with the
record's R on a fixed [-1, 1], the one-line caveat of method direct on a post-norm-scale model
appears where it applies, and a record without the transfer gives no section and no figure."""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ctxpatch.app.cli import main

CONTEXT = "Alice lives in Paris."


@pytest.fixture(scope="module")
def transferred(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[dict[str, Any], Path]:
    """A tiny model's run with the transfer (3 tokens), its JSON and its report, both written
    by one command line."""
    folder = tmp_path_factory.mktemp("transfer")
    code = main(["compare", "--model", tiny_model_dir, "--context", CONTEXT, "--query", "Where?",
                 "--max-new-tokens", "3", "--quiet", "--analyze", "transfer", "--json",
                 str(folder / "run.json"), "--report", str(folder / "r.html")])
    assert code == 0
    return json.loads((folder / "run.json").read_text()), folder


def _section(text: str) -> str:
    return text.split("<h2>Transfer</h2>", 1)[1].split("<h2>", 1)[0]


def _rows(section: str) -> dict[str, list[str]]:
    table = section.split('<table class="transfer">', 1)[1].split("</table>", 1)[0]
    rows = [[html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", r)]
            for r in re.findall(r"<tr>(.*?)</tr>", table) if "<td>" in r]
    return {r[0]: r[1:] for r in rows}


def test_the_section_carries_the_records_numbers(transferred: tuple[dict[str, Any], Path]
                                                 ) -> None:
    record, folder = transferred
    text = (folder / "r.html").read_text(encoding="utf-8")
    assert text.index("<h2>Plots</h2>") < text.index("<h2>Transfer</h2>")
    section = _section(text)
    t = record["analysis"]["transfer"]
    r = np.array(t["retained"], dtype=float)
    n = r.shape[0]
    assert n == 3
    off = ~np.eye(n, dtype=bool)
    match = np.array(t["match"])
    rows = _rows(section)
    assert rows["own patches (the diagonal)"] == [f"{np.diagonal(r).mean():.3g}",
                                                  f"{int(np.diagonal(match).sum())}/{n}"]
    assert rows["another token's patches (off the diagonal)"] == [
        f"{r[off].mean():.3g}", f"{int(match[off].sum())}/{n * n - n}"]
    assert rows["the mean patch"] == [f"{np.mean(t['mean']):.3g}",
                                      f"{sum(t['mean_match'])}/{n}"]
    previous = [r[k - 1, k] for k in range(1, n)]
    assert rows["the previous token's patches"] == [
        f"{np.mean(previous):.3g}", f"{sum(t['previous_match'][1:])}/{n - 1}"]
    # the ground truth behind them: each token's own patches give back the run (float32)
    assert rows["own patches (the diagonal)"][1] == f"{n}/{n}"
    assert "Not a transfer measurement" not in section  # (a Llama: no caveat)
    assert "below R" not in section  # nothing clipped
    assert section.count("data:image/png;base64,") == 1


def test_the_figure_is_written_as_png_and_svg_with_the_records_r(
        qtbot: Any, transferred: tuple[dict[str, Any], Path]) -> None:
    from ctxpatch.app import report_analysis
    from ctxpatch.app.report import PNG_SCALE
    from ctxpatch.app.report_transfer import TRANSFER_SIZE
    from PySide6.QtGui import QImage

    record, folder = transferred
    plots = folder / "r_plots"
    png = (plots / "transfer.png").read_bytes()
    image = QImage.fromData(png, "PNG")
    assert abs(image.width() - TRANSFER_SIZE[0] * PNG_SCALE) <= 2
    assert "<svg" in (plots / "transfer.svg").read_text()[:2000]
    figure = report_analysis._FIGURES["transfer"]
    np.testing.assert_array_equal(figure.image.image, np.clip(
        np.array(record["analysis"]["transfer"]["retained"], dtype=float), -1, 1))
    assert figure.bar.levels() == (-1.0, 1.0)
    _, y = figure.mean.getData()
    np.testing.assert_allclose(y, record["analysis"]["transfer"]["mean"])


def test_clipping_and_the_caveat_are_said(qtbot: Any, transferred: tuple[dict[str, Any], Path],
                                          tmp_path: Path) -> None:
    from ctxpatch.app import report_analysis
    from ctxpatch.app.report import write_report
    from ctxpatch.core.record import read_record

    record = copy.deepcopy(transferred[0])
    t = record["analysis"]["transfer"]
    t["retained"][0][1], t["retained"][1][1], t["match"][1][1] = -40.0, -0.3, False
    record["settings"]["method"] = "direct"
    for plan in record["controllability"]["plan"]:
        plan["control"] = "scale"  # (as on a Gemma)
    write_report(read_record(record), tmp_path / "r.html", tmp_path / "plots")
    section = _section((tmp_path / "r.html").read_text(encoding="utf-8"))
    assert "1 entry lies below R = -1 (lowest -40) and is drawn at -1." in section
    caveat = re.findall(r"<p><b>(.*?)</b></p>", section)
    assert len(caveat) == 1 and "method direct" in caveat[0] and "method stable" in caveat[0]
    assert "2/3 tokens match" in html.unescape(caveat[0])
    assert report_analysis._FIGURES["transfer"].image.image[0, 1] == -1.0


def test_a_record_without_the_transfer_gives_no_section(
        qtbot: Any, transferred: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    from ctxpatch.app.report import write_report
    from ctxpatch.app.report_analysis import analysis_html
    from ctxpatch.core.record import read_record

    record = copy.deepcopy(transferred[0])
    del record["analysis"]
    write_report(read_record(record), tmp_path / "r.html", tmp_path / "plots")
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "<h2>Transfer</h2>" not in text and "retained effect" not in text
    assert not list((tmp_path / "plots").glob("transfer*"))
    assert analysis_html({"transfer": {"retained": []}}, {}) == ""
    # the negative control: the same record with its transfer has both
    assert "<h2>Transfer</h2>" in analysis_html(transferred[0]["analysis"], {})


def test_the_windows_export_has_the_section_from_a_reopened_session(
        qtbot: Any, keep: Any, settings: Any, transferred: tuple[dict[str, Any], Path],
        tmp_path: Path, monkeypatch: Any) -> None:
    import ctxpatch.core.transfer
    from ctxpatch.app.main_window import MainWindow
    from ctxpatch.app.session import save_session, session_dict

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the transfer was recomputed")

    monkeypatch.setattr(ctxpatch.core.transfer, "transfer", recomputed)
    record = transferred[0]
    path = tmp_path / "s.json"
    save_session(path, session_dict({"context": CONTEXT, "query": "Where?"}, {}, [record], 0))
    w = MainWindow(settings=settings, autoload=False)
    keep(w)
    assert w.open_session(str(path)) and w.model is None
    np.testing.assert_array_equal(w.transfer.image.image, np.clip(
        np.array(record["analysis"]["transfer"]["retained"], dtype=float), -1, 1))
    assert w.export("report", str(tmp_path / "again.html"))
    again = _section((tmp_path / "again.html").read_text(encoding="utf-8"))
    first = _section((transferred[1] / "r.html").read_text(encoding="utf-8"))
    assert _rows(again) == _rows(first)
