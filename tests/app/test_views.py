"""The views on synthetic results (no model): mismatch marks, faithful token text, dark palette."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from ctxpatch.app.jobs import RunStarted
from ctxpatch.app.main_window import MainWindow
from ctxpatch.app.panels.generation_panel import COLORS, token_html
from ctxpatch.core.compare import Side, StepResult, TopK
from ctxpatch.core.prompt import Prompt, Segment

TEXTS = ["Hello", " world", "\n", "  ", "日本語", "\t", ""]
MISMATCH = {2, 4}


def _topk(text: str) -> TopK:
    return TopK((5, 6), (text, "x"), (0.9, 0.1))


def _step(i: int) -> StepResult:
    match = i not in MISMATCH
    patched_text = TEXTS[i] if match else "?"
    return StepResult(
        step=i, position=10 + i, baseline_token=i, baseline_text=TEXTS[i],
        baseline_top_k=_topk(TEXTS[i]), logit_scale=20.0,
        patched=Side(i if match else 99, patched_text, match, 1e-6 if match else 3.0,
                     0.0 if match else 0.4, _topk(patched_text)),
        control=Side(7, "c", False, 12.0, 0.9, _topk("c")),
        full_input_ids=(1, 2), reduced_input_ids=(2,), reduced_position_ids=None,
        patch_norms={layer: {f"model.layers.{layer}.mlp.up_proj.weight":
                             {"frobenius": 10.0 ** (layer - i), "relative": 0.5},
                             f"model.layers.{layer}.post_feedforward_layernorm.weight":
                             {"l2": 2.0, "linf": 1.0, "relative": 3.0}}
                     for layer in range(3)},
        layer_info={}, seconds={"baseline": 0.1, "patched": 0.1, "control": 0.1},
    )


@pytest.fixture
def window(qtbot: Any, keep: Any, settings: Any) -> MainWindow:
    w = MainWindow(settings=settings, autoload=False)
    keep(w)
    w.show()
    prompt = Prompt((Segment("context", "CTX ", (1,)), Segment("query", "Q?", (2,))))
    w.state.reset(RunStarted(settings={"max_new_tokens": len(TEXTS), "absorb": "context"},
                             prompt=prompt, layers=(0, 1, 2), num_layers=3, output_control="matrix",
                             model={}))
    for i in range(len(TEXTS)):
        w.state.add_step(_step(i))
    w.state.finish()
    return w


def test_mismatches_are_marked_in_both_panes_and_the_plots(window: MainWindow) -> None:
    x, _ = window.plots.marks["linf"].getData()
    assert sorted(int(v) - 1 for v in x) == sorted(MISMATCH)
    colour = COLORS["mismatch"][0]
    for pane in (window.generation.baseline, window.generation.patched):
        html = pane.view.toHtml()
        assert html.count(colour) == len(MISMATCH)
    assert "2/7" not in window.generation.patched.title.text()
    assert f"{len(TEXTS) - len(MISMATCH)}/{len(TEXTS)}" in window.generation.patched.title.text()


def test_token_text_is_shown_faithfully(window: MainWindow) -> None:
    baseline, patched = window.generation.pane_texts()
    assert baseline.startswith("CTX Q?") and patched.startswith("Q?")  # each side's prompt
    assert "Hello world↵" in baseline and "日本語" in baseline and "→" in baseline
    assert "  " in baseline  # spaces are kept, not collapsed
    assert token_html("<b>&") == "&lt;b&gt;&amp;" and "∅" in token_html("")


def test_patch_explorer_heatmap_and_relative_norms(window: MainWindow) -> None:
    panel = window.patches
    assert [panel.param.itemText(i) for i in range(panel.param.count())] == [
        "mlp.up_proj.weight", "post_feedforward_layernorm.weight"]
    assert panel.heatmap_shape() == (3, len(TEXTS))
    m = window.state.norm_matrix()
    assert m[2, 0] == pytest.approx(100.0) and m[0, 3] == pytest.approx(1e-3)
    panel.scale.setCurrentIndex(1)
    assert np.allclose(window.state.norm_matrix(), 0.5)
    panel.param.setCurrentText("post_feedforward_layernorm.weight")
    assert np.allclose(window.state.norm_matrix(), 3.0)
    window.state.select(4)
    x, y = panel.profile_curve.getData()
    assert list(x) == [0, 1, 2] and np.allclose(y, np.log10(3.0))


def test_keyboard_selection_moves_through_tokens(window: MainWindow) -> None:
    window._step_selection(+1)
    assert window.state.selected == 0
    window._step_selection(-1)
    assert window.state.selected == 0
    window.state.select(100)
    assert window.state.selected == len(TEXTS) - 1
    assert "Token 7" in window.generation.details.toPlainText()


def test_dark_palette_follows(window: MainWindow, qtbot: Any) -> None:
    from PySide6.QtGui import QColor, QPalette

    dark = QPalette()
    for role, colour in ((QPalette.ColorRole.Window, "#202020"),
                         (QPalette.ColorRole.Base, "#181818"),
                         (QPalette.ColorRole.Text, "#e0e0e0"),
                         (QPalette.ColorRole.WindowText, "#e0e0e0")):
        dark.setColor(role, QColor(colour))
    window.setPalette(dark)
    qtbot.wait(10)
    assert window.plots.graphics.backgroundBrush().color().name() == "#181818"
    assert COLORS["mismatch"][1] in window.generation.patched.view.toHtml()


def test_the_plots_select_the_token_under_the_mouse(window: MainWindow, qtbot: Any) -> None:
    from PySide6.QtCore import QPointF

    qtbot.wait(50)  # let the layout give the plots their size
    plot = window.plots.plots["tvd"]
    pos = plot.vb.mapViewToScene(QPointF(3.2, -2.0))
    window.plots._on_hover((pos,))
    assert window.state.selected == 2
    assert window.plots.cursors["match"].value() == 3
    outside = plot.vb.mapViewToScene(QPointF(50.0, -2.0))  # beyond the last token: no change
    window.plots._on_hover((outside,))
    assert window.state.selected == 2


def test_about_names_the_versions(window: MainWindow) -> None:
    text = window.about_text()
    for name in ("ctxpatch 0.", "torch", "transformers", "Qt ", "no model loaded"):
        assert name in text
