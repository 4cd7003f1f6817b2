"""Reports from the command line and the window: HTML and PDF with the plots embedded, every plot
as PNG and SVG, user text escaped, the verification in."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ctxpatch.app.cli import main

CONTEXT = "<script>alert('x')</script> & Alice lives in Paris."


def _compare(model: str, tmp_path: Path, report: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "run.json"
    code = main(["compare", "--model", model, "--context", CONTEXT, "--query", "Where?",
                 "--max-new-tokens", "3", "--quiet", "--json", str(out), "--report",
                 str(tmp_path / report), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_html_report_is_self_contained_and_escaped(qtbot: Any, tiny_model_dir: str,
                                                    tmp_path: Path) -> None:
    record = _compare(tiny_model_dir, tmp_path, "r.html", "--verify")
    text = (tmp_path / "r.html").read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(images) == 1 + 3  # per-token plots, and gate, up, down patch norms
    assert record["verification"]["ok"] and record["verification"]["steps"] == 3
    assert "worst_relative_linf" in text
    plots = tmp_path / "r_plots"
    names = sorted(p.name for p in plots.iterdir())
    assert "per-token.png" in names and "per-token.svg" in names and len(names) == 8
    assert (plots / "per-token.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in (plots / "per-token.svg").read_text()[:2000]


def test_pdf_report(qtbot: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    _compare(tiny_model_dir, tmp_path, "r.pdf")
    data = (tmp_path / "r.pdf").read_bytes()
    assert data[:5] == b"%PDF-" and len(data) > 20_000 and b"/Image" in data


def test_the_window_exports_the_same_report(qtbot: Any, keep: Any, tiny_model_dir: str,
                                            settings: Any, tmp_path: Path) -> None:
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(model=tiny_model_dir, settings=settings, autoload=False)
    keep(w)
    w.input_panel.context.setPlainText(CONTEXT)
    w.input_panel.query.setPlainText("Where?")
    w.input_panel.max_tokens.setValue(3)
    with qtbot.waitSignal(w.run_finished, timeout=60_000):
        w.start_run()
    assert w.export("report", str(tmp_path / "w.html"))
    text = (tmp_path / "w.html").read_text()
    assert "&lt;script&gt;" in text and text.count("data:image/png;base64,") == 4
    assert w.export("report", str(tmp_path / "w.pdf"))
    assert (tmp_path / "w.pdf").read_bytes()[:5] == b"%PDF-"


def test_a_run_without_the_control_reports_it_empty(qtbot: Any, tiny_model_dir: str,
                                                    tmp_path: Path) -> None:
    record = _compare(tiny_model_dir, tmp_path, "r.html", "--no-control")
    assert record["summary"]["control"] is None
    assert all(s["control"]["linf"] is None and s["control"]["token"]["id"] == -1
               for s in record["steps"])
    assert record["settings"]["control"] is False
    rows = re.findall(r"<tr><td>token match</td><td>([^<]*)</td><td>([^<]*)</td></tr>",
                      (tmp_path / "r.html").read_text())
    assert rows == [("3/3", "?/3")] or rows[0][1] in ("—", "?/3"), rows


def test_settings_are_a_readable_table_and_pages_keep_headings_with_what_follows(
        qtbot: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    from ctxpatch.app.report import (
        FIGURE_PT,
        PLOT_SIZE,
        plot_images,
        report_document,
    )
    from ctxpatch.app.report_print import heading_pages, keep_with_next
    from ctxpatch.core.record import read_record
    from PySide6.QtCore import QSizeF

    record = _compare(tiny_model_dir, tmp_path, "r.html", "--max-new-tokens", "1")
    text = (tmp_path / "r.html").read_text()
    settings = text.split("<h2>Settings</h2>", 1)[1].split("<h2>", 1)[0]
    assert "<th>setting</th><th>value</th><th>meaning</th>" in settings
    assert "<td>Absorbed tokens</td>" in settings and "<td>Method</td>" in settings
    assert "True" not in settings and "None" not in settings and "[]" not in settings
    assert "Generations (1 token;" in text  # not "1 tokens"
    # the break rules for browsers, and figures at the size they are shown
    assert "h1, h2, h3 { page-break-after: avoid; break-after: avoid; }" in text
    assert "div.figure { page-break-inside: avoid; break-inside: avoid;" in text
    assert f'width="{PLOT_SIZE[0]}"' in text and FIGURE_PT >= 10
    # the PDF's layout (Qt knows no keep-with-next): on a short page, some heading would end
    # a page without what follows it; after keep_with_next none does
    run = read_record(record)
    images = plot_images(run)
    doc = report_document(run, images)
    doc.setPageSize(QSizeF(679, 640))  # a short page: more page feet
    before = heading_pages(doc)
    assert any(page != follows for _, page, follows in before), before
    assert keep_with_next(doc) > 0
    after = heading_pages(doc)
    assert all(page == follows for _, page, follows in after), after


def test_figures_are_drawn_at_their_shown_size(qtbot: Any, tiny_model_dir: str,
                                               tmp_path: Path) -> None:
    from ctxpatch.app.report import PLOT_SIZE, PNG_SCALE, plot_images
    from ctxpatch.core.record import read_record
    from PySide6.QtGui import QImage

    record = _compare(tiny_model_dir, tmp_path, "r.html")
    png, _ = plot_images(read_record(record))["per-token"]
    image = QImage.fromData(png, "PNG")
    assert image.width() == round(PLOT_SIZE[0] * PNG_SCALE)
    from ctxpatch.app import report

    plots = report._EXPORT[1]
    font = plots.plots["linf"].getAxis("left").style["tickFont"]
    assert font is not None and font.pointSizeF() >= 10
    assert plots.legend.opts["labelTextSize"] == "10pt"
