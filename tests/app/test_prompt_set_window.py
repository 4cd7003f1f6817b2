"""File > Run a prompt set… (`app.prompt_set_dialog`): the set's grid on the worker thread with
progress, its statistics in the dialog and its report; Cancel keeps the finished runs and Run
resumes them; a bad set is one line in the dialog."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROWS = [{"id": "alice", "context": "Alice lives in Paris.", "query": "Where does Alice live?"},
        {"id": "caps", "context": "France: Paris. Japan:", "query": "Tokyo. Italy:"}]


def _dialog(qtbot: Any, model: str, tmp_path: Path, rows: list[dict[str, Any]] = ROWS) -> Any:
    from ctxpatch.app.prompt_set_dialog import PromptSetDialog

    prompts = tmp_path / "set.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    d = PromptSetDialog(None, model=model, device="cpu")
    qtbot.addWidget(d)
    d.prompts.setText(str(prompts))
    d.out.setText(str(tmp_path / "out"))
    d.tokens.setValue(2)
    d.dtypes[1]["bfloat16"].setChecked(False)
    d.show()
    return d


def test_a_set_runs_from_the_window_with_progress_and_its_statistics(
        qtbot: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    d = _dialog(qtbot, tiny_model_dir, tmp_path)
    seen: list[tuple[int, int]] = []
    d.progress.valueChanged.connect(lambda v: seen.append((v, d.progress.maximum())))
    with qtbot.waitSignal(d.set_finished, timeout=240_000) as done:
        d.start()
    assert done.args == ["completed"], d.status.text()
    assert seen[-1] == (4, 4)  # 2 prompts x 2 methods
    assert d.table.rowCount() == 2
    assert [d.table.item(i, 0).text() for i in range(2)] == ["float32-direct", "float32-stable"]
    assert d.table.item(0, 2).text().startswith("100.0% [100.0%, 100.0%]")
    assert d.report is not None and Path(d.report).is_file() and d.report_button.isEnabled()
    shot = Path(os.environ.get("CTXPATCH_SHOT_DIR", tmp_path))  # (to look at it)
    d.grab().save(str(shot / "prompt_set_dialog.png"))


def test_cancel_keeps_the_finished_runs_and_run_resumes(qtbot: Any, tiny_model_dir: str,
                                                        tmp_path: Path) -> None:
    d = _dialog(qtbot, tiny_model_dir, tmp_path)

    def cancel_after_first(value: int) -> None:
        if value >= 1:
            d.cancel()

    d.progress.valueChanged.connect(cancel_after_first)
    with qtbot.waitSignal(d.set_finished, timeout=240_000) as done:
        d.start()
    assert done.args == ["cancelled"], d.status.text()
    kept = sorted(p.stem for p in (tmp_path / "out" / "runs").glob("*.json"))
    assert 1 <= len(kept) < 4 and "Run again resumes" in d.status.text()
    d.progress.valueChanged.disconnect(cancel_after_first)
    with qtbot.waitSignal(d.set_finished, timeout=240_000) as done:
        d.start()
    assert done.args == ["completed"]
    log = d.log.toPlainText()
    assert all(f"{name}: reusing" in log for name in kept), log
    assert len(list((tmp_path / "out" / "runs").glob("*.json"))) == 4


def test_a_bad_set_is_one_line_in_the_dialog(qtbot: Any, tiny_model_dir: str,
                                             tmp_path: Path) -> None:
    d = _dialog(qtbot, tiny_model_dir, tmp_path, [{"query": "a"}, {"context": "no query"}])
    with qtbot.waitSignal(d.set_finished, timeout=10_000) as done:
        d.start()
    assert done.args == ["failed"]
    assert "set.jsonl, line 2: no query" in d.status.text()
    assert not (tmp_path / "out").exists()


def test_the_window_s_file_menu_opens_it(qtbot: Any, keep: Any, settings: Any,
                                         tiny_model_dir: str) -> None:
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(model=tiny_model_dir, settings=settings, autoload=False)
    keep(w)
    file_menu = w.menuBar().actions()[0].menu()
    action = next(a for a in file_menu.actions() if "prompt se" in a.text())
    assert action.shortcut().toString() == "Ctrl+Shift+P"
    d = w.run_prompt_set()
    assert d.isVisible() and d.model == tiny_model_dir
    d.close()


def test_esc_while_a_set_runs_cancels_it_and_the_window_keeps_one_dialog(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    """Esc (QDialog.reject) during a set cancels it like Cancel: the dialog, deleted on close,
    used to go with its running thread, and Qt aborted the process. The window opens one
    dialog at a time and waits for its set when it closes."""
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(model=tiny_model_dir, settings=settings, autoload=False)
    keep(w)
    d = w.run_prompt_set()
    assert w.run_prompt_set() is d
    prompts = tmp_path / "set.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    d.prompts.setText(str(prompts))
    d.out.setText(str(tmp_path / "out"))
    d.tokens.setValue(2)
    d.dtypes[1]["bfloat16"].setChecked(False)
    with qtbot.waitSignal(d.set_finished, timeout=240_000) as done:
        d.start()
        d.reject()
        assert d.isVisible() and d.worker is not None  # (not closed under its thread)
    assert done.args == ["cancelled"], d.status.text()
    w.close()  # (waits for any set; nothing runs now)
