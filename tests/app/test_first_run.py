"""Issue 20, the first ten minutes: a fresh profile's first Run succeeds with no typing (the
paper's Mars prompt, absorb all), and error banners clear on the next success or a click."""

from __future__ import annotations

from typing import Any

from windows import run_to_end


def _fresh(keep: Any, settings: Any, model: str) -> Any:
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(model=model, settings=settings, autoload=False)
    keep(w)
    w.show()
    return w


def test_a_fresh_profile_runs_on_the_first_click(qtbot, keep, settings, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    w = _fresh(keep, settings, tiny_model_dir)
    assert "weather forecast for Mars" in w.input_panel.query.toPlainText()
    assert w.input_panel.context.toPlainText() == ""
    assert w.model_panel.absorb.currentText() == "all"
    assert run_to_end(qtbot, w, timeout=120_000) == "completed"
    assert w.state.steps and all(s.patched.match for s in w.state.steps)
    assert not w.banner.isVisible()


def test_the_user_s_last_inputs_win_over_the_defaults(qtbot, keep, settings,  # type: ignore[no-untyped-def]
                                                      tiny_model_dir) -> None:
    w = _fresh(keep, settings, tiny_model_dir)
    w.input_panel.query.setPlainText("Where?")
    w.input_panel.context.setPlainText("Alice lives in Paris.")
    w.model_panel.absorb.setCurrentText("context")
    w.save_settings()
    again = _fresh(keep, settings, tiny_model_dir)
    assert again.input_panel.query.toPlainText() == "Where?"
    assert again.model_panel.absorb.currentText() == "context"


def test_a_banner_clears_on_the_next_success_and_on_dismiss(qtbot, keep, settings,  # type: ignore[no-untyped-def]
                                                           tiny_model_dir) -> None:
    w = _fresh(keep, settings, tiny_model_dir)
    w.show_error("something went wrong")
    assert w.banner.isVisible()
    assert run_to_end(qtbot, w, timeout=120_000) == "completed"
    assert not w.banner.isVisible()
    w.show_error("again")
    from PySide6.QtWidgets import QToolButton

    w.banner.findChild(QToolButton).click()
    assert not w.banner.isVisible()


def test_file_dialogs_remember_their_folder(qtbot, keep, settings, tiny_model_dir, tmp_path,  # type: ignore[no-untyped-def]
                                            monkeypatch) -> None:
    """Each kind of dialog opens where the last one of its kind was used (across windows)."""
    from PySide6.QtWidgets import QFileDialog

    asked: list[str] = []
    folder = tmp_path / "exports"
    folder.mkdir()

    def save(parent, title, start, filters):  # type: ignore[no-untyped-def]
        asked.append(start)
        return str(folder / f"run{len(asked)}.json"), filters

    monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(save))
    w = _fresh(keep, settings, tiny_model_dir)
    assert run_to_end(qtbot, w, timeout=120_000) == "completed"
    assert w.export("json") and w.export("json")
    assert asked[0] == "ctxpatch-run.json" or not asked[0].startswith(str(folder))
    assert asked[1] == str(folder / "ctxpatch-run.json")
    assert (folder / "run2.json").is_file()
