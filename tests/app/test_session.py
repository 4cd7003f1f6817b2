"""Sessions: save and reopen without recomputing, the run history, an old schema, a damaged
file, and the autosave offered back after a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.main_window import MainWindow
from app.session import autosave_path, load_session
from core.errors import UserError

FIXTURE = Path(__file__).parent / "fixtures" / "session_v0.json"


@pytest.fixture
def fresh(qtbot: Any, keep: Any, settings: Any) -> Any:
    def make(**kw: Any) -> MainWindow:
        w = MainWindow(settings=settings, autoload=False, **kw)
        keep(w)
        w.show()
        return w
    return make


def _run(qtbot: Any, w: MainWindow, tokens: int, method: str = "direct") -> None:
    w.input_panel.max_tokens.setValue(tokens)
    w.model_panel.method.setCurrentText(method)
    with qtbot.waitSignal(w.run_finished, timeout=60_000) as blocker:
        w.start_run()
    assert blocker.args == ["completed"], w.last_error


def test_save_reopen_and_reexport_without_recomputing(qtbot: Any, fresh: Any, tiny_model_dir: str,
                                                       tmp_path: Path) -> None:
    w = fresh(model=tiny_model_dir)
    w.input_panel.context.setPlainText("Alice lives in Paris.")
    w.input_panel.query.setPlainText("Where does Alice live?")
    _run(qtbot, w, 3)
    _run(qtbot, w, 4, "stable")
    assert len(w.history) == 2 and w.history_panel.runs.count() == 2
    panes = w.generation.pane_texts()
    assert w.save_session(str(tmp_path / "s.json"))
    assert w.export("json", str(tmp_path / "a.json"))

    again = fresh()
    assert again.open_session(str(tmp_path / "s.json"))
    assert again.model is None  # nothing was loaded or recomputed
    assert len(again.state.steps) == 4 and again.generation.pane_texts() == panes
    assert again.input_panel.query.toPlainText() == "Where does Alice live?"
    assert again.model_panel.method.currentText() == "stable"
    assert again.export("json", str(tmp_path / "b.json"))
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["steps"] == b["steps"] and a["summary"] == b["summary"] and a["prompt"] == b["prompt"]
    again.history_panel.chosen.emit(0)  # the first run, from the history
    assert len(again.state.steps) == 3 and again.controls.rows()
    again.plots.overlay.setChecked(True)  # compare runs: the other run's curves, 3 metrics
    assert again.plots.overlay_count() == 3
    table = again.plots.comparison.text()  # Figure 4 in numbers: this run and the other one
    assert again.plots.comparison.isVisible() and table.count("<tr>") == 3 and "4/4" in table


def test_an_old_schema_session_opens(fresh: Any) -> None:
    w = fresh()
    assert w.open_session(str(FIXTURE)), w.last_error
    assert len(w.state.steps) == 3 and len(w.history) == 1
    assert w.input_panel.context.toPlainText() == "Alice lives in Paris."
    assert "Alice lives in Paris." in w.generation.pane_texts()[0]


def test_a_damaged_session_is_one_clear_error_and_harms_nothing(fresh: Any, tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(FIXTURE.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(FIXTURE.read_text()[:5000])  # truncated
    w = fresh()
    w.input_panel.query.setPlainText("my unsaved question")
    assert not w.open_session(str(bad))
    assert "damaged" in w.last_error and "\n" not in w.last_error and w.banner.isVisible()
    assert w.input_panel.query.toPlainText() == "my unsaved question"
    assert good.read_text() == FIXTURE.read_text() and w.open_session(str(good))
    with pytest.raises(UserError, match="schema 7"):
        bad.write_text(json.dumps({"format": "ctxpatch-session", "schema_version": 7, "runs": []}))
        load_session(bad)


def test_the_autosave_is_offered_back_after_a_crash(qtbot: Any, fresh: Any, tiny_model_dir: str) -> None:
    w = fresh(model=tiny_model_dir)
    w.input_panel.context.setPlainText("Alice lives in Paris.")
    w.input_panel.query.setPlainText("Where?")
    _run(qtbot, w, 3)
    assert autosave_path().is_file()  # written after the run; a crash would leave it
    crashed = autosave_path().read_text()
    w.close()
    assert not autosave_path().is_file()  # a clean exit removes it
    autosave_path().write_text(crashed)  # as if the process had died
    again = fresh()
    again.offer_autosave()
    assert again.notice.isVisible() and "did not close cleanly" in again.notice.label.text()
    again.notice.button.click()
    assert len(again.state.steps) == 3 and not again.notice.isVisible()
    again.close()
