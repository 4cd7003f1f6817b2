"""The Context lens and Geometry tabs, from a real tiny run's record: the grid's cells and hover
text against the record, a part the record leaves undefined, the heatmaps' values against the
record's Gram, the tabs without the analyses, and the Analyses checkboxes in the window (they
reach the RunSpec the window runs, survive a settings round trip and a session)."""

from __future__ import annotations

import copy
import html
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ctxpatch.app.panels.geometry_panel import QtGeometryPanel, as_matrix
from ctxpatch.app.panels.lens_panel import QtLensPanel, visible
from ctxpatch.core.geometry import role_of
from PySide6.QtCore import Qt
from windows import open_window, run_to_end

TOKENS = 3


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    """A tiny Llama's run with both analyses, as JSON gives it back (what a session holds)."""
    from ctxpatch.core.prompt import build_prompt
    from ctxpatch.core.runs import run_comparison
    from ctxpatch.core.spec import RunSpec
    from tiny import tiny_config, tiny_loaded

    loaded = tiny_loaded(tiny_config("llama"))
    prompt = build_prompt(loaded.tokenizer, "Alice lives in Paris.", "Where does Alice live?")
    run = run_comparison(loaded, prompt, RunSpec(max_new_tokens=TOKENS,
                                                 analyze=frozenset({"lens", "geometry"})))
    return json.loads(json.dumps(run.record))


@pytest.fixture
def lens(qtbot: Any, record: dict[str, Any]) -> QtLensPanel:
    panel = QtLensPanel()
    qtbot.addWidget(panel)
    panel.resize(1000, 450)
    panel.show()
    panel.set_record(record)
    return panel


@pytest.fixture
def geometry(qtbot: Any, record: dict[str, Any]) -> QtGeometryPanel:
    panel = QtGeometryPanel()
    qtbot.addWidget(panel)
    panel.resize(1000, 450)
    panel.show()
    panel.set_record(record)
    return panel


def _layers(record: dict[str, Any]) -> list[int]:
    return sorted(int(k) for k in record["analysis"]["lens"]["steps"][0]["layers"])


def _total(record: dict[str, Any], step: int, layer: int) -> dict[str, Any]:
    return record["analysis"]["lens"]["steps"][step]["layers"][str(layer)]["total"]


def test_the_grid_shows_each_cells_top_promoted_token(lens: QtLensPanel,
                                                      record: dict[str, Any]) -> None:
    layers = _layers(record)
    assert (lens.grid.rowCount(), lens.grid.columnCount()) == (len(layers), TOKENS)
    for j in range(TOKENS):
        token = record["analysis"]["lens"]["steps"][j]["token"]
        assert visible(token) in lens.grid.horizontalHeaderItem(j).text()
        for i, layer in enumerate(layers):
            assert lens.cell(j, i).text() == visible(_total(record, j, layer)["promoted"][0][0])
    assert lens.grid.verticalHeaderItem(0).text() == f"layer {layers[0]}"


def test_a_cells_colour_follows_the_sign_of_the_emitted_logit(lens: QtLensPanel,
                                                              record: dict[str, Any]) -> None:
    layers = _layers(record)
    signs = set()
    for j in range(TOKENS):
        for i, layer in enumerate(layers):
            emitted = _total(record, j, layer)["emitted"]
            colour = lens.cell(j, i).background().color()
            if abs(emitted) > 0.2 * lens.levels:  # (near 0 the map is near white)
                signs.add(emitted > 0)
                assert (colour.red() > colour.blue()) == (emitted > 0), (j, layer, emitted)
    assert signs  # at least one cell was strong enough to judge
    lo, hi = lens.scale.levels
    assert lo == -hi and hi == pytest.approx(max(
        abs(_total(record, j, layer)["emitted"]) for j in range(TOKENS) for layer in layers))


def test_a_cells_hover_text_carries_the_top_10_and_the_emitted_logit(
        lens: QtLensPanel, record: dict[str, Any]) -> None:
    layer = _layers(record)[1]
    text = lens.cell_text(1, layer)
    parts = record["analysis"]["lens"]["steps"][1]["layers"][str(layer)]
    for part, name in (("total", "total"), ("mixer", "mixer"), ("mlp", "MLP")):
        p = parts[part]
        assert f"{name}: emitted token {p['emitted']:+.3g}" in text
        assert len(p["promoted"]) == len(p["suppressed"]) == 10
        for token, logit, _ in p["promoted"] + p["suppressed"]:
            assert f"{visible(token)} {logit:+.3g}" in text
    # the cell's own tooltip holds the same, as a table; hovering writes the cell's line
    tip = lens.cell(1, 1).toolTip()
    assert tip.startswith(f"<b>layer {layer} · token 2 ")
    for part in parts.values():
        assert f"<br>emitted {part['emitted']:+.3g}" in tip
        for token, logit, _ in part["promoted"] + part["suppressed"]:
            assert f"<td>{html.escape(visible(token))}</td><td align='right'>{logit:+.3g}" in tip
    lens.grid.cellEntered.emit(1, 1)
    assert lens.readout.text().startswith(f"layer {layer} · token 2 ")
    assert f"emitted {parts['total']['emitted']:+.3g}" in lens.readout.text()


def test_a_part_left_undefined_says_so_and_is_not_drawn(qtbot: Any,
                                                        record: dict[str, Any]) -> None:
    broken = copy.deepcopy(record)
    layers = _layers(record)
    gone = layers[2]
    for step in broken["analysis"]["lens"]["steps"]:
        step["layers"][str(gone)]["mixer"] = None
        step["layers"][str(gone)]["mlp"] = None
    broken["analysis"]["lens"]["steps"][0]["layers"][str(layers[0])]["total"] = None
    panel = QtLensPanel()
    qtbot.addWidget(panel)
    panel.set_record(broken)
    text = panel.cell_text(0, gone)
    assert "mixer: not defined in this layer: the block changes its output" in text
    assert "MLP: not defined in this layer" in text
    assert "mixer: emitted" not in text and "total: emitted" in text
    assert panel.cell(0, 0).text() == "n/a"
    assert "total: not defined in this layer" in panel.cell_text(0, layers[0])
    panel.grid.setCurrentCell(2, 0)
    assert "not defined in this layer" in panel.details.toPlainText()
    heights = panel.bar_heights()  # the undefined layer has no bar, never a zero one
    assert len(heights["mixer"]) == len(heights["mlp"]) == len(layers) - 1
    assert f"not defined in layer(s) {gone}" in panel.bars.titleLabel.text


def _lines(document: Any) -> list[str]:
    """Every laid-out line of a document's text (table cells included), as drawn."""
    out = []
    block = document.begin()
    while block.isValid():
        layout, text = block.layout(), block.text()
        for i in range(layout.lineCount()):
            line = layout.lineAt(i)
            out.append(text[line.textStart():line.textStart() + line.textLength()])
        block = block.next()
    return out


def test_the_pinned_list_never_breaks_a_long_word(qtbot: Any, record: dict[str, Any]) -> None:
    long = " internationalization"
    changed = copy.deepcopy(record)
    for step in changed["analysis"]["lens"]["steps"]:
        for parts in step["layers"].values():
            for part in parts.values():
                part["promoted"][0][0] = long
    panel = QtLensPanel()
    qtbot.addWidget(panel)
    panel.resize(700, 400)  # the details pane narrower than its three columns need
    panel.show()
    panel.set_record(changed)
    panel.grid.setCurrentCell(0, 0)
    qtbot.wait(10)
    lines = _lines(panel.details.document())
    whole = [line for line in lines if "internationalization" in line]
    assert len(whole) == 3  # (total, mixer and MLP: each on one line)
    assert not any(line.rstrip().endswith(("internatio", "internationali")) for line in lines)


def test_the_bars_show_the_selected_tokens_parts_and_the_arrows_move(
        qtbot: Any, lens: QtLensPanel, record: dict[str, Any]) -> None:
    layers = _layers(record)
    lens.grid.setFocus()
    lens.grid.setCurrentCell(0, 0)
    qtbot.keyClick(lens.grid, Qt.Key.Key_Right)
    qtbot.keyClick(lens.grid, Qt.Key.Key_Down)
    assert (lens.grid.currentRow(), lens.grid.currentColumn()) == (1, 1)
    steps = record["analysis"]["lens"]["steps"]
    for part in ("mixer", "mlp"):
        expected = [steps[1]["layers"][str(layer)][part]["emitted"] for layer in layers]
        np.testing.assert_allclose(lens.bar_heights()[part], expected)
    assert lens.details.toPlainText().startswith(f"layer {layers[1]} · token 2 ")


def test_the_token_heatmap_is_the_records_gram(geometry: QtGeometryPanel,
                                               record: dict[str, Any]) -> None:
    params = record["analysis"]["geometry"]["params"]
    keys = [geometry.param.itemText(i) for i in range(geometry.param.count())]
    assert "mlp.down_proj.weight" in keys
    geometry.param.setCurrentText("mlp.up_proj.weight")
    geometry.layer.setCurrentText("2")
    name = geometry.selected_name()
    assert name == "model.layers.2.mlp.up_proj.weight"
    gram = as_matrix(params[name]["gram"])
    assert gram.shape == (TOKENS, TOKENS)
    np.testing.assert_array_equal(geometry.token_image.image, gram)
    assert tuple(geometry.token_image.levels) == (-1.0, 1.0)  # the fixed scale
    x, y = geometry.sigma_curve.getData()
    np.testing.assert_allclose(y, params[name]["singular_values"])
    summary = geometry.summary.text()
    assert f"{params[name]['effective_rank']:.3g}" in summary
    assert f"summed patch <b>{params[name]['summed_rank']}</b>" in summary
    hover = geometry.hover_text("tokens", 0, 2)
    assert f"cosine {gram[0, 2]:+.4f}" in hover and "token 1 " in hover and "token 3 " in hover


def test_the_layer_heatmap_is_the_roles_cosines_at_the_chosen_token(
        geometry: QtGeometryPanel, record: dict[str, Any]) -> None:
    geometry.param.setCurrentText("mlp.gate_proj.weight")
    geometry.step.setValue(3)
    role = role_of(geometry.selected_name())
    group = record["analysis"]["geometry"]["across_layers"][role]
    np.testing.assert_array_equal(geometry.layer_image.image, as_matrix(group["steps"][2]))
    geometry.step.setValue(1)
    np.testing.assert_array_equal(geometry.layer_image.image, as_matrix(group["steps"][0]))
    cos = as_matrix(group["steps"][0])
    assert f"layer {group['layers'][0]} × layer {group['layers'][1]}" in (
        geometry.hover_text("layers", 0, 1))
    assert f"cosine {cos[0, 1]:+.4f}" in geometry.hover_text("layers", 0, 1)


def test_without_the_analyses_each_tab_says_how_to_get_it(
        qtbot: Any, lens: QtLensPanel, geometry: QtGeometryPanel,
        record: dict[str, Any]) -> None:
    plain = {k: v for k, v in record.items() if k != "analysis"}
    lens.set_record(plain)
    geometry.set_record(plain)
    assert lens.message.isVisible() and not lens.splitter.isVisible()
    assert "tick Lens under Analyses" in lens.message.text()
    assert "--analyze lens" in lens.message.text()
    assert geometry.message.isVisible() and not geometry.graphics.isVisible()
    assert "--analyze geometry" in geometry.message.text()
    lens.set_record(record)  # and back
    assert not lens.message.isVisible() and lens.grid.rowCount() == len(_layers(record))


def test_the_analyses_reach_the_run_fill_the_tabs_and_are_saved(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import ctxpatch.core.analysis as analysis

    threads: list[bool] = []  # per call of analysis_section: on the GUI (main) thread?
    real = analysis.analysis_section

    def watched(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(analysis, "analysis_section", watched)
    w = open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.",
                    "Where does Alice live?", tokens=2)
    assert not any(box.isChecked() for box in w.model_panel.analyses.values())  # off by default
    assert not w.lens.message.isHidden()
    w.model_panel.analyses["lens"].setChecked(True)
    w.model_panel.analyses["geometry"].setChecked(True)
    assert run_to_end(qtbot, w) == "completed", w.last_error
    assert sorted(w.state.started.settings["analyze"]) == ["geometry", "lens"]  # the RunSpec's
    record = w.current_record()
    assert set(record["analysis"]) == {"lens", "geometry"}
    assert threads == [False]  # computed once, on the worker: never on the GUI thread
    assert w.lens.grid.rowCount() == 4 and w.lens.grid.columnCount() == 2
    assert w.lens.cell(0, 0).text() == visible(_total(record, 0, 0)["promoted"][0][0])
    assert w.geometry.selected_name() in record["analysis"]["geometry"]["params"]
    assert w.save_session(str(tmp_path / "s.json"))

    # settings round trip: a new window reads the ticks back
    w.model_panel.analyses["lens"].setChecked(False)
    w.save_settings()
    again = open_window(keep, settings, tiny_model_dir)
    assert not again.model_panel.analyses["lens"].isChecked()
    assert again.model_panel.analyses["geometry"].isChecked()
    assert again.model_panel.spec_options()["analyze"] == ["geometry"]

    # a session reopens the tabs from the record alone, with no model
    assert again.open_session(str(tmp_path / "s.json")) and again.model is None
    assert again.lens.grid.rowCount() == 4 and again.lens.message.isHidden()
    assert again.lens.cell(1, 3).text() == visible(_total(record, 1, 3)["promoted"][0][0])
    np.testing.assert_array_equal(again.geometry.token_image.image, w.geometry.token_image.image)

    # a new run without the analyses empties the tabs
    w.model_panel.analyses["geometry"].setChecked(False)
    assert run_to_end(qtbot, w) == "completed", w.last_error
    assert "analysis" not in w.current_record()
    assert not w.lens.message.isHidden() and w.lens.grid.rowCount() == 0
    assert not w.geometry.message.isHidden() and w.geometry.geometry is None


def test_a_bad_analyses_setting_is_left_out(qtbot: Any, keep: Any, settings: Any,
                                            caplog: pytest.LogCaptureFixture) -> None:
    settings.setValue("panels/model", json.dumps({"model": "demo", "analyze": ["lens", "x"]}))
    with caplog.at_level(logging.WARNING, logger="ctxpatch"):
        w = open_window(keep, settings, "demo")
    assert not any(box.isChecked() for box in w.model_panel.analyses.values())
    assert "analyze" in caplog.text
