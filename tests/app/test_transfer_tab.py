"""The Transfer tab (ANALYSIS.md A3), from a real tiny run's record: the heatmap is the record's
R (rows = source, columns = target) on a fixed [-1, 1], an R below -1 drawn at -1 and said so,
the hover text and the curves carry the record's numbers, a run whose diagonal cannot reproduce
it says so in one line, a run without the transfer says how to get it; in the window: the
Transfer checkbox reaches the run, the transfer's passes drive the progress bar, a cancel during
the transfer leaves no partial analysis and the window usable, and a session reopens the tab
without recomputing."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ctxpatch.app.panels.lens_panel import visible
from ctxpatch.app.panels.transfer_panel import NO_TRANSFER, NOT_FINISHED, QtTransferPanel
from PySide6.QtCore import QObject, Qt, Slot
from windows import open_window, run_to_end

TOKENS = 3


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    """A tiny float64 Llama's run with the transfer, as JSON gives it back (what a session
    holds)."""
    from ctxpatch.core.prompt import build_prompt
    from ctxpatch.core.runs import run_comparison
    from ctxpatch.core.spec import RunSpec
    from tiny import tiny_config, tiny_loaded

    loaded = tiny_loaded(tiny_config("llama"))
    prompt = build_prompt(loaded.tokenizer, "Alice lives in Paris.", "Where does Alice live?")
    run = run_comparison(loaded, prompt, RunSpec(max_new_tokens=TOKENS,
                                                 analyze=frozenset({"transfer"})))
    return json.loads(json.dumps(run.record))


@pytest.fixture
def panel(qtbot: Any, record: dict[str, Any]) -> QtTransferPanel:
    p = QtTransferPanel()
    qtbot.addWidget(p)
    p.resize(1000, 450)
    p.show()
    p.set_record(record)
    return p


def _r(record: dict[str, Any]) -> np.ndarray:
    return np.array(record["analysis"]["transfer"]["retained"], dtype=float)


def test_the_heatmap_is_the_records_retained_effect(panel: QtTransferPanel,
                                                     record: dict[str, Any]) -> None:
    r = _r(record)
    assert r.shape == (TOKENS, TOKENS)
    # the ground truth of a float64 run: each step's own patches reproduce it (R = 1), the
    # others do not (the test can tell a transposed or shifted matrix)
    np.testing.assert_allclose(np.diagonal(r), 1.0, atol=1e-6)
    assert np.all(r[~np.eye(TOKENS, dtype=bool)] < 0.999)
    assert np.all(r >= -1)  # (nothing clipped in this run)
    np.testing.assert_array_equal(panel.image.image, r)
    assert tuple(panel.image.levels) == (-1.0, 1.0)  # the fixed scale, centred on 0
    assert panel.caveat.isHidden() and panel.message.isHidden()
    assert "below R" not in panel.summary.text()
    # rows = source, columns = target: the cell (s, t) is drawn at x = t + 1, y = s + 1
    s, t = 0, 2
    rect = panel.image.mapRectToParent(panel.image.boundingRect())
    assert (rect.left(), rect.top(), rect.width(), rect.height()) == (0.5, 0.5, TOKENS, TOKENS)
    assert panel.image.image[s, t] == r[s, t]
    # the axes carry the tokens
    tokens = [s_["baseline_token"]["text"] for s_ in record["steps"]]
    assert panel.matrix_plot.getAxis("bottom").labels == panel.matrix_plot.getAxis("left").labels
    assert len(panel.matrix_plot.getAxis("left").labels) == TOKENS
    assert panel.tokens == [visible(x) for x in tokens]


def test_the_hover_and_the_curves_carry_the_records_numbers(panel: QtTransferPanel,
                                                            record: dict[str, Any]) -> None:
    section = record["analysis"]["transfer"]
    tokens = [visible(s["baseline_token"]["text"]) for s in record["steps"]]
    text = panel.hover_text(0, 2)
    assert text.startswith(f"patches of token 1 {tokens[0]!r} at token 3 {tokens[2]!r}")
    assert f"R {section['retained'][0][2]:+.4g}" in text
    assert f"L∞ {section['linf'][0][2]:.4g}" in text
    assert ("matches" if section["match"][0][2] else "does not match") in text
    assert panel.hover_text(1, 1).count("token matches") == 1  # the diagonal matches
    assert panel.hover_text(TOKENS, 0) == "" and panel.hover_text(0, -1) == ""
    x, y = panel.mean_curve.getData()
    np.testing.assert_array_equal(x, np.arange(1, TOKENS + 1))
    np.testing.assert_allclose(y, section["mean"])
    x, y = panel.previous_curve.getData()  # (none at the first token)
    np.testing.assert_array_equal(x, np.arange(2, TOKENS + 1))
    np.testing.assert_allclose(y, [section["retained"][t - 1][t] for t in range(1, TOKENS)])
    x, y = panel.diagonal_curve.getData()
    np.testing.assert_allclose(y, np.diagonal(_r(record)))
    assert f"mean patch R {section['mean'][1]:+.4g}" in panel.curve_text(1)
    # the summary's means, computed here from the record
    r = _r(record)
    off = r[~np.eye(TOKENS, dtype=bool)].mean()
    summary = panel.summary.text()
    assert f"another token's <b>{off:.3g}</b>" in summary
    assert f"the mean patch <b>{np.mean(section['mean']):.3g}</b>" in summary
    assert f"own patches <b>{np.diagonal(r).mean():.3g}</b> ({TOKENS}/{TOKENS} match)" in summary


def test_an_r_below_minus_one_is_drawn_at_minus_one_and_said(qtbot: Any,
                                                              record: dict[str, Any]) -> None:
    changed = copy.deepcopy(record)
    changed["analysis"]["transfer"]["retained"][2][0] = -5.5
    changed["analysis"]["transfer"]["mean"][1] = -2.0
    p = QtTransferPanel()
    qtbot.addWidget(p)
    p.set_record(changed)
    assert p.image.image[2, 0] == -1.0 and p.arrays["retained"][2, 0] == -5.5
    np.testing.assert_array_equal(np.delete(p.image.image.ravel(), 6),
                                  np.delete(_r(record).ravel(), 6))
    assert "1 entry lies below R = -1 (lowest -5.5) and is drawn at -1" in p.summary.text()
    assert "R -5.5 (drawn at −1)" in p.hover_text(2, 0)
    assert "drawn at" not in p.hover_text(0, 0)
    assert p.mean_curve.getData()[1][1] == -1.0  # the curves clip the same way


def test_a_diagonal_that_cannot_reproduce_the_run_says_so(qtbot: Any,
                                                          record: dict[str, Any]) -> None:
    p = QtTransferPanel()
    qtbot.addWidget(p)
    p.show()
    # method direct on a post-norm-scale model (the demo's Gemma), its diagonal off
    gemma = copy.deepcopy(record)
    gemma["settings"]["method"] = "direct"
    for plan in gemma["controllability"]["plan"]:
        plan["control"] = "scale"
    section = gemma["analysis"]["transfer"]
    section["retained"][1][1], section["match"][1][1] = -0.2, False
    p.set_record(gemma)
    assert p.caveat.isVisible() and "\n" not in p.caveat.text()
    assert p.caveat.text().startswith("Not a transfer measurement: method direct")
    assert "2/3 tokens match" in p.caveat.text() and "method stable" in p.caveat.text()
    assert p.graphics.isVisible()  # drawn, under the line that says what it is not
    # the same with method stable: the diagonal off, but not for that reason
    gemma["settings"]["method"] = "stable"
    p.set_record(gemma)
    assert p.caveat.text().startswith("The diagonal (each step's own patches) does not")
    # method direct on that family with a diagonal that does reproduce: a milder line
    p.set_record({**record, "settings": {**record["settings"], "method": "direct"},
                  "controllability": gemma["controllability"]})
    assert p.caveat.text().startswith("Method direct on a post-norm-scale model")
    assert "the diagonal reproduces the run" in p.caveat.text()
    p.set_record(record)  # the Llama run as it is: no line
    assert p.caveat.isHidden() and p.caveat.text() == ""


def test_without_the_transfer_the_tab_says_how_to_get_it(panel: QtTransferPanel,
                                                         record: dict[str, Any]) -> None:
    plain = {k: v for k, v in record.items() if k != "analysis"}
    plain["settings"] = {**record["settings"], "analyze": []}
    panel.set_record(plain)
    assert panel.message.isVisible() and not panel.graphics.isVisible()
    assert panel.message.text() == NO_TRANSFER
    assert "tick Transfer under Analyses" in NO_TRANSFER and "--analyze transfer" in NO_TRANSFER
    cut = {**plain, "settings": record["settings"]}  # asked for, and not there: cancelled
    panel.set_record(cut)
    assert panel.message.text() == NOT_FINISHED and panel.section is None
    panel.set_record(record)  # and back
    assert panel.message.isHidden() and panel.graphics.isVisible()


def _watch(w: Any, cancel_at: str | None = None) -> list[tuple[str, int, int]]:
    """The worker's progress reports; with ``cancel_at``, cancel on the worker thread itself
    as the first report starting so arrives (deterministic: before the next pass), once."""
    seen: list[tuple[str, int, int]] = []
    armed = [cancel_at is not None]

    def created(worker: Any) -> None:
        def report(message: str, done: int, total: int) -> None:
            seen.append((message, done, total))
            if armed[0] and message.startswith(str(cancel_at)):
                armed[0] = False
                worker.requestInterruption()

        worker.progress.connect(report, Qt.ConnectionType.DirectConnection)

    w.worker_created.connect(created)
    return seen


class _Bar(QObject):
    """What the window's progress bar and status line show as each progress report arrives on
    the GUI thread (connected after the window's own slot, so it runs after it)."""

    def __init__(self, w: Any) -> None:
        super().__init__()
        self.w, self.seen = w, []

    @Slot(str, int, int)
    def on_progress(self, message: str, done: int, total: int) -> None:
        self.seen.append((message, self.w.progress.value(), self.w.progress.maximum(),
                          self.w.status_label.text()))


def test_the_window_runs_shows_and_reopens_the_transfer(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Path,
        monkeypatch: Any) -> None:
    w = open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.",
                    "Where does Alice live?", tokens=TOKENS)
    assert "transfer" in w.model_panel.analyses and not w.model_panel.analyses[
        "transfer"].isChecked()
    assert w.transfer.message.text() == NO_TRANSFER
    w.model_panel.analyses["transfer"].setChecked(True)
    seen = _watch(w)
    bar = _Bar(w)
    w.worker_created.connect(lambda worker: worker.progress.connect(bar.on_progress))
    assert run_to_end(qtbot, w) == "completed", w.last_error
    assert w.state.started.settings["analyze"] == ["transfer"]
    passes = [(d, t) for m, d, t in seen if m.startswith("Transfer: pass")]
    assert passes == [(i, TOKENS) for i in range(1, TOKENS + 1)]  # one batched pass per target
    shown = [(value, top, text) for m, value, top, text in bar.seen if m.startswith("Transfer: p")]
    assert shown == [(i, TOKENS, f"Transfer: pass {i} of {TOKENS}") for i in range(1, TOKENS + 1)]
    section = w.current_record()["analysis"]["transfer"]
    r = np.array(section["retained"], dtype=float)
    np.testing.assert_allclose(np.diagonal(r), 1.0, atol=1e-4)  # (the tiny folder: float32)
    np.testing.assert_array_equal(w.transfer.image.image, np.clip(r, -1, 1))
    assert w.transfer.message.isHidden()
    w.tabs.setCurrentIndex(0)
    for action in w.menuBar().actions()[2].menu().actions():
        if action.shortcut().toString() == "Ctrl+7":
            action.trigger()
    assert w.tabs.currentWidget() is w.transfer
    assert w.tabs.tabText(w.tabs.currentIndex()) == "Transfer"
    assert w.save_session(str(tmp_path / "s.json"))

    import ctxpatch.core.analysis
    import ctxpatch.core.transfer

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the transfer was recomputed")

    monkeypatch.setattr(ctxpatch.core.transfer, "transfer", recomputed)
    monkeypatch.setattr(ctxpatch.core.analysis, "analysis_section", recomputed)
    again = open_window(keep, settings, tiny_model_dir)
    assert again.open_session(str(tmp_path / "s.json")) and again.model is None
    assert again.transfer.message.isHidden()
    np.testing.assert_array_equal(again.transfer.image.image, w.transfer.image.image)
    assert again.transfer.summary.text() == w.transfer.summary.text()


def test_a_cancel_during_the_transfer_keeps_no_part_of_it(qtbot: Any, keep: Any, settings: Any,
                                                          tiny_model_dir: str) -> None:
    w = open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.",
                    "Where does Alice live?", tokens=TOKENS)
    w.model_panel.analyses["transfer"].setChecked(True)
    seen = _watch(w, cancel_at="Transfer: pass 1")
    assert run_to_end(qtbot, w) == "cancelled"
    passes = [m for m, _, _ in seen if m.startswith("Transfer: pass")]
    assert passes == [f"Transfer: pass 1 of {TOKENS}"]  # stopped before the second pass
    assert len(w.state.steps) == TOKENS and w.state.transfer is None  # the run is kept whole
    record = w.current_record()
    assert "transfer" not in (record.get("analysis") or {})
    assert w.transfer.message.text() == NOT_FINISHED and w.transfer.section is None
    assert len(w.files.history) == 1  # remembered, without a transfer
    assert "transfer" not in (w.files.history[0].get("analysis") or {})
    # the window stays usable: the same run again completes, with its transfer
    seen.clear()
    assert not w.busy and w.input_panel.run.isEnabled()
    assert run_to_end(qtbot, w) == "completed", w.last_error
    assert w.current_record()["analysis"]["transfer"]["retained"]
    assert w.transfer.message.isHidden()
