"""The analyses in reports and sessions (ANALYSIS.md A1/A2): the "Context lens" and "Patch
geometry" sections carry the record's numbers, their figures are written as PNG and SVG, a part
the lens leaves undefined reads "not defined" (never a zero), a record without ``analysis`` gives
the report it always gave, and a session keeps a run's analysis without recomputing it."""

from __future__ import annotations

import copy
import html
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.cli import main

CONTEXT = "Alice lives in Paris."
PLAIN_PLOTS = sorted(f"{name}.{ext}" for name in (
    "per-token", "patch-norms-mlp.gate_proj.weight", "patch-norms-mlp.up_proj.weight",
    "patch-norms-mlp.down_proj.weight") for ext in ("png", "svg"))
ROLES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _compare(model: str, out: Path, *extra: str) -> dict[str, Any]:
    code = main(["compare", "--model", model, "--context", CONTEXT, "--query", "Where?",
                 "--max-new-tokens", "3", "--quiet", "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def analysed(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny model's run with every analysis: the lens, the geometry and the transfer (3
    tokens, 4 layers; tests/app/test_report_transfer.py reads the transfer's section)."""
    return _compare(tiny_model_dir, tmp_path_factory.mktemp("analysed") / "run.json",
                    "--analyze", "all")


def _report(record: dict[str, Any], folder: Path, name: str = "r.html") -> tuple[str, Path]:
    from ctxpatch.app.report import write_report
    from ctxpatch.core.record import read_record

    folder.mkdir(exist_ok=True)
    write_report(read_record(record), folder / name, folder / "plots")
    return (folder / name).read_text(encoding="utf-8"), folder / "plots"


def _section(text: str, title: str) -> str:
    return text.split(f"<h2>{title}</h2>", 1)[1].split("<h2>", 1)[0]


def _lens_rows(text: str) -> list[list[str]]:
    table = _section(text, "Context lens").split('<table class="lens">', 1)[1]
    table = table.split("</table>", 1)[0]
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td>(.*?)</td>", r)]
            for r in re.findall(r"<tr>(.*?)</tr>", table) if "<td>" in r]


def test_the_sections_carry_the_records_numbers(qtbot: Any, analysed: dict[str, Any],
                                               tmp_path: Path) -> None:
    from ctxpatch.core.analysis import strongest_layers

    text, _ = _report(analysed, tmp_path)
    assert text.index("<h2>Plots</h2>") < text.index("<h2>Context lens</h2>") < text.index(
        "<h2>Patch geometry</h2>")
    assert text.count("data:image/png;base64,") == 4 + 1 + len(ROLES) + 1  # (+ the transfer)
    # the table: per token, its three strongest layers, in order, with the record's values
    rows = _lens_rows(text)
    steps = analysed["analysis"]["lens"]["steps"]
    assert len(rows) == 3 * len(steps)
    for t, step in enumerate(steps):
        best = strongest_layers(step)
        assert len(best) == 3
        first = rows[3 * t]
        assert first[0] == str(t + 1) and first[1] == repr(step["token"])
        for row, (layer, total, mixer, mlp) in zip(rows[3 * t:3 * t + 3], best, strict=True):
            assert row[2:] == [str(layer), f"{total:+.3g}", f"{mixer:+.3g}", f"{mlp:+.3g}"]
        # the top layer is the one whose total adds most to the emitted token, by the record
        totals = {int(k): v["total"]["emitted"] for k, v in step["layers"].items()}
        assert int(first[2]) == max(totals, key=totals.__getitem__)
    # the geometry table: per role, the layers' effective and summed ranks and the layer
    # whose patches are largest (the Gram's diagonal summed over the steps)
    params = analysed["analysis"]["geometry"]["params"]
    geometry = _section(text, "Patch geometry")
    for role in ROLES:
        mine = {p["layer"]: p for name, p in params.items() if f".{role}." in name}
        assert sorted(mine) == [0, 1, 2, 3]
        eff = [p["effective_rank"] for p in mine.values()]
        summed = [p["summed_rank"] for p in mine.values()]
        largest = max(mine, key=lambda i: sum(mine[i]["inner"][t][t] for t in range(3)))
        row = (f"<tr><td>{role}</td><td>4</td><td>{min(eff):.3g}–{max(eff):.3g}</td>"
               f"<td>{min(summed)}–{max(summed)}</td><td>{largest}</td></tr>")
        assert row in geometry, (row, geometry)
        assert f"Patch geometry: {role} (largest patches in layer {largest})" in geometry


def test_the_figures_are_written_as_png_and_svg_and_centred(qtbot: Any, analysed: dict[str, Any],
                                                            tmp_path: Path) -> None:
    from ctxpatch.app import report_analysis
    from ctxpatch.app.report import PNG_SCALE
    from ctxpatch.app.report_analysis import GEOMETRY_SIZE, LENS_SIZE
    from PySide6.QtGui import QImage

    _, plots = _report(analysed, tmp_path)
    names = sorted(p.name for p in plots.iterdir())
    added = sorted(f"{n}.{e}" for n in ("lens", *(f"geometry-{r}" for r in ROLES), "transfer")
                   for e in ("png", "svg"))
    assert names == sorted(PLAIN_PLOTS + added)
    for name, size in (("lens", LENS_SIZE), *((f"geometry-{r}", GEOMETRY_SIZE) for r in ROLES)):
        png = (plots / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        image = QImage.fromData(png, "PNG")
        assert abs(image.width() - size[0] * PNG_SCALE) <= 2, (name, image.width())
        assert "<svg" in (plots / f"{name}.svg").read_text()[:2000]
    # the lens's colours are centred at 0 (symmetric about the largest |logit|); cosines on
    # a fixed [-1, 1] (the last role drawn)
    figures = report_analysis._FIGURES
    totals = [p["total"]["emitted"] for s in analysed["analysis"]["lens"]["steps"]
              for p in s["layers"].values()]
    lo, hi = figures["lens"].bar.levels()
    assert hi == pytest.approx(max(map(abs, totals))) and lo == -hi
    assert figures["geometry"].bar.levels() == (-1.0, 1.0)


def test_an_undefined_part_reads_not_defined_never_zero(qtbot: Any, analysed: dict[str, Any],
                                                        tmp_path: Path) -> None:
    from ctxpatch.app import report_analysis
    from ctxpatch.app.report import plot_images
    from ctxpatch.app.report_analysis import NOT_DEFINED, lens_matrix
    from ctxpatch.core.analysis import strongest_layers
    from ctxpatch.core.record import read_record
    from PySide6.QtCore import QPointF

    record = copy.deepcopy(analysed)
    step = record["analysis"]["lens"]["steps"][0]
    top = strongest_layers(step)[0][0]
    step["layers"][str(top)]["mixer"] = None  # the strongest layer's mixer part: undefined
    gone = strongest_layers(step)[1][0]
    step["layers"][str(gone)] = {"total": None, "mixer": None, "mlp": None}  # no readout
    text, _ = _report(record, tmp_path)
    rows = _lens_rows(text)
    assert rows[0][2] == str(top) and rows[0][4] == NOT_DEFINED
    assert rows[0][3] != NOT_DEFINED and rows[0][5] != NOT_DEFINED
    assert str(gone) not in [r[2] for r in rows[:3]]  # a layer without a total is not ranked
    assert sum(NOT_DEFINED in r for r in rows) == 1
    # the heatmap leaves that layer's cell blank (the background), never the colour of 0
    layers, _, m = lens_matrix(record["analysis"]["lens"])
    assert math.isnan(m[layers.index(gone), 0]) and not math.isnan(m[layers.index(top), 0])
    plot_images(read_record(record))
    figure = report_analysis._FIGURES["lens"]
    shot = figure.graphics.grab().toImage()

    def colour(step: int, row: int) -> tuple[int, int, int]:
        p = figure.graphics.mapFromScene(figure.plot.vb.mapViewToScene(QPointF(step + 1, row)))
        c = shot.pixelColor(p.x(), p.y())
        return c.red(), c.green(), c.blue()

    background = figure.graphics.backgroundBrush().color()
    assert colour(0, layers.index(gone)) == (background.red(), background.green(),
                                            background.blue())
    assert colour(0, layers.index(top)) != colour(0, layers.index(gone))


def test_a_record_without_analysis_gives_the_report_it_gave(qtbot: Any, tiny_model_dir: str,
                                                             analysed: dict[str, Any],
                                                             tmp_path: Path) -> None:
    from ctxpatch.app.report import report_html
    from ctxpatch.app.report_analysis import analysis_html
    from ctxpatch.core.record import read_record

    plain = _compare(tiny_model_dir, tmp_path / "plain.json")
    assert "analysis" not in plain
    text, plots = _report(plain, tmp_path / "plain")
    assert sorted(p.name for p in plots.iterdir()) == PLAIN_PLOTS
    words = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text).lower()
    assert "lens" not in words and "geometry" not in words
    assert text.count("data:image/png;base64,") == 4
    # the same run with and without its analysis: the same report but for the two sections
    stripped = {k: v for k, v in analysed.items() if k != "analysis"}
    images = {name.removesuffix(".png"): name for name in PLAIN_PLOTS if name.endswith(".png")}
    figures = {"lens": "lens.png", **{f"geometry/{r}": f"g-{r}.png" for r in ROLES}}

    def undated(page: str) -> str:
        return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", "", page)

    images = {k.replace("patch-norms-", "patch-norms/"): v for k, v in images.items()}
    with_sections = report_html(read_record(analysed), {**images, **figures})
    without = report_html(read_record(stripped), images)
    sections = analysis_html(analysed["analysis"], figures)
    assert sections and sections in with_sections
    assert undated(with_sections.replace(sections, "")) == undated(without)


def test_the_pdf_keeps_the_sections_headings_with_what_follows(qtbot: Any,
                                                               analysed: dict[str, Any],
                                                               tmp_path: Path) -> None:
    from ctxpatch.app.report import (
        PDF_DPI,
        plot_images,
        report_document,
        write_report,
    )
    from ctxpatch.app.report_print import heading_pages, keep_with_next
    from ctxpatch.core.record import read_record
    from PySide6.QtCore import QMarginsF
    from PySide6.QtGui import QPageLayout, QPageSize

    run = read_record(analysed)
    write_report(run, tmp_path / "r.pdf")
    assert (tmp_path / "r.pdf").read_bytes()[:5] == b"%PDF-"
    doc = report_document(run, plot_images(run))
    layout = QPageLayout(QPageSize(QPageSize.PageSizeId.A4), QPageLayout.Orientation.Portrait,
                         QMarginsF(15, 15, 15, 15), QPageLayout.Unit.Millimeter)
    doc.setPageSize(layout.paintRectPixels(PDF_DPI).size().toSizeF())
    keep_with_next(doc)
    pages = heading_pages(doc)
    titles = [title for title, _, _ in pages]
    assert "Context lens" in titles and "Patch geometry" in titles
    assert all(page == follows for _, page, follows in pages), pages


def test_a_session_keeps_the_analysis_without_recomputing(qtbot: Any, keep: Any, settings: Any,
                                                          analysed: dict[str, Any],
                                                          tmp_path: Path, monkeypatch: Any
                                                          ) -> None:
    import ctxpatch.core.analysis
    import ctxpatch.core.geometry
    import ctxpatch.core.lens
    from ctxpatch.app.main_window import MainWindow
    from ctxpatch.app.session import load_session, save_session, session_dict, shown_run

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the analysis was recomputed")

    for module, name in ((ctxpatch.core.analysis, "analysis_section"),
                         (ctxpatch.core.geometry, "patch_geometry"),
                         (ctxpatch.core.lens, "lens_step")):
        monkeypatch.setattr(module, name, recomputed)
    path = tmp_path / "s.json"
    save_session(path, session_dict({"context": CONTEXT, "query": "Where?"}, {}, [analysed], 0))
    index, run = shown_run(load_session(path), path)
    assert index == 0 and run is not None
    assert run.record["analysis"] == analysed["analysis"]
    # the window: reopened, exported again as JSON and as a report, nothing loaded or computed
    w = MainWindow(settings=settings, autoload=False)
    keep(w)
    assert w.open_session(str(path))
    assert w.model is None and len(w.state.steps) == 3
    assert w.export("json", str(tmp_path / "again.json"))
    assert json.loads((tmp_path / "again.json").read_text())["analysis"] == analysed["analysis"]
    assert w.export("report", str(tmp_path / "again.html"))
    text = (tmp_path / "again.html").read_text(encoding="utf-8")
    assert "<h2>Context lens</h2>" in text and "<h2>Patch geometry</h2>" in text
