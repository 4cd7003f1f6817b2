"""Reading the results (issue 20): what the plots, the heatmap, the history, the model panel and
the report show, asserted without pixels: tick strings, ranges, rectangles, texts, page layout."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from ctxpatch.app.jobs import RunStarted
from ctxpatch.app.main_window import MainWindow
from ctxpatch.core.compare import Side, StepResult, TopK
from ctxpatch.core.prompt import Prompt, Segment

N = 7


def _step(i: int, linf: float = 1e-6, tvd: float = 3e-8) -> StepResult:
    top = TopK((5, 6), (" annoyed", "x"), (0.9, 0.1))
    return StepResult(
        step=i, position=10 + i, baseline_token=i, baseline_text=" annoyed", baseline_top_k=top,
        logit_scale=20.0,
        patched=Side(i, " annoyed", i != 3, linf if i != 3 else 2.0, tvd, top),
        control=Side(7, "c", False, 40.0, 0.99, top),
        full_input_ids=(1, 2), reduced_input_ids=(2,), reduced_position_ids=None,
        patch_norms={layer: {f"model.layers.{layer}.mlp.up_proj.weight":
                             {"frobenius": 10.0 ** (layer - i), "relative": 0.5}}
                     for layer in range(3)},
        layer_info={}, seconds={"baseline": 0.1, "patched": 0.1, "control": 0.1},
    )


def _open(qtbot: Any, keep: Any, settings: Any, steps: int, asked: int = N) -> MainWindow:
    w = MainWindow(settings=settings, autoload=False)
    keep(w)
    w.resize(1500, 1400)  # tall enough that every decade has room for its label
    w.show()
    prompt = Prompt((Segment("context", "CTX ", (1,)), Segment("query", "Q?", (2,))))
    w.state.reset(RunStarted(settings={"max_new_tokens": asked, "absorb": "context"},
                             prompt=prompt, layers=(0, 1, 2), num_layers=3, output_control="matrix",
                             model={}))
    for i in range(steps):
        w.state.add_step(_step(i))
    w.state.finish()
    qtbot.wait(50)  # the layout gives the plots their size; the log ranges follow it
    return w


@pytest.fixture
def window(qtbot: Any, keep: Any, settings: Any) -> MainWindow:
    return _open(qtbot, keep, settings, N)


def _decades(lo: float, hi: float) -> list[str]:
    return [f"1e{d}" for d in range(math.ceil(lo), math.floor(hi) + 1)]


def test_every_decade_is_labelled_in_one_format(window: MainWindow) -> None:
    from ctxpatch.app.panels.plots_panel import shown_ticks

    for metric in ("linf", "tvd"):
        axis = window.plots.plots[metric].getAxis("left")
        labels = shown_ticks(axis)
        lo, hi = axis.range
        assert labels == _decades(lo, hi), (metric, labels, axis.range)
        assert all(s.startswith("1e") for s in labels)


def test_every_series_fits_its_axes_with_a_margin(window: MainWindow) -> None:
    for metric in ("linf", "tvd"):
        plot = window.plots.plots[metric]
        (lo, hi) = plot.vb.viewRange()[1]  # log10 units
        ys = []
        for side in ("patched", "control"):
            _, y = window.plots.curves[(metric, side)].getData()
            ys += list(y)
        assert min(ys) > lo + 0.2 and max(ys) < hi - 0.2, (metric, lo, hi, min(ys), max(ys))
        # and every point lies between two labelled decades (none below the lowest label)
        assert math.ceil(lo) <= min(ys) and max(ys) <= math.floor(hi)


def test_token_ticks_are_integers(window: MainWindow) -> None:
    from ctxpatch.app.panels.plots_panel import TokenAxis

    axis = window.plots.plots["match"].getAxis("bottom")
    assert isinstance(axis, TokenAxis)
    for lo, hi, size in ((0.5, 1.5, 800), (0.5, 2.5, 900), (0.5, 7.5, 900), (0.5, 300.5, 400)):
        for _, values in axis.tickValues(lo, hi, size):
            assert all(float(v).is_integer() for v in values), (lo, hi, values)
    assert axis.tickStrings([1.0, 2.0], 1.0, 1.0) == ["1", "2"]


def test_a_cancelled_run_spans_its_tokens(qtbot: Any, keep: Any, settings: Any) -> None:
    w = _open(qtbot, keep, settings, steps=1, asked=20)  # cancelled after 1 of 20
    lo, hi = w.plots.plots["linf"].vb.viewRange()[0]
    assert (lo, hi) == pytest.approx((0.5, 1.5))
    assert [s for s in w.plots.plots["match"].getAxis("bottom").tickStrings(
        [v for _, vs in w.plots.plots["match"].getAxis("bottom").tickValues(lo, hi, 800)
         for v in vs], 1.0, 1.0)] == ["1"]
    title = w.generation.patched.title.text()
    assert "1/1 token match" in title and "tokens match" not in title


def test_the_legend_keeps_clear_of_the_data(window: MainWindow) -> None:
    from PySide6.QtCore import QPointF

    legend = window.plots.legend.sceneBoundingRect()
    assert legend.width() > 0 and legend.height() > 0
    assert window.plots.legend.opts["brush"] is not None  # a background
    for (metric, _), curve in window.plots.curves.items():
        x, y = curve.getData()
        vb = window.plots.plots[metric].vb
        for px, py in zip(x, y, strict=True):
            assert not legend.contains(vb.mapViewToScene(QPointF(px, py)))
        assert not legend.intersects(vb.sceneBoundingRect())


def test_token_match_is_drawn_with_markers_not_zigzags(window: MainWindow) -> None:
    for side in ("patched", "control"):
        curve = window.plots.curves[("match", side)]
        from PySide6.QtCore import Qt

        pen = curve.opts["pen"]
        assert pen is None or pen.style() == Qt.PenStyle.NoPen  # no line joins yes and no
        assert curve.opts["symbol"] is not None


def test_palette_is_okabe_ito_on_light_and_dark() -> None:
    from ctxpatch.app.theme import OKABE_ITO, series_colors
    from PySide6.QtGui import QColor, QPalette

    light, dark = QPalette(), QPalette()
    light.setColor(QPalette.ColorRole.Window, QColor("#f0f0f0"))
    dark.setColor(QPalette.ColorRole.Window, QColor("#202020"))
    values = set(OKABE_ITO.values())
    for palette in (light, dark):
        colors = series_colors(palette)
        assert {colors[k] for k in ("patched", "control", "mismatch")} <= values
    assert series_colors(light)["patched"] != series_colors(dark)["patched"]


def test_heatmap_hover_names_layer_token_parameter_and_value(window: MainWindow,
                                                             qtbot: Any) -> None:
    from PySide6.QtCore import QPointF

    window.tabs.setCurrentWidget(window.patches)
    qtbot.wait(50)
    panel = window.patches
    pos = panel.heat_plot.vb.mapViewToScene(QPointF(3.1, 2.2))  # token 3, layer index 2
    panel._on_heat_hover((pos,))
    text = panel.readout.text()
    assert "layer 2" in text and "token 3" in text and "mlp.up_proj.weight" in text
    assert "norm 1" in text  # 10 ** (2 - 2)
    assert panel.cell_text(N, 0) == "" and panel.cell_text(0, 3) == ""
    panel._on_heat_hover((panel.heat_plot.vb.mapViewToScene(QPointF(-40.0, -40.0)),))
    assert "Hover" in panel.readout.text()


def test_token_detail_never_wraps_inside_a_token(window: MainWindow) -> None:
    from ctxpatch.app.panels.generation_panel import step_details_html

    html = step_details_html(window.state.steps[0])
    assert 'white-space:pre">&#32;annoyed' in html or 'white-space:pre"> annoyed' in html
    assert "<br>" not in html  # a newline token is drawn, not broken


def test_history_marks_a_cancelled_run() -> None:
    from ctxpatch.app.panels.history_panel import run_label, short_label

    record = {"settings": {"max_new_tokens": 20, "model": "demo", "query": "q"},
              "summary": {"tokens": 1, "patched": {"matches": 1}}}
    assert "cancelled after 1 of 20 tokens" in run_label(record)
    assert "(cancelled)" in short_label(record, 0)
    complete = {**record, "summary": {"tokens": 20, "patched": {"matches": 20}}}
    assert "cancelled" not in run_label(complete) and "20/20 match" in run_label(complete)
    eos = {**record, "settings": {**record["settings"], "stop_at_eos": True}}
    assert "stopped after 1 of 20" in run_label(eos)


def test_parameter_counts_of_small_models() -> None:
    from ctxpatch.app.panels.model_panel import footprint_text, parameter_count
    from ctxpatch.core.footprint import Footprint

    assert parameter_count(300_000) == "0.3 M"
    assert parameter_count(134_515_008) == "135 M"
    assert parameter_count(4_200_000) == "4.2 M" and parameter_count(1_234_000_000) == "1.2 B"
    assert parameter_count(3_200) == "3,200"
    text = footprint_text(Footprint(parameters=310_000, dtype="float32"))
    assert "(0.31 M parameters)" in text and "0 M" not in text.replace("0.31 M", "")


def test_plural() -> None:
    from ctxpatch.app.panels.generation_panel import plural
    from ctxpatch.app.report import _plural

    assert plural(1, "token") == _plural(1, "token") == "1 token"
    assert plural(2, "token") == "2 tokens" and plural(0, "token") == "0 tokens"


def test_empty_plots_have_room_for_their_labels(qtbot: Any, keep: Any, settings: Any) -> None:
    from ctxpatch.app.panels.plots_panel import shown_ticks

    w = MainWindow(settings=settings, autoload=False)
    keep(w)
    w.resize(1500, 1400)
    w.show()
    qtbot.wait(50)
    for metric in ("linf", "tvd"):
        axis = w.plots.plots[metric].getAxis("left")
        lo, hi = axis.range
        assert shown_ticks(axis) == _decades(lo, hi)
        assert np.isfinite([lo, hi]).all() and hi - lo >= 1


def test_no_axis_label_gets_an_si_scale_factor(qtbot) -> None:  # type: ignore[no-untyped-def]
    """A TVD axis of small values read "TVD (x0.001)": the ticks already say the values."""
    from ctxpatch.app.panels.plots_panel import QtPlotsPanel
    from ctxpatch.app.state import RunState

    panel = QtPlotsPanel(RunState())
    for plot in panel.plots.values():
        for side in ("left", "bottom"):
            assert not plot.getAxis(side).autoSIPrefix
