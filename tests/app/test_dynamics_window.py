"""The Dynamics tab, the report's "Context dynamics" section and sessions, from real dynamics
results of tiny float64 models (ANALYSIS.md A5).

The tab's colours, heatmap and curves are checked against numbers recomputed here from the
record's raw increments, norms and lens logits (not against the tab's own helpers); the window
runs the dynamics on its worker with the inputs typed, and its result equals core's on the same
model; cancel leaves the tab as it was; a session keeps the numbers and reopens them without a
job; a report holds the section's numbers, and a record without dynamics gives no section.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ctxpatch.app.panels.dynamics_panel import NO_DYNAMICS, QtDynamicsPanel
from PySide6.QtCore import Qt
from windows import open_window

CONTEXT = "Al is."
QUERY = "Who?"


@pytest.fixture(scope="module")
def loaded() -> Any:
    from tiny import tiny_config, tiny_loaded

    return tiny_loaded(tiny_config("llama"))  # float64


@pytest.fixture(scope="module")
def record(loaded: Any) -> dict[str, Any]:
    """A tiny Llama's dynamics, as JSON gives it back (what a session holds)."""
    from ctxpatch.core.dynamics import dynamics
    from ctxpatch.core.spec import RunSpec

    spec = RunSpec(model=loaded.spec, dtype="float64", context=CONTEXT, query=QUERY)
    return json.loads(json.dumps(dynamics(loaded, spec).to_dict()))


@pytest.fixture
def panel(qtbot: Any, record: dict[str, Any]) -> QtDynamicsPanel:
    p = QtDynamicsPanel()
    qtbot.addWidget(p)
    p.resize(1000, 450)
    p.show()
    p.set_record(record)
    return p


def _increments(record: dict[str, Any], layer: str | None = None) -> np.ndarray:
    """(n,) the record's increments of one layer, or summed over the layers."""
    keys = [layer] if layer is not None else list(record["layers"])
    return np.sum([record["layers"][k]["increment"] for k in keys], axis=0)


def _ranks_agree(share: np.ndarray, lightness: list[int]) -> None:
    """A larger share is never lighter (the colour blends towards vermillion with the share)."""
    for i in range(len(share)):
        for j in range(len(share)):
            if share[i] > share[j] * (1 + 1e-6):
                assert lightness[i] <= lightness[j], (i, j, share, lightness)
    assert len(set(lightness)) > 1  # (they differ: a colouring, not one colour)


def test_the_colours_order_tokens_as_the_shares(panel: QtDynamicsPanel,
                                                record: dict[str, Any]) -> None:
    n = len(record["context_ids"])
    share = _increments(record) / _increments(record).sum()
    np.testing.assert_allclose(share, record["attribution"], rtol=1e-12)
    _ranks_agree(share, [c.lightness() for c in panel.token_colours()])
    top = int(np.argmax(share))
    assert f"{100 * share[top]:.1f}%" in panel.token_text(top)
    # one layer chosen: that layer's own shares colour the text
    layer = next(iter(record["layers"]))
    panel.layer.setCurrentText(f"layer {layer}")
    own = _increments(record, layer) / _increments(record, layer).sum()
    assert not np.allclose(own, share)  # (a different order to follow)
    _ranks_agree(own, [c.lightness() for c in panel.token_colours()])
    # the lens colouring: red where the token raised the answer's logit, blue where it lowered
    panel.layer.setCurrentIndex(0)
    panel.colouring.setCurrentIndex(1)
    lens = np.array(record["lens_logit"], dtype=float)
    assert len(panel.token_colours()) == n
    for value, colour in zip(lens, panel.token_colours(), strict=True):
        if abs(value) > 1e-3 * np.abs(lens).max():
            assert (colour.red() > colour.blue()) == (value > 0), (value, colour.name())
    # the text holds every token, in order
    text = panel.text.toPlainText().replace("↵\n", "\n").replace("↵", "\n")
    assert text == "".join(record["context_tokens"])


def test_the_plots_hold_the_record(qtbot: Any, panel: QtDynamicsPanel,
                                   record: dict[str, Any]) -> None:
    layers = sorted(record["layers"], key=int)
    rows = np.array([record["layers"][k]["increment"] for k in layers])
    np.testing.assert_allclose(panel.heatmap(), rows / rows.sum(1, keepdims=True), rtol=1e-9)
    x, y = panel.norm_curve.getData()
    np.testing.assert_allclose(y, np.sum([record["layers"][k]["norm"] for k in layers], 0))
    assert list(x) == list(range(len(record["context_ids"]) + 1)) and y[0] == 0
    np.testing.assert_allclose(panel.increment_curve.getData()[1], _increments(record))
    np.testing.assert_allclose(panel.lens_bars.opts["height"], record["lens_logit"])
    panel.layer.setCurrentText(f"layer {layers[-1]}")
    np.testing.assert_allclose(panel.norm_curve.getData()[1], record["layers"][layers[-1]]["norm"])
    np.testing.assert_allclose(panel.lens_bars.opts["height"],
                               record["layers"][layers[-1]]["lens_logit_increment"])
    assert f"{record['layers'][layers[0]]['increment'][1]:.4g}" in panel.cell_text(0, 1)
    panel.text.setFocus()
    qtbot.keyClick(panel.text, Qt.Key.Key_BracketLeft)  # [: the previous layer
    assert panel.layer.currentText() == f"layer {layers[-2]}"
    qtbot.keyClick(panel.text, Qt.Key.Key_C)  # C: the other colouring
    assert panel.colouring.currentIndex() == 1
    panel.select(2)
    assert all(line.isVisible() and line.value() == 3 for line in panel.cursors)
    panel.set_record(None)
    assert panel.message.text() == NO_DYNAMICS and not panel.splitter.isVisible()


def test_the_report_section_holds_the_numbers(loaded: Any, record: dict[str, Any],
                                              tmp_path: Path) -> None:
    from ctxpatch.app.report import write_report
    from ctxpatch.core.prompt import build_prompt
    from ctxpatch.core.record import read_record
    from ctxpatch.core.runs import run_comparison
    from ctxpatch.core.spec import RunSpec

    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    run = read_record(json.loads(json.dumps(run_comparison(
        loaded, prompt, RunSpec(dtype="float64", max_new_tokens=1)).record)))
    with_it = write_report(run, tmp_path / "r.html", tmp_path / "r_plots", dynamics=record)
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Context dynamics</h2>" in page
    share = _increments(record) / _increments(record).sum()
    for i, token in enumerate(record["context_tokens"]):
        assert f"<td>{100 * share[i]:.2f}%</td><td>{_increments(record)[i]:.4g}</td>" in page
        assert f"<td>{record['lens_logit'][i]:+.4g}</td>" in page, token
    names = {p.name for p in with_it[1:]}
    assert {f"dynamics-{k}.{e}" for k in ("increments", "curves", "lens")
            for e in ("png", "svg")} <= names
    # a run without dynamics: no section, no figure
    without = write_report(run, tmp_path / "plain.html", tmp_path / "plain_plots")
    assert "Context dynamics" not in (tmp_path / "plain.html").read_text()
    assert not any(p.name.startswith("dynamics-") for p in without[1:])


def test_the_window_runs_cancels_and_keeps_it(qtbot: Any, keep: Any, settings: Any,
                                              tiny_model_dir: str, tmp_path: Path) -> None:
    from ctxpatch.core.dynamics import dynamics
    from ctxpatch.core.spec import RunSpec
    from PySide6.QtGui import QAction, QKeySequence

    w = open_window(keep, settings, tiny_model_dir, "", QUERY)
    actions = {a.shortcut().toString(): a for a in w.findChildren(QAction)}
    actions[QKeySequence("Ctrl+6").toString()].trigger()  # View > Context dynamics
    assert w.tabs.currentWidget() is w.dynamics
    created: list[Any] = []
    w.worker_created.connect(created.append)
    actions[QKeySequence("Ctrl+D").toString()].trigger()  # each refusal: one line, no job
    assert created == [] and "context is empty" in w.last_error
    w.input_panel.context.setPlainText(CONTEXT)
    w.input_panel.image_path = "cat.png"  # (as if a picture had been added)
    w.run_dynamics()
    assert created == [] and "remove the picture" in w.last_error
    w.input_panel.image_path = ""
    w.run_dynamics()
    assert created == [] and "no model loaded" in w.last_error and "\n" not in w.last_error
    w.model_panel.dtype.setCurrentText("float64")
    w.load_model()
    qtbot.waitUntil(lambda: not w.busy and w.model is not None, timeout=60_000)
    w.model_panel.dtype.setCurrentText("float32")  # another precision chosen than loaded
    created.clear()
    w.run_dynamics()
    assert created == [] and "not the one chosen" in w.last_error
    w.model_panel.dtype.setCurrentText("float64")
    w.run_dynamics()
    assert w.tabs.currentWidget() is w.dynamics
    qtbot.waitUntil(lambda: not w.busy, timeout=120_000)
    assert w.status_label.text() == "Context dynamics done", w.last_error
    shown = w.dynamics.result
    assert shown is not None and shown.context_tokens[0] == "A"
    expected = dynamics(w.model.handle, RunSpec(model=tiny_model_dir, dtype="float64",
                                                context=CONTEXT, query=QUERY))
    np.testing.assert_allclose(shown.norm, expected.norm, rtol=1e-9)
    np.testing.assert_allclose(shown.attribution, expected.attribution, rtol=1e-9)
    first, heat = w.dynamics.record, w.dynamics.heatmap().copy()

    # cancel at the first prefix: the tab keeps what it showed
    w.input_panel.context.setPlainText(CONTEXT + " Bo is.")

    def stop_early(worker: Any) -> None:
        worker.progress.connect(lambda m, done, total: done >= 1 and worker.requestInterruption(),
                                Qt.ConnectionType.DirectConnection)

    w.worker_created.connect(stop_early)
    w.run_dynamics()
    qtbot.waitUntil(lambda: not w.busy, timeout=60_000)
    w.worker_created.disconnect(stop_early)
    assert "cancelled" in w.status_label.text()
    assert w.dynamics.record is first
    np.testing.assert_array_equal(w.dynamics.heatmap(), heat)

    # a session keeps the numbers, and reopens them without a job
    path = tmp_path / "s.json"
    assert w.save_session(str(path))
    data = json.loads(path.read_text())
    assert data["dynamics"]["attribution"] == first["attribution"]
    other = open_window(keep, settings, tiny_model_dir)
    jobs: list[Any] = []
    other.worker_created.connect(jobs.append)
    assert other.open_session(str(path))
    assert jobs == [] and other.dynamics.record == first
    np.testing.assert_array_equal(other.dynamics.result.norm, shown.norm)
    np.testing.assert_array_equal(other.dynamics.heatmap(), heat)
    # its report: the dynamics alone (no run yet), from the same record
    assert other.export("report", str(tmp_path / "d.html")), other.last_error
    page = (tmp_path / "d.html").read_text()
    assert "<h2>Context dynamics</h2>" in page
    assert f"{100 * shown.attribution[0]:.2f}%" in page
    # an older session without dynamics opens, the tab empty; a damaged one says so in a line
    del data["dynamics"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert other.open_session(str(tmp_path / "old.json"))
    assert other.dynamics.record is None and not other.dynamics.message.isHidden()
    data["dynamics"] = {**first, "layers": {k: {**v, "norm": v["norm"][:-1]}
                                            for k, v in first["layers"].items()}}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    assert not other.open_session(str(tmp_path / "bad.json"))
    assert "dynamics" in other.last_error and "norm" in other.last_error
    assert "\n" not in other.last_error and jobs == []


def test_the_command_line_writes_the_report(tiny_model_dir: str, tmp_path: Path,
                                            capsys: Any) -> None:
    from ctxpatch.app.cli import main

    out = tmp_path / "d.pdf"
    code = main(["dynamics", "--model", tiny_model_dir, "--context", "Al.", "--query", QUERY,
                 "--json", str(tmp_path / "d.json"), "--report", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert out.read_bytes().startswith(b"%PDF")
    assert len(list((tmp_path / "d_plots").iterdir())) == 6
    # an output that is an input: refused before any work, nothing written
    before = sorted(p.name for p in Path(tiny_model_dir).iterdir())
    code = main(["dynamics", "--model", tiny_model_dir, "--context", "Al.", "--query", QUERY,
                 "--report", str(Path(tiny_model_dir) / "config.json"), "--quiet"])
    assert code == 2 and "would overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in Path(tiny_model_dir).iterdir()) == before


def test_a_dynamics_report_of_the_window_keeps_its_compile_result(
        loaded: Any, record: dict[str, Any], tmp_path: Path) -> None:
    """The window with dynamics and a compile result but no run: Ctrl+E writes the dynamics
    report, with the compile section too (it was left out)."""
    from ctxpatch.app.compile_view import number
    from ctxpatch.app.report import write_dynamics_report
    from ctxpatch.core.compile import compile_context

    compiled = compile_context(loaded, CONTEXT, [QUERY], ["Where?"], rank=2, max_new_tokens=1)
    compiled.evaluate()
    result = json.loads(json.dumps(compiled.to_dict()))
    written = write_dynamics_report(record, tmp_path / "d.html", tmp_path / "d_plots",
                                    compiled=result)
    page = (tmp_path / "d.html").read_text()
    assert "<h2>Context dynamics</h2>" in page and "Compiled context" in page
    assert f"<td>{number(result['held_out'][0]['retained'])}</td>" in page
    assert any(p.name.startswith("dynamics-") for p in written[1:])
    write_dynamics_report(record, tmp_path / "alone.html")
    assert "Compiled context" not in (tmp_path / "alone.html").read_text()
